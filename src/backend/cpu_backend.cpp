#include "backend/cpu_backend.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "backend/cpu/activation.h"
#include "backend/cpu/adamw.h"
#include "backend/cpu/attention.h"
#include "backend/cpu/cross_entropy.h"
#include "backend/cpu/int8.h"
#include "backend/cpu/isa/features.h"
#include "backend/cpu/linear.h"
#include "backend/cpu/routes.h"
#include "backend/cpu/low_rank.h"
#include "backend/cpu/rmsnorm.h"
#include "backend/cpu/rope.h"
#include "backend/cpu/tensor_ops.h"

namespace meshtune {

// A route variable's value: true for "onednn", false for `own`, unset when the variable is unset.
static std::optional<bool> route_from_environment(const char* variable, const char* own) {
  const char* value = std::getenv(variable);
  if (!value || !*value) return std::nullopt;
  const std::string choice = value;
  check(choice == "onednn" || choice == own, variable, "=", brief(choice), ": expected onednn or ", own);
  return choice == "onednn";
}

CpuBackendOptions CpuBackendOptions::from_environment() {
  CpuBackendOptions options;
  if (const char* isa = std::getenv("MESHTUNE_CPU"); isa && *isa) {
    options.isa = cpu_path_named(isa, "MESHTUNE_CPU=");
    options.isa_forced = true;
  }
  if (auto f32 = route_from_environment("MESHTUNE_F32_MATMUL", "sgemm"))
    options.force({Product::F32Linear, Product::F32InputGradient, Product::F32WeightGradient, Product::WidenedLinear,
                   Product::WidenedInputGradient},
                  *f32);
  if (auto bf16 = route_from_environment("MESHTUNE_BF16_MATMUL", "sgemm"))
    options.force({Product::Bf16Linear, Product::Bf16InputGradient}, *bf16);
  if (auto int8 = route_from_environment("MESHTUNE_INT8_MATMUL", "meshtune")) options.force({Product::Int8Linear}, *int8);
  return options;
}

// The routes asked for, the measured ones where none was (measuring only when one is needed).
static ProductRoutes chosen_routes(const CpuBackendOptions& options) {
  ProductRoutes routes{};
  for (int p = 0; p < kProductKinds; ++p)
    routes[size_t(p)] = options.onednn[size_t(p)] ? *options.onednn[size_t(p)] : measured_routes().onednn[size_t(p)];
  return routes;
}

CpuBackend::CpuBackend(const CpuBackendOptions& options)
    : path_(make_kernel_path(options.isa.value_or(supported_cpu_paths().back()), chosen_routes(options))),
      isa_forced_(options.isa_forced) {
  for (int p = 0; p < kProductKinds; ++p) forced_[size_t(p)] = options.onednn[size_t(p)].has_value();
}

KernelPath CpuBackend::path_for(Product kind, int64_t M, int64_t rows, int64_t cols, int64_t output_floats,
                                const std::function<void(const KernelPath&, float* scratch)>& run) const {
  if (forced_[size_t(kind)] || M <= 4 || 2.0 * double(M) * double(rows) * double(cols) < kShapeRouteFlops) return path_;
  if (!onednn_can_take(path_.isa, kind)) return path_;
  auto with_route = [&](bool onednn) {
    KernelPath k = path_;
    k.onednn[size_t(kind)] = onednn;
    return k;
  };
  std::vector<float> scratch;  // only while a new shape is timed
  return with_route(route_at_shape(kind, M, rows, cols, [&](bool onednn) {
    scratch.resize(size_t(output_floats));
    const auto t0 = std::chrono::steady_clock::now();
    run(with_route(onednn), scratch.data());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }));
}

std::vector<std::string> CpuBackend::report() const {
  std::vector<std::string> lines = kernel_report(path_, isa_forced_);
  for (std::string& line : route_report(path_, measured_routes())) lines.push_back(std::move(line));
  return lines;
}

std::string CpuBackend::name() const { return std::string("cpu (") + cpu_path_name(path_.isa) + ")"; }

void* CpuBackend::allocate_impl(size_t bytes) { return allocate_host(bytes); }
void CpuBackend::release_impl(void* p) { free_host(p); }
void CpuBackend::upload_impl(const void* host, size_t bytes, void* device) {
  if (bytes > 0) std::memcpy(device, host, bytes);
}
void CpuBackend::download_impl(const void* device, size_t bytes, void* host) {
  if (bytes > 0) std::memcpy(host, device, bytes);
}

// The products: each takes the route path_for gives its kind and shape; a first product of a large
// new shape is timed on both routes into scratch memory first.
void CpuBackend::linear_impl(const float* x, int64_t M, const WeightMatrix& W, float* y, MatmulPrecision precision,
                             const float* x_row_max) {
  const bool int8 = W.dtype == DType::I8;
  auto product = [&](const KernelPath& k, float* out) {
    if (int8 && x_row_max) return linear_int8(k, x, M, W, out, x_row_max);
    meshtune::linear(k, x, M, W, out, precision);
  };
  const Product kind = int8                                ? Product::Int8Linear
                       : precision == MatmulPrecision::BF16 ? Product::Bf16Linear
                       : W.dtype == DType::F32              ? Product::F32Linear
                                                            : Product::WidenedLinear;
  product(path_for(kind, M, W.rows, W.cols, M * W.rows, product), y);
}
void CpuBackend::linear_backward_input_impl(const float* dy, int64_t M, const WeightMatrix& W, float* dx,
                                            bool accumulate, MatmulPrecision precision) {
  const Product kind = precision == MatmulPrecision::BF16 && W.dtype != DType::I8 ? Product::Bf16InputGradient
                       : W.dtype == DType::F32                                   ? Product::F32InputGradient
                                                                                 : Product::WidenedInputGradient;
  const KernelPath k = path_for(kind, M, W.rows, W.cols, M * W.cols, [&](const KernelPath& p, float* out) {
    meshtune::linear_backward_input(p, dy, M, W, out, false, precision);
  });
  meshtune::linear_backward_input(k, dy, M, W, dx, accumulate, precision);
}
void CpuBackend::linear_backward_weight_impl(const float* dy, const float* x, int64_t M, int64_t rows, int64_t cols,
                                             float* dW) {
  const KernelPath k = path_for(Product::F32WeightGradient, M, rows, cols, rows * cols, [&](const KernelPath& p, float* out) {
    meshtune::linear_backward_weight(p, dy, x, M, rows, cols, out);
  });
  meshtune::linear_backward_weight(k, dy, x, M, rows, cols, dW);
}
void CpuBackend::low_rank_impl(const float* x, int64_t M, const LowRankTerm& term, float* y) {
  low_rank_forward(x, M, term, y);
}
void CpuBackend::low_rank_backward_impl(const float* x, const float* dy, int64_t M, const LowRankTerm& term,
                                        float* dx) {
  meshtune::low_rank_backward(x, dy, M, term, dx);
}
void CpuBackend::row_abs_max_impl(const float* x, int64_t rows, int64_t cols, float* out) {
  meshtune::row_abs_max(x, rows, cols, out);
}
void CpuBackend::rmsnorm_impl(const float* x, const float* scale, int64_t rows, int64_t dim, float eps, float* y) {
  meshtune::rmsnorm(path_, x, scale, rows, dim, eps, y);
}
void CpuBackend::rmsnorm_backward_impl(const float* x, const float* scale, int64_t rows, int64_t dim, float eps,
                                       const float* dy, float* dx, float* dscale, bool accumulate) {
  meshtune::rmsnorm_backward(path_, x, scale, rows, dim, eps, dy, dx, dscale, accumulate);
}
void CpuBackend::rope_impl(float* q, int64_t q_heads, float* k, int64_t k_heads, int64_t tokens, int64_t head_dim,
                           const int64_t* positions, float base, float scaling, float q_scale,
                           const CacheWrite* cache) {
  meshtune::rope(path_, q, tokens, q_heads, head_dim, positions, base, scaling);
  meshtune::rope(path_, k, tokens, k_heads, head_dim, positions, base, scaling);
  scale_impl(q, tokens * q_heads * head_dim, q_scale);
  if (!cache) return;
  const int64_t B = cache->batch, T = tokens / B, width = k_heads * head_dim;
  meshtune::write_cache_rows(k, B, T, width, cache->capacity, cache->start, cache->key_cache.data);
  meshtune::write_cache_rows(cache->values.data, B, T, width, cache->capacity, cache->start, cache->value_cache.data);
}
void CpuBackend::rope_backward_impl(float* dq, int64_t q_heads, float* dk, int64_t k_heads, int64_t tokens,
                                    int64_t head_dim, const int64_t* positions, float base, float scaling,
                                    float q_scale) {
  scale_impl(dq, tokens * q_heads * head_dim, q_scale);
  meshtune::rope_backward(path_, dq, tokens, q_heads, head_dim, positions, base, scaling);
  meshtune::rope_backward(path_, dk, tokens, k_heads, head_dim, positions, base, scaling);
}
void CpuBackend::attention_impl(const float* q, const float* k, const float* v, const uint8_t* key_valid,
                                const AttentionShape& s, float* out) {
  meshtune::attention(path_, q, k, v, key_valid, s, out);
}
void CpuBackend::attention_backward_impl(const float* q, const float* k, const float* v, const uint8_t* key_valid,
                                         const AttentionShape& s, const float* dout, float* dq, float* dk, float* dv) {
  meshtune::attention_backward(path_, q, k, v, key_valid, s, dout, dq, dk, dv);
}
void CpuBackend::geglu_impl(const float* gate, const float* up, int64_t n, float* out) {
  meshtune::geglu(path_, gate, up, n, out);
}
void CpuBackend::geglu_backward_impl(const float* gate, const float* up, const float* dout, int64_t n, float* dgate,
                                     float* dup) {
  meshtune::geglu_backward(path_, gate, up, dout, n, dgate, dup);
}
void CpuBackend::soft_cap_impl(float* x, int64_t n, float cap) { meshtune::soft_cap(x, n, cap); }
void CpuBackend::soft_cap_backward_impl(const float* y, float* dy, int64_t n, float cap) {
  meshtune::soft_cap_backward(y, dy, n, cap);
}
void CpuBackend::softmax_row_max_impl(const float* z, int64_t n, int64_t cols, int64_t v0, float* max_and_argmax) {
  meshtune::softmax_row_max(z, n, cols, v0, max_and_argmax);
}
void CpuBackend::softmax_combine_max_impl(const float* gathered, int parts, int64_t n, float* max_and_argmax) {
  softmax_combine_max_rows(gathered, parts, n, max_and_argmax);
}
void CpuBackend::softmax_row_sums_impl(const float* z, int64_t n, int64_t cols, int64_t v0, const int32_t* targets,
                                       const float* max_and_argmax, double* sum_exp_and_target) {
  meshtune::softmax_row_sums(path_, z, n, cols, v0, targets, max_and_argmax, sum_exp_and_target);
}
void CpuBackend::softmax_cross_entropy_sums_impl(const float* max_and_argmax, const double* sum_exp_and_target,
                                                 const int32_t* targets, const float* weights, int64_t n,
                                                 double* sums) {
  softmax_cross_entropy_sum_rows(max_and_argmax, sum_exp_and_target, targets, weights, n, sums);
}
void CpuBackend::softmax_cross_entropy_backward_impl(float* z, int64_t n, int64_t cols, int64_t v0,
                                                     const int32_t* targets, const float* weights, double loss_scale,
                                                     const float* max_and_argmax, const double* sum_exp_and_target,
                                                     float cap) {
  meshtune::softmax_cross_entropy_backward(path_, z, n, cols, v0, targets, weights, loss_scale, max_and_argmax,
                                           sum_exp_and_target, cap);
}
void CpuBackend::embedding_lookup_impl(const WeightMatrix& table, int64_t first_row, const int32_t* ids, int64_t M,
                                       float factor, float* out) {
  meshtune::embedding_lookup(table, first_row, ids, M, factor, out);
}
void CpuBackend::embedding_lookup_backward_impl(const float* dy, const int32_t* ids, int64_t M, int64_t dim,
                                                int64_t first_row, int64_t rows, float factor, float* grad) {
  meshtune::embedding_lookup_backward(dy, ids, M, dim, first_row, rows, factor, grad);
}
void CpuBackend::gather_rows_impl(const float* src, const int64_t* rows, int64_t n, int64_t dim, float* dst) {
  meshtune::gather_rows(src, rows, n, dim, dst);
}
void CpuBackend::greedy_tokens_impl(const float* max_and_argmax, int64_t rows, const uint8_t* keep, int32_t* ids) {
  greedy_token_rows(max_and_argmax, rows, keep, ids);
}
void CpuBackend::scatter_rows_impl(const float* src, const int64_t* rows, int64_t n, int64_t dim, float* dst) {
  meshtune::scatter_rows(src, rows, n, dim, dst);
}
void CpuBackend::interleave_column_blocks_impl(const float* blocks, int parts, int64_t M, int64_t part, float* out) {
  meshtune::interleave_column_blocks(blocks, parts, M, part, out);
}
void CpuBackend::copy_impl(const float* src, int64_t n, float* dst) { copy_values(src, n, dst); }
void CpuBackend::zero_impl(float* x, int64_t n) { fill_zeros(x, n); }
void CpuBackend::add_into_impl(float* x, const float* y, int64_t n) { meshtune::add_into(x, y, n); }
void CpuBackend::scale_impl(float* x, int64_t n, float factor) { scale_in_place(x, n, factor); }
void CpuBackend::narrow_to_bf16_impl(const float* src, int64_t n, uint16_t* dst) {
  meshtune::narrow_to_bf16(path_, src, n, dst);
}
void CpuBackend::widen_bf16_impl(const uint16_t* src, int64_t n, float* dst) { widen_bf16_parallel(path_, src, n, dst); }
void CpuBackend::adamw_update_impl(float* theta, const float* grad, float* m, float* v, int64_t n,
                                   const AdamWStep& step) {
  meshtune::adamw_update(path_, theta, grad, m, v, n, step);
}

double CpuBackend::sum_of_squares_impl(const float* x, int64_t n) { return meshtune::sum_of_squares(x, n); }
void CpuBackend::scale_by_ratio_impl(float* x, int64_t n, float numerator, float denominator) {
  meshtune::scale_by_ratio(x, n, numerator, denominator);
}
void CpuBackend::clamp_impl(float* x, int64_t n, float limit) { clamp_values(x, n, limit); }
int64_t CpuBackend::first_not_finite_impl(const std::vector<ConstFloats>& arrays) {
  for (size_t a = 0; a < arrays.size(); ++a)
    if (!meshtune::all_finite(arrays[a].data, int64_t(arrays[a].size))) return int64_t(a);
  return -1;
}

}  // namespace meshtune
