// Keras' dtype policies (--dtype-policy): under mixed_bfloat16 and bfloat16 the projections, the
// tied head and their input gradients take bf16 inputs with fp32 sums (backend/cpu/linear.h
// MatmulPrecision::BF16). The kernel on every CPU path (oneDNN's bf16 matmul on the avx512bf16
// path, the widening fallback elsewhere) against the plain loop over the same rounded inputs; the
// model against fp32: logits within bf16 tolerance, LoRA gradients pointing the same way (cosine ≥
// 0.999), a 20-step LoRA loss trajectory within 1e-2; and the CLI's policy flags.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "cpu_path_test.h"
#include "backend/cpu/linear.h"
#include "model/lora.h"
#include "store/load.h"
#include "test_util.h"

using namespace meshtune;
using namespace meshtune::testing;

namespace {

class Bf16Matmul : public CpuPathTest {};

WeightMatrix random_matrix(int64_t rows, int64_t cols, DType dtype, uint32_t seed) {
  WeightMatrix w = WeightMatrix::from_f32(rows, cols, random_vector(size_t(rows * cols), seed));
  return dtype == DType::BF16 ? to_bf16_matrix(w) : w;
}

// |a − b| ≤ 1e-5 of the sum of the products' magnitudes (what fp32 sums in any order can differ by).
void expect_close_sums(const std::vector<float>& got, const std::vector<float>& want, const std::vector<double>& scale,
                       const std::string& what) {
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 1e-5 * scale[i] + 1e-30) << what << " at " << i;
}

// On the avx512bf16 path both routes: oneDNN's bf16 matmul and the widened values through sgemm.
TEST_P(Bf16Matmul, ForwardAndInputGradientEqualThePlainLoopOverRoundedInputs) {
  for (const bool onednn : {false, true}) {
    ProductRoutes routes{};
    routes.fill(onednn);
    const KernelPath k = make_kernel_path(GetParam(), routes);
    if (onednn && !k.uses_onednn(Product::Bf16Linear)) continue;  // not this path, or no oneDNN
    SCOPED_TRACE(onednn ? "oneDNN bf16 matmul" : "widened values through sgemm");
    for (const DType dtype : {DType::F32, DType::BF16})
      for (const int64_t M : {1, 3, 5, 17, 64})
        for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{37, 29}, {129, 300}, {256, 64}}) {
          std::ostringstream what;
          what << dtype_name(dtype) << " W " << rows << "×" << cols << ", M " << M;
          const WeightMatrix W = random_matrix(rows, cols, dtype, uint32_t(M * 7 + rows));
          const std::vector<float> x = random_vector(size_t(M * cols), uint32_t(cols + M));
          std::vector<float> y(size_t(M * rows)), want(y.size());
          linear(k, x.data(), M, W, y.data(), MatmulPrecision::BF16);
          reference_linear(x.data(), M, W, want.data(), MatmulPrecision::BF16);
          std::vector<double> scale(y.size());
          for (int64_t m = 0; m < M; ++m)
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t c = 0; c < cols; ++c)
                scale[size_t(m * rows + r)] += std::fabs(double(round_to_bf16(x[size_t(m * cols + c)])) * round_to_bf16(W.at(r, c)));
          expect_close_sums(y, want, scale, "forward " + what.str());

          // dx = round(dy)·round(W), overwriting and accumulating.
          const std::vector<float> dy = random_vector(size_t(M * rows), uint32_t(rows + 3 * M));
          std::vector<float> dx(size_t(M * cols), 0.5f), dx_want(dx.size(), 0.f);
          std::vector<double> dx_scale(dx.size(), 0.5);
          for (int64_t m = 0; m < M; ++m)
            for (int64_t c = 0; c < cols; ++c) {
              double acc = 0;
              for (int64_t r = 0; r < rows; ++r) {
                const double p = double(round_to_bf16(dy[size_t(m * rows + r)])) * round_to_bf16(W.at(r, c));
                acc += p;
                dx_scale[size_t(m * cols + c)] += std::fabs(p);
              }
              dx_want[size_t(m * cols + c)] = float(acc);
            }
          std::vector<float> overwritten(dx.size());
          linear_backward_input(k, dy.data(), M, W, overwritten.data(), false, MatmulPrecision::BF16);
          expect_close_sums(overwritten, dx_want, dx_scale, "dx " + what.str());
          linear_backward_input(k, dy.data(), M, W, dx.data(), true, MatmulPrecision::BF16);
          for (float& v : dx_want) v += 0.5f;
          expect_close_sums(dx, dx_want, dx_scale, "dx accumulated " + what.str());
        }
  }
}

// Rounding the inputs is what the precision means: bf16 results differ from fp32 ones.
TEST_P(Bf16Matmul, DiffersFromFp32) {
  const WeightMatrix W = random_matrix(64, 96, DType::F32, 5);
  const std::vector<float> x = random_vector(size_t(8 * 96), 6);
  std::vector<float> f32(size_t(8 * 64)), bf16(f32.size());
  linear(path(), x.data(), 8, W, f32.data());
  linear(path(), x.data(), 8, W, bf16.data(), MatmulPrecision::BF16);
  double worst = 0;
  for (size_t i = 0; i < f32.size(); ++i) worst = std::max(worst, double(std::fabs(f32[i] - bf16[i])));
  EXPECT_GT(worst, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(CpuPaths, Bf16Matmul, kEveryCpuPath, cpu_path_test_name);

const std::string kPreset = "keras/preset-gemma-tiny";

GemmaModel load_with_policy(bool bf16) {
  LoadOptions options;
  options.bf16_matrices = bf16;
  GemmaModel model = load_model(inspect_model_dir(fixture(kPreset)), options);
  return model;
}

// Logits under mixed_bfloat16 against fp32, over the fixture's valid positions: bf16 keeps 8
// significant bits (relative rounding error ≤ 2^-9 per input), so the logits move by a few
// thousandths of their spread, not more — and they do move.
TEST(MixedBfloat16, LogitsWithinBf16ToleranceOfFp32) {
  const std::vector<int32_t> mask = npy_ints(fixture("keras/outputs-gemma-tiny/padding_mask.npy"));
  const GemmaModel f32 = load_with_policy(false), bf16 = load_with_policy(true);
  const std::vector<float> a = fixture_logits(f32), b = fixture_logits(bf16, MatmulPrecision::BF16);
  const size_t V = size_t(f32.config.vocab_size);
  float lo = 0, hi = 0;
  for (float v : a) lo = std::min(lo, v), hi = std::max(hi, v);
  const double worst = max_diff_valid(a, b, mask, V);
  std::printf("    logits range %.3f, max |Δ| %.4g (%.3g of the range)\n", hi - lo, worst, worst / (hi - lo));
  EXPECT_GT(worst, 0.0);
  EXPECT_LE(worst, 0.02 * (hi - lo));
}

// One LoRA step's gradients under mixed_bfloat16 point the way fp32's do, for every A and B.
TEST(MixedBfloat16, LoraGradientsHaveCosineAtLeast0999ToFp32) {
  const NextTokenBatch next = fixture_next_token_batch();
  std::vector<LoraTensors> tensors;
  for (const bool bf16 : {false, true}) {
    GemmaModel model = load_with_policy(bf16);
    LoraWeights lora = enable_lora(model.config, 4, parse_lora_targets({"all"}), 3);
    for (LoraAdapter& a : lora.adapters)  // non-zero B, so every gradient is non-trivial
      for (size_t i = 0; i < a.b.size(); ++i) a.b[i] = 0.05f * float(int(i % 7) - 3);
    tensors.emplace_back(cpu_backend(), lora);
    attach_lora(model, lora, tensors.back(), model.config);
    ModelGradients none;
    none.layers.assign(size_t(model.config.num_layers), LayerGradients{});
    forward_backward(cpu_context(bf16 ? MatmulPrecision::BF16 : MatmulPrecision::F32), model, next.view(),
                     1.0 / double(next.batch * next.length), &none);
  }
  double least = 1;
  for (size_t i = 0; i < tensors[0].a.size(); ++i)
    for (bool a : {true, false}) {
      const LoraTensors &f32 = tensors[0], &bf16 = tensors[1];
      const double cosine = cosine_similarity(to_host(a ? bf16.grad_a[i] : bf16.grad_b[i]),
                                              to_host(a ? f32.grad_a[i] : f32.grad_b[i]));
      least = std::min(least, cosine);
      EXPECT_GE(cosine, 0.999) << "adapter " << i << (a ? " A" : " B");
      EXPECT_LT(cosine, 1.0 - 1e-12) << "adapter " << i << (a ? " A" : " B") << ": bf16 should round something";
    }
  std::printf("    least cosine over %zu adapters' A and B: %.6f\n", tensors[0].a.size(), least);
}

// Training under mixed_bfloat16 keeps the blocks' activations in bf16: what backward reads is the
// fp32 forward's values rounded to bf16 (block 0's input, the scaled embedding, is the same under
// both policies, so the rounding is all that differs), and a float32 step keeps them exactly.
TEST(MixedBfloat16, TrainingKeepsBlockActivationsInBf16) {
  const NextTokenBatch next = fixture_next_token_batch();
  std::vector<std::vector<float>> inputs;
  for (const bool bf16 : {false, true}) {
    GemmaModel model = load_with_policy(bf16);
    LoraWeights lora = enable_lora(model.config, 4, parse_lora_targets({"all"}), 3);
    attach_lora(model, lora, model.config);
    ModelGradients none;
    none.layers.assign(size_t(model.config.num_layers), LayerGradients{});
    TrainingWorkspace ws;
    forward_backward(cpu_context(bf16 ? MatmulPrecision::BF16 : MatmulPrecision::F32), model, next.view(), 1.0,
                     &none, &ws);
    EXPECT_EQ(ws.blocks.bf16(), bf16);
    const FloatBuffer& input = ws.blocks.backward_set(0).input;
    ASSERT_EQ(input.size(), size_t(next.batch * next.length * model.config.hidden_dim));
    inputs.emplace_back(input.data(), input.data() + input.size());
  }
  size_t rounded = 0;
  for (size_t i = 0; i < inputs[0].size(); ++i) {
    ASSERT_EQ(inputs[1][i], round_to_bf16(inputs[0][i])) << i;
    rounded += inputs[1][i] != inputs[0][i];
  }
  EXPECT_GT(rounded, inputs[0].size() / 2);  // the float32 step keeps its values unrounded
}

// With nothing differentiating the feed-forward (LoRA on q and v, the tutorial's), the blocks keep
// gate and up in bf16 themselves and GeGLU's values and gradients go to the products in bf16
// (Backend::geglu_to_bf16 / geglu_backward_bf16): exactly the gradients of the fp32 ops and their
// narrowing, which a gradient slot for ffw_linear brings back (its ∂W needs GeGLU's fp32 values).
TEST(MixedBfloat16, FeedForwardKeptInBf16GivesTheSameGradients) {
  const NextTokenBatch next = fixture_next_token_batch();
  std::vector<std::vector<float>> gradients;
  for (const bool ffw_linear_gradient : {false, true}) {
    GemmaModel model = load_with_policy(true);
    LoraWeights lora = enable_lora(model.config, 4, parse_lora_targets({}), 3);
    for (LoraAdapter& a : lora.adapters)  // non-zero B, so every gradient is non-trivial
      for (size_t i = 0; i < a.b.size(); ++i) a.b[i] = 0.05f * float(int(i % 7) - 3);
    LoraTensors tensors(cpu_backend(), lora);
    attach_lora(model, lora, tensors, model.config);
    ModelGradients grads;
    grads.layers.assign(size_t(model.config.num_layers), LayerGradients{});
    std::vector<std::vector<float>> ffw_linear(grads.layers.size());
    if (ffw_linear_gradient)
      for (size_t l = 0; l < grads.layers.size(); ++l) {
        const WeightMatrix W = model.layer_weights(int(l)).ffw_linear;
        ffw_linear[l].assign(size_t(W.rows * W.cols), 0.f);
        grads.layers[l].ffw_linear = ffw_linear[l].data();
      }
    TrainingWorkspace ws;
    forward_backward(cpu_context(MatmulPrecision::BF16), model, next.view(), 1.0 / double(next.batch * next.length),
                     &grads, &ws);
    EXPECT_EQ(ws.blocks.backward_set(0).gate_up_bf16 != nullptr, !ffw_linear_gradient);
    std::vector<float>& all = gradients.emplace_back();
    for (size_t i = 0; i < tensors.a.size(); ++i)
      for (const FloatBuffer* g : {&tensors.grad_a[i], &tensors.grad_b[i]}) {
        const std::vector<float> host = to_host(*g);
        all.insert(all.end(), host.begin(), host.end());
      }
  }
  ASSERT_EQ(gradients[0].size(), gradients[1].size());
  EXPECT_GT(*std::max_element(gradients[0].begin(), gradients[0].end()), 0.f);
  for (size_t i = 0; i < gradients[0].size(); ++i) ASSERT_EQ(gradients[0][i], gradients[1][i]) << i;
}

std::vector<double> finetune_losses(const std::string& policy, const std::string& dir, const std::string& extra = "") {
  const CommandResult r = run_meshtune("finetune " + fixture(kPreset) + " --lora-rank 4 --data sample --seq-len 16"
                                       " --batch-size 2 --steps 20 --lr 1e-3 --no-shuffle --no-progress --out " + dir +
                                       " --log-jsonl " + dir + "/log.jsonl --dtype-policy " + policy + " " + extra);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  std::vector<double> losses;
  std::istringstream log(read_text_file(dir + "/log.jsonl"));
  for (std::string line; std::getline(log, line);) losses.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return losses;
}

TEST(MixedBfloat16, TwentyLoraStepsFollowTheFp32LossesWithin1e2) {
  const std::string root = make_temp_dir("policy-steps");
  const std::vector<double> f32 = finetune_losses("float32", root + "/f32");
  const std::vector<double> bf16 = finetune_losses("mixed_bfloat16", root + "/bf16");
  ASSERT_EQ(f32.size(), 20u);
  ASSERT_EQ(bf16.size(), f32.size());
  double worst = 0;
  for (size_t i = 0; i < f32.size(); ++i) {
    worst = std::max(worst, std::fabs(bf16[i] - f32[i]) / f32[i]);
    EXPECT_NEAR(bf16[i], f32[i], 1e-2 * f32[i]) << "step " << i + 1;
  }
  std::printf("    20 steps: largest relative loss difference %.3g (first loss %.5f vs %.5f)\n", worst, bf16[0], f32[0]);
  EXPECT_NE(bf16[0], f32[0]);
}

TEST(DtypePolicyCli, GenerateAndLogitsTakeEveryPolicyAndFinetuneRefusesBfloat16) {
  for (const std::string policy : {"float32", "mixed_bfloat16", "bfloat16"}) {
    const CommandResult r = run_meshtune("generate " + fixture(kPreset) + " --prompt 'The licenses' --max-length 10"
                                         " --dtype-policy " + policy);
    EXPECT_EQ(r.exit_code, 0) << policy << "\n" << r.err;
  }
  const CommandResult bad = run_meshtune("generate " + fixture(kPreset) + " --prompt hi --dtype-policy float16");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("float16"), std::string::npos) << bad.err;
  const std::string dir = make_temp_dir("policy-bf16-train");
  const CommandResult train = run_meshtune("finetune " + fixture(kPreset) + " --lora-rank 2 --data sample --steps 1"
                                           " --batch-size 2 --seq-len 8 --no-progress --out " + dir +
                                           " --dtype-policy bfloat16");
  EXPECT_EQ(train.exit_code, 1) << train.err;
  EXPECT_NE(train.err.find("mixed_bfloat16"), std::string::npos) << train.err;
}

// MESHTUNE_BF16_MATMUL chooses the bf16 product (info --system says which), and a bad value is one
// clear error wherever a bf16 product would run.
TEST(DtypePolicyCli, Bf16MatmulVariableChoosesAndABadValueIsAnError) {
  const CommandResult sgemm = run_meshtune("info --system", "MESHTUNE_BF16_MATMUL=sgemm");
  ASSERT_EQ(sgemm.exit_code, 0) << sgemm.err;
  EXPECT_NE(sgemm.out.find("  bf16 x·Wᵀ: OpenBLAS sgemm — measured"), std::string::npos) << sgemm.out;
  EXPECT_NE(sgemm.out.find("  bf16 dy·W: OpenBLAS sgemm — measured"), std::string::npos)
      << sgemm.out;
  for (const std::string& args : {std::string("info --system"),
                                 "generate " + fixture(kPreset) + " --prompt hi --max-length 6 --dtype-policy "
                                 "mixed_bfloat16"}) {
    const CommandResult bad = run_meshtune(args, "MESHTUNE_BF16_MATMUL=amx");
    EXPECT_EQ(bad.exit_code, 1) << args << "\n" << bad.err;
    EXPECT_NE(bad.err.find("MESHTUNE_BF16_MATMUL=amx: expected onednn or sgemm"), std::string::npos) << bad.err;
  }
}

}  // namespace
