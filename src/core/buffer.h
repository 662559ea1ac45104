// Device-tagged memory. Activations, KV caches and workspaces are Buffers (FloatBuffer: fp32,
// Bf16Buffer: bf16 bit patterns) allocated by an Allocator — the host's, or a backend's
// (backend/backend.h), which is what makes the device tag true and lets a backend count what it
// allocates. Ops are handed Spans: a pointer, an element count and the device the memory is on,
// which the backend checks before it touches anything (an operand on the wrong device or too
// short is an Error, not a crash). Host memory is 64-byte aligned, so each row of an [M, D] block
// with D a multiple of 16 starts on a cache line.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace meshtune {

enum class Device { Host, Cuda };
const char* device_name(Device device);  // "host", "cuda"

void* allocate_host(size_t bytes);  // 64-byte aligned; throws std::bad_alloc
void free_host(void* p);

// Where a Buffer's memory comes from.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  virtual void* allocate(size_t bytes) = 0;  // throws std::bad_alloc
  virtual void release(void* p) = 0;
};
Allocator& host_memory();  // plain aligned host allocations, uncounted

// A view of `size` elements at `data` on `device`; no ownership. Span<const E> for inputs.
template <class E>
struct Span {
  E* data = nullptr;
  size_t size = 0;
  Device device = Device::Host;

  Span() = default;
  Span(E* d, size_t n, Device dev = Device::Host) : data(d), size(n), device(dev) {}
  // Host vectors are host memory (norm scales, positions, masks).
  Span(std::vector<std::remove_const_t<E>>& v) : data(v.data()), size(v.size()) {}
  template <class F = E, std::enable_if_t<std::is_const_v<F>, int> = 0>
  Span(const std::vector<std::remove_const_t<E>>& v) : data(v.data()), size(v.size()) {}
  // Span<E> → Span<const E>.
  template <class F, class = std::enable_if_t<std::is_same_v<const F, E> && !std::is_same_v<F, E>>>
  Span(const Span<F>& s) : data(s.data), size(s.size), device(s.device) {}

  bool empty() const { return data == nullptr; }
  // Elements offset … offset + n − 1 (clamped to what there is, so a short view is caught by the op).
  Span part(size_t offset, size_t n) const {
    const size_t start = offset < size ? offset : size;
    return Span(data + start, n < size - start ? n : size - start, device);
  }
};

template <class Element>
class Buffer {
 public:
  Buffer() = default;
  // `count` elements, all zero (host memory only: a device's zeros come from its backend).
  explicit Buffer(size_t count, Allocator& memory = host_memory()) : allocator_(&memory) {
    resize(count);
    if (allocator_->device() == Device::Host) std::memset(data_.get(), 0, count * sizeof(Element));
  }
  Buffer(Buffer&&) noexcept = default;
  Buffer& operator=(Buffer&&) noexcept = default;
  // Copies go through an op (Backend::copy), which knows where memory is.
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  Element* data() { return data_.get(); }
  const Element* data() const { return data_.get(); }
  size_t size() const { return size_; }
  Device device() const { return allocator_->device(); }
  operator Span<Element>() { return {data(), size_, device()}; }
  operator Span<const Element>() const { return {data(), size_, device()}; }
  Span<Element> span() { return *this; }
  Span<const Element> span() const { return *this; }

  // Makes room for `count` elements from `memory` (default: where it is now). The values are then
  // undefined — callers overwrite them (every op writes its whole output) — and memory is only
  // reallocated when `count` exceeds what was ever allocated (or the allocator changes), so
  // buffers reused from step to step allocate nothing.
  void resize(size_t count) { resize(count, *allocator_); }
  void resize(size_t count, Allocator& memory) {
    if (count > capacity_ || !data_ || &memory != allocator_) {
      data_.reset();
      allocator_ = &memory;
      data_ = std::unique_ptr<Element, Free>(static_cast<Element*>(memory.allocate(count * sizeof(Element))),
                                             Free{&memory});
      capacity_ = count;
    }
    size_ = count;
  }

 private:
  struct Free {
    Allocator* allocator = nullptr;
    void operator()(Element* p) const { allocator->release(p); }
  };
  std::unique_ptr<Element, Free> data_;
  size_t size_ = 0, capacity_ = 0;
  Allocator* allocator_ = &host_memory();
};

using FloatBuffer = Buffer<float>;
using Bf16Buffer = Buffer<uint16_t>;

}  // namespace meshtune
