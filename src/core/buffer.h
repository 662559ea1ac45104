// The memory activations, KV caches and workspaces live in. Model code never allocates those as
// std::vectors: it asks for FloatBuffers and hands their pointers to kernels, which are what touch
// the values. Host memory is the only kind today (64-byte aligned, so each row of an [M, D] block
// with D a multiple of 16 starts on a cache line); a device backend will hand out its own memory
// through this type, and its kernels will be the ones given the pointers.
#pragma once
#include <cstddef>
#include <memory>

namespace meshtune {

enum class Memory { Host };

class FloatBuffer {
 public:
  FloatBuffer() = default;
  // `count` floats, all zero.
  explicit FloatBuffer(size_t count, Memory memory = Memory::Host);
  FloatBuffer(FloatBuffer&&) noexcept = default;
  FloatBuffer& operator=(FloatBuffer&&) noexcept = default;
  // Copies go through a kernel (kernels/tensor_ops.h copy_values), which knows where memory is.
  FloatBuffer(const FloatBuffer&) = delete;
  FloatBuffer& operator=(const FloatBuffer&) = delete;

  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  size_t size() const { return size_; }
  Memory memory() const { return memory_; }
  // Makes room for `count` floats. The values are then undefined — callers overwrite them (every
  // kernel writes its whole output) — and memory is only reallocated when `count` exceeds what was
  // ever allocated, so buffers reused from step to step allocate nothing.
  void resize(size_t count);

 private:
  struct Free {
    void operator()(float* p) const;
  };
  std::unique_ptr<float, Free> data_;
  size_t size_ = 0, capacity_ = 0;
  Memory memory_ = Memory::Host;
};

}  // namespace meshtune
