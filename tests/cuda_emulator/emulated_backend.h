// The CUDA backend (src/backend/cuda) built on the CUDA emulator (emulator.h): its kernels and
// cuBLAS calls run on the CPU.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace meshtune {

std::unique_ptr<Backend> make_emulated_cuda_backend();
void* emulated_cuda_stream(Backend& backend);  // its stream; an Error for any other backend
std::vector<std::string> emulated_routes(Backend& backend);  // empty for any other backend

}  // namespace meshtune
