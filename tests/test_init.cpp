// Random initialisation: fill_normal is the same for any number of threads, a variable made alone
// equals random_model's, and a model written one variable at a time (what `meshtune init` does)
// loads back as random_model's weights, holding one variable at a time.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "core/random.h"
#include "model/init.h"
#include "store/load.h"
#include "store/save.h"
#include "test_util.h"

using namespace meshtune;
using namespace meshtune::testing;
namespace fs = std::filesystem;

namespace {

// Not a multiple of the block (nor even), so the last block is short.
constexpr size_t kValues = 3 * kNormalBlock + 12345;

std::vector<float> normals(int threads, uint64_t seed, float stddev) {
  const int before = omp_get_max_threads();
  omp_set_num_threads(threads);
  std::vector<float> v(kValues);
  fill_normal(v.data(), v.size(), seed, stddev);
  omp_set_num_threads(before);
  return v;
}

TEST(FillNormal, SameValuesForAnyThreadCount) {
  const std::vector<float> one = normals(1, 42, 0.5f), two = normals(2, 42, 0.5f), three = normals(3, 42, 0.5f);
  EXPECT_EQ(one, two);
  EXPECT_EQ(one, three);
  EXPECT_NE(one, normals(2, 43, 0.5f));  // the seed matters
}

TEST(FillNormal, MeanAndStddev) {
  const std::vector<float> v = normals(2, 7, 0.5f);
  double sum = 0, sum_sq = 0;
  for (float x : v) {
    sum += x;
    sum_sq += double(x) * x;
  }
  const double mean = sum / double(v.size()), stddev = std::sqrt(sum_sq / double(v.size()) - mean * mean);
  EXPECT_NEAR(mean, 0, 0.005);  // 5 standard errors (0.5/√208k ≈ 0.001)
  EXPECT_NEAR(stddev, 0.5, 0.005);
  // Blocks are independent streams: neighbouring blocks do not repeat each other.
  EXPECT_NE(std::memcmp(v.data(), v.data() + kNormalBlock, 64 * sizeof(float)), 0);
}

TEST(FillNormal, Bf16IsTheRoundedFp32) {
  const std::vector<float> f = normals(2, 9, 0.02f);
  omp_set_num_threads(2);
  std::vector<uint16_t> b(kValues);
  fill_normal_bf16(b.data(), b.size(), 9, 0.02f);
  for (size_t i = 0; i < kValues; ++i) ASSERT_EQ(b[i], f32_to_bf16(f[i])) << i;
}

// Every variable of `model` as a HostTensor in our layout (for comparing bytes).
HostTensor stored(const GemmaModel& model, const VariableSpec& spec) {
  if (const WeightMatrix* w = model.matrix(spec.slot, spec.layer)) {
    HostTensor t;
    t.dtype = w->dtype;
    t.shape = {w->rows, w->cols};
    t.data = static_cast<const std::byte*>(w->data);
    return t;
  }
  const WeightVector& v = *model.vector(spec.slot, spec.layer);
  HostTensor t;
  t.shape = {int64_t(v.size())};
  t.data = reinterpret_cast<const std::byte*>(v.data());
  return t;
}

void expect_same_weights(const GemmaModel& a, const GemmaModel& b, const std::string& what) {
  for (const VariableSpec& spec : gemma_variables(a.config)) {
    const HostTensor x = stored(a, spec), y = stored(b, spec);
    ASSERT_EQ(x.dtype, y.dtype) << what << " " << spec.keras_path;
    ASSERT_EQ(x.shape, y.shape) << what << " " << spec.keras_path;
    EXPECT_EQ(std::memcmp(x.data, y.data, x.nbytes()), 0) << what << " " << spec.keras_path;
  }
}

TEST(RandomInit, AVariableMadeAloneEqualsRandomModels) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    const GemmaConfig config = preset_config("tiny-gemma3", 300);  // with the optional norms
    const GemmaModel model = random_model(config, 5, dtype);
    for (const VariableSpec& spec : gemma_variables(config)) {
      const HostTensor alone = random_variable(spec, 5, dtype), in_model = stored(model, spec);
      EXPECT_EQ(alone.dtype, spec.kind == VarKind::Norm ? DType::F32 : dtype) << spec.keras_path;
      EXPECT_EQ(alone.dtype, random_variable_dtype(spec, dtype)) << spec.keras_path;
      ASSERT_EQ(alone.shape, in_model.shape) << spec.keras_path;
      EXPECT_EQ(std::memcmp(alone.data, in_model.data, alone.nbytes()), 0) << spec.keras_path;
    }
    // Different variables of the same shape get different values.
    const GemmaModel other_seed = random_model(config, 6, dtype);
    EXPECT_NE(std::memcmp(model.layers[0].key.data, model.layers[0].value.data, model.layers[0].key.nbytes()), 0);
    EXPECT_NE(std::memcmp(model.layers[0].key.data, other_seed.layers[0].key.data, model.layers[0].key.nbytes()), 0);
  }
}

// What `meshtune init` writes: random variables made one at a time. Checks that the savers never
// hold two of them: when a variable is made, the previous one has been freed (for the Keras
// layout's permuted matrices, the source's tensor: its permuted copy is the writer's own).
VariableSource streamed_random(uint64_t seed, DType dtype, std::weak_ptr<const void>& last, int& made) {
  return {[dtype](const VariableSpec& spec) { return random_variable_dtype(spec, dtype); },
          [seed, dtype, &last, &made](const VariableSpec& spec) {
            EXPECT_TRUE(last.expired()) << "still holding the variable before " << spec.keras_path;
            HostTensor t = random_variable(spec, seed, dtype);
            last = t.owner;
            ++made;
            return t;
          }};
}

TEST(RandomInit, StreamedInitLoadsAsRandomModel) {
  for (const std::string name : {"tiny", "tiny-gemma3"}) {
    for (DType dtype : {DType::F32, DType::BF16}) {
      const GemmaConfig config = preset_config(name, 300);
      const std::string what = name + " " + dtype_name(dtype);
      const GemmaModel expected = random_model(config, 11, dtype);
      std::weak_ptr<const void> last;
      int made = 0;
      const std::string keras = make_temp_dir("init-keras"), hf = make_temp_dir("init-hf");
      save_keras_preset(config, streamed_random(11, dtype, last, made), "", 32, keras);
      last.reset();
      save_hf_checkpoint(config, streamed_random(11, dtype, last, made), "", hf);
      EXPECT_EQ(made, 2 * int(gemma_variables(config).size())) << what;

      const GemmaModel from_keras = load_model(inspect_model_dir(keras)), from_hf = load_model(inspect_model_dir(hf));
      expect_same_weights(from_keras, expected, what + " keras");
      expect_same_weights(from_hf, expected, what + " hf");
      EXPECT_EQ(from_keras.config.stored_dtype, dtype_name(dtype)) << what;
      EXPECT_EQ(from_hf.config.stored_dtype, dtype_name(dtype)) << what;
      EXPECT_EQ(load_json(keras + "/config.json")["config"]["dtype"]["config"]["name"], dtype_name(dtype)) << what;
      EXPECT_EQ(load_json(hf + "/config.json")["torch_dtype"], dtype_name(dtype)) << what;
    }
  }
}

}  // namespace
