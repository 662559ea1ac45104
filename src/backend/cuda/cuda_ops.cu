// The CUDA backend's ops other than the matrix products (cuda_backend.cu): normalization, RoPE,
// attention, activations, the chunked cross-entropy, data movement, the optimizer and the
// reductions of clipping. Each kernel is the reference backend's loop (reference_backend.cpp)
// spread over threads — one thread per output element, or one block per row where a row is
// reduced — with sums in double where the reference sums in double. Scalar arithmetic that must
// round exactly as on the CPU (bf16, RoPE's frequencies, AdamW) is core/scalar_math.h's and
// op_types.h's, the same functions the host backends run.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

#include "backend/batched_attention.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_common.cuh"

namespace meshtune {

using cuda::aligned_to;
using cuda::blocks_for;
using cuda::check_cuda;
using cuda::check_launch;
using cuda::geglu_value;
using cuda::gelu_sigmoid;
using cuda::kThreads;
using cuda::pack_bf16x4;
using cuda::quads;
using cuda::unpack_bf16x4;
using cuda::rope_pair;
using cuda::RopeCacheRows;
using cuda::RopePair;
using cuda::warp_sum;
using cuda::block_sum;

namespace {

// Scratch slots of this file (cuda_backend.cu uses 0–3).
constexpr int kRowScratch = 4;   // per-row values: RMSNorm's 1/rms
constexpr int kSumScratch = 5;   // partial sums and flags brought back to the host
constexpr int kAttentionScratch = 6;  // attention: score rows, probabilities, score gradients; decode splits
constexpr int kRowMaxScratch = 7;     // the row maxima of the parts of few long rows

// The largest `value` over the block (every thread gets it).
__device__ float block_max(float value) {
  __shared__ float partial[32];
  for (int offset = 16; offset > 0; offset /= 2) value = fmaxf(value, __shfl_down_sync(0xffffffffu, value, offset));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  float best = -INFINITY;
  for (int w = 0; w < warps; ++w) best = fmaxf(best, partial[w]);
  return best;
}

// ---- per-row reductions ----

__global__ void row_abs_max_kernel(const float* x, int64_t cols, float* out) {
  const float* row = x + blockIdx.x * cols;
  float m = 0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, fabsf(row[c]));
  m = block_max(m);
  if (threadIdx.x == 0) out[blockIdx.x] = m;
}

// 1/√(mean(x²) + eps) of the block's row (every thread gets it).
__device__ double row_inverse_rms(const float* xr, int64_t dim, float eps) {
  double ss = 0;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) ss += double(xr[i]) * xr[i];
  ss = block_sum(ss);
  return 1.0 / sqrt(ss / double(dim) + double(eps));
}

// y = RMSNorm of the block's row of x; with `branch`, x += branch first (written back: the residual
// join before the next norm; each thread then reads only the values it wrote), and into x_copy too
// where given. With `branch_scale` the branch joins normalized: x += RMSNorm(branch)·(1 + branch_scale),
// rounded to float as rmsnorm's own y is.
__global__ void __launch_bounds__(1024) rmsnorm_kernel(float* x, const float* branch, const float* branch_scale, const float* scale,
                               int64_t dim, float eps, float* y, float* x_copy) {
  float* xr = x + blockIdx.x * dim;
  if (branch) {
    const float* br = branch + blockIdx.x * dim;
    const double branch_inv = branch_scale ? row_inverse_rms(br, dim, eps) : 0;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
      xr[i] += branch_scale ? float(double(br[i]) * branch_inv * (1.0 + branch_scale[i])) : br[i];
      if (x_copy) x_copy[blockIdx.x * dim + i] = xr[i];
    }
  }
  const double inv = row_inverse_rms(xr, dim, eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
    y[blockIdx.x * dim + i] = float(double(xr[i]) * inv * (1.0 + scale[i]));
}

// Each row's 1/rms, for backward's two kernels.
__global__ void rmsnorm_inverse_kernel(const float* x, int64_t dim, float eps, double* inv) {
  const double value = row_inverse_rms(x + blockIdx.x * dim, dim, eps);
  if (threadIdx.x == 0) inv[blockIdx.x] = value;
}

// n = x·inv, y = n·(1 + s): dn = dy·(1 + s); dx = inv·(dn − n·mean(dn·n)), or dx += that. dx may be
// dy (not when adding): each value is read before it is written. Without `inverse` (no ∂s to form,
// which needs every row's) the block finds its row's 1/rms itself.
__global__ void rmsnorm_backward_kernel(const float* x, const float* scale, const double* inverse, float eps,
                                        int64_t dim, const float* dy, float* dx, bool accumulate) {
  const int64_t r = blockIdx.x;
  const float* xr = x + r * dim;
  const double inv = inverse ? inverse[r] : row_inverse_rms(xr, dim, eps);
  double dot = 0;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x)
    dot += double(dy[r * dim + i]) * (1.0 + scale[i]) * double(xr[i]) * inv;
  dot = block_sum(dot);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    const double dn = double(dy[r * dim + i]) * (1.0 + scale[i]);
    const float value = float(inv * (dn - double(xr[i]) * inv * dot / double(dim)));
    dx[r * dim + i] = accumulate ? dx[r * dim + i] + value : value;
  }
}

// ∂s[i] += Σ_r dy·x·inv_r, one thread per column, rows in order.
__global__ void rmsnorm_scale_grad_kernel(const float* x, const float* dy, const double* inv, int64_t rows,
                                          int64_t dim, float* dscale) {
  FOR_EACH_INDEX(i, dim) {
    float acc = dscale[i];
    for (int64_t r = 0; r < rows; ++r) acc += float(double(dy[r * dim + i]) * double(x[r * dim + i]) * inv[r]);
    dscale[i] = acc;
  }
}

// ---- RoPE: each head's halves [x1 | x2] rotated by ±θ, θ = position·inverse frequency (fp32) ----

// One block per (token, head) row at a time — the query rows, then the key rows —, its threads over
// the pairs (i, i + half): a thread per pair spent most of its time in the three 64-bit divisions that
// found its row and pair. The query rows are scaled by q_scale after the rotation (forward) or before
// it (backward, the inverse rotation), each a rounding of its own, as two separate ops round. With a
// cache (forward), the rotated key rows go into the key cache too, and a third run of rows copies the
// values into theirs: token m = b·T + t, head h to cache row b·capacity + start + t.
__global__ void rope_kernel(float* q, int64_t q_heads, float* k, int64_t k_heads, int64_t tokens, int64_t head_dim,
                            const int64_t* positions, float base, float scaling, float q_scale, bool inverse,
                            RopeCacheRows cache) {
  const int64_t half = head_dim / 2, q_rows = tokens * q_heads, k_rows = tokens * k_heads;
  const int64_t rows = q_rows + (cache.values ? 2 : 1) * k_rows;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    if (row >= q_rows + k_rows) {  // a value row, copied
      const int64_t r = row - q_rows - k_rows;
      float* into = cache.row(cache.value_cache, r / k_heads, r % k_heads, k_heads, head_dim);
      for (int64_t i = threadIdx.x; i < head_dim; i += blockDim.x) into[i] = cache.values[r * head_dim + i];
      continue;
    }
    const bool of_q = row < q_rows;
    const int64_t heads = of_q ? q_heads : k_heads, r = of_q ? row : row - q_rows;
    const float position = float(positions[r / heads]);
    float* v = (of_q ? q : k) + r * head_dim;
    float* cached = !of_q && cache.values ? cache.row(cache.key_cache, r / k_heads, r % k_heads, k_heads, head_dim)
                                          : nullptr;
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
      const RopePair y = rope_pair(v[i], v[i + half], position, i, head_dim, base, scaling, of_q ? q_scale : 1.f,
                                   inverse);
      v[i] = y.first;
      v[i + half] = y.second;
      if (cached) cached[i] = y.first, cached[i + half] = y.second;
    }
  }
}

// Its launch: up to 65536 blocks of the pairs of a row, rounded up to whole warps.
static void launch_rope(CudaState& st, float* q, int64_t q_heads, float* k, int64_t k_heads, int64_t tokens,
                        int64_t head_dim, const int64_t* positions, float base, float scaling, float q_scale,
                        bool inverse, RopeCacheRows cache = {}) {
  const int64_t rows = tokens * (q_heads + (cache.values ? 2 : 1) * k_heads);
  if (rows == 0) return;
  const unsigned threads = unsigned(std::clamp<int64_t>((head_dim / 2 + 31) / 32 * 32, 32, kThreads));
  rope_kernel<<<unsigned(std::min<int64_t>(rows, 65536)), threads, 0, st.stream>>>(
      q, q_heads, k, k_heads, tokens, head_dim, positions, base, scaling, q_scale, inverse, cache);
  check_launch(inverse ? "rope_backward" : "rope");
}

// ---- attention: one block per query (row b, query t, head n) ----
// The block's scores over the S key slots live in shared memory. Key j is allowed iff it is at or
// before the query's position, a real token, and inside the window; no allowed key gives p = 0.

struct Query {
  int64_t b, t, n, kv, pos, qi;
};

// Query `index` of the shape's B·T·N, (b·T + t)·N + n.
__device__ Query query_at(const AttentionShape& s, int64_t index) {
  Query q;
  q.n = index % s.heads;
  q.t = (index / s.heads) % s.query_len;
  q.b = index / (s.heads * s.query_len);
  q.kv = q.n / (s.heads / s.kv_heads);
  q.pos = s.start + q.t;
  q.qi = ((q.b * s.query_len + q.t) * s.heads + q.n) * s.head_dim;
  return q;
}
__device__ Query this_query(const AttentionShape& s) { return query_at(s, blockIdx.x); }

__device__ int64_t key_index(const AttentionShape& s, const Query& q, int64_t j) {
  return ((q.b * s.capacity + j) * s.kv_heads + q.kv) * s.head_dim;
}

// a·b over the head dimension as the products take them (s.product_input), one warp per key slot:
// lanes read consecutive values (coalesced) and sum in double; every lane gets the sum.
__device__ double warp_dot(const AttentionShape& s, const float* a, const float* b) {
  double d = 0;
  for (int64_t h = threadIdx.x % 32; h < s.head_dim; h += 32) d += double(s.product_input(a[h])) * s.product_input(b[h]);
  return warp_sum(d);
}

// p[j] = the query's probabilities, capped[j] = its capped scores (0 where not allowed). Scores one
// warp per key slot.
__device__ void query_probabilities(const float* q, const float* k, const uint8_t* key_valid, const AttentionShape& s,
                                    const Query& qq, float* p, float* capped) {
  const int64_t S = s.capacity;
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  float local_max = -INFINITY;
  for (int64_t j = threadIdx.x / 32; j < S; j += warps) {
    const bool allowed = j <= qq.pos && key_valid[qq.b * S + j] && (s.window == 0 || qq.pos - s.window < j);
    double d = allowed ? warp_dot(s, q + qq.qi, k + key_index(s, qq, j)) : 0;
    if (allowed && s.soft_cap > 0) d = tanh(d / s.soft_cap) * s.soft_cap;
    if (lane == 0) {
      capped[j] = allowed ? float(d) : 0.f;
      p[j] = allowed ? 1.f : 0.f;  // marks allowed until the exponentials replace it
    }
    if (allowed) local_max = fmaxf(local_max, float(d));
  }
  const float max = block_max(local_max);  // its barrier also publishes p and capped to every thread
  double sum = 0;
  for (int64_t j = threadIdx.x; j < S; j += blockDim.x)
    if (p[j] != 0) {
      const double e = exp(double(capped[j]) - max);
      p[j] = float(e);
      sum += e;
    }
  sum = block_sum(sum);
  for (int64_t j = threadIdx.x; j < S; j += blockDim.x) p[j] = sum > 0 ? s.product_input(float(double(p[j]) / sum)) : 0.f;
  __syncthreads();
}

// Calls visit(i, load(i)) for i = first, first + step, … below end, in that order, with the loads
// of 8 of them issued before they are visited, so that a thread waits for memory once per 8 values
// rather than once per value. One load at a time left the per-query attention sums and the loss's
// row scans latency-bound on an H200 (decode attention 83 µs a call for 192 slots; the row maxima
// of a [256, 256000] chunk 490 µs, 7× the time its bytes take).
template <class Load, class Visit>
__device__ void visit_in_flight(int64_t first, int64_t end, int64_t step, const Load& load, const Visit& visit) {
  constexpr int kInFlight = 8;
  for (int64_t i0 = first; i0 < end; i0 += kInFlight * step) {
    float values[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) values[u] = i0 + u * step < end ? load(i0 + u * step) : 0.f;
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (i0 + u * step < end) visit(i0 + u * step, values[u]);
  }
}

// Σ_j w[j − w_first]·rows[slot j][h] over key slots first … end−1 whose weight is not zero, in slot
// order and in double; the rows (values or keys) as the products take them.
__device__ double weighted_slot_sum(const float* w, const float* rows, const AttentionShape& s, const Query& qq,
                                    int64_t h, int64_t first, int64_t end, int64_t w_first = 0) {
  double acc = 0;
  visit_in_flight(
      first, end, 1, [&](int64_t j) { return s.product_input(rows[key_index(s, qq, j) + h]); },
      [&](int64_t j, float value) {
        if (w[j - w_first] != 0) acc += double(w[j - w_first]) * value;
      });
  return acc;
}

// Whether the calling block is the last of `blocks` to get here for the item `ticket` counts (one
// thread of the block calls it, after the block's results are written); the last resets the count.
// The fences make every block's results visible to the last one.
__device__ bool last_block_of(int* ticket, int64_t blocks) {
  __threadfence();
  const bool last = atomicAdd(ticket, 1) == int(blocks - 1);
  if (last) {
    __threadfence();
    *ticket = 0;  // for the next launch
  }
  return last;
}

// The forward kernel's slot groups for a block of `threads` (at least one), and where its partial sums
// start in shared memory: after the probabilities and capped scores (2·S floats: 8-byte aligned).
__host__ __device__ inline int64_t attention_slot_groups(const AttentionShape& s, int64_t threads) {
  return s.head_dim < threads ? threads / s.head_dim : 1;
}
__host__ __device__ inline int64_t attention_partials_offset(const AttentionShape& s) {
  return 2 * s.capacity;  // in floats
}

// Both per-query kernels take up to 1024 threads a block (attention_threads): __launch_bounds__
// keeps their registers within what a block of 1024 may have (64 each; without it they use 62 — one
// more variable and a decode launch would fail with "too many resources requested").
__global__ void __launch_bounds__(1024)
    attention_kernel(const float* q, const float* k, const float* v, const uint8_t* key_valid, AttentionShape s,
                     float* out) {
  extern __shared__ float shared[];
  float *p = shared, *capped = shared + s.capacity;
  const Query qq = this_query(s);
  query_probabilities(q, k, key_valid, s, qq, p, capped);
  // The weighted sum of the values: the key slots split into contiguous ranges, one per group of
  // head_dim threads (a block of 1024 threads has 4 groups at H = 256), each range's sum a partial
  // in shared memory, added in range order. One thread per h over every slot left most of a decode
  // block idle and waiting on one load chain (35 µs a call for 192 slots on an H200).
  const int64_t H = s.head_dim, S = s.capacity, groups = attention_slot_groups(s, blockDim.x);
  double* partial = reinterpret_cast<double*>(shared + attention_partials_offset(s));
  for (int64_t e = threadIdx.x; e < groups * H; e += blockDim.x) {
    const int64_t g = e / H, first = S * g / groups, end = S * (g + 1) / groups;
    partial[e] = weighted_slot_sum(p, v, s, qq, e % H, first, end);
  }
  __syncthreads();
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    double total = 0;
    for (int64_t g = 0; g < groups; ++g) total += partial[g * H + h];
    out[qq.qi + h] = float(total);
  }
}

// Backward in two passes, without atomics. Per query (one block each): dp_j = dout·v_j;
// ds_j = p_j·(dp_j − Σ p·dp)·(1 − (capped/cap)²); dq = Σ ds_j·k_j; p and ds go to `probs` and
// `dscores` ([B·T·N, S]). Per key slot (attention_key_gradients_kernel): dk_j = Σ ds·q and
// dv_j = Σ p·dout over the queries of its head group, summed in double in a fixed order.
__global__ void __launch_bounds__(1024)
    attention_backward_kernel(const float* q, const float* k, const float* v, const uint8_t* key_valid,
                              AttentionShape s, const float* dout, float* dq, float* probs, float* dscores) {
  extern __shared__ float shared[];
  const int64_t S = s.capacity, H = s.head_dim;
  float *p = shared, *capped = shared + S, *ds = shared + 2 * S;
  const Query qq = this_query(s);
  query_probabilities(q, k, key_valid, s, qq, p, capped);
  double p_dot_dp = 0;  // lane 0 of each warp adds its key slots' terms
  for (int64_t j = threadIdx.x / 32; j < S; j += blockDim.x / 32) {
    if (p[j] == 0) {
      if (threadIdx.x % 32 == 0) ds[j] = 0;
      continue;
    }
    const double dp = warp_dot(s, dout + qq.qi, v + key_index(s, qq, j));
    if (threadIdx.x % 32 == 0) {
      ds[j] = float(dp);
      p_dot_dp += double(p[j]) * dp;
    }
  }
  p_dot_dp = block_sum(p_dot_dp);  // its barrier also publishes ds
  float* row_p = probs + int64_t(blockIdx.x) * S;  // blockIdx.x = (b·T + t)·N + n
  float* row_ds = dscores + int64_t(blockIdx.x) * S;
  for (int64_t j = threadIdx.x; j < S; j += blockDim.x) {
    if (p[j] != 0) {
      double d = double(p[j]) * (double(ds[j]) - p_dot_dp);
      if (s.soft_cap > 0) d *= 1.0 - (double(capped[j]) / s.soft_cap) * (double(capped[j]) / s.soft_cap);
      ds[j] = s.product_input(float(d));
    }
    row_p[j] = p[j];
    row_ds[j] = ds[j];
  }
  __syncthreads();
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x)
    dq[qq.qi + h] = float(weighted_slot_sum(ds, k, s, qq, h, 0, S));
}

// One block per key slot (b, j, kv head): threads over the head dimension.
__global__ void attention_key_gradients_kernel(const float* q, const float* dout, const float* probs,
                                               const float* dscores, AttentionShape s, float* dk, float* dv) {
  const int64_t S = s.capacity, H = s.head_dim, T = s.query_len, N = s.heads, group = s.heads / s.kv_heads;
  const int64_t kv = blockIdx.x % s.kv_heads, j = (blockIdx.x / s.kv_heads) % S, b = blockIdx.x / (s.kv_heads * S);
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    double gk = 0, gv = 0;
    for (int64_t n = kv * group; n < (kv + 1) * group; ++n)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t row = (b * T + t) * N + n;
        const float p = probs[row * S + j];
        if (p == 0) continue;
        gk += double(dscores[row * S + j]) * s.product_input(q[row * H + h]);
        gv += double(p) * s.product_input(dout[row * H + h]);
      }
    dk[int64_t(blockIdx.x) * H + h] = float(gk);
    dv[int64_t(blockIdx.x) * H + h] = float(gv);
  }
}

// ---- attention through cuBLAS (MESHTUNE_CUDA_ATTENTION=gemm) ----
// The products of backend/batched_attention.h (scores [B, N, T, L]; P·V; in backward dP = dout·Vᵀ,
// dq = dS·K, dk = dSᵀ·q, dv = Pᵀ·dout) with these kernels over each score row (one block per
// (b, n, t)) between them.

__device__ bool key_allowed(const AttentionShape& s, const uint8_t* key_valid, int64_t b, int64_t pos, int64_t j) {
  return j <= pos && key_valid[b * s.capacity + j] && (s.window == 0 || pos - s.window < j);
}

// The score-row kernels give each row one warp: rows are a sequence's keys long, and a block per
// row spent more on its barriers than on the row (0.96 ms a call for [131072, 1024] scores on an
// H200, 3.5× the time its bytes take). Warp reductions with xor shuffles leave every lane the same
// value, whatever its position.

// A softmax's running maximum and Σ exp(x − max) over some of a row's values.
struct RunningSum {
  double max = -INFINITY, sum = 0;

  __device__ void add(double x) {
    if (x > max) sum = sum * exp(max - x), max = x;  // exp(−∞) = 0 for the first value
    sum += exp(x - max);
  }
  // Merged with another part of the row's.
  __device__ void merge(double other_max, double other_sum) {
    const double merged = fmax(max, other_max);
    sum = (sum > 0 ? sum * exp(max - merged) : 0.0) + (other_sum > 0 ? other_sum * exp(other_max - merged) : 0.0);
    max = merged;
  }
  // Merged with the other lanes' (each lane gets the whole warp's; the merge is symmetric, so all agree).
  __device__ void merge_warp() {
    for (int offset = 16; offset > 0; offset /= 2) {
      const double other_max = __shfl_xor_sync(0xffffffffu, max, offset);
      const double other_sum = __shfl_xor_sync(0xffffffffu, sum, offset);
      merge(other_max, other_sum);
    }
  }
};

// ---- attention of few queries (decode): each query's key slots split over many blocks ----
// One block per query leaves decode's B·N blocks on a few of the GPU's multiprocessors, each walking
// its whole cache. Here the slots a query may see, [first, L), are cut into splits of `length`
// slots (kSplitSlots, more where the splits of all queries would exceed kSplitBlocks blocks), one
// block each, in two launches with the per-query kernel's arithmetic:
//   1. each block's capped scores (to scratch) and their running max and Σ exp(x − max);
//   2. each block merges its query's splits' statistics in split order (every block of the query
//      gets the same max and sum), turns its slots into probabilities, writes its partial Σ p̂·v̂ for
//      each h, and the query's last block to finish (a ticket counter, zero between launches) adds
//      the partials in split order: the same output on every run.
constexpr int kSplitSlots = 16, kSplitThreads = 256;
constexpr int64_t kSplitBlocks = 4096;  // partial sums in scratch: 8 MB at head_dim 256

struct SplitAttention {
  float* capped = nullptr;     // [queries, L]: slot j of a query at j (slots below `first` unused)
  double* stats = nullptr;     // [queries · splits, 2]: each split's max and sum
  double* partial = nullptr;   // [queries · splits, H]
  int* tickets = nullptr;      // [queries]
  int64_t first = 0, L = 0, length = 0, splits = 0;  // the splits: [first + i·length, …) below L
};

__device__ int64_t split_end(const SplitAttention& a, int64_t split) {
  const int64_t end = a.first + (split + 1) * a.length;
  return end < a.L ? end : a.L;
}

__global__ void split_attention_scores_kernel(const float* q, const float* k, const uint8_t* key_valid,
                                              AttentionShape s, SplitAttention a) {
  __shared__ double warp_max[kSplitThreads / 32], warp_sum_exp[kSplitThreads / 32];
  const int64_t query = blockIdx.x / a.splits, split = blockIdx.x % a.splits;
  const Query qq = query_at(s, query);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  float* capped = a.capped + query * a.L;
  RunningSum local;  // of this warp's slots (lane 0's)
  for (int64_t j = a.first + split * a.length + warp; j < split_end(a, split); j += warps) {
    const bool allowed = key_allowed(s, key_valid, qq.b, qq.pos, j);
    double d = allowed ? warp_dot(s, q + qq.qi, k + key_index(s, qq, j)) : 0;
    if (allowed && s.soft_cap > 0) d = tanh(d / s.soft_cap) * s.soft_cap;
    if (lane == 0) {
      capped[j] = float(d);
      if (allowed) local.add(float(d));
    }
  }
  if (lane == 0) warp_max[warp] = local.max, warp_sum_exp[warp] = local.sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    RunningSum block;
    for (int w = 0; w < warps; ++w) block.merge(warp_max[w], warp_sum_exp[w]);  // in warp order
    a.stats[2 * blockIdx.x] = block.max;
    a.stats[2 * blockIdx.x + 1] = block.sum;
  }
}

__global__ void split_attention_values_kernel(const float* v, const uint8_t* key_valid, AttentionShape s,
                                              SplitAttention a, float* out) {
  extern __shared__ float p[];  // the split's probabilities
  __shared__ bool last;
  const int64_t query = blockIdx.x / a.splits, split = blockIdx.x % a.splits, H = s.head_dim;
  const Query qq = query_at(s, query);
  // The query's max and sum: each lane merges every 32nd split in order, then the warp's lanes
  // (every warp alike, so no barrier is needed before using them).
  RunningSum total;
  for (int64_t i = threadIdx.x % 32; i < a.splits; i += 32)
    total.merge(a.stats[2 * (query * a.splits + i)], a.stats[2 * (query * a.splits + i) + 1]);
  total.merge_warp();
  const int64_t first = a.first + split * a.length, end = split_end(a, split);
  const float* capped = a.capped + query * a.L;
  for (int64_t j = first + threadIdx.x; j < end; j += blockDim.x) {
    float pj = 0;  // as attention_kernel: the exponential in fp32, then divided by the sum
    if (key_allowed(s, key_valid, qq.b, qq.pos, j) && total.sum > 0)
      pj = s.product_input(float(double(float(exp(double(capped[j]) - total.max))) / total.sum));
    p[j - first] = pj;
  }
  __syncthreads();
  double* partial = a.partial + int64_t(blockIdx.x) * H;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x)
    partial[h] = weighted_slot_sum(p, v, s, qq, h, first, end, first);
  // The last of the query's blocks adds the partials.
  __threadfence();  // each thread's partials, before thread 0 takes the ticket
  __syncthreads();
  if (threadIdx.x == 0) last = last_block_of(a.tickets + query, a.splits);
  __syncthreads();
  if (!last) return;
  const volatile double* partials = a.partial + query * a.splits * H;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    double sum = 0;
    for (int64_t i = 0; i < a.splits; ++i) sum += partials[i * H + h];
    out[qq.qi + h] = float(sum);
  }
}

// A row of raw scores becomes the query's probabilities (0 where not allowed): in place, or rounded
// to bf16 into `rounded` when given (bf16_products); its capped scores go to `capped` when given
// (backward's soft-cap slope). The row is read twice (the second time from cache), written once.
__global__ void score_softmax_kernel(float* scores, float* capped, const uint8_t* key_valid, AttentionShape s,
                                     int64_t rows, int64_t L, uint16_t* rounded) {
  FOR_EACH_WARP_ITEM(row, rows) {
    const int64_t t = row % s.query_len, b = row / (s.query_len * s.heads), pos = s.start + t;
    float* x = scores + row * L;
    const auto capped_score = [&](int64_t j) {
      const double d = x[j];
      return s.soft_cap > 0 ? float(tanh(d / s.soft_cap) * s.soft_cap) : float(d);
    };
    RunningSum softmax;
    for (int64_t j = threadIdx.x % 32; j < L; j += 32) {
      const bool allowed = key_allowed(s, key_valid, b, pos, j);
      const float score = allowed ? capped_score(j) : 0.f;
      if (allowed) softmax.add(score);
      if (capped) capped[row * L + j] = score;
    }
    softmax.merge_warp();
    const double inverse = softmax.sum > 0 ? 1.0 / softmax.sum : 0.0;
    for (int64_t j = threadIdx.x % 32; j < L; j += 32) {
      const float p = key_allowed(s, key_valid, b, pos, j) ? float(exp(capped_score(j) - softmax.max) * inverse) : 0.f;
      if (rounded) rounded[row * L + j] = f32_to_bf16(p);
      else x[j] = p;
    }
  }
}

// A row of dp = dout·v_j becomes ds_j = p_j·(dp_j − Σ p·dp)·(1 − (capped/cap)²), with p from `probs`
// or from `rounded_probs` (bf16): in place over dp, or rounded to bf16 into `rounded` when given.
__global__ void score_softmax_backward_kernel(const float* probs, const uint16_t* rounded_probs, const float* capped,
                                              float* dscores, uint16_t* rounded, AttentionShape s, int64_t rows,
                                              int64_t L) {
  FOR_EACH_WARP_ITEM(row, rows) {
    const auto p = [&](int64_t j) {
      return rounded_probs ? bf16_to_f32(rounded_probs[row * L + j]) : probs[row * L + j];
    };
    float* d = dscores + row * L;
    double p_dot_dp = 0;
    for (int64_t j = threadIdx.x % 32; j < L; j += 32) {
      const float pj = p(j);
      if (pj != 0) p_dot_dp += double(pj) * d[j];
    }
    p_dot_dp = warp_sum(p_dot_dp);
    for (int64_t j = threadIdx.x % 32; j < L; j += 32) {
      const float pj = p(j);
      double ds = pj != 0 ? double(pj) * (double(d[j]) - p_dot_dp) : 0.0;
      if (pj != 0 && s.soft_cap > 0) {
        const double c = capped[row * L + j] / s.soft_cap;
        ds *= 1.0 - c * c;
      }
      if (rounded) rounded[row * L + j] = f32_to_bf16(float(ds));
      else d[j] = float(ds);
    }
  }
}

// ---- activations ----

// GeGLU in fp32 (cuda_common.cuh's geglu_value, the CPU's formula), four values a thread where the
// arrays are 16-byte aligned (cuda_common.cuh's quads): one value a thread ran at about half the
// H200's bandwidth (stop 36: 1.1 ms and 1.9 ms).
__device__ float4 geglu_values(float4 u, float4 w) {
  return {geglu_value(u.x, w.x), geglu_value(u.y, w.y), geglu_value(u.z, w.z), geglu_value(u.w, w.w)};
}
__global__ void geglu_kernel(const float* gate, const float* up, int64_t n, float* out) {
  const int64_t whole = aligned_to(gate, 16) && aligned_to(up, 16) && aligned_to(out, 16) ? n / 4 : 0;
  FOR_EACH_INDEX(i, whole) {
    reinterpret_cast<float4*>(out)[i] =
        geglu_values(reinterpret_cast<const float4*>(gate)[i], reinterpret_cast<const float4*>(up)[i]);
  }
  FOR_EACH_INDEX(i, n - 4 * whole) {
    const int64_t e = 4 * whole + i;
    out[e] = geglu_value(gate[e], up[e]);
  }
}

// ∂gate and ∂up of one value, given its gate u, up w and output gradient g.
struct GegluGradient {
  float gate, up;
};
__device__ GegluGradient geglu_gradient(float u, float w, float g) {
  const float s = gelu_sigmoid(u);
  return {g * w * gelu_slope(u, s), g * (u * s)};
}
__global__ void geglu_backward_kernel(const float* gate, const float* up, const float* dout, int64_t n, float* dgate,
                                      float* dup) {
  const bool aligned = aligned_to(gate, 16) && aligned_to(up, 16) && aligned_to(dout, 16) && aligned_to(dgate, 16) &&
                       aligned_to(dup, 16);
  const int64_t whole = aligned ? n / 4 : 0;
  FOR_EACH_INDEX(i, whole) {  // read first: the outputs may alias the inputs
    const float4 u = reinterpret_cast<const float4*>(gate)[i], w = reinterpret_cast<const float4*>(up)[i],
                 g = reinterpret_cast<const float4*>(dout)[i];
    const GegluGradient x = geglu_gradient(u.x, w.x, g.x), y = geglu_gradient(u.y, w.y, g.y),
                        z = geglu_gradient(u.z, w.z, g.z), v = geglu_gradient(u.w, w.w, g.w);
    reinterpret_cast<float4*>(dgate)[i] = {x.gate, y.gate, z.gate, v.gate};
    reinterpret_cast<float4*>(dup)[i] = {x.up, y.up, z.up, v.up};
  }
  FOR_EACH_INDEX(i, n - 4 * whole) {
    const int64_t e = 4 * whole + i;
    const GegluGradient d = geglu_gradient(gate[e], up[e], dout[e]);
    dgate[e] = d.gate;
    dup[e] = d.up;
  }
}
// The bf16 forms (Backend::geglu_to_bf16, geglu_backward_bf16): the same values, rounded as the
// narrowing kernel rounds, in one pass; four values a thread where the arrays allow it.
__global__ void geglu_to_bf16_kernel(const float* gate, const float* up, int64_t n, uint16_t* out,
                                     uint16_t* gate_copy, uint16_t* up_copy) {
  const bool aligned = aligned_to(gate, 16) && aligned_to(up, 16) && aligned_to(out, 8) && aligned_to(gate_copy, 8) &&
                       aligned_to(up_copy, 8);
  const int64_t whole = aligned ? n / 4 : 0;
  FOR_EACH_INDEX(i, whole) {
    const float4 u = reinterpret_cast<const float4*>(gate)[i], w = reinterpret_cast<const float4*>(up)[i];
    reinterpret_cast<uint2*>(out)[i] = pack_bf16x4(geglu_values(u, w));
    reinterpret_cast<uint2*>(gate_copy)[i] = pack_bf16x4(u);
    reinterpret_cast<uint2*>(up_copy)[i] = pack_bf16x4(w);
  }
  FOR_EACH_INDEX(i, n - 4 * whole) {
    const int64_t e = 4 * whole + i;
    out[e] = f32_to_bf16(geglu_value(gate[e], up[e]));
    gate_copy[e] = f32_to_bf16(gate[e]);
    up_copy[e] = f32_to_bf16(up[e]);
  }
}
__global__ void geglu_backward_bf16_kernel(const uint16_t* gate, const uint16_t* up, const float* dout, int64_t n,
                                           uint16_t* dgate, uint16_t* dup) {
  const bool aligned = aligned_to(gate, 8) && aligned_to(up, 8) && aligned_to(dout, 16) && aligned_to(dgate, 8) &&
                       aligned_to(dup, 8);
  const int64_t whole = aligned ? n / 4 : 0;
  FOR_EACH_INDEX(i, whole) {
    const float4 u = unpack_bf16x4(reinterpret_cast<const uint2*>(gate)[i]),
                 w = unpack_bf16x4(reinterpret_cast<const uint2*>(up)[i]), g = reinterpret_cast<const float4*>(dout)[i];
    const GegluGradient x = geglu_gradient(u.x, w.x, g.x), y = geglu_gradient(u.y, w.y, g.y),
                        z = geglu_gradient(u.z, w.z, g.z), v = geglu_gradient(u.w, w.w, g.w);
    reinterpret_cast<uint2*>(dgate)[i] = pack_bf16x4({x.gate, y.gate, z.gate, v.gate});
    reinterpret_cast<uint2*>(dup)[i] = pack_bf16x4({x.up, y.up, z.up, v.up});
  }
  FOR_EACH_INDEX(i, n - 4 * whole) {
    const int64_t e = 4 * whole + i;
    const GegluGradient d = geglu_gradient(bf16_to_f32(gate[e]), bf16_to_f32(up[e]), dout[e]);
    dgate[e] = f32_to_bf16(d.gate);
    dup[e] = f32_to_bf16(d.up);
  }
}
__global__ void soft_cap_kernel(float* x, int64_t n, float cap) {
  FOR_EACH_INDEX(i, n) x[i] = float(double(cap) * tanh(double(x[i]) / cap));
}
__global__ void soft_cap_backward_kernel(const float* y, float* dy, int64_t n, float cap) {
  FOR_EACH_INDEX(i, n) dy[i] = float(double(dy[i]) * (1.0 - (double(y[i]) / cap) * (double(y[i]) / cap)));
}

// ---- the chunked softmax cross-entropy (one block per row of the chunk) ----

// Calls visit(c, row[c]) for this thread's columns (threadIdx.x, + blockDim.x, …), in order.
template <class Visit>
__device__ void scan_row(const float* row, int64_t cols, const Visit& visit) {
  visit_in_flight(threadIdx.x, cols, blockDim.x, [&](int64_t c) { return row[c]; }, visit);
}

// Each row's largest logit and its vocabulary index (the first on ties). A row may be cut into
// `parts` consecutive column ranges, a block each (decode: one row of 256k logits per sequence, which
// a single block walked at 1000 values a thread); each part's best goes to `partial`, and the row's
// last block to finish (a ticket counter, zero between launches) picks the first best in part order.
struct RowMaxParts {
  int64_t parts = 1;
  float* partial = nullptr;  // [n · parts, 2]: each part's max and column
  int* tickets = nullptr;    // [n]
};

__global__ void softmax_row_max_kernel(const float* z, int64_t n, int64_t cols, int64_t v0, float* max_and_argmax,
                                       RowMaxParts split) {
  __shared__ int64_t best_index[kThreads];
  const int64_t r = blockIdx.x / split.parts, part = blockIdx.x % split.parts;
  const int64_t first = cols * part / split.parts, end = cols * (part + 1) / split.parts;
  const float* row = z + r * cols;
  float value = -INFINITY;
  int64_t index = -1;
  visit_in_flight(first + threadIdx.x, end, blockDim.x, [&](int64_t c) { return row[c]; }, [&](int64_t c, float x) {
    if (index < 0 || x > value) value = x, index = c;
  });
  best_index[threadIdx.x] = index;
  __syncthreads();
  if (threadIdx.x != 0) return;
  int64_t best = -1;
  for (unsigned t = 0; t < blockDim.x; ++t) {
    const int64_t c = best_index[t];
    if (c < 0) continue;
    if (best < 0 || row[c] > row[best] || (row[c] == row[best] && c < best)) best = c;
  }
  if (split.parts == 1) {
    max_and_argmax[r] = row[best];
    max_and_argmax[n + r] = float(v0 + best);
    return;
  }
  split.partial[2 * blockIdx.x] = row[best];
  split.partial[2 * blockIdx.x + 1] = float(best);
  if (!last_block_of(split.tickets + r, split.parts)) return;
  const volatile float* parts = split.partial + 2 * r * split.parts;
  float top = parts[0], column = parts[1];
  for (int64_t i = 1; i < split.parts; ++i)
    if (parts[2 * i] > top) top = parts[2 * i], column = parts[2 * i + 1];  // a later part wins only if larger
  max_and_argmax[r] = top;
  max_and_argmax[n + r] = float(v0 + int64_t(column));
}

__global__ void softmax_combine_max_kernel(const float* gathered, int parts, int64_t n, float* max_and_argmax) {
  FOR_EACH_INDEX(i, n) {
    float best = 0, index = 0;
    for (int r = 0; r < parts; ++r) {
      const float value = gathered[(2 * r) * n + i];
      if (r == 0 || value > best) best = value, index = gathered[(2 * r + 1) * n + i];
    }
    max_and_argmax[i] = best;
    max_and_argmax[n + i] = index;
  }
}

__global__ void softmax_row_sums_kernel(const float* z, int64_t n, int64_t cols, int64_t v0, const int32_t* targets,
                                        const float* max_and_argmax, double* sum_exp_and_target) {
  const int64_t i = blockIdx.x;
  const float* row = z + i * cols;
  const double max = max_and_argmax[i];
  double sum = 0;
  scan_row(row, cols, [&](int64_t, float x) { sum += exp(double(x) - max); });
  sum = block_sum(sum);
  if (threadIdx.x == 0) {
    const int64_t y = targets[i] - v0;
    sum_exp_and_target[i] = sum;
    sum_exp_and_target[n + i] = y >= 0 && y < cols ? double(row[y]) : 0.0;
  }
}

// sums[0..2] += Σ w·CE, Σ w·[argmax = target], Σ w over the chunk's rows (one block).
__global__ void softmax_cross_entropy_sums_kernel(const float* max_and_argmax, const double* sum_exp_and_target,
                                                  const int32_t* targets, const float* weights, int64_t n,
                                                  double* sums) {
  double ce = 0, hits = 0, total = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double w = weights[i];
    ce += w * (log(sum_exp_and_target[i]) + double(max_and_argmax[i]) - double(float(sum_exp_and_target[n + i])));
    hits += w * (int64_t(max_and_argmax[n + i]) == targets[i] ? 1.0 : 0.0);
    total += w;
  }
  ce = block_sum(ce);
  hits = block_sum(hits);
  total = block_sum(total);
  if (threadIdx.x == 0) sums[0] += ce, sums[1] += hits, sums[2] += total;
}

__global__ void softmax_cross_entropy_backward_kernel(float* z, int64_t n, int64_t cols, int64_t v0,
                                                      const int32_t* targets, const float* weights, double loss_scale,
                                                      const float* max_and_argmax,
                                                      const double* sum_exp_and_target, float cap) {
  FOR_EACH_INDEX(e, n * cols) {
    const int64_t i = e / cols, c = e % cols, y = targets[i] - v0;
    const double zc = z[e];
    double g = exp(zc - max_and_argmax[i]) / sum_exp_and_target[i] - (c == y ? 1.0 : 0.0);
    if (cap > 0) g *= 1.0 - (zc / cap) * (zc / cap);
    z[e] = float(loss_scale * weights[i] * g);
  }
}

// ---- data movement ----

// A weight matrix as a kernel takes it: its pointers and shape (WeightMatrix also holds the host
// side's ownership, which does not cross to the device).
struct MatrixView {
  const void* data;
  const float* scales;
  int64_t rows, cols;
  DType dtype;
  __device__ const float* f32() const { return static_cast<const float*>(data); }
  __device__ const uint16_t* bf16() const { return static_cast<const uint16_t*>(data); }
  __device__ const int8_t* i8() const { return static_cast<const int8_t*>(data); }
};

__global__ void embedding_lookup_kernel(MatrixView table, int64_t first_row, const int32_t* ids, int64_t M,
                                        float factor, float* out) {
  FOR_EACH_INDEX(e, M * table.cols) {
    const int64_t m = e / table.cols, c = e % table.cols, r = int64_t(ids[m]) - first_row;
    float value = 0;
    if (r >= 0 && r < table.rows) {
      const int64_t i = r * table.cols + c;
      value = table.dtype == DType::BF16 ? bf16_to_f32(table.bf16()[i])
              : table.dtype == DType::I8 ? float(table.i8()[i]) / table.scales[r]
                                         : table.f32()[i];
      value *= factor;  // after the row's own rounding to fp32, as the CPU scales it
    }
    out[e] = value;
  }
}

// One thread per column, the tokens in order: no two threads add into the same value.
__global__ void embedding_lookup_backward_kernel(const float* dy, const int32_t* ids, int64_t M, int64_t dim,
                                                 int64_t first_row, int64_t rows, float factor, float* grad) {
  FOR_EACH_INDEX(c, dim) {
    for (int64_t m = 0; m < M; ++m) {
      const int64_t r = int64_t(ids[m]) - first_row;
      if (r >= 0 && r < rows) grad[r * dim + c] += factor * dy[m * dim + c];
    }
  }
}

// The keys (blockIdx.y = 0) and the values (1) in one launch.
__global__ void greedy_tokens_kernel(const float* max_and_argmax, int64_t rows, const uint8_t* keep, int32_t* ids) {
  FOR_EACH_INDEX(r, rows) if (!keep[r]) ids[r] = int32_t(max_and_argmax[rows + r]);
}
__global__ void gather_rows_kernel(const float* src, const int64_t* rows, int64_t n, int64_t dim, float* dst) {
  FOR_EACH_INDEX(e, n * dim) dst[e] = src[rows[e / dim] * dim + e % dim];
}
__global__ void scatter_rows_kernel(const float* src, const int64_t* rows, int64_t n, int64_t dim, float* dst) {
  FOR_EACH_INDEX(e, n * dim) dst[rows[e / dim] * dim + e % dim] = src[e];
}
__global__ void interleave_kernel(const float* blocks, int parts, int64_t M, int64_t part, float* out) {
  FOR_EACH_INDEX(e, int64_t(parts) * M * part) {
    const int64_t c = e % part, m = (e / part) % M, r = e / (part * M);
    out[(m * parts + r) * part + c] = blocks[e];
  }
}
// Backend::copy and zero as kernels rather than cudaMemcpyAsync / cudaMemsetAsync: on the H200 the
// host spent 9 µs in each cudaMemcpyAsync and 40 µs in each cudaMemsetAsync of a training step,
// against 4–6 µs in a launch. Four values a thread where aligned (cuda_common.cuh's quads).
__global__ void copy_kernel(const float* src, int64_t n, float* dst) {
  const int64_t whole = aligned_to(src, 16) && aligned_to(dst, 16) ? n / 4 : 0;
  FOR_EACH_INDEX(i, whole) reinterpret_cast<float4*>(dst)[i] = reinterpret_cast<const float4*>(src)[i];
  FOR_EACH_INDEX(i, n - 4 * whole) dst[4 * whole + i] = src[4 * whole + i];
}
__global__ void zero_kernel(float* x, int64_t n) {
  const int64_t whole = aligned_to(x, 16) ? n / 4 : 0;
  FOR_EACH_INDEX(i, whole) reinterpret_cast<float4*>(x)[i] = float4{0.f, 0.f, 0.f, 0.f};
  FOR_EACH_INDEX(i, n - 4 * whole) x[4 * whole + i] = 0.f;
}
void zero_floats(CudaState& st, float* x, int64_t n) {
  if (n <= 0) return;
  zero_kernel<<<blocks_for(quads(n)), kThreads, 0, st.stream>>>(x, n);
  check_launch("zero");
}
__global__ void add_into_kernel(float* x, const float* y, int64_t n) {
  const int64_t whole = aligned_to(x, 16) && aligned_to(y, 16) ? n / 4 : 0;
  FOR_EACH_INDEX(i, whole) {
    float4& a = reinterpret_cast<float4*>(x)[i];
    const float4 b = reinterpret_cast<const float4*>(y)[i];
    a = {a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w};
  }
  FOR_EACH_INDEX(i, n - 4 * whole) x[4 * whole + i] += y[4 * whole + i];
}
__global__ void scale_kernel(float* x, int64_t n, float factor) { FOR_EACH_INDEX(i, n) x[i] *= factor; }

// ---- optimizer and clipping ----

__global__ void adamw_kernel(float* theta, const float* grad, float* m, float* v, int64_t n, AdamWStep step) {
  FOR_EACH_INDEX(i, n) adamw_update_one(theta[i], grad[i], m[i], v[i], step);
}
// Up to 24 variables a launch (cuda::launch_per_group), their pointers a kernel parameter (1.2 KB).
constexpr int kVariablesPerLaunch = 24;
struct AdamWBatch {
  float* theta[kVariablesPerLaunch];
  const float* grad[kVariablesPerLaunch];
  float* m[kVariablesPerLaunch];
  float* v[kVariablesPerLaunch];
  int64_t n[kVariablesPerLaunch];
  bool decay[kVariablesPerLaunch];
};
__global__ void adamw_many_kernel(AdamWBatch batch, AdamWStep step) {
  const int x = blockIdx.y;
  step.decay = batch.decay[x];
  float *theta = batch.theta[x], *m = batch.m[x], *v = batch.v[x];
  const float* grad = batch.grad[x];
  FOR_EACH_INDEX(i, batch.n[x]) adamw_update_one(theta[i], grad[i], m[i], v[i], step);
}

constexpr int kSumBlocks = 256;  // fixed, so that the partial sums — and the total — do not depend on n

__global__ void sum_of_squares_kernel(const float* x, int64_t n, double* partial) {
  double acc = 0;
  FOR_EACH_INDEX(i, n) acc += double(x[i]) * double(x[i]);
  acc = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}
__global__ void sum_partials_kernel(const double* partial, int count, double* total) {
  double acc = 0;
  for (int i = 0; i < count; ++i) acc += partial[i];
  *total = acc;
}
__global__ void scale_by_ratio_kernel(float* x, int64_t n, float numerator, float denominator) {
  FOR_EACH_INDEX(i, n) x[i] = (x[i] * numerator) / denominator;
}
__global__ void clamp_kernel(float* x, int64_t n, float limit) {
  FOR_EACH_INDEX(i, n) x[i] = x[i] < -limit ? -limit : (limit < x[i] ? limit : x[i]);  // std::clamp's order
}
// Up to 64 arrays a launch (cuda::launch_per_group), their pointers and sizes a kernel parameter (1 KB):
// arrays first … first + count − 1 of a list of spans (const float or float).
constexpr int kArraysPerLaunch = 64;
template <class Element>
struct ArrayBatch {
  Element* data[kArraysPerLaunch];
  int64_t size[kArraysPerLaunch];
};
template <class Element>
ArrayBatch<Element> array_batch(const std::vector<Span<Element>>& arrays, size_t first, size_t count) {
  ArrayBatch<Element> batch{};
  for (size_t a = 0; a < count; ++a) {
    batch.data[a] = arrays[first + a].data;
    batch.size[a] = int64_t(arrays[first + a].size);
  }
  return batch;
}
__global__ void not_finite_kernel(ArrayBatch<const float> arrays, int* not_finite) {
  const float* x = arrays.data[blockIdx.y];
  FOR_EACH_INDEX(i, arrays.size[blockIdx.y]) if (!isfinite(x[i])) not_finite[blockIdx.y] = 1;
}
__global__ void zero_many_kernel(ArrayBatch<float> arrays) {
  float* x = arrays.data[blockIdx.y];
  FOR_EACH_INDEX(i, arrays.size[blockIdx.y]) x[i] = 0.f;
}

}  // namespace

// ---- the ops ----

void CudaBackend::row_abs_max_impl(const float* x, int64_t rows, int64_t cols, float* out) {
  if (rows == 0) return;
  row_abs_max_kernel<<<unsigned(rows), kThreads, 0, state_->stream>>>(x, cols, out);
  check_launch("row_abs_max");
}

// Threads of the norms' block per row: kThreads, or for few rows (decode: a row per sequence) up to
// 1024, so that a row of 2048 takes 2 values a thread in each of the kernel's dependent passes (the
// branch's join, the sum of squares, the output), not 8: its latency is decode's cost, 37 norms a
// 2B token. Unmeasured.
static unsigned norm_threads(int64_t rows, int64_t dim) {
  if (rows >= 64) return kThreads;
  return unsigned(std::clamp<int64_t>((dim + 31) / 32 * 32, kThreads, 1024));
}

void CudaBackend::rmsnorm_impl(const float* x, const float* scale, int64_t rows, int64_t dim, float eps, float* y) {
  if (rows == 0) return;
  rmsnorm_kernel<<<unsigned(rows), norm_threads(rows, dim), 0, state_->stream>>>(const_cast<float*>(x), nullptr,
                                                                                 nullptr, scale, dim, eps, y, nullptr);
  check_launch("rmsnorm");
}

void CudaBackend::add_rmsnorm_impl(float* x, const float* branch, const float* branch_scale, const float* scale,
                                   int64_t rows, int64_t dim, float eps, float* y, float* x_copy) {
  if (rows == 0) return;
  rmsnorm_kernel<<<unsigned(rows), norm_threads(rows, dim), 0, state_->stream>>>(x, branch, branch_scale, scale, dim,
                                                                                 eps, y, x_copy);
  check_launch("add_rmsnorm");
}

void CudaBackend::rmsnorm_backward_impl(const float* x, const float* scale, int64_t rows, int64_t dim, float eps,
                                        const float* dy, float* dx, float* dscale, bool accumulate) {
  if (rows == 0) return;
  double* inv = nullptr;
  if (dscale) {  // ∂s before dx: the model passes dx = dy, and ∂s sums dy over every row.
    inv = static_cast<double*>(state_->scratch_for(kRowScratch, size_t(rows) * sizeof(double)));
    rmsnorm_inverse_kernel<<<unsigned(rows), kThreads, 0, state_->stream>>>(x, dim, eps, inv);
    rmsnorm_scale_grad_kernel<<<blocks_for(dim), kThreads, 0, state_->stream>>>(x, dy, inv, rows, dim, dscale);
  }
  rmsnorm_backward_kernel<<<unsigned(rows), kThreads, 0, state_->stream>>>(x, scale, inv, eps, dim, dy, dx,
                                                                           accumulate);
  check_launch("rmsnorm_backward");
}

void CudaBackend::rope_impl(float* q, int64_t q_heads, float* k, int64_t k_heads, int64_t tokens, int64_t head_dim,
                            const int64_t* positions, float base, float scaling, float q_scale,
                            const CacheWrite* cache) {
  launch_rope(*state_, q, q_heads, k, k_heads, tokens, head_dim, positions, base, scaling, q_scale, false,
              RopeCacheRows(cache, tokens));
}

void CudaBackend::rope_backward_impl(float* dq, int64_t q_heads, float* dk, int64_t k_heads, int64_t tokens,
                                     int64_t head_dim, const int64_t* positions, float base, float scaling,
                                     float q_scale) {
  launch_rope(*state_, dq, q_heads, dk, k_heads, tokens, head_dim, positions, base, scaling, q_scale, true);
}

// The attention kernels' dynamic shared memory grows with the key slots. Their own __shared__ arrays
// (block_sum's and block_max's partials, a flag: under 400 bytes) count against the same per-block
// limits — 48 KB without the opt-in, the GPU's opt-in limit with it —, so the dynamic bytes keep
// kStaticSharedReserve of each free for them (a GPU refuses the launch, or the opt-in, otherwise).
constexpr size_t kStaticSharedReserve = 1024, kDefaultSharedBytes = 48 * 1024;
static size_t opt_in_shared_bytes(int gpu) {
  int limit = 0;
  check_cuda(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, gpu), "attention");
  return size_t(limit) - kStaticSharedReserve;
}
static bool needs_opt_in(size_t bytes) { return bytes > kDefaultSharedBytes - kStaticSharedReserve; }
static bool shared_fits(size_t bytes, int gpu) { return !needs_opt_in(bytes) || bytes <= opt_in_shared_bytes(gpu); }

// `bytes` of dynamic shared memory for `kernel`, allowed past the default when the GPU has them.
template <class Kernel>
static size_t attention_shared_bytes(Kernel kernel, const AttentionShape& s, size_t bytes, int gpu) {
  if (needs_opt_in(bytes)) {
    check(shared_fits(bytes, gpu), "attention on cuda: ", s.capacity, " key slots need ", bytes,
          " bytes of shared memory per block, more than this GPU's ", opt_in_shared_bytes(gpu),
          " (a shorter sequence fits)");
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)), "attention");
  }
  return bytes;
}

// The products of backend/batched_attention.h on cuBLAS over operands A, B (fp32, no TF32; or bf16
// under bf16_products) and C (fp32). They are column-major descriptions; the column-major
// C = op(A)·op(B) is the row-major Cᵀ = op(B)ᵀ·op(A)ᵀ that cuda::sgemm takes.
template <class In>
static void run_products(CudaState& st, const std::vector<BatchedProduct>& products, const In* A, const In* B,
                         float* C) {
  for (const BatchedProduct& p : products)
    cuda::sgemm(st, p.transpose_b, p.transpose_a, p.n, p.m, p.k, 1.f, B + p.b, p.ldb, A + p.a, p.lda, p.beta,
                C + p.c, p.ldc, "attention (batched product)",
                {.count = p.batch, .stride_a = p.stride_b, .stride_b = p.stride_a, .stride_c = p.stride_c});
}

// Threads per query's block: 128, or with few queries (decode: batch × heads blocks, too few for the
// GPU's SMs) wider blocks — up to 1024 threads, about four key slots per warp — so that the scores,
// one warp per key slot, are not a long serial loop.
static unsigned attention_threads(const AttentionShape& s, int64_t queries) {
  if (queries >= 1024) return 128;
  return unsigned(std::clamp<int64_t>((s.capacity + 3) / 4 * 32, 128, 1024));
}

// Attention's two routes, each writing every output: the per-query kernels (one block per query, its
// key slots' scores in shared memory: suits decode's few queries), or cuBLAS' batched products with
// softmax kernels over score rows in scratch memory (suits the long sequences of training and prefill).

// One scratch slot carved into arrays, each on a 256-byte boundary: made without a base it only
// adds up their sizes.
class ScratchArrays {
 public:
  explicit ScratchArrays(void* base = nullptr) : base_(static_cast<char*>(base)) {}
  template <class T>
  T* take(int64_t count) {
    T* p = base_ ? reinterpret_cast<T*>(base_ + bytes_) : nullptr;
    bytes_ += (size_t(count) * sizeof(T) + 255) / 256 * 256;
    return p;
  }
  size_t bytes() const { return bytes_; }

 private:
  char* base_;
  size_t bytes_ = 0;
};

// Few queries (decode, short prefills) over more key slots than one split: split_attention_*.
constexpr int64_t kSplitQueries = 512;

static void attention_by_splits(CudaState& st, int gpu, const float* q, const float* k, const float* v,
                                const uint8_t* key_valid, const AttentionShape& s, int64_t first, float* out) {
  const int64_t queries = s.batch * s.query_len * s.heads;
  SplitAttention a;
  a.first = first, a.L = attention_key_slots(s);
  const int64_t span = a.L - first, most_splits = std::max<int64_t>(1, kSplitBlocks / queries);
  a.length = std::max<int64_t>(kSplitSlots, (span + most_splits - 1) / most_splits);
  // A split's capped scores sit in shared memory: splits no longer than the GPU holds (more of them).
  if (needs_opt_in(size_t(a.length) * sizeof(float)))
    a.length = std::min(a.length, int64_t(opt_in_shared_bytes(gpu) / sizeof(float)));
  a.splits = (span + a.length - 1) / a.length;
  const auto carve = [&](ScratchArrays arrays) {
    a.capped = arrays.take<float>(queries * a.L);
    a.stats = arrays.take<double>(2 * queries * a.splits);
    a.partial = arrays.take<double>(queries * a.splits * s.head_dim);
    return arrays.bytes();
  };
  const size_t bytes = carve(ScratchArrays());
  carve(ScratchArrays(st.scratch_for(kAttentionScratch, bytes)));
  a.tickets = st.tickets_for(queries);
  const unsigned blocks = unsigned(queries * a.splits);
  split_attention_scores_kernel<<<blocks, kSplitThreads, 0, st.stream>>>(q, k, key_valid, s, a);
  check_launch("attention (split scores)");
  const size_t shared = attention_shared_bytes(split_attention_values_kernel, s, size_t(a.length) * sizeof(float), gpu);
  split_attention_values_kernel<<<blocks, kSplitThreads, shared, st.stream>>>(v, key_valid, s, a, out);
  check_launch("attention (split values)");
}

static void attention_per_query(CudaState& st, int gpu, const float* q, const float* k, const float* v,
                                const uint8_t* key_valid, const AttentionShape& s, float* out);
static bool per_query_fits(const AttentionShape& s, int64_t queries, int gpu);

static void attention_by_kernels(CudaState& st, int gpu, const float* q, const float* k, const float* v,
                                 const uint8_t* key_valid, const AttentionShape& s, float* out) {
  const int64_t queries = s.batch * s.query_len * s.heads;
  // The first slot any query may see: the first query's window start.
  const int64_t first = s.window > 0 ? std::max<int64_t>(0, s.start - s.window + 1) : 0;
  const int64_t visible = attention_key_slots(s) - first;
  if (queries <= kSplitQueries && visible > kSplitSlots) {
    if (!per_query_fits(s, queries, gpu)) return attention_by_splits(st, gpu, q, k, v, key_valid, s, first, out);
    // Per query or split, whichever the shape measured faster (MESHTUNE_CUDA_DECODE_ATTENTION): keyed
    // by the visible slots' power of two, so that decode measures again as its cache fills.
    static const std::string forced = cuda::forced_route("MESHTUNE_CUDA_DECODE_ATTENTION", {"per-query", "split"});
    const auto key = [&] {
      int64_t slots = 1;
      while (slots < visible) slots *= 2;
      return "attention few queries B=" + std::to_string(s.batch) + " T=" + std::to_string(s.query_len) +
             " N=" + std::to_string(s.heads) + " K=" + std::to_string(s.kv_heads) + " H=" + std::to_string(s.head_dim) +
             " slots<=" + std::to_string(slots) + " cap=" + std::to_string(s.soft_cap > 0) +
             " bf16=" + std::to_string(s.bf16_products);
    };
    const auto run = [&](bool split) {
      if (split) attention_by_splits(st, gpu, q, k, v, key_valid, s, first, out);
      else attention_per_query(st, gpu, q, k, v, key_valid, s, out);
    };
    return run(cuda::route_is_second(st, forced, key, run, {"per-query", "split"}));
  }
  attention_per_query(st, gpu, q, k, v, key_valid, s, out);
}

// attention_kernel's shared memory: probabilities and capped scores per slot, then the slot groups'
// partial sums.
static size_t per_query_shared_bytes(const AttentionShape& s, int64_t queries) {
  return size_t(attention_partials_offset(s)) * sizeof(float) +
         size_t(attention_slot_groups(s, attention_threads(s, queries)) * s.head_dim) * sizeof(double);
}
static bool per_query_fits(const AttentionShape& s, int64_t queries, int gpu) {
  return shared_fits(per_query_shared_bytes(s, queries), gpu);
}

static void attention_per_query(CudaState& st, int gpu, const float* q, const float* k, const float* v,
                                const uint8_t* key_valid, const AttentionShape& s, float* out) {
  const int64_t queries = s.batch * s.query_len * s.heads;
  const unsigned threads = attention_threads(s, queries);
  const size_t shared = attention_shared_bytes(attention_kernel, s, per_query_shared_bytes(s, queries), gpu);
  attention_kernel<<<unsigned(queries), threads, shared, st.stream>>>(q, k, v, key_valid, s, out);
  check_launch("attention");
}

// What the products route keeps in scratch: the score rows [queries, L] (fp32: scores, then on the
// fp32 route the probabilities, in place); backward's score gradients (fp32 dp, in place on the fp32
// route) and capped scores (with a soft-cap); under bf16_products the rounded probabilities and score
// gradients and the narrowed q, k, v and dout.
struct ProductScratch {
  float *scores = nullptr, *dscores = nullptr, *capped = nullptr;
  uint16_t *probs16 = nullptr, *dscores16 = nullptr, *q16 = nullptr, *k16 = nullptr, *v16 = nullptr,
           *dout16 = nullptr;
};

static ProductScratch product_scratch(CudaState& st, const AttentionShape& s, bool backward) {
  const int64_t queries = s.batch * s.query_len * s.heads, n = queries * attention_key_slots(s);
  const int64_t q_size = queries * s.head_dim, kv_size = s.batch * s.capacity * s.kv_heads * s.head_dim;
  const auto carve = [&](ScratchArrays a, size_t* bytes) {
    ProductScratch p;
    p.scores = a.take<float>(n);
    if (backward && !s.bf16_products) p.dscores = a.take<float>(n);
    if (backward && s.soft_cap > 0) p.capped = a.take<float>(n);
    if (s.bf16_products) {
      p.probs16 = a.take<uint16_t>(n);
      if (backward) p.dscores16 = a.take<uint16_t>(n);
      // q, k, v and dout consecutive, narrowed in one launch (narrow_product_inputs).
      p.q16 = a.take<uint16_t>(q_size + 2 * kv_size + (backward ? q_size : 0));
      if (p.q16) p.k16 = p.q16 + q_size, p.v16 = p.k16 + kv_size, p.dout16 = backward ? p.v16 + kv_size : nullptr;
    }
    if (bytes) *bytes = a.bytes();
    return p;
  };
  size_t bytes = 0;
  carve(ScratchArrays(), &bytes);
  return carve(ScratchArrays(st.scratch_for(kAttentionScratch, bytes)), nullptr);
}

// The bf16 copies of q, k, v and (backward, when given) dout, in one launch.
static void narrow_product_inputs(CudaState& st, const AttentionShape& s, const float* q, const float* k,
                                  const float* v, const float* dout, const ProductScratch& p) {
  const size_t q_size = size_t(s.batch * s.query_len * s.heads * s.head_dim),
               kv_size = size_t(s.batch * s.capacity * s.kv_heads * s.head_dim);
  std::vector<ConstFloats> parts = {{q, q_size, Device::Cuda}, {k, kv_size, Device::Cuda}, {v, kv_size, Device::Cuda}};
  if (dout) parts.push_back({dout, q_size, Device::Cuda});
  cuda::narrow_parts(st, parts, p.q16);
}

static void attention_by_products(CudaState& st, const float* q, const float* k, const float* v,
                                  const uint8_t* key_valid, const AttentionShape& s, float* out) {
  const int64_t queries = s.batch * s.query_len * s.heads, L = attention_key_slots(s);
  const ProductScratch p = product_scratch(st, s, /*backward=*/false);
  if (s.bf16_products) {
    narrow_product_inputs(st, s, q, k, v, nullptr, p);
    run_products(st, attention_score_products(s), p.k16, p.q16, p.scores);
  } else {
    run_products(st, attention_score_products(s), k, q, p.scores);
  }
  score_softmax_kernel<<<blocks_for(32 * queries), kThreads, 0, st.stream>>>(p.scores, nullptr, key_valid, s, queries, L,
                                                                            p.probs16);
  check_launch("attention (softmax)");
  if (s.bf16_products) run_products(st, attention_sum_products(s), p.v16, p.probs16, out);
  else run_products(st, attention_sum_products(s), v, p.scores, out);
}

struct AttentionGradients {
  const float* dout;
  float *dq, *dk, *dv;
};

static void attention_backward_by_kernels(CudaState& st, int gpu, const float* q, const float* k, const float* v,
                                          const uint8_t* key_valid, const AttentionShape& s,
                                          const AttentionGradients& g) {
  const int64_t queries = s.batch * s.query_len * s.heads, keys = s.batch * s.capacity * s.kv_heads;
  auto* probs = static_cast<float*>(st.scratch_for(kAttentionScratch, size_t(2 * queries * s.capacity) * 4 + 4));
  float* dscores = probs + queries * s.capacity;
  if (queries > 0) {
    const size_t shared = attention_shared_bytes(attention_backward_kernel, s, 3 * size_t(s.capacity) * sizeof(float), gpu);
    attention_backward_kernel<<<unsigned(queries), attention_threads(s, queries), shared, st.stream>>>(
        q, k, v, key_valid, s, g.dout, g.dq, probs, dscores);
    check_launch("attention_backward");
  }
  const unsigned threads = unsigned(std::min<int64_t>(256, (s.head_dim + 31) / 32 * 32));
  attention_key_gradients_kernel<<<unsigned(keys), threads, 0, st.stream>>>(q, g.dout, probs, dscores, s, g.dk, g.dv);
  check_launch("attention_backward (keys)");
}

// The products of the score rows' backward over inputs of type In (fp32, or bf16 under
// bf16_products): probabilities P and score gradients dS in `probs` and `dscores` (the fp32 route:
// in place over `scores` and `dp`).
template <class In>
static void backward_products(CudaState& st, const In* q, const In* k, const In* v, const In* dout,
                              const uint8_t* key_valid, const AttentionShape& s, const ProductScratch& p,
                              float* dp, const In* probs, const In* dscores, const AttentionGradients& g) {
  const int64_t queries = s.batch * s.query_len * s.heads, L = attention_key_slots(s);
  run_products(st, attention_score_products(s), k, q, p.scores);
  score_softmax_kernel<<<blocks_for(32 * queries), kThreads, 0, st.stream>>>(p.scores, p.capped, key_valid, s, queries,
                                                                            L, p.probs16);
  run_products(st, attention_score_products(s), v, dout, dp);  // dp = dout·vᵀ
  score_softmax_backward_kernel<<<blocks_for(32 * queries), kThreads, 0, st.stream>>>(p.scores, p.probs16, p.capped,
                                                                                       dp, p.dscores16, s, queries, L);
  check_launch("attention_backward (softmax)");
  run_products(st, attention_sum_products(s), k, dscores, g.dq);
  run_products(st, attention_key_gradient_products(s), q, dscores, g.dk);
  run_products(st, attention_key_gradient_products(s), dout, probs, g.dv);
}

static void attention_backward_by_products(CudaState& st, const float* q, const float* k, const float* v,
                                           const uint8_t* key_valid, const AttentionShape& s,
                                           const AttentionGradients& g) {
  const int64_t queries = s.batch * s.query_len * s.heads, keys = s.batch * s.capacity * s.kv_heads;
  if (queries == 0 || attention_key_slots(s) < s.capacity) {  // the products write slots below L only
    zero_floats(st, g.dk, keys * s.head_dim);
    zero_floats(st, g.dv, keys * s.head_dim);
  }
  if (queries == 0) return;
  const ProductScratch p = product_scratch(st, s, /*backward=*/true);
  if (s.bf16_products) {
    narrow_product_inputs(st, s, q, k, v, g.dout, p);
    backward_products(st, p.q16, p.k16, p.v16, p.dout16, key_valid, s, p, p.scores, p.probs16, p.dscores16, g);
  } else {
    backward_products(st, q, k, v, g.dout, key_valid, s, p, p.dscores, p.scores, p.dscores, g);
  }
}

std::string cuda::forced_route(const char* name, RouteNames names) {
  const char* value = std::getenv(name);
  const std::string route = value ? value : "auto";
  check(route == "auto" || route == names.first || route == names.second, name, "=", brief(route),
        ": expected auto, ", names.first, " or ", names.second);
  return route;
}

bool cuda::route_is_second(CudaState& st, const std::string& forced, const std::function<std::string()>& shape_key,
                           const std::function<void(bool second)>& run, RouteNames names) {
  if (forced != "auto") return forced == names.second;
  const std::string key = shape_key();
  auto known = st.routes.find(key);
  if (known != st.routes.end()) return known->second.second;
  st.not_while_capturing("time an op's routes");
  CudaState::RouteTiming timing;
  timing.first_name = names.first, timing.second_name = names.second;
  cudaEvent_t marks[5] = {};
  const std::string what = "time the routes of " + key;
  for (cudaEvent_t& e : marks) check_cuda(cudaEventCreate(&e), what.c_str());
  run(false), run(true);  // untimed: scratch grown, cuBLAS' kernels loaded
  check_cuda(cudaEventRecord(marks[0], st.stream), what.c_str());
  for (int round = 0; round < 2; ++round) {
    run(false);
    check_cuda(cudaEventRecord(marks[1 + 2 * round], st.stream), what.c_str());
    run(true);
    check_cuda(cudaEventRecord(marks[2 + 2 * round], st.stream), what.c_str());
  }
  check_cuda(cudaEventSynchronize(marks[4]), what.c_str());
  float ms[4] = {};
  for (int i = 0; i < 4; ++i) check_cuda(cudaEventElapsedTime(&ms[i], marks[i], marks[i + 1]), what.c_str());
  for (cudaEvent_t e : marks) cudaEventDestroy(e);
  timing.first_ms = std::min(ms[0], ms[2]);
  timing.second_ms = std::min(ms[1], ms[3]);
  timing.second = timing.second_ms < timing.first_ms;
  st.routes[key] = timing;
  return timing.second;
}

// Attention's route (cuda::route_is_second), MESHTUNE_CUDA_ATTENTION. The key leaves out `start`:
// decode's calls differ only there.
static bool attention_by_gemm(CudaState& st, const AttentionShape& s, bool backward,
                              const std::function<void(bool gemm)>& run) {
  static const std::string forced = cuda::forced_route("MESHTUNE_CUDA_ATTENTION");
  const auto key = [&] {
    return std::string("attention ") + (backward ? "backward" : "forward") + " B=" + std::to_string(s.batch) +
           " T=" + std::to_string(s.query_len) + " S=" + std::to_string(s.capacity) +
           " N=" + std::to_string(s.heads) + " K=" + std::to_string(s.kv_heads) + " H=" + std::to_string(s.head_dim) +
           " window=" + std::to_string(s.window) + " cap=" + std::to_string(s.soft_cap > 0) +
           " bf16=" + std::to_string(s.bf16_products);
  };
  return cuda::route_is_second(st, forced, key, run);
}

void CudaBackend::attention_impl(const float* q, const float* k, const float* v, const uint8_t* key_valid,
                                 const AttentionShape& s, float* out) {
  if (s.batch * s.query_len * s.heads == 0) return;
  CudaState& st = *state_;
  const auto run = [&](bool gemm) {
    if (gemm) attention_by_products(st, q, k, v, key_valid, s, out);
    else attention_by_kernels(st, gpu_, q, k, v, key_valid, s, out);
  };
  run(attention_by_gemm(st, s, /*backward=*/false, run));
}

void CudaBackend::attention_backward_impl(const float* q, const float* k, const float* v, const uint8_t* key_valid,
                                          const AttentionShape& s, const float* dout, float* dq, float* dk,
                                          float* dv) {
  if (s.batch * s.capacity * s.kv_heads == 0) return;
  CudaState& st = *state_;
  const AttentionGradients g{dout, dq, dk, dv};
  const auto run = [&](bool gemm) {
    if (gemm) attention_backward_by_products(st, q, k, v, key_valid, s, g);
    else attention_backward_by_kernels(st, gpu_, q, k, v, key_valid, s, g);
  };
  run(attention_by_gemm(st, s, /*backward=*/true, run));
}

std::vector<std::string> CudaBackend::routes() const {
  std::vector<std::string> lines;
  for (const auto& [key, t] : state_->routes) {
    char line[256];
    std::snprintf(line, sizeof line, "%s: %s %.3f ms, %s %.3f ms -> %s", key.c_str(), t.first_name, t.first_ms,
                  t.second_name, t.second_ms, t.second ? t.second_name : t.first_name);
    lines.push_back(line);
  }
  const CudaState::GraphCounts& g = state_->graph_counts;
  if (g.launched + g.uncaptured > 0 || !state_->graphs_off.empty())
    lines.push_back("steps as CUDA graphs: " + std::to_string(g.launched) + " launched (" +
                    std::to_string(g.instantiated) + " instantiated, " + std::to_string(g.updated) + " updated), " +
                    std::to_string(g.uncaptured) + " run without" +
                    (state_->graphs_off.empty() ? "" : "; off: " + state_->graphs_off));
  return lines;
}

void CudaBackend::geglu_impl(const float* gate, const float* up, int64_t n, float* out) {
  geglu_kernel<<<blocks_for(quads(n)), kThreads, 0, state_->stream>>>(gate, up, n, out);
  check_launch("geglu");
}
void CudaBackend::geglu_backward_impl(const float* gate, const float* up, const float* dout, int64_t n, float* dgate,
                                      float* dup) {
  geglu_backward_kernel<<<blocks_for(quads(n)), kThreads, 0, state_->stream>>>(gate, up, dout, n, dgate, dup);
  check_launch("geglu_backward");
}
void CudaBackend::geglu_to_bf16_impl(const float* gate, const float* up, int64_t n, uint16_t* out, uint16_t* gate_copy,
                                     uint16_t* up_copy) {
  geglu_to_bf16_kernel<<<blocks_for(quads(n)), kThreads, 0, state_->stream>>>(gate, up, n, out, gate_copy, up_copy);
  check_launch("geglu_to_bf16");
}
void CudaBackend::geglu_backward_bf16_impl(const uint16_t* gate, const uint16_t* up, const float* dout, int64_t n,
                                           uint16_t* dgate, uint16_t* dup) {
  geglu_backward_bf16_kernel<<<blocks_for(quads(n)), kThreads, 0, state_->stream>>>(gate, up, dout, n, dgate, dup);
  check_launch("geglu_backward_bf16");
}
void CudaBackend::soft_cap_impl(float* x, int64_t n, float cap) {
  soft_cap_kernel<<<blocks_for(n), kThreads, 0, state_->stream>>>(x, n, cap);
  check_launch("soft_cap");
}
void CudaBackend::soft_cap_backward_impl(const float* y, float* dy, int64_t n, float cap) {
  soft_cap_backward_kernel<<<blocks_for(n), kThreads, 0, state_->stream>>>(y, dy, n, cap);
  check_launch("soft_cap_backward");
}

void CudaBackend::softmax_row_max_impl(const float* z, int64_t n, int64_t cols, int64_t v0, float* max_and_argmax) {
  if (n == 0) return;
  // Few rows (decode) of many columns: parts of at least kRowMaxPartCols columns, about 256 blocks.
  constexpr int64_t kRowMaxPartCols = 4096, kRowMaxBlocks = 256;
  RowMaxParts split;
  split.parts = std::max<int64_t>(1, std::min(cols / kRowMaxPartCols, kRowMaxBlocks / n));
  if (split.parts > 1) {
    split.partial = static_cast<float*>(state_->scratch_for(kRowMaxScratch, size_t(2 * n * split.parts) * sizeof(float)));
    split.tickets = state_->tickets_for(n);
  }
  softmax_row_max_kernel<<<unsigned(n * split.parts), kThreads, 0, state_->stream>>>(z, n, cols, v0, max_and_argmax,
                                                                                    split);
  check_launch("softmax_row_max");
}
void CudaBackend::softmax_combine_max_impl(const float* gathered, int parts, int64_t n, float* max_and_argmax) {
  softmax_combine_max_kernel<<<blocks_for(n), kThreads, 0, state_->stream>>>(gathered, parts, n, max_and_argmax);
  check_launch("softmax_combine_max");
}
void CudaBackend::softmax_row_sums_impl(const float* z, int64_t n, int64_t cols, int64_t v0, const int32_t* targets,
                                        const float* max_and_argmax, double* sum_exp_and_target) {
  if (n == 0) return;
  softmax_row_sums_kernel<<<unsigned(n), kThreads, 0, state_->stream>>>(z, n, cols, v0, targets, max_and_argmax,
                                                                       sum_exp_and_target);
  check_launch("softmax_row_sums");
}
void CudaBackend::softmax_cross_entropy_sums_impl(const float* max_and_argmax, const double* sum_exp_and_target,
                                                  const int32_t* targets, const float* weights, int64_t n,
                                                  double* sums) {
  softmax_cross_entropy_sums_kernel<<<1, kThreads, 0, state_->stream>>>(max_and_argmax, sum_exp_and_target, targets,
                                                                        weights, n, sums);
  check_launch("softmax_cross_entropy_sums");
}
void CudaBackend::softmax_cross_entropy_backward_impl(float* z, int64_t n, int64_t cols, int64_t v0,
                                                      const int32_t* targets, const float* weights, double loss_scale,
                                                      const float* max_and_argmax, const double* sum_exp_and_target,
                                                      float cap) {
  softmax_cross_entropy_backward_kernel<<<blocks_for(n * cols), kThreads, 0, state_->stream>>>(
      z, n, cols, v0, targets, weights, loss_scale, max_and_argmax, sum_exp_and_target, cap);
  check_launch("softmax_cross_entropy_backward");
}

void CudaBackend::embedding_lookup_impl(const WeightMatrix& table, int64_t first_row, const int32_t* ids, int64_t M,
                                        float factor, float* out) {
  const MatrixView view{table.data, table.scales, table.rows, table.cols, table.dtype};
  embedding_lookup_kernel<<<blocks_for(M * table.cols), kThreads, 0, state_->stream>>>(view, first_row, ids, M, factor,
                                                                                        out);
  check_launch("embedding_lookup");
}
void CudaBackend::embedding_lookup_backward_impl(const float* dy, const int32_t* ids, int64_t M, int64_t dim,
                                                 int64_t first_row, int64_t rows, float factor, float* grad) {
  embedding_lookup_backward_kernel<<<blocks_for(dim), kThreads, 0, state_->stream>>>(dy, ids, M, dim, first_row, rows,
                                                                                     factor, grad);
  check_launch("embedding_lookup_backward");
}
void CudaBackend::greedy_tokens_impl(const float* max_and_argmax, int64_t rows, const uint8_t* keep, int32_t* ids) {
  if (rows == 0) return;
  greedy_tokens_kernel<<<blocks_for(rows), kThreads, 0, state_->stream>>>(max_and_argmax, rows, keep, ids);
  check_launch("greedy_tokens");
}
void CudaBackend::gather_rows_impl(const float* src, const int64_t* rows, int64_t n, int64_t dim, float* dst) {
  gather_rows_kernel<<<blocks_for(n * dim), kThreads, 0, state_->stream>>>(src, rows, n, dim, dst);
  check_launch("gather_rows");
}
void CudaBackend::scatter_rows_impl(const float* src, const int64_t* rows, int64_t n, int64_t dim, float* dst) {
  scatter_rows_kernel<<<blocks_for(n * dim), kThreads, 0, state_->stream>>>(src, rows, n, dim, dst);
  check_launch("scatter_rows");
}
void CudaBackend::interleave_column_blocks_impl(const float* blocks, int parts, int64_t M, int64_t part, float* out) {
  interleave_kernel<<<blocks_for(parts * M * part), kThreads, 0, state_->stream>>>(blocks, parts, M, part, out);
  check_launch("interleave_column_blocks");
}
void CudaBackend::copy_impl(const float* src, int64_t n, float* dst) {
  if (n == 0 || src == dst) return;
  copy_kernel<<<blocks_for(quads(n)), kThreads, 0, state_->stream>>>(src, n, dst);
  check_launch("copy");
}
void CudaBackend::zero_impl(float* x, int64_t n) {
  zero_floats(*state_, x, n);
}
void CudaBackend::add_into_impl(float* x, const float* y, int64_t n) {
  add_into_kernel<<<blocks_for(quads(n)), kThreads, 0, state_->stream>>>(x, y, n);
  check_launch("add_into");
}
void CudaBackend::scale_impl(float* x, int64_t n, float factor) {
  scale_kernel<<<blocks_for(n), kThreads, 0, state_->stream>>>(x, n, factor);
  check_launch("scale");
}

void CudaBackend::adamw_update_impl(float* theta, const float* grad, float* m, float* v, int64_t n,
                                    const AdamWStep& step) {
  adamw_kernel<<<blocks_for(n), kThreads, 0, state_->stream>>>(theta, grad, m, v, n, step);
  check_launch("adamw_update");
}
void CudaBackend::adamw_update_many_impl(const std::vector<AdamWVariable>& variables, const AdamWStep& step) {
  const auto size = [&](size_t i) { return variables[i].n; };
  cuda::launch_per_group(variables.size(), kVariablesPerLaunch, size, [&](size_t first, size_t count, dim3 grid) {
    AdamWBatch batch{};
    for (size_t i = 0; i < count; ++i) {
      const AdamWVariable& x = variables[first + i];
      batch.theta[i] = x.theta.data, batch.grad[i] = x.grad.data, batch.m[i] = x.m.data, batch.v[i] = x.v.data;
      batch.n[i] = x.n, batch.decay[i] = x.decay;
    }
    adamw_many_kernel<<<grid, kThreads, 0, state_->stream>>>(batch, step);
    check_launch("adamw_update");
  });
}

double CudaBackend::sum_of_squares_impl(const float* x, int64_t n) {
  auto* partial = static_cast<double*>(state_->scratch_for(kSumScratch, (kSumBlocks + 1) * sizeof(double)));
  sum_of_squares_kernel<<<kSumBlocks, kThreads, 0, state_->stream>>>(x, n, partial);
  sum_partials_kernel<<<1, 1, 0, state_->stream>>>(partial, kSumBlocks, partial + kSumBlocks);
  check_launch("sum_of_squares");
  double total = 0;
  download_impl(partial + kSumBlocks, sizeof(double), &total);
  return total;
}
void CudaBackend::scale_by_ratio_impl(float* x, int64_t n, float numerator, float denominator) {
  scale_by_ratio_kernel<<<blocks_for(n), kThreads, 0, state_->stream>>>(x, n, numerator, denominator);
  check_launch("scale_by_ratio");
}
void CudaBackend::clamp_impl(float* x, int64_t n, float limit) {
  clamp_kernel<<<blocks_for(n), kThreads, 0, state_->stream>>>(x, n, limit);
  check_launch("clamp");
}
void CudaBackend::zero_many_impl(const std::vector<Floats>& arrays) {
  const auto size = [&](size_t a) { return int64_t(arrays[a].size); };
  cuda::launch_per_group(arrays.size(), kArraysPerLaunch, size, [&](size_t first, size_t count, dim3 grid) {
    zero_many_kernel<<<grid, kThreads, 0, state_->stream>>>(array_batch(arrays, first, count));
    check_launch("zero (many)");
  });
}
int64_t CudaBackend::first_not_finite_impl(const std::vector<ConstFloats>& arrays) {
  if (arrays.empty()) return -1;
  // One flag per array, raised by its row of blocks (64 arrays a launch); all brought back at once
  // (the trainer checks every gradient and every updated value each step: one round trip).
  auto* flags = static_cast<int*>(state_->scratch_for(kSumScratch, arrays.size() * sizeof(int)));
  check_cuda(cudaMemsetAsync(flags, 0, arrays.size() * sizeof(int), state_->stream), "first_not_finite");
  const auto size = [&](size_t a) { return int64_t(arrays[a].size); };
  cuda::launch_per_group(arrays.size(), kArraysPerLaunch, size, [&](size_t first, size_t count, dim3 grid) {
    not_finite_kernel<<<grid, kThreads, 0, state_->stream>>>(array_batch(arrays, first, count), flags + first);
    check_launch("first_not_finite");
  });
  std::vector<int> raised(arrays.size());
  download_impl(flags, raised.size() * sizeof(int), raised.data());
  for (size_t a = 0; a < raised.size(); ++a)
    if (raised[a]) return int64_t(a);
  return -1;
}

}  // namespace meshtune
