#include "store/save.h"

#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/file_util.h"
#include "io/keras_h5.h"
#include "io/safetensors.h"
#include "model/variables.h"

namespace meshtune {

namespace fs = std::filesystem;
using json = nlohmann::json;

// A model variable as a HostTensor in our (= HF) layout, aliasing the model's memory.
static HostTensor variable_tensor(const GemmaModel& model, const VariableSpec& spec) {
  auto from_matrix = [&](const WeightMatrix& m) {
    HostTensor t;
    t.dtype = m.dtype;
    t.shape = spec.hf_shape;
    t.data = static_cast<const std::byte*>(m.data);
    t.owner = m.owner;
    return t;
  };
  auto from_vector = [&](const WeightVector& v) {
    HostTensor t;
    t.dtype = DType::F32;
    t.shape = spec.hf_shape;
    t.data = reinterpret_cast<const std::byte*>(v.data());
    return t;  // the model outlives the save call
  };
  if (const WeightMatrix* w = model.matrix(spec.slot, spec.layer)) return from_matrix(*w);
  return from_vector(*model.vector(spec.slot, spec.layer));
}

static json dtype_policy(const std::string& name) {
  return {{"module", "keras"}, {"class_name", "DTypePolicy"}, {"config", {{"name", name}}}, {"registered_name", nullptr}};
}

// The per-row scales of an int8 matrix, aliasing the model's memory.
static HostTensor int8_scales(const GemmaModel& model, const VariableSpec& spec) {
  const WeightMatrix& m = *model.matrix(spec.slot, spec.layer);
  HostTensor t;
  t.dtype = DType::F32;
  t.shape = {m.rows};
  t.data = reinterpret_cast<const std::byte*>(m.scales);
  t.owner = m.owner;
  return t;
}

// The source reading a model in memory (aliasing it: nothing is copied).
static VariableSource model_variables(const GemmaModel& model) {
  return {[&model](const VariableSpec& spec) { return variable_tensor(model, spec).dtype; },
          [&model](const VariableSpec& spec) { return variable_tensor(model, spec); },
          [&model](const VariableSpec& spec) { return int8_scales(model, spec); }};
}

// Keras' DTypePolicyMap after quantize("int8"): one QuantizedDTypePolicy per int8 layer; the
// others follow the global policy (float32).
static json int8_policy_map(const std::vector<VariableSpec>& specs, const VariableSource& variables) {
  json policy_map = json::object();
  for (const VariableSpec& spec : specs)
    if (variables.dtype(spec) == DType::I8)
      policy_map[keras_layer(spec)] = {{"module", "keras.dtype_policies"}, {"class_name", "QuantizedDTypePolicy"},
                                       {"config", {{"mode", "int8"}, {"source_name", nullptr}}},
                                       {"registered_name", nullptr}};
  if (policy_map.empty()) return nullptr;
  return {{"module", "keras.dtype_policies"}, {"class_name", "DTypePolicyMap"},
          {"config", {{"default_policy", nullptr}, {"policy_map", policy_map}}}, {"registered_name", nullptr}};
}

// The dtype config.json declares: the embedding's, the first variable (see save.h).
static std::string declared_dtype(const std::vector<VariableSpec>& specs, const VariableSource& variables) {
  return dtype_name(variables.dtype(specs.front()));
}

void save_keras_preset(const GemmaConfig& c, const VariableSource& variables, const std::string& tokenizer_path,
                       int sequence_length, const std::string& out_dir) {
  fs::create_directories(fs::path(out_dir) / "assets" / "tokenizer");
  const std::vector<VariableSpec> specs = gemma_variables(c);
  std::vector<TensorSpec> datasets;
  std::vector<std::function<HostTensor()>> makers;  // dataset i's tensor in Keras layout
  for (const VariableSpec& spec : specs) {
    datasets.push_back({spec.h5_path, variables.dtype(spec), spec.keras_shape});
    makers.push_back([&variables, &spec] { return ours_to_keras(variables.tensor(spec), spec.kind, spec.keras_shape); });
    if (variables.dtype(spec) != DType::I8) continue;
    datasets.push_back({keras_int8_scale_path(spec), DType::F32, keras_int8_scale_shape(spec)});
    makers.push_back([&variables, &spec] {
      HostTensor t = variables.scales(spec);  // [rows] in our row order = Keras' flattened broadcast shape
      t.shape = keras_int8_scale_shape(spec);
      return t;
    });
  }
  write_h5_datasets((fs::path(out_dir) / "model.weights.h5").string(), datasets, [&](size_t i) { return makers[i](); });

  const json policy_map = int8_policy_map(specs, variables);
  json backbone = c.to_keras_json(policy_map.is_null() ? declared_dtype(specs, variables) : "float32");
  if (!policy_map.is_null()) backbone["config"]["dtype"] = policy_map;
  int64_t parameter_count = c.num_parameters();  // Keras counts the int8 scales too
  for (const VariableSpec& spec : specs)
    if (variables.dtype(spec) == DType::I8) parameter_count += spec.hf_shape[0];
  const std::string prefix = c.names().keras_prefix, cap = c.names().keras_class;
  json tokenizer = {{"module", "keras_hub.src.models." + prefix + "." + prefix + "_tokenizer"},
                    {"class_name", cap + "Tokenizer"},
                    {"config", {{"name", prefix + "_tokenizer"}, {"trainable", true}, {"dtype", dtype_policy("int32")},
                                {"config_file", "tokenizer.json"}, {"proto", nullptr}, {"sequence_length", nullptr},
                                {"add_bos", false}, {"add_eos", false}}},
                    {"registered_name", "keras_hub>" + cap + "Tokenizer"}};
  json preprocessor = {{"module", "keras_hub.src.models." + prefix + "." + prefix + "_causal_lm_preprocessor"},
                       {"class_name", cap + "CausalLMPreprocessor"},
                       {"config", {{"name", prefix + "_causal_lm_preprocessor"}, {"trainable", true},
                                   {"dtype", dtype_policy("float32")}, {"tokenizer", tokenizer},
                                   {"config_file", "preprocessor.json"}, {"sequence_length", sequence_length},
                                   {"add_start_token", true}, {"add_end_token", true}}},
                       {"registered_name", "keras_hub>" + cap + "CausalLMPreprocessor"}};
  if (c.names().keras_vision_fields) {
    // A text-only Gemma 3, as KerasHub's get_config writes it: without has_vision_tokens=false,
    // Gemma3Tokenizer looks for <img> and friends in the vocabulary and fails to load.
    tokenizer["config"]["has_vision_tokens"] = false;
    preprocessor["config"]["tokenizer"] = tokenizer;
    preprocessor["config"]["num_vision_tokens_per_image"] = 256;
    preprocessor["config"]["max_images_per_prompt"] = 2;
  }
  json task = {{"module", "keras_hub.src.models." + prefix + "." + prefix + "_causal_lm"},
               {"class_name", cap + "CausalLM"},
               {"config", {{"backbone", backbone}, {"preprocessor", preprocessor}, {"name", prefix + "_causal_lm"}}},
               {"registered_name", "keras_hub>" + cap + "CausalLM"}};
  std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d@%H:%M:%S", std::gmtime(&now));
  json metadata = {{"keras_version", "3.15.1"}, {"keras_hub_version", "0.31.1"},
                   {"parameter_count", parameter_count}, {"date_saved", date}, {"tasks", {"CausalLM"}},
                   {"saved_by", "meshtune"}};
  write_file_atomic((fs::path(out_dir) / "config.json").string(), backbone.dump(4));
  write_file_atomic((fs::path(out_dir) / "tokenizer.json").string(), tokenizer.dump(4));
  write_file_atomic((fs::path(out_dir) / "preprocessor.json").string(), preprocessor.dump(4));
  write_file_atomic((fs::path(out_dir) / "task.json").string(), task.dump(4));
  write_file_atomic((fs::path(out_dir) / "metadata.json").string(), metadata.dump(4));
  if (!tokenizer_path.empty())
    copy_file_atomic(tokenizer_path, (fs::path(out_dir) / "assets" / "tokenizer" / "vocabulary.spm").string());
}

void save_hf_checkpoint(const GemmaConfig& c, const VariableSource& variables, const std::string& tokenizer_path,
                        const std::string& out_dir) {
  const std::vector<VariableSpec> specs = gemma_variables(c);
  for (const VariableSpec& spec : specs)
    check(variables.dtype(spec) != DType::I8, out_dir, ": a Hugging Face checkpoint has no int8 form (",
          spec.keras_path, " is int8); export --to keras, or load without --quantize");
  fs::create_directories(out_dir);
  std::vector<TensorSpec> tensors;
  for (const VariableSpec& spec : specs) tensors.push_back({spec.hf_name, variables.dtype(spec), spec.hf_shape});
  write_safetensors((fs::path(out_dir) / "model.safetensors").string(), tensors,
                    [&](size_t i) { return variables.tensor(specs[i]); }, {{"format", "pt"}});
  write_file_atomic((fs::path(out_dir) / "config.json").string(), c.to_hf_json(declared_dtype(specs, variables)).dump(2));
  json tokenizer_config = {{"tokenizer_class", "GemmaTokenizer"}, {"bos_token", "<bos>"}, {"eos_token", "<eos>"},
                           {"pad_token", "<pad>"}, {"unk_token", "<unk>"}, {"add_bos_token", true},
                           {"add_eos_token", false}};
  write_file_atomic((fs::path(out_dir) / "tokenizer_config.json").string(), tokenizer_config.dump(2));
  if (!tokenizer_path.empty()) copy_file_atomic(tokenizer_path, (fs::path(out_dir) / "tokenizer.model").string());
}

void save_keras_preset(const GemmaModel& model, const std::string& tokenizer_path, int sequence_length,
                       const std::string& out_dir) {
  save_keras_preset(model.config, model_variables(model), tokenizer_path, sequence_length, out_dir);
}

void save_hf_checkpoint(const GemmaModel& model, const std::string& tokenizer_path, const std::string& out_dir) {
  save_hf_checkpoint(model.config, model_variables(model), tokenizer_path, out_dir);
}

}  // namespace meshtune
