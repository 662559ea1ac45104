// A link seam: the functions of src/backend/cuda_devices.cpp and src/distribution/nccl.cpp, for the
// emulated GPU test executables (tests/CMakeLists.txt compiles this file into them, so the linker
// takes these and never the library's). The GPU tests' sources then run unchanged: cuda_system()
// lists one emulated GPU, make_cuda_backend gives the CUDA backend on the emulator, and a mesh of
// "GPUs" gets MPI's collectives on its (host-allocated) device memory where NCCL would run.
#include "backend/cuda_devices.h"
#include "core/error.h"
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

std::vector<std::string> cuda_attention_routes(Backend& backend) { return emulated_attention_routes(backend); }

std::string nccl_unique_id(Communicator&) { fail("nccl_unique_id: the CUDA emulator has no NCCL"); }

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, void*) {
  return make_device_tagged_communicator(host, Device::Cuda);
}

}  // namespace meshtune
