// LoRA as KerasHub does it (spec §7), plus PEFT-style adapters for interchange:
//   Keras style: A = kernel[:-1]+(r,) (per head for attention kernels), B = (r, kernel[-1]);
//                ΔK = A·B over the flattened Keras kernel [prod(kernel[:-1]), last], scale = alpha/r.
//   PEFT style:  A [r, in], B [out, r] in HF's [out, in] layout, ΔW = scale·B·A.
// The effective kernel is W + scale·ΔW (Keras' `kernel` property). Base weights stay frozen.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/gemma.h"
#include "model/tensor_parallel.h"
#include "model/variables.h"

namespace meshtune {

enum class LoraStyle { Keras, Peft };

// The seven matrices of a decoder block that can carry an adapter, in Slot order.
inline constexpr std::array<Slot, 7> kLoraSlots = {Slot::Query,     Slot::Key,        Slot::Value,    Slot::AttentionOutput,
                                                   Slot::FfwGating, Slot::FfwGating2, Slot::FfwLinear};

// What an adapted kernel looks like: its Keras shape and layout kind, and our [rows = out, cols = in].
struct LoraKernel {
  Shape keras_shape;
  VarKind kind = VarKind::Dense;
  int64_t rows = 0, cols = 0;
};
// Throws Error for a slot that cannot carry an adapter, or a model without layers.
LoraKernel lora_kernel(const GemmaConfig& config, Slot slot);

struct LoraAdapter {
  int layer = 0;
  Slot slot = Slot::Query;  // one of Query, Key, Value, AttentionOutput, FfwGating, FfwGating2, FfwLinear
  LoraStyle style = LoraStyle::Keras;
  int rank = 0;
  Shape a_shape, b_shape;   // Keras: kernel[:-1]+(r,), (r, last); PEFT: (r, in), (out, r)
  std::vector<float> a, b;  // row-major, fp32, host memory (the form files are read and written in)
  std::string keras_path(const GemmaConfig& config) const;  // ".../attention/query" (no /lora_kernel_a)
};

struct LoraWeights {
  int rank = 0;
  double alpha = 0;  // scale = alpha / rank (Keras: alpha = rank → 1)
  std::vector<LoraAdapter> adapters;
  double scale() const { return alpha / rank; }
  long long num_parameters() const;
};

// Target names (Keras layer names): query, key, value, attention_output, ffw_gating, ffw_gating_2,
// ffw_linear; "all" = every one of them. Throws Error for an unknown name.
std::vector<Slot> parse_lora_targets(const std::vector<std::string>& names);
const char* slot_layer_name(Slot slot);  // "query", "ffw_gating_2", …

// backbone.enable_lora(rank): Keras-style adapters on `targets` of every layer, A ~ he_uniform
// (U(±√(6/fan_in)), fan_in = prod(kernel[:-1])), B = 0, alpha = rank unless given (> 0).
LoraWeights enable_lora(const GemmaConfig& config, int rank, const std::vector<Slot>& targets, uint64_t seed,
                        double alpha = 0);

// ΔW = scale·(A·B) of one adapter in our [out, in] layout (rows × cols of the base matrix).
std::vector<float> lora_delta(const GemmaConfig& config, const LoraAdapter& adapter, double scale);

// A copy of `base` whose adapted matrices are replaced by fp32 W + ΔW (other matrices are shared,
// not copied); an int8 W is dequantized, merged and quantized again, as Keras' save_weights does. This is what generation with an adapter, export (merge) and training use. When
// `base` builds its blocks on demand (layer_source), so does the result, merging as it builds.
GemmaModel merge_lora(const GemmaModel& base, const LoraWeights& lora);
// The same when `base` holds only this process' part of each matrix (tensor parallelism): `config`
// is the whole model's, and `part` cuts that part out of a whole ΔW (our layout).
using LoraDeltaPart = std::function<std::vector<float>(const LoraAdapter& adapter, const std::vector<float>& delta)>;
GemmaModel merge_lora(const GemmaModel& base, const LoraWeights& lora, const GemmaConfig& config,
                      const LoraDeltaPart& part);

// Training's form of the adapters: A, B and their gradients in a backend's memory, one of each per
// adapter of a LoraWeights (same order), made once per run; the optimizer updates A and B there.
struct LoraTensors {
  std::vector<FloatBuffer> a, b, grad_a, grad_b;
  LoraTensors() = default;
  LoraTensors(Backend& backend, const LoraWeights& lora);  // A and B uploaded, gradients zero
  // The current A and B back into `lora`'s host copies (for saving, merging, checkpoints).
  void download(Backend& backend, LoraWeights& lora) const;
};

// Every adapter becomes the low-rank term of its block in `model` (y = x·Wᵀ + scale·(x·A)·B; W is
// neither copied nor differentiated). `whole` is the whole model's config; under an active
// tensor-parallel `plan`, `model` holds this process' part of every matrix and each term covers the
// same part (a slice of A or B, no copy). With `tensors` the terms read A and B there and backward
// adds into their gradients (training); without, they read `lora`'s host values and are frozen
// (inference over an int8 base). What the terms point to must outlive `model`'s use of them.
void attach_lora(GemmaModel& model, const LoraWeights& lora, LoraTensors& tensors, const GemmaConfig& whole,
                 const TensorParallelPlan& plan = {});
void attach_lora(GemmaModel& model, const LoraWeights& lora, const GemmaConfig& whole,
                 const TensorParallelPlan& plan = {});

// Checks that adapters fit the model (layer index, shapes); throws Error naming `source`.
void validate_lora(const GemmaConfig& config, const LoraWeights& lora, const std::string& source);

}  // namespace meshtune
