// The memory activations, KV caches and workspaces live in. Model code never allocates those as
// std::vectors: it asks for FloatBuffers (fp32) or Bf16Buffers (bf16 bit patterns, for activations
// kept in bf16) and hands their pointers to kernels, which are what touch the values. Host memory is
// the only kind today (64-byte aligned, so each row of an [M, D] block with D a multiple of 16 starts
// on a cache line); a device backend will hand out its own memory through this type, and its
// kernels will be the ones given the pointers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

namespace meshtune {

enum class Memory { Host };

void* allocate_host(size_t bytes);  // 64-byte aligned; throws std::bad_alloc
void free_host(void* p);

template <class Element>
class Buffer {
 public:
  Buffer() = default;
  // `count` elements, all zero.
  explicit Buffer(size_t count, Memory memory = Memory::Host) : memory_(memory) {
    resize(count);
    std::memset(data_.get(), 0, count * sizeof(Element));
  }
  Buffer(Buffer&&) noexcept = default;
  Buffer& operator=(Buffer&&) noexcept = default;
  // Copies go through a kernel (kernels/tensor_ops.h copy_values), which knows where memory is.
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  Element* data() { return data_.get(); }
  const Element* data() const { return data_.get(); }
  size_t size() const { return size_; }
  Memory memory() const { return memory_; }
  // Makes room for `count` elements. The values are then undefined — callers overwrite them (every
  // kernel writes its whole output) — and memory is only reallocated when `count` exceeds what was
  // ever allocated, so buffers reused from step to step allocate nothing.
  void resize(size_t count) {
    if (count > capacity_ || !data_) {
      data_.reset(static_cast<Element*>(allocate_host(count * sizeof(Element))));
      capacity_ = count;
    }
    size_ = count;
  }

 private:
  struct Free {
    void operator()(Element* p) const { free_host(p); }
  };
  std::unique_ptr<Element, Free> data_;
  size_t size_ = 0, capacity_ = 0;
  Memory memory_ = Memory::Host;
};

using FloatBuffer = Buffer<float>;
using Bf16Buffer = Buffer<uint16_t>;

}  // namespace meshtune
