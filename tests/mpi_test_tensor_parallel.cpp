// Tensor parallelism against one device, gradient by gradient (ctest runs this under mpirun with 2
// and 4 ranks; every rank runs every test). For Gemma 1, 2 and 3 models, LoRA on every target and
// full fine-tuning, on meshes (1, n) and (2, n/2) with KerasHub's layout map (hidden dimension
// over "batch") and the tutorial's: one step's loss and every parameter's gradient block equal the
// one-device trainer's (1e-5 of the tensor's largest gradient) — checked before AdamW, which
// magnifies last-bit differences of tiny gradients. Shared KV heads (1 KV head on 2 or 4 parts),
// the Gemma 3 query/key norm scales (partial sums over heads), the vocabulary-parallel embedding
// and cross-entropy (both maps split the embedding's rows), and clipping are among the cases.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "api/distribution.h"
#include "core/random.h"
#include "distribution/communicator.h"
#include "distribution/layout.h"
#include "distribution/mesh.h"
#include "distribution/sharding.h"
#include "model/gemma_layouts.h"
#include "model/tensor_parallel.h"
#include "model/init.h"
#include "model/lora.h"
#include "model/sharded_model.h"
#include "store/load.h"
#include "test_util.h"
#include "train/trainer.h"

namespace meshtune {
namespace {

Batch random_batch(int64_t B, int64_t L, int vocab, uint64_t seed) {
  SplitMix64 rng{seed};
  Batch b;
  b.batch_size = B;
  b.seq_len = L;
  for (int64_t i = 0; i < B * L; ++i) {
    b.token_ids.push_back(int32_t(rng.next() % uint64_t(vocab)));
    b.targets.push_back(int32_t(rng.next() % uint64_t(vocab)));
    const bool padded = i % L >= L - 2 && i / L == 1;  // the second row ends in padding
    b.padding_mask.push_back(padded ? 0 : 1);
    b.sample_weight.push_back(padded ? 0.f : 1.f);
  }
  return b;
}

// KerasHub's map or the tutorial's, with K/V left whole when their heads do not divide the model
// axis (as `--layout auto` does).
LayoutMap layout_for(const std::string& name, const GemmaConfig& c, int model_parts) {
  LayoutMap map;
  const LayoutMap base =
      name == "tutorial" ? tutorial_gemma_layout("model") : keras_hub_gemma_layout("model", "batch");
  for (const auto& [key, spec] : base.rules()) {
    PartitionSpec s = spec;
    if (key.find("(query|key|value)") != std::string::npos && c.num_key_value_heads % model_parts != 0) {
      map.add("decoder_block.*attention.*query.kernel", s);
      s[0] = std::nullopt;
      map.add("decoder_block.*attention.*(key|value).kernel", s);
      continue;
    }
    map.add(key, s);
  }
  return map;
}

struct Case {
  std::string model;  // tiny, tiny-gemma2, tiny-gemma3
  bool full;
  DType dtype = DType::F32;  // of the stored weights (bf16 blocks are kept as bf16)
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.model << (c.full ? " full" : " lora") << (c.dtype == DType::BF16 ? " bf16" : "");
}

class TensorParallel : public ::testing::TestWithParam<Case> {};

TEST_P(TensorParallel, GradientsEqualOneDevice) {
  const Case param = GetParam();
  Communicator& comm = world();
  const int n = comm.size();
  GemmaConfig config = preset_config(param.model, 256);
  const GemmaModel model = random_model(config, 7, param.dtype);
  const Batch batch = random_batch(4, 10, config.vocab_size, 11);
  auto make_lora = [&] {
    std::optional<LoraWeights> lora;
    if (!param.full) {
      lora = enable_lora(config, 2, parse_lora_targets({"all"}), 3);
      for (LoraAdapter& a : lora->adapters)  // non-zero B, so every gradient is non-trivial
        for (size_t i = 0; i < a.b.size(); ++i) a.b[i] = 0.05f * float(int(i % 7) - 3);
    }
    return lora;
  };
  std::vector<std::vector<int>> meshes = {{1, n}};
  if (n == 4) meshes.push_back({2, 2});
  // Clipping (tiny limits, so it clips): AdamW leaves the clipped gradients in place, and their
  // norms are over whole variables, summed from every process' blocks.
  for (const std::string clip : {"none", "clipnorm", "global_clipnorm"}) {
    FitOptions options;
    if (clip == "clipnorm") options.adamw.clipnorm = 1e-3;
    if (clip == "global_clipnorm") options.adamw.global_clipnorm = 1e-3;
    Trainer one(meshtune::testing::cpu_backend(), MatmulPrecision::F32, model, make_lora(), options);
    const LossSums one_sums = one.train_step(batch, 0.0);
    for (const auto& shape : meshes) {
      for (const std::string layout_name : {"keras_hub", "tutorial"}) {
        if (clip != "none" && layout_name != "keras_hub") continue;
        const std::string what = param.model + (param.full ? " full" : " lora") + " mesh " + std::to_string(shape[0]) +
                                 "x" + std::to_string(shape[1]) + " " + layout_name + " clip " + clip;
        DeviceMesh mesh(shape, {"batch", "model"}, comm);
        Distribution dist;
        dist.mesh = &mesh;
        dist.layout = layout_for(layout_name, config, shape[1]);
        const TensorParallelPlan plan = plan_tensor_parallel(config, dist.layout, mesh, "batch");
        ASSERT_TRUE(plan.active() && plan.vocab) << what << ": " << plan.summary;
        Trainer many(meshtune::testing::cpu_backend(), MatmulPrecision::F32, model, make_lora(), options, dist);
        const LossSums sums = many.train_step(batch, 0.0);
        EXPECT_NEAR(sums.weighted_ce, one_sums.weighted_ce, 1e-5 * one_sums.weighted_ce) << what;
        EXPECT_EQ(sums.weighted_correct, one_sums.weighted_correct) << what;

        // Each parameter's gradient is this process' block (its layout's spec) of the whole one.
        const auto variables = gemma_variables(config);
        ASSERT_EQ(many.parameters().size(), one.parameters().size()) << what;
        for (size_t i = 0; i < one.parameters().size(); ++i) {
          const Parameter& whole = one.parameters()[i];
          const Parameter& part = many.parameters()[i];
          ShardSpec spec;
          if (param.full) {
            const VariableSpec& v = variables[i];
            spec = make_shard_spec(our_dimensions(v.kind), v.keras_shape, dist.layout.resolve(v.keras_path, v.keras_shape, mesh),
                                   mesh);
          } else {
            spec = make_shard_spec(right_aligned_dimensions(whole.shape.size()), whole.shape, dist.layout.resolve(whole.path, whole.shape, mesh),
                                   mesh);
          }
          const std::vector<float> expected = take_block(whole.grad.data, spec);
          ASSERT_EQ(part.size, expected.size()) << what << " " << whole.path;
          double scale = 0, worst = 0;
          for (float g : expected) scale = std::max(scale, double(std::fabs(g)));
          for (size_t k = 0; k < expected.size(); ++k)
            worst = std::max(worst, double(std::fabs(part.grad.data[k] - expected[k])));
          EXPECT_LE(worst, 1e-5 * std::max(scale, 1e-6))
              << what << " " << whole.path << " (max |grad| " << scale << ")";
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, TensorParallel,
                         ::testing::Values(Case{"tiny", false}, Case{"tiny", true}, Case{"tiny-gemma2", false},
                                           Case{"tiny-gemma2", true}, Case{"tiny-gemma3", false},
                                           Case{"tiny-gemma3", true}, Case{"tiny-gemma2", false, DType::BF16},
                                           Case{"tiny", true, DType::BF16}),
                         [](const auto& info) {
                           std::string name = info.param.model == "tiny"          ? "Gemma1"
                                              : info.param.model == "tiny-gemma2" ? "Gemma2"
                                                                                  : "Gemma3";
                           return name + (info.param.full ? "Full" : "Lora") +
                                  (info.param.dtype == DType::BF16 ? "Bf16" : "");
                         });

// Sharded loading as the library does it (api/distribution.h sharded_loading): this process' block
// of every variable `layout` splits, and int8 row maxima combined over the mesh.
LoadOptions sharded_options(LoadOptions options, const LayoutMap& layout, DeviceMesh& mesh) {
  const LoadOptions sharded = api::sharded_loading(layout, mesh);
  options.block_of = sharded.block_of;
  options.combine_row_max = sharded.combine_row_max;
  return options;
}

// int8 under tensor parallelism (--quantize int8, and a Keras int8 preset). Each process quantizes
// only its blocks as they load; a block of some columns (attention_output and ffw_linear over
// their heads/width, KerasHub's hidden dimension over "batch") combines its rows' maxima over the
// mesh first, so every block's codes and scales are bit for bit the ones the whole model has.
// Then one LoRA step under the tutorial's map: attention_output and ffw_linear quantize each token
// by its maximum over all processes' slices, so the loss and the gradients equal one device's up
// to the order of the float sums of the partial products.
TEST(TensorParallelInt8, BlocksHoldTheWholeModelsCodesAndAStepEqualsOneDevice) {
  Communicator& comm = world();
  const int n = comm.size();
  // A Keras preset (blocks read as HDF5 boxes, quantized), a Keras int8 preset (code blocks with
  // their rows' scales) and a Hugging Face checkpoint (blocks cut from the memory map, quantized).
  for (const std::string preset : {"keras/preset-gemma-tiny", "keras2/preset-gemma-tiny-int8", "hf/tiny-gemma/checkpoint"}) {
    const ModelDir dir = inspect_model_dir(testing::fixture(preset));
    LoadOptions whole_options;
    whole_options.quantize_int8 = true;
    const GemmaModel whole = load_model(dir, whole_options);
    const GemmaConfig& config = whole.config;
    std::vector<std::vector<int>> meshes = {{1, n}};
    if (n == 4) meshes.push_back({2, 2});
    for (const auto& shape : meshes) {
      for (const std::string layout_name : {"keras_hub", "tutorial"}) {
        const std::string what = preset + " mesh " + std::to_string(shape[0]) + "x" + std::to_string(shape[1]) + " " +
                                 layout_name;
        DeviceMesh mesh(shape, {"batch", "model"}, comm);
        const LayoutMap layout = layout_for(layout_name, config, shape[1]);
        const LoadOptions options = sharded_options(whole_options, layout, mesh);
        const GemmaModel part = load_model(dir, options);
        int blocks = 0;
        for (const VariableSpec& spec : gemma_variables(config)) {
          const WeightMatrix* mine = part.matrix(spec.slot, spec.layer);
          const std::optional<ShardSpec> block = options.block_of(spec);
          if (!mine || !block) continue;
          ++blocks;
          const WeightMatrix expected = matrix_block(*whole.matrix(spec.slot, spec.layer), spec, *block);
          ASSERT_EQ(mine->dtype, DType::I8) << what << " " << spec.keras_path;
          ASSERT_EQ(mine->rows, expected.rows) << what << " " << spec.keras_path;
          ASSERT_EQ(mine->cols, expected.cols) << what << " " << spec.keras_path;
          EXPECT_EQ(std::memcmp(mine->i8(), expected.i8(), size_t(expected.rows * expected.cols)), 0)
              << what << " " << spec.keras_path << ": codes";
          EXPECT_EQ(std::memcmp(mine->scales, expected.scales, size_t(expected.rows) * sizeof(float)), 0)
              << what << " " << spec.keras_path << ": scales";
        }
        EXPECT_GT(blocks, 0) << what;
      }
    }

    // One LoRA step, the tutorial's map on (1, n).
    const Batch batch = random_batch(4, 10, config.vocab_size, 11);
    auto make_lora = [&] {
      LoraWeights lora = enable_lora(config, 2, parse_lora_targets({"all"}), 3);
      for (LoraAdapter& a : lora.adapters)  // non-zero B, so every gradient is non-trivial
        for (size_t i = 0; i < a.b.size(); ++i) a.b[i] = 0.05f * float(int(i % 7) - 3);
      return lora;
    };
    Trainer one(meshtune::testing::cpu_backend(), MatmulPrecision::F32, whole, make_lora(), {});
    const LossSums one_sums = one.train_step(batch, 0.0);
    DeviceMesh mesh({1, n}, {"batch", "model"}, comm);
    Distribution dist;
    dist.mesh = &mesh;
    dist.layout = layout_for("tutorial", config, n);
    Trainer many(meshtune::testing::cpu_backend(), MatmulPrecision::F32, load_model(dir, sharded_options(whole_options, dist.layout, mesh)), make_lora(), {}, dist);
    const LossSums sums = many.train_step(batch, 0.0);
    EXPECT_NEAR(sums.weighted_ce, one_sums.weighted_ce, 1e-6 * one_sums.weighted_ce) << preset;
    for (size_t i = 0; i < one.parameters().size(); ++i) {
      const Parameter& w = one.parameters()[i];
      const Parameter& p = many.parameters()[i];
      const ShardSpec spec = make_shard_spec(right_aligned_dimensions(w.shape.size()), w.shape,
                                             dist.layout.resolve(w.path, w.shape, mesh), mesh);
      const std::vector<float> expected = take_block(w.grad.data, spec);
      ASSERT_EQ(p.size, expected.size()) << preset << " " << w.path;
      double scale = 0, worst = 0;
      for (size_t k = 0; k < expected.size(); ++k) {
        scale = std::max(scale, double(std::fabs(expected[k])));
        worst = std::max(worst, double(std::fabs(p.grad.data[k] - expected[k])));
      }
      EXPECT_LE(worst, 1e-5 * std::max(scale, 1e-6)) << preset << " " << w.path << " (max |grad| " << scale << ")";
    }
  }
}

// Under a bf16 dtype policy frozen weights are stored bf16 as they load; under a mesh each process
// converts only its blocks (an HF checkpoint's cut out of the memory map): the same bytes as the
// whole bf16 model's blocks.
TEST(ShardedBf16Loading, BlocksHoldTheWholeModelsBf16Values) {
  Communicator& comm = world();
  for (const std::string preset : {"keras/preset-gemma-tiny", "hf/tiny-gemma/checkpoint"}) {
    const ModelDir dir = inspect_model_dir(testing::fixture(preset));
    LoadOptions bf16;
    bf16.bf16_matrices = true;
    const GemmaModel whole = load_model(dir, bf16);
    DeviceMesh mesh({1, comm.size()}, {"batch", "model"}, comm);
    const LayoutMap layout = layout_for("tutorial", whole.config, comm.size());
    const LoadOptions options = sharded_options(bf16, layout, mesh);
    const GemmaModel part = load_model(dir, options);
    int blocks = 0;
    for (const VariableSpec& spec : gemma_variables(whole.config)) {
      const WeightMatrix* mine = part.matrix(spec.slot, spec.layer);
      const std::optional<ShardSpec> block = options.block_of(spec);
      if (!mine || !block) continue;
      ++blocks;
      const WeightMatrix expected = matrix_block(*whole.matrix(spec.slot, spec.layer), spec, *block);
      ASSERT_EQ(mine->dtype, DType::BF16) << preset << " " << spec.keras_path;
      ASSERT_EQ(mine->rows * mine->cols, expected.rows * expected.cols) << preset << " " << spec.keras_path;
      EXPECT_EQ(std::memcmp(mine->data, expected.data, size_t(expected.rows * expected.cols) * 2), 0)
          << preset << " " << spec.keras_path;
    }
    EXPECT_GT(blocks, 0) << preset;
  }
}

}  // namespace
}  // namespace meshtune
