// The one-process communicator and DeviceMesh without mpirun, the text parsers, and abort_job
// under a real 2-rank mpirun (the job must end, not hang, when one rank fails).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "distribution/communicator.h"
#include "distribution/mesh.h"
#include "test_util.h"

namespace meshtune {
namespace {

// The message of the Error that `body` throws ("" if none).
template <typename F>
std::string error_of(F body) {
  try {
    body();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(SingleCommunicator, CollectivesAreCopies) {
  std::unique_ptr<Communicator> comm = make_single_communicator();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);

  std::vector<float> f = {1.5f, -2.0f, 3.25f};
  comm->all_reduce_sum(f);
  EXPECT_EQ(f, (std::vector<float>{1.5f, -2.0f, 3.25f}));
  std::vector<double> d = {1e300, -0.5};
  comm->all_reduce_sum(d);
  EXPECT_EQ(d, (std::vector<double>{1e300, -0.5}));

  std::vector<float> out(3, 0.0f);
  comm->all_gather(f, out);
  EXPECT_EQ(out, f);
  std::vector<float> scattered(3, 0.0f);
  comm->reduce_scatter_sum(f, scattered);
  EXPECT_EQ(scattered, f);

  comm->broadcast(f, 0);
  EXPECT_EQ(f, (std::vector<float>{1.5f, -2.0f, 3.25f}));
  std::string bytes("a\0b", 3);
  comm->broadcast_bytes(bytes, 0);
  EXPECT_EQ(bytes, std::string("a\0b", 3));
  comm->barrier();

  EXPECT_THROW(comm->broadcast(f, 1), Error);
  // Operands are checked like a backend's: in the communicator's memory, long enough.
  float x = 1;
  EXPECT_NE(error_of([&] { comm->all_reduce_sum(Span<float>(&x, 1, Device::Cuda)); }).find("is in cuda memory"),
            std::string::npos);
  std::vector<float> two(2);
  EXPECT_NE(error_of([&] { comm->all_gather(f, two); }).find("output holds 2 elements, 3 needed"), std::string::npos);
  EXPECT_THROW(comm->broadcast_bytes(bytes, -1), Error);

  std::unique_ptr<Communicator> sub = comm->split(5, 0);
  EXPECT_EQ(sub->rank(), 0);
  EXPECT_EQ(sub->size(), 1);
}

TEST(SingleCommunicator, WorldWithoutMpirunIsSingle) {
  if (launched_by_mpirun()) GTEST_SKIP() << "running under mpirun";
  EXPECT_EQ(world().size(), 1);
  EXPECT_EQ(world().rank(), 0);
  EXPECT_EQ(&world(), &world());
}

TEST(SingleMesh, OneByOneWorks) {
  std::unique_ptr<Communicator> comm = make_single_communicator();
  DeviceMesh mesh({1, 1}, {"batch", "model"}, *comm);
  EXPECT_EQ(mesh.size(), 1);
  EXPECT_EQ(mesh.shape(), (std::vector<int>{1, 1}));
  EXPECT_EQ(mesh.axis_names(), (std::vector<std::string>{"batch", "model"}));
  EXPECT_EQ(mesh.axis_index("model"), 1);
  EXPECT_EQ(mesh.axis_index("nope"), -1);
  EXPECT_EQ(mesh.axis_size(0), 1);
  EXPECT_EQ(mesh.coordinate(0), 0);
  EXPECT_EQ(mesh.coordinate(1), 0);
  EXPECT_EQ(mesh.axis_comm(0).size(), 1);
  EXPECT_EQ(mesh.axis_comm(1).size(), 1);
  EXPECT_EQ(&mesh.comm(), comm.get());
  EXPECT_EQ(mesh.describe(), "(1, 1) ('batch', 'model')");

  DeviceMesh line({1}, {"batch"}, *comm);
  EXPECT_EQ(line.describe(), "(1,) ('batch',)");
}

TEST(SingleMesh, InvalidMeshesThrow) {
  std::unique_ptr<Communicator> comm = make_single_communicator();
  EXPECT_EQ(error_of([&] { DeviceMesh({1, 2}, {"batch", "model"}, *comm); }),
            "mesh 1x2 has 2 devices but the job has 1 process");
  EXPECT_EQ(error_of([&] { DeviceMesh({1, 8}, {"batch", "model"}, *comm); }),
            "mesh 1x8 has 8 devices but the job has 1 process");
  EXPECT_NE(error_of([&] { DeviceMesh({}, {}, *comm); }), "");
  EXPECT_NE(error_of([&] { DeviceMesh({1, 1}, {"batch"}, *comm); }).find("2 dimensions but 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { DeviceMesh({0, 1}, {"batch", "model"}, *comm); }).find("positive"),
            std::string::npos);
  EXPECT_NE(error_of([&] { DeviceMesh({1, -1}, {"batch", "model"}, *comm); }).find("positive"),
            std::string::npos);
  EXPECT_NE(error_of([&] { DeviceMesh({1, 1}, {"batch", "batch"}, *comm); }).find("duplicate"),
            std::string::npos);
  EXPECT_NE(error_of([&] { DeviceMesh({1, 1}, {"batch", ""}, *comm); }).find("invalid axis name"),
            std::string::npos);
  EXPECT_NE(error_of([&] { DeviceMesh({65536, 65536}, {"a", "b"}, *comm); }).find("too large"),
            std::string::npos);
}

TEST(SingleMesh, ParseShape) {
  EXPECT_EQ(DeviceMesh::parse_shape("1x8"), (std::vector<int>{1, 8}));
  EXPECT_EQ(DeviceMesh::parse_shape("2x2"), (std::vector<int>{2, 2}));
  EXPECT_EQ(DeviceMesh::parse_shape("8"), (std::vector<int>{8}));
  EXPECT_EQ(DeviceMesh::parse_shape("2x1x4"), (std::vector<int>{2, 1, 4}));
  for (const char* bad : {"", "x", "1x", "x8", "0x8", "-1x8", "+1x8", "1*8", "1,8", "a", "1.5",
                          "1xx8", "99999999999"}) {
    std::string message = error_of([&] { DeviceMesh::parse_shape(bad); });
    EXPECT_NE(message.find("invalid mesh shape '" + std::string(bad) + "'"), std::string::npos)
        << "input '" << bad << "' gave: " << message;
  }
}

TEST(SingleMesh, ParseAxes) {
  EXPECT_EQ(DeviceMesh::parse_axes("batch,model"), (std::vector<std::string>{"batch", "model"}));
  EXPECT_EQ(DeviceMesh::parse_axes("batch"), (std::vector<std::string>{"batch"}));
  EXPECT_EQ(DeviceMesh::parse_axes(" batch , model_2 "),
            (std::vector<std::string>{"batch", "model_2"}));
  for (const char* bad : {"", ",", "batch,", ",model", "batch,,model", "ba tch", "1batch",
                          "batch;model", "batch,batch"}) {
    std::string message = error_of([&] { DeviceMesh::parse_axes(bad); });
    EXPECT_NE(message.find("invalid mesh axis names '" + std::string(bad) + "'"),
              std::string::npos)
        << "input '" << bad << "' gave: " << message;
  }
}

// Rank 1 calls abort_job while rank 0 waits in a barrier: mpirun must return non-zero, well
// before its own --timeout would kill the job.
TEST(AbortJob, EndsEveryRankUnderMpirun) {
  std::string dir = testing::make_temp_dir("abort");
  std::string log = dir + "/log";
  std::string command = std::string("'") + MESHTUNE_MPIEXEC +
                        "' --allow-run-as-root --oversubscribe -np 2 --timeout 60 '" +
                        MESHTUNE_MPI_ABORT_PROBE + "' >'" + log + "' 2>&1 </dev/null";
  auto start = std::chrono::steady_clock::now();
  int status = std::system(command.c_str());
  double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::string output = testing::read_text_file(log);
  std::filesystem::remove_all(dir);

  ASSERT_NE(status, -1);
  ASSERT_TRUE(WIFEXITED(status)) << output;
  EXPECT_NE(WEXITSTATUS(status), 0) << output;
  EXPECT_LT(seconds, 45.0) << "the job hung until mpirun's timeout\n" << output;
  EXPECT_NE(output.find("rank 1 failed"), std::string::npos) << output;
  EXPECT_EQ(output.find("rank 0 left the barrier"), std::string::npos) << output;
}

}  // namespace
}  // namespace meshtune
