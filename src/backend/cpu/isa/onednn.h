// The products meshtune hands to oneDNN (Debian libdnnl-dev) where the build found it: the int8,
// fp32 and bf16 GEMMs of prefill and training, where a CpuBackend measured them faster than OpenBLAS
// and our own kernels (backend/cpu/routes.h). oneDNN picks its
// own instruction set (ONEDNN_MAX_CPU_ISA limits it); MESHTUNE_CPU does not reach it. Without
// oneDNN, onednn_available() is false and callers use their own kernels.
#pragma once
#include <cstdint>

namespace meshtune::cpu {

bool onednn_available();
const char* onednn_version();  // "2.6.3"

// y[m·rows + r] = float(Σ_c x[m·cols + c]·w[r·cols + c]) / (x_scales[m]·w_scales[r]): int8 codes,
// exact int32 sums, Keras' dequantization (the same floats as cpu/int8_dot.h's kernels).
void dot_int8_onednn(const int8_t* x, int64_t M, const float* x_scales, const int8_t* w, const float* w_scales,
                     int64_t rows, int64_t cols, float* y);
// Whether that product's sums are exact on this CPU, checked once on codes at ±127: without VNNI
// (AVX2, AVX-512 without VNNI) oneDNN multiplies through saturating 16-bit pair sums and scales the
// weights down to avoid them, so its int32 sums are not the products' (seen on an AVX2-only EPYC:
// errors of 1.4 relative). Callers keep their own kernels where this is false.
bool onednn_int8_exact();

// c[M, N] (+)= A · B, fp32 sums and output, both operands fp32 or both bf16 (`bf16`); each matrix
// row-major with its leading dimension (lda, ldb, ldc: elements between rows as stored). A [M, K]
// is stored as [K, M] when `a_transposed` (dW = dyᵀ·x); B [K, N] is stored as [N, K] when
// `b_transposed` (y = x·Wᵀ with W [out, in]). `accumulate` adds into c.
void matmul_onednn(bool bf16, int64_t M, int64_t K, int64_t N, const void* a, int64_t lda, bool a_transposed,
                   const void* b, int64_t ldb, bool b_transposed, float* c, int64_t ldc, bool accumulate);

}  // namespace meshtune::cpu
