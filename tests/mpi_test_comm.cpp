// MPI collectives and DeviceMesh on a real multi-rank job (ctest runs it with mpirun -np 2 and 4;
// every rank runs every test). Without mpirun it still passes as a one-rank job.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "distribution/communicator.h"
#include "distribution/mesh.h"
#include "distribution/nccl.h"

namespace meshtune {
// Test hook in communicator.cpp: lowers the per-call MPI element limit (0 restores it).
void set_max_mpi_count_for_testing(size_t count);

namespace {

// Restores the default chunk limit even when an assertion returns early.
struct ChunkLimit {
  explicit ChunkLimit(size_t count) { set_max_mpi_count_for_testing(count); }
  ~ChunkLimit() { set_max_mpi_count_for_testing(0); }
};

// All ranks' copies of `value`, in rank order.
std::vector<float> gather_one(Communicator& comm, float value) {
  std::vector<float> out(size_t(comm.size()));
  comm.all_gather({&value, 1}, out);
  return out;
}

// The NCCL bootstrap a GPU mesh will use: rank 0's unique id reaches every rank over MPI. NCCL
// makes ids without a GPU, so this runs here; each test's id is new (two calls differ).
TEST(NcclBootstrap, EveryRankGetsRankZerosUniqueId) {
#ifndef MESHTUNE_HAVE_CUDA
  GTEST_SKIP() << "built without the CUDA backend (no NCCL)";
#else
  Communicator& comm = world();
  const std::string id = nccl_unique_id(comm), again = nccl_unique_id(comm);
  ASSERT_EQ(id.size(), kNcclUniqueIdBytes);
  EXPECT_NE(id, std::string(kNcclUniqueIdBytes, '\0'));
  EXPECT_NE(id, again);
  // Every rank's bytes against rank 0's, byte by byte: the per-byte maximum equals the minimum.
  std::vector<float> high(id.size()), low(id.size());
  for (size_t i = 0; i < id.size(); ++i) high[i] = float(uint8_t(id[i])), low[i] = -high[i];
  comm.all_reduce_max(high);
  comm.all_reduce_max(low);
  for (size_t i = 0; i < id.size(); ++i) EXPECT_EQ(high[i], -low[i]) << "byte " << i << " differs between ranks";
#endif
}

TEST(MpiComm, WorldMatchesLauncher) {
  Communicator& comm = world();
  EXPECT_GE(comm.rank(), 0);
  EXPECT_LT(comm.rank(), comm.size());
  if (launched_by_mpirun()) {
    EXPECT_EQ(comm.size(), std::atoi(std::getenv("OMPI_COMM_WORLD_SIZE")));
  } else {
    EXPECT_EQ(comm.size(), 1);
  }
  std::vector<float> ranks = gather_one(comm, float(comm.rank()));
  for (int r = 0; r < comm.size(); ++r) EXPECT_EQ(ranks[size_t(r)], float(r));
}

TEST(MpiComm, AllReduceSumFloat) {
  Communicator& comm = world();
  const int n = comm.size(), me = comm.rank();
  std::vector<float> data(1000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = float(me + 1) + 0.5f * float(i);
  comm.all_reduce_sum(data);
  // Small integers and halves: every partial sum is exact, so the comparison can be exact.
  for (size_t i = 0; i < data.size(); ++i) {
    ASSERT_EQ(data[i], float(n * (n + 1) / 2) + 0.5f * float(n) * float(i)) << "element " << i;
  }
}

TEST(MpiComm, AllReduceSumDouble) {
  Communicator& comm = world();
  const int n = comm.size(), me = comm.rank();
  std::vector<double> data(777);
  for (size_t i = 0; i < data.size(); ++i) data[i] = double(me) * 1e10 + double(i);
  comm.all_reduce_sum(data);
  for (size_t i = 0; i < data.size(); ++i) {
    ASSERT_EQ(data[i], double(n * (n - 1) / 2) * 1e10 + double(n) * double(i)) << "element " << i;
  }
}

TEST(MpiComm, AllReduceIsIdenticalOnEveryRankAndRepeatable) {
  Communicator& comm = world();
  std::mt19937 rng(1234u + unsigned(comm.rank()));
  std::normal_distribution<float> normal;
  std::vector<float> input(4099);
  for (float& x : input) x = normal(rng);
  std::vector<float> first = input, second = input;
  comm.all_reduce_sum(first);
  comm.all_reduce_sum(second);
  ASSERT_EQ(std::memcmp(first.data(), second.data(), first.size() * sizeof(float)), 0);
  // Every rank holds the same bits: gather each rank's copy and compare with rank 0's.
  std::vector<float> all(first.size() * size_t(comm.size()));
  comm.all_gather(first, all);
  for (int r = 1; r < comm.size(); ++r) {
    ASSERT_EQ(std::memcmp(all.data(), all.data() + size_t(r) * first.size(),
                          first.size() * sizeof(float)), 0) << "rank " << r;
  }
}

TEST(MpiComm, ChunkedAllReduceAndBroadcast) {
  Communicator& comm = world();
  const int n = comm.size(), me = comm.rank();
  ChunkLimit limit(7);  // 100 elements -> 15 chunks, the last one short
  std::vector<float> f(100);
  std::vector<double> d(100);
  for (size_t i = 0; i < f.size(); ++i) {
    f[i] = float(i) + float(me);
    d[i] = double(i) * double(me + 1);
  }
  comm.all_reduce_sum(f);
  comm.all_reduce_sum(d);
  for (size_t i = 0; i < f.size(); ++i) {
    ASSERT_EQ(f[i], float(n) * float(i) + float(n * (n - 1) / 2)) << "element " << i;
    ASSERT_EQ(d[i], double(i) * double(n * (n + 1) / 2)) << "element " << i;
  }

  std::vector<float> b(50, -1.0f);
  if (me == 0) {
    for (size_t i = 0; i < b.size(); ++i) b[i] = float(i) * 3.0f;
  }
  comm.broadcast(b, 0);
  for (size_t i = 0; i < b.size(); ++i) ASSERT_EQ(b[i], float(i) * 3.0f);

  std::string bytes = me == 0 ? std::string(40, 'z') + "tail" : "";
  comm.broadcast_bytes(bytes, 0);
  EXPECT_EQ(bytes, std::string(40, 'z') + "tail");

  // Counts above the limit that cannot be chunked are rejected on every rank, before any MPI call.
  if (n > 1) {
    std::vector<float> out(size_t(n) * 8);
    EXPECT_THROW(comm.all_gather({out.data(), 8}, out), Error);
    EXPECT_THROW(comm.reduce_scatter_sum(out, {out.data(), 8}), Error);
  }
}

TEST(MpiComm, AllGatherOrdering) {
  Communicator& comm = world();
  const int n = comm.size(), me = comm.rank();
  const size_t count = 3;
  std::vector<float> in(count), out(count * size_t(n), -1.0f);
  for (size_t i = 0; i < count; ++i) in[i] = float(me * 10) + float(i);
  comm.all_gather(in, out);
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < count; ++i) {
      EXPECT_EQ(out[size_t(r) * count + i], float(r * 10) + float(i)) << "rank " << r << " i " << i;
    }
  }
}

TEST(MpiComm, ReduceScatterSum) {
  Communicator& comm = world();
  const int n = comm.size(), me = comm.rank();
  const size_t count = 5;
  std::vector<float> in(count * size_t(n)), out(count, -1.0f);
  for (size_t j = 0; j < in.size(); ++j) in[j] = float(me * 1000) + float(j);
  comm.reduce_scatter_sum(in, out);
  for (size_t i = 0; i < count; ++i) {
    float j = float(size_t(me) * count + i);
    EXPECT_EQ(out[i], float(1000 * n * (n - 1) / 2) + float(n) * j) << "element " << i;
  }
}

TEST(MpiComm, BroadcastFromEveryRoot) {
  Communicator& comm = world();
  const int n = comm.size(), me = comm.rank();
  for (int root = 0; root < n; ++root) {
    std::vector<float> data(17, float(-me));
    if (me == root) {
      for (size_t i = 0; i < data.size(); ++i) data[i] = float(root * 100) + float(i);
    }
    comm.broadcast(data, root);
    for (size_t i = 0; i < data.size(); ++i) {
      ASSERT_EQ(data[i], float(root * 100) + float(i)) << "root " << root;
    }
  }
  EXPECT_THROW(comm.broadcast({}, n), Error);
  EXPECT_THROW(comm.broadcast({}, -1), Error);
}

TEST(MpiComm, BroadcastBytes) {
  Communicator& comm = world();
  const int n = comm.size(), me = comm.rank();
  const int root = n - 1;
  // Binary content (embedded NULs); the receivers start with strings of other lengths.
  std::string expected("config\0{\"a\": 1}\xff", 16);
  std::string bytes = me == root ? expected : std::string(size_t(me) * 100 + 3, 'q');
  comm.broadcast_bytes(bytes, root);
  EXPECT_EQ(bytes, expected);

  std::string empty = me == 0 ? "" : "not empty";
  comm.broadcast_bytes(empty, 0);
  EXPECT_EQ(empty, "");
  EXPECT_THROW(comm.broadcast_bytes(empty, n), Error);
}

TEST(MpiComm, SplitByParity) {
  Communicator& comm = world();
  const int n = comm.size(), me = comm.rank();
  std::unique_ptr<Communicator> sub = comm.split(me % 2, me);
  std::vector<float> expected;
  for (int r = me % 2; r < n; r += 2) expected.push_back(float(r));
  EXPECT_EQ(sub->size(), int(expected.size()));
  EXPECT_EQ(sub->rank(), me / 2);
  EXPECT_EQ(gather_one(*sub, float(me)), expected);

  // The key orders the members: a reversed key reverses the order.
  std::unique_ptr<Communicator> reversed = comm.split(me % 2, -me);
  std::vector<float> backwards(expected.rbegin(), expected.rend());
  EXPECT_EQ(gather_one(*reversed, float(me)), backwards);

  // A sum within the sub-communicator only involves its members.
  double total = me;
  sub->all_reduce_sum({&total, 1});
  double want = 0;
  for (float r : expected) want += r;
  EXPECT_EQ(total, want);
}

// Every (s0, s1) with s0·s1 = world size.
std::vector<std::pair<int, int>> factorisations(int n) {
  std::vector<std::pair<int, int>> out;
  for (int a = 1; a <= n; ++a) {
    if (n % a == 0) out.push_back({a, n / a});
  }
  return out;
}

TEST(MpiMesh, EveryFactorisation) {
  Communicator& comm = world();
  const int n = comm.size(), me = comm.rank();
  for (auto [s0, s1] : factorisations(n)) {
    SCOPED_TRACE("mesh " + std::to_string(s0) + "x" + std::to_string(s1));
    DeviceMesh mesh({s0, s1}, {"batch", "model"}, comm);
    EXPECT_EQ(mesh.size(), n);
    EXPECT_EQ(mesh.axis_index("batch"), 0);
    EXPECT_EQ(mesh.axis_index("model"), 1);
    EXPECT_EQ(mesh.axis_index("data"), -1);
    EXPECT_EQ(mesh.describe(),
              "(" + std::to_string(s0) + ", " + std::to_string(s1) + ") ('batch', 'model')");

    // Row-major coordinates, unique over the job.
    EXPECT_EQ(mesh.coordinate(0), me / s1);
    EXPECT_EQ(mesh.coordinate(1), me % s1);
    std::vector<float> c0 = gather_one(comm, float(mesh.coordinate(0)));
    std::vector<float> c1 = gather_one(comm, float(mesh.coordinate(1)));
    std::set<std::pair<float, float>> seen;
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(c0[size_t(r)], float(r / s1));
      EXPECT_EQ(c1[size_t(r)], float(r % s1));
      seen.insert({c0[size_t(r)], c1[size_t(r)]});
    }
    EXPECT_EQ(int(seen.size()), n);

    // Axis "batch": same model coordinate, ordered by batch coordinate.
    std::vector<float> batch_members;
    for (int i = 0; i < s0; ++i) batch_members.push_back(float(i * s1 + me % s1));
    EXPECT_EQ(mesh.axis_comm(0).size(), s0);
    EXPECT_EQ(mesh.axis_comm(0).rank(), mesh.coordinate(0));
    EXPECT_EQ(gather_one(mesh.axis_comm(0), float(me)), batch_members);

    // Axis "model": same batch coordinate, consecutive ranks.
    std::vector<float> model_members;
    for (int j = 0; j < s1; ++j) model_members.push_back(float((me / s1) * s1 + j));
    EXPECT_EQ(mesh.axis_comm(1).size(), s1);
    EXPECT_EQ(mesh.axis_comm(1).rank(), mesh.coordinate(1));
    EXPECT_EQ(gather_one(mesh.axis_comm(1), float(me)), model_members);
  }
}

TEST(MpiMesh, OneDimensional) {
  Communicator& comm = world();
  DeviceMesh mesh({comm.size()}, {"batch"}, comm);
  EXPECT_EQ(mesh.coordinate(0), comm.rank());
  EXPECT_EQ(mesh.axis_comm(0).size(), comm.size());
  EXPECT_EQ(mesh.describe(), "(" + std::to_string(comm.size()) + ",) ('batch',)");
}

TEST(MpiMesh, SizeMismatchNamesTheCounts) {
  Communicator& comm = world();
  const int n = comm.size();
  std::string want = "mesh 1x" + std::to_string(2 * n) + " has " + std::to_string(2 * n) +
                     " devices but the job has " + std::to_string(n) + " process" +
                     (n == 1 ? "" : "es");
  try {
    DeviceMesh mesh({1, 2 * n}, {"batch", "model"}, comm);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), want);
  }
  if (n > 1) {
    EXPECT_THROW(DeviceMesh({n - 1}, {"batch"}, comm), Error);
  }
}

}  // namespace
}  // namespace meshtune
