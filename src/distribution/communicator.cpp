// Communicators: OpenMPI under mpirun, a one-member copy-only communicator otherwise.
#include "distribution/communicator.h"

#include <chrono>

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include "core/error.h"

namespace meshtune {

namespace {

// Largest element count passed to one MPI call (MPI counts are int). Tests lower it to exercise
// the chunked paths with small buffers.
size_t g_max_mpi_count = size_t(INT_MAX);

void check_root(int root, int size, const char* op) {
  check(root >= 0 && root < size, "communicator ", op, ": root ", root, " is not a member (size ",
        size, ")");
}

// An operand of `op`: in the communicator's memory and holding at least `count` elements.
template <class E>
E* operand(const Communicator& comm, const Span<E>& s, size_t count, const char* op, const char* what) {
  check(count == 0 || s.data != nullptr, "communicator ", op, ": the ", what, " is missing");
  check(s.device == comm.device(), "communicator ", op, ": the ", what, " is in ", device_name(s.device),
        " memory; this communicator works on ", device_name(comm.device()), " memory");
  check(s.size >= count, "communicator ", op, ": the ", what, " holds ", s.size, " elements, ", count, " needed");
  return s.data;
}

// ---------------------------------------------------------------------------------------------
// One process: every collective is the identity (or a copy).

class SingleCommunicator : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void broadcast_bytes(std::string&, int root) override { check_root(root, 1, "broadcast_bytes"); }
  void barrier() override {}
  std::unique_ptr<Communicator> split(int color, int) override {
    check(color >= 0, "communicator split: color must be non-negative, got ", color);
    return std::make_unique<SingleCommunicator>();
  }

 protected:
  void all_reduce_sum_impl(float*, size_t) override {}
  void all_reduce_sum_impl(double*, size_t) override {}
  void all_reduce_max_impl(float*, size_t) override {}
  void all_gather_impl(const float* in, size_t count, float* out) override { copy(in, count, out); }
  void reduce_scatter_sum_impl(const float* in, size_t count, float* out) override { copy(in, count, out); }
  void broadcast_impl(float*, size_t, int) override {}

 private:
  static void copy(const float* in, size_t count, float* out) {
    if (count > 0 && in != out) std::memmove(out, in, count * sizeof(float));
  }
};

// ---------------------------------------------------------------------------------------------
// MPI.

bool mpi_active() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

void finalize_mpi_at_exit() {
  // Guard: someone else (or an earlier handler) may already have finalised.
  if (mpi_active()) MPI_Finalize();
}

// Turns an MPI return code into an Error naming the operation.
void check_mpi(int rc, const char* op) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(rc, text, &length) != MPI_SUCCESS) {
    std::snprintf(text, sizeof(text), "MPI error code %d", rc);
  }
  fail("MPI ", op, " failed: ", text);
}

// Time spent in collectives, summed over this process' communicators.
double g_collective_seconds = 0;

struct CollectiveTimer {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~CollectiveTimer() {
    g_collective_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
};

class MpiCommunicator : public Communicator {
 public:
  // `owned`: the communicator came from MPI_Comm_split and is freed with this object.
  MpiCommunicator(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
    // Errors come back as codes (then Error) instead of MPI's default job abort.
    check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "Comm_set_errhandler");
    check_mpi(MPI_Comm_rank(comm_, &rank_), "Comm_rank");
    check_mpi(MPI_Comm_size(comm_, &size_), "Comm_size");
  }
  ~MpiCommunicator() override {
    // A communicator outliving MPI (a static object) cannot be freed any more; nothing to do then.
    if (owned_ && mpi_active()) MPI_Comm_free(&comm_);
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void broadcast_bytes(std::string& bytes, int root) override {
    check_root(root, size_, "broadcast_bytes");
    uint64_t length = bytes.size();
    check_mpi(MPI_Bcast(&length, 1, MPI_UINT64_T, root, comm_), "Bcast (length)");
    if (rank_ != root) bytes.resize(size_t(length));
    bcast(bytes.data(), size_t(length), MPI_BYTE, 1, root);
  }

  void barrier() override {
    CollectiveTimer timer;
    check_mpi(MPI_Barrier(comm_), "Barrier");
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    check(color >= 0, "communicator split: color must be non-negative, got ", color);
    MPI_Comm sub = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(comm_, color, key, &sub), "Comm_split");
    return std::make_unique<MpiCommunicator>(sub, true);
  }

 protected:
  void all_reduce_sum_impl(float* data, size_t count) override {
    CollectiveTimer timer;
    all_reduce(data, count, MPI_FLOAT, sizeof(float));
  }
  void all_reduce_sum_impl(double* data, size_t count) override {
    CollectiveTimer timer;
    all_reduce(data, count, MPI_DOUBLE, sizeof(double));
  }
  void all_reduce_max_impl(float* data, size_t count) override {
    CollectiveTimer timer;
    all_reduce(data, count, MPI_FLOAT, sizeof(float), MPI_MAX);
  }

  void all_gather_impl(const float* in, size_t count, float* out) override {
    // The output interleaves members, so chunks would need strided types; reject instead.
    check(count <= g_max_mpi_count, "communicator all_gather: ", count,
          " elements per member exceed the MPI limit of ", g_max_mpi_count);
    CollectiveTimer timer;
    check_mpi(MPI_Allgather(in, int(count), MPI_FLOAT, out, int(count), MPI_FLOAT, comm_),
              "Allgather");
  }

  void reduce_scatter_sum_impl(const float* in, size_t count, float* out) override {
    check(count <= g_max_mpi_count, "communicator reduce_scatter_sum: ", count,
          " elements per member exceed the MPI limit of ", g_max_mpi_count);
    CollectiveTimer timer;
    check_mpi(MPI_Reduce_scatter_block(in, out, int(count), MPI_FLOAT, MPI_SUM, comm_),
              "Reduce_scatter_block");
  }

  void broadcast_impl(float* data, size_t count, int root) override {
    bcast(data, count, MPI_FLOAT, sizeof(float), root);
  }

 private:
  // Counts above the int limit go in consecutive chunks: element-wise operations, so the result is
  // the same, and the chunking depends only on `count`, so every member agrees on it.
  void all_reduce(void* data, size_t count, MPI_Datatype type, size_t element_size, MPI_Op op = MPI_SUM) {
    char* bytes = static_cast<char*>(data);
    for (size_t done = 0; done < count;) {
      size_t n = std::min(count - done, g_max_mpi_count);
      check_mpi(MPI_Allreduce(MPI_IN_PLACE, bytes + done * element_size, int(n), type, op, comm_),
                "Allreduce");
      done += n;
    }
  }

  void bcast(void* data, size_t count, MPI_Datatype type, size_t element_size, int root) {
    char* bytes = static_cast<char*>(data);
    for (size_t done = 0; done < count;) {
      size_t n = std::min(count - done, g_max_mpi_count);
      check_mpi(MPI_Bcast(bytes + done * element_size, int(n), type, root, comm_), "Bcast");
      done += n;
    }
  }

  MPI_Comm comm_;
  bool owned_;
  int rank_ = 0;
  int size_ = 1;
};

std::unique_ptr<Communicator> make_world() {
  if (!launched_by_mpirun()) return make_single_communicator();
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    // FUNNELED: OpenMP threads run inside a rank, but only the main thread calls MPI.
    int provided = 0;
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "Init_thread");
    check(provided >= MPI_THREAD_FUNNELED, "MPI provides thread level ", provided,
          ", below MPI_THREAD_FUNNELED");
    std::atexit(finalize_mpi_at_exit);
  }
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, false);
}

}  // namespace

// The communicator for operands in `where`: a device communicator's host twin for host memory.
Communicator* Communicator::for_memory(Device where) {
  Communicator* twin = where == Device::Host && device() != Device::Host ? host_twin() : nullptr;
  return twin ? twin : this;
}

void Communicator::all_reduce_sum(Span<float> data) {
  if (Communicator* c = for_memory(data.device); c != this) return c->all_reduce_sum(data);
  all_reduce_sum_impl(operand(*this, data, data.size, "all_reduce_sum", "data"), data.size);
}
void Communicator::all_reduce_sum(Span<double> data) {
  if (Communicator* c = for_memory(data.device); c != this) return c->all_reduce_sum(data);
  all_reduce_sum_impl(operand(*this, data, data.size, "all_reduce_sum", "data"), data.size);
}
void Communicator::all_reduce_max(Span<float> data) {
  if (Communicator* c = for_memory(data.device); c != this) return c->all_reduce_max(data);
  all_reduce_max_impl(operand(*this, data, data.size, "all_reduce_max", "data"), data.size);
}
void Communicator::all_gather(Span<const float> in, Span<float> out) {
  if (Communicator* c = for_memory(in.device); c != this) return c->all_gather(in, out);
  const float* from = operand(*this, in, in.size, "all_gather", "input");
  all_gather_impl(from, in.size, operand(*this, out, in.size * size_t(size()), "all_gather", "output"));
}
void Communicator::reduce_scatter_sum(Span<const float> in, Span<float> out) {
  if (Communicator* c = for_memory(in.device); c != this) return c->reduce_scatter_sum(in, out);
  const float* from = operand(*this, in, out.size * size_t(size()), "reduce_scatter_sum", "input");
  reduce_scatter_sum_impl(from, out.size, operand(*this, out, out.size, "reduce_scatter_sum", "output"));
}
void Communicator::broadcast(Span<float> data, int root) {
  if (Communicator* c = for_memory(data.device); c != this) return c->broadcast(data, root);
  check_root(root, size(), "broadcast");
  broadcast_impl(operand(*this, data, data.size, "broadcast", "data"), data.size, root);
}
void Communicator::all_reduce_sum_group(const std::vector<Span<float>>& arrays) {
  for (const Span<float>& a : arrays) all_reduce_sum(a);
}

namespace {

// make_device_tagged_communicator's: the host twin's collectives on the (host) memory behind the tag.
class DeviceTaggedCommunicator : public DeviceCommunicator {
 public:
  DeviceTaggedCommunicator(Communicator& host, Device device) : DeviceCommunicator(host, device) {}
  DeviceTaggedCommunicator(std::unique_ptr<Communicator> host, Device device)
      : DeviceCommunicator(std::move(host), device) {}
  std::unique_ptr<Communicator> split(int color, int key) override {
    return std::unique_ptr<Communicator>(new DeviceTaggedCommunicator(host().split(color, key), device()));
  }

 protected:
  void all_reduce_sum_impl(float* data, size_t count) override { host().all_reduce_sum({data, count}); }
  void all_reduce_sum_impl(double* data, size_t count) override { host().all_reduce_sum({data, count}); }
  void all_reduce_max_impl(float* data, size_t count) override { host().all_reduce_max({data, count}); }
  void all_gather_impl(const float* in, size_t count, float* out) override {
    host().all_gather({in, count}, {out, count * size_t(size())});
  }
  void reduce_scatter_sum_impl(const float* in, size_t count, float* out) override {
    host().reduce_scatter_sum({in, count * size_t(size())}, {out, count});
  }
  void broadcast_impl(float* data, size_t count, int root) override { host().broadcast({data, count}, root); }
};

}  // namespace

std::unique_ptr<Communicator> make_device_tagged_communicator(Communicator& host, Device device) {
  check(host.device() == Device::Host, "make_device_tagged_communicator: the twin must work on host memory");
  return std::unique_ptr<Communicator>(new DeviceTaggedCommunicator(host, device));
}


// Test hook (declared by the tests that use it, not in the header): lowers the per-call MPI
// element limit so the chunked paths run with small buffers. 0 restores the default.
void set_max_mpi_count_for_testing(size_t count) {
  g_max_mpi_count = count == 0 ? size_t(INT_MAX) : std::min(count, size_t(INT_MAX));
}

bool launched_by_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
}

Communicator& world() {
  static std::unique_ptr<Communicator> comm = make_world();
  return *comm;
}

std::unique_ptr<Communicator> make_single_communicator() {
  return std::make_unique<SingleCommunicator>();
}

void abort_job(const std::string& message, int code) {
  std::cout.flush();  // keep what this rank already printed
  std::cerr << message << std::endl;
  // MPI_Abort ends every rank; a plain exit would leave the peers blocked in a collective.
  if (mpi_active()) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

double collective_seconds() { return g_collective_seconds; }

}  // namespace meshtune
