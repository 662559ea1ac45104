#include "cli/commands.h"

namespace meshtune::cli {

void ModelOptions::add_to(CLI::App& app, bool with_lora, bool required) {
  app.add_option("model", model, "Model directory (Keras preset or Hugging Face checkpoint) or a preset name")
      ->required(required);
  app.add_option("--models-dir", models_dir, "Where to look for preset names (also: MESHTUNE_MODELS=DIR1:DIR2)");
  if (with_lora)
    app.add_option("--lora", lora, "Merge this LoRA adapter (Keras .lora.h5 or a PEFT directory) into the model");
  app.add_flag("--fp32-weights", fp32_weights, "Widen bf16-stored weights to fp32 at load (default: keep bf16)");
  app.add_option("--quantize", quantize,
                 "Quantize the weights at load as Keras' model.quantize(MODE) does; MODE: int8")
      ->check(CLI::IsMember({"int8"}));
  app.add_option("--device", device,
                 "Where to compute: cpu (default) or cuda (an NVIDIA GPU; under mpirun, the GPU of each process' "
                 "local rank)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
}

void ModelOptions::add_dtype_policy(CLI::App& app) {
  app.add_option("--dtype-policy", dtype_policy,
                 "Keras' dtype policy: float32 (default), mixed_bfloat16 (fp32 variables, bf16 matmul inputs with fp32 "
                 "sums; norms, RoPE, softmax and the loss in fp32) or bfloat16 (bf16 weights, for inference)")
      ->check(CLI::IsMember({"float32", "mixed_bfloat16", "bfloat16"}));
}

api::PresetOptions ModelOptions::preset() const {
  api::PresetOptions p;
  p.models_dir = models_dir;
  p.dtype_policy = dtype_policy;
  p.quantize = quantize;
  p.fp32_weights = fp32_weights;
  p.lora = lora;
  p.backend = device;
  return p;
}

api::GemmaCausalLM ModelOptions::load(bool need_tokenizer) const {
  api::PresetOptions p = preset();
  p.need_tokenizer = need_tokenizer;
  return api::GemmaCausalLM::from_preset(model, p);
}

}  // namespace meshtune::cli
