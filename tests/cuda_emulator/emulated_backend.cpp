// Compiled with CudaBackend renamed EmulatedCudaBackend (tests/CMakeLists.txt), beside the translated
// src/backend/cuda sources, so that it and a real CUDA backend can be linked into one program.
#include "emulated_backend.h"

#include "backend/cuda/cuda_backend.h"

namespace meshtune::testing {

std::unique_ptr<Backend> make_emulated_cuda_backend() { return std::make_unique<CudaBackend>(0); }

}  // namespace meshtune::testing
