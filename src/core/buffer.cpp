#include "core/buffer.h"

#include <cstdlib>
#include <new>

namespace meshtune {

const char* device_name(Device device) { return device == Device::Host ? "host" : "cuda"; }

void* allocate_host(size_t bytes) {
  bytes = (bytes + 63) / 64 * 64;  // aligned_alloc wants a multiple of the alignment
  void* p = std::aligned_alloc(64, bytes == 0 ? 64 : bytes);
  if (!p) throw std::bad_alloc();
  return p;
}

void free_host(void* p) { std::free(p); }

namespace {
class HostMemory final : public Allocator {
 public:
  Device device() const override { return Device::Host; }
  void* allocate(size_t bytes) override { return allocate_host(bytes); }
  void release(void* p) override { free_host(p); }
};
}  // namespace

Allocator& host_memory() {
  static HostMemory memory;
  return memory;
}

}  // namespace meshtune
