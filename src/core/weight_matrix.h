// A weight matrix as the model holds it — fp32, bf16, or int8 codes with one scale per row — and
// the host-side preparation of such matrices at load: bf16 rounding and Keras' int8 quantization.
// The kernels that multiply by them live in the backends (backend/backend.h).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/scalar_math.h"
#include "core/tensor.h"

namespace meshtune {

// A weight matrix [rows = out, cols = in], row-major, tagged with its dtype: F32, BF16, or I8 codes
// with one fp32 scale per row (output channel), W[r, c] = code[r, c] / scales[r] — Keras' int8
// `kernel_scale` convention (below).
struct WeightMatrix {
  int64_t rows = 0;  // out
  int64_t cols = 0;  // in
  DType dtype = DType::F32;  // F32, BF16 or I8
  const void* data = nullptr;
  std::shared_ptr<const void> owner;  // keeps data (and scales) alive: own buffer or a memory map
  bool mapped = false;  // data lies in a memory-mapped file: a part may be shared without keeping
                        // heap memory alive (ShardedModel keeps such row blocks as views)
  const float* scales = nullptr;  // I8 only: [rows]
  Device device = Device::Host;   // where data (and scales) are

  const float* f32() const { return static_cast<const float*>(data); }
  const uint16_t* bf16() const { return static_cast<const uint16_t*>(data); }
  const int8_t* i8() const { return static_cast<const int8_t*>(data); }
  size_t nbytes() const {
    return size_t(rows) * size_t(cols) * dtype_size(dtype) + (dtype == DType::I8 ? size_t(rows) * 4 : 0);
  }
  float at(int64_t r, int64_t c) const {
    size_t i = size_t(r) * size_t(cols) + size_t(c);
    switch (dtype) {
      case DType::BF16: return bf16_to_f32(bf16()[i]);
      case DType::I8: return float(i8()[i]) / scales[r];
      default: return f32()[i];
    }
  }
  // Row r converted to fp32 into out[cols] (I8: dequantized, code / scale). Host memory only.
  void row_to_f32(int64_t r, float* out) const;
  // All values as fp32 (a copy), and a matrix owning the given fp32 values.
  std::vector<float> to_f32() const;
  static WeightMatrix from_f32(int64_t rows, int64_t cols, std::vector<float> values);
};

// A weight vector — RMSNorm's scales, fp32 — held like a WeightMatrix: copies of a model share its
// storage (so a block's weights copy cheaply), and it is tagged with where its memory is. Assigning
// host values replaces the storage; full fine-tuning updates it in place through values().
class WeightVector {
 public:
  WeightVector() = default;
  WeightVector(std::vector<float> host);  // NOLINT: host values become the vector (load, init)
  explicit WeightVector(std::shared_ptr<FloatBuffer> storage) : storage_(std::move(storage)) {}

  size_t size() const { return storage_ ? storage_->size() : 0; }
  bool empty() const { return size() == 0; }
  Device device() const { return storage_ ? storage_->device() : Device::Host; }
  operator Span<const float>() const { return storage_ ? storage_->span() : Span<const float>(); }
  Span<float> values() const { return storage_ ? storage_->span() : Span<float>(); }
  const float* data() const { return storage_ ? storage_->data() : nullptr; }  // host code: load, save, sharding
  std::vector<float> to_f32() const;  // a host copy; an Error for device memory (download it instead)

 private:
  std::shared_ptr<FloatBuffer> storage_;
};

// What a matrix product's float inputs are: F32 as given, or BF16 — x (dy in backward) and W
// rounded to bf16 (nearest even), the products summed in fp32 and written as fp32: the matmuls of
// Keras' mixed_bfloat16 and bfloat16 policies. int8 matrices take the int8 path whatever the precision.
enum class MatmulPrecision { F32, BF16 };

// W stored as bf16, rounded to nearest even (W itself when it is bf16 or int8 already).
WeightMatrix to_bf16_matrix(const WeightMatrix& W);

// ---- int8 as Keras' `quantize("int8")` defines it (../shared/fixtures/keras2/int8.md, the contract):
// abs-max codes with one fp32 scale per row, s = 127 / (max|v| + 1e-7), code = clip(round half to
// even(v·s), −127, 127). Weights are quantized once per output channel (a row of our [out, in]
// layout); activations per token at every call (the backends' int8 linear); y = int32(x_codes ·
// W_codesᵀ) / (s_x · s_W), one float division. Every step is bit-identical to Keras' numpy arithmetic.

// int8_scale(abs_max) and int8_code(v, s): core/scalar_math.h (the GPU's kernels use them too).
float abs_max(const float* values, int64_t n);  // max |values[i]|, 0 for none
// codes[0:n] of values[0:n]; returns their scale s (value ≈ code / s).
float quantize_int8(const float* values, int64_t n, int8_t* codes);
// The same with the scale given: when `values` are a slice of a longer row, the scale is the
// whole row's (int8_scale of its max|v|), and the codes are the whole row's codes of this slice.
void quantize_int8_scaled(const float* values, int64_t n, float scale, int8_t* codes);
// out[c] = code[c] / scale (Keras' dequantization, a division).
void dequantize_int8(const int8_t* codes, int64_t n, float scale, float* out);

// The widest row whose int32 sum of code products cannot overflow: 127² · cols < 2³¹.
inline constexpr int64_t kMaxInt8Columns = 133144;
// Throws Error naming `what` when an int8 matrix would be wider than that.
void check_int8_columns(int64_t cols, const std::string& what);

// W (any dtype, read as fp32) quantized row by row: an I8 matrix owning its codes and scales.
// `row_max` (W.rows values), when given, is each row's max|v| over the whole row of which W holds
// some columns (a block split along the contraction, tensor parallelism); else W's own.
WeightMatrix quantize_matrix_int8(const WeightMatrix& W, const float* row_max = nullptr);
// quantize_matrix_int8 of permute3(in, dims, perm, {rows, cols}) (an F32 or BF16 tensor), without
// the permuted copy: each thread permutes a band of rows into a buffer that stays in its cache and
// quantizes it there (a 7B int8 load spent half its time clearing and filling the copies).
WeightMatrix quantize_permuted_int8(const HostTensor& in, std::array<int64_t, 3> dims, std::array<int, 3> perm,
                                    int64_t rows, int64_t cols);
std::vector<float> matrix_row_abs_max(const WeightMatrix& W);  // max|W[r, :]| for every row

}  // namespace meshtune
