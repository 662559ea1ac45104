// The CUDA emulator: runs the CUDA backend's kernels on the CPU, so that every kernel is tested
// against the reference backend on machines without a GPU (CI, and every session without the
// device). What it checks, and what it cannot:
//   - each block's threads run as cooperative fibers on one CPU thread; __syncthreads and warp
//     shuffles switch between them, so barriers, shared memory and warp sums behave as on a GPU
//     (in index order, or last first under MESHTUNE_CUDA_EMULATOR_ORDER=reverse — the registry runs
//     both —, so a missing barrier shows; other races, e.g. two threads adding into one value without
//     atomics, are not found); blocks run one at a time, in index order or (reverse) last first, so
//     a kernel whose last block finishes the work must find the last by its ticket, not its index;
//   - a barrier some threads of the block never reach, a full-mask shuffle some lanes of the warp
//     never reach, or a shuffle in a block that is not whole warps is a launch error, as are launch
//     shapes a GPU refuses (0 blocks, more than 1024 threads, more dynamic shared memory than
//     allowed — 48 KB unless cudaFuncSetAttribute raised it — or an H200 has);
//   - copies and memsets are checked against the device allocations they touch; a kernel's own
//     reads and writes are checked only under AddressSanitizer (the sanitizer build);
//   - cuBLAS' products are plain column-major loops with cuBLAS' argument checks (emulator.cpp).
// Speed, coalescing and the real cuBLAS are what only the GPU machine (scripts/device-check) shows.
//
// The CUDA sources are translated for it by tests/cuda_emulator/translate.cmake:
// `kernel<<<grid, block, shared, stream>>>(args)` becomes
// `cuda_emulator::launch(grid, block, shared, stream)(kernel, "kernel")(args)`, and `extern __shared__ T x[];`
// the block's dynamic shared memory.
#pragma once
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>

#include "../emulator_counts.h"

namespace cuda_emulator {

// Runs `thread` (a kernel with its arguments bound) for every thread of every block of the launch —
// or, while the stream is captured, records it in the graph to run when the graph is launched; a bad
// launch or a stuck block is recorded for cudaGetLastError. `kernel` identifies the function (for
// its attributes).
void run_kernel(dim3 grid, dim3 block, size_t shared_bytes, const void* kernel, const char* name,
                std::function<void()> thread);

cudaError_t set_function_attribute(const void* kernel, int attribute, int value);

// The running block's dynamic shared memory (the launch's third argument).
void* dynamic_shared_bytes();
template <class T>
T* dynamic_shared() {
  return static_cast<T*>(dynamic_shared_bytes());
}

// Whether p points into (or just past) a device allocation. A kernel's pointer arguments must (or be
// null): a host pointer handed to a kernel is a launch error here, as it would fault on a GPU.
bool device_pointer(const void* p);
void record_bad_argument(const char* kernel, size_t index);

template <class T>
bool argument_ok(const char* kernel, size_t index, const T& value) {
  if constexpr (std::is_pointer_v<T>) {
    if (value != nullptr && !device_pointer(value)) {
      record_bad_argument(kernel, index);
      return false;
    }
  }
  return true;
}

// Warp shuffles: the running lane offers `bits` and gets its source lane's.
enum class Shuffle { Down, Xor };
uint64_t shuffle(unsigned mask, uint64_t bits, size_t size, Shuffle kind, unsigned argument);

struct Launch {
  dim3 grid, block;
  size_t shared_bytes;

  // The launch of `kernel` (`name` for messages): called with the kernel's arguments, which it
  // converts and copies as a real launch does, then runs the grid.
  template <class... Params>
  auto operator()(void (*kernel)(Params...), const char* name) const {
    return [launch = *this, kernel, name](auto&&... args) {
      const std::tuple<Params...> params(args...);
      const bool pointers_ok = std::apply(
          [&](const auto&... value) {
            size_t index = 0;
            return (argument_ok(name, index++, value) && ...);
          },
          params);
      if (!pointers_ok) return;
      // The arguments copied into the launch, as a GPU copies them: a captured launch runs later.
      run_kernel(launch.grid, launch.block, launch.shared_bytes, reinterpret_cast<const void*>(kernel), name,
                 [kernel, params] { std::apply(kernel, params); });
    };
  }
};

inline Launch launch(dim3 grid, dim3 block, size_t shared_bytes = 0, cudaStream_t = nullptr) {
  return Launch{grid, block, shared_bytes};
}

}  // namespace cuda_emulator

void __syncthreads();

template <class T>
T cuda_emulator_shuffle(unsigned mask, T value, cuda_emulator::Shuffle kind, unsigned argument) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = cuda_emulator::shuffle(mask, bits, sizeof(T), kind, argument);
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}
template <class T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta) {
  return cuda_emulator_shuffle(mask, value, cuda_emulator::Shuffle::Down, delta);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  return cuda_emulator_shuffle(mask, value, cuda_emulator::Shuffle::Xor, unsigned(lane_mask));
}
