// Compiled with CudaBackend renamed EmulatedCudaBackend (tests/CMakeLists.txt), beside the translated
// src/backend/cuda sources, so that it and a real CUDA backend can be linked into one program.
#include "emulated_backend.h"

#include "backend/cuda/cuda_backend.h"
#include "core/error.h"

namespace meshtune {

std::unique_ptr<Backend> make_emulated_cuda_backend() { return std::make_unique<CudaBackend>(0); }

void* emulated_cuda_stream(Backend& backend) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  check(cuda != nullptr, "cuda_stream_of: ", backend.name(), " is not a CUDA backend");
  return cuda->stream();
}

std::vector<std::string> emulated_routes(Backend& backend) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  return cuda ? cuda->routes() : std::vector<std::string>{};
}

}  // namespace meshtune
