// Meshes of devices without a GPU: the API on `reference-device` (the reference loops on memory
// tagged as a GPU's, collectives through a device communicator whose host twin is MPI) against the
// same mesh on the host reference backend (ctest runs this under mpirun with 2 and 4 ranks; every
// rank runs every test). The numbers must be equal bit for bit, so what these runs check is where
// each operand lives: the weights the trainer cuts on the host and uploads, adapters, gradients and
// their sums in device memory, flags and norms through the host twin, checkpoints staged through
// host copies — the paths a mesh of GPUs over NCCL takes.
//
// Built again as gpu_test_device_mesh (MESHTUNE_GPU_TESTS, ctest label `gpu`): the same runs with
// `cuda` (NCCL) against `cpu`, within the float32 tolerances of GPU against CPU sums — one process
// (a mesh of one GPU) by ctest, or under mpirun with one process per GPU (scripts/device-check).
#include <gtest/gtest.h>

#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "api/causal_lm.h"
#include "core/error.h"
#include "distribution/communicator.h"
#include "test_util.h"

namespace meshtune {
namespace {

using testing::fixture;

#ifdef MESHTUNE_GPU_TESTS
const char* const kHost = "cpu";
const char* const kDevice = "cuda";
constexpr double kLossTolerance = 1e-4, kWeightTolerance = 1e-6;
#else
const char* const kHost = "reference";
const char* const kDevice = "reference-device";
constexpr double kLossTolerance = 0, kWeightTolerance = 0;  // the same loops: equal
#endif

void expect_close(const std::vector<double>& a, const std::vector<double>& b, double tolerance) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], tolerance) << "step " << i;
}

struct MeshCase {
  std::string name;
  std::vector<int> shape;  // over ("batch", "model")
  std::string layout;      // "" = none (data parallel)
  std::vector<std::string> rules = {};  // layout rules added after `layout`
};

std::vector<MeshCase> mesh_cases() {
  const int n = world().size();
  std::vector<MeshCase> cases = {{"model parallel (1, n), KerasHub's map", {1, n}, "auto"},
                                 {"data parallel (n, 1)", {n, 1}, ""},
                                 {"FSDP-style (n, 1), embeddings split over 'batch'", {n, 1}, "",
                                  {"token_embedding/embeddings=batch,"}}};
  if (n >= 4 && n % 2 == 0) cases.push_back({"(2, n/2)", {2, n / 2}, "auto"});
  return cases;
}

api::GemmaCausalLM load(const std::string& backend, const MeshCase& mesh) {
  static std::ostringstream sink;
  api::PresetOptions options;
  options.notes = &sink;
  options.backend = backend;
  options.distribution.mesh_shape = mesh.shape;
  options.distribution.layout = mesh.layout;
  options.distribution.layout_rules = mesh.rules;
  return api::GemmaCausalLM::from_preset(fixture("keras/preset-gemma-tiny"), options);
}

api::FitRunOptions steps(int64_t n, const std::string& checkpoint = "") {
  api::FitRunOptions run;
  run.epochs = 0;
  run.steps = n;
  run.batch_size = 4;
  run.sequence_length = 32;
  run.checkpoint_path = checkpoint;
  return run;
}

class Losses : public api::Callback {
 public:
  void step_end(const StepReport& r) override { values.push_back(r.loss); }
  std::vector<double> values;
};

// One directory shared by every rank (rank 0's name, broadcast).
std::string shared_temp_dir(const std::string& tag) {
  std::string dir = world().rank() == 0 ? testing::make_temp_dir(tag) : std::string();
  world().broadcast_bytes(dir, 0);
  return dir;
}

TEST(DeviceMesh, GenerateAndLoraFitEqualTheHostMesh) {
  const Dataset data = load_dataset("sample");
  const std::string dir = shared_temp_dir("device-mesh");
  for (const MeshCase& mesh : mesh_cases()) {
    SCOPED_TRACE(mesh.name);
    api::GemmaCausalLM host = load(kHost, mesh), device = load(kDevice, mesh);
    auto generated = [](const api::GemmaCausalLM& lm) {
      return lm.generate({"The"}, lm.default_generate_options()).at(0).token_ids;
    };
    EXPECT_EQ(generated(device), generated(host));
    std::map<std::string, Losses> losses;
    for (auto [name, lm] : {std::pair{"host", &host}, std::pair{"device", &device}}) {
      lm->enable_lora();
      lm->compile({});
      lm->fit(data, steps(2, dir + "/" + name + ".checkpoint.safetensors"), {&losses[name]});
    }
    ASSERT_EQ(losses["device"].values.size(), 2u);
    expect_close(losses["device"].values, losses["host"].values, kLossTolerance);
    const LoraWeights &a = *device.lora(), &b = *host.lora();
    for (size_t i = 0; i < a.adapters.size(); ++i)
      for (const auto& [x, y] : {std::pair{&a.adapters[i].a, &b.adapters[i].a}, {&a.adapters[i].b, &b.adapters[i].b}})
        for (size_t j = 0; j < x->size(); ++j) ASSERT_NEAR((*x)[j], (*y)[j], kWeightTolerance) << i << " " << j;
    // Low-rank terms on the device, W + BA merged into each process' part on the host.
    EXPECT_NEAR(device.evaluate(data, steps(1)).loss, host.evaluate(data, steps(1)).loss, 1e-5 + kLossTolerance);

    // Resumed from the device's checkpoint, the next step is the host's.
    std::map<std::string, Losses> resumed;
    for (const std::string name : {"host", "device"}) {
      api::GemmaCausalLM lm = load(name == "host" ? kHost : kDevice, mesh);
      lm.enable_lora();
      lm.compile({});
      api::FitRunOptions run = steps(3, dir + "/" + name + ".checkpoint.safetensors");
      run.resume = true;
      EXPECT_EQ(lm.fit(data, run, {&resumed[name]}).steps, 3);
    }
    expect_close(resumed["device"].values, resumed["host"].values, kLossTolerance);
  }
}

// Full fine-tuning: working copies and gradients on the device, blocks of split variables cut and
// gathered through host staging, the optimizer on the device's blocks.
TEST(DeviceMesh, FullFineTuningEqualsTheHostMesh) {
  const Dataset data = load_dataset("sample");
  const std::string dir = shared_temp_dir("device-mesh-full");
  for (const MeshCase& mesh : mesh_cases()) {
    SCOPED_TRACE(mesh.name);
    std::map<std::string, Losses> losses;
    std::map<std::string, double> evaluated, reloaded;
    std::map<std::string, std::vector<int32_t>> generated;
    for (const std::string name : {"host", "device"}) {
      api::GemmaCausalLM lm = load(name == "host" ? kHost : kDevice, mesh);
      lm.compile({});
      lm.fit(data, steps(2, dir + "/" + name + ".checkpoint.safetensors"), {&losses[name]});
      evaluated[name] = lm.evaluate(data, steps(1)).loss;
      generated[name] = lm.generate({"The"}, lm.default_generate_options()).at(0).token_ids;
      lm.save_to_preset(dir + "/" + name + "-preset");
      world().barrier();  // rank 0 writes it
      static std::ostringstream sink;
      api::PresetOptions quiet;
      quiet.notes = &sink;
      reloaded[name] = api::GemmaCausalLM::from_preset(dir + "/" + name + "-preset", quiet).evaluate(data, steps(1)).loss;
    }
    ASSERT_EQ(losses["device"].values.size(), 2u);
    expect_close(losses["device"].values, losses["host"].values, kLossTolerance);
    EXPECT_NEAR(evaluated["device"], evaluated["host"], kLossTolerance);
    EXPECT_NEAR(reloaded["device"], reloaded["host"], kLossTolerance);
    EXPECT_NEAR(reloaded["device"], evaluated["device"], 1e-5 + kLossTolerance);  // the whole model was written
    if (kLossTolerance == 0) {
      EXPECT_EQ(generated["device"], generated["host"]);
    }

    std::map<std::string, Losses> resumed;
    for (const std::string name : {"host", "device"}) {
      api::GemmaCausalLM lm = load(name == "host" ? kHost : kDevice, mesh);
      lm.compile({});
      api::FitRunOptions run = steps(3, dir + "/" + name + ".checkpoint.safetensors");
      run.resume = true;
      EXPECT_EQ(lm.fit(data, run, {&resumed[name]}).steps, 3);
    }
    ASSERT_EQ(resumed["device"].values.size(), 1u);
    expect_close(resumed["device"].values, resumed["host"].values, kLossTolerance);
  }
}

// A layout map that splits LoRA matrices: each process updates its block of A, the working copy is
// gathered from the blocks after every step. Where values live changes no number: the split runs
// equal the run with A replicated.
TEST(DeviceMesh, SplitLoraMatricesEqualReplicatedOnes) {
  const Dataset data = load_dataset("sample");
  std::map<std::string, Losses> losses;
  std::map<std::string, LoraWeights> trained;
  for (const std::string name : {"replicated", "host", "device"}) {
    static std::ostringstream sink;
    api::PresetOptions options;
    options.notes = &sink;
    options.backend = name == "device" ? kDevice : kHost;
    options.distribution.mesh_shape = {1, world().size()};
    if (name != "replicated") options.distribution.layout_rules = {".*lora_kernel_a=,model,"};
    api::GemmaCausalLM lm = api::GemmaCausalLM::from_preset(fixture("keras/preset-gemma-tiny"), options);
    lm.enable_lora();
    lm.compile({});
    lm.fit(data, steps(3), {&losses[name]});
    trained[name] = *lm.lora();
  }
  for (const std::string name : {"host", "device"}) {
    SCOPED_TRACE(name);
    ASSERT_EQ(losses[name].values.size(), 3u);
    expect_close(losses[name].values, losses["replicated"].values, name == "device" ? kLossTolerance : 0);
    const LoraWeights &a = trained[name], &b = trained["replicated"];
    ASSERT_EQ(a.adapters.size(), b.adapters.size());
    for (size_t i = 0; i < a.adapters.size(); ++i)
      for (const auto& [x, y] : {std::pair{&a.adapters[i].a, &b.adapters[i].a}, {&a.adapters[i].b, &b.adapters[i].b}})
        for (size_t j = 0; j < x->size(); ++j)
          ASSERT_NEAR((*x)[j], (*y)[j], name == "device" ? kWeightTolerance : 0) << i << " " << j;
  }
}

}  // namespace
}  // namespace meshtune
