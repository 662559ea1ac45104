// A link seam: the functions of src/backend/cuda_devices.cpp and src/distribution/nccl.cpp, for the
// emulated GPU test executables (tests/CMakeLists.txt compiles this file into them, so the linker
// takes these and never the library's). The GPU tests' sources then run unchanged: cuda_system()
// lists one emulated GPU, make_cuda_backend gives the CUDA backend on the emulator, and a mesh of
// "GPUs" gets MPI's collectives on its device memory where NCCL would run (inside a DeviceWork: the
// emulator's device memory is host memory that host code may touch only then).
#include "backend/cuda_devices.h"
#include "core/error.h"
#include "device_work.h"
#include "distribution/nccl.h"
#include "emulated_backend.h"

namespace meshtune {

CudaSystem cuda_system() {
  CudaSystem system;
  system.built = true;
  system.gpus.push_back({0, "CUDA emulator", size_t(16) << 30, 9, 0});
  return system;
}

size_t gpu_memory_in_use() { return 0; }

std::unique_ptr<Backend> make_cuda_backend(int) { return make_emulated_cuda_backend(); }  // every rank its own

void* cuda_stream_of(Backend& backend) { return emulated_cuda_stream(backend); }

std::vector<std::string> cuda_routes(Backend& backend) { return emulated_routes(backend); }

std::string nccl_unique_id(Communicator&) { fail("nccl_unique_id: the CUDA emulator has no NCCL"); }

namespace {

// NCCL's stand-in: the host's collectives on the emulated GPU's memory, each inside a DeviceWork.
class EmulatedNccl : public DeviceCommunicator {
 public:
  explicit EmulatedNccl(Communicator& host) : DeviceCommunicator(host, Device::Cuda) {}
  explicit EmulatedNccl(std::unique_ptr<Communicator> host) : DeviceCommunicator(std::move(host), Device::Cuda) {}
  std::unique_ptr<Communicator> split(int color, int key) override {
    return std::make_unique<EmulatedNccl>(host().split(color, key));
  }

 protected:
  void all_reduce_sum_impl(float* data, size_t count) override { on_device([&] { host().all_reduce_sum({data, count}); }); }
  void all_reduce_sum_impl(double* data, size_t count) override { on_device([&] { host().all_reduce_sum({data, count}); }); }
  void all_reduce_max_impl(float* data, size_t count) override { on_device([&] { host().all_reduce_max({data, count}); }); }
  void all_gather_impl(const float* in, size_t count, float* out) override {
    on_device([&] { host().all_gather({in, count}, {out, count * size_t(size())}); });
  }
  void reduce_scatter_sum_impl(const float* in, size_t count, float* out) override {
    on_device([&] { host().reduce_scatter_sum({in, count * size_t(size())}, {out, count}); });
  }
  void broadcast_impl(float* data, size_t count, int root) override {
    on_device([&] { host().broadcast({data, count}, root); });
  }

 private:
  template <class Work>
  static void on_device(const Work& work) {
    const cuda_emulator::DeviceWork working;
    work();
  }
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, void*) {
  return std::make_unique<EmulatedNccl>(host);
}

}  // namespace meshtune
