// HostTensor: a named n-dimensional array in host memory as a file gave it to us (any dtype),
// owning its bytes or aliasing a memory map (kept alive by `owner`). Model code converts these into
// its own weight matrices; this type only carries bytes, dtype and shape between io and model.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/scalar_math.h"

namespace meshtune {

enum class DType { F32, BF16, F16, I32, I64, I8, U8, BOOL };

size_t dtype_size(DType dt);
const char* dtype_name(DType dt);  // "float32", "bfloat16", "float16", "int32", "int64", "int8", "uint8", "bool"

using Shape = std::vector<int64_t>;
int64_t num_elements(const Shape& shape);
std::string shape_str(const Shape& shape);  // "(4, 64, 16)"

struct HostTensor {
  DType dtype = DType::F32;
  Shape shape;
  // num_elements(shape) * dtype_size(dtype) bytes; a view of a file (safetensors, the loader's HDF5
  // maps) may be misaligned for its dtype: such are read through memcpy, not as<T>()
  const std::byte* data = nullptr;
  std::shared_ptr<const void> owner;  // keeps `data` alive (a buffer or a memory map)
  bool mapped = false;  // `data` views a read-only memory map of a file: never write through it

  size_t nbytes() const { return size_t(num_elements(shape)) * dtype_size(dtype); }
  template <typename T> const T* as() const { return reinterpret_cast<const T*>(data); }

  // A new tensor owning a zero-filled buffer of the given dtype and shape.
  static HostTensor allocate(DType dtype, Shape shape);
  // Mutable access to a tensor made by allocate().
  template <typename T> T* mutable_as() { return reinterpret_cast<T*>(const_cast<std::byte*>(data)); }
};

// What a tensor will be before it exists: the streaming writers take these up front (a header
// comes before the data) and a TensorSource that makes tensor i when it is about to be written.
struct TensorSpec {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
};
using TensorSource = std::function<HostTensor(size_t index)>;
// Throws Error (naming `where` and the tensor) when a source's tensor differs from its declaration.
void check_declared(const HostTensor& t, const TensorSpec& spec, const std::string& where);

float f16_to_f32(uint16_t h);

// Converts any floating tensor (F32/BF16/F16) to a contiguous float vector.
std::vector<float> to_f32(const HostTensor& t);

// A new tensor of shape `out_shape` holding `in` (viewed as `dims`) with its dimensions reordered:
// out[j0][j1][j2] = in[i0][i1][i2] where out dimension k is in dimension perm[k].
HostTensor permute3(const HostTensor& in, std::array<int64_t, 3> dims, std::array<int, 3> perm, const Shape& out_shape);
// Rows [first_row, first_row + rows) of that permutation viewed as rows of `row_length` elements
// (the last output dimension, or the last two), written to `dst` in `in`'s dtype, on the calling
// thread only — for a caller that processes a matrix band by band in parallel.
void permute3_rows(const HostTensor& in, std::array<int64_t, 3> dims, std::array<int, 3> perm, int64_t row_length,
                   int64_t first_row, int64_t rows, std::byte* dst);

}  // namespace meshtune
