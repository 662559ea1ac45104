// bench_train: LoRA fine-tuning speed of one Trainer::train_step — ms/step, tokens/s, peak RSS and
// achieved GFLOP/s — on a random fp32 Gemma model, the counterpart of bench/torch_lora_step.py.
// Prints one JSON line on stdout; progress on stderr.
//
//   bench_train [--shape small|2b|7b] [--device cpu|cuda] [--layers N] [--threads 2] [--steps 5] [--warmup 1]
//               [--batch 2] [--seq-len 128] [--rank 4] [--lr 1e-4] [--breakdown] [--dump FILE] [--gpu-profile]
//
// small = the test fixtures' shape (preset_config("tiny", 1000)); 2b = Gemma 2B (18 layers unless
// --layers). LoRA rank 4 on query and value (Keras style, alpha = rank), B set to small random
// values so every gradient is non-zero; a random [batch, seq-len] token batch with all sample
// weights 1; AdamW (lr 1e-4, weight decay 0.01, eps 1e-7). --breakdown adds per-phase timings;
// --dump writes the weights, batch, first-step gradients and losses (small shapes) so that
// torch_lora_step.py --check can verify it computes the same thing. --gpu-profile (--device cuda)
// runs one more step, untimed, under CUPTI and adds where the GPU's time went (gpu_profile.h).
// See bench/README.md.
#include <CLI/CLI.hpp>
#include <cblas.h>
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/cpu/blas_kernels.h"
#include "backend//cpu_backend.h"
#include "backend/cuda_devices.h"
#include "core/error.h"
#include "core/random.h"
#include "io/safetensors.h"
#include "backend/cpu/isa/features.h"
#include "backend/cpu/int8.h"
#include "model/backward.h"
#include "model/gemma.h"
#include "model/init.h"
#include "model/lora.h"
#include "model/variables.h"
#include "gpu_profile.h"
#include "machine_limits.h"
#include "run_stats.h"
#include "train/trainer.h"

using namespace meshtune;
using namespace meshtune::bench;

namespace {

struct Options {
  std::string shape = "small";
  std::string weights = "f32";  // the frozen base: f32, bf16, or int8 (quantized from f32, Keras' formula)
  std::string policy = "float32";
  std::string device = "cpu";  // cpu, or cuda: the step on GPU 0 (the weights uploaded once)  // Keras' dtype policy: float32 or mixed_bfloat16 (bf16 matmul inputs)
  int layers = 0;  // 0 = the shape's default (small 2, 2b 18)
  int threads = 2;
  int steps = 5;
  int warmup = 1;
  int batch = 2;
  int seq_len = 128;
  int rank = 4;
  double lr = 1e-4;
  bool breakdown = false;
  bool gpu_profile = false;
  std::string dump;
};

Options parse_args(int argc, char** argv) {
  Options o;
  CLI::App app("bench_train: LoRA training steps of a random Gemma model; one JSON line on stdout");
  app.add_option("--shape", o.shape, "small, 2b or 7b (Gemma 7B: the tutorial's model)")
      ->check(CLI::IsMember({"small", "2b", "7b"}));
  app.add_option("--device", o.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--weights", o.weights, "Frozen base weights: f32, bf16 or int8")
      ->check(CLI::IsMember({"f32", "bf16", "int8"}));
  app.add_option("--dtype-policy", o.policy, "float32, or mixed_bfloat16: bf16 matmul inputs, fp32 sums (an f32 base is stored as bf16)")
      ->check(CLI::IsMember({"float32", "mixed_bfloat16"}));
  app.add_option("--layers", o.layers, "Decoder blocks (0: the shape's default)")->check(CLI::NonNegativeNumber);
  app.add_option("--threads", o.threads, "OpenMP threads")->check(CLI::PositiveNumber);
  app.add_option("--steps", o.steps, "Timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "Untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--batch", o.batch, "Batch size")->check(CLI::PositiveNumber);
  app.add_option("--seq-len", o.seq_len, "Sequence length")->check(CLI::PositiveNumber);
  app.add_option("--rank", o.rank, "LoRA rank")->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "AdamW learning rate");
  app.add_flag("--breakdown", o.breakdown, "Add per-phase timings");
  app.add_flag("--gpu-profile", o.gpu_profile, "One more step under CUPTI: where the GPU's time went (--device cuda)");
  app.add_option("--dump", o.dump, "Write weights, batch, first-step gradients and losses (small shapes)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  return o;
}

GemmaConfig bench_config(const Options& o) {
  GemmaConfig c;
  if (o.shape == "small") {
    c = preset_config("tiny", 1000);  // vocab 1000, D 64, 4 heads / 1 KV head of 16, FFN 128, family 1
    if (o.layers > 0) c.num_layers = o.layers;
  } else {
    c = preset_config(o.shape == "7b" ? "gemma_7b_en" : "gemma_2b_en");
    if (o.layers > 0) c.num_layers = o.layers;
  }
  c.validate("bench_train config");
  return c;
}

// FLOPs of one LoRA training step (2 per multiply-add), counted from the model's shapes — the same
// formula as torch_lora_step.py, so both report GFLOP/s of the same work (see bench/README.md):
//   forward:  2·M·(L·P + V·D)  every layer matrix and the tied LM head on all M = B·T tokens
//             + L·4·B·N·H·T(T+1)/2  causal attention: QKᵀ and P·V over the allowed pairs only
//             + LoRA path 2·M·r·(D·(N+K) + H·(N+K)) per layer (x·A, then ·B)
//   backward: activations' gradients = the forward's matmul FLOPs again (dx = dy·W for every layer
//             matrix and the LM head) + 2× the forward attention (dQ, dK, dV, dP)
//             + LoRA: dx through the path (= its forward) + dA and dB (= its forward again).
// P = D·N·H + 2·D·K·H + N·H·D + 3·D·F (q, k, v, o, gate, up, down). Norms, RoPE, softmax, GeGLU,
// the loss and AdamW are left out (O(M·D), O(M·V) — small next to the matmuls).
struct FlopCount {
  double forward = 0, backward = 0;
  double total() const { return forward + backward; }
};
FlopCount count_flops(const GemmaConfig& c, int64_t B, int64_t T, int r) {
  const double M = double(B * T), D = c.hidden_dim, N = c.num_query_heads, K = c.num_key_value_heads,
               H = c.head_dim, F = c.ffw_dim, V = c.vocab_size, L = c.num_layers;
  const double P = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F;
  const double matmul = 2 * M * (L * P + V * D);
  const double attention = L * 4 * double(B) * N * H * (double(T) * double(T + 1) / 2);
  const double lora_path = L * 2 * M * r * (D * (N + K) + H * (N + K));
  FlopCount f;
  f.forward = matmul + attention + lora_path;
  f.backward = matmul + 2 * attention + 2 * lora_path;
  return f;
}

// Per-phase timings of one step, by calling the pieces Trainer::train_step is made of.
nlohmann::ordered_json breakdown(const Context& ctx, const GemmaModel& base, const LoraWeights& lora,
                                 const Batch& batch, int reps) {
  const GemmaConfig& c = base.config;
  const int64_t B = batch.batch_size, T = batch.seq_len, M = B * T, D = c.hidden_dim;
  TokenBatch tb{B, T, batch.token_ids.data(), batch.padding_mask.data(), batch.targets.data(),
                batch.sample_weight.data()};
  LoraTensors tensors(ctx.backend, lora);
  GemmaModel model = base;  // the adapters as low-rank terms, as Trainer::train_step runs them
  attach_lora(model, lora, tensors, c);
  ModelGradients grads;  // no weight gradients: only the adapters' grad_a / grad_b
  grads.layers.assign(size_t(c.num_layers), LayerGradients{});
  std::vector<double> forward_s, fb_s, lm_head_s;
  TrainingWorkspace ws;  // reused, as Trainer::train_step reuses its own
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 is an untimed warm-up
    if (rep == 1) forward_s.clear(), fb_s.clear(), lm_head_s.clear();
    auto t0 = Clock::now();
    forward_backward(ctx, model, tb, 1.0 / double(M), nullptr);  // forward + loss, no backward
    forward_s.push_back(seconds_since(t0));
    t0 = Clock::now();
    forward_backward(ctx, model, tb, 1.0 / double(M), &grads, &ws);
    fb_s.push_back(seconds_since(t0));
    // The LM head alone: one [M, D]·[D, V] product (forward_backward forms it in row chunks).
    std::vector<float> h(size_t(M * D), 0.01f), logits(size_t(M * c.vocab_size));
    t0 = Clock::now();
    lm_head(ctx, model, h, M, logits);
    lm_head_s.push_back(seconds_since(t0));
  }
  nlohmann::ordered_json j;
  j["forward_and_loss_ms"] = 1e3 * median(forward_s);
  j["forward_backward_ms"] = 1e3 * median(fb_s);
  j["backward_ms"] = 1e3 * (median(fb_s) - median(forward_s));
  j["lm_head_forward_ms"] = 1e3 * median(lm_head_s);
  j["saved_activations_mib"] = double(ws.blocks.bytes()) / double(1 << 20);  // what backward keeps of the blocks
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  if (meshtune::time_sgemm_if_asked()) return 0;  // a child timing OpenBLAS' kernel families
  meshtune::choose_blas_kernels(argv);  // the family measured fastest on this machine
  const Options o = parse_args(argc, argv);
  try {
    std::unique_ptr<Backend> gpu;  // first: no GPU is one line at once, not after making the weights
    if (o.device == "cuda") {
      check(!o.breakdown && o.dump.empty(), "--breakdown and --dump are for --device cpu");
      gpu = make_cuda_backend(0);
    } else {
      check(!o.gpu_profile, "--gpu-profile is for --device cuda");
    }
    // Same thread count for our OpenMP loops and OpenBLAS (one libgomp pool).
    omp_set_num_threads(o.threads);
    openblas_set_num_threads(o.threads);
    const GemmaConfig c = bench_config(o);
    const int64_t B = o.batch, T = o.seq_len, M = B * T, V = c.vocab_size;

    auto t0 = Clock::now();
    // The 7B shape's int8 base is quantized from bf16 weights: fp32 ones (34 GB) do not fit here.
    const bool bf16_base = o.weights == "bf16" || (o.weights == "int8" && o.shape == "7b");
    GemmaModel model = random_model(c, 1234, bf16_base ? DType::BF16 : DType::F32);
    if (o.weights == "int8")
      for (const VariableSpec& spec : gemma_variables(c))
        if (WeightMatrix* w = model.matrix(spec.slot, spec.layer)) *w = quantize_matrix_int8(*w);
    if (o.policy == "mixed_bfloat16") {  // the frozen base in bf16, as `finetune --dtype-policy mixed_bfloat16` stores it
      for (const VariableSpec& spec : gemma_variables(c))
        if (WeightMatrix* w = model.matrix(spec.slot, spec.layer)) *w = to_bf16_matrix(*w);
    }
    const double init_s = seconds_since(t0);
    std::cerr << "bench_train: " << o.shape << " L" << c.num_layers << ": random weights in " << init_s << " s\n";

    LoraWeights lora = enable_lora(c, o.rank, {Slot::Query, Slot::Value}, 7);
    SplitMix64 rng{99};
    for (LoraAdapter& ad : lora.adapters)  // B = 0 would leave ∂L/∂A = 0; make every gradient real
      for (float& b : ad.b) b = 0.01f * rng.normal();

    Batch batch;
    batch.batch_size = B;
    batch.seq_len = T;
    batch.token_ids.resize(size_t(M));
    batch.targets.resize(size_t(M));
    for (int64_t m = 0; m < M; ++m) {
      batch.token_ids[size_t(m)] = int32_t(rng.next() % uint64_t(V));
      batch.targets[size_t(m)] = int32_t(rng.next() % uint64_t(V));
    }
    batch.padding_mask.assign(size_t(M), 1);
    batch.sample_weight.assign(size_t(M), 1.f);

    std::vector<std::pair<std::string, HostTensor>> dump;
    auto dump_floats = [&](const std::string& name, const float* p, Shape shape) {
      HostTensor t = HostTensor::allocate(DType::F32, shape);
      std::copy(p, p + num_elements(shape), t.mutable_as<float>());
      dump.emplace_back(name, t);
    };
    if (!o.dump.empty()) {  // the inputs, before the Trainer takes the model
      check(V * c.hidden_dim <= (int64_t(1) << 26), "--dump is meant for small shapes");
      check(o.weights == "f32", "--dump writes fp32 weights: use --weights f32");
      const int64_t D = c.hidden_dim;
      auto mat = [&](const std::string& name, const WeightMatrix& w) { dump_floats(name, w.f32(), {w.rows, w.cols}); };
      mat("embed", model.embeddings);
      dump_floats("final_norm", model.final_norm.data(), {D});
      for (int i = 0; i < c.num_layers; ++i) {
        const DecoderLayerWeights& l = model.layers[size_t(i)];
        const std::string p = std::to_string(i).insert(0, 1, 'l') + ".";
        dump_floats(p + "pre_attention_norm", l.pre_attention_norm.data(), {D});
        dump_floats(p + "pre_ffw_norm", l.pre_ffw_norm.data(), {D});
        mat(p + "q", l.query);
        mat(p + "k", l.key);
        mat(p + "v", l.value);
        mat(p + "o", l.attention_output);
        mat(p + "gate", l.ffw_gating);
        mat(p + "up", l.ffw_gating_2);
        mat(p + "down", l.ffw_linear);
      }
      for (const LoraAdapter& ad : lora.adapters) {
        const std::string p = std::to_string(ad.layer).insert(0, 1, 'l') + (ad.slot == Slot::Query ? ".lora_q_" : ".lora_v_");
        dump_floats(p + "a", ad.a.data(), ad.a_shape);
        dump_floats(p + "b", ad.b.data(), ad.b_shape);
      }
      HostTensor tok = HostTensor::allocate(DType::I32, {B, T}), tgt = HostTensor::allocate(DType::I32, {B, T});
      std::copy(batch.token_ids.begin(), batch.token_ids.end(), tok.mutable_as<int32_t>());
      std::copy(batch.targets.begin(), batch.targets.end(), tgt.mutable_as<int32_t>());
      dump.emplace_back("tokens", tok);
      dump.emplace_back("targets", tgt);
    }

    nlohmann::ordered_json phases;
    CpuBackend cpu;
    Backend& backend = gpu ? *gpu : cpu;
    const Context ctx{backend, o.policy == "mixed_bfloat16" ? MatmulPrecision::BF16 : MatmulPrecision::F32};
    if (o.breakdown) phases = breakdown(ctx, model, lora, batch, std::max(1, o.steps));

    FitOptions fit;
    fit.adamw.learning_rate = o.lr;
    fit.adamw.weight_decay = 0.01;
    fit.adamw.epsilon = 1e-7;
    Trainer trainer(backend, ctx.precision, gpu ? upload_model(model, *gpu) : std::move(model), lora, fit);

    const CpuTimes cpu_start = cpu_times();
    std::vector<double> step_s, losses;
    for (int step = 0; step < o.warmup + o.steps; ++step) {
      t0 = Clock::now();
      const LossSums sums = trainer.train_step(batch, o.lr);
      const double s = seconds_since(t0);
      if (step >= o.warmup) step_s.push_back(s);
      losses.push_back(sums.weighted_ce / double(M));
      if (step == 0 && !o.dump.empty())  // the first step's gradients (still in place after it)
        for (const Parameter& p : trainer.parameters()) dump_floats("grad/" + p.path, p.grad.data, p.shape);
      std::cerr << "bench_train: step " << step << (step < o.warmup ? " (warm-up)" : "") << ": " << s * 1e3
                << " ms, loss " << losses.back() << "\n";
    }
    const CpuTimes cpu_end = cpu_times();
    const double rss = peak_rss_gib();
    nlohmann::ordered_json gpu_profile;
    if (o.gpu_profile) {  // one more step, not among the timed ones
      backend.synchronize();
      GpuProfile profile;
      t0 = Clock::now();
      trainer.train_step(batch, o.lr);
      backend.synchronize();
      const double wall_ms = 1e3 * seconds_since(t0);
      gpu_profile = profile.stop(1);
      gpu_profile["wall_ms"] = wall_ms;
    }

    if (!o.dump.empty()) {
      const std::vector<float> loss_values(losses.begin(), losses.end());
      dump_floats("losses", loss_values.data(), {int64_t(loss_values.size())});
      write_safetensors(o.dump, dump,
                        {{"num_layers", std::to_string(c.num_layers)}, {"vocab_size", std::to_string(V)},
                         {"hidden_dim", std::to_string(c.hidden_dim)}, {"lr", std::to_string(o.lr)},
                         {"rank", std::to_string(o.rank)}});
      std::cerr << "bench_train: wrote " << o.dump << "\n";
    }

    const double step = median(step_s);
    const FlopCount flops = count_flops(c, B, T, o.rank);
    nlohmann::ordered_json j;
    j["impl"] = "meshtune";
    j["shape"] = o.shape;
    j["weights"] = o.weights;
    j["dtype_policy"] = o.policy;
    j["device"] = backend.name();
    j["bf16_dot_products"] = o.policy != "float32" && (gpu || cpu.path().uses_onednn(Product::Bf16Linear));
    j["layers"] = c.num_layers;
    j["threads"] = o.threads;
    j["cpu_features"] = meshtune::cpu_features().summary();
    j["kernel_path"] = meshtune::cpu_path_name(cpu.path().isa);
    j["blas_core"] = openblas_get_corename();
    j["batch"] = B;
    j["seq_len"] = T;
    j["lora_rank"] = o.rank;
    j["params"] = c.num_parameters();
    j["trainable_params"] = trainer.trainable_count();
    j["steps"] = o.steps;
    j["warmup"] = o.warmup;
    j["init_s"] = init_s;
    j["ms_per_step"] = 1e3 * step;
    j["ms_per_step_min"] = 1e3 * *std::min_element(step_s.begin(), step_s.end());
    j["ms_per_step_max"] = 1e3 * *std::max_element(step_s.begin(), step_s.end());
    j["tokens_per_s"] = double(M) / step;
    j["peak_rss_gib"] = rss;
    if (gpu) {
      j["gpu_memory_gib"] = double(gpu_memory_in_use()) / double(1 << 30);
      j["cuda_routes"] = cuda_routes(*gpu);  // measured at each shape's first call
      if (o.gpu_profile) j["gpu_profile"] = gpu_profile;
    }
    j["gflop_per_step"] = flops.total() / 1e9;
    j["gflop_forward"] = flops.forward / 1e9;
    j["gflops"] = flops.total() / step / 1e9;
    if (!gpu) {  // the peak of the arithmetic the products used: bf16 dot products, else fp32 FMA
      const bool bf16 = j["bf16_dot_products"].get<bool>();
      const double peak = bf16 ? bench::bf16_dot_peak_gflops(o.threads) : bench::fma_f32_peak_gflops(o.threads);
      j["peak_gflops"] = peak;
      j["peak_kind"] = bf16 ? "bf16 dot (vdpbf16ps)"
                       : o.weights == "int8" ? "fp32 FMA (the backward's; the int8 forward's peak is higher)"
                                             : "fp32 FMA";
      if (peak > 0) j["fraction_of_peak"] = flops.total() / step / 1e9 / peak;
    }
    j["first_loss"] = losses.front();
    j["last_loss"] = losses.back();
    j["foreign_cpus"] = foreign_cpus(cpu_start, cpu_end);  // > ~0.1: another process competed
    if (o.breakdown) j["breakdown"] = phases;
    std::cout << j.dump() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "bench_train: error: " << e.what() << "\n";
    return 1;
  }
}
