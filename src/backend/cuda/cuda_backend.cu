// The CUDA backend (cuda_backend.h): the GPU, its memory and the host crossings, and the matrix
// products — linear and its gradients through cuBLAS, LoRA's low-rank term as small kernels.
// The other ops are in cuda_ops.cu.
#include "backend/cuda/cuda_backend.h"

#include <algorithm>

#include "backend/cuda/cuda_common.cuh"

namespace meshtune {

using cuda::blocks_for;
using cuda::check_blas;
using cuda::check_cuda;
using cuda::check_launch;
using cuda::kThreads;
using cuda::warp_sum;
using cuda::block_sum;

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
}

CudaBackend::~CudaBackend() {
  // Nothing may throw here: errors while tearing down are ignored (the process is ending or the
  // device is gone).
  if (state_->stream) cudaStreamSynchronize(state_->stream);
  for (auto& [bytes, p] : state_->free_blocks) cudaFree(p);
  for (auto& [p, bytes] : state_->live) cudaFree(p);
  for (void* p : state_->scratch)
    if (p) cudaFree(p);
  if (state_->blas) cuda::cublas().destroy(state_->blas);
  if (state_->stream) cudaStreamDestroy(state_->stream);
}

std::string CudaBackend::name() const {
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, gpu_);
  return std::string("cuda:") + std::to_string(gpu_) + " (" + prop.name + ")";
}

void* CudaBackend::stream() const { return state_->stream; }

void CudaBackend::synchronize() { check_cuda(cudaStreamSynchronize(state_->stream), "synchronize"); }

// ---- memory and the host crossings ----

void* CudaBackend::allocate_impl(size_t bytes) {
  bytes = bytes == 0 ? 1 : bytes;
  auto reused = state_->free_blocks.find(bytes);
  void* p = nullptr;
  if (reused != state_->free_blocks.end()) {
    p = reused->second;
    state_->free_blocks.erase(reused);
  } else {
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

void CudaBackend::upload_impl(const void* host, size_t bytes, void* device) {
  if (bytes == 0) return;
  check_cuda(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, state_->stream), "upload");
  // A pageable host buffer may be reused as soon as the call returns; a pinned one would not: sync.
  check_cuda(cudaStreamSynchronize(state_->stream), "upload");
}

void CudaBackend::download_impl(const void* device, size_t bytes, void* host) {
  if (bytes == 0) return;
  check_cuda(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, state_->stream), "download");
  check_cuda(cudaStreamSynchronize(state_->stream), "download");
}

// ---- bf16 narrowing and widening (matmul inputs under the bf16 policies) ----

namespace {  // the kernels and helpers of this file

__global__ void narrow_kernel(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = f32_to_bf16(src[i]);
}
__global__ void widen_kernel(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = bf16_to_f32(src[i]);
}

static void narrow(CudaState& s, const float* src, int64_t n, uint16_t* dst) {
  narrow_kernel<<<blocks_for(n), kThreads, 0, s.stream>>>(src, n, dst);
  check_launch("narrow_to_bf16");
}
static void widen(CudaState& s, const uint16_t* src, int64_t n, float* dst) {
  widen_kernel<<<blocks_for(n), kThreads, 0, s.stream>>>(src, n, dst);
  check_launch("widen_bf16");
}

}  // namespace

void CudaBackend::narrow_to_bf16_impl(const float* src, int64_t n, uint16_t* dst) { narrow(*state_, src, n, dst); }
void CudaBackend::widen_bf16_impl(const uint16_t* src, int64_t n, float* dst) { widen(*state_, src, n, dst); }

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
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x)
    out[e] = float(codes[e]) / scales[e / cols];
}

// Under BF16 precision: the activations (x, or dy in backward) narrowed into scratch slot 0 and the
// weights as bf16 (narrowed into slot 1 when stored fp32); under F32: the weights as fp32 (widened
// into slot 1 when stored bf16).
static MatmulOperands matmul_operands(CudaState& s, const float* activations, int64_t count, const WeightMatrix& W,
                                      MatmulPrecision precision) {
  const int64_t size = W.rows * W.cols;
  MatmulOperands out;
  if (W.dtype == DType::I8) {  // through the dequantized values, in fp32 (as the reference)
    auto* w = static_cast<float*>(s.scratch_for(1, size_t(size) * 4));
    dequantize_kernel<<<blocks_for(size), kThreads, 0, s.stream>>>(W.i8(), W.scales, size, W.cols, w);
    check_launch("dequantize_int8");
    out.activations = activations;
    out.weights = w;
    return out;
  }
  if (precision == MatmulPrecision::BF16) {
    auto* a = static_cast<uint16_t*>(s.scratch_for(0, size_t(count) * 2));
    narrow(s, activations, count, a);
    out.activations = a;
    out.type = CUDA_R_16BF;
    if (W.dtype == DType::BF16) {
      out.weights = W.data;
    } else {
      auto* w = static_cast<uint16_t*>(s.scratch_for(1, size_t(size) * 2));
      narrow(s, W.f32(), size, w);
      out.weights = w;
    }
    return out;
  }
  out.activations = activations;
  if (W.dtype == DType::F32) {
    out.weights = W.data;
  } else {
    auto* w = static_cast<float*>(s.scratch_for(1, size_t(size) * 4));
    widen(s, W.bf16(), size, w);
    out.weights = w;
  }
  return out;
}

// ---- int8 weights: Keras' arithmetic, as the CPU's (backend/cpu/int8.cpp) ----
// Each activation row quantized at its own scale (int8_scale of its max|x|, or of the given maxima
// of a row split over processes), exact int32 sums of code products, one division by both scales.

__global__ void quantize_rows_kernel(const float* x, int64_t n, int64_t cols, const float* row_max, int8_t* codes) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x)
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
  const MatmulOperands op = matmul_operands(*state_, x, M * W.cols, W, precision);
  gemm(*state_, CUBLAS_OP_T, CUBLAS_OP_N, W.rows, M, W.cols, op.weights, W.cols, op.activations, W.cols, op.type, 0.f,
       y, W.rows, "linear");
}

void CudaBackend::linear_backward_input_impl(const float* dy, int64_t M, const WeightMatrix& W, float* dx,
                                             bool accumulate, MatmulPrecision precision) {
  // dx[M, cols] = dy[M, rows]·W: dxᵀ (cols × M) = (W as column-major [cols, rows]) · dyᵀ.
  const MatmulOperands op = matmul_operands(*state_, dy, M * W.rows, W, precision);
  gemm(*state_, CUBLAS_OP_N, CUBLAS_OP_N, W.cols, M, W.rows, op.weights, W.cols, op.activations, W.rows, op.type,
       accumulate ? 1.f : 0.f, dx, W.cols, "linear_backward_input");
}

void CudaBackend::linear_backward_weight_impl(const float* dy, const float* x, int64_t M, int64_t rows, int64_t cols,
                                              float* dW) {
  // dW[rows, cols] += dyᵀ·x: dWᵀ (cols × rows) += xᵀ (cols × M) · dy (op T of column-major [rows, M]).
  gemm(*state_, CUBLAS_OP_N, CUBLAS_OP_T, cols, rows, M, x, cols, dy, rows, CUDA_R_32F, 1.f, dW, cols,
       "linear_backward_weight");
}

// ---- LoRA's low-rank term: y[:, g] += scale·(x·A_g)·B, with strided A and B ----
// Small products (rank r of 4–64), summing in double as the reference does. u[m, g, j] =
// Σ_i x[m, i]·A_g(i, j); v[m, g, j] = Σ_o dy[m, g, o]·B(j, o). Outputs whose sum is long (over the
// input width, the outputs of a group, the rows) are one warp each — one block for ∂B, whose sum runs
// over every row of every group —; the others one thread each.

namespace {

__device__ inline double lora_a(const LowRankTerm& t, int64_t g, int64_t i, int64_t j) {
  return t.a[g * t.a_group + i * t.a_row + j * t.a_col];
}
__device__ inline double lora_b(const LowRankTerm& t, int64_t j, int64_t o) { return t.b[j * t.b_row + o * t.b_col]; }

__global__ void low_rank_u_kernel(const float* x, int64_t M, LowRankTerm t, double* u) {
  FOR_EACH_WARP_ITEM(e, M * t.groups * t.rank) {
    const int64_t j = e % t.rank, g = (e / t.rank) % t.groups, m = e / (t.rank * t.groups);
    double acc = 0;
    for (int64_t i = threadIdx.x % 32; i < t.in; i += 32) acc += double(x[m * t.in + i]) * lora_a(t, g, i, j);
    acc = warp_sum(acc);
    if (threadIdx.x % 32 == 0) u[e] = acc;
  }
}

__global__ void low_rank_v_kernel(const float* dy, int64_t M, LowRankTerm t, double* v) {
  const int64_t og = t.out_per_group;
  FOR_EACH_WARP_ITEM(e, M * t.groups * t.rank) {
    const int64_t j = e % t.rank, g = (e / t.rank) % t.groups, m = e / (t.rank * t.groups);
    double acc = 0;
    for (int64_t o = threadIdx.x % 32; o < og; o += 32) acc += double(dy[m * t.out() + g * og + o]) * lora_b(t, j, o);
    acc = warp_sum(acc);
    if (threadIdx.x % 32 == 0) v[e] = acc;
  }
}

__global__ void low_rank_y_kernel(const double* u, int64_t M, LowRankTerm t, float* y) {
  const int64_t n = M * t.out(), og = t.out_per_group;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = e / t.out(), g = (e % t.out()) / og, o = e % og;
    double acc = 0;
    for (int64_t j = 0; j < t.rank; ++j) acc += u[(m * t.groups + g) * t.rank + j] * lora_b(t, j, o);
    y[e] += float(t.scale * acc);
  }
}

// dx[m, i] += scale·Σ_g Σ_j v[m, g, j]·A_g(i, j)
__global__ void low_rank_dx_kernel(const double* v, int64_t M, LowRankTerm t, float* dx) {
  const int64_t n = M * t.in;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = e / t.in, i = e % t.in;
    float out = dx[e];
    for (int64_t g = 0; g < t.groups; ++g) {
      double acc = 0;
      for (int64_t j = 0; j < t.rank; ++j) acc += v[(m * t.groups + g) * t.rank + j] * lora_a(t, g, i, j);
      out += float(t.scale * acc);
    }
    dx[e] = out;
  }
}

// ∂A_g(i, j) += scale·Σ_m x[m, i]·v[m, g, j]
__global__ void low_rank_grad_a_kernel(const float* x, const double* v, int64_t M, LowRankTerm t) {
  FOR_EACH_WARP_ITEM(e, t.groups * t.in * t.rank) {
    const int64_t j = e % t.rank, i = (e / t.rank) % t.in, g = e / (t.rank * t.in);
    double acc = 0;
    for (int64_t m = threadIdx.x % 32; m < M; m += 32) acc += double(x[m * t.in + i]) * v[(m * t.groups + g) * t.rank + j];
    acc = warp_sum(acc);
    if (threadIdx.x % 32 == 0) t.grad_a[g * t.a_group + i * t.a_row + j * t.a_col] += float(t.scale * acc);
  }
}

// ∂B(j, o) += scale·Σ_g Σ_m u[m, g, j]·dy[m, g, o]: one block per output.
__global__ void low_rank_grad_b_kernel(const double* u, const float* dy, int64_t M, LowRankTerm t) {
  const int64_t og = t.out_per_group, n = t.rank * og, terms = t.groups * M;
  for (int64_t e = blockIdx.x; e < n; e += gridDim.x) {
    const int64_t j = e / og, o = e % og;
    double acc = 0;
    for (int64_t k = threadIdx.x; k < terms; k += blockDim.x) {
      const int64_t g = k / M, m = k % M;
      acc += u[(m * t.groups + g) * t.rank + j] * double(dy[m * t.out() + g * og + o]);
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) t.grad_b[j * t.b_row + o * t.b_col] += float(t.scale * acc);
  }
}

}  // namespace

void CudaBackend::low_rank_impl(const float* x, int64_t M, const LowRankTerm& t, float* y) {
  auto* u = static_cast<double*>(state_->scratch_for(2, size_t(M * t.groups * t.rank) * sizeof(double)));
  low_rank_u_kernel<<<blocks_for(32 * M * t.groups * t.rank), kThreads, 0, state_->stream>>>(x, M, t, u);
  low_rank_y_kernel<<<blocks_for(M * t.out()), kThreads, 0, state_->stream>>>(u, M, t, y);
  check_launch("low_rank");
}

void CudaBackend::low_rank_backward_impl(const float* x, const float* dy, int64_t M, const LowRankTerm& t,
                                         float* dx) {
  const int64_t n = M * t.groups * t.rank;
  auto* u = static_cast<double*>(state_->scratch_for(2, size_t(n) * sizeof(double)));
  auto* v = static_cast<double*>(state_->scratch_for(3, size_t(n) * sizeof(double)));
  low_rank_v_kernel<<<blocks_for(32 * n), kThreads, 0, state_->stream>>>(dy, M, t, v);
  if (dx) low_rank_dx_kernel<<<blocks_for(M * t.in), kThreads, 0, state_->stream>>>(v, M, t, dx);
  if (t.grad_a)
    low_rank_grad_a_kernel<<<blocks_for(32 * t.groups * t.in * t.rank), kThreads, 0, state_->stream>>>(x, v, M, t);
  if (t.grad_b) {
    low_rank_u_kernel<<<blocks_for(32 * n), kThreads, 0, state_->stream>>>(x, M, t, u);
    const int64_t outputs = t.rank * t.out_per_group;
    low_rank_grad_b_kernel<<<unsigned(std::min<int64_t>(outputs, 65535)), kThreads, 0, state_->stream>>>(u, dy, M, t);
  }
  check_launch("low_rank_backward");
}

}  // namespace meshtune
