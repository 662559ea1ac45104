// LoRA: enable_lora, merge, backward, and the adapter files, against the real Keras fixtures
// (../shared/fixtures/keras/lora-gemma-tiny).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/npy.h"
#include "io/keras_h5.h"
#include "io/safetensors.h"
#include "store/load.h"
#include "model/backward.h"
#include "model/init.h"
#include "model/lora.h"
#include "store/lora_files.h"
#include "test_util.h"

using namespace meshtune;
using namespace meshtune::testing;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::string kLoraDir = "keras/lora-gemma-tiny/";
const std::vector<Slot> kAll = {Slot::Query,      Slot::Key,        Slot::Value,    Slot::AttentionOutput,
                                Slot::FfwGating, Slot::FfwGating2, Slot::FfwLinear};

GemmaModel tiny_model(const std::string& name = "gemma-tiny") {
  return load_model(inspect_model_dir(fixture("keras/preset-" + name)));
}

json lora_info() { return json::parse(read_text_file(fixture(kLoraDir + "lora_info.json"))); }

struct Outputs {
  std::vector<float> hidden, logits;
  std::vector<int32_t> mask;
};

// The forward pass on the fixture inputs of outputs-gemma-tiny (as in test_gemma_keras.cpp).
Outputs run_forward(const GemmaModel& model) {
  const std::string in = fixture("keras/outputs-gemma-tiny/");
  HostTensor ids_t = read_npy(in + "token_ids.npy");
  const int64_t B = ids_t.shape[0], T = ids_t.shape[1], V = model.config.vocab_size;
  std::vector<int32_t> ids = npy_ints(in + "token_ids.npy");
  Outputs out;
  out.mask = npy_ints(in + "padding_mask.npy");
  KVCache cache(model.config, B, T, meshtune::testing::cpu_backend());
  cache.set_key_valid(meshtune::testing::cpu_backend(), std::vector<uint8_t>(out.mask.begin(), out.mask.end()));
  out.hidden = meshtune::testing::to_host(backbone_forward(meshtune::testing::cpu_context(), model, ids.data(), B, T, 0, cache));
  out.logits.resize(size_t(B * T * V));
  lm_head(meshtune::testing::cpu_context(), model, out.hidden, B * T, out.logits);
  return out;
}

const WeightMatrix& matrix(const GemmaModel& m, int layer, Slot slot) {
  const DecoderLayerWeights& l = m.layers[size_t(layer)];
  switch (slot) {
    case Slot::Query: return l.query;
    case Slot::Key: return l.key;
    case Slot::Value: return l.value;
    case Slot::AttentionOutput: return l.attention_output;
    case Slot::FfwGating: return l.ffw_gating;
    case Slot::FfwGating2: return l.ffw_gating_2;
    default: return l.ffw_linear;
  }
}

double max_matrix_diff(const WeightMatrix& a, const WeightMatrix& b) {
  EXPECT_EQ(a.rows, b.rows);
  EXPECT_EQ(a.cols, b.cols);
  double worst = 0;
  for (int64_t r = 0; r < a.rows; ++r)
    for (int64_t c = 0; c < a.cols; ++c) worst = std::max(worst, double(std::fabs(a.at(r, c) - b.at(r, c))));
  return worst;
}

// Deterministic non-zero values (a simple LCG), so B can be non-zero without a fixture.
void fill_pseudo_random(std::vector<float>& v, uint32_t seed, float amplitude) {
  uint32_t s = seed;
  for (float& x : v) {
    s = s * 1664525u + 1013904223u;
    x = amplitude * (float(s >> 8) / float(1 << 24) * 2.f - 1.f);
  }
}

// Throws Error whose message contains every one of `parts`.
template <typename F>
void expect_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

TEST(Lora, TargetsAndNames) {
  EXPECT_EQ(parse_lora_targets({"query", "value"}), (std::vector<Slot>{Slot::Query, Slot::Value}));
  EXPECT_EQ(parse_lora_targets({"all"}), kAll);
  EXPECT_EQ(parse_lora_targets({}), (std::vector<Slot>{Slot::Query, Slot::Value}));
  EXPECT_THROW(parse_lora_targets({"q_proj_typo"}), Error);
  EXPECT_STREQ(slot_layer_name(Slot::FfwGating2), "ffw_gating_2");
  GemmaConfig c = tiny_model().config;
  LoraAdapter a;
  a.layer = 0;
  a.slot = Slot::Query;
  EXPECT_EQ(a.keras_path(c), "decoder_block_0/attention/query");
  a.layer = 1;
  a.slot = Slot::FfwGating2;
  EXPECT_EQ(a.keras_path(c), "decoder_block_1/ffw_gating_2");
  // The adapter paths match gemma_variables' kernel paths.
  for (const VariableSpec& spec : gemma_variables(c))
    for (Slot s : kAll)
      if (spec.slot == s) {
        LoraAdapter ad;
        ad.layer = spec.layer;
        ad.slot = s;
        EXPECT_EQ(ad.keras_path(c) + "/kernel", spec.keras_path);
      }
}

TEST(Lora, TrainableCountsMatchKeras) {
  // Spec §7: L·r·[(N·D+H)+(K·D+H)] = 11,067,392 for Gemma 7B at rank 4.
  GemmaConfig c7 = preset_config("gemma_7b_en");
  LoraWeights w7 = enable_lora(c7, 4, {Slot::Query, Slot::Value}, 1);
  EXPECT_EQ(w7.num_parameters(), 11067392);
  const long long formula = 28LL * 4 * ((16LL * 3072 + 256) + (16LL * 3072 + 256));
  EXPECT_EQ(w7.num_parameters(), formula);

  json info = lora_info();
  GemmaModel m = tiny_model();
  LoraWeights w = enable_lora(m.config, info["rank"].get<int>(), parse_lora_targets({}), 7);
  EXPECT_EQ(w.num_parameters(), info["trainable_params_after_enable_lora"].get<long long>());
  // Every Keras LoRA variable of lora_info has an adapter with the same shape.
  for (const json& v : info["variables_after_enable_lora"]) {
    const std::string path = v["path"];
    const bool is_a = path.ends_with("/lora_kernel_a"), is_b = path.ends_with("/lora_kernel_b");
    if (!is_a && !is_b) continue;
    const std::string layer_path = path.substr(0, path.rfind('/'));
    bool found = false;
    for (const LoraAdapter& ad : w.adapters)
      if (ad.keras_path(m.config) == layer_path) {
        found = true;
        EXPECT_EQ(is_a ? ad.a_shape : ad.b_shape, v["shape"].get<Shape>()) << path;
      }
    EXPECT_TRUE(found) << path;
  }
}

TEST(Lora, HeUniformInitAndZeroB) {
  GemmaModel m = tiny_model();
  LoraWeights w = enable_lora(m.config, 3, kAll, 42);
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.alpha, 3.0);
  EXPECT_EQ(w.scale(), 1.0);
  EXPECT_EQ(w.adapters.size(), size_t(m.config.num_layers) * kAll.size());
  for (const LoraAdapter& ad : w.adapters) {
    int64_t fan_in = 1;
    for (size_t i = 0; i + 1 < ad.a_shape.size(); ++i) fan_in *= ad.a_shape[i];
    const float limit = float(std::sqrt(6.0 / double(fan_in)));
    float max_abs = 0;
    double mean = 0;
    for (float v : ad.a) {
      EXPECT_LE(std::fabs(v), limit);
      max_abs = std::max(max_abs, std::fabs(v));
      mean += v;
    }
    mean /= double(ad.a.size());
    EXPECT_GT(max_abs, 0.9f * limit) << ad.keras_path(m.config);  // really spread over ±limit
    EXPECT_LT(std::fabs(mean), 0.2 * limit) << ad.keras_path(m.config);
    for (float v : ad.b) EXPECT_EQ(v, 0.f);
  }
  // Deterministic in the seed.
  LoraWeights again = enable_lora(m.config, 3, kAll, 42);
  LoraWeights other = enable_lora(m.config, 3, kAll, 43);
  EXPECT_EQ(again.adapters[5].a, w.adapters[5].a);
  EXPECT_NE(other.adapters[5].a, w.adapters[5].a);
  EXPECT_EQ(enable_lora(m.config, 2, kAll, 1, 16.0).scale(), 8.0);
  // Gemma 7B query: limit √(6/(16·3072)) ≈ 0.01105 (spec §7).
  LoraWeights w7 = enable_lora(preset_config("gemma_7b_en"), 1, {Slot::Query}, 1);
  float max7 = 0;
  for (float v : w7.adapters[0].a) max7 = std::max(max7, std::fabs(v));
  EXPECT_LE(max7, 0.011049f);
  EXPECT_GT(max7, 0.0110f);
}

TEST(Lora, ZeroBLeavesLogitsUnchanged) {
  GemmaModel base = tiny_model();
  LoraWeights w = enable_lora(base.config, 2, kAll, 5);
  GemmaModel merged = merge_lora(base, w);
  Outputs a = run_forward(base), b = run_forward(merged);
  EXPECT_EQ(a.logits, b.logits);
  // Unadapted matrices are shared, not copied.
  LoraWeights qv = enable_lora(base.config, 2, {Slot::Query, Slot::Value}, 5);
  GemmaModel merged_qv = merge_lora(base, qv);
  EXPECT_EQ(merged_qv.embeddings.data, base.embeddings.data);
  EXPECT_EQ(merged_qv.layers[0].key.data, base.layers[0].key.data);
  EXPECT_NE(merged_qv.layers[0].query.data, base.layers[0].query.data);
  EXPECT_EQ(merged_qv.layers[0].query.dtype, DType::F32);
}

TEST(Lora, MergeWidensBf16) {
  GemmaModel base = tiny_model();
  // Make layer 0's query a bf16 matrix, as a bf16 checkpoint would give.
  WeightMatrix& q = base.layers[0].query;
  auto bits = std::make_shared<std::vector<uint16_t>>(size_t(q.rows * q.cols));
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t c = 0; c < q.cols; ++c) (*bits)[size_t(r * q.cols + c)] = f32_to_bf16(q.at(r, c));
  q.dtype = DType::BF16;
  q.data = bits->data();
  q.owner = bits;
  LoraWeights w = enable_lora(base.config, 2, {Slot::Query}, 4);
  fill_pseudo_random(w.adapters[0].b, 1, 0.5f);
  GemmaModel merged = merge_lora(base, w);
  const WeightMatrix& m = merged.layers[0].query;
  EXPECT_EQ(m.dtype, DType::F32);
  std::vector<float> delta = lora_delta(base.config, w.adapters[0], w.scale());
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t c = 0; c < q.cols; ++c)
      EXPECT_EQ(m.at(r, c), q.at(r, c) + delta[size_t(r * q.cols + c)]) << r << "," << c;
}

TEST(Lora, KerasIndexMatchesFixtureAndSpec) {
  json info = lora_info();
  GemmaConfig c = tiny_model().config;
  std::vector<int> expected = info["lora_enabled_layer_indices"].get<std::vector<int>>();
  std::vector<int> ours;
  for (int layer = 0; layer < c.num_layers; ++layer)
    for (Slot s : {Slot::Value, Slot::Query}) ours.push_back(keras_lora_index(c, layer, s));
  std::sort(ours.begin(), ours.end());
  EXPECT_EQ(ours, expected);
  for (const auto& [idx, path] : info["adapter_group_index_to_layer_path"].items()) {
    bool found = false;
    for (int layer = 0; layer < c.num_layers; ++layer)
      for (Slot s : kAll) {
        LoraAdapter ad;
        ad.layer = layer;
        ad.slot = s;
        if (ad.keras_path(c) == path.get<std::string>()) {
          EXPECT_EQ(keras_lora_index(c, layer, s), std::stoi(idx)) << path;
          found = true;
        }
      }
    EXPECT_TRUE(found) << path;
  }
  // Spec §3.4 strides: Gemma 2 value 9+13i, query 11+13i; Gemma 3 value 11+15i, query 13+15i.
  GemmaConfig c2 = tiny_model("gemma2-tiny").config;
  GemmaConfig c3 = c2;
  c3.family = 3;
  c3.use_query_key_norm = true;
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(keras_lora_index(c2, i, Slot::Value), 9 + 13 * i);
    EXPECT_EQ(keras_lora_index(c2, i, Slot::Query), 11 + 13 * i);
    EXPECT_EQ(keras_lora_index(c3, i, Slot::Value), 11 + 15 * i);
    EXPECT_EQ(keras_lora_index(c3, i, Slot::Query), 13 + 15 * i);
  }
  EXPECT_EQ(keras_lora_index(c, 0, Slot::FfwLinear), 2);
  EXPECT_EQ(keras_lora_index(c, 1, Slot::AttentionOutput), 18);
  EXPECT_THROW(keras_lora_index(c, 0, Slot::PreFfwNorm), Error);
  EXPECT_THROW(keras_lora_index(c, 2, Slot::Query), Error);
}

TEST(Lora, FixtureAdapterReproducesKerasLogits) {
  GemmaModel base = tiny_model();
  LoraWeights w = load_keras_lora(fixture(kLoraDir + "adapter.lora.h5"), base.config);
  json info = lora_info();
  EXPECT_EQ(w.rank, info["rank"].get<int>());
  EXPECT_EQ(w.scale(), 1.0);
  EXPECT_EQ(w.num_parameters(), info["trainable_params_after_enable_lora"].get<long long>());
  ASSERT_EQ(w.adapters.size(), 4u);
  EXPECT_EQ(w.adapters[0].keras_path(base.config), "decoder_block_0/attention/value");  // index 8
  EXPECT_EQ(w.adapters[1].keras_path(base.config), "decoder_block_0/attention/query");  // index 10
  GemmaModel merged = merge_lora(base, w);
  Outputs out = run_forward(merged);
  const size_t D = size_t(base.config.hidden_dim), V = size_t(base.config.vocab_size);
  const double dl = max_diff_valid(out.logits, to_f32(read_npy(fixture(kLoraDir + "logits_with_random_lora.npy"))),
                                   out.mask, V);
  const double dh = max_diff_valid(
      out.hidden, to_f32(read_npy(fixture(kLoraDir + "hidden_states_with_random_lora.npy"))), out.mask, D);
  std::cout << "max |logits - keras| = " << dl << ", max |hidden - keras| = " << dh << "\n";
  EXPECT_LT(dl, 1e-4);
  EXPECT_LT(dh, 1e-4);
  // The adapter really changes the output.
  EXPECT_GT(max_diff_valid(out.logits, run_forward(base).logits, out.mask, V), 1e-3);
}

TEST(Lora, MergedKerasCheckpointMatches) {
  const std::string dir = make_temp_dir("lora-merged");
  for (const auto& entry : fs::recursive_directory_iterator(fixture("keras/preset-gemma-tiny"))) {
    const fs::path rel = fs::relative(entry.path(), fixture("keras/preset-gemma-tiny"));
    if (entry.is_directory()) fs::create_directories(fs::path(dir) / rel);
    else fs::copy_file(entry.path(), fs::path(dir) / rel);
  }
  fs::remove(fs::path(dir) / "model.weights.h5");
  fs::copy_file(fixture(kLoraDir + "model_with_lora.weights.h5"), fs::path(dir) / "model.weights.h5");
  GemmaModel keras_merged = load_model(inspect_model_dir(dir));
  Outputs out = run_forward(keras_merged);
  const double dl = max_diff_valid(out.logits, to_f32(read_npy(fixture(kLoraDir + "logits_with_random_lora.npy"))),
                                   out.mask, size_t(keras_merged.config.vocab_size));
  std::cout << "merged checkpoint: max |logits - keras| = " << dl << "\n";
  EXPECT_LT(dl, 1e-4);
  // Our merge equals Keras' merged kernels.
  GemmaModel base = tiny_model();
  LoraWeights w = load_keras_lora(fixture(kLoraDir + "adapter.lora.h5"), base.config);
  GemmaModel ours = merge_lora(base, w);
  double worst = 0;
  for (int layer = 0; layer < base.config.num_layers; ++layer)
    for (Slot s : kAll) worst = std::max(worst, max_matrix_diff(matrix(ours, layer, s), matrix(keras_merged, layer, s)));
  std::cout << "max |merged kernel - keras merged kernel| = " << worst << "\n";
  EXPECT_EQ(worst, 0.0);  // Keras saves W + A·B; we compute the same fp32 operations (spec §7)
}

TEST(Lora, KerasFileRoundTripAndLayout) {
  GemmaModel base = tiny_model();
  const std::string src = fixture(kLoraDir + "adapter.lora.h5");
  LoraWeights w = load_keras_lora(src, base.config);
  const std::string path = make_temp_dir("lora-h5") + "/out.lora.h5";
  save_keras_lora(path, base.config, w);
  LoraWeights back = load_keras_lora(path, base.config);
  ASSERT_EQ(back.adapters.size(), w.adapters.size());
  EXPECT_EQ(back.rank, w.rank);
  EXPECT_EQ(back.alpha, w.alpha);
  for (size_t i = 0; i < w.adapters.size(); ++i) {
    EXPECT_EQ(back.adapters[i].layer, w.adapters[i].layer);
    EXPECT_EQ(back.adapters[i].slot, w.adapters[i].slot);
    EXPECT_EQ(back.adapters[i].a_shape, w.adapters[i].a_shape);
    EXPECT_EQ(back.adapters[i].b_shape, w.adapters[i].b_shape);
    EXPECT_EQ(back.adapters[i].a, w.adapters[i].a);  // bit-identical
    EXPECT_EQ(back.adapters[i].b, w.adapters[i].b);
  }
  // The file we write holds exactly the fixture's datasets.
  auto ours = read_h5_datasets(path), theirs = read_h5_datasets(src);
  ASSERT_EQ(ours.size(), theirs.size());
  for (const auto& [name, t] : theirs) {
    ASSERT_TRUE(ours.count(name)) << name;
    const HostTensor& o = ours.at(name);
    EXPECT_EQ(o.dtype, t.dtype) << name;
    EXPECT_EQ(o.shape, t.shape) << name;
    ASSERT_EQ(o.nbytes(), t.nbytes()) << name;
    EXPECT_EQ(std::memcmp(o.data, t.data, t.nbytes()), 0) << name;
  }
  // Freshly enabled adapters on every target round-trip too.
  LoraWeights all = enable_lora(base.config, 2, kAll, 3);
  for (LoraAdapter& ad : all.adapters) fill_pseudo_random(ad.b, uint32_t(ad.layer * 10 + int(ad.slot)), 0.1f);
  const std::string path2 = make_temp_dir("lora-h5") + "/all.lora.h5";
  save_keras_lora(path2, base.config, all);
  LoraWeights all_back = load_lora_adapter(path2, base.config);
  ASSERT_EQ(all_back.adapters.size(), all.adapters.size());
  for (const LoraAdapter& ad : all.adapters) {
    bool found = false;
    for (const LoraAdapter& bd : all_back.adapters)
      if (bd.layer == ad.layer && bd.slot == ad.slot) {
        found = true;
        EXPECT_EQ(bd.a, ad.a);
        EXPECT_EQ(bd.b, ad.b);
      }
    EXPECT_TRUE(found);
  }
  EXPECT_THROW(save_keras_lora(make_temp_dir("lora-h5") + "/bad.h5", base.config, w), Error);
}

// ΔW of every adapter of `a` equals that of `b` (matched by layer and slot) to `tol`.
double max_delta_diff(const GemmaConfig& c, const LoraWeights& a, const LoraWeights& b) {
  EXPECT_EQ(a.adapters.size(), b.adapters.size());
  double worst = 0;
  for (const LoraAdapter& x : a.adapters) {
    bool found = false;
    for (const LoraAdapter& y : b.adapters) {
      if (x.layer != y.layer || x.slot != y.slot) continue;
      found = true;
      std::vector<float> dx = lora_delta(c, x, a.scale()), dy = lora_delta(c, y, b.scale());
      EXPECT_EQ(dx.size(), dy.size());
      for (size_t i = 0; i < dx.size(); ++i) worst = std::max(worst, double(std::fabs(dx[i] - dy[i])));
    }
    EXPECT_TRUE(found) << x.keras_path(c);
  }
  return worst;
}

TEST(Lora, PeftExportIsExact) {
  for (std::string name : {"gemma-tiny", "gemma2-tiny"}) {
    GemmaModel base = tiny_model(name);
    const GemmaConfig& c = base.config;
    LoraWeights w = enable_lora(c, 2, kAll, 11, 3.0);  // scale 1.5, so the patterns matter
    for (LoraAdapter& ad : w.adapters) fill_pseudo_random(ad.b, uint32_t(ad.layer * 100 + int(ad.slot)), 0.2f);
    const std::string dir = make_temp_dir("peft") + "/adapter";
    save_peft_adapter(dir, c, w);
    json cfg = json::parse(read_text_file(dir + "/adapter_config.json"));
    EXPECT_EQ(cfg["peft_type"], "LORA");
    EXPECT_EQ(cfg["task_type"], "CAUSAL_LM");
    EXPECT_EQ(cfg["r"], 2);
    EXPECT_EQ(cfg["lora_alpha"].get<double>(), 3.0);
    EXPECT_EQ(cfg["target_modules"].size(), 7u);
    EXPECT_EQ(cfg["rank_pattern"]["q_proj"], c.num_query_heads * 2);
    EXPECT_EQ(cfg["alpha_pattern"]["q_proj"].get<double>(), 1.5 * c.num_query_heads * 2);
    EXPECT_FALSE(cfg["rank_pattern"].contains("o_proj"));
    auto tensors = read_safetensors(dir + "/adapter_model.safetensors");
    EXPECT_EQ(tensors.size(), w.adapters.size() * 2);
    EXPECT_EQ(tensors.at("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight").shape,
              (Shape{c.num_query_heads * 2, c.hidden_dim}));
    EXPECT_EQ(tensors.at("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight").shape,
              (Shape{c.hidden_dim, 2}));

    LoraWeights back = load_lora_adapter(dir, c);
    for (const LoraAdapter& ad : back.adapters) EXPECT_EQ(ad.style, LoraStyle::Peft);
    const double d = max_delta_diff(c, w, back);
    std::cout << name << ": max |ΔW keras - ΔW peft| = " << d << "\n";
    EXPECT_LT(d, 1e-6);
    GemmaModel m1 = merge_lora(base, w), m2 = merge_lora(base, back);
    for (int layer = 0; layer < c.num_layers; ++layer)
      for (Slot s : kAll) EXPECT_LT(max_matrix_diff(matrix(m1, layer, s), matrix(m2, layer, s)), 1e-6);

    // PEFT → PEFT is bit-identical.
    const std::string dir2 = make_temp_dir("peft") + "/again";
    save_peft_adapter(dir2, c, back);
    LoraWeights back2 = load_peft_adapter(dir2, c);
    ASSERT_EQ(back2.adapters.size(), back.adapters.size());
    EXPECT_EQ(back2.scale(), back.scale());
    for (size_t i = 0; i < back.adapters.size(); ++i) {
      EXPECT_EQ(back2.adapters[i].rank, back.adapters[i].rank);
      EXPECT_EQ(back2.adapters[i].a, back.adapters[i].a);
      EXPECT_EQ(back2.adapters[i].b, back.adapters[i].b);
    }
    // A PEFT adapter cannot become a .lora.h5 file.
    EXPECT_THROW(save_keras_lora(dir + "/x.lora.h5", c, back), Error);
  }
}

TEST(Lora, PeftFixtureAdapterGivesKerasLogits) {
  GemmaModel base = tiny_model();
  LoraWeights w = load_keras_lora(fixture(kLoraDir + "adapter.lora.h5"), base.config);
  const std::string dir = make_temp_dir("peft-fixture");
  save_peft_adapter(dir, base.config, w);
  Outputs out = run_forward(merge_lora(base, load_lora_adapter(dir + "/adapter_config.json", base.config)));
  const double dl = max_diff_valid(out.logits, to_f32(read_npy(fixture(kLoraDir + "logits_with_random_lora.npy"))),
                                   out.mask, size_t(base.config.vocab_size));
  std::cout << "via PEFT: max |logits - keras| = " << dl << "\n";
  EXPECT_LT(dl, 1e-4);
}

// Merged-kernel training, the way LoRA gradients were formed before the low-rank path: ∂L/∂W_eff of
// the merged kernel, then ∂L/∂A_k = Σ ∂L/∂W ⊙ ΔW(e_k, B) and ∂L/∂B_k = Σ ∂L/∂W ⊙ ΔW(A, e_k) —
// exact, since ΔW is linear in each of A and B.
void merged_kernel_gradients(const GemmaConfig& c, const LoraAdapter& ad, double scale, const std::vector<float>& grad_w,
                             std::vector<double>& grad_a, std::vector<double>& grad_b) {
  auto along = [&](bool of_a, size_t k) {
    LoraAdapter unit = ad;
    std::vector<float>& v = of_a ? unit.a : unit.b;
    std::fill(v.begin(), v.end(), 0.f);
    v[k] = 1.f;
    const std::vector<float> delta = lora_delta(c, unit, scale);
    double sum = 0;
    for (size_t i = 0; i < delta.size(); ++i) sum += double(grad_w[i]) * delta[i];
    return sum;
  };
  grad_a.resize(ad.a.size());
  grad_b.resize(ad.b.size());
  for (size_t k = 0; k < ad.a.size(); ++k) grad_a[k] = along(true, k);
  for (size_t k = 0; k < ad.b.size(); ++k) grad_b[k] = along(false, k);
}

double relative_difference(const std::vector<float>& ours, const std::vector<double>& reference) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    diff += (ours[i] - reference[i]) * (ours[i] - reference[i]);
    norm += reference[i] * reference[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

// Training runs the adapters as low-rank terms (x·Wᵀ + s·(x·A)·B, W neither merged nor
// differentiated). Its loss and every ∂A, ∂B equal merged-kernel training's within 1e-5 relative,
// for Keras-style adapters (one A per head on q/k/v) and PEFT-style ones, on every family.
TEST(Lora, LowRankPathEqualsMergedKernelGradients) {
  for (const std::string family : {"tiny", "tiny-gemma2", "tiny-gemma3"}) {
    GemmaConfig config = preset_config(family, 61);
    config.sliding_window_size = 3;
    const GemmaModel base = random_model(config, 7);
    const int64_t B = 2, T = 6, M = B * T;
    std::vector<int32_t> ids(M), targets(M);
    std::vector<uint8_t> mask(M, 1);
    std::vector<float> weights(M, 1.f);
    for (int64_t m = 0; m < M; ++m) ids[m] = int32_t((m * 17 + 3) % 61), targets[m] = int32_t((m * 29 + 5) % 61);
    weights[0] = 0.f;
    const TokenBatch tb{B, T, ids.data(), mask.data(), targets.data(), weights.data()};
    LoraWeights keras = enable_lora(config, 3, kAll, 21, 4.5);
    for (LoraAdapter& ad : keras.adapters) fill_pseudo_random(ad.b, uint32_t(int(ad.slot) + 7 * ad.layer + 1), 0.3f);
    const std::string dir = make_temp_dir("lowrank-" + family);
    save_peft_adapter(dir, config, keras);
    LoraWeights peft = load_peft_adapter(dir, config);
    for (LoraAdapter& ad : peft.adapters) fill_pseudo_random(ad.a, uint32_t(int(ad.slot) + 50), 0.3f);
    for (LoraWeights* lora : {&keras, &peft}) {
      const std::string name = family + (lora == &keras ? " keras" : " peft");
      // Merged kernels: ∂L/∂W_eff of every adapted matrix.
      const GemmaModel merged = merge_lora(base, *lora);
      ModelGradients wgrads;
      wgrads.layers.assign(size_t(config.num_layers), LayerGradients{});
      std::vector<std::vector<float>> grad_w;
      for (const LoraAdapter& ad : lora->adapters) {
        const WeightMatrix& w = *merged.matrix(ad.slot, ad.layer);
        grad_w.emplace_back(size_t(w.rows * w.cols), 0.f);
        wgrads.of(ad.slot, ad.layer) = grad_w.back().data();
      }
      const LossSums merged_sums = forward_backward(meshtune::testing::cpu_context(), merged, tb, 1.0 / double(M), &wgrads);
      // Low-rank terms on the frozen base.
      LoraTensors tensors(meshtune::testing::cpu_backend(), *lora);
      GemmaModel low_rank = base;
      attach_lora(low_rank, *lora, tensors, config);
      ModelGradients none;
      none.layers.assign(size_t(config.num_layers), LayerGradients{});
      const LossSums sums = forward_backward(meshtune::testing::cpu_context(), low_rank, tb, 1.0 / double(M), &none);
      EXPECT_NEAR(sums.weighted_ce, merged_sums.weighted_ce, 1e-5 * merged_sums.weighted_ce) << name;
      for (size_t i = 0; i < lora->adapters.size(); ++i) {
        const LoraAdapter& ad = lora->adapters[i];
        std::vector<double> ga, gb;
        merged_kernel_gradients(config, ad, lora->scale(), grad_w[i], ga, gb);
        EXPECT_LT(relative_difference(to_host(tensors.grad_a[i]), ga), 1e-5) << name << " " << ad.keras_path(config) << " A";
        EXPECT_LT(relative_difference(to_host(tensors.grad_b[i]), gb), 1e-5) << name << " " << ad.keras_path(config) << " B";
      }
    }
  }
}

TEST(Lora, ErrorsNameTheFile) {
  GemmaModel tiny = tiny_model();
  GemmaConfig g2 = tiny_model("gemma2-tiny").config;
  const std::string fixture_path = fixture(kLoraDir + "adapter.lora.h5");
  // A Gemma 1 adapter on the Gemma 2 model: index 8 is block 0's attention_output there.
  expect_error([&] { load_keras_lora(fixture_path, g2); }, {fixture_path, "lora/"});

  auto ds = read_h5_datasets(fixture_path);
  auto write_variant = [&](const std::string& file, auto&& edit) {
    std::map<std::string, HostTensor> copy = ds;
    edit(copy);
    std::vector<std::pair<std::string, HostTensor>> list(copy.begin(), copy.end());
    const std::string path = make_temp_dir("lora-bad") + "/" + file;
    write_h5_datasets(path, list);
    return path;
  };
  // A tensor whose rank disagrees with /lora/vars/rank.
  std::string bad_rank = write_variant("rank.lora.h5", [](auto& m) {
    m["lora/10/vars/lora_kernel_a"] = HostTensor::allocate(DType::F32, {4, 64, 3});
  });
  expect_error([&] { load_keras_lora(bad_rank, tiny.config); }, {bad_rank, "lora/10/vars/lora_kernel_a", "(4, 64, 3)"});
  // A tensor whose shape does not fit the model.
  std::string bad_shape = write_variant("shape.lora.h5", [](auto& m) {
    m["lora/10/vars/lora_kernel_a"] = HostTensor::allocate(DType::F32, {4, 32, 2});
  });
  expect_error([&] { load_keras_lora(bad_shape, tiny.config); }, {bad_shape, "lora/10/vars/lora_kernel_a", "(4, 64, 2)"});
  // An index that is no adaptable kernel (0 = token_embedding).
  std::string bad_index = write_variant("index.lora.h5", [](auto& m) {
    m["lora/0/vars/lora_kernel_a"] = m["lora/8/vars/lora_kernel_a"];
  });
  expect_error([&] { load_keras_lora(bad_index, tiny.config); }, {bad_index, "lora/0/vars/lora_kernel_a"});
  std::string no_rank = write_variant("norank.lora.h5", [](auto& m) { m.erase("lora/vars/rank"); });
  expect_error([&] { load_keras_lora(no_rank, tiny.config); }, {no_rank, "rank"});
  std::string half = write_variant("half.lora.h5", [](auto& m) { m.erase("lora/8/vars/lora_kernel_b"); });
  expect_error([&] { load_keras_lora(half, tiny.config); }, {half, "lora/8"});

  // PEFT: a gemma-tiny adapter on the Gemma 2 model, and a tensor with a wrong shape.
  const std::string dir = make_temp_dir("peft-bad");
  save_peft_adapter(dir, tiny.config, load_keras_lora(fixture_path, tiny.config));
  expect_error([&] { load_peft_adapter(dir, g2); }, {dir + "/adapter_model.safetensors", "lora_"});
  auto tensors = read_safetensors(dir + "/adapter_model.safetensors");
  tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"] = HostTensor::allocate(DType::F32, {17, 2});
  write_safetensors(dir + "/adapter_model.safetensors", {tensors.begin(), tensors.end()});
  expect_error([&] { load_peft_adapter(dir, tiny.config); },
               {dir + "/adapter_model.safetensors", "layers.1.self_attn.v_proj.lora_B.weight", "(17, 2)"});
  expect_error([&] { load_lora_adapter(dir + "/nothing-here", tiny.config); }, {dir + "/nothing-here"});

  // validate_lora names the source, the variable and the shapes.
  LoraWeights w = enable_lora(tiny.config, 2, {Slot::Query}, 1);
  w.adapters[1].a_shape = {4, 64, 3};
  expect_error([&] { validate_lora(tiny.config, w, "my-source"); },
               {"my-source", "decoder_block_1/attention/query", "(4, 64, 3)", "(4, 64, 2)"});
  LoraWeights far = enable_lora(tiny.config, 2, {Slot::Query}, 1);
  far.adapters[0].layer = 7;
  expect_error([&] { validate_lora(tiny.config, far, "src2"); }, {"src2", "layer 7"});
  LoraWeights norm = enable_lora(tiny.config, 2, {Slot::Query}, 1);
  norm.adapters[0].slot = Slot::PreFfwNorm;
  expect_error([&] { validate_lora(tiny.config, norm, "src3"); }, {"src3", "pre_ffw_norm"});
  EXPECT_THROW(merge_lora(tiny, far), Error);
}

}  // namespace
