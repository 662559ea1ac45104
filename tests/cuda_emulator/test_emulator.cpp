// The CUDA emulator's own checks (emulator.h): that it runs a block's threads so that barriers and
// warp shuffles mean what they mean on a GPU, that it refuses what a GPU refuses, and that its
// cuBLAS products follow cuBLAS' definition. The emulated GPU tests (emulated_gpu_*) rely on these.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "cublas_v2.h"
#include "cuda_runtime.h"

namespace {

template <class T>
T* device_copy(const std::vector<T>& host) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpyAsync(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, nullptr), cudaSuccess);
  return static_cast<T*>(p);
}
template <class T>
std::vector<T> host_copy(const T* device, size_t n) {
  std::vector<T> host(n);
  EXPECT_EQ(cudaMemcpyAsync(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost, nullptr), cudaSuccess);
  return host;
}
std::string last_error() {
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? "" : cudaGetErrorString(error);
}

// Each thread publishes base + its index, then (after the barrier, when `sync`) thread 0 sums them.
void publish_then_sum(int* out, int base, bool sync) {
  __shared__ int values[256];
  values[threadIdx.x] = base + int(threadIdx.x);
  if (sync) __syncthreads();
  if (threadIdx.x == 0) {
    int sum = 0;
    for (unsigned t = 0; t < blockDim.x; ++t) sum += values[t];
    out[blockIdx.x] = sum;
  }
}

TEST(CudaEmulator, ABarrierPublishesWhatEveryThreadWrote) {
  int* out = device_copy(std::vector<int>(3, 0));
  cuda_emulator::launch(3, 256)(publish_then_sum, "publish_then_sum")(out, 1, true);
  EXPECT_EQ(last_error(), "");
  EXPECT_EQ(host_copy(out, 3), std::vector<int>(3, 256 * 257 / 2));
  // Without the barrier thread 0 reads before the others have written: a missing __syncthreads shows.
  int* racy = device_copy(std::vector<int>(1, 0));
  cuda_emulator::launch(1, 256)(publish_then_sum, "publish_then_sum")(racy, 1000, false);
  EXPECT_NE(host_copy(racy, 1)[0], 256 * 1000 + 256 * 255 / 2);
  cudaFree(out);
  cudaFree(racy);
}

void shuffles(const float* in, float* down, float* xored) {
  const float v = in[threadIdx.x];
  down[threadIdx.x] = __shfl_down_sync(0xffffffffu, v, 3);
  xored[threadIdx.x] = __shfl_xor_sync(0xffffffffu, v, 5);
}

TEST(CudaEmulator, WarpShufflesFollowCudasDefinition) {
  std::vector<float> values(64);
  for (size_t i = 0; i < values.size(); ++i) values[i] = float(i) * 1.5f;
  const float* in = device_copy(values);
  float *down = device_copy(std::vector<float>(64)), *xored = device_copy(std::vector<float>(64));
  cuda_emulator::launch(1, 64)(shuffles, "shuffles")(in, down, xored);
  ASSERT_EQ(last_error(), "");
  const std::vector<float> got_down = host_copy(down, 64), got_xor = host_copy(xored, 64);
  for (unsigned t = 0; t < 64; ++t) {
    const unsigned lane = t % 32, warp = t / 32;
    EXPECT_EQ(got_down[t], values[lane + 3 < 32 ? t + 3 : t]) << t;  // past the warp's end: own value
    EXPECT_EQ(got_xor[t], values[warp * 32 + (lane ^ 5)]) << t;
  }
}

void barrier_not_all_reach(int* out) {
  if (threadIdx.x == 7) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}
void shuffle_in_half_a_warp(float* out) {
  if (threadIdx.x < 16) out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
}

TEST(CudaEmulator, RefusesWhatAGpuRefuses) {
  int* out = device_copy(std::vector<int>(64, 0));
  cuda_emulator::launch(1, 64)(barrier_not_all_reach, "barrier_not_all_reach")(out);
  EXPECT_NE(last_error().find("barrier_not_all_reach, block (0, 0, 0): block stuck"), std::string::npos);
  cuda_emulator::launch(1, 32)(shuffle_in_half_a_warp, "shuffle_in_half_a_warp")(reinterpret_cast<float*>(out));
  EXPECT_NE(last_error().find("block stuck"), std::string::npos);
  // After a stuck block the next launch runs normally.
  int* sums = device_copy(std::vector<int>(1, 0));
  cuda_emulator::launch(1, 256)(publish_then_sum, "publish_then_sum")(sums, 1, true);
  EXPECT_EQ(last_error(), "");
  EXPECT_EQ(host_copy(sums, 1)[0], 256 * 257 / 2);

  cuda_emulator::launch(0, 32)(publish_then_sum, "publish_then_sum")(sums, 1, true);
  EXPECT_NE(last_error().find("a launch of 0 x 1 x 1 blocks"), std::string::npos);
  cuda_emulator::launch(1, 2048)(publish_then_sum, "publish_then_sum")(sums, 1, true);
  EXPECT_NE(last_error().find("blocks of 2048 threads"), std::string::npos);
  cuda_emulator::launch(1, 32, 64 * 1024)(publish_then_sum, "publish_then_sum")(sums, 1, true);
  EXPECT_NE(last_error().find("65536 bytes of dynamic shared memory"), std::string::npos);
  EXPECT_EQ(cudaFuncSetAttribute(publish_then_sum, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024),
            cudaSuccess);
  cuda_emulator::launch(1, 32, 64 * 1024)(publish_then_sum, "publish_then_sum")(sums, 1, true);
  EXPECT_EQ(last_error(), "");

  std::vector<int> host(1);
  cuda_emulator::launch(1, 32)(publish_then_sum, "publish_then_sum")(host.data(), 1, true);
  EXPECT_NE(last_error().find("publish_then_sum: argument 0 points outside device memory"), std::string::npos);
  EXPECT_EQ(cudaMemcpyAsync(host.data(), out, 65 * sizeof(int), cudaMemcpyDeviceToHost, nullptr),
            cudaErrorInvalidValue);
  EXPECT_NE(last_error().find("outside a device allocation"), std::string::npos);
  cudaFree(out);
  cudaFree(sums);
}

// Copies to and from pinned memory happen when the stream gets there: a download lands only when
// the host waits for an event recorded after it (or the stream), and an upload's pinned source must
// be left alone until then — what the CUDA backend's downloads-collected-later and unwaited
// uploads rely on.
TEST(CudaEmulator, PinnedCopiesLandWhenTheHostWaits) {
  int* device = device_copy(std::vector<int>{1, 2, 3});
  int* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&pinned), 3 * sizeof(int)), cudaSuccess);
  cudaEvent_t first = nullptr, second = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&first, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&second), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(pinned, device, 3 * sizeof(int), cudaMemcpyDeviceToHost, nullptr), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(first, nullptr), cudaSuccess);
  EXPECT_NE(pinned[0], 1);  // not yet: the host has not waited
  ASSERT_EQ(cudaEventSynchronize(first), cudaSuccess);
  EXPECT_EQ(std::vector<int>(pinned, pinned + 3), (std::vector<int>{1, 2, 3}));

  // An upload from pinned memory, its source rewritten before the host waited for it: refused there.
  pinned[0] = 7;
  ASSERT_EQ(cudaMemcpyAsync(device, pinned, sizeof(int), cudaMemcpyHostToDevice, nullptr), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(second, nullptr), cudaSuccess);
  EXPECT_EQ(host_copy(device, 1)[0], 7);
  pinned[0] = 8;
  EXPECT_EQ(cudaEventSynchronize(second), cudaErrorIllegalState);
  EXPECT_NE(last_error().find("before it had waited"), std::string::npos);
  // Waited for first, then rewritten: fine.
  ASSERT_EQ(cudaMemcpyAsync(device, pinned, sizeof(int), cudaMemcpyHostToDevice, nullptr), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  pinned[0] = 9;
  EXPECT_EQ(host_copy(device, 1)[0], 8);
  EXPECT_EQ(last_error(), "");
  cudaEventDestroy(first);
  cudaEventDestroy(second);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  cudaFree(device);
}

TEST(CudaEmulator, GemmFollowsCublasDefinition) {
  // C (m × n) = α·op(A)·op(B) + β·C, column-major, for each transpose; β = 0 never reads C (NaN there).
  const int m = 3, n = 4, k = 5;
  std::vector<float> a(size_t(m * k)), b(size_t(k * n));
  for (size_t i = 0; i < a.size(); ++i) a[i] = float(i % 7) - 3.f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = float(i % 5) * 0.5f;
  cublasHandle_t handle = nullptr;
  ASSERT_EQ(cublasCreate_v2(&handle), CUBLAS_STATUS_SUCCESS);
  for (const bool ta : {false, true})
    for (const bool tb : {false, true}) {
      // A stored so that op(A) is m × k: as is (lda = m), or its transpose (lda = k); B likewise.
      auto at = [&](int i, int l) { return ta ? a[size_t(l + i * k)] : a[size_t(i + l * m)]; };
      auto bt = [&](int l, int j) { return tb ? b[size_t(j + l * n)] : b[size_t(l + j * k)]; };
      const float* A = device_copy(a);
      const float* B = device_copy(b);
      float* C = device_copy(std::vector<float>(size_t(m * n), NAN));
      const float alpha = 2.f, beta = 0.f;
      ASSERT_EQ(cublasGemmEx(handle, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &alpha,
                             A, CUDA_R_32F, ta ? k : m, B, CUDA_R_32F, tb ? n : k, &beta, C, CUDA_R_32F, m,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                CUBLAS_STATUS_SUCCESS);
      const std::vector<float> got = host_copy(C, size_t(m * n));
      for (int i = 0; i < m; ++i)
        for (int j = 0; j < n; ++j) {
          float want = 0;
          for (int l = 0; l < k; ++l) want += at(i, l) * bt(l, j);
          EXPECT_FLOAT_EQ(got[size_t(i + j * m)], alpha * want) << ta << tb << " " << i << "," << j;
        }
      // A leading dimension shorter than the rows it must hold is cuBLAS' INVALID_VALUE.
      EXPECT_EQ(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, A, CUDA_R_32F, m - 1, B, CUDA_R_32F,
                             k, &beta, C, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                CUBLAS_STATUS_INVALID_VALUE);
      // So is a matrix that is not device memory, or reaches past its allocation (one more batch).
      const std::vector<float> host_a = a;
      EXPECT_EQ(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, host_a.data(), CUDA_R_32F, m, B,
                             CUDA_R_32F, k, &beta, C, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                CUBLAS_STATUS_INVALID_VALUE);
      EXPECT_EQ(cublasGemmStridedBatchedEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, A, CUDA_R_32F, m, 0, B,
                                           CUDA_R_32F, k, 0, &beta, C, CUDA_R_32F, m, m, 2, CUBLAS_COMPUTE_32F,
                                           CUBLAS_GEMM_DEFAULT),
                CUBLAS_STATUS_INVALID_VALUE);
      cudaFree(const_cast<float*>(A));
      cudaFree(const_cast<float*>(B));
      cudaFree(C);
    }
  cublasDestroy_v2(handle);
}

}  // namespace
