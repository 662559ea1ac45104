// The table of hostile inputs: each case damages one file of a valid model, adapter, checkpoint,
// layout or data set (truncation, huge / negative / overflowing sizes, overlaps, wrong types, deep
// nesting, path traversal, bad UTF-8, NUL bytes, regex bombs) and runs the Release binary on it.
// Every case must end with exit code 1 and one error line that names the file (and the key, tensor
// or line), within a time limit (no hang) and a memory bound (no unbounded allocation), and with no
// crash, sanitizer report or library dump. A few cases are valid but hostile in size or shape
// (a regex bomb that matches nothing, a 4 MB line) and must succeed within the same bounds.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/crc32c.h"
#include "io/keras_h5.h"
#include "io/safetensors.h"
#include "train/trainer.h"
#include "test_util.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using meshtune::testing::make_temp_dir;
using meshtune::testing::read_text_file;

namespace {

constexpr int kTimeoutSeconds = 60;
constexpr long kMaxRssKb = 200 * 1024;  // every valid input here needs far less

struct Outcome {
  int exit_code = -1;  // 128 + signal when killed
  bool timed_out = false;
  long max_rss_kb = 0;
  std::string err;
};

// Runs `meshtune ARGS` (a shell word list) in its own process group with a deadline, and reads the
// peak resident memory of it and its children from wait4.
Outcome run_bounded(const std::string& args, const std::string& shell_prefix = "") {
  const std::string dir = make_temp_dir("hostile-run");
  const std::string err_path = dir + "/err";
  const std::string command = shell_prefix + "exec '" + std::string(MESHTUNE_BINARY) + "' --threads 1 " + args;
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    const int err = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int null = open("/dev/null", O_RDWR);
    dup2(null, 0);
    dup2(null, 1);
    dup2(err, 2);
    execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  Outcome o;
  int status = 0;
  struct rusage usage {};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kTimeoutSeconds);
  while (true) {
    if (wait4(pid, &status, WNOHANG, &usage) == pid) break;
    if (std::chrono::steady_clock::now() > deadline) {
      kill(-pid, SIGKILL);
      wait4(pid, &status, 0, &usage);
      o.timed_out = true;
      break;
    }
    usleep(5000);
  }
  o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  o.max_rss_kb = usage.ru_maxrss;
  o.err = read_text_file(err_path);
  fs::remove_all(dir);
  return o;
}

std::string q(const std::string& s) { return "'" + s + "'"; }

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}
std::string read_bytes(const std::string& path) { return read_text_file(path); }
void write_json(const std::string& path, const json& j) { write_bytes(path, j.dump(2)); }
json read_json(const std::string& path) { return json::parse(read_bytes(path)); }
void truncate_to(const std::string& path, size_t n) { write_bytes(path, read_bytes(path).substr(0, n)); }

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char((v >> (8 * i)) & 0xff);
  return s;
}
std::string nested(const std::string& open, const std::string& inner, const std::string& close, int depth) {
  std::string s;
  for (int i = 0; i < depth; ++i) s += open;
  s += inner;
  for (int i = 0; i < depth; ++i) s += close;
  return s;
}

// A safetensors file's header text and data, to rewrite the header by hand.
struct StFile {
  std::string header, data;
};
StFile split_st(const std::string& path) {
  const std::string bytes = read_bytes(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(bytes[size_t(i)]);
  return {bytes.substr(8, n), bytes.substr(8 + n)};
}
void write_st(const std::string& path, const std::string& header, const std::string& data) {
  write_bytes(path, le64(header.size()) + header + data);
}
void edit_st_header(const std::string& path, const std::function<void(json&)>& edit) {
  StFile f = split_st(path);
  json h = json::parse(f.header);
  edit(h);
  write_st(path, h.dump(), f.data);
}
// Rewrites a checkpoint file's metadata (e.g. a rank file's placement), keeping its tensors.
void edit_st_metadata(const std::string& path, const std::function<void(std::map<std::string, std::string>&)>& edit) {
  std::map<std::string, std::string> meta = meshtune::read_safetensors_metadata(path);
  const auto tensors = meshtune::read_safetensors(path);
  std::vector<std::pair<std::string, meshtune::HostTensor>> ordered(tensors.begin(), tensors.end());
  edit(meta);
  meshtune::write_safetensors(path, ordered, meta);
}

// One TFRecord record: length, masked CRC of the length, data, masked CRC of the data.
std::string tfrecord(const std::string& data) {
  const std::string len = le64(data.size());
  auto crc = [](const std::string& s) {
    const uint32_t c = meshtune::masked_crc32c(s.data(), s.size());
    return std::string(reinterpret_cast<const char*>(&c), 4);
  };
  return len + crc(len) + data + crc(data);
}

// The valid inputs every case starts from, made once per test process.
struct Bases {
  std::string root, keras, hf, run, sharded;
};

int run_ok(const std::string& args) {
  const Outcome o = run_bounded(args);
  EXPECT_EQ(o.exit_code, 0) << args << "\n" << o.err;
  return o.exit_code;
}

const Bases& bases() {
  static Bases b = [] {
    Bases b;
    b.root = make_temp_dir("hostile-bases");
    b.keras = b.root + "/keras";
    b.hf = b.root + "/hf";
    b.run = b.root + "/run";
    b.sharded = b.root + "/sharded";
    run_ok("init " + q(b.keras));
    run_ok("init --format hf " + q(b.hf));
    const std::string train = " --data sample --take 4 --steps 1 --batch-size 2 --seq-len 16 --no-progress --out ";
    run_ok("finetune " + q(b.keras) + train + q(b.run));
    const std::string mpirun = std::string(MESHTUNE_MPIEXEC) + " --allow-run-as-root --oversubscribe -np 2 '" +
                               MESHTUNE_BINARY + "' --threads 1 finetune " + q(b.keras) + train + q(b.sharded) +
                               " --mesh 1x2 --layout auto >/dev/null 2>&1";
    EXPECT_EQ(std::system(mpirun.c_str()), 0) << mpirun;
    return b;
  }();
  return b;
}

// A case: `setup` copies what it needs into its own directory `dir`, damages it, and returns the
// meshtune arguments; the error line must contain every needle.
struct Case {
  std::string name;
  std::function<std::string(const std::string& dir)> setup;
  std::vector<std::string> needles;
  int exit_code = 1;
  std::string shell_prefix = "";  // e.g. a file-size limit that makes every write past it fail (a full disk)
};

std::string copy_of(const std::string& from, const std::string& dir, const std::string& name) {
  const std::string to = dir + "/" + name;
  fs::copy(from, to, fs::copy_options::recursive);
  return to;
}

void run_table(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string dir = make_temp_dir("hostile-" + c.name);
    const std::string args = c.setup(dir);
    const auto start = std::chrono::steady_clock::now();
    const Outcome o = run_bounded(args, c.shell_prefix);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_FALSE(o.timed_out) << "hung (killed after " << kTimeoutSeconds << " s)";
    EXPECT_EQ(o.exit_code, c.exit_code) << o.err;
    EXPECT_LT(o.max_rss_kb, kMaxRssKb) << "peak RSS " << o.max_rss_kb / 1024 << " MB";
    for (const char* bad : {"Sanitizer", "Segmentation", "terminate called", "HDF5-DIAG", "Aborted", "core dumped"})
      EXPECT_EQ(o.err.find(bad), std::string::npos) << o.err;
    if (c.exit_code == 1) {
      std::vector<std::string> error_lines;
      std::istringstream lines(o.err);
      for (std::string line; std::getline(lines, line);)
        if (line.find("error") != std::string::npos) error_lines.push_back(line);
      EXPECT_EQ(error_lines.size(), 1u) << "want exactly one error line:\n" << o.err;
      if (error_lines.size() == 1) {
        EXPECT_EQ(error_lines[0].rfind("meshtune: error: ", 0), 0u) << error_lines[0];
        EXPECT_LT(error_lines[0].size(), 2000u) << "an error line must stay readable";
        for (const std::string& needle : c.needles)
          EXPECT_NE(error_lines[0].find(needle), std::string::npos) << "missing '" << needle << "' in: " << error_lines[0];
      }
    }
    const size_t last = o.err.find_last_not_of('\n');
    const std::string last_line = o.err.substr(o.err.rfind('\n', last) == std::string::npos ? 0 : o.err.rfind('\n', last) + 1);
    std::printf("  %-36s exit %d %5.2f s %4ld MB  %s\n", c.name.c_str(), o.exit_code, seconds, o.max_rss_kb / 1024,
                c.exit_code == 1 ? last_line.substr(0, 220).c_str() : "");
    fs::remove_all(dir);
  }
}

// ---- Hugging Face checkpoints: model.safetensors, its index, config.json ------------------------

TEST(Hostile, SafetensorsModel) {
  const Bases& b = bases();
  auto hf = [&](const std::string& dir, const std::function<void(const std::string& st)>& damage) {
    const std::string m = copy_of(b.hf, dir, "m");
    damage(m + "/model.safetensors");
    return "info " + q(m);
  };
  auto header = [&](const std::string& dir, const std::function<void(json&)>& edit) {
    return hf(dir, [&](const std::string& st) { edit_st_header(st, edit); });
  };
  auto first_tensor = [](json& h) -> json& {
    for (auto& [k, v] : h.items())
      if (k != "__metadata__") return v;
    throw std::runtime_error("no tensor");
  };
  run_table({
      {"st_truncated_4_bytes", [&](const std::string& d) { return hf(d, [](const std::string& st) { truncate_to(st, 4); }); }, {"model.safetensors", "too short"}},
      {"st_truncated_data", [&](const std::string& d) { return hf(d, [](const std::string& st) { truncate_to(st, read_bytes(st).size() / 2); }); },
       {"model.safetensors", "tensor"}},
      {"st_header_length_huge", [&](const std::string& d) { return hf(d, [](const std::string& st) {
         std::string s = read_bytes(st); write_bytes(st, le64(~0ull) + s.substr(8)); }); }, {"model.safetensors", "header length"}},
      {"st_header_not_json", [&](const std::string& d) { return hf(d, [](const std::string& st) { write_st(st, "{\"a\": nope}", ""); }); },
       {"model.safetensors", "JSON"}},
      {"st_header_not_object", [&](const std::string& d) { return hf(d, [](const std::string& st) { write_st(st, "[1, 2]", ""); }); },
       {"model.safetensors", "not a JSON object"}},
      {"st_header_deep_nesting", [&](const std::string& d) { return hf(d, [](const std::string& st) {
         write_st(st, "{\"t\": {\"dtype\": \"F32\", \"shape\": " + nested("[", "1", "]", 200000) + "}}", ""); }); },
       {"model.safetensors", "nested"}},
      {"st_header_bad_utf8", [&](const std::string& d) { return hf(d, [](const std::string& st) { write_st(st, "{\"\xff\xfe\": 1}", ""); }); },
       {"model.safetensors", "JSON"}},
      {"st_header_nul_byte", [&](const std::string& d) { return hf(d, [](const std::string& st) { write_st(st, std::string("{\"a\0b\": 1}", 10), ""); }); },
       {"model.safetensors"}},
      {"st_shape_negative", [&](const std::string& d) { return header(d, [&](json& h) { first_tensor(h)["shape"] = {-4, 16}; }); },
       {"model.safetensors", "non-negative"}},
      {"st_shape_overflow", [&](const std::string& d) { return header(d, [&](json& h) { first_tensor(h)["shape"] = {1ull << 40, 1ull << 40}; }); },
       {"model.safetensors", "too many elements"}},
      {"st_shape_float", [&](const std::string& d) { return header(d, [&](json& h) { first_tensor(h)["shape"] = {2.5}; }); },
       {"model.safetensors", "non-negative integers"}},
      {"st_offsets_past_end", [&](const std::string& d) { return header(d, [&](json& h) { first_tensor(h)["data_offsets"] = {0, 1ull << 50}; }); },
       {"model.safetensors", "past the end"}},
      {"st_offsets_reversed", [&](const std::string& d) { return header(d, [&](json& h) { first_tensor(h)["data_offsets"] = {8, 4}; }); },
       {"model.safetensors", "begin > end"}},
      {"st_offsets_missing", [&](const std::string& d) { return header(d, [&](json& h) { first_tensor(h).erase("data_offsets"); }); },
       {"model.safetensors", "data_offsets"}},
      {"st_overlap", [&](const std::string& d) { return header(d, [&](json& h) {
         std::map<uint64_t, std::string> by_size;  // two tensors of one size: the second gets the first's bytes
         for (auto& [k, v] : h.items()) {
           if (k == "__metadata__") continue;
           const uint64_t size = v["data_offsets"][1].get<uint64_t>() - v["data_offsets"][0].get<uint64_t>();
           if (by_size.count(size)) {
             v["data_offsets"] = h[by_size[size]]["data_offsets"];
             return;
           }
           by_size[size] = k;
         }
         throw std::runtime_error("no two tensors of one size"); }); }, {"model.safetensors", "overlap"}},
      {"st_dtype_unknown", [&](const std::string& d) { return header(d, [&](json& h) { first_tensor(h)["dtype"] = "F64"; }); },
       {"model.safetensors", "unsupported dtype"}},
      {"st_dtype_not_string", [&](const std::string& d) { return header(d, [&](json& h) { first_tensor(h)["dtype"] = json::object(); }); },
       {"model.safetensors", "dtype"}},
      {"st_dtype_wrong_for_weight", [&](const std::string& d) { return header(d, [&](json& h) {
         for (auto& [k, v] : h.items())
           if (k.find("embed_tokens") != std::string::npos) v["dtype"] = "I32"; }); }, {"embed_tokens"}},
      {"st_missing_tensor", [&](const std::string& d) { return header(d, [&](json& h) {
         for (auto& [k, v] : h.items())
           if (k.find("layers.1.mlp.down_proj") != std::string::npos) { h.erase(k); return; } }); },
       {"layers.1.mlp.down_proj"}},
      {"st_entry_not_object", [&](const std::string& d) { return header(d, [&](json& h) { first_tensor(h) = 7; }); },
       {"model.safetensors", "not a JSON object"}},
      {"st_index_traversal", [&](const std::string& d) {
         const std::string m = copy_of(b.hf, d, "m");
         write_json(m + "/model.safetensors.index.json", {{"weight_map", {{"model.embed_tokens.weight", "../../../../etc/passwd"}}}});
         return "info " + q(m); }, {"model.safetensors.index.json", "not a plain file name"}},
      {"st_index_absolute", [&](const std::string& d) {
         const std::string m = copy_of(b.hf, d, "m");
         write_json(m + "/model.safetensors.index.json", {{"weight_map", {{"model.embed_tokens.weight", "/etc/passwd"}}}});
         return "info " + q(m); }, {"model.safetensors.index.json", "not a plain file name"}},
      {"st_index_missing_shard", [&](const std::string& d) {
         const std::string m = copy_of(b.hf, d, "m");
         write_json(m + "/model.safetensors.index.json", {{"weight_map", {{"model.embed_tokens.weight", "nope.safetensors"}}}});
         return "info " + q(m); }, {"model.safetensors.index.json", "nope.safetensors"}},
      {"st_index_deep_nesting", [&](const std::string& d) {
         const std::string m = copy_of(b.hf, d, "m");
         write_bytes(m + "/model.safetensors.index.json", "{\"weight_map\": " + nested("{\"a\": ", "1", "}", 100000) + "}");
         return "info " + q(m); }, {"model.safetensors.index.json", "nested"}},
  });
}

TEST(Hostile, HfConfig) {
  const Bases& b = bases();
  auto config = [&](const std::string& dir, const std::function<void(json&)>& edit) {
    const std::string m = copy_of(b.hf, dir, "m");
    json c = read_json(m + "/config.json");
    edit(c);
    write_json(m + "/config.json", c);
    return "info " + q(m);
  };
  auto raw = [&](const std::string& dir, const std::string& text) {
    const std::string m = copy_of(b.hf, dir, "m");
    write_bytes(m + "/config.json", text);
    return "info " + q(m);
  };
  run_table({
      {"hf_heads_zero", [&](const std::string& d) { return config(d, [](json& c) { c["num_attention_heads"] = 0; c.erase("head_dim"); }); },
       {"config.json", "num_attention_heads"}},
      {"hf_heads_int_min", [&](const std::string& d) { return config(d, [](json& c) { c["num_attention_heads"] = -2147483648LL; c.erase("head_dim"); }); },
       {"config.json", "num_attention_heads"}},
      {"hf_kv_heads_minus_one", [&](const std::string& d) { return config(d, [](json& c) { c["num_key_value_heads"] = -1; }); },
       {"config.json", "num_key_value_heads"}},
      {"hf_vocab_2pow32_plus1", [&](const std::string& d) { return config(d, [](json& c) { c["vocab_size"] = 4294967297LL; }); },
       {"config.json", "vocab_size", "4294967297"}},
      {"hf_layers_2pow32", [&](const std::string& d) { return config(d, [](json& c) { c["num_hidden_layers"] = 4294967296LL; }); },
       {"config.json", "num_hidden_layers"}},
      {"hf_uint64_max", [&](const std::string& d) { return config(d, [](json& c) { c["hidden_size"] = ~0ull; }); },
       {"config.json", "hidden_size"}},
      {"hf_vocab_fraction", [&](const std::string& d) { return config(d, [](json& c) { c["vocab_size"] = 511.5; }); },
       {"config.json", "vocab_size"}},
      {"hf_vocab_string", [&](const std::string& d) { return config(d, [](json& c) { c["vocab_size"] = "512"; }); },
       {"config.json", "vocab_size"}},
      {"hf_vocab_missing", [&](const std::string& d) { return config(d, [](json& c) { c.erase("vocab_size"); }); },
       {"config.json", "vocab_size"}},
      {"hf_eps_string", [&](const std::string& d) { return config(d, [](json& c) { c["rms_norm_eps"] = "tiny"; }); },
       {"config.json", "rms_norm_eps"}},
      {"hf_rope_theta_negative", [&](const std::string& d) { return config(d, [](json& c) { c["rope_theta"] = -1.0; }); },
       {"config.json", "RoPE"}},
      {"hf_model_type_unknown", [&](const std::string& d) { return config(d, [](json& c) { c["model_type"] = "llama"; }); },
       {"config.json", "model_type"}},
      {"hf_text_config_not_object", [&](const std::string& d) { return config(d, [](json& c) { c["model_type"] = "gemma3"; c["text_config"] = 5; }); },
       {"config.json", "text_config"}},
      {"hf_sliding_window_huge", [&](const std::string& d) { return config(d, [](json& c) { c["model_type"] = "gemma2"; c["sliding_window"] = 1ll << 40; }); },
       {"config.json", "sliding_window"}},
      {"hf_max_positions_zero", [&](const std::string& d) { return config(d, [](json& c) { c["max_position_embeddings"] = 0; }); },
       {"config.json", "max_position_embeddings"}},
      {"hf_config_truncated", [&](const std::string& d) { return raw(d, "{\"model_type\": \"gemma\", \"vocab"); }, {"config.json", "JSON"}},
      {"hf_config_empty", [&](const std::string& d) { return raw(d, ""); }, {"config.json", "JSON"}},
      {"hf_config_array", [&](const std::string& d) { return raw(d, "[1, 2, 3]"); }, {"config.json"}},
      {"hf_config_deep_nesting", [&](const std::string& d) { return raw(d, "{\"model_type\": " + nested("[", "", "]", 500000) + "}"); },
       {"config.json", "nested"}},
  });
}

// ---- Keras presets: config.json, preprocessor.json, model.weights.h5 / .json, tokenizer -------

TEST(Hostile, KerasPreset) {
  const Bases& b = bases();
  auto config = [&](const std::string& dir, const std::function<void(json&)>& edit, const std::string& command = "info") {
    const std::string m = copy_of(b.keras, dir, "m");
    json c = read_json(m + "/config.json");
    edit(c);
    write_json(m + "/config.json", c);
    return command + " " + q(m);
  };
  auto preprocessor = [&](const std::string& dir, const json& sequence_length) {
    const std::string m = copy_of(b.keras, dir, "m");
    json p = read_json(m + "/preprocessor.json");
    p["config"]["sequence_length"] = sequence_length;
    write_json(m + "/preprocessor.json", p);
    return "generate " + q(m) + " --prompt hi";
  };
  auto file = [&](const std::string& dir, const std::string& name, const std::function<void(const std::string&)>& damage) {
    const std::string m = copy_of(b.keras, dir, "m");
    damage(m + "/" + name);
    return "generate " + q(m) + " --prompt hi --max-length 8";
  };
  run_table({
      {"keras_dtype_empty_object", [&](const std::string& d) { return config(d, [](json& c) { c["config"]["dtype"] = json::object(); }); },
       {"config.json", "dtype"}},
      {"keras_dtype_number", [&](const std::string& d) { return config(d, [](json& c) { c["config"]["dtype"] = 3; }); },
       {"config.json", "dtype"}},
      {"keras_vocab_negative", [&](const std::string& d) { return config(d, [](json& c) { c["config"]["vocabulary_size"] = -512; }); },
       {"config.json", "vocabulary_size"}},
      {"keras_heads_2pow32", [&](const std::string& d) { return config(d, [](json& c) { c["config"]["num_query_heads"] = 4294967300LL; }); },
       {"config.json", "num_query_heads"}},
      {"keras_intermediate_odd", [&](const std::string& d) { return config(d, [](json& c) { c["config"]["intermediate_dim"] = 255; }); },
       {"config.json", "intermediate_dim"}},
      {"keras_class_unknown", [&](const std::string& d) { return config(d, [](json& c) { c["class_name"] = "BertBackbone"; }); },
       {"config.json", "BertBackbone"}},
      {"keras_config_array", [&](const std::string& d) { return config(d, [](json& c) { c["config"] = json::array(); }); }, {"config.json"}},
      {"keras_bool_as_string", [&](const std::string& d) { return config(d, [](json& c) { c["config"]["use_post_ffw_norm"] = "yes"; }); },
       {"config.json", "use_post_ffw_norm"}},
      {"keras_heads_not_divisible", [&](const std::string& d) { return config(d, [](json& c) { c["config"]["num_key_value_heads"] = 3; }); },
       {"config.json", "num_key_value_heads"}},
      {"preprocessor_sequence_length_zero", [&](const std::string& d) { return preprocessor(d, 0); }, {"preprocessor.json", "sequence_length"}},
      {"preprocessor_sequence_length_2e9", [&](const std::string& d) { return preprocessor(d, 2000000000); }, {"preprocessor.json", "sequence_length"}},
      {"preprocessor_sequence_length_2pow32", [&](const std::string& d) { return preprocessor(d, 4294967297LL); }, {"preprocessor.json", "sequence_length"}},
      {"generate_max_length_2e9", [&](const std::string& d) { return "generate " + q(copy_of(b.keras, d, "m")) + " --prompt hi --max-length 2000000000"; },
       {"max_length", "8192"}},
      {"generate_stop_token_negative", [&](const std::string& d) { return "generate " + q(copy_of(b.keras, d, "m")) + " --prompt hi --stop-token-id -7"; },
       {"stop token id -7"}},
      {"h5_truncated", [&](const std::string& d) { return file(d, "model.weights.h5", [](const std::string& p) { truncate_to(p, read_bytes(p).size() / 3); }); },
       {"model.weights.h5"}},
      {"h5_not_hdf5", [&](const std::string& d) { return file(d, "model.weights.h5", [](const std::string& p) { write_bytes(p, "not an hdf5 file\n"); }); },
       {"model.weights.h5", "not an HDF5 file"}},
      {"h5_index_traversal", [&](const std::string& d) { return file(d, "model.weights.json", [](const std::string& p) {
         write_json(p, {{"weight_map", {{"token_embedding/embeddings", "../../m/model.weights.h5"}}}}); }); },
       {"model.weights.json", "not a plain file name"}},
      {"h5_index_deep_nesting", [&](const std::string& d) { return file(d, "model.weights.json", [](const std::string& p) {
         write_bytes(p, nested("[", "", "]", 300000)); }); }, {"model.weights.json", "nested"}},
      {"tokenizer_garbage", [&](const std::string& d) { return file(d, "assets/tokenizer/vocabulary.spm", [](const std::string& p) {
         write_bytes(p, std::string(1000, '\x07')); }); }, {"vocabulary.spm"}},
      {"tokenizer_empty", [&](const std::string& d) { return file(d, "assets/tokenizer/vocabulary.spm", [](const std::string& p) { write_bytes(p, ""); }); },
       {"vocabulary.spm"}},
  });
}

// ---- Keras int8 presets: the DTypePolicyMap in config.json (int8.md §4) --------------------------

TEST(Hostile, Int8Preset) {
  const std::string int8 = meshtune::testing::fixture("keras2/preset-gemma-tiny-int8");
  auto config = [&](const std::string& dir, const std::function<void(json&)>& edit) {
    const std::string m = copy_of(int8, dir, "m");
    json c = read_json(m + "/config.json");
    edit(c);
    write_json(m + "/config.json", c);
    return "generate " + q(m) + " --prompt hi --max-length 8";
  };
  auto policies = [](json& c) -> json& { return c["config"]["dtype"]["config"]["policy_map"]; };
  // Element 3 of the first int8 scale dataset (…/vars/1) of a layer whose path contains `layer`.
  auto scale = [&](const std::string& dir, const std::string& layer, float value) {
    const std::string m = copy_of(int8, dir, "m");
    using meshtune::HostTensor;
    std::map<std::string, HostTensor> datasets = meshtune::read_h5_datasets(m + "/model.weights.h5");
    std::vector<std::pair<std::string, HostTensor>> written;
    bool changed = false;
    for (auto& [name, tensor] : datasets) {
      HostTensor copy = HostTensor::allocate(tensor.dtype, tensor.shape);
      std::memcpy(copy.mutable_as<std::byte>(), tensor.data, tensor.nbytes());
      if (!changed && name.find(layer) != std::string::npos && name.size() > 6 &&
          name.compare(name.size() - 6, 6, "vars/1") == 0 && tensor.dtype == meshtune::DType::F32) {
        copy.mutable_as<float>()[3] = value;
        changed = true;
      }
      written.emplace_back(name, std::move(copy));
    }
    EXPECT_TRUE(changed) << "no int8 scale of " << layer;
    meshtune::write_h5_datasets(m + "/model.weights.h5", written);
    return "generate " + q(m) + " --prompt hi --max-length 8";
  };
  run_table({
      {"int8_policy_unknown_layer", [&](const std::string& d) { return config(d, [&](json& c) {
         policies(c)["decoder_block_99/attention/query"] = policies(c)["token_embedding"]; }); },
       {"config.json", "decoder_block_99/attention/query"}},
      {"int8_policy_mode_int4", [&](const std::string& d) { return config(d, [&](json& c) {
         policies(c)["token_embedding"]["config"]["mode"] = "int4"; }); }, {"config.json", "int4"}},
      {"int8_policy_mode_number", [&](const std::string& d) { return config(d, [&](json& c) {
         policies(c)["token_embedding"]["config"]["mode"] = 8; }); }, {"config.json", "mode"}},
      {"int8_policy_map_array", [&](const std::string& d) { return config(d, [&](json& c) { policies(c) = json::array({1, 2}); }); },
       {"config.json", "policy_map"}},
      {"int8_policy_not_object", [&](const std::string& d) { return config(d, [&](json& c) { policies(c)["token_embedding"] = "int8"; }); },
       {"config.json", "token_embedding"}},
      {"int8_policy_class_unknown", [&](const std::string& d) { return config(d, [&](json& c) {
         policies(c)["token_embedding"]["class_name"] = "Float8DTypePolicy"; }); }, {"config.json", "Float8DTypePolicy"}},
      {"int8_layer_left_float", [&](const std::string& d) { return config(d, [&](json& c) {
         policies(c).erase("decoder_block_0/attention/query"); }); }, {"model.weights.h5", "int8", "dtype policy map"}},
      // One scale of the embedding (vocabulary row 3) or of a decoder kernel made impossible.
      {"int8_embedding_scale_nan", [&](const std::string& d) { return scale(d, "embedding", NAN); },
       {"model.weights.h5", "int8 scale of", "nan", "index 3"}},
      {"int8_embedding_scale_zero", [&](const std::string& d) { return scale(d, "embedding", 0.f); },
       {"model.weights.h5", "int8 scale of", "finite positive"}},
      {"int8_kernel_scale_inf", [&](const std::string& d) { return scale(d, "query", INFINITY); },
       {"model.weights.h5", "query", "inf"}},
      {"int8_kernel_scale_negative", [&](const std::string& d) { return scale(d, "ffw_linear", -2.f); },
       {"model.weights.h5", "ffw_linear", "-2"}},
      {"int8_kernel_scale_denormal", [&](const std::string& d) { return scale(d, "gating", 1e-40f); },
       {"model.weights.h5", "gating", "normal"}},
      {"int8_preset_full_finetune", [&](const std::string& d) {
         return "finetune " + q(copy_of(int8, d, "m")) + " --full --data sample --take 2 --steps 1 --batch-size 2 --seq-len 8"
                " --no-progress --out " + q(d + "/run"); }, {"int8", "--full"}},
  });
}

// ---- LoRA adapters: PEFT directories and Keras .lora.h5 ---------------------------------------

TEST(Hostile, LoraAdapters) {
  const Bases& b = bases();
  auto peft_config = [&](const std::string& dir, const std::function<void(json&)>& edit) {
    const std::string a = copy_of(b.run + "/adapter", dir, "adapter");
    json c = read_json(a + "/adapter_config.json");
    edit(c);
    write_json(a + "/adapter_config.json", c);
    return "generate " + q(b.keras) + " --lora " + q(a) + " --prompt hi --max-length 8";
  };
  auto peft_weights = [&](const std::string& dir, const std::function<void(json&)>& edit) {
    const std::string a = copy_of(b.run + "/adapter", dir, "adapter");
    edit_st_header(a + "/adapter_model.safetensors", edit);
    return "generate " + q(b.keras) + " --lora " + q(a) + " --prompt hi --max-length 8";
  };
  auto keras_file = [&](const std::string& dir, const std::function<void(const std::string&)>& damage) {
    const std::string a = copy_of(b.run + "/adapter.lora.h5", dir, "adapter.lora.h5");
    damage(a);
    return "generate " + q(b.keras) + " --lora " + q(a) + " --prompt hi --max-length 8";
  };
  auto rename_first = [](json& h, const std::string& name) {
    for (auto& [k, v] : h.items())
      if (k != "__metadata__") { json t = v; h.erase(k); h[name] = t; return; }
  };
  run_table({
      {"peft_r_2pow32_plus1", [&](const std::string& d) { return peft_config(d, [](json& c) { c["r"] = 4294967297LL; }); },
       {"adapter_config.json", "r"}},
      {"peft_r_1e8", [&](const std::string& d) { return peft_config(d, [](json& c) { c["r"] = 100000000; }); }, {"adapter_config.json", "r"}},
      {"peft_r_negative", [&](const std::string& d) { return peft_config(d, [](json& c) { c["r"] = -4; }); }, {"adapter_config.json", "r"}},
      {"peft_alpha_string", [&](const std::string& d) { return peft_config(d, [](json& c) { c["lora_alpha"] = "x"; }); },
       {"adapter_config.json", "lora_alpha"}},
      {"peft_rank_pattern_lookahead", [&](const std::string& d) { return peft_config(d, [](json& c) { c["rank_pattern"] = {{"(?=q)q_proj", 2}}; }); },
       {"adapter_config.json", "rank_pattern", "not a valid regex"}},
      {"peft_rank_pattern_value_huge", [&](const std::string& d) { return peft_config(d, [](json& c) { c["rank_pattern"] = {{"q_proj", 1ll << 40}}; }); },
       {"adapter_config.json", "rank_pattern"}},
      {"peft_rank_pattern_not_object", [&](const std::string& d) { return peft_config(d, [](json& c) { c["rank_pattern"] = "q_proj"; }); },
       {"adapter_config.json", "rank_pattern"}},
      {"peft_rank_pattern_bomb", [&](const std::string& d) { return peft_config(d, [](json& c) {
         c["rank_pattern"]["(.*.*.*.*.*.*.*.*.*.*.*.*.*.*)*Z"] = 2; }); }, {}, 0},
      {"peft_rank_pattern_deep_parens", [&](const std::string& d) { return peft_config(d, [](json& c) {
         c["rank_pattern"][nested("(", "Z", ")", 2000)] = 2; }); }, {}, 0},
      {"peft_config_deep_nesting", [&](const std::string& d) {
         const std::string a = copy_of(b.run + "/adapter", d, "adapter");
         write_bytes(a + "/adapter_config.json", "{\"r\": " + nested("{\"a\":", "1", "}", 100000) + "}");
         return "generate " + q(b.keras) + " --lora " + q(a) + " --prompt hi"; }, {"adapter_config.json", "nested"}},
      {"peft_tensor_layer_index_huge", [&](const std::string& d) { return peft_weights(d, [&](json& h) {
         rename_first(h, "base_model.model.model.layers.99999999999.self_attn.q_proj.lora_A.weight"); }); },
       {"adapter_model.safetensors", "unexpected tensor"}},
      {"peft_tensor_unknown_module", [&](const std::string& d) { return peft_weights(d, [&](json& h) {
         rename_first(h, "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight"); }); },
       {"adapter_model.safetensors", "rotary"}},
      {"peft_tensor_name_100k", [&](const std::string& d) { return peft_weights(d, [&](json& h) {
         rename_first(h, "base_model.model.model.layers.0." + std::string(100000, 'x') + ".lora_A.weight"); }); },
       {"adapter_model.safetensors"}},
      {"peft_tensor_wrong_shape", [&](const std::string& d) { return peft_weights(d, [&](json& h) {
         for (auto& [k, v] : h.items())
           if (k.find("lora_A") != std::string::npos) {
             const auto s = v["shape"];
             v["shape"] = {s[1], s[0]};
             return;
           } }); }, {"lora_A.weight", "shape"}},
      {"peft_tensor_int_dtype", [&](const std::string& d) { return peft_weights(d, [&](json& h) {
         for (auto& [k, v] : h.items())
           if (k.find("lora_A") != std::string::npos) { v["dtype"] = "I32"; return; } }); }, {"adapter_model.safetensors", "dtype"}},
      {"lora_h5_truncated", [&](const std::string& d) { return keras_file(d, [](const std::string& p) { truncate_to(p, read_bytes(p).size() / 2); }); },
       {"adapter.lora.h5"}},
      {"lora_h5_not_hdf5", [&](const std::string& d) { return keras_file(d, [](const std::string& p) { write_bytes(p, "{}"); }); }, {"adapter.lora.h5"}},
  });
}

// ---- Layout maps: --layout FILE and --layout-rule --------------------------------------------

TEST(Hostile, Layouts) {
  const Bases& b = bases();
  auto layout = [&](const std::string& dir, const std::string& text) {
    write_bytes(dir + "/layout.json", text);
    return "info " + q(b.keras) + " --mesh 1x2 --mesh-axes batch,model --layout " + q(dir + "/layout.json");
  };
  auto rule = [&](const std::string& text) {
    return "info " + q(b.keras) + " --mesh 1x2 --mesh-axes batch,model --layout-rule " + q(text);
  };
  run_table({
      {"layout_deep_nesting", [&](const std::string& d) { return layout(d, nested("{\"a\": ", "[null]", "}", 200000)); }, {"layout.json", "nested"}},
      {"layout_not_json", [&](const std::string& d) { return layout(d, "{\"a\": [null"); }, {"layout.json", "JSON"}},
      {"layout_broken_regex", [&](const std::string& d) { return layout(d, R"({"(query": [null]})"); }, {"layout.json", "(query"}},
      {"layout_lookahead", [&](const std::string& d) { return layout(d, R"({"(?=x).*": [null]})"); }, {"layout.json", "not a valid regex"}},
      {"layout_value_object", [&](const std::string& d) { return layout(d, R"({"a.*": {"x": 1}})"); }, {"layout.json", "'a.*'"}},
      {"layout_entry_number", [&](const std::string& d) { return layout(d, R"({"a.*": [7]})"); }, {"layout.json", "'a.*'"}},
      {"layout_bad_utf8", [&](const std::string& d) { return layout(d, "{\"\xc3\x28\": [null]}"); }, {"layout.json", "JSON"}},
      {"layout_regex_bomb", [&](const std::string& d) { return layout(d, R"({"(.*.*.*.*.*.*.*.*.*.*.*.*.*.*.*.*)*Z": [null]})"); }, {}, 0},
      {"layout_rule_bomb", [&](const std::string&) { return rule("(x+x+)+y=model"); }, {}, 0},
      {"layout_rule_deep_parens", [&](const std::string&) { return rule(nested("(", "q", ")", 1500) + "=model"); }, {}, 0},
      {"layout_rule_too_long", [&](const std::string&) { return rule(std::string(5000, 'a') + "=model"); }, {"layout rule", "4096"}},
      {"layout_rule_repeat_bomb", [&](const std::string&) { return rule("((a{1000}){1000}){1000}=model"); }, {"layout rule", "not a valid regex"}},
      {"layout_rule_wrong_rank", [&](const std::string&) { return rule("token_embedding/embeddings=model"); },
       {"token_embedding/embeddings", "entries"}},
  });
}

// ---- Data: TFRecord, JSONL, text, npy ---------------------------------------------------------

TEST(Hostile, Data) {
  const Bases& b = bases();
  auto finetune = [&](const std::string& dir, const std::string& data) {
    return "finetune " + q(b.keras) + " --data " + q(data) + " --steps 1 --batch-size 2 --seq-len 16 --no-progress --out " +
           q(dir + "/out");
  };
  auto data_file = [&](const std::string& dir, const std::string& kind, const std::string& name, const std::string& bytes) {
    write_bytes(dir + "/" + name, bytes);
    return finetune(dir, kind + ":" + dir + "/" + name);
  };
  auto logits = [&](const std::string& dir, const std::string& bytes) {
    write_bytes(dir + "/ids.npy", bytes);
    return "logits " + q(b.keras) + " --token-ids " + q(dir + "/ids.npy") + " --out " + q(dir + "/logits.npy");
  };
  auto npy = [](const std::string& descr, const std::string& shape, const std::string& data, bool fortran = false) {
    std::string header = "{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") + ", 'shape': " + shape + ", }";
    header.append(64 - (10 + header.size() + 1) % 64, ' ');
    header += '\n';
    return std::string("\x93NUMPY\x01\x00", 8) + char(header.size() & 0xff) + char(header.size() >> 8) + header + data;
  };
  const std::string example = [] {  // tf.train.Example {features {feature {key: "text" value {bytes_list {value: "hi"}}}}}
    const std::string bytes_list = std::string("\x0a\x02", 2) + "hi";
    const std::string feature = std::string("\x0a") + char(bytes_list.size()) + bytes_list;
    const std::string entry = std::string("\x0a\x04", 2) + "text" + "\x12" + char(feature.size()) + feature;
    const std::string features = std::string("\x0a") + char(entry.size()) + entry;
    return std::string("\x0a") + char(features.size()) + features;
  }();
  run_table({
      {"tfrecord_truncated", [&](const std::string& d) { return data_file(d, "tfrecord", "d.tfrecord", tfrecord(example).substr(0, 10)); },
       {"d.tfrecord"}},
      {"tfrecord_bad_crc", [&](const std::string& d) { std::string r = tfrecord(example); r[14] ^= 1;
         return data_file(d, "tfrecord", "d.tfrecord", r); }, {"d.tfrecord", "CRC"}},
      {"tfrecord_length_2pow60", [&](const std::string& d) {
         const std::string len = le64(1ull << 60);
         const uint32_t c = meshtune::masked_crc32c(len.data(), 8);
         return data_file(d, "tfrecord", "d.tfrecord", len + std::string(reinterpret_cast<const char*>(&c), 4) + "xx"); },
       {"d.tfrecord"}},
      {"tfrecord_example_garbage", [&](const std::string& d) { return data_file(d, "tfrecord", "d.tfrecord", tfrecord(std::string(64, '\xff'))); },
       {"d.tfrecord"}},
      {"tfrecord_example_no_text", [&](const std::string& d) { return data_file(d, "tfrecord", "d.tfrecord", tfrecord(std::string("\x0a\x00", 2))); },
       {"d.tfrecord", "text"}},
      {"jsonl_not_json", [&](const std::string& d) { return data_file(d, "jsonl", "d.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"}\n{oops\n"); },
       {"d.jsonl", "line 3"}},
      {"jsonl_missing_field", [&](const std::string& d) { return data_file(d, "jsonl", "d.jsonl", "{\"text\": \"a\"}\n{\"body\": \"b\"}\n"); },
       {"d.jsonl", "line 2", "text"}},
      {"jsonl_field_number", [&](const std::string& d) { return data_file(d, "jsonl", "d.jsonl", "{\"text\": 5}\n"); }, {"d.jsonl", "line 1"}},
      {"jsonl_deep_nesting", [&](const std::string& d) { return data_file(d, "jsonl", "d.jsonl", "{\"text\": " + nested("[", "", "]", 200000) + "}\n"); },
       {"d.jsonl", "line 1", "nested"}},
      {"jsonl_bad_utf8", [&](const std::string& d) { return data_file(d, "jsonl", "d.jsonl", "{\"text\": \"\xff\xfe\"}\n"); }, {"d.jsonl", "line 1"}},
      {"jsonl_nul_byte", [&](const std::string& d) { return data_file(d, "jsonl", "d.jsonl", std::string("{\"text\": \"a\0\"}\n", 15)); },
       {"d.jsonl", "line 1"}},
      {"text_empty", [&](const std::string& d) { return data_file(d, "text", "d.txt", "\n\n  \n"); }, {"d.txt", "no examples"}},
      {"text_4mb_line", [&](const std::string& d) {
         std::string line;
         while (line.size() < (4u << 20)) line += "a great movie with a plot ";
         return data_file(d, "text", "d.txt", line + "\nshort review\n"); }, {}, 0},
      {"npy_bad_magic", [&](const std::string& d) { return logits(d, "NOTNUMPY"); }, {"ids.npy", "magic"}},
      {"npy_shape_overflow", [&](const std::string& d) { return logits(d, npy("<i4", "(4294967296, 4294967296)", "")); }, {"ids.npy"}},
      {"npy_truncated_data", [&](const std::string& d) { return logits(d, npy("<i4", "(1, 8)", std::string(12, '\0'))); }, {"ids.npy", "shorter"}},
      {"npy_fortran", [&](const std::string& d) { return logits(d, npy("<i4", "(1, 2)", std::string(8, '\0'), true)); }, {"ids.npy", "Fortran"}},
      {"npy_float64", [&](const std::string& d) { return logits(d, npy("<f8", "(1, 2)", std::string(16, '\0'))); }, {"ids.npy", "dtype"}},
      {"npy_header_garbage", [&](const std::string& d) { return logits(d, npy("<i4", "((((((", "")); }, {"ids.npy"}},
      {"npy_token_outside_vocabulary", [&](const std::string& d) {
         const int32_t ids[2] = {2, 99999};
         return logits(d, npy("<i4", "(1, 2)", std::string(reinterpret_cast<const char*>(ids), 8))); }, {"99999"}},
  });
}

// ---- Training checkpoints, sharded manifests and placements; run directories ------------------

TEST(Hostile, Checkpoints) {
  const Bases& b = bases();
  auto export_of = [&](const std::string& dir, const std::string& checkpoint) {
    return "export " + q(b.keras) + " --checkpoint " + q(checkpoint) + " --to keras " + q(dir + "/exported");
  };
  auto single = [&](const std::string& dir, const std::function<void(const std::string&)>& damage) {
    const std::string run = copy_of(b.run, dir, "run");
    damage(run + "/checkpoint.safetensors");
    return export_of(dir, run + "/checkpoint.safetensors");
  };
  auto sharded = [&](const std::string& dir, const std::function<void(const std::string& run)>& damage) {
    const std::string run = copy_of(b.sharded, dir, "run");
    damage(run);
    return export_of(dir, run + "/checkpoint.safetensors");
  };
  auto manifest = [&](const std::string& dir, const std::function<void(json&)>& edit) {
    return sharded(dir, [&](const std::string& run) {
      json m = read_json(run + "/checkpoint.safetensors");
      edit(m);
      write_json(run + "/checkpoint.safetensors", m);
    });
  };
  auto rank_file = [](const std::string& run, int rank) {
    return run + "/" + read_json(run + "/checkpoint.safetensors")["files"][size_t(rank)].get<std::string>();
  };
  // Edits the placement of one LoRA variable in rank 1's file.
  auto placement = [&](const std::string& dir, const std::function<void(json&)>& edit) {
    return sharded(dir, [&](const std::string& run) {
      edit_st_metadata(rank_file(run, 1), [&](std::map<std::string, std::string>& meta) {
        json p = json::parse(meta.at("placement"));
        for (auto& [path, block] : p.items())
          if (path.find("query") != std::string::npos && path.find("lora_kernel_a") != std::string::npos) {
            edit(block);
            break;
          }
        meta["placement"] = p.dump();
      });
    });
  };
  auto metadata = [&](const std::string& dir, const std::string& key, const std::string& value) {
    return single(dir, [&](const std::string& ck) {
      edit_st_metadata(ck, [&](std::map<std::string, std::string>& meta) { meta[key] = value; });
    });
  };
  run_table({
      {"ckpt_8_bytes", [&](const std::string& d) { return single(d, [](const std::string& p) { write_bytes(p, le64(1ull << 29)); }); },
       {"checkpoint.safetensors"}},
      {"ckpt_header_length_huge", [&](const std::string& d) { return single(d, [](const std::string& p) {
         std::string s = read_bytes(p); write_bytes(p, le64(1ull << 62) + s.substr(8)); }); }, {"checkpoint.safetensors", "header length"}},
      {"ckpt_not_meshtune", [&](const std::string& d) { return single(d, [](const std::string& p) {
         edit_st_metadata(p, [](std::map<std::string, std::string>& m) { m["format"] = "pt"; }); }); }, {"checkpoint.safetensors", "not a meshtune checkpoint"}},
      {"ckpt_step_not_number", [&](const std::string& d) { return metadata(d, "step", "abc"); }, {"checkpoint.safetensors", "step"}},
      {"ckpt_lora_rank_huge", [&](const std::string& d) { return metadata(d, "lora_rank", "99999999999"); }, {"checkpoint.safetensors", "lora_rank"}},
      {"ckpt_lora_alpha_nan", [&](const std::string& d) { return metadata(d, "lora_alpha", "nan"); }, {"checkpoint.safetensors", "lora_alpha"}},
      {"ckpt_mode_unknown", [&](const std::string& d) { return metadata(d, "mode", "magic"); }, {"checkpoint.safetensors", "mode"}},
      {"ckpt_metadata_not_string", [&](const std::string& d) { return single(d, [](const std::string& p) {
         edit_st_header(p, [](json& h) { h["__metadata__"]["step"] = 3; }); }); }, {"checkpoint.safetensors", "step"}},
      {"manifest_traversal", [&](const std::string& d) { return manifest(d, [](json& m) { m["files"][0] = "../../../../etc/passwd"; }); },
       {"checkpoint.safetensors", "files[0]", "not a plain file name"}},
      {"manifest_other_run", [&](const std::string& d) { return manifest(d, [](json& m) { m["files"][1] = "../other_run/x.rank1"; }); },
       {"checkpoint.safetensors", "files[1]", "not a plain file name"}},
      {"manifest_absolute", [&](const std::string& d) { return manifest(d, [](json& m) { m["files"][0] = "/etc/passwd"; }); },
       {"checkpoint.safetensors", "not a plain file name"}},
      {"manifest_file_count", [&](const std::string& d) { return manifest(d, [](json& m) { m["files"].erase(1); }); },
       {"checkpoint.safetensors", "files"}},
      {"manifest_files_not_strings", [&](const std::string& d) { return manifest(d, [](json& m) { m["files"] = {1, 2}; }); },
       {"checkpoint.safetensors", "files[0]"}},
      {"manifest_mesh_huge", [&](const std::string& d) { return manifest(d, [](json& m) { m["mesh"] = {1ll << 40, 2}; }); },
       {"checkpoint.safetensors", "mesh"}},
      {"manifest_deep_nesting", [&](const std::string& d) { return sharded(d, [](const std::string& run) {
         write_bytes(run + "/checkpoint.safetensors", "{\"format\": " + nested("[", "", "]", 100000) + "}"); }); },
       {"checkpoint.safetensors", "nested"}},
      {"manifest_missing_rank_file", [&](const std::string& d) { return sharded(d, [&](const std::string& run) { fs::remove(rank_file(run, 1)); }); },
       {".rank1", "missing"}},
      {"placement_offset_outside", [&](const std::string& d) { return placement(d, [](json& p) { p["offset"] = {0, 0, 1 << 30}; }); },
       {".rank1", "placement", "outside"}},
      {"placement_negative", [&](const std::string& d) { return placement(d, [](json& p) { p["offset"] = {0, -8, 0}; }); },
       {".rank1", "placement"}},
      {"placement_short_array", [&](const std::string& d) { return placement(d, [](json& p) { p["full"] = {4}; }); }, {".rank1", "full"}},
      {"placement_missing_key", [&](const std::string& d) { return placement(d, [](json& p) { p.erase("local"); }); }, {".rank1", "local"}},
      {"placement_full_huge", [&](const std::string& d) { return placement(d, [](json& p) { p["full"] = {1 << 30, 1 << 30, 1 << 30}; }); },
       {".rank1", "placement"}},
      {"placement_overlap", [&](const std::string& d) { return placement(d, [](json& p) {
         // this block now starts where the other rank's starts, with a different extent
         for (size_t i = 0; i < 3; ++i)
           if (p["local"][i] != p["full"][i]) { p["offset"][i] = 0; p["local"][i] = p["local"][i].get<int>() / 2 * 2; }
         json local = p["local"];
         for (size_t i = 0; i < 3; ++i) if (local[i] == p["full"][i] && local[i].get<int>() > 1) { p["local"][i] = local[i].get<int>() / 2; break; } }); },
       {".rank1"}},
      {"placement_not_json", [&](const std::string& d) { return sharded(d, [&](const std::string& run) {
         edit_st_metadata(rank_file(run, 1), [](std::map<std::string, std::string>& m) { m["placement"] = "{oops"; }); }); }, {".rank1", "placement", "JSON"}},
      {"finetune_into_existing_run", [&](const std::string& d) {
         const std::string run = copy_of(b.run, d, "run");
         return "finetune " + q(b.keras) + " --data sample --take 4 --steps 1 --batch-size 2 --seq-len 16 --no-progress --out " + q(run); },
       {"already holds a run", "--resume", "--overwrite"}},
      {"disk_full_writing_h5", [&](const std::string& d) { return "init " + q(d + "/m"); },
       {"model.weights.h5", "(HDF5: write failed: File too large)"}, 1, "ulimit -f 100; trap '' XFSZ; "},
      {"disk_full_writing_safetensors", [&](const std::string& d) { return "init --format hf " + q(d + "/m"); },
       {"model.safetensors", "File too large"}, 1, "ulimit -f 100; trap '' XFSZ; "},
      {"disk_full_writing_adapter", [&](const std::string& d) {
         return "finetune " + q(b.keras) + " --data sample --take 4 --steps 1 --batch-size 2 --seq-len 16 --no-progress --out " +
                q(d + "/run"); }, {"File too large"}, 1, "ulimit -f 20; trap '' XFSZ; "},
      {"resume_without_checkpoint", [&](const std::string& d) {
         return "finetune " + q(b.keras) + " --data sample --take 4 --steps 1 --batch-size 2 --seq-len 16 --no-progress --resume --out " +
                q(d + "/new"); }, {"--resume", "checkpoint"}},
  });
}

// Placements that pass every per-block check but do not tile the variable: two blocks that overlap
// (one would overwrite the other's values) and two that leave a gap (zeros would pass for weights).
TEST(Hostile, PlacementsMustTileTheVariable) {
  const std::string dir = make_temp_dir("hostile-tiling");
  // Rank file `name` holds rows [row, row + 2) of a [6, 3] variable.
  auto rank_file = [&](const std::string& name, int row) {
    meshtune::HostTensor t = meshtune::HostTensor::allocate(meshtune::DType::F32, {6});
    for (int i = 0; i < 6; ++i) t.mutable_as<float>()[i] = float(i);
    const json placement = {{"v", {{"full", {1, 6, 3}}, {"local", {1, 2, 3}}, {"offset", {0, row, 0}}}}};
    meshtune::write_safetensors(dir + "/" + name, {{"param/v", t}},
                                {{"format", "meshtune-checkpoint-1"}, {"mode", "full"}, {"step", "1"}, {"lora_rank", "0"},
                                 {"lora_alpha", "0"}, {"placement", placement.dump()}});
  };
  const json manifest = {{"format", "meshtune-sharded-checkpoint-1"}, {"step", 1}, {"mesh", {1, 3}},
                         {"axes", {"batch", "model"}}, {"files", {"r0", "r1", "r2"}}};
  write_json(dir + "/checkpoint.safetensors", manifest);
  auto error_of = [&] {
    try {
      meshtune::read_trained_parameters(dir + "/checkpoint.safetensors");
    } catch (const meshtune::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  rank_file("r0", 0);
  rank_file("r1", 2);
  rank_file("r2", 4);
  EXPECT_EQ(error_of(), "no error");  // rows 0–1, 2–3, 4–5: a tiling
  rank_file("r2", 3);                 // rows 3–4 overlap rows 2–3
  EXPECT_NE(error_of().find("overlaps"), std::string::npos) << error_of();
  rank_file("r2", 2);                 // a repeat of r1's block (replicated): rows 4–5 never written
  EXPECT_NE(error_of().find("cover 12 of 18"), std::string::npos) << error_of();
  fs::remove_all(dir);
}

// --overwrite replaces a run: the old checkpoint and adapter files are gone, the new run's are there.
TEST(Hostile, OverwriteReplacesTheWholeRun) {
  const Bases& b = bases();
  const std::string dir = make_temp_dir("hostile-overwrite");
  const std::string run = copy_of(b.run, dir, "run");
  write_bytes(run + "/notes.txt", "mine");
  const Outcome full = run_bounded("finetune " + q(b.keras) +
                                   " --data sample --take 4 --steps 2 --batch-size 2 --seq-len 16 --no-progress --full --overwrite --out " + q(run));
  ASSERT_EQ(full.exit_code, 0) << full.err;
  EXPECT_FALSE(fs::exists(run + "/adapter.lora.h5"));
  EXPECT_FALSE(fs::exists(run + "/adapter"));
  EXPECT_TRUE(fs::exists(run + "/model/config.json"));
  EXPECT_EQ(meshtune::read_safetensors_metadata(run + "/checkpoint.safetensors").at("mode"), "full");
  EXPECT_EQ(read_bytes(run + "/notes.txt"), "mine");  // not a run output: left alone
  for (const auto& entry : fs::directory_iterator(run))
    EXPECT_EQ(entry.path().filename().string().rfind(".meshtune-overwritten", 0), std::string::npos);
  fs::remove_all(dir);
}

}  // namespace
