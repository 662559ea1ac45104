#include "model/lora.h"

#include <algorithm>

#include <cblas.h>

#include <cmath>
#include <set>
#include <utility>

#include "core/error.h"
#include "core/random.h"
#include "core/weight_matrix.h"

namespace meshtune {

namespace {

bool is_adaptable(Slot slot) { return std::find(kLoraSlots.begin(), kLoraSlots.end(), slot) != kLoraSlots.end(); }

int64_t prod_but_last(const Shape& s) {
  int64_t p = 1;
  for (size_t i = 0; i + 1 < s.size(); ++i) p *= s[i];
  return p;
}



// ΔK[P, last] = A[P, r]·B[r, last], summing over r in order with a separate multiply and add (no
// FMA): that is what NumPy computes for Keras, so merged kernels equal Keras' bit for bit.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
void keras_lora_product(const float* a, const float* b, int64_t P, int64_t r, int64_t last, float* out) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  for (int64_t p = 0; p < P; ++p) {
    float* o = out + p * last;
    const float* ap = a + p * r;
    for (int64_t h = 0; h < last; ++h) o[h] = ap[0] * b[h];
    for (int64_t j = 1; j < r; ++j) {
      const float* bj = b + j * last;
      for (int64_t h = 0; h < last; ++h) o[h] += ap[j] * bj[h];
    }
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

}  // namespace

// Taken from gemma_variables (layer 0) so that there is one table of shapes.
LoraKernel lora_kernel(const GemmaConfig& config, Slot slot) {
  check(is_adaptable(slot), "LoRA: ", slot_layer_name(slot), " cannot carry a LoRA adapter");
  check(config.num_layers > 0, "LoRA: the model has no layers");
  for (const VariableSpec& spec : gemma_variables(config))
    if (spec.layer == 0 && spec.slot == slot) return {spec.keras_shape, spec.kind, spec.hf_shape[0], spec.hf_shape[1]};
  fail("LoRA: ", slot_layer_name(slot), " is not a kernel of this model");
}

std::string LoraAdapter::keras_path(const GemmaConfig& config) const {
  const std::string block = "decoder_block_" + std::to_string(layer) + "/";
  switch (slot) {
    case Slot::Query:
    case Slot::Key:
    case Slot::Value:
    case Slot::AttentionOutput: return block + "attention/" + slot_layer_name(slot);
    default: return block + slot_layer_name(slot);
  }
}

long long LoraWeights::num_parameters() const {
  long long n = 0;
  for (const LoraAdapter& a : adapters) n += (long long)(a.a.size() + a.b.size());
  return n;
}

const char* slot_layer_name(Slot slot) {
  switch (slot) {
    case Slot::Embeddings: return "token_embedding";
    case Slot::FinalNorm: return "final_normalization";
    case Slot::PreAttentionNorm: return "pre_attention_norm";
    case Slot::PostAttentionNorm: return "post_attention_norm";
    case Slot::PreFfwNorm: return "pre_ffw_norm";
    case Slot::PostFfwNorm: return "post_ffw_norm";
    case Slot::QueryNorm: return "query_norm";
    case Slot::KeyNorm: return "key_norm";
    case Slot::Query: return "query";
    case Slot::Key: return "key";
    case Slot::Value: return "value";
    case Slot::AttentionOutput: return "attention_output";
    case Slot::FfwGating: return "ffw_gating";
    case Slot::FfwGating2: return "ffw_gating_2";
    case Slot::FfwLinear: return "ffw_linear";
  }
  return "?";
}

std::vector<Slot> parse_lora_targets(const std::vector<std::string>& names) {
  static const std::vector<Slot> all = {Slot::Query,      Slot::Key,        Slot::Value,    Slot::AttentionOutput,
                                        Slot::FfwGating, Slot::FfwGating2, Slot::FfwLinear};
  // Keras' own default (enable_lora without target names) adapts query and value.
  if (names.empty()) return {Slot::Query, Slot::Value};
  std::vector<Slot> out;
  auto add = [&](Slot s) {
    for (Slot have : out)
      if (have == s) return;
    out.push_back(s);
  };
  for (const std::string& name : names) {
    if (name == "all") {
      for (Slot s : all) add(s);
      continue;
    }
    bool found = false;
    for (Slot s : all)
      if (name == slot_layer_name(s)) {
        add(s);
        found = true;
      }
    check(found, "unknown LoRA target '", name,
          "' (expected query, key, value, attention_output, ffw_gating, ffw_gating_2, ffw_linear or all)");
  }
  return out;
}

LoraWeights enable_lora(const GemmaConfig& config, int rank, const std::vector<Slot>& targets, uint64_t seed,
                        double alpha) {
  // A rank above the hidden size adds parameters but no expressiveness (ΔW has at most that rank),
  // and bounds what a mistyped rank can allocate.
  check(rank > 0 && rank <= config.hidden_dim, "LoRA rank ", rank, " is outside [1, ", config.hidden_dim,
        "] (at most the model's hidden size)");
  check(alpha >= 0, "LoRA alpha must be positive, got ", alpha);
  LoraWeights w;
  w.rank = rank;
  w.alpha = alpha > 0 ? alpha : double(rank);
  SplitMix64 rng{seed};
  for (int layer = 0; layer < config.num_layers; ++layer) {
    for (Slot slot : targets) {
      const LoraKernel k = lora_kernel(config, slot);
      LoraAdapter a;
      a.layer = layer;
      a.slot = slot;
      a.style = LoraStyle::Keras;
      a.rank = rank;
      a.a_shape = Shape(k.keras_shape.begin(), k.keras_shape.end() - 1);
      a.a_shape.push_back(rank);
      a.b_shape = {rank, k.keras_shape.back()};
      // he_uniform as Keras computes fans for A: fan_in = product of all dims but the last.
      const double limit = std::sqrt(6.0 / double(prod_but_last(a.a_shape)));
      a.a.resize(size_t(num_elements(a.a_shape)));
      for (float& v : a.a) v = float(limit * (2.0 * rng.uniform() - 1.0));
      a.b.assign(size_t(num_elements(a.b_shape)), 0.f);
      w.adapters.push_back(std::move(a));
    }
  }
  return w;
}

std::vector<float> lora_delta(const GemmaConfig& config, const LoraAdapter& ad, double scale) {
  const LoraKernel k = lora_kernel(config, ad.slot);
  const int r = ad.rank;
  std::vector<float> delta(size_t(k.rows * k.cols), 0.f);
  if (ad.style == LoraStyle::Peft) {  // ΔW[out, in] = scale·B[out, r]·A[r, in]
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(k.rows), int(k.cols), r, float(scale), ad.b.data(), r,
                ad.a.data(), int(k.cols), 0.f, delta.data(), int(k.cols));
    return delta;
  }
  // Keras: ΔK[P, last] = A[P, r]·B[r, last] on the flattened Keras kernel, then into our layout.
  const int64_t P = prod_but_last(k.keras_shape), last = k.keras_shape.back();
  HostTensor dk = HostTensor::allocate(DType::F32, k.keras_shape);
  keras_lora_product(ad.a.data(), ad.b.data(), P, r, last, dk.mutable_as<float>());
  HostTensor ours = keras_to_ours(dk, k.kind);
  const float* src = ours.as<float>();
  const float s = float(scale);
  for (size_t i = 0; i < delta.size(); ++i) delta[i] = s * src[i];
  return delta;
}

// W_eff = W + ΔW (or this process' part of it) for the adapters of one decoder block.
static void merge_layer(const GemmaConfig& config, const LoraWeights& lora, int layer, const LoraDeltaPart& part,
                        DecoderLayerWeights& w) {
  for (const LoraAdapter& ad : lora.adapters) {
    if (ad.layer != layer) continue;
    WeightMatrix& m = *w.matrix(ad.slot);
    std::vector<float> delta = lora_delta(config, ad, lora.scale());
    if (part) delta = part(ad, delta);
    std::vector<float> values = m.to_f32();
    check(values.size() == delta.size(), "merge_lora: the LoRA update of ", ad.keras_path(config),
          " does not fit its kernel's part");
    for (size_t i = 0; i < values.size(); ++i) values[i] += delta[i];
    const bool int8 = m.dtype == DType::I8;
    m = WeightMatrix::from_f32(m.rows, m.cols, std::move(values));
    if (int8) m = quantize_matrix_int8(m);  // Keras' _get_kernel_with_merged_lora: re-quantized (int8.md §5)
  }
}

GemmaModel merge_lora(const GemmaModel& base, const LoraWeights& lora) { return merge_lora(base, lora, base.config, {}); }

GemmaModel merge_lora(const GemmaModel& base, const LoraWeights& lora, const GemmaConfig& config,
                      const LoraDeltaPart& part) {
  validate_lora(config, lora, "merge_lora");
  GemmaModel merged = base;  // WeightMatrix copies share storage
  if (base.layer_source) {  // blocks built on demand: merge each as it is built
    merged.layer_source = [source = base.layer_source, lora, config, part](int layer) {
      DecoderLayerWeights w = source(layer);
      merge_layer(config, lora, layer, part, w);
      return w;
    };
    return merged;
  }
  for (int layer = 0; layer < config.num_layers; ++layer)
    merge_layer(config, lora, layer, part, merged.layers[size_t(layer)]);
  return merged;
}

// The rows [out0, out0 + out_n) and columns [in0, in0 + in_n) of our [out, in] matrix that a
// compute region (our 3-D view of the variable) covers.
struct MatrixWindow {
  int64_t out0 = 0, out_n = 0, in0 = 0, in_n = 0;
};
static MatrixWindow matrix_window(VarKind kind, const ShardSpec& r) {
  switch (kind) {
    case VarKind::HeadsIn:  // (heads, H, D): rows heads·H
      return {r.offset[0] * r.full[1], r.local[0] * r.full[1], r.offset[2], r.local[2]};
    case VarKind::HeadsOut:  // (D, N, H): columns N·H
      return {r.offset[0], r.local[0], r.offset[1] * r.full[2], r.local[1] * r.full[2]};
    default:  // Dense (1, out, in)
      return {r.offset[1], r.local[1], r.offset[2], r.local[2]};
  }
}

LoraTensors::LoraTensors(Backend& backend, const LoraWeights& lora) {
  for (const LoraAdapter& ad : lora.adapters) {
    for (auto [values, host] : {std::pair{&a, &ad.a}, std::pair{&b, &ad.b}}) {
      FloatBuffer& value = values->emplace_back();
      backend.resize(value, host->size());
      backend.upload(*host, value);
    }
    for (auto [grads, n] : {std::pair{&grad_a, ad.a.size()}, std::pair{&grad_b, ad.b.size()}})
      backend.resize_zeroed(grads->emplace_back(), n);
  }
}

void LoraTensors::download(Backend& backend, LoraWeights& lora) const {
  check(lora.adapters.size() == a.size(), "LoRA: ", a.size(), " adapters' tensors for ", lora.adapters.size(),
        " adapters");
  for (size_t i = 0; i < a.size(); ++i) {
    backend.download(a[i], lora.adapters[i].a);
    backend.download(b[i], lora.adapters[i].b);
  }
}

namespace {

// Where adapter i's terms read and write: A, B (and their gradients when trained).
struct AdapterStorage {
  const float *a = nullptr, *b = nullptr;
  float *grad_a = nullptr, *grad_b = nullptr;
  Device device = Device::Host;
};

void attach_terms(GemmaModel& model, const LoraWeights& lora, const std::vector<AdapterStorage>& storage,
                  const GemmaConfig& whole, const TensorParallelPlan& plan) {
  validate_lora(whole, lora, "attach_lora");
  model.low_rank.assign(size_t(whole.num_layers), LayerLowRank{});
  const std::vector<VariableSpec> specs = gemma_variables(whole);
  for (size_t index = 0; index < lora.adapters.size(); ++index) {
    const LoraAdapter& ad = lora.adapters[index];
    const AdapterStorage& at = storage[index];
    const LoraKernel k = lora_kernel(whole, ad.slot);
    const int64_t r = ad.rank;
    LowRankTerm t;
    t.rank = r;
    t.scale = float(lora.scale());
    if (ad.style == LoraStyle::Peft) {  // A [r, in], B [out, r]: ΔW = B·A
      t.in = k.cols, t.out_per_group = k.rows;
      t.a_row = 1, t.a_col = k.cols;
      t.b_row = 1, t.b_col = r;
    } else if (k.kind == VarKind::HeadsIn) {  // Keras (N, D, H): A (N, D, r) per head, B (r, H) shared
      t.groups = k.keras_shape[0], t.in = k.keras_shape[1], t.out_per_group = k.keras_shape[2];
      t.a_group = t.in * r, t.a_row = r, t.a_col = 1;
      t.b_row = t.out_per_group, t.b_col = 1;
    } else {  // Keras (N, H, D) flattened to (N·H, D), or a dense (in, out): A (in, r), B (r, out)
      t.in = k.cols, t.out_per_group = k.rows;
      t.a_row = r, t.a_col = 1;
      t.b_row = k.rows, t.b_col = 1;
    }
    // This process' part: its input columns (a slice of A's rows) and output columns (whole groups,
    // or a slice of B's columns).
    const VariableSpec* spec = nullptr;
    for (const VariableSpec& v : specs)
      if (v.layer == ad.layer && v.slot == ad.slot) spec = &v;
    const MatrixWindow w = matrix_window(k.kind, plan.compute_region(*spec));
    int64_t a_offset = w.in0 * t.a_row, b_offset = 0;
    t.in = w.in_n;
    if (t.groups > 1) {
      check(w.out0 % t.out_per_group == 0 && w.out_n % t.out_per_group == 0, "attach_lora: ", ad.keras_path(whole),
            ": this process' rows are not whole heads");
      a_offset += w.out0 / t.out_per_group * t.a_group;
      t.groups = w.out_n / t.out_per_group;
    } else {
      b_offset = w.out0 * t.b_col;
      t.out_per_group = w.out_n;
    }
    t.device = at.device;
    t.a = at.a + a_offset;
    t.b = at.b + b_offset;
    if (at.grad_a) t.grad_a = at.grad_a + a_offset;
    if (at.grad_b) t.grad_b = at.grad_b + b_offset;
    *model.low_rank[size_t(ad.layer)].of(ad.slot) = t;
  }
}

}  // namespace

void attach_lora(GemmaModel& model, const LoraWeights& lora, LoraTensors& tensors, const GemmaConfig& whole,
                 const TensorParallelPlan& plan) {
  check(tensors.a.size() == lora.adapters.size(), "attach_lora: ", tensors.a.size(), " adapters' tensors for ",
        lora.adapters.size(), " adapters");
  std::vector<AdapterStorage> storage;
  for (size_t i = 0; i < tensors.a.size(); ++i)
    storage.push_back({tensors.a[i].data(), tensors.b[i].data(), tensors.grad_a[i].data(), tensors.grad_b[i].data(),
                       tensors.a[i].device()});
  attach_terms(model, lora, storage, whole, plan);
}

void attach_lora(GemmaModel& model, const LoraWeights& lora, const GemmaConfig& whole, const TensorParallelPlan& plan) {
  std::vector<AdapterStorage> storage;
  for (const LoraAdapter& ad : lora.adapters) storage.push_back({ad.a.data(), ad.b.data()});
  attach_terms(model, lora, storage, whole, plan);
}

void validate_lora(const GemmaConfig& config, const LoraWeights& lora, const std::string& source) {
  if (lora.adapters.empty()) return;
  check(lora.rank > 0, source, ": LoRA rank must be positive, got ", lora.rank);
  check(lora.alpha > 0, source, ": LoRA alpha must be positive, got ", lora.alpha);
  std::set<std::pair<int, int>> seen;
  for (const LoraAdapter& ad : lora.adapters) {
    check(ad.layer >= 0 && ad.layer < config.num_layers, source, ": LoRA adapter for layer ", ad.layer,
          ", but the model has ", config.num_layers, " layers");
    check(is_adaptable(ad.slot), source, ": decoder_block_", ad.layer, "/", slot_layer_name(ad.slot),
          " cannot carry a LoRA adapter (only query, key, value, attention_output and the FFW kernels)");
    const std::string name = ad.keras_path(config);
    check(seen.insert({ad.layer, int(ad.slot)}).second, source, ": two LoRA adapters for ", name);
    check(ad.rank > 0, source, ": ", name, ": LoRA rank must be positive, got ", ad.rank);
    const LoraKernel k = lora_kernel(config, ad.slot);
    Shape want_a, want_b;
    if (ad.style == LoraStyle::Keras) {
      want_a = Shape(k.keras_shape.begin(), k.keras_shape.end() - 1);
      want_a.push_back(ad.rank);
      want_b = {ad.rank, k.keras_shape.back()};
    } else {
      want_a = {ad.rank, k.cols};
      want_b = {k.rows, ad.rank};
    }
    const char* style = ad.style == LoraStyle::Keras ? "Keras-style" : "PEFT-style";
    check(ad.a_shape == want_a, source, ": ", name, "/lora_kernel_a has shape ", shape_str(ad.a_shape), ", but a ",
          style, " rank-", ad.rank, " adapter on this model needs ", shape_str(want_a));
    check(ad.b_shape == want_b, source, ": ", name, "/lora_kernel_b has shape ", shape_str(ad.b_shape), ", but a ",
          style, " rank-", ad.rank, " adapter on this model needs ", shape_str(want_b));
    check(int64_t(ad.a.size()) == num_elements(ad.a_shape) && int64_t(ad.b.size()) == num_elements(ad.b_shape),
          source, ": ", name, ": LoRA data size does not match its shape");
  }
}

}  // namespace meshtune
