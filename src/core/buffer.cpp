#include "core/buffer.h"

#include <cstdlib>
#include <new>

namespace meshtune {

void* allocate_host(size_t bytes) {
  bytes = (bytes + 63) / 64 * 64;  // aligned_alloc wants a multiple of the alignment
  void* p = std::aligned_alloc(64, bytes == 0 ? 64 : bytes);
  if (!p) throw std::bad_alloc();
  return p;
}

void free_host(void* p) { std::free(p); }

}  // namespace meshtune
