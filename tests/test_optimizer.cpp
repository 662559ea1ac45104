// AdamW against the spec §8 example (verified against real Keras output), a third step against a
// plain double re-implementation, weight-decay exclusion, clipping and learning-rate schedules.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "backend/cpu_backend.h"
#include "core/error.h"
#include "train/optimizer.h"

namespace meshtune {
namespace {

CpuBackend backend;

const std::vector<float> kTheta0 = {1.0f, -2.0f, 0.5f};
const std::vector<std::vector<float>> kGrads = {{0.1f, 0.2f, -0.3f}, {-0.05f, 0.4f, 0.1f}, {0.3f, -0.1f, 0.2f}};

// One variable of three elements, with its own storage.
struct Var {
  std::vector<float> value, grad;
  Parameter param;
  Var(const std::string& path, const std::string& name, std::vector<float> v) : value(std::move(v)) {
    grad.assign(value.size(), 0.0f);
    param.path = path;
    param.name = name;
    param.shape = {int64_t(value.size())};
    param.value = value;
    param.grad = grad;
    param.size = value.size();
  }
};

// Runs `steps` AdamW updates of θ₀ with the example gradients, returning θ after each one.
std::vector<std::vector<float>> run_adamw(const AdamWOptions& options, int steps, const std::string& name = "kernel") {
  Var var("dense/" + name, name, kTheta0);
  AdamW adamw(backend, options, {var.param});
  std::vector<std::vector<float>> thetas;
  for (int s = 0; s < steps; ++s) {
    var.grad = kGrads[s];
    adamw.step({var.param}, options.learning_rate);
    thetas.push_back(var.value);
  }
  EXPECT_EQ(adamw.iterations, steps);
  return thetas;
}

// The same update in double, written straight from the formula, for comparison with a tolerance.
std::vector<std::vector<double>> reference_adamw(double lr, double wd, bool decay, int steps) {
  const double b1 = 0.9, b2 = 0.999, eps = 1e-7;
  std::vector<double> theta(kTheta0.begin(), kTheta0.end()), m(3, 0.0), v(3, 0.0);
  std::vector<std::vector<double>> thetas;
  for (int s = 0; s < steps; ++s) {
    const int t = s + 1;
    const double alpha = lr * std::sqrt(1 - std::pow(b2, t)) / (1 - std::pow(b1, t));
    for (int i = 0; i < 3; ++i) {
      const double g = kGrads[s][i];
      if (decay) theta[i] -= lr * wd * theta[i];
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      theta[i] -= alpha * m[i] / (std::sqrt(v[i]) + eps);
    }
    thetas.push_back(theta);
  }
  return thetas;
}

void expect_near_relative(const std::vector<float>& got, const std::vector<double>& want, double rel,
                          const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], rel * std::fabs(want[i])) << what << " element " << i;
  }
}

void expect_bits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], want[i]) << what << " element " << i;
}

AdamWOptions options_with(double lr, double wd) {
  AdamWOptions o;
  o.learning_rate = lr;
  o.weight_decay = wd;
  return o;
}

// Spec §8 numbers (8 significant digits, from real Keras) and exact fp32 values from an op-by-op fp32
// emulation of Keras' formula (which the spec says matches Keras bit for bit).
TEST(AdamW, DefaultsMatchKerasExample) {
  auto thetas = run_adamw(AdamWOptions{}, 3);
  expect_near_relative(thetas[0], {0.99899602, -2.0009921, 0.50099796}, 1e-7, "θ₁");
  expect_near_relative(thetas[1], {0.99872571, -2.0019491, 0.50139612}, 1e-7, "θ₂");
  expect_bits(thetas[0], {0x1.ff7c68p-1f, -0x1.002082p+1f, 0x1.0082cep-1f}, "θ₁ bits");
  expect_bits(thetas[1], {0x1.ff58fap-1f, -0x1.003fdep+1f, 0x1.00b6fep-1f}, "θ₂ bits");
  expect_bits(thetas[2], {0x1.ff0092p-1f, -0x1.0052e4p+1f, 0x1.00ac34p-1f}, "θ₃ bits");
}

TEST(AdamW, LargeRateAndDecayMatchKerasExample) {
  auto thetas = run_adamw(options_with(0.1, 0.1), 3);
  expect_near_relative(thetas[1], {0.85447109, -2.1557145, 0.62906939}, 1e-7, "θ₂");
  expect_bits(thetas[2], {0x1.8ec900p-1f, -0x1.18b4ccp+1f, 0x1.3ac064p-1f}, "θ₃ bits");
}

TEST(AdamW, ExcludedFromDecayMatchesKerasExample) {
  AdamWOptions o = options_with(0.1, 0.1);
  o.exclude_from_weight_decay = {"scale"};
  auto thetas = run_adamw(o, 3, "scale");
  expect_near_relative(thetas[1], {0.87337112, -2.1965144, 0.64001936}, 1e-7, "θ₂");
  expect_bits(thetas[2], {0x1.9cd63cp-1f, -0x1.20b01cp+1f, 0x1.439428p-1f}, "θ₃ bits");
}

// Three AdamW steps equal a hand-computed expectation (the formula in double).
TEST(AdamW, ThreeStepsMatchDoubleReference) {
  struct Case {
    double lr, wd;
    bool excluded;
  };
  for (const Case& c : {Case{1e-3, 0.004, false}, Case{0.1, 0.1, false}, Case{0.1, 0.1, true}}) {
    AdamWOptions o = options_with(c.lr, c.wd);
    if (c.excluded) o.exclude_from_weight_decay = {"kernel"};
    auto got = run_adamw(o, 3);
    auto want = reference_adamw(c.lr, c.wd, !c.excluded, 3);
    for (int s = 0; s < 3; ++s) {
      expect_near_relative(got[s], want[s], 2e-6, "lr " + std::to_string(c.lr) + " step " + std::to_string(s + 1));
    }
  }
}

TEST(AdamW, SlotsHoldMomentsAndGradientsAreKept) {
  Var var("dense/kernel", "kernel", kTheta0);
  AdamW adamw(backend, AdamWOptions{}, {var.param});
  ASSERT_EQ(adamw.momentums.size(), 1u);
  EXPECT_EQ(std::vector<float>(adamw.momentums[0].data(), adamw.momentums[0].data() + 3), std::vector<float>(3, 0.0f));
  var.grad = kGrads[0];
  var.param.grad = var.grad;
  adamw.step({var.param}, 1e-3);
  EXPECT_EQ(var.grad, kGrads[0]);  // no clipping: gradients untouched
  EXPECT_FLOAT_EQ(adamw.momentums[0].data()[0], 0.01f);
  EXPECT_FLOAT_EQ(adamw.velocities[0].data()[1], 0.001f * 0.04f);
}

TEST(AdamW, ZeroGradientOnlyDecays) {
  Var var("dense/kernel", "kernel", kTheta0);
  AdamW adamw(backend, options_with(0.1, 0.1), {var.param});
  adamw.step({var.param}, 0.1);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(var.value[i], kTheta0[i] - (kTheta0[i] * 0.1f) * 0.1f);
}

// Keras: re.search("|".join(names), variable.name) on the short name.
TEST(AdamW, ExclusionIsRegexSearchOnShortName) {
  Var scale("decoder_block_0/pre_attention_norm/scale", "scale", {1});
  Var my_scale("x/my_scale_x", "my_scale_x", {1});
  Var lora("decoder_block_0/attention/query/lora_kernel_a", "lora_kernel_a", {1});

  AdamWOptions o;
  o.exclude_from_weight_decay = {"scale"};
  AdamW by_scale(backend, o, {});
  EXPECT_FALSE(by_scale.decays(scale.param));
  EXPECT_FALSE(by_scale.decays(my_scale.param));
  EXPECT_TRUE(by_scale.decays(lora.param));

  o.exclude_from_weight_decay = {"query"};
  AdamW by_query(backend, o, {});
  EXPECT_TRUE(by_query.decays(lora.param));  // the path has "query", the name does not

  o.exclude_from_weight_decay = {"scale", "lora_kernel_[ab]"};
  AdamW both(backend, o, {});
  EXPECT_FALSE(both.decays(scale.param));
  EXPECT_FALSE(both.decays(lora.param));

  AdamW none(backend, AdamWOptions{}, {});
  EXPECT_TRUE(none.decays(scale.param));
}

TEST(AdamW, InvalidExclusionRegexNamesIt) {
  AdamWOptions o;
  o.exclude_from_weight_decay = {"scale", "lora_(a"};
  try {
    AdamW adamw(backend, o, {});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lora_(a"), std::string::npos) << e.what();
  }
}

TEST(AdamW, MoreThanOneClipOptionIsAnError) {
  AdamWOptions o;
  o.clipnorm = 1;
  o.clipvalue = 1;
  EXPECT_THROW(AdamW(backend, o, {}), Error);
  o.clipvalue = 0;
  o.global_clipnorm = 1;
  EXPECT_THROW(AdamW(backend, o, {}), Error);
}

TEST(AdamW, ClipnormIsPerTensor) {
  Var a("a", "a", {0, 0}), b("b", "b", {0, 0});
  AdamWOptions o;
  o.clipnorm = 1;
  AdamW adamw(backend, o, {a.param, b.param});
  a.grad = {3, 4};   // norm 5 → scaled to norm 1
  b.grad = {0.3f, 0.4f};  // norm 0.5 → unchanged
  adamw.step({a.param, b.param}, 1e-3);
  EXPECT_FLOAT_EQ(a.grad[0], 0.6f);
  EXPECT_FLOAT_EQ(a.grad[1], 0.8f);
  EXPECT_FLOAT_EQ(b.grad[0], 0.3f);
  EXPECT_FLOAT_EQ(b.grad[1], 0.4f);
}

TEST(AdamW, GlobalClipnormUsesNormOfAllTensors) {
  Var a("a", "a", {0, 0}), b("b", "b", {0});
  AdamWOptions o;
  o.global_clipnorm = 2.5;
  AdamW adamw(backend, o, {a.param, b.param});
  a.grad = {3, 0};
  b.grad = {4};  // global norm 5 → every gradient halved
  adamw.step({a.param, b.param}, 1e-3);
  EXPECT_FLOAT_EQ(a.grad[0], 1.5f);
  EXPECT_FLOAT_EQ(a.grad[1], 0.0f);
  EXPECT_FLOAT_EQ(b.grad[0], 2.0f);

  a.grad = {0.3f, 0};
  b.grad = {0.4f};  // norm 0.5 ≤ 2.5: unchanged
  adamw.step({a.param, b.param}, 1e-3);
  EXPECT_FLOAT_EQ(a.grad[0], 0.3f);
  EXPECT_FLOAT_EQ(b.grad[0], 0.4f);
}

TEST(AdamW, ClipvalueClamps) {
  Var a("a", "a", {0, 0, 0});
  AdamWOptions o;
  o.clipvalue = 0.5;
  AdamW adamw(backend, o, {a.param});
  a.grad = {-2, 0.25f, 7};
  adamw.step({a.param}, 1e-3);
  EXPECT_EQ(a.grad, (std::vector<float>{-0.5f, 0.25f, 0.5f}));
}

TEST(AdamW, MismatchedParametersAreAnError) {
  Var a("a", "a", {0, 0}), b("b", "b", {0, 0, 0});
  AdamW adamw(backend, AdamWOptions{}, {a.param});
  EXPECT_THROW(adamw.step({a.param, b.param}, 1e-3), Error);
  EXPECT_THROW(adamw.step({b.param}, 1e-3), Error);
}

TEST(LearningRateSchedule, Constant) {
  LearningRateSchedule s;
  s.base = 2e-4;
  EXPECT_DOUBLE_EQ(s.at(0), 2e-4);
  EXPECT_DOUBLE_EQ(s.at(12345), 2e-4);
}

TEST(LearningRateSchedule, ConstantWithWarmup) {
  LearningRateSchedule s;
  s.base = 1.0;
  s.warmup_steps = 4;
  EXPECT_DOUBLE_EQ(s.at(0), 0.25);
  EXPECT_DOUBLE_EQ(s.at(3), 1.0);
  EXPECT_DOUBLE_EQ(s.at(100), 1.0);
}

TEST(LearningRateSchedule, LinearWarmupThenDecay) {
  LearningRateSchedule s;
  s.kind = "linear";
  s.base = 1.0;
  s.warmup_steps = 10;
  s.total_steps = 110;
  s.final_fraction = 0.1;
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(4), 0.5);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_DOUBLE_EQ(s.at(60), 0.55);
  EXPECT_DOUBLE_EQ(s.at(110), 0.1);
  EXPECT_DOUBLE_EQ(s.at(500), 0.1);
}

TEST(LearningRateSchedule, CosineDecay) {
  LearningRateSchedule s;
  s.kind = "cosine";
  s.base = 2.0;
  s.total_steps = 100;
  EXPECT_DOUBLE_EQ(s.at(0), 2.0);
  EXPECT_NEAR(s.at(50), 1.0, 1e-12);
  EXPECT_NEAR(s.at(25), 1.0 + std::cos(M_PI / 4), 1e-12);
  EXPECT_DOUBLE_EQ(s.at(100), 0.0);
  EXPECT_DOUBLE_EQ(s.at(1000), 0.0);
  s.final_fraction = 0.5;
  EXPECT_NEAR(s.at(50), 1.5, 1e-12);
  EXPECT_DOUBLE_EQ(s.at(100), 1.0);
}

TEST(LearningRateSchedule, Errors) {
  LearningRateSchedule s;
  s.kind = "exponential";
  try {
    s.at(0);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("exponential"), std::string::npos) << e.what();
  }
  s.kind = "linear";
  s.warmup_steps = 10;
  s.total_steps = 5;
  EXPECT_THROW(s.at(20), Error);
}

}  // namespace
}  // namespace meshtune
