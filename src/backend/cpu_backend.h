// The CPU backend: the kernels of src/kernels — OpenBLAS / oneDNN for the products, OpenMP threads,
// the generic / AVX2 / AVX-512 / AVX512_BF16 paths of backend/cpu/isa — on host memory. It chooses
// its path once, when it is made (the products' routes by measurement, backend/cpu/routes.h), and hands it to every kernel (no process-wide kernel state).
// Tested op by op against ReferenceBackend on every path the machine has (tests/test_backend_ops.cpp).
#pragma once
#include <array>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/kernel_path.h"

namespace meshtune {

struct CpuBackendOptions {
  std::optional<CpuPath> isa;  // unset: the best this CPU supports
  bool isa_forced = false;     // isa came from MESHTUNE_CPU (for reports)
  // Per product kind (kernel_path.h): true = oneDNN, false = OpenBLAS / our int8 kernel; unset = the
  // faster as measured on this machine (backend/cpu/routes.h).
  std::array<std::optional<bool>, kProductKinds> onednn;

  void force(std::initializer_list<Product> products, bool use_onednn) {
    for (Product p : products) onednn[size_t(p)] = use_onednn;
  }
  // MESHTUNE_CPU=generic|avx2|avx512|avx512bf16 and MESHTUNE_F32_MATMUL / MESHTUNE_BF16_MATMUL =
  // onednn|sgemm, MESHTUNE_INT8_MATMUL=onednn|meshtune, read now; Error naming the variable for a bad value.
  static CpuBackendOptions from_environment();
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const CpuBackendOptions& options = CpuBackendOptions::from_environment());
  const KernelPath& path() const { return path_; }
  // Lines for `meshtune info --system` and benchmarks: the CPU, its features, each kernel's route
  // (with the measured rates of the products' routes).
  std::vector<std::string> report() const;
  std::string name() const override;
  Device device() const override { return Device::Host; }

 protected:
  void* allocate_impl(size_t bytes) override;
  void release_impl(void* p) override;
  void upload_impl(const void* host, size_t bytes, void* device) override;
  void download_impl(const void* device, size_t bytes, void* host) override;

  void linear_impl(const float* x, int64_t M, const WeightMatrix& W, float* y, MatmulPrecision precision,
                   const float* x_row_max) override;
  void linear_backward_input_impl(const float* dy, int64_t M, const WeightMatrix& W, float* dx, bool accumulate,
                                  MatmulPrecision precision) override;
  void linear_backward_weight_impl(const float* dy, const float* x, int64_t M, int64_t rows, int64_t cols,
                                   float* dW) override;
  void low_rank_impl(const float* x, int64_t M, const LowRankTerm& term, float* y) override;
  void low_rank_backward_impl(const float* x, const float* dy, int64_t M, const LowRankTerm& term,
                              float* dx) override;
  void row_abs_max_impl(const float* x, int64_t rows, int64_t cols, float* out) override;
  void rmsnorm_impl(const float* x, const float* scale, int64_t rows, int64_t dim, float eps, float* y) override;
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
  void add_into_impl(float* x, const float* y, int64_t n) override;
  void scale_impl(float* x, int64_t n, float factor) override;
  void narrow_to_bf16_impl(const float* src, int64_t n, uint16_t* dst) override;
  void widen_bf16_impl(const uint16_t* src, int64_t n, float* dst) override;
  void adamw_update_impl(float* theta, const float* grad, float* m, float* v, int64_t n,
                         const AdamWStep& step) override;
  double sum_of_squares_impl(const float* x, int64_t n) override;
  void scale_by_ratio_impl(float* x, int64_t n, float numerator, float denominator) override;
  void clamp_impl(float* x, int64_t n, float limit) override;
  int64_t first_not_finite_impl(const std::vector<ConstFloats>& arrays) override;

 private:
  // path_, with the route of `kind` for this product: the kind's unless the product is large
  // enough to be measured at its own shape (backend/cpu/routes.h) and the route was not forced.
  // `run` runs the product on a given path into `output_floats` of scratch memory (to time it).
  KernelPath path_for(Product kind, int64_t M, int64_t rows, int64_t cols, int64_t output_floats,
                      const std::function<void(const KernelPath&, float* scratch)>& run) const;

  KernelPath path_;
  ProductRoutes forced_{};  // kinds whose route the options fixed: never measured per shape
  bool isa_forced_ = false;
};

}  // namespace meshtune
