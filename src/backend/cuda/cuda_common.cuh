// What the CUDA backend's files share: the error checks, the backend's state (stream, cuBLAS,
// cached blocks, scratch) and the launch shapes of its kernels.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "core/buffer.h"
#include "core/error.h"
#include "core/scalar_math.h"
#include "core/shared_library.h"

namespace meshtune::cuda {

// A failed CUDA call or kernel launch: one Error naming what was being done.
inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    fail("cuda: ", what, ": ", cudaGetErrorString(status), " (error ", int(status), ")");
}
inline void check_blas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) fail("cuBLAS: ", what, ": status ", int(status));
}
// After a kernel launch: a bad launch configuration is reported here, with the op's name.
inline void check_launch(const char* op) { check_cuda(cudaGetLastError(), op); }

// cuBLAS, opened when the first CUDA backend is made rather than linked: its libraries are 600 MB,
// and mapping them at start-up cost every CPU-only run ~150 MB of memory and 0.3 s.
struct Cublas {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasSetWorkspace_v2) set_workspace = nullptr;
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
  cublasStatus_t (*gemm_strided_batched_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                            const void*, const void*, cudaDataType, int, long long, const void*,
                                            cudaDataType, int, long long, const void*, void*, cudaDataType, int,
                                            long long, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
};
inline const Cublas& cublas() {
  static const Cublas loaded = [] {
    Cublas c;
#ifdef MESHTUNE_CUDA_EMULATOR  // tests/cuda_emulator: its own cuBLAS
    auto symbol = [](const char* name) { return cuda_emulator::cublas_symbol(name); };
#else
    const std::string soname = "libcublas.so." MESHTUNE_CUBLAS_MAJOR;
    void* lib = open_shared_library(soname, MESHTUNE_CUDA_LIBRARY_DIR, "--device cuda: cuBLAS");
    auto symbol = [&](const char* name) { return library_symbol(lib, soname, name, "--device cuda: cuBLAS"); };
#endif
    c.create = reinterpret_cast<decltype(c.create)>(symbol("cublasCreate_v2"));
    c.destroy = reinterpret_cast<decltype(c.destroy)>(symbol("cublasDestroy_v2"));
    c.set_stream = reinterpret_cast<decltype(c.set_stream)>(symbol("cublasSetStream_v2"));
    c.set_math_mode = reinterpret_cast<decltype(c.set_math_mode)>(symbol("cublasSetMathMode"));
    c.set_workspace = reinterpret_cast<decltype(c.set_workspace)>(symbol("cublasSetWorkspace_v2"));
    c.gemm_ex = reinterpret_cast<decltype(c.gemm_ex)>(symbol("cublasGemmEx"));
    c.gemm_strided_batched_ex =
        reinterpret_cast<decltype(c.gemm_strided_batched_ex)>(symbol("cublasGemmStridedBatchedEx"));
    return c;
  }();
  return loaded;
}

// The sum of `value` over the block (every thread gets it). blockDim.x is a multiple of 32, ≤ 1024.
__device__ inline double block_sum(double value) {
  __shared__ double partial[32];
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  double total = 0;
  for (int w = 0; w < warps; ++w) total += partial[w];  // in warp order: the same on every run
  return total;
}

// The sum of `value` over the warp (every lane gets it).
template <class Number>  // float or double
__device__ inline Number warp_sum(Number value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// Grid-stride loop over [0, n) by threads, along the grid's x (its y is free: the ops over many
// arrays let blockIdx.y pick the array).
#define FOR_EACH_INDEX(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

// Grid-stride loop over [0, n) by warps: one warp per item (its lanes share `item`; launch with
// blocks_for(32·n)).
#define FOR_EACH_WARP_ITEM(item, n)                                                                      \
  for (int64_t item = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; item < (n);               \
       item += int64_t(gridDim.x) * blockDim.x / 32)

constexpr int kThreads = 256;  // threads per block of the element-wise and per-row kernels

// Blocks for a grid-stride loop over n elements.
inline int blocks_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return int(blocks < 1 ? 1 : blocks > 8192 ? 8192 : blocks);
}

// The streaming kernels (bf16 narrowing and widening, copies, zeros) take four values a thread where
// their arrays are aligned for 16- / 8-byte accesses: one value a thread kept too few bytes in
// flight and ran at a third of an H200's bandwidth. Their grids: blocks_for(quads(n)); their loops:
// FOR_EACH_INDEX over the n / 4 whole quads (none when unaligned), then over the rest one by one.
inline int64_t quads(int64_t n) { return (n + 3) / 4; }
__device__ inline bool aligned_to(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Four values rounded to bf16 (nearest even) in one 8-byte word, and back: the streaming kernels'
// and the bf16 GeGLU kernels' four-values-a-thread loads and stores.
__device__ inline uint2 pack_bf16x4(float4 x) {
  return {uint32_t(f32_to_bf16(x.x)) | uint32_t(f32_to_bf16(x.y)) << 16,
          uint32_t(f32_to_bf16(x.z)) | uint32_t(f32_to_bf16(x.w)) << 16};
}
__device__ inline float4 unpack_bf16x4(uint2 x) {
  return {bf16_to_f32(uint16_t(x.x & 0xffffu)), bf16_to_f32(uint16_t(x.x >> 16)), bf16_to_f32(uint16_t(x.y & 0xffffu)),
          bf16_to_f32(uint16_t(x.y >> 16))};
}

// GeGLU of one value in fp32 with the CPU's formula (core/scalar_math.h): gelu_tanh(u)·w, shared by
// the GeGLU kernels and the few-row products that end in GeGLU. (Double tanh made the GeGLU kernels
// compute-bound on an H200: 1.1 ms and 1.9 ms for the 8 × 1024 × 24576 values of the 7B shape, about
// twice the time of their bytes.)
__device__ inline float gelu_sigmoid(float u) { return 1.f / (1.f + expf(gelu_sigmoid_exponent(u))); }
__device__ inline float geglu_value(float u, float w) { return u * gelu_sigmoid(u) * w; }

// RoPE of one pair (x1, x2) = (row[i], row[i + half]) at `position`: the rotation by position·θ_i,
// θ_i the inverse frequency (core/scalar_math.h), then ·scale (q_scale for a query, 1 — exact — for a
// key); or backward, ·scale first, then the inverse rotation: each a rounding of its own, as two
// separate ops round. The RoPE kernel and the few-row q/k products that end in RoPE share it.
struct RopePair {
  float first, second;
};
__device__ inline RopePair rope_pair(float x1, float x2, float position, int64_t i, int64_t head_dim, float base,
                                     float scaling, float scale, bool inverse) {
  const float angle = position * rope_inverse_frequency(i, head_dim, base, scaling);
  const float c = cosf(angle), s = inverse ? -sinf(angle) : sinf(angle);
  if (inverse) x1 *= scale, x2 *= scale;
  RopePair y{x1 * c - x2 * s, x2 * c + x1 * s};
  if (!inverse) y.first *= scale, y.second *= scale;
  return y;
}
// Where RoPE writes a decoding step's keys and values (Backend's CacheWrite of `tokens` as the kernels
// take it; none for null): token m = b·T + t, key head h go to cache row b·capacity + start + t.
struct RopeCacheRows {
  const float* values = nullptr;  // null: no cache
  int64_t T = 0, capacity = 0, start = 0;
  float *key_cache = nullptr, *value_cache = nullptr;
  RopeCacheRows() = default;
  RopeCacheRows(const CacheWrite* c, int64_t tokens) {
    if (!c) return;
    values = c->values.data, T = tokens / c->batch, capacity = c->capacity, start = c->start;
    key_cache = c->key_cache.data, value_cache = c->value_cache.data;
  }
  __device__ float* row(float* into, int64_t m, int64_t h, int64_t k_heads, int64_t head_dim) const {
    return into + (((m / T) * capacity + start + m % T) * k_heads + h) * head_dim;
  }
};

// The ops over many arrays (a step's finiteness check and AdamW update, a block's bf16 activations)
// hand the arrays' pointers to a kernel as a parameter, `per_launch` at a time: launch(first, count,
// grid) for each group of `items`, grid = (blocks for the group's largest size(i), at most
// kBlocksPerArray; count), so that blockIdx.y picks the array and FOR_EACH_INDEX strides over its
// elements. Every array gets the largest one's blocks, and the smaller arrays' extra blocks start
// only to find nothing to do: the cap keeps those few (a 7B block's 14 saved activations at 2 × 128
// tokens were 86,016 blocks, 62,976 of them empty; now 14,336, 1,536 empty). 1024 blocks of 256
// threads fill an H200 (132 multiprocessors × 2048 threads) once. A group of empty arrays launches
// nothing.
constexpr int kBlocksPerArray = 1024;
template <class Size, class Launch>
void launch_per_group(size_t items, size_t per_launch, const Size& size, const Launch& launch) {
  for (size_t first = 0; first < items; first += per_launch) {
    const size_t count = items - first < per_launch ? items - first : per_launch;
    int64_t largest = 0;
    for (size_t i = first; i < first + count; ++i) largest = size(i) > largest ? size(i) : largest;
    const int blocks = blocks_for(largest) < kBlocksPerArray ? blocks_for(largest) : kBlocksPerArray;
    if (largest > 0) launch(first, count, dim3(unsigned(blocks), unsigned(count)));
  }
}

}  // namespace meshtune::cuda

namespace meshtune {

// The state behind CudaBackend (cuda_backend.h keeps it opaque so that host code never includes
// CUDA's headers).
// Thrown inside a step being captured as a CUDA graph (CudaBackend::run_step) by what a capture
// cannot hold: memory to allocate or grow, a route to time, a host crossing. The step then runs
// without a graph.
struct NotCapturable {
  const char* what;
};

struct CudaState {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  // cuBLAS' workspace, ours: in a captured step cuBLAS would otherwise allocate one for each graph.
  void* blas_workspace = nullptr;
  static constexpr size_t kBlasWorkspaceBytes = size_t(32) << 20;  // what cuBLAS itself takes on Hopper

  // CUDA graphs (CudaBackend::run_step): while `capturing`, the stream's calls are recorded into the
  // step's graph instead of run; the graph instantiated last, updated in place by the next step's
  // capture where only parameters changed (decode: the step's position, the cache's length).
  bool capturing = false;
  cudaGraphExec_t step_graph = nullptr;
  std::string graphs_off;  // why steps run without graphs ("" = they use them): MESHTUNE_CUDA_GRAPHS=off, or a failure
  struct GraphCounts {
    int64_t launched = 0, updated = 0, instantiated = 0, uncaptured = 0;
  } graph_counts;
  // Called first by whatever a capture cannot hold.
  void not_while_capturing(const char* what) const {
    if (capturing) throw NotCapturable{what};
  }

  std::unordered_map<void*, size_t> live;               // allocated block → bytes
  std::unordered_multimap<size_t, void*> free_blocks;   // released blocks, reused by exact size
  // Scratch of the ops (bf16 copies of matmul inputs, widened weights, LoRA's intermediate
  // products, per-row values, partial sums, attention's scores, probabilities and score gradients,
  // the row maxima of long rows' parts; slots 0–3 cuda_backend.cu's, 4–7 cuda_ops.cu's, 8 the
  // Backend's default implementations' scratch_floats): grown when too small, never shrunk, reused in
  // stream order.
  std::vector<void*> scratch = std::vector<void*>(9, nullptr);
  std::vector<size_t> scratch_bytes = std::vector<size_t>(9, 0);
  // The route of each op and shape with two (our kernels or cuBLAS' products: attention per direction,
  // linear of few rows; decode attention per query or split), as measured at its first call
  // (cuda::route_is_second), by key.
  struct RouteTiming {
    bool second = false;
    float first_ms = 0, second_ms = 0;
    const char *first_name = "", *second_name = "";
  };
  std::map<std::string, RouteTiming> routes;
  // Pinned host memory for the host crossings that do not wait for the stream (cuda_backend.cu):
  // small uploads (the batch's ids, positions, masks), copied there and queued, and the downloads
  // the host collects later (start_download). Each slot holds one copy; its event is recorded after
  // the copy, and the slot is reused only once the host has waited for that.
  struct HostSlot {
    cudaEvent_t done = nullptr;
    uint64_t id = 0;         // the copy in the slot (0: none the host has not waited for)
    void* host = nullptr;    // a download's destination
    size_t bytes = 0;
  };
  static constexpr size_t kHostSlotBytes = 64 * 1024;
  static constexpr int kUploadSlots = 16;
  char* pinned = nullptr;  // the download slots, then the upload slots
  std::vector<HostSlot> download_slots, upload_slots;
  uint64_t downloads_started = 0, uploads_started = 0;

  // Counters of kernels whose last block per item finishes the item (split attention), zero between
  // launches: grown, and zeroed, when too few.
  int* tickets = nullptr;
  int64_t ticket_count = 0;

  int* tickets_for(int64_t count) {
    if (ticket_count < count) {
      not_while_capturing("grow the ticket counters");
      cuda::check_cuda(cudaStreamSynchronize(stream), "synchronize before growing the ticket counters");
      if (tickets) cuda::check_cuda(cudaFree(tickets), "free the ticket counters");
      tickets = nullptr;
      cuda::check_cuda(cudaMalloc(reinterpret_cast<void**>(&tickets), size_t(count) * sizeof(int)),
                       "allocate the ticket counters");
      ticket_count = count;
      cuda::check_cuda(cudaMemsetAsync(tickets, 0, size_t(count) * sizeof(int), stream), "zero the ticket counters");
    }
    return tickets;
  }

  void* scratch_for(int slot, size_t bytes) {
    if (scratch_bytes[size_t(slot)] < bytes) {
      not_while_capturing("grow scratch memory");
      cuda::check_cuda(cudaStreamSynchronize(stream), "synchronize before growing scratch memory");
      if (scratch[size_t(slot)]) cuda::check_cuda(cudaFree(scratch[size_t(slot)]), "free scratch memory");
      scratch[size_t(slot)] = nullptr;
      cuda::check_cuda(cudaMalloc(&scratch[size_t(slot)], bytes), "allocate scratch memory");
      scratch_bytes[size_t(slot)] = bytes;
    }
    return scratch[size_t(slot)];
  }
};

namespace cuda {

// Row-major fp32 products through cuBLAS (no TF32), with cblas_sgemm(CblasRowMajor, …)'s arguments:
// C[M, N] = alpha·op(A)·op(B) + beta·C, `count` times, each operand `stride_*` floats after the last
// (stride 0: the same matrix every time). `op` names the caller in errors.
struct Batch {
  int64_t count = 1, stride_a = 0, stride_b = 0, stride_c = 0;
};
void sgemm(CudaState& s, bool transpose_a, bool transpose_b, int64_t M, int64_t N, int64_t K, float alpha,
           const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc, const char* op,
           Batch batch = {});
// The same with bf16 A and B (fp32 sums, fp32 C): the bf16 policies' products on tensor cores.
void sgemm(CudaState& s, bool transpose_a, bool transpose_b, int64_t M, int64_t N, int64_t K, float alpha,
           const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc,
           const char* op, Batch batch = {});

// An op's two routes by name: our kernels or cuBLAS' products, unless named otherwise.
struct RouteNames {
  const char* first = "kernels";
  const char* second = "gemm";
};

// An op with two routes (run(false), run(true)) and which one its shape takes: the one `forced`
// names (an environment variable's value: one of `names`), or with `forced` auto the faster, timed
// at the first call of the shape's key() (each route run once untimed, then twice timed; the output
// is the chosen route's) and kept in s.routes. key() is called only under auto: a forced route
// builds no key on the hot path. The routes agree to rounding: both are tested against the reference.
bool route_is_second(CudaState& s, const std::string& forced, const std::function<std::string()>& key,
                     const std::function<void(bool second)>& run, RouteNames names = {});
// The route environment variable `name` forces: auto (unset) or one of `names`; anything else is an Error.
std::string forced_route(const char* name, RouteNames names = {});

// dst = src rounded to bf16 (nearest even), n values; or several arrays into consecutive parts of
// dst, up to 16 a launch.
void narrow(CudaState& s, const float* src, int64_t n, uint16_t* dst);
void narrow_parts(CudaState& s, const std::vector<Span<const float>>& parts, uint16_t* dst);

}  // namespace cuda
}  // namespace meshtune
