// The CUDA backend: the Backend's ops on one NVIDIA GPU. Memory is device memory from cudaMalloc
// (freed blocks are kept for reuse by size: after the first step nothing is allocated), every op
// is queued on the backend's one stream, and the host crossings are the Backend's upload/download.
// Matrix products go to cuBLAS — under MatmulPrecision::F32 in fp32 without TF32 (the CPU's
// numbers), under BF16 with bf16 inputs and fp32 sums (Keras' mixed_bfloat16) —, the rest to the
// kernels of src/backend/cuda/*.cu, written as the reference backend's loops spread over threads
// (double sums where the reference sums in double). int8 weights are not supported yet.
//
// Built only with the CUDA toolkit (CMake MESHTUNE_CUDA); backend/cuda_devices.h is the way in
// that every build has.
#pragma once
#include <memory>

#include "backend/backend.h"

namespace meshtune {

struct CudaState;  // the stream, cuBLAS handle, cached blocks and scratch (cuda_backend.cu)

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int gpu = 0);  // an Error when there is no such GPU or no usable driver
  ~CudaBackend() override;
  std::string name() const override;
  Device device() const override { return Device::Cuda; }
  void synchronize() override;
  // As one CUDA graph (MESHTUNE_CUDA_GRAPHS=on, the default; off runs every step as it comes).
  void run_step(const std::function<void()>& step) override;
  int gpu() const { return gpu_; }
  void* stream() const;  // the cudaStream_t every op is queued on
  // The route measured for each op and shape with two run so far (MESHTUNE_CUDA_ATTENTION,
  // MESHTUNE_CUDA_LINEAR = auto), one line each:
  // "attention forward B=2 T=128 …: kernels 0.120 ms, gemm 0.041 ms -> gemm"; then, once a step has
  // run through run_step, one line of how the steps ran ("steps as CUDA graphs: 40 launched (1
  // instantiated, 39 updated), 2 run without").
  std::vector<std::string> routes() const;

 protected:
  void* allocate_impl(size_t bytes) override;
  void release_impl(void* p) override;
  void upload_impl(const void* host, size_t bytes, void* device) override;
  void download_impl(const void* device, size_t bytes, void* host) override;
  uint64_t start_download_impl(const void* device, size_t bytes, void* host) override;
  void finish_download_impl(uint64_t id) override;

  void linear_impl(const float* x, int64_t M, const WeightMatrix& W, float* y, MatmulPrecision precision,
                   const float* x_row_max) override;
  void linear_shared_input_impl(const float* x, int64_t M, const std::vector<LinearOutput>& outputs,
                                MatmulPrecision precision) override;
  void linear_geglu_impl(const float* x, int64_t M, const WeightMatrix& W_gate, const WeightMatrix& W_up, float* gate,
                         float* up, float* out, MatmulPrecision precision) override;
  void linear_rope_impl(const float* x, int64_t M, const WeightMatrix& W_q, const WeightMatrix& W_k,
                        const WeightMatrix& W_v, float* q, float* k, float* v, const RopeStep& rope,
                        MatmulPrecision precision) override;
  void linear_backward_input_impl(const float* dy, int64_t M, const WeightMatrix& W, float* dx, bool accumulate,
                                  MatmulPrecision precision) override;
  void linear_backward_input_shared_impl(const std::vector<LinearOutputGradient>& gradients, int64_t M, float* dx,
                                         bool accumulate, MatmulPrecision precision) override;
  void linear_backward_weight_impl(const float* dy, const float* x, int64_t M, int64_t rows, int64_t cols,
                                   float* dW) override;
  void linear_bf16_input_impl(const uint16_t* x, int64_t M, const WeightMatrix& W, float* y) override;
  void linear_backward_input_bf16_impl(const std::vector<Bf16OutputGradient>& gradients, int64_t M, float* dx,
                                       bool accumulate) override;
  void low_rank_impl(const float* x, int64_t M, const LowRankTerm& term, float* y) override;
  void low_rank_backward_impl(const float* x, const float* dy, int64_t M, const LowRankTerm& term,
                              float* dx) override;
  void row_abs_max_impl(const float* x, int64_t rows, int64_t cols, float* out) override;
  void rmsnorm_impl(const float* x, const float* scale, int64_t rows, int64_t dim, float eps, float* y) override;
  void add_rmsnorm_impl(float* x, const float* branch, const float* branch_scale, const float* scale, int64_t rows,
                        int64_t dim, float eps, float* y, float* x_copy) override;
  void rmsnorm_backward_impl(const float* x, const float* scale, int64_t rows, int64_t dim, float eps,
                             const float* dy, float* dx, float* dscale,
                             bool accumulate) override;
  void rope_impl(float* q, int64_t q_heads, float* k, int64_t k_heads, int64_t tokens, int64_t head_dim,
                 const int64_t* positions, float base, float scaling, float q_scale,
                 const CacheWrite* cache) override;
  void rope_backward_impl(float* dq, int64_t q_heads, float* dk, int64_t k_heads, int64_t tokens, int64_t head_dim,
                          const int64_t* positions, float base, float scaling, float q_scale) override;
  void attention_impl(const float* q, const float* k, const float* v, const uint8_t* key_valid,
                      const AttentionShape& s, float* out) override;
  void attention_backward_impl(const float* q, const float* k, const float* v, const uint8_t* key_valid,
                               const AttentionShape& s, const float* dout, float* dq, float* dk, float* dv) override;
  void geglu_impl(const float* gate, const float* up, int64_t n, float* out) override;
  void geglu_backward_impl(const float* gate, const float* up, const float* dout, int64_t n, float* dgate,
                           float* dup) override;
  void geglu_to_bf16_impl(const float* gate, const float* up, int64_t n, uint16_t* out, uint16_t* gate_copy,
                          uint16_t* up_copy) override;
  void geglu_backward_bf16_impl(const uint16_t* gate, const uint16_t* up, const float* dout, int64_t n,
                                uint16_t* dgate, uint16_t* dup) override;
  void soft_cap_impl(float* x, int64_t n, float cap) override;
  void soft_cap_backward_impl(const float* y, float* dy, int64_t n, float cap) override;
  void softmax_row_max_impl(const float* z, int64_t n, int64_t cols, int64_t v0, float* max_and_argmax) override;
  void softmax_combine_max_impl(const float* gathered, int parts, int64_t n, float* max_and_argmax) override;
  void softmax_row_sums_impl(const float* z, int64_t n, int64_t cols, int64_t v0, const int32_t* targets,
                             const float* max_and_argmax, double* sum_exp_and_target) override;
  void softmax_cross_entropy_sums_impl(const float* max_and_argmax, const double* sum_exp_and_target,
                                       const int32_t* targets, const float* weights, int64_t n,
                                       double* sums) override;
  void softmax_cross_entropy_backward_impl(float* z, int64_t n, int64_t cols, int64_t v0, const int32_t* targets,
                                           const float* weights, double loss_scale, const float* max_and_argmax,
                                           const double* sum_exp_and_target, float cap) override;
  void embedding_lookup_impl(const WeightMatrix& table, int64_t first_row, const int32_t* ids, int64_t M,
                             float factor, float* out) override;
  void embedding_lookup_backward_impl(const float* dy, const int32_t* ids, int64_t M, int64_t dim, int64_t first_row,
                                      int64_t rows, float factor, float* grad) override;
  void gather_rows_impl(const float* src, const int64_t* rows, int64_t n, int64_t dim, float* dst) override;
  void greedy_tokens_impl(const float* max_and_argmax, int64_t rows, const uint8_t* keep, int32_t* ids) override;
  void scatter_rows_impl(const float* src, const int64_t* rows, int64_t n, int64_t dim, float* dst) override;
  void interleave_column_blocks_impl(const float* blocks, int parts, int64_t M, int64_t part, float* out) override;
  void copy_impl(const float* src, int64_t n, float* dst) override;
  void zero_impl(float* x, int64_t n) override;
  void zero_many_impl(const std::vector<Floats>& arrays) override;
  void add_into_impl(float* x, const float* y, int64_t n) override;
  void scale_impl(float* x, int64_t n, float factor) override;
  void narrow_to_bf16_impl(const float* src, int64_t n, uint16_t* dst) override;
  void widen_bf16_impl(const uint16_t* src, int64_t n, float* dst) override;
  void narrow_parts_to_bf16_impl(const std::vector<ConstFloats>& parts, uint16_t* dst) override;
  void widen_bf16_parts_impl(const uint16_t* src, const std::vector<Floats>& parts) override;
  void adamw_update_impl(float* theta, const float* grad, float* m, float* v, int64_t n,
                         const AdamWStep& step) override;
  void adamw_update_many_impl(const std::vector<AdamWVariable>& variables, const AdamWStep& step) override;
  double sum_of_squares_impl(const float* x, int64_t n) override;
  void scale_by_ratio_impl(float* x, int64_t n, float numerator, float denominator) override;
  void clamp_impl(float* x, int64_t n, float limit) override;
  int64_t first_not_finite_impl(const std::vector<ConstFloats>& arrays) override;
  float* scratch_floats(size_t n) override;
 private:
  int gpu_ = 0;
  std::unique_ptr<CudaState> state_;
};

}  // namespace meshtune
