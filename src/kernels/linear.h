// The linear-layer kernel and its backward: y = x · Wᵀ with W stored [out, in] row-major (Hugging
// Face's Linear layout), in fp32, bf16 or int8 (kernels/int8.h). Large batches go to OpenBLAS sgemm; a few rows (decode)
// take a matrix-vector path that streams W once at memory bandwidth, converting bf16 on the fly,
// chosen at run time for the CPU (kernels/cpu/gemv.h).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/buffer.h"
#include "core/tensor.h"

namespace meshtune {

// A weight matrix [rows = out, cols = in], row-major, tagged with its dtype: F32, BF16, or I8 codes
// with one fp32 scale per row (output channel), W[r, c] = code[r, c] / scales[r] — Keras' int8
// `kernel_scale` convention (kernels/int8.h).
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
  // Row r converted to fp32 into out[cols] (I8: dequantized, code / scale).
  void row_to_f32(int64_t r, float* out) const;
  // All values as fp32 (a copy), and a matrix owning the given fp32 values.
  std::vector<float> to_f32() const;
  static WeightMatrix from_f32(int64_t rows, int64_t cols, std::vector<float> values);
};

// What a matrix product's float inputs are: F32 as given, or BF16 — x (dy in backward) and W
// rounded to bf16 (nearest even), the products summed in fp32 and written as fp32: the matmuls of
// Keras' mixed_bfloat16 and bfloat16 policies. Where the CPU has bf16 dot products (the
// avx512bf16 path) and the build has oneDNN, oneDNN's bf16 matmul computes it; elsewhere the same
// bf16 values are widened and summed by the fp32 paths (bf16 is then a storage format). int8
// matrices take the int8 path whatever the precision.
enum class MatmulPrecision { F32, BF16 };
// Whether more than 4 rows at BF16 go to oneDNN's bf16 matmul: only where it beats OpenBLAS sgemm
// on the widened values — with AMX-BF16 tiles. With AVX512_BF16 alone oneDNN 2.6.3 reached
// 140–150 GFLOP/s against sgemm's 185–250 on the development machine (bench/bench_gemm), so
// there bf16 stays a storage format. MESHTUNE_BF16_MATMUL=onednn|sgemm overrides; tests and the
// benchmark switch it with use_onednn_for_bf16.
bool bf16_matmul_uses_dot_products();
void use_onednn_for_bf16(bool use);

// y[m, 0:rows] = Σ_k x[m, k] · W[r, k], for m < M. x is [M, cols], y is [M, rows], both row-major.
void linear(const float* x, int64_t M, const WeightMatrix& W, float* y, MatmulPrecision precision = MatmulPrecision::F32);

// Backward of linear (y = x·Wᵀ, W [out, in]): dx = dy·W and dW = dyᵀ·x, through OpenBLAS. For I8,
// dx uses the dequantized W and treats the activation quantizer as the identity (straight-through),
// as Keras' int8 EinsumDense gradient does.
// dx[M, cols] (+)= dy[M, rows] · W. `accumulate` adds into dx instead of overwriting.
void linear_backward_input(const float* dy, int64_t M, const WeightMatrix& W, float* dx, bool accumulate = false,
                           MatmulPrecision precision = MatmulPrecision::F32);

// dW[rows, cols] += dy[M, rows]ᵀ · x[M, cols].
void linear_backward_weight(const float* dy, const float* x, int64_t M, int64_t rows, int64_t cols, float* dW);


// bf16 → fp32 for n values, on the CPU path in use (on the calling thread; widen_bf16_parallel
// spreads a large array over the threads); fp32 → bf16 (nearest even, NaN kept, over the threads).
void widen_bf16(const uint16_t* src, int64_t n, float* dst);
void widen_bf16_parallel(const uint16_t* src, int64_t n, float* dst);
void narrow_to_bf16(const float* src, int64_t n, uint16_t* dst);
// W stored as bf16 (W itself when it is bf16 or int8 already).
WeightMatrix to_bf16_matrix(const WeightMatrix& W);

}  // namespace meshtune
