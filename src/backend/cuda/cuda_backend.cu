// The CUDA backend (cuda_backend.h): the GPU, its memory and the host crossings, and the matrix
// products through cuBLAS — linear and its gradients, LoRA's low-rank term and its gradients.
// The other ops are in cuda_ops.cu.
#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "backend/cuda/cuda_common.cuh"

namespace meshtune {

using cuda::aligned_to;
using cuda::blocks_for;
using cuda::check_blas;
using cuda::check_cuda;
using cuda::check_launch;
using cuda::geglu_value;
using cuda::kThreads;
using cuda::pack_bf16x4;
using cuda::quads;
using cuda::unpack_bf16x4;
using cuda::rope_pair;
using cuda::RopeCacheRows;
using cuda::RopePair;
using cuda::warp_sum;

CudaBackend::CudaBackend(int gpu) : gpu_(gpu), state_(std::make_unique<CudaState>()) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  check(status == cudaSuccess, "--device cuda: no usable NVIDIA GPU (cudaGetDeviceCount: ", cudaGetErrorString(status),
        ")");
  check(gpu >= 0 && gpu < count, "--device cuda: GPU ", gpu, " does not exist (this machine has ", count, ")");
  check_cuda(cudaSetDevice(gpu), "select the GPU");
  check_cuda(cudaStreamCreateWithFlags(&state_->stream, cudaStreamNonBlocking), "create a stream");
  check_blas(cuda::cublas().create(&state_->blas), "create a handle");
  check_blas(cuda::cublas().set_stream(state_->blas, state_->stream), "set the stream");
  // fp32 products stay fp32 (no TF32): the CPU's numbers under the float32 policy.
  check_blas(cuda::cublas().set_math_mode(state_->blas, CUBLAS_DEFAULT_MATH), "set the math mode");
  // After set_stream, which resets it to cuBLAS' own pool.
  check_cuda(cudaMalloc(&state_->blas_workspace, CudaState::kBlasWorkspaceBytes), "allocate cuBLAS' workspace");
  check_blas(cuda::cublas().set_workspace(state_->blas, state_->blas_workspace, CudaState::kBlasWorkspaceBytes),
             "set the workspace");
  const char* graphs = std::getenv("MESHTUNE_CUDA_GRAPHS");
  const std::string graphs_value = graphs ? graphs : "on";
  check(graphs_value == "on" || graphs_value == "off", "MESHTUNE_CUDA_GRAPHS=", brief(graphs_value),
        ": expected on or off");
  if (graphs_value == "off") state_->graphs_off = "MESHTUNE_CUDA_GRAPHS=off";
}

CudaBackend::~CudaBackend() {
  // Nothing may throw here: errors while tearing down are ignored (the process is ending or the
  // device is gone).
  if (state_->stream) cudaStreamSynchronize(state_->stream);
  if (state_->step_graph) cudaGraphExecDestroy(state_->step_graph);
  if (state_->blas_workspace) cudaFree(state_->blas_workspace);
  for (auto& [bytes, p] : state_->free_blocks) cudaFree(p);
  for (auto& [p, bytes] : state_->live) cudaFree(p);
  for (void* p : state_->scratch)
    if (p) cudaFree(p);
  if (state_->tickets) cudaFree(state_->tickets);
  for (const auto* slots : {&state_->download_slots, &state_->upload_slots})
    for (const CudaState::HostSlot& slot : *slots)
      if (slot.done) cudaEventDestroy(slot.done);
  if (state_->pinned) cudaFreeHost(state_->pinned);
  if (state_->blas) cuda::cublas().destroy(state_->blas);
  if (state_->stream) cudaStreamDestroy(state_->stream);
}

std::string CudaBackend::name() const {
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, gpu_);
  return std::string("cuda:") + std::to_string(gpu_) + " (" + prop.name + ")";
}

void* CudaBackend::stream() const { return state_->stream; }

void CudaBackend::synchronize() {
  state_->not_while_capturing("synchronize");
  check_cuda(cudaStreamSynchronize(state_->stream), "synchronize");
}

// ---- a step as one CUDA graph ----

// Captured, then launched as one graph: the launches and products of the step cost the host a
// capture each (cheaper than a launch) and the GPU none of the gaps between host launches. Each step
// is captured afresh, so its graph always holds this step's parameters and buffers; the executable
// graph is updated in place (cudaGraphExecUpdate) while the steps' work has the same shape, and
// instantiated again when not. A capture that meets what it cannot hold (NotCapturable: memory to
// grow, a route to time) is dropped and the step runs as it comes; any other failure inside one
// turns graphs off for this backend and runs the step as it comes (which raises a real error again).
void CudaBackend::run_step(const std::function<void()>& step) {
  CudaState& s = *state_;
  if (!s.graphs_off.empty() || s.capturing) return step();
  // Relaxed: an allocation the step asks for is not a stream call (and throws NotCapturable anyway).
  check_cuda(cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeRelaxed), "begin capturing a step");
  s.capturing = true;
  bool held = true;
  std::string failure;
  try {
    step();
  } catch (const NotCapturable&) {
    held = false;
  } catch (const std::exception& e) {
    held = false;
    failure = e.what();
  }
  s.capturing = false;
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(s.stream, &graph);
  if (ended != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    if (held) failure = std::string("cudaStreamEndCapture: ") + cudaGetErrorString(ended);
    held = false;
  }
  if (!held) {
    if (graph) cudaGraphDestroy(graph);
    if (!failure.empty()) s.graphs_off = "a step could not be captured (" + failure + ")";
    ++s.graph_counts.uncaptured;
    return step();
  }
  if (s.step_graph) {
    cudaGraphExecUpdateResultInfo info{};
    if (cudaGraphExecUpdate(s.step_graph, graph, &info) == cudaSuccess) {
      ++s.graph_counts.updated;
    } else {  // another shape of work: a new executable graph, once the old one has run
      cudaGetLastError();
      check_cuda(cudaStreamSynchronize(s.stream), "wait for the last step's graph");
      cudaGraphExecDestroy(s.step_graph);
      s.step_graph = nullptr;
    }
  }
  if (!s.step_graph) {
    const cudaError_t made = cudaGraphInstantiate(&s.step_graph, graph, 0);
    cudaGraphDestroy(graph);
    check_cuda(made, "instantiate a step's graph");
    ++s.graph_counts.instantiated;
  } else {
    cudaGraphDestroy(graph);
  }
  check_cuda(cudaGraphLaunch(s.step_graph, s.stream), "launch a step's graph");
  ++s.graph_counts.launched;
}

// ---- memory and the host crossings ----

void* CudaBackend::allocate_impl(size_t bytes) {
  bytes = bytes == 0 ? 1 : bytes;
  auto reused = state_->free_blocks.find(bytes);
  void* p = nullptr;
  if (reused != state_->free_blocks.end()) {
    p = reused->second;
    state_->free_blocks.erase(reused);
  } else {
    state_->not_while_capturing("allocate GPU memory");
    const cudaError_t status = cudaMalloc(&p, bytes);
    if (status != cudaSuccess) {
      cudaGetLastError();  // clear it
      fail("cuda: out of GPU memory allocating ", bytes, " bytes (", cudaGetErrorString(status), ")");
    }
  }
  state_->live[p] = bytes;
  return p;
}

void CudaBackend::release_impl(void* p) {
  auto it = state_->live.find(p);
  if (it == state_->live.end()) return;
  state_->free_blocks.emplace(it->second, p);  // kept for the next buffer of this size
  state_->live.erase(it);
}

// The pinned slots and their events, made at the first crossing that uses them.
static void make_host_slots(CudaState& s) {
  if (s.pinned) return;
  const size_t slots = size_t(Backend::kDownloadsInFlight + CudaState::kUploadSlots);
  check_cuda(cudaMallocHost(reinterpret_cast<void**>(&s.pinned), slots * CudaState::kHostSlotBytes),
             "allocate pinned host memory");
  s.download_slots.resize(size_t(Backend::kDownloadsInFlight));
  s.upload_slots.resize(size_t(CudaState::kUploadSlots));
  for (auto* list : {&s.download_slots, &s.upload_slots})
    for (CudaState::HostSlot& slot : *list)
      check_cuda(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming), "create an event");
}
static char* slot_memory(CudaState& s, bool upload, size_t slot) {
  return s.pinned + (upload ? size_t(Backend::kDownloadsInFlight) + slot : slot) * CudaState::kHostSlotBytes;
}

void CudaBackend::upload_impl(const void* host, size_t bytes, void* device) {
  if (bytes == 0) return;
  CudaState& s = *state_;
  s.not_while_capturing("upload");
  if (bytes > CudaState::kHostSlotBytes) {
    check_cuda(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, s.stream), "upload");
    // A pageable host buffer may be reused as soon as the call returns, while the copy may still
    // read it: wait.
    check_cuda(cudaStreamSynchronize(s.stream), "upload");
    return;
  }
  // A small one through a pinned slot, not waited for: the host queues on (the slot is reused once
  // its copy is done — kUploadSlots uploads later, long done in practice).
  make_host_slots(s);
  const size_t index = size_t(s.uploads_started++ % CudaState::kUploadSlots);
  CudaState::HostSlot& slot = s.upload_slots[index];
  if (slot.id != 0) check_cuda(cudaEventSynchronize(slot.done), "upload (a pinned slot's last copy)");
  char* staged = slot_memory(s, /*upload=*/true, index);
  std::memcpy(staged, host, bytes);
  check_cuda(cudaMemcpyAsync(device, staged, bytes, cudaMemcpyHostToDevice, s.stream), "upload");
  check_cuda(cudaEventRecord(slot.done, s.stream), "upload");
  slot.id = s.uploads_started;
}

void CudaBackend::download_impl(const void* device, size_t bytes, void* host) {
  if (bytes == 0) return;
  state_->not_while_capturing("download");
  check_cuda(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, state_->stream), "download");
  check_cuda(cudaStreamSynchronize(state_->stream), "download");
}

uint64_t CudaBackend::start_download_impl(const void* device, size_t bytes, void* host) {
  CudaState& s = *state_;
  if (bytes == 0) return 0;
  s.not_while_capturing("download");
  if (bytes > CudaState::kHostSlotBytes) {  // too big for a slot: at once
    download_impl(device, bytes, host);
    return 0;
  }
  make_host_slots(s);
  const uint64_t id = ++s.downloads_started;
  const size_t index = size_t(id % uint64_t(kDownloadsInFlight));
  if (s.download_slots[index].id != 0) finish_download_impl(s.download_slots[index].id);  // the oldest
  CudaState::HostSlot& slot = s.download_slots[index];
  check_cuda(cudaMemcpyAsync(slot_memory(s, /*upload=*/false, index), device, bytes, cudaMemcpyDeviceToHost,
                             s.stream),
             "download");
  check_cuda(cudaEventRecord(slot.done, s.stream), "download");
  slot.id = id, slot.host = host, slot.bytes = bytes;
  return id;
}

void CudaBackend::finish_download_impl(uint64_t id) {
  CudaState& s = *state_;
  if (s.download_slots.empty()) return;
  s.not_while_capturing("download");
  const size_t index = size_t(id % uint64_t(kDownloadsInFlight));
  CudaState::HostSlot& slot = s.download_slots[index];
  if (slot.id != id) return;  // finished already (a later start made room)
  check_cuda(cudaEventSynchronize(slot.done), "download");
  std::memcpy(slot.host, slot_memory(s, /*upload=*/false, index), slot.bytes);
  slot.id = 0;
}

// ---- bf16 narrowing and widening (matmul inputs under the bf16 policies) ----

namespace {  // the kernels and helpers of this file

// Four values a thread where aligned (cuda_common.cuh's quads).
__device__ void narrow_elements(const float* src, int64_t n, uint16_t* dst) {
  const int64_t whole = aligned_to(src, 16) && aligned_to(dst, 8) ? n / 4 : 0;
  FOR_EACH_INDEX(i, whole) reinterpret_cast<uint2*>(dst)[i] = pack_bf16x4(reinterpret_cast<const float4*>(src)[i]);
  FOR_EACH_INDEX(i, n - 4 * whole) dst[4 * whole + i] = f32_to_bf16(src[4 * whole + i]);
}
__device__ void widen_elements(const uint16_t* src, int64_t n, float* dst) {
  const int64_t whole = aligned_to(src, 8) && aligned_to(dst, 16) ? n / 4 : 0;
  FOR_EACH_INDEX(i, whole) reinterpret_cast<float4*>(dst)[i] = unpack_bf16x4(reinterpret_cast<const uint2*>(src)[i]);
  FOR_EACH_INDEX(i, n - 4 * whole) dst[4 * whole + i] = bf16_to_f32(src[4 * whole + i]);
}

__global__ void narrow_kernel(const float* src, int64_t n, uint16_t* dst) { narrow_elements(src, n, dst); }
__global__ void widen_kernel(const uint16_t* src, int64_t n, float* dst) { widen_elements(src, n, dst); }

static void widen(CudaState& s, const uint16_t* src, int64_t n, float* dst) {
  widen_kernel<<<blocks_for(quads(n)), kThreads, 0, s.stream>>>(src, n, dst);
  check_launch("widen_bf16");
}

// Several fp32 arrays and their consecutive parts of one bf16 array, up to 16 a launch
// (cuda::launch_per_group), their pointers a kernel parameter.
constexpr int kPartsPerLaunch = 16;
struct Bf16Parts {
  float* f32[kPartsPerLaunch];
  int64_t size[kPartsPerLaunch];
  int64_t offset[kPartsPerLaunch];  // of the part in the bf16 array
};

__global__ void narrow_parts_kernel(Bf16Parts parts, uint16_t* dst) {
  narrow_elements(parts.f32[blockIdx.y], parts.size[blockIdx.y], dst + parts.offset[blockIdx.y]);
}
__global__ void widen_parts_kernel(const uint16_t* src, Bf16Parts parts) {
  widen_elements(src + parts.offset[blockIdx.y], parts.size[blockIdx.y], parts.f32[blockIdx.y]);
}

// Calls launch(the parts of one launch, grid) for each group of kPartsPerLaunch parts.
template <class Part, class Launch>
static void for_each_launch_of_parts(const std::vector<Part>& parts, const Launch& launch) {
  std::vector<int64_t> offsets(parts.size() + 1, 0);  // of each part in the bf16 array
  for (size_t p = 0; p < parts.size(); ++p) offsets[p + 1] = offsets[p] + int64_t(parts[p].size);
  const auto size = [&](size_t p) { return int64_t(parts[p].size); };
  const auto threads = [&](size_t p) { return quads(size(p)); };  // the grid: four values a thread
  cuda::launch_per_group(parts.size(), kPartsPerLaunch, threads, [&](size_t first, size_t count, dim3 grid) {
    Bf16Parts batch{};
    for (size_t p = 0; p < count; ++p) {
      batch.f32[p] = const_cast<float*>(parts[first + p].data);  // read only, when narrowing
      batch.size[p] = size(first + p);
      batch.offset[p] = offsets[first + p];
    }
    launch(batch, grid);
  });
}

}  // namespace

void CudaBackend::narrow_to_bf16_impl(const float* src, int64_t n, uint16_t* dst) { cuda::narrow(*state_, src, n, dst); }
void CudaBackend::widen_bf16_impl(const uint16_t* src, int64_t n, float* dst) { widen(*state_, src, n, dst); }

void CudaBackend::narrow_parts_to_bf16_impl(const std::vector<ConstFloats>& parts, uint16_t* dst) {
  cuda::narrow_parts(*state_, parts, dst);
}
void CudaBackend::widen_bf16_parts_impl(const uint16_t* src, const std::vector<Floats>& parts) {
  for_each_launch_of_parts(parts, [&](const Bf16Parts& batch, dim3 grid) {
    widen_parts_kernel<<<grid, kThreads, 0, state_->stream>>>(src, batch);
    check_launch("widen_bf16 (parts)");
  });
}

// ---- linear: y = x·Wᵀ and its gradients, through cuBLAS ----
// cuBLAS is column-major: a row-major [R, C] array is its column-major [C, R] transpose, so
// y[M, rows] = x·Wᵀ is yᵀ (rows × M) = W (as Wᵀᵀ: op T of the column-major [cols, rows]) · xᵀ.

namespace {

// C (m × n, column-major, fp32) = alpha·op(A)·op(B) + beta·C, A and B in `type` (fp32 or bf16),
// fp32 sums.
void gemm(CudaState& s, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void* A,
          int64_t lda, const void* B, int64_t ldb, cudaDataType type, float beta, float* C, int64_t ldc,
          const char* op) {
  const float alpha = 1.f;
  check(m < (int64_t(1) << 31) && n < (int64_t(1) << 31) && k < (int64_t(1) << 31), op,
        ": a matrix dimension does not fit cuBLAS' 32-bit sizes");
  check_blas(cuda::cublas().gemm_ex(s.blas, ta, tb, int(m), int(n), int(k), &alpha, A, type, int(lda), B, type, int(ldb), &beta,
                          C, CUDA_R_32F, int(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
             op);
}

// The operands of a product as cuBLAS takes them: fp32, or bf16 under the bf16 precision.
struct MatmulOperands {
  const void* weights = nullptr;
  const void* activations = nullptr;
  cudaDataType type = CUDA_R_32F;
};

// W's values (code / scale, Keras' dequantization) as fp32: the input gradient goes through them.
__global__ void dequantize_kernel(const int8_t* codes, const float* scales, int64_t n, int64_t cols, float* out) {
  FOR_EACH_INDEX(e, n)
    out[e] = float(codes[e]) / scales[e / cols];
}

// The weights as a product takes them: under BF16 precision bf16 (narrowed into scratch slot 1 when
// stored fp32); under F32 fp32 (widened into slot 1 when stored bf16; int8 dequantized into it).
static const void* weight_operand(CudaState& s, const WeightMatrix& W, MatmulPrecision precision) {
  const int64_t size = W.rows * W.cols;
  if (W.dtype == DType::I8) {  // through the dequantized values, in fp32 (as the reference)
    auto* w = static_cast<float*>(s.scratch_for(1, size_t(size) * 4));
    dequantize_kernel<<<blocks_for(size), kThreads, 0, s.stream>>>(W.i8(), W.scales, size, W.cols, w);
    check_launch("dequantize_int8");
    return w;
  }
  if (precision == MatmulPrecision::BF16) {
    if (W.dtype == DType::BF16) return W.data;
    auto* w = static_cast<uint16_t*>(s.scratch_for(1, size_t(size) * 2));
    cuda::narrow(s, W.f32(), size, w);
    return w;
  }
  if (W.dtype == DType::F32) return W.data;
  auto* w = static_cast<float*>(s.scratch_for(1, size_t(size) * 4));
  widen(s, W.bf16(), size, w);
  return w;
}

// The product's type (bf16 under BF16 precision, but int8 weights keep fp32) and its activations (x,
// or dy in backward) as it takes them: narrowed into scratch slot 0 under bf16.
static cudaDataType product_type(const WeightMatrix& W, MatmulPrecision precision) {
  return W.dtype != DType::I8 && precision == MatmulPrecision::BF16 ? CUDA_R_16BF : CUDA_R_32F;
}
static const void* activation_operand(CudaState& s, const float* activations, int64_t count, cudaDataType type) {
  if (type == CUDA_R_32F) return activations;
  auto* a = static_cast<uint16_t*>(s.scratch_for(0, size_t(count) * 2));
  cuda::narrow(s, activations, count, a);
  return a;
}

static MatmulOperands matmul_operands(CudaState& s, const float* activations, int64_t count, const WeightMatrix& W,
                                      MatmulPrecision precision) {
  MatmulOperands out;
  out.type = product_type(W, precision);
  out.weights = weight_operand(s, W, precision);
  out.activations = activation_operand(s, activations, count, out.type);
  return out;
}

// ---- linear of few rows (decode): one warp per weight row, every input row at once ----
// y[m, r] = Σ_c x[m, c]·W[r, c] in fp32 for M ≤ kSmallRows rows of x; under BF16 precision x and fp32
// weights rounded to bf16 as they are read, as the cuBLAS route narrows them. The weights are read
// once, 16 bytes a lane, and widened on the fly (bf16 weights under F32 precision are not widened into
// a copy first); up to kSmallProducts weights of one input in one launch (q, k, v). Each lane sums
// its columns in order, the lanes' sums are added by xor shuffles: the same on every run.
constexpr int kSmallRows = 8, kSmallProducts = 4;
struct SmallProducts {
  const void* w[kSmallProducts];
  bool bf16[kSmallProducts];
  float* y[kSmallProducts];
  int64_t end[kSmallProducts];  // the products' rows, counted over all of them: product i's end
  int count;
};

__device__ inline float weight_at(const uint16_t* row, int64_t c) { return bf16_to_f32(row[c]); }
__device__ inline float weight_at(const float* row, int64_t c) { return row[c]; }
// Eight weights from column c (a multiple of 8; the row 16-byte aligned) as fp32.
__device__ inline void load_eight(const uint16_t* row, int64_t c, float (&w)[8]) {
  const uint4 v = *reinterpret_cast<const uint4*>(row + c);
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
  for (int j = 0; j < 4; ++j) {
    w[2 * j] = bf16_to_f32(uint16_t(words[j] & 0xffffu));
    w[2 * j + 1] = bf16_to_f32(uint16_t(words[j] >> 16));
  }
}
__device__ inline void load_eight(const float* row, int64_t c, float (&w)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(row + c), b = *reinterpret_cast<const float4*>(row + c + 4);
  w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
}
__device__ inline float as_input(float v, bool round) { return round ? round_to_bf16(v) : v; }

// This lane's share of row·x[m] for each of the M rows of x, added into sum[m]. Four 16-byte loads
// in flight a lane (unrolled by 4; was 2): a warp per row holds 2 KB in flight, so that the 2048
// warps of a 2B down projection (rows of 16384 columns) keep about 4 MB in flight on the GPU — what
// HBM's latency times its bandwidth asks. Registers 56 and 64 (the GeGLU form; were 60 and 62): the
// same occupancy. Unmeasured.
template <class Weight>
__device__ void small_row_sums(const Weight* row, const float* x, int M, int64_t cols, bool round,
                               float (&sum)[kSmallRows]) {
  const int lane = threadIdx.x % 32;
  const int64_t eights = cols % 8 == 0 && aligned_to(row, 16) && aligned_to(x, 16) ? cols / 8 : 0;
#pragma unroll 4
  for (int64_t e = lane; e < eights; e += 32) {
    float w[8];
    load_eight(row, 8 * e, w);
    for (int j = 0; j < 8; ++j) w[j] = as_input(w[j], round);
#pragma unroll
    for (int m = 0; m < kSmallRows; ++m)
      if (m < M) {
        float in[8];
        load_eight(x + m * cols, 8 * e, in);
        for (int j = 0; j < 8; ++j) sum[m] += w[j] * as_input(in[j], round);
      }
  }
  for (int64_t c = 8 * eights + lane; c < cols; c += 32) {
    const float w = as_input(weight_at(row, c), round);
#pragma unroll
    for (int m = 0; m < kSmallRows; ++m)
      if (m < M) sum[m] += w * as_input(x[m * cols + c], round);
  }
}

// This lane's share of product i's row r times each of the M rows of x (sum[m]; warp_sum adds the
// lanes'). Each kernel adds and writes one m at a time: holding all M totals cost 16 registers a
// thread (76, not 60), and occupancy.
__device__ void small_product_row(const SmallProducts& p, int i, int64_t r, const float* x, int M, int64_t cols,
                                  bool round, float (&sum)[kSmallRows]) {
  if (p.bf16[i]) small_row_sums(static_cast<const uint16_t*>(p.w[i]) + r * cols, x, M, cols, round, sum);
  else small_row_sums(static_cast<const float*>(p.w[i]) + r * cols, x, M, cols, round, sum);
}

__global__ void small_linear_kernel(const float* x, int M, int64_t cols, SmallProducts p, bool round) {
  const int lane = threadIdx.x % 32;
  FOR_EACH_WARP_ITEM(item, p.end[p.count - 1]) {
    int i = 0;
    while (item >= p.end[i]) ++i;
    const int64_t r = item - (i > 0 ? p.end[i - 1] : 0), rows = p.end[i] - (i > 0 ? p.end[i - 1] : 0);
    float sum[kSmallRows] = {};
    small_product_row(p, i, r, x, M, cols, round, sum);
#pragma unroll
    for (int m = 0; m < kSmallRows; ++m)
      if (m < M) {
        const float total = warp_sum(sum[m]);
        if (lane == m) p.y[i][m * rows + r] = total;
      }
  }
}

// The same two products (gate, then up: p.w[0] and p.w[1], of `rows` rows each) ending in GeGLU: a
// warp takes row r of both and writes out[m, r] = geglu_value(gate, up) — the few-row route's sums,
// then the GeGLU kernel's formula, in one launch.
__global__ void small_linear_geglu_kernel(const float* x, int M, int64_t cols, SmallProducts p, int64_t rows,
                                          bool round, float* out) {
  const int lane = threadIdx.x % 32;
  FOR_EACH_WARP_ITEM(r, rows) {
    float gate[kSmallRows] = {}, up[kSmallRows] = {};
    small_product_row(p, 0, r, x, M, cols, round, gate);
    small_product_row(p, 1, r, x, M, cols, round, up);
#pragma unroll
    for (int m = 0; m < kSmallRows; ++m)
      if (m < M) {
        const float g = warp_sum(gate[m]), u = warp_sum(up[m]);
        if (lane == m) out[m * rows + r] = geglu_value(g, u);
      }
  }
}

// q, k and v (p.w[0], p.w[1], p.w[2]) ending in RoPE and, with a cache, its write
// (Backend::linear_rope): a warp takes a pair of rows (i, i + half) of a query or key head — the
// few-row route's sums, then rope_pair and the query scale as the RoPE kernel applies them — or a
// row of v. 82 registers (3 blocks of 256 a multiprocessor, 24 warps with 2 KB each in flight);
// __launch_bounds__ for 4 blocks spilled.
struct RopeRows {
  int64_t q_heads, k_heads, head_dim;
  const int64_t* positions;
  float base, scaling, q_scale;
  RopeCacheRows cache;  // values: not read (v's rows go to the cache as they are made); null: no cache
};
__global__ void small_linear_rope_kernel(const float* x, int M, int64_t cols, SmallProducts p, RopeRows r,
                                         bool round) {
  const int lane = threadIdx.x % 32;
  const int64_t H = r.head_dim, half = H / 2, q_pairs = r.q_heads * half, k_pairs = r.k_heads * half;
  FOR_EACH_WARP_ITEM(item, q_pairs + k_pairs + r.k_heads * H) {
    if (item >= q_pairs + k_pairs) {  // a row of v
      const int64_t row = item - q_pairs - k_pairs;
      float sum[kSmallRows] = {};
      small_product_row(p, 2, row, x, M, cols, round, sum);
#pragma unroll
      for (int m = 0; m < kSmallRows; ++m)
        if (m < M) {
          const float total = warp_sum(sum[m]);
          if (lane != m) continue;
          p.y[2][m * r.k_heads * H + row] = total;
          if (r.cache.values) r.cache.row(r.cache.value_cache, m, row / H, r.k_heads, H)[row % H] = total;
        }
      continue;
    }
    const bool of_q = item < q_pairs;
    const int product = of_q ? 0 : 1;
    const int64_t pair = of_q ? item : item - q_pairs, head = pair / half, i = pair % half;
    const int64_t width = (of_q ? r.q_heads : r.k_heads) * H;
    float first[kSmallRows] = {}, second[kSmallRows] = {};
    small_product_row(p, product, head * H + i, x, M, cols, round, first);
    small_product_row(p, product, head * H + i + half, x, M, cols, round, second);
#pragma unroll
    for (int m = 0; m < kSmallRows; ++m)
      if (m < M) {
        const float x1 = warp_sum(first[m]), x2 = warp_sum(second[m]);
        if (lane != m) continue;
        const RopePair y = rope_pair(x1, x2, float(r.positions[m]), i, H, r.base, r.scaling, of_q ? r.q_scale : 1.f,
                                     false);
        float* out = p.y[product] + m * width + head * H;
        out[i] = y.first, out[i + half] = y.second;
        if (!of_q && r.cache.values) {
          float* cached = r.cache.row(r.cache.key_cache, m, head, r.k_heads, H);
          cached[i] = y.first, cached[i + half] = y.second;
        }
      }
  }
}

// Up to kSmallProducts of `outputs` from `first`, as the few-row kernels take them.
static SmallProducts small_products(const std::vector<LinearOutput>& outputs, size_t first) {
  SmallProducts p{};
  int64_t rows = 0;
  for (size_t i = first; i < outputs.size() && p.count < kSmallProducts; ++i, ++p.count) {
    const WeightMatrix& W = *outputs[i].W;
    p.w[p.count] = W.data;
    p.bf16[p.count] = W.dtype == DType::BF16;
    p.y[p.count] = outputs[i].y.data;
    p.end[p.count] = rows += W.rows;
  }
  return p;
}

static void small_linear(CudaState& s, const float* x, int64_t M, const std::vector<LinearOutput>& outputs,
                         MatmulPrecision precision) {
  for (size_t first = 0; first < outputs.size(); first += kSmallProducts) {
    const SmallProducts p = small_products(outputs, first);
    const int64_t rows = p.end[p.count - 1];
    if (rows == 0) continue;
    small_linear_kernel<<<blocks_for(32 * rows), kThreads, 0, s.stream>>>(
        x, int(M), outputs[first].W->cols, p, precision == MatmulPrecision::BF16);
    check_launch("linear (few rows)");
  }
}

// ---- int8 weights: Keras' arithmetic, as the CPU's (backend/cpu/int8.cpp) ----
// Each activation row quantized at its own scale (int8_scale of its max|x|, or of the given maxima
// of a row split over processes), exact int32 sums of code products, one division by both scales.

__global__ void quantize_rows_kernel(const float* x, int64_t n, int64_t cols, const float* row_max, int8_t* codes) {
  FOR_EACH_INDEX(e, n)
    codes[e] = int8_code(x[e], int8_scale(row_max[e / cols]));
}

// y[m, r] = int32(Σ_c xq[m, c]·wq[r, c]) / (s_x[m]·s_W[r]); |sum| < 2³¹ (check_int8_columns), so
// every partial sum is exact and the order does not matter. One warp per output, its lanes reading
// consecutive words of the row (coalesced); four codes at a time (__dp4a) when the rows are whole
// 4-byte words.
__global__ void int8_linear_kernel(const int8_t* xq, const float* row_max, const int8_t* w, const float* w_scales,
                                   int64_t M, int64_t rows, int64_t cols, float* y) {
  const int lane = threadIdx.x % 32;
  FOR_EACH_WARP_ITEM(e, M * rows) {
    const int64_t m = e / rows, r = e % rows;
    const int8_t* a = xq + m * cols;
    const int8_t* b = w + r * cols;
    int32_t acc = 0;
    if (cols % 4 == 0 && reinterpret_cast<uintptr_t>(a) % 4 == 0 && reinterpret_cast<uintptr_t>(b) % 4 == 0) {
      const int* a4 = reinterpret_cast<const int*>(a);
      const int* b4 = reinterpret_cast<const int*>(b);
      for (int64_t c = lane; c < cols / 4; c += 32) acc = __dp4a(a4[c], b4[c], acc);
    } else {
      for (int64_t c = lane; c < cols; c += 32) acc += int32_t(a[c]) * int32_t(b[c]);
    }
    for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    if (lane == 0) y[e] = float(acc) / (int8_scale(row_max[m]) * w_scales[r]);
  }
}

}  // namespace

void CudaBackend::linear_impl(const float* x, int64_t M, const WeightMatrix& W, float* y, MatmulPrecision precision,
                              const float* x_row_max) {
  if (W.dtype == DType::I8) {
    if (M == 0) return;
    auto* codes = static_cast<int8_t*>(state_->scratch_for(0, size_t(M * W.cols) + 4));  // 256-byte aligned
    const float* maxima = x_row_max;
    if (!maxima) {
      auto* own = static_cast<float*>(state_->scratch_for(2, size_t(M) * sizeof(float)));
      row_abs_max_impl(x, M, W.cols, own);
      maxima = own;
    }
    quantize_rows_kernel<<<blocks_for(M * W.cols), kThreads, 0, state_->stream>>>(x, M * W.cols, W.cols, maxima, codes);
    int8_linear_kernel<<<blocks_for(32 * M * W.rows), kThreads, 0, state_->stream>>>(codes, maxima, W.i8(), W.scales,
                                                                                      M, W.rows, W.cols, y);
    check_launch("linear (int8)");
    return;
  }
  linear_shared_input_impl(x, M, {{&W, Floats(y, size_t(M * W.rows), Device::Cuda)}}, precision);
}

// The products by cuBLAS, the input narrowed once for all of them under BF16 precision.
static void cublas_linear(CudaState& s, const float* x, int64_t M, const std::vector<LinearOutput>& outputs,
                          MatmulPrecision precision) {
  const cudaDataType type = product_type(*outputs[0].W, precision);
  const void* activations = activation_operand(s, x, M * outputs[0].W->cols, type);
  for (const LinearOutput& out : outputs) {
    const WeightMatrix& W = *out.W;
    gemm(s, CUBLAS_OP_T, CUBLAS_OP_N, W.rows, M, W.cols, weight_operand(s, W, precision), W.cols, activations, W.cols,
         type, 0.f, out.y.data, W.rows, "linear");
  }
}

// The few-row products' route (MESHTUNE_CUDA_LINEAR: auto, kernels or gemm) and the key its timings
// are kept under.
static const std::string& forced_linear_route() {
  static const std::string forced = cuda::forced_route("MESHTUNE_CUDA_LINEAR");
  return forced;
}
static std::string linear_route_key(int64_t M, const std::vector<LinearOutput>& outputs, MatmulPrecision precision) {
  std::string shape = "linear M=" + std::to_string(M) + " cols=" + std::to_string(outputs[0].W->cols) + " rows";
  for (const LinearOutput& out : outputs)
    shape += " " + std::to_string(out.W->rows) + (out.W->dtype == DType::BF16 ? " bf16" : " f32");
  return shape + (precision == MatmulPrecision::BF16 ? ", bf16 products" : ", f32 products");
}

// Products of one input: few rows (decode) by small_linear or cuBLAS, whichever the shape's first
// call measured faster; more rows by cuBLAS. int8 weights keep their own kernels.
void CudaBackend::linear_shared_input_impl(const float* x, int64_t M, const std::vector<LinearOutput>& outputs,
                                           MatmulPrecision precision) {
  if (M == 0 || outputs.empty()) return;
  for (const LinearOutput& out : outputs)
    if (out.W->dtype == DType::I8) return Backend::linear_shared_input_impl(x, M, outputs, precision);
  CudaState& s = *state_;
  const auto run = [&](bool by_cublas) {
    if (by_cublas) cublas_linear(s, x, M, outputs, precision);
    else small_linear(s, x, M, outputs, precision);
  };
  if (M > kSmallRows) return run(true);
  run(cuda::route_is_second(s, forced_linear_route(), [&] { return linear_route_key(M, outputs, precision); }, run));
}

// Gate and up ending in GeGLU: of few rows, one launch of small_linear_geglu_kernel (gate and up
// untouched), or cuBLAS' two products and the GeGLU kernel, timed as a route of its own; more rows
// (or int8 weights) as every backend does it.
void CudaBackend::linear_geglu_impl(const float* x, int64_t M, const WeightMatrix& W_gate, const WeightMatrix& W_up,
                                    float* gate, float* up, float* out, MatmulPrecision precision) {
  if (M > kSmallRows || W_gate.dtype == DType::I8 || W_up.dtype == DType::I8)
    return Backend::linear_geglu_impl(x, M, W_gate, W_up, gate, up, out, precision);
  if (M == 0) return;
  CudaState& s = *state_;
  const int64_t n = M * W_gate.rows;
  const std::vector<LinearOutput> outputs{{&W_gate, Floats(gate, size_t(n), Device::Cuda)},
                                          {&W_up, Floats(up, size_t(n), Device::Cuda)}};
  const auto run = [&](bool by_cublas) {
    if (by_cublas) {
      cublas_linear(s, x, M, outputs, precision);
      geglu_impl(gate, up, n, out);
      return;
    }
    small_linear_geglu_kernel<<<blocks_for(32 * W_gate.rows), kThreads, 0, s.stream>>>(
        x, int(M), W_gate.cols, small_products(outputs, 0), W_gate.rows, precision == MatmulPrecision::BF16, out);
    check_launch("linear_geglu (few rows)");
  };
  const auto key = [&] { return linear_route_key(M, outputs, precision) + ", then GeGLU"; };
  run(cuda::route_is_second(s, forced_linear_route(), key, run));
}

// q, k and v ending in RoPE: of few rows, one launch of small_linear_rope_kernel, or cuBLAS' three
// products and the RoPE kernel, timed as a route of its own; more rows (or int8 weights) as every
// backend does it.
void CudaBackend::linear_rope_impl(const float* x, int64_t M, const WeightMatrix& W_q, const WeightMatrix& W_k,
                                   const WeightMatrix& W_v, float* q, float* k, float* v, const RopeStep& rope,
                                   MatmulPrecision precision) {
  const bool int8 = W_q.dtype == DType::I8 || W_k.dtype == DType::I8 || W_v.dtype == DType::I8;
  if (M > kSmallRows || int8 || rope.head_dim % 2 != 0)
    return Backend::linear_rope_impl(x, M, W_q, W_k, W_v, q, k, v, rope, precision);
  if (M == 0) return;
  CudaState& s = *state_;
  const auto out = [&](float* y, const WeightMatrix& W) { return Floats(y, size_t(M * W.rows), Device::Cuda); };
  const std::vector<LinearOutput> outputs{{&W_q, out(q, W_q)}, {&W_k, out(k, W_k)}, {&W_v, out(v, W_v)}};
  const auto run = [&](bool by_cublas) {
    if (by_cublas) {
      cublas_linear(s, x, M, outputs, precision);
      rope_impl(q, rope.q_heads, k, rope.k_heads, M, rope.head_dim, rope.positions.data, rope.base, rope.scaling,
                rope.q_scale, rope.cache);
      return;
    }
    const RopeRows rows{rope.q_heads, rope.k_heads, rope.head_dim, rope.positions.data, rope.base,
                        rope.scaling, rope.q_scale, RopeCacheRows(rope.cache, M)};
    const int64_t items = (rope.q_heads + rope.k_heads) * (rope.head_dim / 2) + rope.k_heads * rope.head_dim;
    small_linear_rope_kernel<<<blocks_for(32 * items), kThreads, 0, s.stream>>>(
        x, int(M), W_q.cols, small_products(outputs, 0), rows, precision == MatmulPrecision::BF16);
    check_launch("linear_rope (few rows)");
  };
  const auto key = [&] { return linear_route_key(M, outputs, precision) + ", then RoPE"; };
  run(cuda::route_is_second(s, forced_linear_route(), key, run));
}

void CudaBackend::linear_backward_input_impl(const float* dy, int64_t M, const WeightMatrix& W, float* dx,
                                             bool accumulate, MatmulPrecision precision) {
  // dx[M, cols] = dy[M, rows]·W: dxᵀ (cols × M) = (W as column-major [cols, rows]) · dyᵀ.
  const MatmulOperands op = matmul_operands(*state_, dy, M * W.rows, W, precision);
  gemm(*state_, CUBLAS_OP_N, CUBLAS_OP_N, W.cols, M, W.rows, op.weights, W.cols, op.activations, W.rows, op.type,
       accumulate ? 1.f : 0.f, dx, W.cols, "linear_backward_input");
}

// Several products into one dx: under BF16 precision every dy narrowed in one launch (into
// consecutive parts of scratch slot 0; the weights keep slot 1), then the products, adding after the
// first. fp32 and int8 products narrow nothing, so they go one by one.
void CudaBackend::linear_backward_input_shared_impl(const std::vector<LinearOutputGradient>& gradients, int64_t M,
                                                    float* dx, bool accumulate, MatmulPrecision precision) {
  bool narrowed_together = gradients.size() > 1 && M > 0;
  for (const LinearOutputGradient& g : gradients)
    if (product_type(*g.W, precision) != CUDA_R_16BF) narrowed_together = false;
  if (!narrowed_together) return Backend::linear_backward_input_shared_impl(gradients, M, dx, accumulate, precision);
  CudaState& s = *state_;
  std::vector<Span<const float>> dys;
  int64_t total = 0;
  for (const LinearOutputGradient& g : gradients) {
    dys.emplace_back(g.dy.data, size_t(M * g.W->rows), g.dy.device);
    total += M * g.W->rows;
  }
  auto* narrowed = static_cast<uint16_t*>(s.scratch_for(0, size_t(total) * 2));
  cuda::narrow_parts(s, dys, narrowed);
  int64_t offset = 0;
  for (size_t i = 0; i < gradients.size(); ++i) {
    const WeightMatrix& W = *gradients[i].W;
    gemm(s, CUBLAS_OP_N, CUBLAS_OP_N, W.cols, M, W.rows, weight_operand(s, W, precision), W.cols, narrowed + offset,
         W.rows, CUDA_R_16BF, accumulate || i > 0 ? 1.f : 0.f, dx, W.cols, "linear_backward_input");
    offset += M * W.rows;
  }
}

float* CudaBackend::scratch_floats(size_t n) {
  return static_cast<float*>(state_->scratch_for(8, n * sizeof(float)));
}

// Inputs already in bf16 go to cuBLAS as they are (no narrowing launch); the weights as under BF16.
void CudaBackend::linear_bf16_input_impl(const uint16_t* x, int64_t M, const WeightMatrix& W, float* y) {
  CudaState& s = *state_;
  gemm(s, CUBLAS_OP_T, CUBLAS_OP_N, W.rows, M, W.cols, weight_operand(s, W, MatmulPrecision::BF16), W.cols, x, W.cols,
       CUDA_R_16BF, 0.f, y, W.rows, "linear");
}
void CudaBackend::linear_backward_input_bf16_impl(const std::vector<Bf16OutputGradient>& gradients, int64_t M,
                                                  float* dx, bool accumulate) {
  CudaState& s = *state_;
  for (size_t i = 0; i < gradients.size(); ++i) {
    const WeightMatrix& W = *gradients[i].W;
    gemm(s, CUBLAS_OP_N, CUBLAS_OP_N, W.cols, M, W.rows, weight_operand(s, W, MatmulPrecision::BF16), W.cols,
         gradients[i].dy.data, W.rows, CUDA_R_16BF, accumulate || i > 0 ? 1.f : 0.f, dx, W.cols,
         "linear_backward_input");
  }
}

void CudaBackend::linear_backward_weight_impl(const float* dy, const float* x, int64_t M, int64_t rows, int64_t cols,
                                              float* dW) {
  // dW[rows, cols] += dyᵀ·x: dWᵀ (cols × rows) += xᵀ (cols × M) · dy (op T of column-major [rows, M]).
  gemm(*state_, CUBLAS_OP_N, CUBLAS_OP_T, cols, rows, M, x, cols, dy, rows, CUDA_R_32F, 1.f, dW, cols,
       "linear_backward_weight");
}

// ---- LoRA's low-rank term: y[:, g] += scale·(x·A_g)·B, with strided A and B ----
// As the CPU does it (backend/cpu/low_rank.cpp), through cuBLAS in fp32: the factors gathered into
// contiguous matrices — a [in, R] with a(i, g·r + j) = A_g(i, j), R = groups·rank; b [r, og] —, then
// x·A of every group is one product and the products with B one product batched over the groups.
//
// Three of the products have long sums and small outputs: x·a (over the input width), ∂A (over the
// rows) and ∂B (over rows × groups). As one cuBLAS product each, such a shape has few output tiles
// and so runs on a few of the GPU's multiprocessors: x·a of the 7B query at 2048 rows is 16 tiles of
// 128 × 128 on an H200's 132, ∂B 1 or 2. So their sums are cut into chunks (SplitSum), one
// strided-batched product writes each chunk's partial sums, and a kernel adds the chunks in order
// (the same result on every run).

namespace {

constexpr int kFactorScratch = 0, kPartialScratch = 1, kDownScratch = 2, kBackScratch = 3;

// Chunks enough for about kSplitTiles output tiles of 128 × 128 in all, each of at least kMinChunk terms,
// a multiple of 8 (so that a chunk starts 32-byte aligned where its operand's rows do).
constexpr int64_t kSplitTiles = 512, kMinChunk = 256;
struct SplitSum {
  int64_t chunks = 1, length = 0;  // terms per chunk; the last chunk may have fewer
};
SplitSum split_sum(int64_t rows, int64_t cols, int64_t terms) {
  const int64_t tiles = ((rows + 127) / 128) * ((cols + 127) / 128);
  const int64_t wanted = std::max<int64_t>(1, std::min((kSplitTiles + tiles - 1) / tiles, terms / kMinChunk));
  if (wanted == 1) return {1, terms};
  const int64_t length = ((terms + wanted - 1) / wanted + 7) / 8 * 8;
  return {(terms + length - 1) / length, length};
}

// out[c] = alpha·op(A)·op(B) over the terms [c·length, (c + 1)·length) of the sum, for each chunk c:
// row-major [M, N] blocks one after another (cuda::sgemm's arguments). One chunk is one plain product.
void chunked_product(CudaState& s, bool transpose_a, bool transpose_b, int64_t M, int64_t N, int64_t K, float alpha,
                     const float* A, int64_t lda, const float* B, int64_t ldb, const SplitSum& split, float* out,
                     const char* op) {
  const int64_t step_a = transpose_a ? lda : 1, step_b = transpose_b ? 1 : ldb;  // from one term to the next
  const int64_t length = split.length, whole = K / length;
  if (whole > 0)
    cuda::sgemm(s, transpose_a, transpose_b, M, N, length, alpha, A, lda, B, ldb, 0.f, out, N, op,
                {.count = whole, .stride_a = length * step_a, .stride_b = length * step_b, .stride_c = M * N});
  if (whole < split.chunks)  // the shorter last chunk
    cuda::sgemm(s, transpose_a, transpose_b, M, N, K - whole * length, alpha, A + whole * length * step_a, lda,
                B + whole * length * step_b, ldb, 0.f, out + whole * M * N, N, op);
}

// Σ_c partial[c·n + i], in chunk order.
__device__ inline float chunk_sum(const float* partial, int64_t chunks, int64_t n, int64_t i) {
  float total = partial[i];
  for (int64_t c = 1; c < chunks; ++c) total += partial[c * n + i];
  return total;
}
__global__ void sum_chunks_kernel(const float* partial, int64_t chunks, int64_t n, float* out) {
  FOR_EACH_INDEX(i, n) out[i] = chunk_sum(partial, chunks, n, i);
}

// Where the partial sums of ∂B start after ∂A's in one scratch block: rounded up to 256 bytes.
int64_t rounded_to_64(int64_t floats) { return (floats + 63) / 64 * 64; }

// The gathered factors' values — a's in·R, then b's r·og — and element e's place in the term's
// strided A or B: one mapping for gathering the factors and for adding their gradients back.
__host__ __device__ inline int64_t factor_elements(const LowRankTerm& t) {
  return t.in * t.groups * t.rank + t.rank * t.out_per_group;
}
struct FactorElement {
  bool of_a;
  int64_t packed;   // in a (e), or in b (e − in·R)
  int64_t strided;  // in A (and ∂A), or in B (and ∂B)
};
__device__ inline FactorElement factor_element(const LowRankTerm& t, int64_t e) {
  const int64_t r = t.rank, R = t.groups * r, og = t.out_per_group, na = t.in * R;
  if (e < na) {
    const int64_t i = e / R, g = (e % R) / r, j = e % r;
    return {true, e, g * t.a_group + i * t.a_row + j * t.a_col};
  }
  const int64_t f = e - na, j = f / og, o = f % og;
  return {false, f, j * t.b_row + o * t.b_col};
}

__global__ void gather_factors_kernel(LowRankTerm t, float* a, float* b) {
  FOR_EACH_INDEX(e, factor_elements(t)) {
    const FactorElement x = factor_element(t, e);
    if (x.of_a) a[x.packed] = t.a[x.strided];
    else b[x.packed] = t.b[x.strided];
  }
}

// ∂A_g(i, j) += ga(i, g·r + j) and ∂B(j, o) += gb(j, o), for the factors the term trains; ga and gb
// are the chunks' partial sums.
__global__ void add_factor_gradients_kernel(LowRankTerm t, const float* ga, int64_t chunks_a, const float* gb,
                                            int64_t chunks_b) {
  const int64_t na = t.in * t.groups * t.rank, nb = t.rank * t.out_per_group;
  FOR_EACH_INDEX(e, factor_elements(t)) {
    const FactorElement x = factor_element(t, e);
    if (x.of_a && t.grad_a) t.grad_a[x.strided] += chunk_sum(ga, chunks_a, na, x.packed);
    if (!x.of_a && t.grad_b) t.grad_b[x.strided] += chunk_sum(gb, chunks_b, nb, x.packed);
  }
}

struct Factors {
  const float* a;  // [in, R]
  const float* b;  // [r, og]
};

Factors gather_factors(CudaState& s, const LowRankTerm& t) {
  auto* a = static_cast<float*>(s.scratch_for(kFactorScratch, size_t(factor_elements(t) + 64) * 4));
  float* b = a + rounded_to_64(t.in * t.groups * t.rank);
  gather_factors_kernel<<<blocks_for(factor_elements(t)), kThreads, 0, s.stream>>>(t, a, b);
  check_launch("low_rank (gather the factors)");
  return {a, b};
}

// u[M, R] = x[M, in] · a (all groups at once), its sum over the input width in chunks.
void project_down(CudaState& s, const float* x, int64_t M, const LowRankTerm& t, const Factors& f, float* u) {
  const int64_t R = t.groups * t.rank;
  const SplitSum split = split_sum(M, R, t.in);
  if (split.chunks == 1) return chunked_product(s, false, false, M, R, t.in, 1.f, x, t.in, f.a, R, split, u, "low_rank");
  auto* partial = static_cast<float*>(s.scratch_for(kPartialScratch, size_t(split.chunks * M * R) * 4));
  chunked_product(s, false, false, M, R, t.in, 1.f, x, t.in, f.a, R, split, partial, "low_rank");
  sum_chunks_kernel<<<blocks_for(M * R), kThreads, 0, s.stream>>>(partial, split.chunks, M * R, u);
  check_launch("low_rank (add the chunks of x·A)");
}

}  // namespace

void CudaBackend::low_rank_impl(const float* x, int64_t M, const LowRankTerm& t, float* y) {
  if (M == 0) return;
  CudaState& s = *state_;
  const Factors f = gather_factors(s, t);
  const int64_t r = t.rank, og = t.out_per_group, R = t.groups * r;
  auto* u = static_cast<float*>(s.scratch_for(kDownScratch, size_t(M * R) * 4));
  project_down(s, x, M, t, f, u);
  // y[:, g·og + o] += scale · u[:, g·r + j] · b(j, o), for each group g
  cuda::sgemm(s, false, false, M, og, r, t.scale, u, R, f.b, og, 1.f, y, t.out(), "low_rank",
              {.count = t.groups, .stride_a = r, .stride_b = 0, .stride_c = og});
}

void CudaBackend::low_rank_backward_impl(const float* x, const float* dy, int64_t M, const LowRankTerm& t,
                                         float* dx) {
  if (M == 0) return;
  CudaState& s = *state_;
  const Factors f = gather_factors(s, t);
  const int64_t r = t.rank, og = t.out_per_group, R = t.groups * r;
  // v[:, g·r + j] = Σ_o dy[:, g·og + o] · b(j, o), for each group g
  auto* v = static_cast<float*>(s.scratch_for(kBackScratch, size_t(M * R) * 4));
  cuda::sgemm(s, false, true, M, r, og, 1.f, dy, t.out(), f.b, og, 0.f, v, R, "low_rank_backward",
              {.count = t.groups, .stride_a = og, .stride_b = 0, .stride_c = r});
  // dx[M, in] += scale · v · aᵀ
  if (dx) cuda::sgemm(s, false, true, M, t.in, R, t.scale, v, R, f.a, R, 1.f, dx, t.in, "low_rank_backward");
  if (!t.grad_a && !t.grad_b) return;
  // u = x · a for ∂B, first: its chunks use the partial sums' scratch that ∂A and ∂B then take.
  float* u = nullptr;
  if (t.grad_b) {
    u = static_cast<float*>(s.scratch_for(kDownScratch, size_t(M * R) * 4));
    project_down(s, x, M, t, f, u);
  }
  const SplitSum split_a = split_sum(t.in, R, M), split_b = split_sum(r, og, M * t.groups);
  const int64_t a_floats = rounded_to_64(split_a.chunks * t.in * R);
  auto* ga = static_cast<float*>(s.scratch_for(kPartialScratch, size_t(a_floats + split_b.chunks * r * og) * 4));
  float* gb = ga + a_floats;
  // ∂A [in, R] = scale · xᵀ · v
  if (t.grad_a) chunked_product(s, true, false, t.in, R, M, t.scale, x, t.in, v, R, split_a, ga, "low_rank_backward");
  // ∂B [r, og] = scale · Σ_m Σ_g u[m, g·r + j] · dy[m, g·og + o]: one product over the M·G rows of u
  // as [M·G, r] and of dy as [M·G, og].
  if (t.grad_b)
    chunked_product(s, true, false, r, og, M * t.groups, t.scale, u, r, dy, og, split_b, gb, "low_rank_backward");
  add_factor_gradients_kernel<<<blocks_for(factor_elements(t)), kThreads, 0, s.stream>>>(t, ga, split_a.chunks, gb,
                                                                                        split_b.chunks);
  check_launch("low_rank_backward (add the factors' gradients)");
}

// ---- row-major products with fp32 sums (cuda_common.cuh) ----

// A and B in `type` (fp32 or bf16), C in fp32.
static void row_major_gemm(CudaState& s, bool transpose_a, bool transpose_b, int64_t M, int64_t N, int64_t K,
                           float alpha, const void* A, int64_t lda, const void* B, int64_t ldb, cudaDataType type,
                           float beta, float* C, int64_t ldc, const char* op, cuda::Batch batch) {
  check(M < (int64_t(1) << 31) && N < (int64_t(1) << 31) && K < (int64_t(1) << 31) && batch.count < (int64_t(1) << 31),
        op, ": a matrix dimension does not fit cuBLAS' 32-bit sizes");
  // cuBLAS is column-major, where the row-major C is Cᵀ = op(B)ᵀ·op(A)ᵀ: the operands swap.
  check_blas(cuda::cublas().gemm_strided_batched_ex(
                 s.blas, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N, transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, int(N),
                 int(M), int(K), &alpha, B, type, int(ldb), batch.stride_b, A, type, int(lda), batch.stride_a, &beta,
                 C, CUDA_R_32F, int(ldc), batch.stride_c, int(batch.count), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
             op);
}

void cuda::sgemm(CudaState& s, bool transpose_a, bool transpose_b, int64_t M, int64_t N, int64_t K, float alpha,
                 const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc,
                 const char* op, Batch batch) {
  row_major_gemm(s, transpose_a, transpose_b, M, N, K, alpha, A, lda, B, ldb, CUDA_R_32F, beta, C, ldc, op, batch);
}
void cuda::sgemm(CudaState& s, bool transpose_a, bool transpose_b, int64_t M, int64_t N, int64_t K, float alpha,
                 const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc,
                 const char* op, Batch batch) {
  row_major_gemm(s, transpose_a, transpose_b, M, N, K, alpha, A, lda, B, ldb, CUDA_R_16BF, beta, C, ldc, op, batch);
}

void cuda::narrow(CudaState& s, const float* src, int64_t n, uint16_t* dst) {
  narrow_kernel<<<blocks_for(quads(n)), kThreads, 0, s.stream>>>(src, n, dst);
  check_launch("narrow_to_bf16");
}
void cuda::narrow_parts(CudaState& s, const std::vector<Span<const float>>& parts, uint16_t* dst) {
  for_each_launch_of_parts(parts, [&](const Bf16Parts& batch, dim3 grid) {
    narrow_parts_kernel<<<grid, kThreads, 0, s.stream>>>(batch, dst);
    check_launch("narrow_to_bf16 (parts)");
  });
}

}  // namespace meshtune
