#include "core/buffer.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace meshtune {

void FloatBuffer::Free::operator()(float* p) const { std::free(p); }

static float* allocate_host(size_t count) {
  const size_t bytes = (count * sizeof(float) + 63) / 64 * 64;  // aligned_alloc wants a multiple of the alignment
  void* p = std::aligned_alloc(64, bytes == 0 ? 64 : bytes);
  if (!p) throw std::bad_alloc();
  return static_cast<float*>(p);
}

FloatBuffer::FloatBuffer(size_t count, Memory memory) : memory_(memory) {
  resize(count);
  std::memset(data_.get(), 0, count * sizeof(float));
}

void FloatBuffer::resize(size_t count) {
  if (count > capacity_ || !data_) {
    data_.reset(allocate_host(count));
    capacity_ = count;
  }
  size_ = count;
}

}  // namespace meshtune
