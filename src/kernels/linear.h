// The linear-layer kernel and its backward: y = x · Wᵀ with W stored [out, in] row-major (Hugging
// Face's Linear layout), in fp32 or bf16. Large batches go to OpenBLAS sgemm; a few rows (decode)
// take a matrix-vector path that streams W once at memory bandwidth, converting bf16 on the fly,
// chosen at run time for the CPU (kernels/cpu/gemv.h).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"

namespace meshtune {

struct WeightMatrix {
  int64_t rows = 0;  // out
  int64_t cols = 0;  // in
  DType dtype = DType::F32;  // F32 or BF16
  const void* data = nullptr;
  std::shared_ptr<const void> owner;  // keeps data alive (own buffer or a memory map)
  bool mapped = false;  // data lies in a memory-mapped file: a part may be shared without keeping
                        // heap memory alive (ShardedModel keeps such row blocks as views)

  const float* f32() const { return static_cast<const float*>(data); }
  const uint16_t* bf16() const { return static_cast<const uint16_t*>(data); }
  size_t nbytes() const { return size_t(rows) * size_t(cols) * dtype_size(dtype); }
  float at(int64_t r, int64_t c) const {
    size_t i = size_t(r) * size_t(cols) + size_t(c);
    return dtype == DType::F32 ? f32()[i] : bf16_to_f32(bf16()[i]);
  }
  // Row r converted to fp32 into out[cols].
  void row_to_f32(int64_t r, float* out) const;
  // All values as fp32 (a copy), and a matrix owning the given fp32 values.
  std::vector<float> to_f32() const;
  static WeightMatrix from_f32(int64_t rows, int64_t cols, std::vector<float> values);
};

// y[m, 0:rows] = Σ_k x[m, k] · W[r, k], for m < M. x is [M, cols], y is [M, rows], both row-major.
void linear(const float* x, int64_t M, const WeightMatrix& W, float* y);

// The plain triple loop (double accumulation): the reference the tests compare `linear` against.
void linear_reference(const float* x, int64_t M, const WeightMatrix& W, float* y);

// Backward of linear (y = x·Wᵀ, W [out, in]): dx = dy·W and dW = dyᵀ·x, through OpenBLAS.
// dx[M, cols] (+)= dy[M, rows] · W. `accumulate` adds into dx instead of overwriting.
void linear_backward_input(const float* dy, int64_t M, const WeightMatrix& W, float* dx, bool accumulate = false);

// dW[rows, cols] += dy[M, rows]ᵀ · x[M, cols].
void linear_backward_weight(const float* dy, const float* x, int64_t M, int64_t rows, int64_t cols, float* dW);


// bf16 → fp32 for n values, on the CPU path in use.
void widen_bf16(const uint16_t* src, int64_t n, float* dst);

}  // namespace meshtune
