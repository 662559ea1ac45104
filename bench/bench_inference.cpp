// bench_inference: load time, prefill and decode speed and peak memory of a Gemma-2B-shaped model
// (random weights) read from a Hugging Face checkpoint, next to this machine's limits (sgemm rate,
// memory bandwidth) measured in the same run. Prints one JSON line on stdout; progress on stderr.
//
//   bench_inference [--dtype f32|bf16|int8] [--dtype-policy float32|mixed_bfloat16|bfloat16] [--layers 18] [--threads 2] [--prompt 128] [--decode 16]
//                   [--dir /tmp/meshtune-bench] [--repeat 3] [--device cpu|cuda] [--gpu-profile]
//
// The checkpoint is created once per (dtype, layers) under --dir, in a child process so that
// building it never counts towards this process's peak RSS. With --device cuda the random weights
// are made in memory and uploaded (no checkpoint; load_s is that), prefill and decode run on GPU 0,
// and the decode bound comes from the GPU's own copy bandwidth measured in the same run;
// --gpu-profile adds one more run whose decode is recorded by CUPTI (gpu_profile.h: where the GPU's
// time went, per token). See bench/README.md.
#include <CLI/CLI.hpp>
#include <cblas.h>
#include <omp.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "backend/cpu/blas_kernels.h"
#include "backend//cpu_backend.h"
#include "backend/cuda_devices.h"
#include "core/error.h"
#include "gpu_profile.h"
#include "machine_limits.h"
#include "run_stats.h"
#include "model/gemma.h"
#include "generate/generate.h"
#include "backend/cpu/isa/features.h"
#include "model/init.h"
#include "model/variables.h"
#include "backend/cpu/int8.h"
#include "store/load.h"
#include "store/save.h"

namespace fs = std::filesystem;
using namespace meshtune;
using namespace meshtune::bench;

namespace {

struct Options {
  std::string dtype = "f32";
  std::string policy = "float32";  // Keras' dtype policy: bf16 matmul inputs under mixed_bfloat16 / bfloat16
  int layers = 18;
  int threads = 2;
  int prompt = 128;
  int decode = 16;
  std::string dir = "/tmp/meshtune-bench";
  int repeat = 3;
  std::string device = "cpu";
  bool gpu_profile = false;
};

Options parse_args(int argc, char** argv) {
  Options o;
  CLI::App app("bench_inference: load, prefill and decode of a Gemma-2B-shaped model; one JSON line on stdout");
  app.add_option("--dtype", o.dtype, "Weights: f32, bf16, or int8 (the bf16 checkpoint quantized at load)")
      ->check(CLI::IsMember({"f32", "bf16", "int8"}));
  app.add_option("--dtype-policy", o.policy, "float32, mixed_bfloat16 or bfloat16 (bf16 matmul inputs; weights stored bf16)")
      ->check(CLI::IsMember({"float32", "mixed_bfloat16", "bfloat16"}));
  app.add_option("--layers", o.layers, "Decoder blocks")->check(CLI::PositiveNumber);
  app.add_option("--threads", o.threads, "OpenMP threads")->check(CLI::PositiveNumber);
  app.add_option("--prompt", o.prompt, "Prompt tokens (prefill)")->check(CLI::PositiveNumber);
  app.add_option("--decode", o.decode, "Tokens decoded one at a time")->check(CLI::PositiveNumber);
  app.add_option("--dir", o.dir, "Where the random checkpoint is created (once)");
  app.add_option("--repeat", o.repeat, "Repeats (medians are reported)")->check(CLI::PositiveNumber);
  app.add_flag("--gpu-profile", o.gpu_profile, "One more run, its decode under CUPTI: where the GPU's time went (--device cuda)");
  app.add_option("--device", o.device, "cpu, or cuda (GPU 0; random weights made in memory)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  return o;
}

// Gemma 2B: vocab 256000, hidden 2048, 8 query heads sharing 1 KV head of dim 256, FFN 16384.
GemmaConfig gemma_2b_config(int layers) {
  GemmaConfig c = preset_config("gemma_2b_en");
  c.num_layers = layers;
  return c;
}

// Creates the checkpoint in a forked child (before this process starts any OpenMP threads), so
// the ~10 GB of freshly generated weights never show up in our own peak RSS. A marker file
// written last makes an interrupted creation count as absent.
std::string ensure_checkpoint(const Options& o) {
  const std::string stored = o.dtype == "f32" ? "f32" : "bf16";
  const std::string path = (fs::path(o.dir) / ("gemma2b-" + stored + "-L" + std::to_string(o.layers))).string();
  const fs::path marker = fs::path(path) / "bench-complete";
  if (fs::exists(marker)) return path;
  std::cerr << "bench_inference: creating " << path << " (once; random weights, takes a few minutes)\n";
  fs::create_directories(path);
  std::fflush(nullptr);
  const pid_t pid = fork();
  check(pid >= 0, "fork failed");
  if (pid == 0) {
    int code = 0;
    try {
      auto t0 = Clock::now();
      GemmaModel model = random_model(gemma_2b_config(o.layers), 1234, stored == "bf16" ? DType::BF16 : DType::F32);
      std::cerr << "bench_inference: generated weights in " << seconds_since(t0) << " s\n";
      t0 = Clock::now();
      save_hf_checkpoint(model, "", path);
      std::ofstream(marker) << "ok\n";
      std::cerr << "bench_inference: saved in " << seconds_since(t0) << " s\n";
    } catch (const std::exception& e) {
      std::cerr << "bench_inference: creating the checkpoint failed: " << e.what() << "\n";
      code = 1;
    }
    std::fflush(nullptr);
    _exit(code);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "creating ", path, " failed");
  return path;
}

int32_t argmax(const std::vector<float>& v) {
  return int32_t(std::max_element(v.begin(), v.end()) - v.begin());
}

// Bytes of every weight matrix: what one decode step must stream from memory (the embedding is
// read in full as the tied LM head; its row lookup for the input token is negligible).
size_t matrix_bytes(const GemmaModel& m) {
  size_t total = m.embeddings.nbytes();
  for (const auto& l : m.layers)
    for (const WeightMatrix* w : {&l.query, &l.key, &l.value, &l.attention_output, &l.ffw_gating, &l.ffw_gating_2,
                                  &l.ffw_linear})
      total += w->nbytes();
  return total;
}

size_t layer_matrix_params(const GemmaModel& m) {
  size_t total = 0;
  for (const auto& l : m.layers)
    for (const WeightMatrix* w : {&l.query, &l.key, &l.value, &l.attention_output, &l.ffw_gating, &l.ffw_gating_2,
                                  &l.ffw_linear})
      total += size_t(w->rows) * size_t(w->cols);
  return total;
}

// The GPU's memory bandwidth as a device-to-device copy moves it (read + write bytes), GB/s, the
// median of `repeats` copies of 1 GiB.
double device_copy_gbps(Backend& gpu, int repeats) {
  const size_t n = (size_t(1) << 30) / sizeof(float);
  FloatBuffer a, b;
  gpu.resize_zeroed(a, n);
  gpu.resize_zeroed(b, n);
  float sink = 0;
  gpu.copy(a, int64_t(n), b);  // warm-up
  gpu.download(b.span().part(0, 1), {&sink, 1});
  std::vector<double> s;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = Clock::now();
    gpu.copy(a, int64_t(n), b);
    gpu.download(b.span().part(0, 1), {&sink, 1});  // waits for the copy
    s.push_back(seconds_since(t0));
  }
  return 2.0 * double(n * sizeof(float)) / median(s) / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  if (meshtune::time_sgemm_if_asked()) return 0;  // a child timing OpenBLAS' kernel families
  meshtune::choose_blas_kernels(argv);  // the family measured fastest on this machine
  const Options o = parse_args(argc, argv);
  try {
    std::unique_ptr<Backend> gpu;  // first: no GPU is one line at once, not after making the weights
    if (o.device == "cuda") gpu = make_cuda_backend(0);
    check(gpu || !o.gpu_profile, "--gpu-profile is for --device cuda");
    const std::string path = gpu ? std::string() : ensure_checkpoint(o);

    // Same thread count for our OpenMP loops and OpenBLAS (the OpenMP build of OpenBLAS runs on
    // the same libgomp pool, so neither oversubscribes the other).
    omp_set_num_threads(o.threads);
    openblas_set_num_threads(o.threads);

    const CpuTimes cpu_start = cpu_times();
    // --- load: the API calls (safetensors are memory-mapped, so this is mostly header parsing) ---
    auto t0 = Clock::now();
    GemmaModel model;
    if (gpu) {
      model = random_model(gemma_2b_config(o.layers), 1234, o.dtype == "f32" && o.policy == "float32" ? DType::F32 : DType::BF16);
      if (o.dtype == "int8")
        for (const VariableSpec& spec : gemma_variables(model.config))
          if (WeightMatrix* w = model.matrix(spec.slot, spec.layer)) *w = quantize_matrix_int8(*w);
      model = upload_model(model, *gpu);
    } else {
      LoadOptions load;
      load.quantize_int8 = o.dtype == "int8";
      load.bf16_matrices = o.policy != "float32";  // as generate --dtype-policy stores frozen weights
      model = load_model(inspect_model_dir(path), load);
    }
    CpuBackend cpu;
    Backend& backend = gpu ? *gpu : cpu;
    const Context ctx{backend, o.policy != "float32" ? MatmulPrecision::BF16 : MatmulPrecision::F32};
    const double load_s = seconds_since(t0);
    const GemmaConfig& c = model.config;
    const int64_t V = c.vocab_size, D = c.hidden_dim, T = o.prompt;

    std::vector<int32_t> prompt(static_cast<size_t>(T));
    for (int64_t i = 0; i < T; ++i) prompt[size_t(i)] = int32_t(3 + (i * 7919) % (V - 3));
    prompt[0] = 2;  // <bos>

    // Read-bandwidth samples taken between the repeats, over 1 GiB of the model's own embedding
    // matrix (64-byte aligned start): memory bandwidth on a shared VM drifts by tens of percent
    // within minutes, so the bound is computed from samples taken at the same time as decode.
    // (On a GPU the bound is its copy bandwidth, measured after the runs.)
    const size_t table_bytes = size_t(model.embeddings.rows * model.embeddings.cols) * dtype_size(model.embeddings.dtype);
    const size_t sample_bytes = std::min<size_t>(size_t(1) << 30, table_bytes - 64);
    const auto* embedding_bytes = static_cast<const char*>(model.embeddings.data);
    const void* sample_start = embedding_bytes + (64 - reinterpret_cast<uintptr_t>(embedding_bytes) % 64) % 64;
    std::vector<double> read_samples;

    std::vector<float> logits(static_cast<size_t>(V));
    FloatBuffer device_logits;  // a GPU's logits, downloaded for the argmax (as generate does)
    if (gpu) backend.resize(device_logits, size_t(V));
    auto head = [&](ConstFloats hidden) {
      lm_head(ctx, model, hidden, 1, gpu ? Floats(device_logits) : Floats(logits));
      if (gpu) backend.download(device_logits, logits);
    };
    std::vector<double> prefill_s, decode_step_s;
    double first_prefill_s = 0;
    // Run 0 is a warm-up (it faults the mapped weights into this process) and is reported apart.
    // --gpu-profile: one more run, not among the timed ones, its decode under CUPTI.
    nlohmann::ordered_json gpu_profile;
    for (int run = 0; run <= o.repeat + (o.gpu_profile ? 1 : 0); ++run) {
      const bool profiled = run > o.repeat;
      KVCache cache(c, 1, T + o.decode, ctx.backend);
      ForwardWorkspace ws;  // reused by every step, as generate reuses its own
      t0 = Clock::now();
      const FloatBuffer& prefilled = backbone_forward(ctx, model, prompt.data(), 1, T, 0, cache, ws);
      head(prefilled.span().part(size_t((T - 1) * D), size_t(D)));
      const double s = seconds_since(t0);
      if (run == 0) first_prefill_s = s;
      else if (!profiled) prefill_s.push_back(s);
      int32_t token = argmax(logits);
      std::optional<GpuProfile> profile;
      if (profiled) profile.emplace();
      t0 = Clock::now();
      for (int step = 0; step < o.decode; ++step) {
        const auto step_start = Clock::now();
        const FloatBuffer& hidden = backbone_forward(ctx, model, &token, 1, 1, T + step, cache, ws);
        head(hidden);
        token = argmax(logits);
        if (run > 0 && !profiled) decode_step_s.push_back(seconds_since(step_start));
      }
      if (profiled) {
        const double wall_ms = 1e3 * seconds_since(t0) / o.decode;
        gpu_profile = profile->stop(o.decode);  // per token
        gpu_profile["wall_ms"] = wall_ms;
        continue;
      }
      // After the run (whose LM head has mapped every embedding page), one bandwidth sample.
      if (!gpu) read_samples.push_back(bench::read_gbps_once(sample_start, sample_bytes, o.threads));
      std::cerr << "bench_inference: run " << run << (run == 0 ? " (warm-up)" : "") << ": prefill " << s << " s\n";
    }
    // Decode as `generate` runs it (greedy, no stop tokens: the host queues steps ahead and
    // collects each step's tokens later): the time of a run of 1 + decode steps less that of a run
    // of 1 step (the same prompt and prefill), per token; median of repeat pairs.
    std::vector<double> generate_step_s;
    {
      auto timed_generate = [&](int steps) {
        const int length = int(T) + steps;
        std::vector<std::vector<int32_t>> rows = {std::vector<int32_t>(size_t(length), 0)};
        std::vector<std::vector<uint8_t>> mask = {std::vector<uint8_t>(size_t(length), 0)};
        std::copy(prompt.begin(), prompt.end(), rows[0].begin());
        std::fill(mask[0].begin(), mask[0].begin() + T, uint8_t(1));
        meshtune::GenerateOptions options;
        options.max_length = length;
        options.sampler.name = "greedy";
        options.stop_token_ids = {};
        const auto start_time = Clock::now();
        meshtune::generate_ids(ctx, model, rows, mask, options);
        backend.synchronize();
        return seconds_since(start_time);
      };
      timed_generate(1), timed_generate(1 + o.decode);  // warm-up: routes measured, memory allocated
      for (int run = 0; run < std::max(1, o.repeat); ++run) {
        const double one = timed_generate(1), more = timed_generate(1 + o.decode);
        generate_step_s.push_back(std::max(1e-9, (more - one) / o.decode));
      }
    }
    const double rss_gib = peak_rss_gib();  // before the machine-limit buffers below

    const size_t weight_bytes = matrix_bytes(model);
    // Prefill FLOPs: 2 per multiply-add of every layer matrix for each of the T tokens, the LM head
    // for the last position only, plus causal attention: QKᵀ and P·V each 2·N·H per (query, allowed
    // key) pair, Σ_t (t+1) = T(T+1)/2 pairs per head group. Norms, RoPE, softmax, GeGLU are left out.
    const double matmul_flops = 2.0 * double(layer_matrix_params(model)) * double(T) + 2.0 * double(V) * double(D);
    const double attention_flops =
        double(c.num_layers) * 4.0 * c.num_query_heads * c.head_dim * (double(T) * double(T + 1) / 2);
    // Average KV-cache bytes one decode step reads (keys + values, all layers), for comparison.
    const double kv_bytes = 2.0 * c.num_layers * (T + o.decode / 2.0) * c.num_key_value_heads * c.head_dim * 4;
    const int64_t params = int64_t(c.num_parameters());

    // --- machine limits, same thread count (a GPU's: its copy bandwidth) ---
    std::cerr << "bench_inference: measuring machine limits\n";
    const size_t gib = size_t(1) << 30;
    const double sgemm = gpu ? 0 : bench::sgemm_gflops(2048, 2048, 2048, false, 5);
    const double sgemm_prefill_shape = gpu ? 0 : bench::sgemm_gflops(int(T), int(c.ffw_dim), int(D), true, 5);
    const double copy = gpu ? device_copy_gbps(*gpu, 5) : bench::copy_gbps(gib, 5);
    const double read = gpu ? copy : bench::read_gbps(gib, 5, o.threads);
    const double read_1t = gpu ? 0 : bench::read_gbps(gib, 5, 1);
    if (gpu) read_samples.push_back(copy);

    const CpuTimes cpu_end = cpu_times();

    const double prefill_tok_s = double(T) / median(prefill_s);
    const double prefill_gflops = (matmul_flops + attention_flops) / median(prefill_s) / 1e9;
    const double decode_tok_s = 1.0 / median(decode_step_s);
    const double read_during = median(read_samples);
    const double bound_tok_s = read_during * 1e9 / double(weight_bytes);

    nlohmann::ordered_json j;
    j["device"] = backend.name();
    j["dtype"] = o.dtype;
    j["dtype_policy"] = o.policy;
    j["layers"] = c.num_layers;
    j["threads"] = o.threads;
    j["cpu_features"] = meshtune::cpu_features().summary();
    j["kernel_path"] = meshtune::cpu_path_name(cpu.path().isa);
    j["blas_core"] = openblas_get_corename();
    j["prompt_tokens"] = T;
    j["decode_tokens"] = o.decode;
    j["repeat"] = o.repeat;
    j["params"] = params;
    j["load_s"] = load_s;
    j["first_prefill_s"] = first_prefill_s;
    j["prefill_s"] = median(prefill_s);
    j["prefill_tok_s"] = prefill_tok_s;
    j["prefill_gflop"] = (matmul_flops + attention_flops) / 1e9;
    j["prefill_attention_gflop"] = attention_flops / 1e9;
    j["prefill_gflops"] = prefill_gflops;
    j["decode_ms_per_token"] = 1e3 * median(decode_step_s);
    j["decode_tok_s"] = decode_tok_s;
    j["decode_tok_s_mean"] = double(decode_step_s.size()) / [&] { double s = 0; for (double x : decode_step_s) s += x; return s; }();
    j["peak_rss_gib"] = rss_gib;
    if (gpu) {
      j["gpu_memory_gib"] = double(gpu_memory_in_use()) / double(1 << 30);
      j["cuda_routes"] = cuda_routes(*gpu);  // measured at each shape's first call
      if (o.gpu_profile) j["gpu_profile"] = gpu_profile;
    }
    j["weight_bytes_per_token"] = weight_bytes;
    j["kv_bytes_per_token"] = kv_bytes;
    j["decode_effective_gbps"] = double(weight_bytes) * decode_tok_s / 1e9;
    // Through generate_ids (greedy: tokens chosen on the device, the host a few steps ahead).
    j["generate_tok_s"] = 1.0 / median(generate_step_s);
    j["generate_bound_fraction"] = (1.0 / median(generate_step_s)) / bound_tok_s;
    j["bound_tok_s"] = bound_tok_s;  // from read_gbps_during
    j["bound_ratio"] = bound_tok_s / decode_tok_s;  // measured time / ideal time; 1.0 = at the bound
    j["bound_tok_s_anon"] = read * 1e9 / double(weight_bytes);  // from read_gbps (the 1 GiB buffer)
    j["sgemm_gflops"] = sgemm;
    j["sgemm_prefill_shape_gflops"] = sgemm_prefill_shape;
    if (!gpu) j["prefill_vs_sgemm"] = prefill_gflops / sgemm;
    j["copy_gbps"] = copy;
    j["read_gbps"] = read;
    j["read_gbps_1thread"] = read_1t;
    j["read_gbps_during"] = read_during;
    j["read_gbps_during_samples"] = read_samples;
    j["foreign_cpus"] = foreign_cpus(cpu_start, cpu_end);  // > ~0.1: other processes competed; rerun
    std::cout << j.dump() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "bench_inference: error: " << e.what() << "\n";
    return 1;
  }
}
