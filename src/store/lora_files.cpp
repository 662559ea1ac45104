#include "store/lora_files.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>

#include "core/error.h"
#include "core/file_util.h"
#include "core/json.h"
#include "core/user_regex.h"
#include "io/keras_h5.h"
#include "io/safetensors.h"

namespace meshtune {

namespace fs = std::filesystem;
namespace {

constexpr int kMaxPeftRank = 1 << 20;

Shape keras_a_shape(const LoraKernel& k, int64_t rank) {
  Shape s(k.keras_shape.begin(), k.keras_shape.end() - 1);
  s.push_back(rank);
  return s;
}

HostTensor f32_tensor(const std::vector<float>& v, const Shape& shape) {
  HostTensor t = HostTensor::allocate(DType::F32, shape);
  std::memcpy(t.mutable_as<float>(), v.data(), t.nbytes());
  return t;
}

bool is_float(DType d) { return d == DType::F32 || d == DType::BF16 || d == DType::F16; }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool nearly_equal(double a, double b) { return std::fabs(a - b) <= 1e-12 * std::max(std::fabs(a), std::fabs(b)); }

// A PEFT number: an integer when it is one (PEFT writes ints for r and usually for lora_alpha).
json peft_number(double x) {
  const double r = std::round(x);
  if (std::fabs(x - r) <= 1e-9 * std::max(1.0, std::fabs(x))) return (long long)r;
  return x;
}

// Adapters read from `path`, checked against the model.
LoraWeights checked(LoraWeights w, const GemmaConfig& config, const std::string& path) {
  check(!w.adapters.empty(), path, ": no LoRA adapters in the file");
  validate_lora(config, w, path);
  return w;
}

// HF module names of the adaptable slots.
const char* hf_module(Slot slot) {
  switch (slot) {
    case Slot::Query: return "self_attn.q_proj";
    case Slot::Key: return "self_attn.k_proj";
    case Slot::Value: return "self_attn.v_proj";
    case Slot::AttentionOutput: return "self_attn.o_proj";
    case Slot::FfwGating: return "mlp.gate_proj";
    case Slot::FfwGating2: return "mlp.up_proj";
    case Slot::FfwLinear: return "mlp.down_proj";
    default: fail("LoRA: ", slot_layer_name(slot), " has no PEFT module");
  }
}

std::string short_module(Slot slot) {
  std::string m = hf_module(slot);
  return m.substr(m.find('.') + 1);  // "q_proj"
}

// One adapter in PEFT form: ΔW = (alpha/rank)·B·A with A [rank, in], B [out, rank].
struct PeftFactors {
  int rank = 0;
  double alpha = 0;
  std::vector<float> a, b;
  Shape a_shape, b_shape;
};

// Writes a Keras-style adapter exactly as PEFT factors (all three cases are exact, no SVD):
// - query/key/value, Keras (heads, D, H), B shared by heads: r' = heads·r,
//   A'[(n,j), d] = A[n,d,j], B'[n·H+h, (n,j)] = B[j,h] (block diagonal).
// - attention_output, Keras (N, H, D): our layout (D, N·H) is the flattened Keras kernel
//   transposed, so ΔW = Bᵀ·A_flatᵀ: A' = A_flatᵀ [r, N·H], B' = Bᵀ [D, r].
// - FFW kernels, Keras (in, out): likewise ΔW = Bᵀ·Aᵀ: A' = Aᵀ [r, in], B' = Bᵀ [out, r].
PeftFactors to_peft(const GemmaConfig& config, const LoraAdapter& ad, double scale) {
  PeftFactors f;
  if (ad.style == LoraStyle::Peft) {
    f.rank = ad.rank;
    f.a = ad.a;
    f.b = ad.b;
    f.a_shape = ad.a_shape;
    f.b_shape = ad.b_shape;
  } else {
    const LoraKernel k = lora_kernel(config, ad.slot);
    const int64_t r = ad.rank;
    if (k.kind == VarKind::HeadsIn) {
      const int64_t heads = k.keras_shape[0], D = k.keras_shape[1], H = k.keras_shape[2];
      f.rank = int(heads * r);
      f.a_shape = {heads * r, D};
      f.b_shape = {heads * H, heads * r};
      f.a.assign(size_t(heads * r * D), 0.f);
      f.b.assign(size_t(heads * H * heads * r), 0.f);
      for (int64_t n = 0; n < heads; ++n)
        for (int64_t d = 0; d < D; ++d)
          for (int64_t j = 0; j < r; ++j) f.a[size_t((n * r + j) * D + d)] = ad.a[size_t((n * D + d) * r + j)];
      for (int64_t n = 0; n < heads; ++n)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t j = 0; j < r; ++j) f.b[size_t((n * H + h) * heads * r + n * r + j)] = ad.b[size_t(j * H + h)];
    } else {  // HeadsOut or Dense: A_flat [P, r], B [r, last] → A' = A_flatᵀ, B' = Bᵀ
      const int64_t P = k.cols, last = k.rows;
      f.rank = int(r);
      f.a_shape = {r, P};
      f.b_shape = {last, r};
      f.a.resize(size_t(r * P));
      f.b.resize(size_t(last * r));
      for (int64_t p = 0; p < P; ++p)
        for (int64_t j = 0; j < r; ++j) f.a[size_t(j * P + p)] = ad.a[size_t(p * r + j)];
      for (int64_t j = 0; j < r; ++j)
        for (int64_t o = 0; o < last; ++o) f.b[size_t(o * r + j)] = ad.b[size_t(j * last + o)];
    }
  }
  f.alpha = scale * f.rank;  // PEFT's scale alpha/r' must equal ours
  return f;
}

// PEFT's rank_pattern / alpha_pattern: each key is a regex matched against a module name as
// (.*\.)?(key)$ (PEFT's get_pattern_key); an exact name wins over a regex. Compiled once (RE2).
struct ModulePatterns {
  std::vector<std::pair<UserRegex, JsonValue>> rules;
  std::map<std::string, JsonValue> exact;

  ModulePatterns(const JsonValue& config, const std::string& field) {
    auto patterns = config.find(field);
    if (!patterns) return;
    if (!patterns->is_object()) patterns->fail("must be an object {module regex: value}");
    for (const auto& [key, value] : patterns->members()) {
      exact.emplace(key, value);
      rules.emplace_back(UserRegex("(.*\\.)?(" + key + ")", value.where() + " (key of " + field + ")"), value);
    }
  }
  std::optional<JsonValue> find(const std::string& module) const {
    if (auto it = exact.find(module); it != exact.end()) return it->second;
    for (const auto& [regex, value] : rules)
      if (regex.full_match(module)) return value;
    return std::nullopt;
  }
};

// Reads the decimal digits at s[pos…] (at most 8, so no overflow); returns false if there are none.
bool read_index(const std::string& s, size_t& pos, int& out) {
  const size_t begin = pos;
  out = 0;
  while (pos < s.size() && pos - begin < 9 && s[pos] >= '0' && s[pos] <= '9') out = out * 10 + (s[pos++] - '0');
  return pos > begin && pos - begin < 9;
}

bool starts_with(const std::string& s, size_t pos, const std::string& prefix) { return s.compare(pos, prefix.size(), prefix) == 0; }

// "lora/<idx>/vars/lora_kernel_a|b" → (idx, 'a'|'b').
bool parse_keras_lora_name(const std::string& name, int& index, char& which) {
  size_t pos = 5;
  if (!starts_with(name, 0, "lora/") || !read_index(name, pos, index)) return false;
  if (!starts_with(name, pos, "/vars/lora_kernel_") || name.size() != pos + 19) return false;
  which = name.back();
  return which == 'a' || which == 'b';
}

// "base_model.model.model.layers.<i>.<module>.lora_A|lora_B.weight" → (i, module, 'A'|'B').
bool parse_peft_name(const std::string& name, int& layer, std::string& module, char& which) {
  const std::string prefix = "base_model.model.model.layers.", suffix_a = ".lora_A.weight", suffix_b = ".lora_B.weight";
  size_t pos = prefix.size();
  if (!starts_with(name, 0, prefix) || !read_index(name, pos, layer) || pos >= name.size() || name[pos] != '.') return false;
  const bool a = ends_with(name, suffix_a), b = ends_with(name, suffix_b);
  if (!a && !b) return false;
  if (name.size() < pos + 1 + suffix_a.size() + 1) return false;
  module = name.substr(pos + 1, name.size() - suffix_a.size() - pos - 1);
  which = a ? 'A' : 'B';
  return true;
}

}  // namespace

int keras_lora_index(const GemmaConfig& config, int layer, Slot slot) {
  check(layer >= 0 && layer < config.num_layers, "LoRA: layer ", layer, " out of range (the model has ",
        config.num_layers, " layers)");
  // The weighted sublayers of one decoder block in the order Keras' DFS meets them: children in
  // reverse creation order, each followed by its own children (attention's kernels).
  std::vector<std::string> order = {"block", "ffw_linear", "ffw_gating_2", "ffw_gating"};
  if (config.use_post_ffw_norm) order.push_back("post_ffw_norm");
  order.insert(order.end(), {"pre_ffw_norm", "attention", "attention_output"});
  if (config.use_query_key_norm) order.insert(order.end(), {"key_norm", "query_norm"});
  order.insert(order.end(), {"value", "key", "query"});
  if (config.use_post_attention_norm) order.push_back("post_attention_norm");
  order.push_back("pre_attention_norm");
  const auto it = std::find(order.begin(), order.end(), std::string(slot_layer_name(slot)));
  check(std::find(kLoraSlots.begin(), kLoraSlots.end(), slot) != kLoraSlots.end() && it != order.end(), "LoRA: ",
        slot_layer_name(slot), " cannot carry a LoRA adapter");
  // Index 0 is token_embedding; blocks follow one after another.
  return 1 + layer * int(order.size()) + int(it - order.begin());
}

void save_keras_lora(const std::string& path, const GemmaConfig& config, const LoraWeights& lora) {
  check(ends_with(path, ".lora.h5"), path, ": a Keras LoRA file name must end in .lora.h5");
  validate_lora(config, lora, path);
  check(!lora.adapters.empty(), path, ": no LoRA adapters to save");
  // Keras reads no alpha (it uses alpha = rank, scale 1), so any other scale goes into B.
  const double scale = lora.scale();
  std::vector<std::pair<int, const LoraAdapter*>> by_index;
  for (const LoraAdapter& ad : lora.adapters) {
    check(ad.style == LoraStyle::Keras, path, ": ", ad.keras_path(config),
          " is a PEFT-style adapter; only Keras-style adapters can be saved as .lora.h5 (save it as PEFT instead)");
    check(ad.rank == lora.rank, path, ": ", ad.keras_path(config), " has rank ", ad.rank,
          ", but a .lora.h5 file holds one rank (", lora.rank, ")");
    by_index.push_back({keras_lora_index(config, ad.layer, ad.slot), &ad});
  }
  std::sort(by_index.begin(), by_index.end());
  std::vector<std::pair<std::string, HostTensor>> datasets;
  HostTensor rank = HostTensor::allocate(DType::I64, {});
  rank.mutable_as<int64_t>()[0] = lora.rank;
  datasets.push_back({"lora/vars/rank", rank});
  for (const auto& [idx, ad] : by_index) {
    const std::string group = "lora/" + std::to_string(idx) + "/vars/";
    std::vector<float> b = ad->b;
    if (scale != 1.0)
      for (float& v : b) v = float(v * scale);
    datasets.push_back({group + "lora_kernel_a", f32_tensor(ad->a, ad->a_shape)});
    datasets.push_back({group + "lora_kernel_b", f32_tensor(b, ad->b_shape)});
  }
  write_h5_datasets(path, datasets);
}

LoraWeights load_keras_lora(const std::string& path, const GemmaConfig& config) {
  std::map<std::string, HostTensor> ds = read_h5_datasets(path);
  auto rank_it = ds.find("lora/vars/rank");
  check(rank_it != ds.end(), path, ": no dataset lora/vars/rank (not a Keras .lora.h5 file)");
  const HostTensor& rank_t = rank_it->second;
  check((rank_t.dtype == DType::I64 || rank_t.dtype == DType::I32) && num_elements(rank_t.shape) == 1, path,
        ": dataset lora/vars/rank must be an integer scalar, got ", dtype_name(rank_t.dtype), shape_str(rank_t.shape));
  const int64_t rank = rank_t.dtype == DType::I64 ? rank_t.as<int64_t>()[0] : rank_t.as<int32_t>()[0];
  check(rank > 0 && rank < (1 << 20), path, ": dataset lora/vars/rank holds ", rank, ", not a valid rank");

  // Every adaptable kernel of this model, by its Keras index.
  std::map<int, std::pair<int, Slot>> targets;
  for (int layer = 0; layer < config.num_layers; ++layer)
    for (Slot slot : kLoraSlots) targets[keras_lora_index(config, layer, slot)] = {layer, slot};

  std::map<int, LoraAdapter> found;  // by index, so adapters come out in file order
  for (const auto& [name, t] : ds) {
    if (name == "lora/vars/rank") continue;
    int idx = 0;
    char which = 0;
    check(parse_keras_lora_name(name, idx, which), path, ": unexpected dataset ", brief(name),
          " (a .lora.h5 holds lora/vars/rank and lora/<idx>/vars/lora_kernel_a|b)");
    auto target = targets.find(idx);
    check(target != targets.end(), path, ": dataset ", name, ": index ", idx,
          " is not a query/key/value/attention_output/FFW kernel of this model (", config.num_layers,
          " layers, Gemma ", config.family, ")");
    check(is_float(t.dtype), path, ": dataset ", name, " has dtype ", dtype_name(t.dtype), ", expected float32");
    LoraAdapter& ad = found[idx];
    ad.layer = target->second.first;
    ad.slot = target->second.second;
    ad.style = LoraStyle::Keras;
    ad.rank = int(rank);
    const LoraKernel k = lora_kernel(config, ad.slot);
    const bool is_a = which == 'a';
    const Shape want = is_a ? keras_a_shape(k, rank) : Shape{rank, k.keras_shape.back()};
    if (t.shape != want) {
      const int64_t t_rank = t.shape.empty() ? -1 : (is_a ? t.shape.back() : t.shape.front());
      check(t_rank == rank, path, ": dataset ", name, " has shape ", shape_str(t.shape), ", which does not match ",
            "the file's rank ", rank, " (expected ", shape_str(want), " for ", ad.keras_path(config), ")");
      fail(path, ": dataset ", name, " has shape ", shape_str(t.shape), ", but ", ad.keras_path(config),
           " of this model needs ", shape_str(want), " (kernel ", shape_str(k.keras_shape), ", rank ", rank, ")");
    }
    (is_a ? ad.a_shape : ad.b_shape) = t.shape;
    (is_a ? ad.a : ad.b) = to_f32(t);
  }

  LoraWeights w;
  w.rank = int(rank);
  w.alpha = double(rank);  // Keras never stores alpha: scale 1
  for (auto& [idx, ad] : found) {
    check(!ad.a.empty() && !ad.b.empty(), path, ": group lora/", idx, " needs both lora_kernel_a and lora_kernel_b");
    w.adapters.push_back(std::move(ad));
  }
  return checked(std::move(w), config, path);
}

void save_peft_adapter(const std::string& dir, const GemmaConfig& config, const LoraWeights& lora,
                       const std::string& base_model) {
  validate_lora(config, lora, dir);
  check(!lora.adapters.empty(), dir, ": no LoRA adapters to save");
  const double scale = lora.scale();
  std::vector<std::pair<std::string, HostTensor>> tensors;
  // Per module type ("q_proj"): the (r', alpha') of each layer, to decide the patterns.
  std::map<std::string, std::vector<std::pair<int, std::pair<int, double>>>> per_module;
  std::vector<std::string> targets;
  for (const LoraAdapter& ad : lora.adapters) {
    PeftFactors f = to_peft(config, ad, scale);
    const std::string module = "model.layers." + std::to_string(ad.layer) + "." + hf_module(ad.slot);
    tensors.push_back({"base_model.model." + module + ".lora_A.weight", f32_tensor(f.a, f.a_shape)});
    tensors.push_back({"base_model.model." + module + ".lora_B.weight", f32_tensor(f.b, f.b_shape)});
    per_module[short_module(ad.slot)].push_back({ad.layer, {f.rank, f.alpha}});
  }
  for (Slot s : kLoraSlots)
    if (per_module.count(short_module(s))) targets.push_back(short_module(s));

  // rank_pattern/alpha_pattern only where a module differs from the global r / lora_alpha: one key
  // per module type when all layers agree, else one per layer ("layers.3.self_attn.q_proj").
  json rank_pattern = json::object(), alpha_pattern = json::object();
  for (const auto& [short_name, entries] : per_module) {
    bool uniform = true;
    for (const auto& e : entries)
      uniform = uniform && e.second.first == entries[0].second.first &&
                nearly_equal(e.second.second, entries[0].second.second);
    for (const auto& [layer, ra] : entries) {
      std::string key = short_name;
      if (!uniform) {
        for (Slot s : kLoraSlots)
          if (short_module(s) == short_name) key = "layers." + std::to_string(layer) + "." + hf_module(s);
      }
      if (ra.first != lora.rank) rank_pattern[key] = ra.first;
      if (!nearly_equal(ra.second, lora.alpha)) alpha_pattern[key] = peft_number(ra.second);
    }
  }
  json cfg = {{"peft_type", "LORA"},
              {"task_type", "CAUSAL_LM"},
              {"r", lora.rank},
              {"lora_alpha", peft_number(lora.alpha)},
              {"target_modules", targets},
              {"rank_pattern", rank_pattern},
              {"alpha_pattern", alpha_pattern},
              {"bias", "none"},
              {"fan_in_fan_out", false},
              {"use_rslora", false},
              {"lora_dropout", 0.0},
              {"base_model_name_or_path", base_model}};
  fs::create_directories(dir);
  write_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
  write_file_atomic((fs::path(dir) / "adapter_config.json").string(), cfg.dump(2) + "\n");
}

LoraWeights load_peft_adapter(const std::string& dir, const GemmaConfig& config) {
  const std::string config_path = (fs::path(dir) / "adapter_config.json").string();
  const std::string weights_path = (fs::path(dir) / "adapter_model.safetensors").string();
  check(fs::exists(config_path), dir, ": no adapter_config.json (not a PEFT adapter directory)");
  const json cfg_json = read_json_file(config_path);
  const JsonValue cfg(cfg_json, config_path);
  check(cfg.is_object(), config_path, ": expected a JSON object");
  const std::string peft_type = cfg.string_or("peft_type", "LORA");
  check(peft_type == "LORA", config_path, ": peft_type is ", brief(peft_type), ", only LORA is supported");
  check(!cfg.boolean_or("fan_in_fan_out", false), config_path, ": fan_in_fan_out=true is not supported (Gemma uses nn.Linear)");
  check(!cfg.boolean_or("use_dora", false), config_path, ": DoRA adapters (use_dora=true) are not supported");
  const bool rslora = cfg.boolean_or("use_rslora", false);
  // PEFT's defaults when a key is absent. Ranks are bounded by the tensors they must match.
  const int r = int(cfg.integer_or("r", 8, 1, kMaxPeftRank));
  const double lora_alpha = cfg.number_or("lora_alpha", 8.0);
  check(lora_alpha > 0, config_path, ": lora_alpha must be positive, got ", lora_alpha);
  const ModulePatterns rank_pattern(cfg, "rank_pattern"), alpha_pattern(cfg, "alpha_pattern");
  auto peft_scale = [&](double alpha, int rank) { return alpha / (rslora ? std::sqrt(double(rank)) : double(rank)); };
  const double scale = peft_scale(lora_alpha, r);

  check(fs::exists(weights_path), dir, ": no adapter_model.safetensors (adapter_model.bin is not supported)");
  std::map<std::string, HostTensor> tensors = read_safetensors(weights_path);

  std::map<std::pair<int, int>, std::pair<const HostTensor*, const HostTensor*>> modules;  // (layer, slot) → A, B
  std::map<std::pair<int, int>, std::string> a_names;
  for (const auto& [name, t] : tensors) {
    int layer = 0;
    std::string module;
    char which = 0;
    check(parse_peft_name(name, layer, module, which), weights_path, ": unexpected tensor ", brief(name),
          " (expected base_model.model.model.layers.<i>.<module>.lora_A|lora_B.weight)");
    check(layer < config.num_layers, weights_path, ": tensor ", brief(name), " is for layer ", layer, ", but the model has ",
          config.num_layers, " layers");
    const Slot* slot = nullptr;
    for (const Slot& s : kLoraSlots)
      if (module == hf_module(s)) slot = &s;
    check(slot != nullptr, weights_path, ": tensor ", brief(name), ": unknown module ", brief(module),
          " (expected self_attn.q_proj|k_proj|v_proj|o_proj or mlp.gate_proj|up_proj|down_proj)");
    check(is_float(t.dtype), weights_path, ": tensor ", brief(name), " has dtype ", dtype_name(t.dtype),
          ", expected a floating-point type");
    auto& entry = modules[{layer, int(*slot)}];
    (which == 'A' ? entry.first : entry.second) = &t;
    if (which == 'A') a_names[{layer, int(*slot)}] = name;
  }

  LoraWeights w;
  w.rank = r;
  w.alpha = scale * r;  // so that w.scale() is PEFT's global scale (also under rsLoRA)
  for (const auto& [key, ab] : modules) {
    const int layer = key.first;
    const Slot slot = Slot(key.second);
    const std::string module = "model.layers." + std::to_string(layer) + "." + hf_module(slot);
    const std::string base_name = "base_model.model." + module;
    check(ab.first && ab.second, weights_path, ": ", base_name, " needs both lora_A.weight and lora_B.weight");
    const HostTensor& A = *ab.first;
    const HostTensor& B = *ab.second;
    const LoraKernel k = lora_kernel(config, slot);
    const std::optional<JsonValue> rp = rank_pattern.find(module), ap = alpha_pattern.find(module);
    const int rank = rp ? rp->to_int(1, kMaxPeftRank) : r;
    const double alpha = ap ? ap->number() : lora_alpha;
    check(alpha > 0, config_path, ": alpha for ", module, " must be positive");
    const Shape want_a = {rank, k.cols}, want_b = {k.rows, rank};
    check(A.shape == want_a, weights_path, ": tensor ", base_name, ".lora_A.weight has shape ", shape_str(A.shape),
          ", but ", config_path, " (rank ", rank, ") and the model (", k.rows, "x", k.cols, " ", hf_module(slot),
          ") need ", shape_str(want_a));
    check(B.shape == want_b, weights_path, ": tensor ", base_name, ".lora_B.weight has shape ", shape_str(B.shape),
          ", but ", config_path, " (rank ", rank, ") and the model (", k.rows, "x", k.cols, " ", hf_module(slot),
          ") need ", shape_str(want_b));
    LoraAdapter ad;
    ad.layer = layer;
    ad.slot = slot;
    ad.style = LoraStyle::Peft;
    ad.rank = rank;
    ad.a_shape = want_a;
    ad.b_shape = want_b;
    ad.a = to_f32(A);
    ad.b = to_f32(B);
    // One scale serves all adapters; a module with its own alpha/r gets the ratio folded into B.
    const double module_scale = peft_scale(alpha, rank);
    if (!nearly_equal(module_scale, scale))
      for (float& v : ad.b) v = float(v * (module_scale / scale));
    w.adapters.push_back(std::move(ad));
  }
  return checked(std::move(w), config, weights_path);
}

LoraWeights load_lora_adapter(const std::string& path, const GemmaConfig& config) {
  if (ends_with(path, ".lora.h5")) return load_keras_lora(path, config);
  if (fs::is_directory(path) && fs::exists(fs::path(path) / "adapter_config.json"))
    return load_peft_adapter(path, config);
  if (fs::path(path).filename() == "adapter_config.json" || fs::path(path).filename() == "adapter_model.safetensors")
    return load_peft_adapter(fs::path(path).parent_path().string(), config);
  fail(path, ": not a LoRA adapter (expected a Keras *.lora.h5 file or a PEFT directory with adapter_config.json)");
}

}  // namespace meshtune
