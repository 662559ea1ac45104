// The CUDA backend (src/backend/cuda) built on the CUDA emulator (emulator.h): its kernels and
// cuBLAS calls run on the CPU. For the GPU tests built as emulated_gpu_test_* (MESHTUNE_CUDA_EMULATOR).
#pragma once
#include <memory>

#include "backend/backend.h"

namespace meshtune::testing {

std::unique_ptr<Backend> make_emulated_cuda_backend();

}  // namespace meshtune::testing
