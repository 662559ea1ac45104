// The paths of the decode matrix-vector product (backend/cpu/linear.h: y = x·Wᵀ for M ≤ 4 rows of x,
// W [rows, cols] fp32 or bf16) and of bf16 → fp32 widening, one file per instruction set. The
// AVX2 and AVX-512 files are compiled with their own -m flags and linear() picks one at run time
// (backend/cpu/isa/features.h). Those files use no standard-library templates and no inline functions
// from other headers: the linker keeps one copy of such code for the whole program, and a copy
// compiled with AVX-512 would then run on CPUs without it.
#pragma once
#include <omp.h>

#include <cstdint>

namespace meshtune::cpu {

// y[m·rows + r] = Σ_c x[m·cols + c]·W[r, c] for m < M (M ≤ 4); `scratch` holds
// gemv_scratch_floats(M, cols) floats (x rearranged for the vector loads).
static inline int64_t gemv_scratch_floats(int64_t M, int64_t cols) { return M * ((cols + 31) / 32 * 32); }
void gemv_f32_generic(const float* x, int64_t M, const float* w, int64_t rows, int64_t cols, float* y, float* scratch);
void gemv_bf16_generic(const float* x, int64_t M, const uint16_t* w, int64_t rows, int64_t cols, float* y, float* scratch);
void gemv_f32_avx2(const float* x, int64_t M, const float* w, int64_t rows, int64_t cols, float* y, float* scratch);
void gemv_bf16_avx2(const float* x, int64_t M, const uint16_t* w, int64_t rows, int64_t cols, float* y, float* scratch);
void gemv_f32_avx512(const float* x, int64_t M, const float* w, int64_t rows, int64_t cols, float* y, float* scratch);
void gemv_bf16_avx512(const float* x, int64_t M, const uint16_t* w, int64_t rows, int64_t cols, float* y, float* scratch);

// dst[i] = bf16 src[i] as fp32, i < n.
void widen_bf16_generic(const uint16_t* src, int64_t n, float* dst);
void widen_bf16_avx2(const uint16_t* src, int64_t n, float* dst);
void widen_bf16_avx512(const uint16_t* src, int64_t n, float* dst);

// Items [begin, end) of n for thread t of `threads`: one contiguous piece per thread, so each
// thread streams its own stretch of W.
static inline void thread_share(int64_t n, int t, int threads, int64_t& begin, int64_t& end) {
  begin = n * t / threads;
  end = n * (t + 1) / threads;
}

// The threading of the row-blocked kernels (the decode products, the int8 dot products): output
// rows in blocks of `block_rows`, the blocks split over the OpenMP threads by thread_share, and
// block(r, n, prefetch) called for each — n rows from r (fewer than block_rows only for the last
// block), `prefetch` set when the next block is this thread's too and full, so that its weights
// can be fetched while this one is computed. `static`: every ISA file keeps its own copy.
template <class Block>
static inline void for_each_row_block(int64_t rows, int64_t block_rows, const Block& block) {
  const int64_t blocks = (rows + block_rows - 1) / block_rows;
#pragma omp parallel
  {
    int64_t b0, b1;
    thread_share(blocks, omp_get_thread_num(), omp_get_num_threads(), b0, b1);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = b * block_rows;
      block(r, rows - r < block_rows ? rows - r : block_rows, b + 1 < b1 && rows - r >= 2 * block_rows);
    }
  }
}

}  // namespace meshtune::cpu
