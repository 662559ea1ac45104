// The command line end to end: info, generate --json, logits, init/export — and every kind of bad
// input giving a clear message naming the file/tensor, a non-zero exit, and no crash.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backend/cuda_devices.h"
#include "io/npy.h"
#include "test_util.h"

using namespace meshtune;
using namespace meshtune::testing;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::string kTiny = fixture("keras/preset-gemma-tiny");
const std::string kTinyHf = fixture("hf/tiny-gemma/checkpoint");

std::string quote(const std::string& s) { return "'" + s + "'"; }

// A writable copy of an HF fixture checkpoint.
std::string copy_hf_checkpoint(const std::string& tag) {
  std::string dir = make_temp_dir(tag);
  for (const auto& entry : fs::directory_iterator(kTinyHf)) fs::copy_file(entry.path(), fs::path(dir) / entry.path().filename());
  for (const auto& entry : fs::directory_iterator(dir)) fs::permissions(entry.path(), fs::perms::owner_write, fs::perm_options::add);
  return dir;
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// The bad-input contract: non-zero exit, no signal, a message containing every `needle`.
void expect_clean_failure(const CommandResult& r, const std::vector<std::string>& needles) {
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(r.err.find("Segmentation"), std::string::npos);
  for (const auto& needle : needles) EXPECT_NE(r.err.find(needle), std::string::npos) << "missing '" << needle << "' in: " << r.err;
}

TEST(Cli, InfoListsEveryVariableWithShapeAndDtype) {
  CommandResult r = run_meshtune("info " + quote(kTiny));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json summary = json::parse(read_text_file(fixture("keras/summary-gemma-tiny.json")));
  for (const auto& v : summary["variables"]) {
    std::string shape = "(";
    for (size_t i = 0; i < v["shape"].size(); ++i) shape += (i ? ", " : "") + std::to_string(v["shape"][i].get<int>());
    shape += v["shape"].size() == 1 ? ",)" : ")";
    EXPECT_NE(r.out.find(v["path"].get<std::string>() + " "), std::string::npos) << v["path"];
    EXPECT_NE(r.out.find(shape), std::string::npos) << shape;
  }
  EXPECT_NE(r.out.find("Total params: 133,952 (523.25 KB)"), std::string::npos) << r.out;
}

TEST(Cli, GenerateJsonHasPromptCompletionAndAllIds) {
  CommandResult r = run_meshtune("generate " + quote(kTiny) + " --prompt 'The licenses' --prompt Copyright --max-length 10 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json summary = json::parse(read_text_file(fixture("keras/summary-gemma-tiny.json")));
  std::istringstream lines(r.out);
  std::string line;
  for (size_t i = 0; std::getline(lines, line); ++i) {
    json j = json::parse(line);
    const std::string prompt = summary["generate_strings"]["prompts"][i];
    const std::string full = summary["generate_strings"]["outputs"][i];
    EXPECT_EQ(j["prompt"], prompt);
    EXPECT_EQ(prompt + j["text"].get<std::string>(), full);
    EXPECT_EQ(j["token_ids"][0], 2);  // BOS first
  }
}

TEST(Cli, LogitsWritesNpyOfTheRightShape) {
  std::string dir = make_temp_dir("logits");
  CommandResult r = run_meshtune("logits " + quote(kTiny) + " --token-ids " +
                                 quote(fixture("keras/outputs-gemma-tiny/token_ids.npy")) + " --padding-mask " +
                                 quote(fixture("keras/outputs-gemma-tiny/padding_mask.npy")) + " --out " + dir +
                                 "/l.npy --hidden-states " + dir + "/h.npy");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(read_npy(dir + "/l.npy").shape, (Shape{3, 12, 1000}));
  EXPECT_EQ(read_npy(dir + "/h.npy").shape, (Shape{3, 12, 64}));
}

TEST(Cli, InitWritesAPresetThatLoadsAndGenerates) {
  std::string dir = make_temp_dir("init") + "/tiny";
  CommandResult r = run_meshtune("init " + quote(dir));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (std::string f : {"config.json", "model.weights.h5", "assets/tokenizer/vocabulary.spm", "preprocessor.json",
                        "tokenizer.json", "task.json", "metadata.json"})
    EXPECT_TRUE(fs::exists(fs::path(dir) / f)) << f;
  CommandResult g = run_meshtune("generate " + quote(dir) + " --prompt 'This movie' --max-length 12 --json");
  ASSERT_EQ(g.exit_code, 0) << g.err;
  EXPECT_EQ(json::parse(g.out)["token_ids"].size(), 12u);
  // Deterministic: a second init gives the same weights.
  std::string again = make_temp_dir("init2") + "/tiny";
  ASSERT_EQ(run_meshtune("init " + quote(again)).exit_code, 0);
  CommandResult g2 = run_meshtune("generate " + quote(again) + " --prompt 'This movie' --max-length 12 --json");
  EXPECT_EQ(g.out, g2.out);
}

TEST(Cli, InitBfloat16WritesBf16MatricesThatLoadAndGenerate) {
  const std::string root = make_temp_dir("init-bf16"), keras = root + "/keras", hf = root + "/hf";
  ASSERT_EQ(run_meshtune("init --config tiny --dtype bfloat16 " + quote(keras)).exit_code, 0);
  ASSERT_EQ(run_meshtune("init --config tiny --dtype bfloat16 --format hf " + quote(hf)).exit_code, 0);
  EXPECT_EQ(load_json(keras + "/config.json")["config"]["dtype"]["config"]["name"], "bfloat16");
  EXPECT_EQ(load_json(hf + "/config.json")["torch_dtype"], "bfloat16");
  for (const std::string& dir : {keras, hf}) {
    CommandResult info = run_meshtune("info " + quote(dir));
    ASSERT_EQ(info.exit_code, 0) << info.err;
    EXPECT_NE(info.out.find("decoder_block_0/attention/query/kernel             (4, 64, 16)             bfloat16"),
              std::string::npos) << info.out;
    EXPECT_NE(info.out.find("decoder_block_0/pre_attention_norm/scale           (64,)                   float32"),
              std::string::npos) << info.out;  // norm scales stay fp32
  }
  // The same weights in both formats: the same greedy tokens.
  CommandResult a = run_meshtune("generate " + quote(keras) + " --prompt 'This movie' --max-length 12 --json");
  CommandResult b = run_meshtune("generate " + quote(hf) + " --prompt 'This movie' --max-length 12 --json");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  EXPECT_EQ(json::parse(a.out)["token_ids"].size(), 12u);
  EXPECT_EQ(a.out, b.out);
  expect_clean_failure(run_meshtune("init --dtype float16 " + quote(root + "/bad")), {"--dtype", "float16"});
}

TEST(Cli, PresetNameResolvesThroughModelsDir) {
  std::string root = fs::path(kTiny).parent_path().string();
  CommandResult r = run_meshtune("info preset-gemma-tiny --models-dir " + quote(root));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  CommandResult missing = run_meshtune("info gemma_2b_en --models-dir " + quote(root));
  expect_clean_failure(missing, {"gemma_2b_en", root});
}

TEST(BadInput, MissingDirectoryOrConfig) {
  expect_clean_failure(run_meshtune("info /nonexistent/model/dir"), {"/nonexistent/model/dir"});
  std::string empty = make_temp_dir("empty");
  expect_clean_failure(run_meshtune("info " + quote(empty)), {empty, "config.json"});
}

TEST(BadInput, TruncatedH5) {
  std::string dir = make_temp_dir("trunc-h5");
  fs::copy(kTiny, dir, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  std::string weights = read_text_file(kTiny + "/model.weights.h5");
  fs::permissions(dir + "/model.weights.h5", fs::perms::owner_write, fs::perm_options::add);
  write_text(dir + "/model.weights.h5", weights.substr(0, weights.size() / 2));
  expect_clean_failure(run_meshtune("info " + quote(dir)), {"model.weights.h5"});
}

TEST(BadInput, H5TensorShapeDisagreesWithConfig) {
  std::string dir = make_temp_dir("shape-h5");
  fs::copy(kTiny, dir, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  fs::permissions(dir + "/config.json", fs::perms::owner_write, fs::perm_options::add);
  json config = json::parse(read_text_file(dir + "/config.json"));
  config["config"]["intermediate_dim"] = 512;
  write_text(dir + "/config.json", config.dump());
  expect_clean_failure(run_meshtune("info " + quote(dir)), {"model.weights.h5", "gating_ffw/vars/0", "(64, 128)"});
}

// Rewrites the safetensors header of a copied checkpoint with `edit` applied to its JSON.
void edit_safetensors_header(const std::string& path, const std::function<void(json&)>& edit) {
  std::string bytes = read_text_file(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  json header = json::parse(bytes.substr(8, n));
  edit(header);
  std::string text = header.dump();
  text.resize(n, ' ');  // same length keeps the data offsets meaningful
  ASSERT_LE(header.dump().size(), n);
  write_text(path, bytes.substr(0, 8) + text + bytes.substr(8 + n));
}

TEST(BadInput, SafetensorsHeaderLengthPastEnd) {
  std::string dir = copy_hf_checkpoint("st-len");
  std::string bytes = read_text_file(dir + "/model.safetensors");
  uint64_t huge = uint64_t(1) << 40;
  std::memcpy(bytes.data(), &huge, 8);
  write_text(dir + "/model.safetensors", bytes);
  expect_clean_failure(run_meshtune("info " + quote(dir)), {"model.safetensors", "header length"});
}

TEST(BadInput, SafetensorsOffsetsOutsideData) {
  std::string dir = copy_hf_checkpoint("st-off");
  edit_safetensors_header(dir + "/model.safetensors", [](json& h) {
    h["model.norm.weight"]["data_offsets"] = {100000000, 100000256};
  });
  expect_clean_failure(run_meshtune("info " + quote(dir)), {"model.safetensors", "model.norm.weight"});
}

TEST(BadInput, SafetensorsOverlappingTensors) {
  std::string dir = copy_hf_checkpoint("st-overlap");
  edit_safetensors_header(dir + "/model.safetensors", [](json& h) {
    h["model.norm.weight"]["data_offsets"] = h["model.embed_tokens.weight"]["data_offsets"][0].get<int64_t>() == 0
                                                 ? json{0, 256}
                                                 : json{h["model.embed_tokens.weight"]["data_offsets"][0], h["model.embed_tokens.weight"]["data_offsets"][0].get<int64_t>() + 256};
  });
  expect_clean_failure(run_meshtune("info " + quote(dir)), {"model.safetensors", "overlap"});
}

TEST(BadInput, SafetensorsDtypeDisagreesWithConfig) {
  std::string dir = copy_hf_checkpoint("st-dtype");
  edit_safetensors_header(dir + "/model.safetensors", [](json& h) {
    auto& t = h["model.layers.0.self_attn.q_proj.weight"];
    t["dtype"] = "I32";
  });
  expect_clean_failure(run_meshtune("info " + quote(dir)), {"model.safetensors", "model.layers.0.self_attn.q_proj.weight", "int32"});
}

TEST(BadInput, SafetensorsShapeDisagreesWithConfig) {
  std::string dir = copy_hf_checkpoint("st-shape");
  json config = json::parse(read_text_file(dir + "/config.json"));
  config["num_attention_heads"] = 8;
  write_text(dir + "/config.json", config.dump());
  expect_clean_failure(run_meshtune("info " + quote(dir)), {"model.safetensors", "q_proj.weight", "(64, 64)", "(128, 64)"});
}

TEST(BadInput, UnknownModelType) {
  std::string dir = copy_hf_checkpoint("st-type");
  json config = json::parse(read_text_file(dir + "/config.json"));
  config["model_type"] = "llama";
  write_text(dir + "/config.json", config.dump());
  expect_clean_failure(run_meshtune("info " + quote(dir)), {"config.json", "llama"});
}

TEST(BadInput, TokenizerLargerThanVocabulary) {
  std::string dir = copy_hf_checkpoint("st-vocab");
  // Shrink the model's vocabulary (and its embedding) below the tokenizer's 1000 pieces.
  std::string bytes = read_text_file(dir + "/model.safetensors");
  json config = json::parse(read_text_file(dir + "/config.json"));
  config["vocab_size"] = 500;
  write_text(dir + "/config.json", config.dump());
  edit_safetensors_header(dir + "/model.safetensors", [](json& h) {
    auto& t = h["model.embed_tokens.weight"];
    t["shape"] = {500, 64};
    t["data_offsets"][1] = t["data_offsets"][0].get<int64_t>() + 500 * 64 * 4;
  });
  expect_clean_failure(run_meshtune("generate " + quote(dir) + " --prompt hi --max-length 4"),
                       {"tokenizer.model", "1000", "500"});
}

TEST(BadInput, TokenIdOutsideVocabularyInLogits) {
  std::string dir = make_temp_dir("bad-ids");
  HostTensor ids = HostTensor::allocate(DType::I32, {1, 3});
  ids.mutable_as<int32_t>()[0] = 2;
  ids.mutable_as<int32_t>()[1] = 1000;
  write_npy(dir + "/ids.npy", ids);
  expect_clean_failure(run_meshtune("logits " + quote(kTiny) + " --token-ids " + dir + "/ids.npy --out " + dir + "/l.npy"),
                       {"ids.npy", "1000", "[0, 1]"});
  EXPECT_FALSE(fs::exists(dir + "/l.npy"));
}

TEST(BadInput, UnknownFlagAndSampler) {
  EXPECT_NE(run_meshtune("generate " + quote(kTiny) + " --prompt x --sampler beam").exit_code, 0);
  EXPECT_NE(run_meshtune("frobnicate").exit_code, 0);
}

}  // namespace

// Our config.json carries what transformers' Gemma configs declare, with the declared JSON types
// (transformers at commit 008e5743, GemmaConfig / Gemma2Config: strict dataclasses that reject a
// float where an int is declared), and what llama.cpp's convert_hf_to_gguf.py reads unconditionally
// (max_position_embeddings).
TEST(Cli, HfConfigFieldsHaveTransformersTypes) {
  const std::string root = make_temp_dir("hfconfig");
  for (const std::string family : {"tiny", "tiny-gemma2", "tiny-gemma3"}) {
    SCOPED_TRACE(family);
    const std::string dir = root + "/" + family;
    ASSERT_EQ(run_meshtune("init --format hf --config " + family + " " + quote(dir)).exit_code, 0);
    const json c = load_json(dir + "/config.json");
    for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                            "num_key_value_heads", "head_dim", "max_position_embeddings", "pad_token_id", "eos_token_id",
                            "bos_token_id"})
      EXPECT_TRUE(c.contains(key) && c[key].is_number_integer()) << key << " in " << c.dump();
    // Every field GemmaConfig / Gemma2Config declare at that commit, but rope_parameters (we write
    // the legacy rope_theta, which every version reads); Gemma3TextConfig: Gemma2Config's fields.
    std::vector<std::string> declared = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads", "head_dim",
                                         "max_position_embeddings", "initializer_range", "rms_norm_eps", "use_cache",
                                         "pad_token_id", "eos_token_id", "bos_token_id", "tie_word_embeddings",
                                         "attention_bias", "attention_dropout", "use_bidirectional_attention"};
    if (family == "tiny") declared.push_back("hidden_act");
    else
      for (const char* key : {"hidden_activation", "query_pre_attn_scalar", "sliding_window", "layer_types",
                              "final_logit_softcapping", "attn_logit_softcapping"})
        declared.push_back(key);
    for (const std::string& key : declared) EXPECT_TRUE(c.contains(key)) << key << " missing in " << c.dump();
    EXPECT_TRUE(c["rms_norm_eps"].is_number()) << c.dump();
    EXPECT_TRUE(c["initializer_range"].is_number_float() && c["attention_dropout"].is_number()) << c.dump();
    EXPECT_TRUE(c["use_cache"].is_boolean() && c["attention_bias"].is_boolean()) << c.dump();
    if (family != "tiny") {
      ASSERT_TRUE(c["layer_types"].is_array()) << c.dump();
      EXPECT_EQ(c["layer_types"].size(), c["num_hidden_layers"].get<size_t>());
    }
    EXPECT_TRUE(c["tie_word_embeddings"].is_boolean()) << c.dump();
    EXPECT_TRUE(c["query_pre_attn_scalar"].is_number_integer()) << c.dump();  // was 16.0
    if (family == "tiny") EXPECT_EQ(c.value("hidden_act", ""), "gelu_pytorch_tanh") << c.dump();
    else EXPECT_EQ(c.value("hidden_activation", ""), "gelu_pytorch_tanh") << c.dump();
    if (family != "tiny") {
      EXPECT_TRUE(c["sliding_window"].is_null() || c["sliding_window"].is_number_integer()) << c.dump();
      for (const char* key : {"final_logit_softcapping", "attn_logit_softcapping"})
        EXPECT_TRUE(c[key].is_null() || c[key].is_number()) << key << " in " << c.dump();
    }
  }
}


// A text-only Gemma 3 preset says so as KerasHub writes it (keras-hub at 71453d08, 0.32.0.dev0:
// Gemma3Tokenizer.get_config adds has_vision_tokens, Gemma3CausalLMPreprocessor.get_config adds
// num_vision_tokens_per_image and max_images_per_prompt); without it
// Gemma3CausalLM.from_preset fails with "Cannot find special token '<img>'".
TEST(Cli, Gemma3PresetIsTextOnlyForKeras) {
  const std::string dir = make_temp_dir("g3preset") + "/m";
  ASSERT_EQ(run_meshtune("init --config tiny-gemma3 " + quote(dir)).exit_code, 0);
  const json tokenizer = load_json(dir + "/tokenizer.json");
  const json preprocessor = load_json(dir + "/preprocessor.json");
  const json task = load_json(dir + "/task.json");
  EXPECT_EQ(tokenizer["class_name"], "Gemma3Tokenizer");
  EXPECT_EQ(tokenizer["config"]["has_vision_tokens"], false);
  EXPECT_EQ(preprocessor["config"]["tokenizer"]["config"]["has_vision_tokens"], false);
  EXPECT_EQ(preprocessor["config"]["num_vision_tokens_per_image"], 256);
  EXPECT_EQ(preprocessor["config"]["max_images_per_prompt"], 2);
  EXPECT_EQ(task["config"]["preprocessor"], preprocessor);
  // and still loads here
  EXPECT_EQ(run_meshtune("generate " + quote(dir) + " --prompt hi --max-length 8").exit_code, 0);
}

// `info --system` says which kernel paths run; MESHTUNE_CPU forces one (and a bad value is one
// clear error); a forced generic path gives the same greedy generation as the default path.
TEST(Cli, InfoSystemReportsKernelPathsAndMeshtuneCpuForcesOne) {
  const CommandResult info = run_meshtune("info --system");
  ASSERT_EQ(info.exit_code, 0) << info.err;
  for (const char* line : {"cpu features:", "kernel path:", "decode matrix-vector", "elementwise kernels", "BLAS: OpenBLAS"})
    EXPECT_NE(info.out.find(line), std::string::npos) << line << " in\n" << info.out;
  const CommandResult forced = run_meshtune("info --system", "MESHTUNE_CPU=generic");
  ASSERT_EQ(forced.exit_code, 0) << forced.err;
  EXPECT_NE(forced.out.find("kernel path: generic (forced by MESHTUNE_CPU)"), std::string::npos) << forced.out;
  const CommandResult bad = run_meshtune("info --system", "MESHTUNE_CPU=sse9");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("MESHTUNE_CPU=sse9: expected generic, avx2, avx512 or avx512bf16"), std::string::npos) << bad.err;
  const std::string model = fixture("keras/preset-gemma-tiny");
  const std::string args = "generate " + model + " --prompt 'The movie' --max-length 16";
  const CommandResult best = run_meshtune(args), generic = run_meshtune(args, "MESHTUNE_CPU=generic");
  ASSERT_EQ(best.exit_code, 0) << best.err;
  ASSERT_EQ(generic.exit_code, 0) << generic.err;
  EXPECT_EQ(best.out, generic.out);
}

// A bad command line is one line with the prefix every other error has, and exit code 1; a thread
// count the machine cannot start is refused before libgomp aborts.
TEST(Cli, ParseErrorsAndThreadCountsAreOneLineErrors) {
  for (const std::string& args : {std::string("generate"), std::string("finetune x --data y --batch-size abc"),
                                   std::string("nonsense"), std::string("--threads 4096 info --system"),
                                   std::string("--threads 0 info --system"), std::string("--threads -3 info --system")}) {
    const CommandResult r = run_meshtune(args);
    EXPECT_EQ(r.exit_code, 1) << args;
    EXPECT_EQ(r.err.rfind("meshtune: error: ", 0), 0u) << args << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << ": " << r.err;
  }
  EXPECT_NE(run_meshtune("--threads 4096 info --system").err.find("--threads must be between 1 and"), std::string::npos);
  EXPECT_EQ(run_meshtune("--threads 2 info --system").exit_code, 0);
  EXPECT_EQ(run_meshtune("--help").exit_code, 0);
}

// --device cuda on a machine without a usable GPU (this one; or a build without the CUDA backend):
// one line naming the flag and the reason, exit 1, for generate and finetune alike; and
// the GPU section of `info --system` says why there is none. (On a GPU machine the GPU tests,
// ctest -L gpu, cover the other side.)
TEST(Cli, DeviceCudaWithoutAGpuIsOneLine) {
  if (!cuda_system().gpus.empty()) GTEST_SKIP() << "this machine has a GPU";
  const std::string model = fixture("keras/preset-gemma-tiny");
  for (const std::string& args : {"generate " + model + " --prompt hi --device cuda",
                                   "finetune " + model + " --data sample --steps 1 --device cuda --out " +
                                       make_temp_dir("device-cuda") + "/run"}) {
    const CommandResult r = run_meshtune(args);
    EXPECT_EQ(r.exit_code, 1) << args;
    EXPECT_EQ(r.err.rfind("meshtune: error: --device cuda: ", 0), 0u) << args << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << ": " << r.err;
  }
  const CommandResult bad = run_meshtune("generate " + model + " --prompt hi --device tpu");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("--device"), std::string::npos) << bad.err;
  const CommandResult info = run_meshtune("info --system");
  EXPECT_NE(info.out.find("GPUs: none usable ("), std::string::npos) << info.out;
}
