// The NVIDIA GPUs this process can use, and the CUDA backend on one of them — the way in that every
// build has: a build without the CUDA toolkit answers "not built" here instead of failing to link.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace meshtune {

struct GpuInfo {
  int index = 0;
  std::string name;          // "NVIDIA H200"
  size_t memory_bytes = 0;
  int major = 0, minor = 0;  // compute capability
};

struct CudaSystem {
  bool built = false;        // this binary has the CUDA backend
  std::string unavailable;   // why there is no GPU to use ("" when there is one)
  int driver_version = 0;    // 13000 = 13.0; 0 when there is no driver
  int runtime_version = 0;
  std::vector<GpuInfo> gpus;
};

// What this build and this machine offer (never throws).
CudaSystem cuda_system();

// Bytes of the current GPU's memory in use (by every process), 0 without one: a CUDA backend keeps
// what it allocated, so after a run this is its peak (plus the CUDA context's own).
size_t gpu_memory_in_use();

// The CUDA backend on GPU `gpu`, or — for -1 — on the GPU of this process' local rank (one process
// per GPU under mpirun). One Error naming `--device cuda` and the reason when it cannot be made.
std::unique_ptr<Backend> make_cuda_backend(int gpu = -1);

// The CUDA stream a CUDA backend queues its ops on (a cudaStream_t), for the NCCL communicator of
// a mesh of GPUs to queue its collectives in order with them. An Error for any other backend.
void* cuda_stream_of(Backend& backend);

// The route a CUDA backend measured and chose for each op and shape with two that it has run
// (attention, linear of few rows: CudaBackend::routes); empty for any other backend.
std::vector<std::string> cuda_routes(Backend& backend);

}  // namespace meshtune
