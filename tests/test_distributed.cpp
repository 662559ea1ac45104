// Distributed fine-tuning equals the one-device run: for meshes (1,2), (2,1), (1,4), (2,2) under
// `mpirun --oversubscribe`, with the tutorial's layout map (adapted to the tiny shapes), KerasHub's
// Gemma map (`--layout auto`) and DataParallel, on the Gemma 1 and Gemma 2 fixture models, five
// AdamW steps of LoRA and of full fine-tuning give the same per-step losses (1e-5 relative) and
// final weights (1e-5), and generation gives the same tokens. Plus the error paths: each exits
// non-zero on every rank, without hanging.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "io/keras_h5.h"
#include "io/safetensors.h"
#include "test_util.h"

using namespace meshtune;
using namespace meshtune::testing;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::string kMpirun = "timeout 300 mpirun --allow-run-as-root --oversubscribe --timeout 240 -np ";

// The tutorial's map with key/value left replicated: the fixtures have 1 or 2 KV heads, which a
// 4-wide model axis cannot split.
const char* kTutorialAdapted = R"({
  "token_embedding/embeddings": ["model", null],
  "decoder_block.*attention.*query.*kernel": ["model", null, null],
  "decoder_block.*attention_output.*kernel": ["model", null, null],
  "decoder_block.*ffw_gating.*kernel": [null, "model"],
  "decoder_block.*ffw_linear.*kernel": ["model", null]
})";

struct RunResult {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> weights;
  std::string generated;
};

// Runs a job; a launch that fails without any meshtune error (mpirun itself failing to start the
// processes on an overloaded 2-core machine) is retried once, and its output is shown.
CommandResult run_job_command(const std::string& args, const std::string& launcher) {
  CommandResult r = run_meshtune(args, "", launcher);
  if (r.exit_code != 0 && !launcher.empty() && r.err.find("meshtune: error") == std::string::npos) {
    std::cerr << "mpirun launch failed (exit " << r.exit_code << "), retrying once:\n" << r.err << "\n";
    r = run_meshtune(args, "", launcher);
  }
  return r;
}

std::map<std::string, std::vector<float>> floats_of(const std::map<std::string, HostTensor>& tensors) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& [name, t] : tensors)
    if (t.dtype == DType::F32) out[name] = to_f32(t);
  return out;
}

// Runs finetune (and generate with the result) on `processes` processes ("" mesh = one process);
// `mpirun_options` go to mpirun (e.g. the transport).
RunResult run_job(const std::string& model, bool full, const std::string& mesh_args, int processes, const std::string& dir,
                  const std::string& mpirun_options = "") {
  const std::string launcher = processes > 1 ? kMpirun + std::to_string(processes) + " " + mpirun_options + " " : "";
  const std::string mode = full ? " --full" : " --lora-rank 2 --lora-targets all";
  CommandResult r = run_job_command("--threads 1 finetune " + model + mode +
                                     " --data sample --seq-len 12 --batch-size 4 --steps 5 --lr 1e-2 --no-shuffle"
                                     " --no-progress --out " + dir + " --log-jsonl " + dir + "/log.jsonl " + mesh_args,
                                 launcher);
  EXPECT_EQ(r.exit_code, 0) << mesh_args << "\n" << r.err;
  RunResult result;
  std::istringstream log(read_text_file(dir + "/log.jsonl"));
  for (std::string line; std::getline(log, line);) result.losses.push_back(json::parse(line)["loss"].get<double>());
  if (full) result.weights = floats_of(read_keras_weights_dir(dir + "/model"));
  else result.weights = floats_of(read_safetensors(dir + "/adapter/adapter_model.safetensors"));
  CommandResult g = run_job_command("--threads 1 generate " + model + " --prompt 'The licenses' --max-length 12 --no-stop --json " +
                                         (full ? "" : " --lora " + dir + "/adapter.lora.h5 ") + mesh_args,
                                     launcher);
  EXPECT_EQ(g.exit_code, 0) << g.err;
  result.generated = g.out;
  return result;
}

// Weights: 1e-5 of each tensor's largest magnitude where every sum runs in the one-device order.
// When the batch is split (data parallel) or the heads/FFN width are (tensor parallel), sums run
// in another order; Adam divides by √v, which magnifies those last-bit differences for tiny
// gradients (PyTorch's fixture notes the same): after 5 steps at lr 1e-2 the weights are up to
// 4e-5 (batch split), 1.1e-4 (tensor parallel) and 2.2e-4 (both) apart, so those meshes get 5e-4.
// The gradients themselves are checked to 1e-5 before Adam in mpi_test_tensor_parallel.
void expect_same(const RunResult& one, const RunResult& many, const std::string& what, double weight_tolerance) {
  ASSERT_EQ(one.losses.size(), 5u) << what;
  ASSERT_EQ(many.losses.size(), one.losses.size()) << what;
  for (size_t i = 0; i < one.losses.size(); ++i)
    EXPECT_NEAR(many.losses[i], one.losses[i], 1e-5 * std::fabs(one.losses[i])) << what << " step " << i + 1;
  ASSERT_EQ(many.weights.size(), one.weights.size()) << what;
  for (const auto& [name, values] : one.weights) {
    const auto& other = many.weights.at(name);
    ASSERT_EQ(other.size(), values.size()) << what << " " << name;
    double scale = 0, worst = 0;
    for (size_t i = 0; i < values.size(); ++i) {
      scale = std::max(scale, double(std::fabs(values[i])));
      worst = std::max(worst, double(std::fabs(values[i] - other[i])));
    }
    EXPECT_LE(worst, weight_tolerance * std::max(scale, 1e-3)) << what << " " << name;
  }
  EXPECT_EQ(many.generated, one.generated) << what;
}

class Distributed : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

// Conversations (answer-only loss) split over the batch axis and over tensor-parallel heads give the
// one-process losses: the weights travel with their rows.
TEST(DistributedChat, ConversationsOnAMeshEqualOneDevice) {
  const std::string root = make_temp_dir("dist-chat");
  const std::string data = root + "/chat.jsonl";
  {
    std::ofstream out(data);
    for (int i = 0; i < 8; ++i)
      out << R"({"messages": [{"role": "user", "content": "Is movie )" << i << R"( good?"}, {"role": "assistant", "content": "It is )"
          << (i % 2 ? "great" : "dull") << R"(."}]})" << "\n";
  }
  const std::string model = fixture("keras/preset-gemma2-tiny");
  auto losses = [&](const std::string& launcher, const std::string& mesh, const std::string& out) {
    CommandResult r = run_job_command("--threads 1 finetune " + model + " --data " + data +
                                          " --seq-len 48 --batch-size 4 --steps 3 --lr 1e-2 --no-shuffle --no-progress"
                                          " --log-jsonl " + out + ".jsonl --out " + out + " " + mesh,
                                      launcher);
    EXPECT_EQ(r.exit_code, 0) << mesh << "\n" << r.err;
    std::vector<double> out_losses;
    std::istringstream log(read_text_file(out + ".jsonl"));
    for (std::string line; std::getline(log, line);) out_losses.push_back(json::parse(line)["loss"].get<double>());
    return out_losses;
  };
  const std::vector<double> one = losses("", "", root + "/one");
  ASSERT_EQ(one.size(), 3u);
  // The answers fit (at --seq-len 24 the tiny tokenizer's chat template filled every position: the
  // losses were all 0, so this test compared nothing until fit refused such data).
  for (double loss : one) EXPECT_GT(loss, 0.1);
  for (const std::string& mesh : {std::string(""), std::string("--mesh 1x2 --layout auto")}) {
    const std::vector<double> two = losses(kMpirun + "2 ", mesh, root + "/two" + std::to_string(mesh.size()));
    ASSERT_EQ(two.size(), one.size()) << mesh;
    for (size_t i = 0; i < one.size(); ++i) EXPECT_NEAR(two[i], one[i], 1e-5 * std::fabs(one[i])) << mesh << " step " << i + 1;
  }
}

// Between hosts there is no shared memory: OpenMPI restricted to TCP (the ob1 messaging layer over
// the tcp and self transports, here on the loopback interface) must give the one-device run too.
// This is what `mpirun --hostfile hosts --mca btl tcp,self …` does across machines (README).
TEST(DistributedTransport, TcpOnlyEqualsOneDevice) {
  const std::string model = fixture("keras/preset-gemma2-tiny");
  const std::string root = make_temp_dir("dist-tcp");
  const RunResult one = run_job(model, false, "", 1, root + "/one");
  const std::string tcp = "--mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo";
  const RunResult many = run_job(model, false, "--mesh 1x2 --layout auto", 2, root + "/tcp", tcp);
  expect_same(one, many, "(1,2) over TCP", 5e-4);
  const RunResult data_parallel = run_job(model, false, "", 2, root + "/tcp-dp", tcp);
  expect_same(one, data_parallel, "data parallel over TCP", 5e-4);
}

// Data parallel and (1, 2) tensor parallel against one process under `args` (e.g. a weight
// precision): the first step's loss to rounding (1e-6), later ones within `later` relative, and
// the same generated tokens.
void expect_meshes_follow_one_process(const std::string& model, const std::string& args, double later,
                                      const std::string& root) {
  const RunResult one = run_job(model, false, args, 1, root + "/one");
  ASSERT_EQ(one.losses.size(), 5u);
  for (const std::string& mesh : {std::string(""), std::string("--mesh 1x2 --layout auto")}) {
    const RunResult many = run_job(model, false, args + " " + mesh, 2, root + "/two" + std::to_string(mesh.size()));
    ASSERT_EQ(many.losses.size(), one.losses.size()) << mesh;
    EXPECT_NEAR(many.losses[0], one.losses[0], 1e-6 * one.losses[0]) << mesh;
    for (size_t i = 0; i < one.losses.size(); ++i) {
      std::printf("    step %zu: loss %.9f one process, %.9f on 2 (%s)\n", i + 1, one.losses[i], many.losses[i],
                  mesh.empty() ? "data parallel" : mesh.c_str());
      EXPECT_NEAR(many.losses[i], one.losses[i], later * one.losses[i]) << mesh << " step " << i + 1;
    }
    EXPECT_EQ(many.generated, one.generated) << mesh;
  }
}

// LoRA over an int8 base (--quantize int8) split over the batch axis, and over tensor-parallel heads
// and FFN width, gives the one-process run: the first step's loss to rounding; later ones within
// 3e-4, because the last-bit differences of the split sums (5e-4 of the weights, see expect_same)
// can flip an activation's int8 code (int8.md §6), which moves the loss by one quantization step:
// 1.4e-4 at step 4 when dy·W over the dequantized weights runs on oneDNN's f32 matmul (its split
// sums differ in more last bits than OpenBLAS'; 1e-8 with MESHTUNE_F32_MATMUL=sgemm).
// Generation after training (the adapter as low-rank terms over the int8 parts) gives the same
// tokens, from a Keras int8 preset too. A layout whose int8 blocks would have to be all-gathered
// (--no-tensor-parallel) is a clear error on every rank.
TEST(DistributedInt8, DataAndTensorParallelEqualOneDevice) {
  expect_meshes_follow_one_process(fixture("keras/preset-gemma-tiny"), "--quantize int8", 3e-4, make_temp_dir("dist-int8"));
  const std::string preset = fixture("keras2/preset-gemma-tiny-int8");
  const std::string generate = "--threads 1 generate " + preset + " --prompt 'The licenses' --max-length 12 --no-stop --json";
  const CommandResult whole = run_job_command(generate, "");
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  const CommandResult parts = run_job_command(generate + " --mesh 1x2 --layout auto", kMpirun + "2 ");
  ASSERT_EQ(parts.exit_code, 0) << parts.err;
  EXPECT_EQ(parts.out, whole.out);
  const CommandResult gathered = run_job_command(generate + " --mesh 1x2 --layout auto --no-tensor-parallel", kMpirun + "2 ");
  EXPECT_EQ(gathered.exit_code, 1) << gathered.err;
  EXPECT_NE(gathered.err.find("int8 weights split across the mesh can only be used as each process' tensor-parallel part"),
            std::string::npos) << gathered.err;
}

// Under mixed_bfloat16 a mesh gives the one-process run too, data parallel and tensor parallel: the
// first step's loss to rounding; later ones within 1e-3 (a last-bit difference of a split sum can
// round a matmul input to the neighbouring bf16 value, 2^-8 apart, and Adam at lr 1e-2 carries it).
TEST(DistributedPolicy, MixedBfloat16EqualsOneDevice) {
  expect_meshes_follow_one_process(fixture("keras/preset-gemma2-tiny"), "--dtype-policy mixed_bfloat16", 1e-3,
                                   make_temp_dir("dist-policy"));
}

TEST_P(Distributed, EveryMeshAndLayoutEqualsOneDevice) {
  const auto [preset, full] = GetParam();
  const std::string model = fixture("keras/" + preset);
  const std::string root = make_temp_dir("dist");
  const std::string layout_file = root + "/tutorial.json";
  std::ofstream(layout_file) << kTutorialAdapted;
  const RunResult one = run_job(model, full, "", 1, root + "/one");
  int i = 0;
  for (const std::string mesh : {"1x2", "2x1", "1x4", "2x2"}) {
    const int processes = (mesh[0] - '0') * (mesh[2] - '0');
    for (const std::string& layout : {"--layout " + layout_file, std::string("--layout auto"), std::string("")}) {
      const std::string args = "--mesh " + mesh + " " + layout;
      const bool reordered = mesh[0] != '1' || (mesh[2] != '1' && !layout.empty());
      expect_same(one, run_job(model, full, args, processes, root + "/run" + std::to_string(i++)), args,
                  reordered ? 5e-4 : 1e-5);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Distributed,
                         ::testing::Combine(::testing::Values("preset-gemma-tiny", "preset-gemma2-tiny"),
                                            ::testing::Values(false, true)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) == "preset-gemma-tiny" ? "Gemma1" : "Gemma2") +
                                  (std::get<1>(info.param) ? "Full" : "Lora");
                         });

// A 2x2 run SIGKILLed after step 3 resumes from its sharded checkpoint (one file per rank plus a
// manifest) to bit-identical weights.
TEST(DistributedResume, ShardedCheckpointResumesBitIdentically) {
  const std::string root = make_temp_dir("dist-resume");
  ASSERT_EQ(run_meshtune("init --config tiny-gemma2 " + root + "/tiny").exit_code, 0);
  const std::string common = "--threads 1 finetune " + root + "/tiny --data sample --seq-len 12 --batch-size 4 --steps 6 "
                             "--lr 1e-2 --no-progress --lora-targets all --layout auto ";
  const std::string args = common + "--mesh 2x2 --out ";
  const std::string mpirun = kMpirun + "4 -x MESHTUNE_TEST_KILL_AFTER_STEP ";
  ASSERT_EQ(run_meshtune(args + root + "/a", "", kMpirun + "4 ").exit_code, 0);
  EXPECT_NE(run_meshtune(args + root + "/b --checkpoint-every 1", "MESHTUNE_TEST_KILL_AFTER_STEP=3", mpirun).exit_code, 0);
  EXPECT_TRUE(fs::exists(root + "/b/checkpoint.safetensors.step3.rank3"));
  EXPECT_FALSE(fs::exists(root + "/b/checkpoint.safetensors.step2.rank0"));  // older files are removed
  CommandResult resumed = run_meshtune(args + root + "/b --resume", "", kMpirun + "4 ");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.err.find("at step 3"), std::string::npos);
  EXPECT_EQ(read_text_file(root + "/a/adapter/adapter_model.safetensors"),
            read_text_file(root + "/b/adapter/adapter_model.safetensors"));
  // Resuming on another mesh is refused with a clear message.
  CommandResult other = run_meshtune(common + "--mesh 2x1 --out " + root + "/b --resume", "", kMpirun + "2 ");
  EXPECT_NE(other.exit_code, 0);
  EXPECT_NE(other.err.find("resume it on that mesh"), std::string::npos) << other.err;
}

// Per-process weight bytes on (1,2) with KerasHub's map: 1/2 of every split variable, the norms
// whole, as finetune reports them ("this process holds N bytes"). On a tiny model the allocator's
// total is dominated by MPI's own buffers, so the allocator measurement is the Gemma-2B-shaped one
// in bench/README.md (1.49 GB held of 2.98 GB, 1.92 GB peak RSS per rank against 3.79 GB).
TEST(DistributedMemory, EachProcessHoldsItsShareOfTheWeights) {
  const std::string model = fixture("keras/preset-gemma2-tiny");
  const std::string root = make_temp_dir("dist-memory");
  CommandResult r = run_job_command("--threads 1 finetune " + model + " --data sample --seq-len 12 --batch-size 4 --steps 1 "
                                    "--no-progress --lora-rank 2 --mesh 1x2 --layout auto --out " + root + "/run",
                                    kMpirun + "2 ");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // Expected: Σ over variables of bytes / (product of the axis sizes splitting it), from the same
  // map `--layout auto` builds (KerasHub's, K/V whole when their heads do not divide the axis).
  const size_t holds_at = r.err.find("this process holds ");
  ASSERT_NE(holds_at, std::string::npos) << r.err;
  const long long held = std::stoll(r.err.substr(holds_at + 19));
  const size_t one_at = r.err.find("(one device: ", holds_at);
  const long long whole = std::stoll(r.err.substr(one_at + 13));
  // The fixture: vocabulary 1000 × 64 embedding, 2 blocks of q (4·32·64), k, v (2·32·64 each; 2 KV
  // heads divide 2), o (4·32·64), gating ×2 and linear (64·128 each), 4 norms of 64, final norm 64.
  const long long D = 64, split = 1000 * D + 2 * (4 * 32 * D * 2 + 2 * 32 * D * 2 + 3 * D * 128),
                  kept = 2 * 4 * D + D;
  EXPECT_EQ(whole, 4 * (split + kept));
  EXPECT_EQ(held, 4 * (split / 2 + kept));
}

// Samples before/after training and validation under a mesh run on every process' part of the
// model (nothing gathered whole) and give what one process gives.
TEST(DistributedSamples, GenerateAndEvaluateDuringARunMatchOneDevice) {
  const std::string model = fixture("keras/preset-gemma2-tiny");
  const std::string root = make_temp_dir("dist-samples");
  const std::string args = "--threads 1 finetune " + model + " --data sample --seq-len 12 --batch-size 4 --steps 3 "
                           "--lr 1e-2 --no-progress --lora-rank 2 --lora-targets all --sample-prompt 'The movie' "
                           "--sample-max-length 10 --validation-data sample --validation-take 8 --out ";
  CommandResult one = run_meshtune(args + root + "/one");
  ASSERT_EQ(one.exit_code, 0) << one.err;
  CommandResult many = run_job_command(args + root + "/many --mesh 1x2 --layout auto", kMpirun + "2 ");
  ASSERT_EQ(many.exit_code, 0) << many.err;
  auto lines = [](const std::string& text, const std::string& prefix) {
    std::string out;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);)
      if (line.rfind(prefix, 0) == 0) out += line + "\n";
    return out;
  };
  EXPECT_FALSE(lines(one.out, "after: ").empty()) << one.out;
  EXPECT_EQ(lines(many.out, "before: "), lines(one.out, "before: "));
  EXPECT_EQ(lines(many.out, "after: "), lines(one.out, "after: "));
  const json r1 = json::parse(lines(one.out, "{")), rn = json::parse(lines(many.out, "{"));
  EXPECT_NEAR(rn["val_loss"].get<double>(), r1["val_loss"].get<double>(), 1e-5 * r1["val_loss"].get<double>());
  EXPECT_EQ(rn["val_accuracy"].get<double>(), r1["val_accuracy"].get<double>());
}

// `export --checkpoint` reassembles a sharded run's checkpoint (each rank's blocks) into one model:
// the same weights the run itself wrote at the end (LoRA: merged the same way as `export --lora`).
TEST(DistributedExport, ShardedCheckpointBecomesOneModel) {
  const std::string model = fixture("keras/preset-gemma2-tiny");
  const std::string root = make_temp_dir("dist-export");
  for (const bool full : {false, true}) {
    const std::string run = root + (full ? "/full" : "/lora");
    CommandResult r = run_job_command("--threads 1 finetune " + model + " --data sample --seq-len 12 --batch-size 4 "
                                      "--steps 2 --lr 1e-2 --no-progress --mesh 2x2 --layout auto --out " + run +
                                      (full ? " --full" : " --lora-rank 2 --lora-targets all"),
                                      kMpirun + "4 ");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    CommandResult e = run_meshtune("export " + model + " --checkpoint " + run + "/checkpoint.safetensors --to keras " +
                                   run + "/exported");
    ASSERT_EQ(e.exit_code, 0) << e.err;
    EXPECT_NE(e.err.find("step 2"), std::string::npos) << e.err;
    std::string reference = run + "/model";  // full: what the run wrote; LoRA: export --lora
    if (!full) {
      ASSERT_EQ(run_meshtune("export " + model + " --lora " + run + "/adapter.lora.h5 --to keras " + run + "/merged").exit_code, 0);
      reference = run + "/merged";
    }
    const auto got = floats_of(read_keras_weights_dir(run + "/exported"));
    const auto want = floats_of(read_keras_weights_dir(reference));
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, values] : want) EXPECT_EQ(got.at(name), values) << (full ? "full " : "lora ") << name;
  }
  // A file that is not a checkpoint is a clear error.
  CommandResult bad = run_meshtune("export " + model + " --checkpoint " + model + "/config.json --to keras " + root + "/x");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("config.json"), std::string::npos) << bad.err;
}

// The error paths: a clear message, a non-zero exit of the whole job, and no hang.
void expect_job_fails(const std::string& args, int processes, const std::vector<std::string>& needles,
                      const std::string& env = "") {
  const auto start = std::chrono::steady_clock::now();
  CommandResult r = run_meshtune(args, env, kMpirun + std::to_string(processes) + " ");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.exit_code, 0) << args;
  EXPECT_LT(seconds, 60) << args;
  for (const auto& n : needles) EXPECT_NE(r.err.find(n), std::string::npos) << "missing '" << n << "' in " << r.err;
}

TEST(DistributedErrors, EachIsAClearErrorOnEveryRank) {
  const std::string model = fixture("keras/preset-gemma-tiny");
  const std::string root = make_temp_dir("dist-errors");
  const std::string base = "finetune " + model + " --data sample --seq-len 8 --batch-size 4 --steps 2 --no-progress --out " + root;
  // A dimension the axis does not divide: gemma-tiny has 1 KV head.
  expect_job_fails(base + " --mesh 1x2 --layout-rule 'decoder_block.*key.kernel=model,,'", 2,
                   {"decoder_block_0/attention/key/kernel", "model", "dimension 0"});
  expect_job_fails(base + " --mesh 1x2 --layout-rule 'token_embedding/embeddings=modle,'", 2, {"modle"});
  expect_job_fails(base + " --mesh 1x2 --layout-rule 'token_embedding/embeddings=model'", 2,
                   {"token_embedding/embeddings"});  // rank 1 rule for a rank 2 tensor
  expect_job_fails(base + " --mesh 1x2 --layout-rule '(unclosed=model,'", 2, {"(unclosed"});
  expect_job_fails(base + " --mesh 1x2 --layout-rule 'token_.*=model,' --layout-rule '.*embeddings=model,'", 2,
                   {"token_.*", ".*embeddings"});
  expect_job_fails(base + " --mesh 1x4", 2, {"4", "2 processes"});
  // One rank dying mid-run ends the job.
  expect_job_fails(base + " --steps 6 --mesh 2x1", 2, {}, "MESHTUNE_TEST_KILL_AFTER_STEP=2 MESHTUNE_TEST_KILL_RANK=1");
}

}  // namespace
