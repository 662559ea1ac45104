// What this machine can do at best, measured in the same run as the inference benchmark so the
// ratios compare like with like: the OpenBLAS sgemm rate, the memory bandwidths and the arithmetic
// peaks. All
// measurements use the current OpenMP thread count (omp_get_max_threads) and report medians.
#pragma once
#include <cstddef>

namespace meshtune::bench {

// GFLOP/s (2·M·N·K per call) of cblas_sgemm C[M,N] = A[M,K]·B, with B given as [N,K] and
// transposed when `b_transposed` (the layout `linear` passes). Median of `reps` timed calls after
// one untimed warm-up call.
double sgemm_gflops(int M, int N, int K, bool b_transposed, int reps);

// Copy bandwidth: each thread memcpy's its share of a `bytes` buffer into a second buffer.
// GB/s = bytes copied / s (1 GB = 1e9 bytes); the memory traffic is about twice that (read + write).
double copy_gbps(size_t bytes, int reps);

// One read-bandwidth sample over memory that already exists (the model's own weights, between
// benchmark repeats): `threads` threads sum their shares of `bytes` at `p` as below. GB/s.
double read_gbps_once(const void* p, size_t bytes, int threads);

// Read bandwidth: each of `threads` threads sums its share of a `bytes` float array with AVX-512
// (eight independent accumulators, so the adds never limit). GB/s = bytes read / s.
double read_gbps(size_t bytes, int reps, int threads);

// The arithmetic peaks of this CPU on `threads` threads: each thread runs a loop of one instruction
// on 16 independent accumulators (enough to hide any latency, so the loop is throughput-bound),
// 0 when the CPU lacks it. fp32 FMA (AVX-512, else AVX2: 2 FLOP per lane), bf16 dot product
// (vdpbf16ps: 2 multiply-adds per fp32 lane = 4 FLOP), int8 dot product (vpdpbusd: 4 per lane =
// 8 OP). GFLOP/s (GOP/s), the median of 5 runs of ~20 ms.
double fma_f32_peak_gflops(int threads);
double bf16_dot_peak_gflops(int threads);
double int8_dot_peak_gops(int threads);

}  // namespace meshtune::bench
