#include "distribution/nccl.h"

#include "core/error.h"

#ifdef MESHTUNE_HAVE_CUDA
#include <nccl.h>

#include <algorithm>

#include "core/shared_library.h"
#endif

namespace meshtune {

#ifdef MESHTUNE_HAVE_CUDA

static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes, "NCCL's unique id changed size");

namespace {

// The NCCL functions meshtune calls, from libnccl.so.2 opened once.
struct Nccl {
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclReduceScatter) reduce_scatter = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
};

const Nccl& nccl() {
  static const Nccl loaded = [] {
    const std::string soname = "libnccl.so.2";
    void* lib = open_shared_library(soname, MESHTUNE_CUDA_LIBRARY_DIR, "NCCL");
    auto symbol = [&](const char* name) { return library_symbol(lib, soname, name, "NCCL"); };
    Nccl n;
    n.get_unique_id = reinterpret_cast<decltype(n.get_unique_id)>(symbol("ncclGetUniqueId"));
    n.comm_init_rank = reinterpret_cast<decltype(n.comm_init_rank)>(symbol("ncclCommInitRank"));
    n.comm_destroy = reinterpret_cast<decltype(n.comm_destroy)>(symbol("ncclCommDestroy"));
    n.error_string = reinterpret_cast<decltype(n.error_string)>(symbol("ncclGetErrorString"));
    n.all_reduce = reinterpret_cast<decltype(n.all_reduce)>(symbol("ncclAllReduce"));
    n.all_gather = reinterpret_cast<decltype(n.all_gather)>(symbol("ncclAllGather"));
    n.reduce_scatter = reinterpret_cast<decltype(n.reduce_scatter)>(symbol("ncclReduceScatter"));
    n.broadcast = reinterpret_cast<decltype(n.broadcast)>(symbol("ncclBroadcast"));
    n.group_start = reinterpret_cast<decltype(n.group_start)>(symbol("ncclGroupStart"));
    n.group_end = reinterpret_cast<decltype(n.group_end)>(symbol("ncclGroupEnd"));
    return n;
  }();
  return loaded;
}

void check_nccl(ncclResult_t status, const char* what) {
  if (status != ncclSuccess) fail("NCCL ", what, " failed: ", nccl().error_string(status), " (result ", int(status), ")");
}

// Rank 0's id: NCCL's ncclGetUniqueId, called once per communicator.
std::string make_unique_id() {
  ncclUniqueId id;
  check_nccl(nccl().get_unique_id(&id), "ncclGetUniqueId");
  return std::string(id.internal, sizeof(id.internal));
}

class NcclCommunicator : public DeviceCommunicator {
 public:
  NcclCommunicator(Communicator& host, void* stream) : DeviceCommunicator(host, Device::Cuda), stream_(stream) {
    join();
  }
  NcclCommunicator(std::unique_ptr<Communicator> host, void* stream)
      : DeviceCommunicator(std::move(host), Device::Cuda), stream_(stream) {
    join();
  }
  ~NcclCommunicator() override {
    if (comm_) nccl().comm_destroy(comm_);  // waits for its queued work; errors ignored (ending)
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  std::unique_ptr<Communicator> split(int color, int key) override {
    return std::make_unique<NcclCommunicator>(host().split(color, key), stream_);
  }

  void all_reduce_sum_group(const std::vector<Span<float>>& arrays) override {
    if (arrays.size() < 2) return Communicator::all_reduce_sum_group(arrays);
    check_nccl(nccl().group_start(), "ncclGroupStart");
    try {
      for (const Span<float>& a : arrays) all_reduce_sum(a);
    } catch (...) {
      nccl().group_end();
      throw;
    }
    check_nccl(nccl().group_end(), "ncclGroupEnd");
  }

 protected:
  void all_reduce_sum_impl(float* data, size_t count) override {
    check_nccl(nccl().all_reduce(data, data, count, ncclFloat32, ncclSum, comm_, stream()), "ncclAllReduce");
  }
  void all_reduce_sum_impl(double* data, size_t count) override {
    check_nccl(nccl().all_reduce(data, data, count, ncclFloat64, ncclSum, comm_, stream()), "ncclAllReduce");
  }
  void all_reduce_max_impl(float* data, size_t count) override {
    check_nccl(nccl().all_reduce(data, data, count, ncclFloat32, ncclMax, comm_, stream()), "ncclAllReduce");
  }
  void all_gather_impl(const float* in, size_t count, float* out) override {
    check_nccl(nccl().all_gather(in, out, count, ncclFloat32, comm_, stream()), "ncclAllGather");
  }
  void reduce_scatter_sum_impl(const float* in, size_t count, float* out) override {
    check_nccl(nccl().reduce_scatter(in, out, count, ncclFloat32, ncclSum, comm_, stream()), "ncclReduceScatter");
  }
  void broadcast_impl(float* data, size_t count, int root) override {
    check_nccl(nccl().broadcast(data, data, count, ncclFloat32, root, comm_, stream()), "ncclBroadcast");
  }

 private:
  cudaStream_t stream() const { return static_cast<cudaStream_t>(stream_); }

  // Every member joins with rank 0's id. One process per GPU: NCCL refuses two ranks on one GPU.
  void join() {
    const std::string id_bytes = nccl_unique_id(host());
    ncclUniqueId id;
    std::copy(id_bytes.begin(), id_bytes.end(), id.internal);
    const ncclResult_t status = nccl().comm_init_rank(&comm_, size(), id, rank());
    if (status != ncclSuccess) {
      comm_ = nullptr;
      fail("NCCL ncclCommInitRank failed on rank ", rank(), " of ", size(), ": ", nccl().error_string(status),
           " (one process per GPU: start at most as many processes per machine as it has GPUs)");
    }
  }

  void* stream_;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

std::string nccl_unique_id(Communicator& comm) {
  // Rank 0's failure must not leave the others waiting for the id: its message is broadcast first,
  // and every rank fails with it.
  std::string id, error;
  if (comm.rank() == 0) {
    try {
      id = make_unique_id();
    } catch (const Error& e) {
      error = e.what();
    }
  }
  comm.broadcast_bytes(error, 0);
  check(error.empty(), error);
  comm.broadcast_bytes(id, 0);
  check(id.size() == kNcclUniqueIdBytes, "NCCL: the unique id from rank 0 has ", id.size(), " bytes, not ",
        kNcclUniqueIdBytes);
  return id;
}

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, void* cuda_stream) {
  check(host.device() == Device::Host, "make_nccl_communicator: the bootstrap communicator must work on host memory");
  return std::make_unique<NcclCommunicator>(host, cuda_stream);
}

#else

std::string nccl_unique_id(Communicator&) {
  fail("NCCL: this meshtune was built without the CUDA backend (no CUDA toolkit when it was built)");
}

std::unique_ptr<Communicator> make_nccl_communicator(Communicator&, void*) {
  fail("NCCL: this meshtune was built without the CUDA backend (no CUDA toolkit when it was built)");
}

#endif

}  // namespace meshtune
