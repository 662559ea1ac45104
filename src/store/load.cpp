#include "store/load.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/file_util.h"
#include "core/json.h"
#include "io/keras_h5.h"
#include "io/safetensors.h"
#include "core/weight_matrix.h"
#include "model/sharded_model.h"
#include "model/variables.h"

namespace meshtune {

namespace fs = std::filesystem;

std::string resolve_model_path(const std::string& model, const std::string& models_dir) {
  if (fs::is_directory(model)) return model;
  std::vector<std::string> searched;
  const bool bare_name = model.find('/') == std::string::npos;
  if (bare_name) {
    std::vector<std::string> roots;
    if (!models_dir.empty()) roots.push_back(models_dir);
    if (const char* env = std::getenv("MESHTUNE_MODELS")) {
      std::stringstream ss(env);
      for (std::string item; std::getline(ss, item, ':');)
        if (!item.empty()) roots.push_back(item);
    }
    for (const auto& root : roots) {
      fs::path candidate = fs::path(root) / model;
      if (fs::is_directory(candidate)) return candidate.string();
      searched.push_back(candidate.string());
    }
  }
  std::ostringstream msg;
  msg << "model '" << model << "' not found: it is not a directory";
  if (bare_name) {
    if (searched.empty()) msg << ", and no search path is set (use --models-dir DIR or MESHTUNE_MODELS=DIR1:DIR2)";
    else {
      msg << ", and the search path has no such directory; looked in:";
      for (const auto& s : searched) msg << "\n  " << s;
    }
  }
  fail_not_found(msg.str());
}

ModelDir inspect_model_dir(const std::string& dir) {
  ModelDir m;
  m.path = dir;
  m.config_path = (fs::path(dir) / "config.json").string();
  check(fs::is_directory(dir), dir, ": not a directory");
  check(fs::exists(m.config_path), dir, ": no config.json (expected a Keras preset or a Hugging Face checkpoint)");
  json config = read_json_file(m.config_path);
  const bool has_h5 = fs::exists(fs::path(dir) / "model.weights.h5") || fs::exists(fs::path(dir) / "model.weights.json");
  const bool has_st = fs::exists(fs::path(dir) / "model.safetensors") ||
                      fs::exists(fs::path(dir) / "model.safetensors.index.json");
  check(config.is_object(), m.config_path, ": not a JSON object");
  if (config.contains("class_name")) {
    m.format = ModelFormat::Keras;
    check(has_h5, dir, ": Keras preset without model.weights.h5 or model.weights.json");
    m.tokenizer_path = (fs::path(dir) / "assets/tokenizer/vocabulary.spm").string();
    fs::path pre = fs::path(dir) / "preprocessor.json";
    if (fs::exists(pre)) {
      const json p = read_json_file(pre.string());
      const JsonValue preprocessor(p, pre.string());
      if (preprocessor.is_object())
        if (auto c = preprocessor.find("config"); c && c->is_object())
          m.sequence_length = int(c->integer_or("sequence_length", m.sequence_length, 1, kMaxPositions));
    }
  } else if (config.contains("model_type")) {
    m.format = ModelFormat::HuggingFace;
    check(has_st, dir, ": Hugging Face checkpoint without model.safetensors or model.safetensors.index.json");
    m.tokenizer_path = (fs::path(dir) / "tokenizer.model").string();
  } else {
    fail(m.config_path, ": neither a Keras config (class_name) nor a Hugging Face config (model_type)");
  }
  if (!fs::exists(m.tokenizer_path)) m.tokenizer_path.clear();
  return m;
}

// Converts a loaded tensor into a weight matrix, in place when it is already fp32/bf16, aligned,
// and in our layout; otherwise into a fresh buffer.
static WeightMatrix to_matrix(const HostTensor& t, bool keep_bf16) {
  WeightMatrix m;
  m.rows = t.shape[0];
  m.cols = num_elements(t.shape) / std::max<int64_t>(1, t.shape[0]);
  const bool aligned = reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) == 0;
  const bool keep_as_is = t.dtype == DType::F32 || (t.dtype == DType::BF16 && keep_bf16);
  if (keep_as_is && aligned) {  // zero copy: alias the file's buffer or memory map
    m.dtype = t.dtype;
    m.data = t.data;
    m.owner = t.owner;
    m.mapped = t.mapped;
  } else if (keep_as_is) {  // misaligned: copy the bytes as they are
    HostTensor copy = HostTensor::allocate(t.dtype, t.shape);
    std::memcpy(copy.mutable_as<std::byte>(), t.data, t.nbytes());
    m.dtype = t.dtype;
    m.data = copy.data;
    m.owner = copy.owner;
  } else {  // f16, or bf16 when fp32 was asked for: widen
    auto values = std::make_shared<std::vector<float>>(to_f32(t));
    m.dtype = DType::F32;
    m.data = values->data();
    m.owner = values;
  }
  return m;
}

static bool is_float_dtype(DType d) { return d == DType::F32 || d == DType::BF16 || d == DType::F16; }

GemmaConfig read_model_config(const ModelDir& dir) {
  json config = read_json_file(dir.config_path);
  return dir.format == ModelFormat::Keras ? GemmaConfig::from_keras_json(config, dir.config_path)
                                          : GemmaConfig::from_hf_json(config, dir.config_path);
}

// An int8 layer's kernel codes (already in our layout) and the scale dataset beside them, checked
// against the shapes Keras writes (int8.md §2).
using TakeTensor = std::function<std::optional<HostTensor>(const std::string& name)>;

static WeightMatrix int8_matrix(const HostTensor& codes, const VariableSpec& spec, const TakeTensor& take,
                                const std::string& weights_file, const std::optional<ShardSpec>& block) {
  const std::string scale_name = keras_int8_scale_path(spec);
  std::optional<HostTensor> taken = take(scale_name);
  check(taken.has_value(), weights_file, ": missing tensor ", scale_name, " (the int8 scale of ", keras_layer(spec),
        ")");
  const HostTensor scale = std::move(*taken);
  check(scale.dtype == DType::F32, weights_file, ": tensor ", scale_name, " (int8 scale of ", keras_layer(spec),
        ") has dtype ", dtype_name(scale.dtype), ", expected float32");
  check(scale.shape == keras_int8_scale_shape(spec), weights_file, ": tensor ", scale_name, " (int8 scale of ",
        keras_layer(spec), ") has shape ", shape_str(scale.shape), ", expected ", shape_str(keras_int8_scale_shape(spec)));
  check_int8_columns(num_elements(codes.shape) / std::max<int64_t>(1, codes.shape[0]), weights_file + ": " + keras_layer(spec));
  // Keras' broadcast scale shapes flatten to our row order; a block (sharded loading) takes its rows'.
  std::vector<float> scales(static_cast<size_t>(num_elements(scale.shape)));
  std::memcpy(scales.data(), scale.data, scales.size() * sizeof(float));
  // A code is divided by its scale (127 / max|w|, so at most ~1.3e9 and never near the smallest
  // floats): a NaN, infinite, zero, negative or denormal scale gives silently wrong numbers.
  for (size_t i = 0; i < scales.size(); ++i)
    check(std::isfinite(scales[i]) && scales[i] >= std::numeric_limits<float>::min(), weights_file, ": tensor ",
          scale_name, " (int8 scale of ", keras_layer(spec), ") holds ", scales[i], " at index ", i,
          "; a scale must be a finite positive (normal) float");
  if (block) scales = block_scales(scales.data(), spec, *block);
  struct Storage {
    HostTensor codes;
    std::vector<float> scales;
  };
  auto storage = std::make_shared<Storage>(Storage{codes, std::move(scales)});
  WeightMatrix m;
  m.rows = codes.shape[0];
  m.cols = num_elements(codes.shape) / std::max<int64_t>(1, codes.shape[0]);
  m.dtype = DType::I8;
  m.data = codes.data;
  m.scales = storage->scales.data();
  m.owner = storage;
  return m;
}

// A float matrix quantized to int8 as it loads. A block (sharded loading) gets the whole rows'
// maxima, so its codes and scales are those of the whole matrix.
static WeightMatrix quantized_matrix(const WeightMatrix& w, const VariableSpec& spec, const std::optional<ShardSpec>& block,
                                     const LoadOptions& options) {
  if (!block) return quantize_matrix_int8(w);
  std::vector<float> row_max = matrix_row_abs_max(w);
  if (options.combine_row_max) options.combine_row_max(spec, *block, row_max.data());
  return quantize_matrix_int8(w, row_max.data());
}

GemmaModel load_model(const ModelDir& dir, const LoadOptions& options) {
  const bool keep_bf16 = options.keep_bf16;
  GemmaModel model;
  const bool keras = dir.format == ModelFormat::Keras;
  model.config = read_model_config(dir);
  // Sharded loading: the blocks of the variables this process holds only a block of, and for a
  // Keras preset their boxes in the file (the variable's Keras dimensions).
  std::map<std::string, ShardSpec> blocks;
  std::map<std::string, DatasetBox> boxes;
  if (options.block_of)
    for (const VariableSpec& spec : gemma_variables(model.config)) {
      const std::optional<ShardSpec> block = options.block_of(spec);
      if (!block) continue;
      blocks[spec.h5_path] = *block;
      if (!keras) continue;
      DatasetBox& box = boxes[spec.h5_path];
      for (int d : our_dimensions(spec.kind)) {
        box.start.push_back(block->offset[size_t(d)]);
        box.count.push_back(block->local[size_t(d)]);
      }
    }
  DatasetSelection select;
  if (!boxes.empty())
    select = [&boxes](const std::string& name, const Shape& shape) -> std::optional<DatasetBox> {
      auto it = boxes.find(name);
      if (it == boxes.end() || it->second.count.size() != shape.size()) return std::nullopt;  // shape errors below
      return it->second;
    };
  // Each tensor is taken once. A Keras preset's datasets are read only then, one at a time, so the
  // loader holds a single unconverted tensor besides the model; safetensors are memory-mapped.
  std::optional<KerasWeightsReader> reader;
  std::map<std::string, HostTensor> tensors;
  if (keras) reader.emplace(dir.path);
  else tensors = read_safetensors_dir(dir.path);
  const TakeTensor take = [&](const std::string& name) -> std::optional<HostTensor> {
    if (reader) return reader->has(name) ? std::optional<HostTensor>(reader->read(name, select)) : std::nullopt;
    auto it = tensors.find(name);
    if (it == tensors.end()) return std::nullopt;
    HostTensor t = it->second;
    tensors.erase(it);
    return t;
  };
  const std::string weights_file =
      keras ? (fs::path(dir.path) / (fs::exists(fs::path(dir.path) / "model.weights.json") ? "model.weights.json" : "model.weights.h5")).string()
            : (fs::path(dir.path) / (fs::exists(fs::path(dir.path) / "model.safetensors.index.json") ? "model.safetensors.index.json" : "model.safetensors")).string();

  // Gemma 3 multimodal HF repos prefix the text model's names.
  if (!keras && !tensors.count("model.embed_tokens.weight")) {
    for (const std::string prefix : {"model.language_model.", "language_model.model."}) {
      if (!tensors.count(prefix + "embed_tokens.weight")) continue;
      std::map<std::string, HostTensor> renamed;
      for (auto& [name, t] : tensors)
        if (name.rfind(prefix, 0) == 0) renamed["model." + name.substr(prefix.size())] = t;
      tensors = std::move(renamed);
      break;
    }
  }

  const GemmaConfig& c = model.config;
  model.layers.resize(size_t(c.num_layers));
  std::set<std::string> int8_layers = c.int8_layers;
  for (const VariableSpec& spec : gemma_variables(c)) {
    const std::string& name = keras ? spec.h5_path : spec.hf_name;
    std::optional<HostTensor> taken = take(name);
    check(taken.has_value(), weights_file, ": missing tensor ", name, " (", spec.keras_path, ")");
    HostTensor t = std::move(*taken);  // freed once converted: a model loads in little more than its size
    const auto box = boxes.find(name);
    const Shape& expected = box != boxes.end() ? Shape(box->second.count.begin(), box->second.count.end())
                            : keras          ? spec.keras_shape
                                             : spec.hf_shape;
    check(t.shape == expected, weights_file, ": tensor ", name, " has shape ", shape_str(t.shape), ", but ",
          dir.config_path, " implies ", shape_str(expected));
    WeightMatrix* w = model.matrix(spec.slot, spec.layer);
    const auto found = blocks.find(spec.h5_path);
    const std::optional<ShardSpec> block = found != blocks.end() ? std::optional<ShardSpec>(found->second) : std::nullopt;
    if (w && int8_layers.erase(keras_layer(spec))) {
      check(t.dtype == DType::I8, weights_file, ": tensor ", name, " has dtype ", dtype_name(t.dtype), ", but ",
            dir.config_path, "'s dtype policy map makes ", keras_layer(spec), " int8");
      *w = int8_matrix(keras_to_ours(t, spec.kind), spec, take, weights_file, keras ? block : std::nullopt);
      continue;
    }
    check(is_float_dtype(t.dtype), weights_file, ": tensor ", name, " has dtype ", dtype_name(t.dtype),
          ", expected a floating-point type", t.dtype == DType::I8 ? " (int8 needs a dtype policy map in config.json)" : "");
    std::optional<WeightMatrix> quantized;  // a whole Keras kernel: permuted band by band into the quantizer
    if (w && keras && options.quantize_int8 && !block) quantized = keras_kernel_to_int8(t, spec.kind);
    if (keras && !quantized) t = keras_to_ours(t, spec.kind);
    if (quantized) {
      *w = std::move(*quantized);
    } else if (!w) {
      *model.vector(spec.slot, spec.layer) = to_f32(t);
    } else if (options.quantize_int8 || options.bf16_matrices) {
      // Converted as it loads; a block of a memory-mapped tensor is cut out first (a Keras block
      // already is the block), so no process holds a converted copy of more than its part.
      WeightMatrix stored = to_matrix(t, /*keep_bf16=*/true);
      if (block && !keras) stored = matrix_block(stored, spec, *block);
      *w = options.quantize_int8 ? quantized_matrix(stored, spec, block, options) : to_bf16_matrix(stored);
    } else {
      *w = to_matrix(t, keep_bf16);
    }
    if (t.mapped && w && w->data != t.data) release_mapped_pages(t.data, t.nbytes());  // converted: the map's pages go
  }
  check(int8_layers.empty(), dir.config_path, ": the dtype policy map names layer ",
        int8_layers.empty() ? "" : *int8_layers.begin(), ", which has no matrix in this model");
  return model;
}

}  // namespace meshtune
