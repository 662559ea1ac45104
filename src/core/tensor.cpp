#include "core/tensor.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <sstream>

#include "core/error.h"

namespace meshtune {

size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::F32: case DType::I32: return 4;
    case DType::BF16: case DType::F16: return 2;
    case DType::I64: return 8;
    case DType::I8: case DType::U8: case DType::BOOL: return 1;
  }
  return 0;
}

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::I8: return "int8";
    case DType::U8: return "uint8";
    case DType::BOOL: return "bool";
  }
  return "?";
}

int64_t num_elements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_str(const Shape& shape) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  if (shape.size() == 1) out << ",";
  out << ")";
  return out.str();
}

// Buffers of this size or more come straight from mmap: the kernel's fresh pages are zero already
// (no second pass clearing them, as new[]() would make) and, marked MADV_HUGEPAGE, may be 2 MiB
// pages: one page fault per 2 MiB instead of 512. Loading a 7B preset spent over half its time
// zero-filling buffers and faulting their 4 KiB pages in.
constexpr size_t kMappedBufferBytes = size_t(4) << 20;

HostTensor HostTensor::allocate(DType dtype, Shape shape) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  const size_t bytes = t.nbytes() + 1;
  if (bytes < kMappedBufferBytes) {
    auto buffer = std::shared_ptr<std::byte[]>(new std::byte[bytes]());
    t.data = buffer.get();
    t.owner = buffer;
    return t;
  }
  void* addr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (addr == MAP_FAILED) fail("cannot allocate ", bytes, " bytes for a ", dtype_name(dtype), " tensor of shape ",
                               shape_str(t.shape), ": ", std::strerror(errno));
  madvise(addr, bytes, MADV_HUGEPAGE);  // advice only: without transparent huge pages, 4 KiB pages
  t.data = static_cast<const std::byte*>(addr);
  t.owner = std::shared_ptr<const void>(addr, [bytes](const void* p) { munmap(const_cast<void*>(p), bytes); });
  return t;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) { mant <<= 1; --exp; }
      u = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::vector<float> to_f32(const HostTensor& t) {
  size_t n = size_t(num_elements(t.shape));
  std::vector<float> out(n);
  switch (t.dtype) {
    case DType::F32: std::memcpy(out.data(), t.data, n * 4); break;
    case DType::BF16: {
      for (size_t i = 0; i < n; ++i) { uint16_t b; std::memcpy(&b, t.data + 2 * i, 2); out[i] = bf16_to_f32(b); }
      break;
    }
    case DType::F16: {
      for (size_t i = 0; i < n; ++i) { uint16_t b; std::memcpy(&b, t.data + 2 * i, 2); out[i] = f16_to_f32(b); }
      break;
    }
    default: fail("expected a floating-point tensor, got ", dtype_name(t.dtype));
  }
  return out;
}

void check_declared(const HostTensor& t, const TensorSpec& spec, const std::string& where) {
  check(t.dtype == spec.dtype && t.shape == spec.shape, where, ": tensor \"", spec.name, "\" came as ",
        dtype_name(t.dtype), " ", shape_str(t.shape), ", declared ", dtype_name(spec.dtype), " ", shape_str(spec.shape));
  check(t.nbytes() == 0 || t.data != nullptr, where, ": tensor \"", spec.name, "\" has no data");
}

constexpr int64_t kPermuteTile = 16;  // 1.4× faster than 32 at a 7B Dense kernel's transposition (2 threads)

// The output tile at (a0, b0, c0) of permute_elements.
template <typename Element>
static void permute_tile(const std::byte* src, Element* dst, std::array<int64_t, 3> od, std::array<int64_t, 3> s,
                         int64_t a0, int64_t b0, int64_t c0) {
  for (int64_t a = a0; a < std::min(a0 + kPermuteTile, od[0]); ++a)
    for (int64_t b = b0; b < std::min(b0 + kPermuteTile, od[1]); ++b)
      for (int64_t c = c0; c < std::min(c0 + kPermuteTile, od[2]); ++c)
        // memcpy: a view of a file may be misaligned for its type (one mov all the same)
        std::memcpy(&dst[(a * od[1] + b) * od[2] + c], src + (a * s[0] + b * s[1] + c * s[2]) * int64_t(sizeof(Element)),
                    sizeof(Element));
}

// dst[a][b][c] (row-major, shape `od`) = src[a·s0 + b·s1 + c·s2], in tiles of kPermuteTile³
// elements so that reads and writes both stay within a few cache lines whatever the permutation
// (walking the output in order reads the source a cache line per element: minutes for a 7B
// model's matrices). In parallel over tiles, or serially (a caller's thread permuting its part).
template <typename Element>
static void permute_elements(const std::byte* src, Element* dst, std::array<int64_t, 3> od, std::array<int64_t, 3> s,
                             bool parallel) {
  // In parallel over tiles of the output: a 7B preset's permutations were a fifth of its load time.
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
  for (int64_t a0 = 0; a0 < od[0]; a0 += kPermuteTile)
    for (int64_t b0 = 0; b0 < od[1]; b0 += kPermuteTile)
      for (int64_t c0 = 0; c0 < od[2]; c0 += kPermuteTile) permute_tile(src, dst, od, s, a0, b0, c0);
}

// permute_elements for elements of `element_size` bytes, moved as unsigned integers of that size.
static void permute_bytes(size_t element_size, const std::byte* src, std::byte* dst, std::array<int64_t, 3> od,
                          std::array<int64_t, 3> s, bool parallel) {
  switch (element_size) {
    case 1: return permute_elements(src, reinterpret_cast<uint8_t*>(dst), od, s, parallel);
    case 2: return permute_elements(src, reinterpret_cast<uint16_t*>(dst), od, s, parallel);
    case 4: return permute_elements(src, reinterpret_cast<uint32_t*>(dst), od, s, parallel);
    case 8: return permute_elements(src, reinterpret_cast<uint64_t*>(dst), od, s, parallel);
    default: fail("permuting a tensor: unsupported element size ", element_size);
  }
}

// The permutation's output dimensions and the input strides each walks.
struct Permutation {
  std::array<int64_t, 3> od, strides;
};
static Permutation permutation(std::array<int64_t, 3> dims, std::array<int, 3> perm) {
  const std::array<int64_t, 3> in_strides = {dims[1] * dims[2], dims[2], 1};
  return {{dims[perm[0]], dims[perm[1]], dims[perm[2]]}, {in_strides[perm[0]], in_strides[perm[1]], in_strides[perm[2]]}};
}

void permute3_rows(const HostTensor& in, std::array<int64_t, 3> dims, std::array<int, 3> perm, int64_t row_length,
                   int64_t first_row, int64_t rows, std::byte* dst) {
  const Permutation p = permutation(dims, perm);
  const std::array<int64_t, 3>& od = p.od;
  const int64_t size = int64_t(dtype_size(in.dtype));
  auto serial = [&](const std::byte* from, std::byte* to, std::array<int64_t, 3> sub) {
    permute_bytes(size_t(size), from, to, sub, p.strides, /*parallel=*/false);
  };
  if (row_length == od[1] * od[2]) {  // a row is one index of the first output dimension
    return serial(in.data + first_row * p.strides[0] * size, dst, {rows, od[1], od[2]});
  }
  check(row_length == od[2], "permute3_rows: a row of ", row_length, " elements is neither the last output "
        "dimension (", od[2], ") nor the last two");
  for (int64_t r = first_row; r < first_row + rows;) {  // a row is an (a, b) pair: runs of b within one a
    const int64_t a = r / od[1], b = r % od[1], n = std::min(od[1] - b, first_row + rows - r);
    serial(in.data + (a * p.strides[0] + b * p.strides[1]) * size, dst + (r - first_row) * row_length * size, {1, n, od[2]});
    r += n;
  }
}

HostTensor permute3(const HostTensor& in, std::array<int64_t, 3> dims, std::array<int, 3> perm,
                           const Shape& out_shape) {
  HostTensor out = HostTensor::allocate(in.dtype, out_shape);
  const auto [od, strides] = permutation(dims, perm);
  permute_bytes(dtype_size(in.dtype), in.data, out.mutable_as<std::byte>(), od, strides, /*parallel=*/true);
  return out;
}

}  // namespace meshtune
