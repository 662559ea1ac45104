// The operands of the backend ops that are more than a pointer and a length (backend/backend.h):
// the shape of an attention call, the LoRA term of a linear layer, the AdamW step's scalars, and
// the per-row statistics of the chunked softmax cross-entropy with the host arithmetic that
// combines them. Every backend takes the same ones.
#pragma once
#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "core/scalar_math.h"

namespace meshtune {

// Attention (backend.h attention): query head n uses KV head n / (N/K).
struct AttentionShape {
  int64_t batch = 0;      // B
  int64_t query_len = 0;  // T: queries of row b sit at positions start .. start+T-1
  int64_t start = 0;
  int64_t capacity = 0;   // S: key slots in the cache per row
  int64_t heads = 0;      // N
  int64_t kv_heads = 0;   // K
  int64_t head_dim = 0;   // H
  int64_t window = 0;     // sliding window W (key j allowed iff pos − W < j), 0 = none
  float soft_cap = 0;     // 0 = none
  // Under the dtype policy's bf16 precision (mixed_bfloat16, bfloat16) attention's products are
  // bf16 matmuls summed in fp32, as Keras computes its einsums in the compute dtype: q·kᵀ of the
  // rounded q and k, o = Σ p̂·v̂ of the rounded probabilities and values; the softmax stays fp32.
  // Backward alike: dp = dô·v̂ᵀ, ds = p̂·(dp − Σ p̂·dp)·cap', dq = Σ dŝ·k̂, dk = Σ dŝ·q̂, dv = Σ p̂·dô
  // (x̂ = round_to_bf16(x)). Sums and outputs stay fp32.
  bool bf16_products = false;

  // x as a product takes it: rounded to bf16 under bf16_products.
  MESHTUNE_HOST_DEVICE float product_input(float x) const { return bf16_products ? round_to_bf16(x) : x; }
};

// The low-rank term of a LoRA-adapted linear layer:
//   y[:, group g] += scale · (x · A_g) · B        (A_g: [in, r], B: [r, out_g])
// Keras' attention kernels have one A per head sharing B (groups = heads); PEFT and dense kernels
// have one group. A and B are strided views, so PEFT's transposed storage and a tensor-parallel
// part of an adapter need no copies.
struct LowRankTerm {
  int64_t rank = 0;           // r; 0 = no term
  int64_t groups = 1;         // output column blocks, each with its own A
  int64_t in = 0;             // input width (columns of x)
  int64_t out_per_group = 0;  // output columns per group; y has groups·out_per_group columns
  float scale = 1;            // alpha / r
  // A_g(i, j) = a[g·a_group + i·a_row + j·a_col], B(j, o) = b[j·b_row + o·b_col]; one stride of each is 1.
  const float* a = nullptr;
  int64_t a_group = 0, a_row = 0, a_col = 0;
  const float* b = nullptr;
  int64_t b_row = 0, b_col = 0;
  // Where backward adds ∂L/∂A and ∂L/∂B (same strides as a and b); null = frozen.
  float* grad_a = nullptr;
  float* grad_b = nullptr;
  Device device = Device::Host;  // where a, b and the gradients are

  MESHTUNE_HOST_DEVICE bool active() const { return rank > 0; }
  MESHTUNE_HOST_DEVICE int64_t out() const { return groups * out_per_group; }
};

// The per-step scalars, already cast to fp32 as Keras casts them.
struct AdamWStep {
  bool decay = false;       // weight decay applies to this variable
  float weight_decay = 0;   // wd
  float learning_rate = 0;  // lr
  float one_minus_beta_1 = 0, one_minus_beta_2 = 0;
  float alpha = 0;          // lr·√(1 − β₂ᵗ)/(1 − β₁ᵗ)
  float epsilon = 0;
};

// Keras' AdamW update of one value, each operation rounded to fp32 in Keras' order (the reference
// and CUDA backends run this very function; the CPU's vector loop does the same operations).
MESHTUNE_HOST_DEVICE inline void adamw_update_one(float& theta, float grad, float& m, float& v, const AdamWStep& step) {
  if (step.decay) {
    const float decay = theta * step.weight_decay;
    const float change = decay * step.learning_rate;
    theta = theta - change;
  }
  const float dm = grad - m;
  const float dm_scaled = dm * step.one_minus_beta_1;
  m = m + dm_scaled;
  const float g2 = grad * grad;
  const float dv = g2 - v;
  const float dv_scaled = dv * step.one_minus_beta_2;
  v = v + dv_scaled;
  const float numerator = m * step.alpha;
  const float denominator = ::sqrtf(v) + step.epsilon;
  theta = theta - numerator / denominator;
}

// The chunked softmax cross-entropy's statistics for the n rows of a chunk (backend.h softmax_*),
// in the backend's memory; the buffers are sized by the ops and reused from chunk to chunk.
struct SoftmaxRows {
  FloatBuffer max_and_argmax;         // [2n]: each row's largest logit, then its vocabulary index (first on ties)
  Buffer<double> sum_exp_and_target;  // [2n]: Σ exp(z − max), then the target's logit (0 if not held here)
  FloatBuffer gathered;               // a split vocabulary: every process' max_and_argmax, process order
};

// The two steps of the loss that are a few values per row, as host loops (the host backends'
// implementation; a device backend has its own):
// combining a split vocabulary's maxima — `gathered` holds every process' [max…, argmax…] (2n
// each, process order); the first process holding the overall maximum wins, as a whole-vocabulary
// argmax would;
void softmax_combine_max_rows(const float* gathered, int parts, int64_t n, float* max_and_argmax);
// the metric sums once the statistics are whole: adds Σ w·CE (CE = log Σexp + max − z_target),
// Σ w·[argmax = target] and Σ w over the rows into sums[0..2] (Keras' metric states).
void softmax_cross_entropy_sum_rows(const float* max_and_argmax, const double* sum_exp_and_target,
                                    const int32_t* targets, const float* weights, int64_t n, double* sums);
// Greedy decoding's choice from the same statistics, as a host loop too: ids[r] = row r's argmax
// unless keep[r].
void greedy_token_rows(const float* max_and_argmax, int64_t n, const uint8_t* keep, int32_t* ids);

}  // namespace meshtune
