// The backend seam: one object behind which the compute and the memory of model and train code
// sit. Model code never touches values itself; it allocates Buffers from a Backend and calls its
// ops, each with its backward beside it. Implementations:
//   ReferenceBackend (backend/reference_backend.h): plain loops, the oracle every other backend is
//     tested against, op by op (tests/test_backend_ops.cpp);
//   CpuBackend (backend/cpu_backend.h): the CPU kernels in src/kernels (OpenBLAS, oneDNN, OpenMP,
//     the AVX2 / AVX-512 paths).
// A CUDA backend implements the same protected *_impl functions over device pointers.
//
// The public functions check every operand — on this backend's device, at least as long as the op
// reads or writes — and then call the implementation with raw pointers, so a wrong operand is one
// Error naming the op and the operand instead of a crash, on every backend alike.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "backend/op_types.h"
#include "core/weight_matrix.h"

namespace meshtune {

using Floats = Span<float>;
using ConstFloats = Span<const float>;

// One product of several that share their input (Backend::linear over a list): y = x·Wᵀ.
struct LinearOutput {
  const WeightMatrix* W = nullptr;
  Floats y;
};
// The gradient dy of one of them, for the input gradient of all (linear_backward_input below).
struct LinearOutputGradient {
  const WeightMatrix* W = nullptr;
  ConstFloats dy;
};
// The same with dy already rounded to bf16 (a BF16-precision product's input; geglu_backward_bf16's).
struct Bf16OutputGradient {
  const WeightMatrix* W = nullptr;
  Span<const uint16_t> dy;
};

// Where RoPE (Backend::rope) also writes a step's rotated keys and its values: into their caches
// [batch, capacity, k_heads·head_dim] at positions start … start+T−1 (tokens = batch·T) — a decoding
// step's KV-cache write, in the same call (on a GPU, the same launch).
struct CacheWrite {
  ConstFloats values;  // the step's values [tokens, k_heads·head_dim], written as they are
  int64_t batch = 0, capacity = 0, start = 0;
  Floats key_cache, value_cache;
};

// RoPE as Backend::rope takes it, for the products that end in it (Backend::linear_rope): the query
// and key heads of head_dim, each token's position, the frequencies' base and scaling, the query
// scale, and the cache write (or none).
struct RopeStep {
  int64_t q_heads = 0, k_heads = 0, head_dim = 0;
  Span<const int64_t> positions;
  float base = 10000, scaling = 1, q_scale = 1;
  const CacheWrite* cache = nullptr;
};

// One variable of an optimizer step over many: its value, gradient and AdamW slots (n values each),
// and whether weight decay applies to it.
struct AdamWVariable {
  Floats theta;
  ConstFloats grad;
  Floats m, v;
  int64_t n = 0;
  bool decay = false;
};

class Backend : public Allocator {
 public:
  ~Backend() override = default;
  virtual std::string name() const = 0;  // "reference", "cpu (avx512bf16)"

  // ---- memory ----
  // Allocations made so far (a step of a shape seen before must make none).
  size_t allocations() const { return allocations_; }
  void* allocate(size_t bytes) final;
  void release(void* p) final;
  // A buffer of `count` elements on this backend (values undefined; reused if big enough).
  template <class E>
  void resize(Buffer<E>& buffer, size_t count) { buffer.resize(count, *this); }
  // The same, all zeros (gradients and optimizer slots before they accumulate).
  void resize_zeroed(FloatBuffer& buffer, size_t count) {
    resize(buffer, count);
    zero(buffer, int64_t(count));
  }
  // The named host crossings: the batch in (ids, positions, masks, targets), metrics and sampled
  // logits out, adapters in and out. The whole host span is copied.
  void upload(Span<const float> host, Floats device);
  void upload(Span<const int32_t> host, Span<int32_t> device);
  void upload(Span<const int64_t> host, Span<int64_t> device);
  void upload(Span<const uint8_t> host, Span<uint8_t> device);
  void download(ConstFloats device, Span<float> host);
  void upload(Span<const double> host, Span<double> device);
  void download(Span<const double> device, Span<double> host);
  void download(Span<const int32_t> device, Span<int32_t> host);
  // A download the host collects later, so that it need not wait for the work queued before it
  // (greedy decoding's tokens, fetched a few steps behind the GPU): the values are in `host` once
  // finish_download returns; until then `host` must stay valid and untouched. Host backends copy at
  // once. At most kDownloadsInFlight may be outstanding: starting one more finishes the oldest.
  static constexpr int kDownloadsInFlight = 8;
  struct PendingDownload {
    uint64_t id = 0;  // 0: nothing pending
  };
  PendingDownload start_download(Span<const int32_t> device, Span<int32_t> host);
  void finish_download(PendingDownload& pending);
  // The weights: a copy in this backend's memory (the same storage when they are there already, as
  // host weights are for the CPU backends). The copy lives in buffers of this backend, which must
  // outlive it.
  WeightMatrix upload(const WeightMatrix& host);
  WeightVector upload(const WeightVector& host);
  virtual void synchronize() {}
  // Runs `step`, work queued on this backend with no host crossing in it (no upload, download or
  // synchronize: greedy decoding's step, whose inputs are on the backend already), as one unit. A
  // GPU captures it as a CUDA graph and launches that — one host call where each launch and product
  // would cost one —, or runs it as it comes where a capture cannot hold it (memory to grow, a route
  // to time). `step` must do the same work each time it is called: it may run twice.
  virtual void run_step(const std::function<void()>& step) { step(); }

  // ---- matrices (x: [M, W.cols] row-major, y: [M, W.rows]) ----
  // y = x·Wᵀ for every dtype of W (F32, BF16, I8 with per-row scales) under `precision`. For I8, the
  // rows' largest |x| may be given (x_row_max: combined over a split input, see model/gemma.cpp).
  void linear(ConstFloats x, int64_t M, const WeightMatrix& W, Floats y, MatmulPrecision precision,
              ConstFloats x_row_max = {});
  // y_i = x·W_iᵀ for several weights of one input x (attention's q, k and v; the FFN's gate and up),
  // every W_i as wide as x: a GPU reads (and rounds) x once and runs the products of a few rows in
  // one launch.
  void linear(ConstFloats x, int64_t M, const std::vector<LinearOutput>& outputs, MatmulPrecision precision);
  // out = gelu_tanh(x·W_gateᵀ)·(x·W_upᵀ) [M, rows]: the feed-forward's two products and its GeGLU in
  // one call, where nothing else reads the products (inference, no LoRA on gate or up). gate and up
  // are room for the products where they are computed apart (afterwards undefined); out may be gate.
  // A GPU's few-row products (decode) write only out: one launch instead of two.
  void linear_geglu(ConstFloats x, int64_t M, const WeightMatrix& W_gate, const WeightMatrix& W_up, Floats gate,
                    Floats up, Floats out, MatmulPrecision precision);
  // q, k, v = x·W_qᵀ, x·W_kᵀ, x·W_vᵀ, then RoPE of q and k (and the cache write, whose values must be
  // v) as rope() does it:
  // attention's projections and RoPE in one call, where nothing else reads the products before RoPE
  // (no LoRA on them, no q/k norm). A GPU's few-row products (decode) do it all in one launch.
  void linear_rope(ConstFloats x, int64_t M, const WeightMatrix& W_q, const WeightMatrix& W_k, const WeightMatrix& W_v,
                   Floats q, Floats k, Floats v, const RopeStep& rope, MatmulPrecision precision);
  // dx (+)= dy·W, and dW += dyᵀ·x ([rows, cols]).
  void linear_backward_input(ConstFloats dy, int64_t M, const WeightMatrix& W, Floats dx, bool accumulate,
                             MatmulPrecision precision);
  // dx (+)= Σ_i dy_i·W_i: the input gradient of linear over several weights of one input (q, k and v;
  // gate and up), in that order. Under the bf16 policies a GPU narrows every dy_i in one launch.
  void linear_backward_input(const std::vector<LinearOutputGradient>& gradients, int64_t M, Floats dx,
                             bool accumulate, MatmulPrecision precision);
  void linear_backward_weight(ConstFloats dy, ConstFloats x, int64_t M, int64_t rows, int64_t cols, Floats dW);
  // The products of inputs already rounded to bf16 — what a BF16-precision product makes of their fp32
  // values, so the numbers are linear's and linear_backward_input's under BF16 precision; W not int8
  // (int8 products quantize the fp32 values): y = x·Wᵀ, and dx (+)= Σ_i dy_i·W_i. A GPU reads them as
  // they are, where the fp32 forms narrow their input first.
  void linear(Span<const uint16_t> x, int64_t M, const WeightMatrix& W, Floats y);
  void linear_backward_input(const std::vector<Bf16OutputGradient>& gradients, int64_t M, Floats dx, bool accumulate);
  // LoRA's y += s·(x·A)·B and its backward (dx += …, ∂A, ∂B into the term's gradient views).
  void low_rank(ConstFloats x, int64_t M, const LowRankTerm& term, Floats y);
  void low_rank_backward(ConstFloats x, ConstFloats dy, int64_t M, const LowRankTerm& term, Floats dx);
  // out[r] = max |x[r, :]| over `rows` rows of `cols`.
  void row_abs_max(ConstFloats x, int64_t rows, int64_t cols, Floats out);

  // ---- normalization, position, attention, activations ----
  // Gemma RMSNorm per row: y = x·rsqrt(mean(x²) + eps)·(1 + scale); y may be x. Backward writes dx
  // (may be dy) and adds ∂L/∂scale into dscale unless it is empty.
  void rmsnorm(ConstFloats x, ConstFloats scale, int64_t rows, int64_t dim, float eps, Floats y);
  // A branch joining the residual stream and the next norm in one call: x += branch, then y = RMSNorm(x)
  // (y apart from x and branch); x_copy, if given, receives the new x too (what training keeps for
  // backward, without a copy of its own). With `branch_scale` the branch is normalized first (Gemma
  // 2/3's post-norm): x += RMSNorm(branch)·(1 + branch_scale). Its backward is rmsnorm_backward's.
  void add_rmsnorm(Floats x, ConstFloats branch, ConstFloats scale, int64_t rows, int64_t dim, float eps, Floats y,
                   Floats x_copy = {}, ConstFloats branch_scale = {});
  // With `accumulate` it adds into dx instead (dx is then not dy): a residual's gradient in one call.
  void rmsnorm_backward(ConstFloats x, ConstFloats scale, int64_t rows, int64_t dim, float eps, ConstFloats dy,
                        Floats dx, Floats dscale, bool accumulate = false);
  // RoPE in place on the queries q [tokens, q_heads, head_dim] and the keys k [tokens, k_heads,
  // head_dim], token t at positions[t]; then q ·= q_scale (the query scaling). Backward: dq ·= q_scale,
  // then dq and dk rotated back. One call for both (on a GPU one launch, not three). With `cache`, the
  // rotated keys and the step's values go into a KV cache too (CacheWrite).
  void rope(Floats q, int64_t q_heads, Floats k, int64_t k_heads, int64_t tokens, int64_t head_dim,
            Span<const int64_t> positions, float base, float scaling, float q_scale, const CacheWrite* cache = nullptr);
  void rope_backward(Floats dq, int64_t q_heads, Floats dk, int64_t k_heads, int64_t tokens, int64_t head_dim,
                     Span<const int64_t> positions, float base, float scaling, float q_scale);
  // Attention of q [B·T, N·H] over a cache k, v [B, S, K·H] (key_valid [B, S]) → out [B·T, N·H].
  void attention(ConstFloats q, ConstFloats k, ConstFloats v, Span<const uint8_t> key_valid, const AttentionShape& s,
                 Floats out);
  void attention_backward(ConstFloats q, ConstFloats k, ConstFloats v, Span<const uint8_t> key_valid,
                          const AttentionShape& s, ConstFloats dout, Floats dq, Floats dk, Floats dv);
  // out = gelu_tanh(gate)·up over n (out may be gate); backward gives dgate, dup.
  void geglu(ConstFloats gate, ConstFloats up, int64_t n, Floats out);
  void geglu_backward(ConstFloats gate, ConstFloats up, ConstFloats dout, int64_t n, Floats dgate, Floats dup);
  // GeGLU where only bf16 products and bf16 copies read its M·F values (a training step's feed-forward
  // under the bf16 policies, model/gemma.cpp): the numbers of geglu then narrow_to_bf16 of out, gate
  // and up — out for the down projection, gate and up for backward —, and of widen_bf16 of gate and
  // up, geglu_backward, then narrow_to_bf16 of dgate and dup (the gate and up products' input
  // gradients), each in one pass on a GPU instead of four.
  void geglu_to_bf16(ConstFloats gate, ConstFloats up, int64_t n, Span<uint16_t> out, Span<uint16_t> gate_copy,
                     Span<uint16_t> up_copy);
  void geglu_backward_bf16(Span<const uint16_t> gate, Span<const uint16_t> up, ConstFloats dout, int64_t n,
                           Span<uint16_t> dgate, Span<uint16_t> dup);
  // x = cap·tanh(x/cap); backward from the capped y: dy ·= 1 − (y/cap)².
  void soft_cap(Floats x, int64_t n, float cap);
  void soft_cap_backward(ConstFloats y, Floats dy, int64_t n, float cap);

  // ---- the chunked softmax cross-entropy (backend/cpu/cross_entropy.h: steps a split vocabulary
  // combines between) over a chunk of n rows of logits z [n, cols] (vocabulary columns v0 …),
  // targets [n] and weights [n] of those rows; the statistics stay on the backend ----
  void softmax_row_max(ConstFloats z, int64_t n, int64_t cols, int64_t v0, SoftmaxRows& stats);
  void softmax_combine_max(ConstFloats gathered, int parts, int64_t n, SoftmaxRows& stats);
  void softmax_row_sums(ConstFloats z, int64_t n, int64_t cols, int64_t v0, Span<const int32_t> targets,
                        SoftmaxRows& stats);
  // sums[0..2] += Σ w·CE, Σ w·[argmax = target], Σ w over the chunk (Keras' metric states).
  void softmax_cross_entropy_sums(const SoftmaxRows& stats, Span<const int32_t> targets, ConstFloats weights,
                                  int64_t n, Span<double> sums);
  void softmax_cross_entropy_backward(Floats z, int64_t n, int64_t cols, int64_t v0, Span<const int32_t> targets,
                                      ConstFloats weights, double loss_scale, const SoftmaxRows& stats, float cap);

  // ---- data movement ----
  // out[m] = factor · table row ids[m] − first_row for the ids the table holds (the row widened to
  // fp32, then multiplied: Gemma's √D scale in the lookup's own call), zeros for the others; its
  // gradient adds factor·dy[m] into grad[ids[m] − first_row] ([rows, dim]).
  void embedding_lookup(const WeightMatrix& table, int64_t first_row, Span<const int32_t> ids, int64_t M, Floats out,
                        float factor = 1);
  void embedding_lookup_backward(ConstFloats dy, Span<const int32_t> ids, int64_t M, int64_t dim, int64_t first_row,
                                 int64_t rows, float factor, Floats grad);
  // dst[i] = src row rows[i], and dst row rows[i] = src[i] (rows of dim floats; rows on the host).
  void gather_rows(ConstFloats src, Span<const int64_t> rows, int64_t dim, Floats dst);
  void scatter_rows(ConstFloats src, Span<const int64_t> rows, int64_t dim, Floats dst);
  // `parts` blocks of [M, part] columns interleaved into rows of [M, parts·part].
  void interleave_column_blocks(ConstFloats blocks, int parts, int64_t M, int64_t part, Floats out);
  void copy(ConstFloats src, int64_t n, Floats dst);       // dst = src
  void zero(Floats x, int64_t n);                          // x = 0
  // Every array = 0, whole (a step's gradients: on a GPU a few launches, not one per array).
  void zero(const std::vector<Floats>& arrays);
  void add_into(Floats x, ConstFloats y, int64_t n);       // x += y
  void scale(Floats x, int64_t n, float factor);           // x ·= factor
  void narrow_to_bf16(ConstFloats src, int64_t n, Span<uint16_t> dst);
  void widen_bf16(Span<const uint16_t> src, int64_t n, Floats dst);
  // Several arrays narrowed, in order, into consecutive parts of `dst`, and widened back from them:
  // a block's saved activations in one call (on a GPU one launch, not one per array).
  void narrow_to_bf16(const std::vector<ConstFloats>& parts, Span<uint16_t> dst);
  void widen_bf16(Span<const uint16_t> src, const std::vector<Floats>& parts);

  // Greedy decoding's choice where the logits are: ids[r] = the argmax of row r (softmax_row_max's
  // statistics) where keep[r] is 0, ids[r] unchanged where it is 1 (a row still inside its prompt).
  void greedy_tokens(const SoftmaxRows& row_max, int64_t rows, Span<const uint8_t> keep, Span<int32_t> ids);

  // ---- optimizer ----
  void adamw_update(Floats theta, ConstFloats grad, Floats m, Floats v, int64_t n, const AdamWStep& step);
  // Every variable of a step at once, each with its own `decay` (step.decay is ignored): on a GPU a
  // few launches instead of one per variable.
  void adamw_update(const std::vector<AdamWVariable>& variables, const AdamWStep& step);
  // Gradient clipping and Keras' TerminateOnNaN check: Σx² (summed in double, in index order, and
  // brought back to the host); x = (x·numerator)/denominator (two roundings, Keras' clipnorm);
  // x = clamp(x, −limit, limit) (clipvalue); the index of the first of `arrays` holding a NaN or an
  // infinity, or −1 (one host round trip for all of them on a device).
  double sum_of_squares(ConstFloats x, int64_t n);
  void scale_by_ratio(Floats x, int64_t n, float numerator, float denominator);
  void clamp(Floats x, int64_t n, float limit);
  int64_t first_not_finite(const std::vector<ConstFloats>& arrays);

 protected:
  virtual void* allocate_impl(size_t bytes) = 0;
  virtual void release_impl(void* p) = 0;
  virtual void upload_impl(const void* host, size_t bytes, void* device) = 0;
  virtual void download_impl(const void* device, size_t bytes, void* host) = 0;
  // By default a download at once (download_impl); returns the id finish_download_impl takes (0: done).
  virtual uint64_t start_download_impl(const void* device, size_t bytes, void* host);
  virtual void finish_download_impl(uint64_t id);

  virtual void linear_impl(const float* x, int64_t M, const WeightMatrix& W, float* y, MatmulPrecision precision,
                           const float* x_row_max) = 0;
  // By default each product on its own (linear_impl).
  virtual void linear_shared_input_impl(const float* x, int64_t M, const std::vector<LinearOutput>& outputs,
                                        MatmulPrecision precision);
  // By default linear_shared_input_impl into gate and up, then geglu_impl.
  virtual void linear_geglu_impl(const float* x, int64_t M, const WeightMatrix& W_gate, const WeightMatrix& W_up,
                                 float* gate, float* up, float* out, MatmulPrecision precision);
  // By default linear_shared_input_impl, then rope_impl.
  virtual void linear_rope_impl(const float* x, int64_t M, const WeightMatrix& W_q, const WeightMatrix& W_k,
                                const WeightMatrix& W_v, float* q, float* k, float* v, const RopeStep& rope,
                                MatmulPrecision precision);
  virtual void linear_backward_input_impl(const float* dy, int64_t M, const WeightMatrix& W, float* dx,
                                          bool accumulate, MatmulPrecision precision) = 0;
  // By default each product on its own (linear_backward_input_impl), adding after the first.
  virtual void linear_backward_input_shared_impl(const std::vector<LinearOutputGradient>& gradients, int64_t M,
                                                 float* dx, bool accumulate, MatmulPrecision precision);
  virtual void linear_backward_weight_impl(const float* dy, const float* x, int64_t M, int64_t rows, int64_t cols,
                                           float* dW) = 0;
  // By default widened into scratch_floats, then linear_impl / linear_backward_input_shared_impl under BF16.
  virtual void linear_bf16_input_impl(const uint16_t* x, int64_t M, const WeightMatrix& W, float* y);
  virtual void linear_backward_input_bf16_impl(const std::vector<Bf16OutputGradient>& gradients, int64_t M,
                                               float* dx, bool accumulate);
  virtual void low_rank_impl(const float* x, int64_t M, const LowRankTerm& term, float* y) = 0;
  virtual void low_rank_backward_impl(const float* x, const float* dy, int64_t M, const LowRankTerm& term,
                                      float* dx) = 0;
  virtual void row_abs_max_impl(const float* x, int64_t rows, int64_t cols, float* out) = 0;
  virtual void rmsnorm_impl(const float* x, const float* scale, int64_t rows, int64_t dim, float eps, float* y) = 0;
  // By default rmsnorm_impl of the branch into y (where branch_scale is not null), add_into_impl,
  // rmsnorm_impl, then copy_impl into x_copy (may be null).
  virtual void add_rmsnorm_impl(float* x, const float* branch, const float* branch_scale, const float* scale,
                                int64_t rows, int64_t dim, float eps, float* y, float* x_copy);
  virtual void rmsnorm_backward_impl(const float* x, const float* scale, int64_t rows, int64_t dim, float eps,
                                     const float* dy, float* dx, float* dscale, bool accumulate) = 0;
  // `cache` null: none; its spans checked against tokens, k_heads and head_dim.
  virtual void rope_impl(float* q, int64_t q_heads, float* k, int64_t k_heads, int64_t tokens, int64_t head_dim,
                         const int64_t* positions, float base, float scaling, float q_scale,
                         const CacheWrite* cache) = 0;
  virtual void rope_backward_impl(float* dq, int64_t q_heads, float* dk, int64_t k_heads, int64_t tokens,
                                  int64_t head_dim, const int64_t* positions, float base, float scaling,
                                  float q_scale) = 0;
  virtual void attention_impl(const float* q, const float* k, const float* v, const uint8_t* key_valid,
                              const AttentionShape& s, float* out) = 0;
  virtual void attention_backward_impl(const float* q, const float* k, const float* v, const uint8_t* key_valid,
                                       const AttentionShape& s, const float* dout, float* dq, float* dk,
                                       float* dv) = 0;
  virtual void geglu_impl(const float* gate, const float* up, int64_t n, float* out) = 0;
  virtual void geglu_backward_impl(const float* gate, const float* up, const float* dout, int64_t n, float* dgate,
                                   float* dup) = 0;
  // By default the fp32 ops in scratch_floats and the narrowing and widening around them.
  virtual void geglu_to_bf16_impl(const float* gate, const float* up, int64_t n, uint16_t* out, uint16_t* gate_copy,
                                  uint16_t* up_copy);
  virtual void geglu_backward_bf16_impl(const uint16_t* gate, const uint16_t* up, const float* dout, int64_t n,
                                        uint16_t* dgate, uint16_t* dup);
  virtual void soft_cap_impl(float* x, int64_t n, float cap) = 0;
  virtual void soft_cap_backward_impl(const float* y, float* dy, int64_t n, float cap) = 0;
  virtual void softmax_row_max_impl(const float* z, int64_t n, int64_t cols, int64_t v0, float* max_and_argmax) = 0;
  virtual void softmax_combine_max_impl(const float* gathered, int parts, int64_t n, float* max_and_argmax) = 0;
  virtual void softmax_row_sums_impl(const float* z, int64_t n, int64_t cols, int64_t v0, const int32_t* targets,
                                     const float* max_and_argmax, double* sum_exp_and_target) = 0;
  virtual void softmax_cross_entropy_sums_impl(const float* max_and_argmax, const double* sum_exp_and_target,
                                               const int32_t* targets, const float* weights, int64_t n,
                                               double* sums) = 0;
  virtual void softmax_cross_entropy_backward_impl(float* z, int64_t n, int64_t cols, int64_t v0,
                                                   const int32_t* targets, const float* weights, double loss_scale,
                                                   const float* max_and_argmax, const double* sum_exp_and_target,
                                                   float cap) = 0;
  virtual void embedding_lookup_impl(const WeightMatrix& table, int64_t first_row, const int32_t* ids, int64_t M,
                                     float factor, float* out) = 0;
  virtual void embedding_lookup_backward_impl(const float* dy, const int32_t* ids, int64_t M, int64_t dim,
                                              int64_t first_row, int64_t rows, float factor, float* grad) = 0;
  virtual void gather_rows_impl(const float* src, const int64_t* rows, int64_t n, int64_t dim, float* dst) = 0;
  virtual void greedy_tokens_impl(const float* max_and_argmax, int64_t rows, const uint8_t* keep, int32_t* ids) = 0;
  virtual void scatter_rows_impl(const float* src, const int64_t* rows, int64_t n, int64_t dim, float* dst) = 0;
  virtual void interleave_column_blocks_impl(const float* blocks, int parts, int64_t M, int64_t part,
                                             float* out) = 0;
  virtual void copy_impl(const float* src, int64_t n, float* dst) = 0;
  virtual void zero_impl(float* x, int64_t n) = 0;
  virtual void add_into_impl(float* x, const float* y, int64_t n) = 0;
  virtual void scale_impl(float* x, int64_t n, float factor) = 0;
  virtual void narrow_to_bf16_impl(const float* src, int64_t n, uint16_t* dst) = 0;
  virtual void widen_bf16_impl(const uint16_t* src, int64_t n, float* dst) = 0;
  // By default each part on its own (narrow_to_bf16_impl / widen_bf16_impl).
  virtual void narrow_parts_to_bf16_impl(const std::vector<ConstFloats>& parts, uint16_t* dst);
  virtual void widen_bf16_parts_impl(const uint16_t* src, const std::vector<Floats>& parts);
  // By default each array on its own (zero_impl).
  virtual void zero_many_impl(const std::vector<Floats>& arrays);
  // By default each variable on its own (adamw_update_impl).
  virtual void adamw_update_many_impl(const std::vector<AdamWVariable>& variables, const AdamWStep& step);
  virtual void adamw_update_impl(float* theta, const float* grad, float* m, float* v, int64_t n,
                                 const AdamWStep& step) = 0;
  virtual double sum_of_squares_impl(const float* x, int64_t n) = 0;
  virtual void scale_by_ratio_impl(float* x, int64_t n, float numerator, float denominator) = 0;
  virtual void clamp_impl(float* x, int64_t n, float limit) = 0;
  virtual int64_t first_not_finite_impl(const std::vector<ConstFloats>& arrays) = 0;
  // Room for the default implementations' fp32 values: n floats of this backend's memory, kept (not
  // an allocation of the backend's) and valid until the next call. A default that holds it calls no
  // other op that takes it. By default host memory (the host backends'); a device backend overrides it.
  virtual float* scratch_floats(size_t n);

 private:
  size_t allocations_ = 0;
  std::vector<float> host_scratch_;
};

}  // namespace meshtune
