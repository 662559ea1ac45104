#include "backend/cuda_devices.h"

#include <cstdlib>

#include "core/error.h"

#ifdef MESHTUNE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "backend/cuda/cuda_backend.h"
#endif

namespace meshtune {

#ifdef MESHTUNE_HAVE_CUDA

CudaSystem cuda_system() {
  CudaSystem system;
  system.built = true;
  cudaRuntimeGetVersion(&system.runtime_version);
  cudaDriverGetVersion(&system.driver_version);
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();
    system.unavailable = std::string(cudaGetErrorString(status)) + " (cudaGetDeviceCount: error " +
                         std::to_string(int(status)) + ")";
    return system;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    system.gpus.push_back({i, prop.name, prop.totalGlobalMem, prop.major, prop.minor});
  }
  if (system.gpus.empty()) system.unavailable = "no NVIDIA GPU found";
  return system;
}

size_t gpu_memory_in_use() {
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return total - free;
}

std::unique_ptr<Backend> make_cuda_backend(int gpu) {
  const CudaSystem system = cuda_system();
  check(system.unavailable.empty(), "--device cuda: no usable NVIDIA GPU here: ", system.unavailable);
  if (gpu < 0) {  // one process per GPU: OpenMPI's local rank picks it
    const char* local_rank = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    gpu = local_rank ? std::atoi(local_rank) : 0;
    check(gpu < int(system.gpus.size()), "--device cuda: local rank ", gpu, " has no GPU of its own (this machine has ",
          system.gpus.size(), "): start at most one process per GPU");
  }
  return std::make_unique<CudaBackend>(gpu);
}

void* cuda_stream_of(Backend& backend) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  check(cuda != nullptr, "cuda_stream_of: ", backend.name(), " is not a CUDA backend");
  return cuda->stream();
}

std::vector<std::string> cuda_routes(Backend& backend) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  return cuda ? cuda->routes() : std::vector<std::string>{};
}

#else

CudaSystem cuda_system() {
  CudaSystem system;
  system.unavailable = "this meshtune was built without the CUDA backend (no CUDA toolkit at build time)";
  return system;
}

size_t gpu_memory_in_use() { return 0; }

std::unique_ptr<Backend> make_cuda_backend(int) {
  fail("--device cuda: this meshtune was built without the CUDA backend (no CUDA toolkit was found when it was "
       "built; rebuild with the toolkit and -DMESHTUNE_CUDA=ON)");
}

void* cuda_stream_of(Backend& backend) { fail("cuda_stream_of: ", backend.name(), " is not a CUDA backend"); }

std::vector<std::string> cuda_routes(Backend&) { return {}; }

#endif

}  // namespace meshtune
