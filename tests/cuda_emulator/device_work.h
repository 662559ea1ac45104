// The CUDA emulator's device memory is readable by host code only while the emulated GPU works on it
// (a launch, a cuBLAS product, a copy or memset, an emulated NCCL collective). Elsewhere it is mapped
// without access, so host code that dereferences a device pointer — a segfault on a GPU — faults
// here too, and the emulator's fault handler names the address and prints the stack. (Not under
// AddressSanitizer: there each allocation is its own malloc, so that the sanitizer sees a kernel's
// overrun at once; the release build's emulated tests do this check.) Needs no CUDA header.
#pragma once

namespace cuda_emulator {

// While one lives (they nest), host code may touch device memory.
class DeviceWork {
 public:
  DeviceWork();
  ~DeviceWork();
  DeviceWork(const DeviceWork&) = delete;
  DeviceWork& operator=(const DeviceWork&) = delete;
};

}  // namespace cuda_emulator
