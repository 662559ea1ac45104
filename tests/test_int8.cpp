// int8 as Keras' quantize("int8") does it, against ../shared/fixtures/keras2 (int8.md is the
// contract): the int8 linear kernel on every CPU path against its plain-loop reference (bit for
// bit), the quantizer's rounding, codes and scales of our quantization equal to the ones Keras
// saved, every int8 layer of block 0 bit-identical to Keras' trace, and the whole model's logits
// (also with LoRA on the int8 base) within int8.md §6's tolerances. Bad int8 presets are errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include "core/error.h"
#include "cpu_path_test.h"
#include "generate/generate.h"
#include "io/keras_h5.h"
#include "io/npy.h"
#include "backend/cpu/isa/features.h"
#include "backend/cpu/int8.h"
#include "backend/cpu/isa/onednn.h"
#include "backend/cpu/linear.h"
#include "model/backward.h"
#include "model/lora.h"
#include "model/variables.h"
#include "store/load.h"
#include "store/lora_files.h"
#include "test_util.h"

using namespace meshtune;
using namespace meshtune::testing;
namespace fs = std::filesystem;

namespace {

const std::string kInt8Preset = "keras2/preset-gemma-tiny-int8";
const std::string kFloatPreset = "keras/preset-gemma-tiny";
const std::string kOutputs = "keras2/int8-gemma-tiny/";

WeightMatrix random_int8_matrix(int64_t rows, int64_t cols, uint32_t seed) {
  return quantize_matrix_int8(WeightMatrix::from_f32(rows, cols, random_vector(size_t(rows * cols), seed)));
}

bool bit_equal(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

// The kernels on the best path this machine has (the per-path tests take each path).
KernelPath best_path() { return make_kernel_path(supported_cpu_paths().back()); }

class Int8Linear : public CpuPathTest {};

// Integer sums are exact, so every path must give the reference's floats bit for bit — over row
// counts and widths that are not multiples of the SIMD width, the row blocks or the thread split.
// Our own kernels at every row count (oneDNN off), then with oneDNN taking the larger ones.
void expect_every_shape_equals_reference(const KernelPath& path) {
  for (int64_t M : {1, 2, 3, 4, 5, 7, 130})
    for (int64_t rows : {1, 3, 17, 61, 257})
      for (int64_t cols : {1, 15, 16, 17, 31, 33, 100, 2049}) {
        SCOPED_TRACE("M=" + std::to_string(M) + " rows=" + std::to_string(rows) + " cols=" + std::to_string(cols));
        const WeightMatrix w = random_int8_matrix(rows, cols, uint32_t(rows * 131 + cols));
        const std::vector<float> x = random_vector(size_t(M * cols), uint32_t(M * 7 + cols));
        std::vector<float> y(size_t(M * rows), NAN), ref(size_t(M * rows));
        linear(path, x.data(), M, w, y.data());
        reference_linear(x.data(), M, w, ref.data());
        int failures = 0;
        for (size_t i = 0; i < y.size() && failures < 3; ++i)
          if (!bit_equal(y[i], ref[i])) {
            ADD_FAILURE() << "y[" << i << "] = " << y[i] << ", reference " << ref[i];
            ++failures;
          }
      }
}

TEST_P(Int8Linear, EveryPathEqualsTheReferenceBitForBit) {
  expect_every_shape_equals_reference(make_kernel_path(GetParam()));
  ProductRoutes routes{};
  routes[size_t(Product::Int8Linear)] = true;
  const KernelPath onednn = make_kernel_path(GetParam(), routes);
  if (!int8_uses_onednn(onednn, 5))
    GTEST_SKIP() << (cpu::onednn_available() ? "oneDNN's int8 sums are not exact on this CPU (no VNNI): not used"
                                             : "built without oneDNN");
  expect_every_shape_equals_reference(onednn);
}

INSTANTIATE_TEST_SUITE_P(CpuPaths, Int8Linear, kEveryCpuPath, cpu_path_test_name);

// Ties round half to even (np.round), not away from zero: with max |v| = m the scale is ≈ 127/m,
// so v = k.5·m/127 lands on k.5 exactly when the float arithmetic allows; we build such values
// from the scale itself and check both neighbours of an even and an odd floor.
TEST(Int8Quantize, RoundsHalfToEvenAndClips) {
  const float m = 127.f;  // scale = 127 / (127 + 1e-7) rounds to exactly 1 in float32
  const std::vector<float> v = {2.5f, 3.5f, -2.5f, -3.5f, 0.5f, 1.5f, m, -m};
  std::vector<int8_t> codes(v.size());
  const float s = quantize_int8(v.data(), int64_t(v.size()), codes.data());
  ASSERT_EQ(s, 1.f);
  EXPECT_EQ(std::vector<int>(codes.begin(), codes.end()), (std::vector<int>{2, 4, -2, -4, 0, 2, 127, -127}));
  // An all-zero row: scale 127/1e-7, codes 0, so the layer's output is 0.
  const std::vector<float> zero(5, 0.f);
  EXPECT_EQ(quantize_int8(zero.data(), 5, codes.data()), 127.f / 1e-7f);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(codes[size_t(i)], 0);
}

// The vectorisable rounding (1.5·2²³ added and subtracted after clipping) equals Keras' definition,
// clip(nearbyint(v·s), -127, 127), on ties, at the clipping edges and over a sweep of values.
TEST(Int8Quantize, EqualsClippedNearbyintEverywhere) {
  std::vector<float> v;
  for (int k = -300; k <= 300; ++k) v.insert(v.end(), {0.5f * float(k), 0.5f * float(k) + 1e-4f, 0.5f * float(k) - 1e-4f});
  for (float x : {126.5f, -126.5f, 127.49f, 127.5f, -127.5f, 128.f, 1e9f, -1e9f, -0.f, 0.49999997f, -0.49999997f,
                  8388607.5f, std::numeric_limits<float>::max(), -std::numeric_limits<float>::infinity()})
    v.push_back(x);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 60.f);
  for (int i = 0; i < 10000; ++i) v.push_back(normal(rng));
  for (float s : {1.f, 0.37f, 3.1f}) {
    std::vector<int8_t> codes(v.size());
    quantize_int8_scaled(v.data(), int64_t(v.size()), s, codes.data());
    for (size_t i = 0; i < v.size(); ++i)
      ASSERT_EQ(int(codes[i]), int(std::clamp(std::nearbyint(v[i] * s), -127.f, 127.f))) << v[i] << " × " << s;
  }
}

// The backward is straight-through, as Keras' int8 EinsumDense gradient: dx = dy · (codes / scale),
// the same numbers as the backward over the dequantized matrix.
TEST(Int8Linear, BackwardUsesTheDequantizedWeights) {
  const WeightMatrix w = random_int8_matrix(37, 70, 3);
  const WeightMatrix dequantized = WeightMatrix::from_f32(w.rows, w.cols, w.to_f32());
  const std::vector<float> dy = random_vector(5 * 37, 4);
  std::vector<float> dx(5 * 70), want(5 * 70);
  const KernelPath path = best_path();
  linear_backward_input(path, dy.data(), 5, w, dx.data());
  linear_backward_input(path, dy.data(), 5, dequantized, want.data());
  EXPECT_EQ(dx, want);
  EXPECT_EQ(w.at(3, 5), float(w.i8()[3 * 70 + 5]) / w.scales[3]);
}

// A row wider than 133,144 codes could overflow the int32 sums: refused, not wrapped.
TEST(Int8Linear, TooWideForInt32SumsIsAnError) {
  const WeightMatrix wide = WeightMatrix::from_f32(1, kMaxInt8Columns + 1, std::vector<float>(kMaxInt8Columns + 1, 1.f));
  EXPECT_THROW(quantize_matrix_int8(wide), Error);
  WeightMatrix codes = random_int8_matrix(1, kMaxInt8Columns, 9);  // the widest allowed works
  std::vector<float> x(kMaxInt8Columns, 1.f), y(1), ref(1);
  linear(best_path(), x.data(), 1, codes, y.data());
  reference_linear(x.data(), 1, codes, ref.data());
  EXPECT_TRUE(bit_equal(y[0], ref[0]));
  codes.cols = kMaxInt8Columns + 1;  // a hostile view
  EXPECT_THROW(linear_int8(best_path(), x.data(), 1, codes, y.data()), Error);
}

// ---- against Keras ------------------------------------------------------------------------------

// Our quantization of the float preset gives exactly the codes and scales Keras saved.
TEST(Int8Keras, QuantizingTheFloatPresetGivesKerasCodesAndScales) {
  LoadOptions quantize;
  quantize.quantize_int8 = true;
  const GemmaModel ours = load_model(inspect_model_dir(fixture(kFloatPreset)), quantize);
  const GemmaModel keras = load_model(inspect_model_dir(fixture(kInt8Preset)));
  ASSERT_EQ(keras.config.int8_layers.size(), 15u);
  int matrices = 0;
  for (const VariableSpec& spec : gemma_variables(keras.config)) {
    const WeightMatrix* a = ours.matrix(spec.slot, spec.layer);
    const WeightMatrix* b = keras.matrix(spec.slot, spec.layer);
    if (!a) continue;
    SCOPED_TRACE(spec.keras_path);
    ASSERT_EQ(a->dtype, DType::I8);
    ASSERT_EQ(b->dtype, DType::I8);
    ASSERT_EQ(a->rows, b->rows);
    ASSERT_EQ(a->cols, b->cols);
    EXPECT_EQ(std::memcmp(a->data, b->data, size_t(a->rows * a->cols)), 0) << "codes differ";
    EXPECT_EQ(std::memcmp(a->scales, b->scales, size_t(a->rows) * 4), 0) << "scales differ";
    ++matrices;
  }
  EXPECT_EQ(matrices, 15);
}

// Teacher-forced: each int8 layer of block 0 fed Keras' recorded input gives Keras' activation
// codes, scales and output bit for bit; so does the tied head (its output is logits.npy).
TEST(Int8Keras, EveryLayerOfBlock0AndTheHeadBitIdentical) {
  const GemmaModel model = load_model(inspect_model_dir(fixture(kInt8Preset)));
  const std::string out = fixture(kOutputs);
  struct Layer {
    std::string name;
    const WeightMatrix* w;
  };
  const DecoderLayerWeights& l = model.layers[0];
  const std::vector<Layer> layers = {
      {"b0_query", &l.query},           {"b0_key", &l.key},
      {"b0_value", &l.value},           {"b0_attention_output", &l.attention_output},
      {"b0_ffw_gating", &l.ffw_gating}, {"b0_ffw_gating_2", &l.ffw_gating_2},
      {"b0_ffw_linear", &l.ffw_linear}, {"token_embedding_reverse", &model.embeddings}};
  for (const Layer& layer : layers) {
    SCOPED_TRACE(layer.name);
    const std::string trace = out + "trace_" + layer.name;
    const std::vector<float> x = npy_floats(trace + "_input.npy");
    const std::vector<float> want_scales = npy_floats(trace + "_input_scale.npy");
    const HostTensor want_codes = read_npy(trace + "_input_int8.npy");
    ASSERT_EQ(want_codes.dtype, DType::I8);
    const int64_t cols = layer.w->cols, M = int64_t(x.size()) / cols;
    ASSERT_EQ(int64_t(want_scales.size()), M);
    std::vector<int8_t> codes(static_cast<size_t>(cols));
    for (int64_t m = 0; m < M; ++m) {
      const float s = quantize_int8(x.data() + m * cols, cols, codes.data());
      ASSERT_TRUE(bit_equal(s, want_scales[size_t(m)])) << "row " << m << ": scale " << s << " vs " << want_scales[size_t(m)];
      ASSERT_EQ(std::memcmp(codes.data(), want_codes.as<int8_t>() + m * cols, size_t(cols)), 0) << "row " << m;
    }
    const std::vector<float> want = npy_floats(layer.name == "token_embedding_reverse" ? out + "logits.npy"
                                                                                        : trace + "_output.npy");
    std::vector<float> y(size_t(M * layer.w->rows));
    ASSERT_EQ(y.size(), want.size());
    linear(best_path(), x.data(), M, *layer.w, y.data());
    size_t differ = 0;
    for (size_t i = 0; i < y.size(); ++i) differ += !bit_equal(y[i], want[i]);
    EXPECT_EQ(differ, 0u) << "of " << y.size() << " outputs";
  }
}

// Median and max |Δ| over the real tokens (int8.md §6: the median separates a right
// implementation from a wrong one, the max alone cannot).
void expect_logits_close(const std::vector<float>& got, const std::vector<float>& want, const std::vector<int32_t>& mask,
                         size_t width) {
  ASSERT_EQ(got.size(), want.size());
  std::vector<double> diffs;
  for (size_t t = 0; t < mask.size(); ++t)
    if (mask[t])
      for (size_t v = 0; v < width; ++v) diffs.push_back(std::abs(double(got[t * width + v]) - want[t * width + v]));
  ASSERT_FALSE(diffs.empty());
  std::nth_element(diffs.begin(), diffs.begin() + diffs.size() / 2, diffs.end());
  const double median = diffs[diffs.size() / 2], max = *std::max_element(diffs.begin(), diffs.end());
  std::printf("    median |Δ| %.3g, max |Δ| %.3g over %zu values\n", median, max, diffs.size());
  EXPECT_LE(median, 1e-4);
  EXPECT_LE(max, 0.5);
}

TEST(Int8Keras, LogitsOfTheInt8PresetAndOfQuantizeAtLoad) {
  const std::vector<int32_t> mask = npy_ints(fixture("keras/outputs-gemma-tiny/padding_mask.npy"));
  const std::vector<float> want = npy_floats(fixture(kOutputs + "logits.npy"));
  const GemmaModel preset = load_model(inspect_model_dir(fixture(kInt8Preset)));
  expect_logits_close(fixture_logits(preset), want, mask, size_t(preset.config.vocab_size));
  LoadOptions quantize;
  quantize.quantize_int8 = true;
  const GemmaModel quantized = load_model(inspect_model_dir(fixture(kFloatPreset)), quantize);
  expect_logits_close(fixture_logits(quantized), want, mask, size_t(quantized.config.vocab_size));
}

// LoRA on the int8 base: y = int8 path + scale·(x·A)·B on the float input (int8.md §5).
TEST(Int8Keras, LoraOnTheInt8BaseAsLowRankTerms) {
  GemmaModel model = load_model(inspect_model_dir(fixture(kInt8Preset)));
  LoraWeights lora = load_lora_adapter(fixture(kOutputs + "adapter.lora.h5"), model.config);
  attach_lora(model, lora, model.config);
  const std::vector<int32_t> mask = npy_ints(fixture("keras/outputs-gemma-tiny/padding_mask.npy"));
  expect_logits_close(fixture_logits(model), npy_floats(fixture(kOutputs + "logits_with_random_lora.npy")), mask,
                      size_t(model.config.vocab_size));
}

TEST(Int8Keras, GreedyIdsEqualKeras) {
  const GemmaModel model = load_model(inspect_model_dir(fixture(kInt8Preset)));
  const std::string out = fixture(kOutputs);
  const PromptRows prompts = read_prompt_rows(out + "generate_prompt_token_ids.npy", out + "generate_prompt_padding_mask.npy");
  const int64_t B = prompts.batch, L = prompts.length;
  const std::vector<int32_t> expected = npy_ints(out + "generate_greedy_token_ids.npy");
  GenerateOptions options;
  options.max_length = int(L);
  const GeneratedIds got = generate_ids(meshtune::testing::cpu_context(), model, prompts.rows, prompts.masks, options);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < L; ++i) EXPECT_EQ(got.token_ids[size_t(b)][size_t(i)], expected[size_t(b * L + i)]);
}

// Keras' save_weights of the int8 + LoRA model merges each adapter into its dequantized kernel and
// quantizes again (int8.md §5): merge_lora over int8 weights gives those codes and scales.
TEST(Int8Keras, MergingLoraReQuantizesLikeKeras) {
  const GemmaModel base = load_model(inspect_model_dir(fixture(kInt8Preset)));
  const LoraWeights lora = load_lora_adapter(fixture(kOutputs + "adapter.lora.h5"), base.config);
  const GemmaModel merged = merge_lora(base, lora);
  const std::map<std::string, HostTensor> keras = read_h5_datasets(fixture(kOutputs + "model_with_lora_merged.weights.h5"));
  int adapted = 0;
  for (const VariableSpec& spec : gemma_variables(base.config)) {
    const WeightMatrix* m = merged.matrix(spec.slot, spec.layer);
    if (!m) continue;
    SCOPED_TRACE(spec.keras_path);
    ASSERT_EQ(m->dtype, DType::I8);
    const HostTensor codes = keras_to_ours(keras.at(spec.h5_path), spec.kind);
    const HostTensor& scales = keras.at(keras_int8_scale_path(spec));
    EXPECT_EQ(std::memcmp(m->data, codes.data, codes.nbytes()), 0) << "codes differ";
    // Within 1e-6 relative (a few ulp), not bit for bit: this oracle's NumPy formed A·B with fused
    // multiply-adds (its BLAS kernel), the float oracle's without (test_lora's merged kernels are
    // bit-exact that way) and we follow the float one; a row's largest |W + ΔW| then differs in its
    // last bits. Measured: 9 rows of the four adapted matrices differ, by 1–2 ulp.
    for (int64_t r = 0; r < m->rows; ++r)
      EXPECT_NEAR(m->scales[r], scales.as<float>()[r], 1e-6 * std::abs(scales.as<float>()[r])) << "row " << r;
    adapted += m->data != base.matrix(spec.slot, spec.layer)->data;
  }
  EXPECT_EQ(adapted, 4);  // query and value of both blocks
}

// export --to keras writes an int8 preset as Keras does: the same datasets (codes, scales in
// their broadcast shapes, float norms) byte for byte, the same DTypePolicyMap; it loads back.
TEST(Int8Cli, ExportWritesAKerasInt8Preset) {
  for (const std::string& source : {fixture(kInt8Preset), fixture(kFloatPreset) + " --quantize int8"}) {
    SCOPED_TRACE(source);
    const std::string out = make_temp_dir("int8-export") + "/preset";
    const CommandResult r = run_meshtune("export " + source + " --to keras " + out);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto ours = read_h5_datasets(out + "/model.weights.h5");
    const auto keras = read_h5_datasets(fixture(kInt8Preset) + "/model.weights.h5");
    ASSERT_EQ(ours.size(), keras.size());
    for (const auto& [name, t] : keras) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(ours.count(name));
      const HostTensor& o = ours.at(name);
      EXPECT_EQ(o.dtype, t.dtype);
      EXPECT_EQ(o.shape, t.shape);
      EXPECT_EQ(o.nbytes() == t.nbytes() && std::memcmp(o.data, t.data, t.nbytes()) == 0, true) << "bytes differ";
    }
    const nlohmann::json ours_config = load_json(out + "/config.json"), keras_config = load_json(fixture(kInt8Preset) + "/config.json");
    EXPECT_EQ(ours_config["config"]["dtype"], keras_config["config"]["dtype"]);
    EXPECT_EQ(load_json(out + "/metadata.json")["parameter_count"], load_json(fixture(kInt8Preset) + "/metadata.json")["parameter_count"]);
    const GemmaModel back = load_model(inspect_model_dir(out));
    EXPECT_TRUE(back.has_int8());
  }
  const CommandResult hf = run_meshtune("export " + fixture(kInt8Preset) + " --to hf " + make_temp_dir("int8-hf") + "/m");
  EXPECT_EQ(hf.exit_code, 1);
  EXPECT_NE(hf.err.find("no int8 form"), std::string::npos) << hf.err;
}

// info lists an int8 preset's variables as Keras does: int8 kernels, their float32 scales as
// variables of their own, and the parameter count Keras' metadata.json gives (scales included).
TEST(Int8Cli, InfoShowsDtypesScalesAndKerasParameterCount) {
  const CommandResult r = run_meshtune("info " + fixture(kInt8Preset));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const long long keras_count = load_json(fixture(kInt8Preset) + "/metadata.json")["parameter_count"];
  EXPECT_EQ(keras_count, 135912);
  EXPECT_NE(r.out.find("Total params: 135,912"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Trainable params: 320 "), std::string::npos) << r.out;  // the norm scales
  for (const std::string line : {"decoder_block_0/attention/query/kernel        ", "(4, 64, 16)             int8",
                                 "decoder_block_0/attention/query/kernel_scale  ", "(1, 1, 4, 16)           float32",
                                 "token_embedding/embeddings_scale", "(1000,)                 float32"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
}

TEST(Int8Cli, FullFineTuningOfInt8WeightsIsRefused) {
  const CommandResult r = run_meshtune("finetune " + fixture(kInt8Preset) + " --full --data sample --take 4 --steps 1 "
                                       "--batch-size 2 --seq-len 16 --no-progress --out " + make_temp_dir("int8-full") + "/run");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("LoRA"), std::string::npos) << r.err;
}

// LoRA trained over the int8 base: the loss is the int8 model's, and every ∂A, ∂B points the way
// the same adapter's gradient over the dequantized float model does (cosine ≥ 0.999: the two
// forwards differ by the activation quantization only; a wrong input gradient through the int8
// layers — zero, codes without their scale — fails this).
TEST(Int8Keras, LoraGradientsOverTheInt8Base) {
  const GemmaModel int8_base = load_model(inspect_model_dir(fixture(kInt8Preset)));
  GemmaModel float_base = int8_base;
  for (const VariableSpec& spec : gemma_variables(float_base.config))
    if (WeightMatrix* w = float_base.matrix(spec.slot, spec.layer)) *w = WeightMatrix::from_f32(w->rows, w->cols, w->to_f32());
  const NextTokenBatch next = fixture_next_token_batch();
  const TokenBatch batch = next.view();
  const int64_t B = next.batch, T = next.length;
  std::vector<LoraTensors> tensors;
  std::vector<double> losses;
  for (const GemmaModel* base : std::vector<const GemmaModel*>{&int8_base, &float_base}) {
    const LoraWeights lora = load_lora_adapter(fixture(kOutputs + "adapter.lora.h5"), base->config);
    tensors.emplace_back(meshtune::testing::cpu_backend(), lora);
    GemmaModel model = *base;
    attach_lora(model, lora, tensors.back(), model.config);
    ModelGradients none;
    none.layers.assign(size_t(model.config.num_layers), LayerGradients{});
    losses.push_back(forward_backward(meshtune::testing::cpu_context(), model, batch, 1.0 / double(B * T), &none).weighted_ce);
  }
  EXPECT_NEAR(losses[0], losses[1], 1e-2 * losses[1]);
  for (size_t i = 0; i < tensors[0].a.size(); ++i)
    for (bool a : {true, false}) {
      const std::vector<float> g = meshtune::testing::to_host(a ? tensors[0].grad_a[i] : tensors[0].grad_b[i]);
      const std::vector<float> f = meshtune::testing::to_host(a ? tensors[1].grad_a[i] : tensors[1].grad_b[i]);
      const double cosine = cosine_similarity(g, f);
      std::printf("    adapter %zu %s: cosine %.6f\n", i, a ? "A" : "B", cosine);
      EXPECT_GE(cosine, 0.999);
    }
}

// ---- bad int8 presets: one clear error each -------------------------------------------------------

// A copy of the int8 preset with `edit` applied to its config.json and `datasets` to its weights.
std::string damaged_preset(const std::string& tag, const std::function<void(nlohmann::json&)>& edit_config,
                           const std::function<void(std::map<std::string, HostTensor>&)>& edit_weights = {}) {
  const std::string dir = make_temp_dir("int8-" + tag) + "/preset";
  fs::copy(fixture(kInt8Preset), dir, fs::copy_options::recursive);
  nlohmann::json config = load_json(dir + "/config.json");
  edit_config(config);
  std::ofstream(dir + "/config.json") << config.dump(1);
  if (edit_weights) {
    std::map<std::string, HostTensor> datasets = read_h5_datasets(dir + "/model.weights.h5");
    edit_weights(datasets);
    std::vector<std::pair<std::string, HostTensor>> list(datasets.begin(), datasets.end());
    write_h5_datasets(dir + "/model.weights.h5", list);
  }
  return dir;
}

void expect_load_error(const std::string& dir, const std::vector<std::string>& needles) {
  try {
    load_model(inspect_model_dir(dir));
    ADD_FAILURE() << "loaded without an error";
  } catch (const Error& e) {
    for (const std::string& needle : needles)
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "missing '" << needle << "' in: " << e.what();
  }
}

nlohmann::json& policy_map(nlohmann::json& config) { return config["config"]["dtype"]["config"]["policy_map"]; }
const std::string kQuery0Scale = "layers/gemma_decoder_block/attention/query_dense/vars/1";

TEST(Int8Hostile, ScaleWithTheWrongShape) {
  expect_load_error(damaged_preset("scale-shape", [](nlohmann::json&) {}, [](std::map<std::string, HostTensor>& d) {
    HostTensor& s = d.at(kQuery0Scale);
    s.shape = {1, s.shape[2], s.shape[3]};  // (1, n, h): a broadcast dimension dropped
  }), {"model.weights.h5", kQuery0Scale, "shape", "(1, 1, "});
}

TEST(Int8Hostile, ScaleWithTheWrongDtype) {
  expect_load_error(damaged_preset("scale-dtype", [](nlohmann::json&) {}, [](std::map<std::string, HostTensor>& d) {
    HostTensor& s = d.at(kQuery0Scale);
    HostTensor wide = HostTensor::allocate(DType::I32, s.shape);
    d[kQuery0Scale] = wide;
  }), {kQuery0Scale, "int32", "float32"});
}

TEST(Int8Hostile, MissingScale) {
  expect_load_error(damaged_preset("scale-missing", [](nlohmann::json&) {},
                                   [](std::map<std::string, HostTensor>& d) { d.erase(kQuery0Scale); }),
                    {"missing tensor", kQuery0Scale});
}

TEST(Int8Hostile, PolicyMapNamesALayerThatDoesNotExist) {
  expect_load_error(damaged_preset("no-layer", [](nlohmann::json& c) {
    policy_map(c)["decoder_block_7/attention/query"] = policy_map(c)["token_embedding"];
  }), {"config.json", "decoder_block_7/attention/query"});
}

TEST(Int8Hostile, PolicyMapWithAnotherMode) {
  expect_load_error(damaged_preset("int4", [](nlohmann::json& c) {
    policy_map(c)["token_embedding"]["config"]["mode"] = "int4";
  }), {"config.json", "int4", "only int8"});
}

TEST(Int8Hostile, FloatLayerStoredAsInt8) {
  expect_load_error(damaged_preset("unmapped", [](nlohmann::json& c) { policy_map(c).erase("decoder_block_0/ffw_linear"); }),
                    {"ffw_linear", "int8", "dtype policy map"});
}

TEST(Int8Cli, QuantizeInt4IsRefused) {
  const CommandResult r = run_meshtune("logits " + fixture(kFloatPreset) + " --quantize int4 --token-ids " +
                                       fixture("keras/outputs-gemma-tiny/token_ids.npy"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("int4"), std::string::npos) << r.err;
}

TEST(Int8Cli, GenerateOnAnInt8PresetAndWithQuantize) {
  for (const std::string& args : {fixture(kInt8Preset), fixture(kFloatPreset) + " --quantize int8"}) {
    const CommandResult r = run_meshtune("generate " + args + " --prompt 'The quick' --max-length 12");
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_FALSE(r.out.empty());
  }
}

}  // namespace

// A Keras kernel quantized as it is permuted, band by band (keras_kernel_to_int8, the load's path
// for int8), equals permuting it first and quantizing the result: every code and scale, for each
// permuted kind, in F32 and BF16, with row counts that leave a partial band and (query kernels)
// bands that cross from one head to the next.
TEST(Int8Quantize, KerasKernelsQuantizedWhilePermutedEqualPermutingFirst) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  const std::vector<std::pair<VarKind, Shape>> kernels = {
      {VarKind::HeadsIn, {7, 37, 5}}, {VarKind::HeadsOut, {3, 5, 37}}, {VarKind::Dense, {37, 21}}};
  for (const auto& [kind, shape] : kernels)
    for (DType dtype : {DType::F32, DType::BF16}) {
      HostTensor k = HostTensor::allocate(dtype, shape);
      for (int64_t i = 0; i < num_elements(shape); ++i) {
        const float v = normal(rng) * (i % 11 == 0 ? 40.f : 1.f);  // some rows with outliers
        if (dtype == DType::F32) k.mutable_as<float>()[i] = v;
        else k.mutable_as<uint16_t>()[i] = f32_to_bf16(v);
      }
      const HostTensor ours = keras_to_ours(k, kind);
      WeightMatrix permuted;
      permuted.rows = ours.shape[0];
      permuted.cols = ours.shape[1];
      permuted.dtype = dtype;
      permuted.data = ours.data;
      const WeightMatrix want = quantize_matrix_int8(permuted);
      const std::optional<WeightMatrix> got = keras_kernel_to_int8(k, kind);
      ASSERT_TRUE(got.has_value());
      ASSERT_EQ(got->rows, want.rows);
      ASSERT_EQ(got->cols, want.cols);
      EXPECT_EQ(0, std::memcmp(got->i8(), want.i8(), size_t(want.rows * want.cols))) << int(kind) << " " << int(dtype);
      EXPECT_EQ(std::vector<float>(got->scales, got->scales + got->rows),
                std::vector<float>(want.scales, want.scales + want.rows));
    }
  EXPECT_FALSE(keras_kernel_to_int8(HostTensor::allocate(DType::F32, {10, 4}), VarKind::Embedding).has_value());
}
