// What the CUDA backend has asked of the emulated GPU so far, counted by the CUDA emulator
// (emulator.cpp), for tests that bound what one training step costs a GPU beyond its arithmetic:
// kernel launches (each a few microseconds of host and GPU time) and host round trips (each drains
// the stream). Needs no CUDA header, so the GPU tests' sources can include it.
#pragma once
#include <cstdint>
#include <map>
#include <string>

namespace cuda_emulator {

struct Counts {
  std::map<std::string, int64_t> launches;  // kernel name → launches (direct or into a captured graph)
  int64_t products = 0;                     // cuBLAS calls (a batched product counts once; captured too)
  int64_t uploads = 0, downloads = 0;       // host → device and device → host copies
  int64_t synchronizations = 0;             // cudaStreamSynchronize / cudaEventSynchronize
  int64_t graph_launches = 0;               // cudaGraphLaunch (its kernels and products were counted when captured)
  double device_seconds = 0;                // spent doing the GPU's work (the rest of a run is the host's)

  int64_t kernel_launches() const {
    int64_t total = 0;
    for (const auto& [name, n] : launches) total += n;
    return total;
  }
};

Counts& counts();  // since the process started; tests take differences

}  // namespace cuda_emulator
