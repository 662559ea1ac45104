// The linear-layer kernel of the CPU backend and its backward: y = x · Wᵀ with W stored [out, in]
// row-major (Hugging Face's Linear layout; core/weight_matrix.h), in fp32, bf16 or int8
// (backend/cpu/int8.h). Large batches go to OpenBLAS sgemm or oneDNN's matmul, as the path says
// (KernelPath::onednn, chosen by measurement: backend/cpu/routes.h); a few rows (decode) take a matrix-vector path that streams W once at memory
// bandwidth, converting bf16 on the fly, for the path's instruction set (backend/cpu/isa/gemv.h).
#pragma once
#include <cstdint>

#include "core/weight_matrix.h"
#include "backend/cpu/kernel_path.h"

namespace meshtune {

// y[m, 0:rows] = Σ_k x[m, k] · W[r, k], for m < M. x is [M, cols], y is [M, rows], both row-major.
// At BF16 precision, more than 4 rows go to oneDNN's bf16 matmul when the path routes Bf16Linear
// there; elsewhere the same bf16 values are widened and summed by the fp32 paths.
void linear(const KernelPath& path, const float* x, int64_t M, const WeightMatrix& W, float* y,
            MatmulPrecision precision = MatmulPrecision::F32);

// Backward of linear (y = x·Wᵀ, W [out, in]): dx = dy·W and dW = dyᵀ·x, through OpenBLAS or oneDNN. For I8,
// dx uses the dequantized W and treats the activation quantizer as the identity (straight-through),
// as Keras' int8 EinsumDense gradient does.
// dx[M, cols] (+)= dy[M, rows] · W. `accumulate` adds into dx instead of overwriting.
void linear_backward_input(const KernelPath& path, const float* dy, int64_t M, const WeightMatrix& W, float* dx,
                           bool accumulate = false, MatmulPrecision precision = MatmulPrecision::F32);

// dW[rows, cols] += dy[M, rows]ᵀ · x[M, cols].
void linear_backward_weight(const KernelPath& path, const float* dy, const float* x, int64_t M, int64_t rows, int64_t cols, float* dW);

// bf16 → fp32 for n values, on the calling thread (widen_bf16_parallel spreads a large array over
// the threads); fp32 → bf16 (nearest even, NaN kept, over the threads).
void widen_bf16(const KernelPath& path, const uint16_t* src, int64_t n, float* dst);
void widen_bf16_parallel(const KernelPath& path, const uint16_t* src, int64_t n, float* dst);
void narrow_to_bf16(const KernelPath& path, const float* src, int64_t n, uint16_t* dst);

}  // namespace meshtune
