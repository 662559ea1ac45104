#include "core/tensor.h"

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

HostTensor HostTensor::allocate(DType dtype, Shape shape) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  auto buffer = std::shared_ptr<std::byte[]>(new std::byte[t.nbytes() + 1]());
  t.data = buffer.get();
  t.owner = buffer;
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

}  // namespace meshtune
