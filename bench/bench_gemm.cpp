// bench_gemm: the matrix products of each weight precision on the Gemma-2B projection shapes,
// one JSON line per (shape, implementation) on stdout.
// - int8 (backend/cpu/int8.h): `linear` with our own kernel on each CPU path the machine has, against
//   the same job through oneDNN's s8 × s8 → s32 matmul (Debian libdnnl-dev, where the build found
//   it). Each quantizes x per row, sums integer products and dequantizes (y = acc / (s_x·s_W)), and
//   must give the reference's floats (checked).
// - bf16 weights: fp32 inputs (sgemm on the widened weights), and bf16 inputs (the mixed_bfloat16
//   policy, MatmulPrecision::BF16) through sgemm on the widened values and through oneDNN's bf16
//   matmul — which of the two `linear` takes is measured per machine (backend/cpu/routes.h); the two must
//   agree to fp32 rounding (checked).
//
// - every product kind's two routes (OpenBLAS / our kernel against oneDNN, backend/cpu/routes.h) at
//   the prefill shapes, and whether the route chosen by measurement is within 5 % of the faster.
// Each rate comes with its fraction of this machine's peak for the arithmetic used (machine_limits.h).
//
//   bench_gemm [--threads 2] [--repeat 5] [--routes-only]
#include <CLI/CLI.hpp>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "backend/cpu/blas_kernels.h"
#include "backend//reference_backend.h"
#include "backend/cpu/kernel_path.h"
#include "backend/cpu/isa/int8_dot.h"
#include "backend/cpu/isa/onednn.h"
#include "backend/cpu/int8.h"
#include "backend/cpu/routes.h"
#include "backend/cpu_backend.h"
#include "backend/cpu/linear.h"
#include "machine_limits.h"
#include "run_stats.h"

using namespace meshtune;
using namespace meshtune::bench;

namespace {

struct Shape3 {
  const char* name;
  int64_t M, N, K;  // y[M, N] = x[M, K] · W[N, K]ᵀ
};

std::vector<float> normal_values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

template <typename F>
double median_seconds(int repeat, F&& f) {
  f();  // warm-up
  std::vector<double> s;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = Clock::now();
    f();
    s.push_back(seconds_since(t0));
  }
  return median(s);
}

// This machine's arithmetic peaks (machine_limits.h), measured once in main.
struct Peaks {
  double fp32 = 0, bf16 = 0, int8 = 0;
};
Peaks peaks;

// One JSON line: the shape, the weights' dtype, the implementation, the time and the rate
// (GOPS for integer products, GFLOP/s for float ones) with its fraction of the peak of the
// arithmetic it used (int8 dot, bf16 dot for oneDNN's bf16 matmul, else fp32 FMA), and what it
// was checked against.
void report(const Shape3& s, const char* weights, const std::string& impl, int threads, double seconds,
            const nlohmann::ordered_json& check) {
  const double ops = 2.0 * double(s.M) * double(s.N) * double(s.K);
  nlohmann::ordered_json j;
  j["shape"] = s.name;
  j["weights"] = weights;
  j["impl"] = impl;
  j["threads"] = threads;
  j["cpu_features"] = cpu_features().summary();
  j["ms"] = seconds * 1e3;
  const bool int8 = std::string(weights) == "int8", bf16_dot = impl.find("oneDNN") != std::string::npos &&
                                                                  impl.find("bf16 inputs") != std::string::npos;
  j[int8 ? "gops" : "gflops"] = ops / seconds / 1e9;
  const double peak = int8 ? peaks.int8 : bf16_dot ? peaks.bf16 : peaks.fp32;
  j["peak_kind"] = int8 ? "int8 dot (vpdpbusd)" : bf16_dot ? "bf16 dot (vdpbf16ps)" : "fp32 FMA";
  if (peak > 0) j["fraction_of_peak"] = ops / seconds / 1e9 / peak;
  for (const auto& [key, value] : check.items()) j[key] = value;
  std::cout << j.dump() << std::endl;
}

// bf16 weights: the fp32-input product and the two routes of the bf16-input one.
void bench_bf16(const Shape3& s, int threads, int repeat) {
  const CpuPath best = supported_cpu_paths().back();
  const KernelPath sgemm = make_kernel_path(best), onednn = make_kernel_path(best, every_product_on_onednn());
  const WeightMatrix W = to_bf16_matrix(WeightMatrix::from_f32(s.N, s.K, normal_values(s.N * s.K, 1)));
  const std::vector<float> x = normal_values(s.M * s.K, 2);
  std::vector<float> y(size_t(s.M * s.N)), sgemm_route(y.size());
  report(s, "bf16", "fp32 inputs: sgemm on widened bf16", threads,
         median_seconds(repeat, [&] { linear(sgemm, x.data(), s.M, W, y.data()); }), {});
  report(s, "bf16", "bf16 inputs: sgemm on widened values", threads,
         median_seconds(repeat, [&] { linear(sgemm, x.data(), s.M, W, sgemm_route.data(), MatmulPrecision::BF16); }), {});
  if (onednn.uses_onednn(Product::Bf16Linear) && s.M > 4) {
    const double t = median_seconds(repeat, [&] { linear(onednn, x.data(), s.M, W, y.data(), MatmulPrecision::BF16); });
    double worst = 0, largest = 0;
    for (size_t i = 0; i < y.size(); ++i) {
      worst = std::max(worst, double(std::fabs(y[i] - sgemm_route[i])));
      largest = std::max(largest, double(std::fabs(sgemm_route[i])));
    }
    report(s, "bf16", std::string("bf16 inputs: oneDNN ") + cpu::onednn_version() + " bf16 matmul", threads, t,
           {{"max_rel_diff_to_sgemm_route", worst / largest}});
  }
  // The input gradient dx[M, K] = dy[M, N] · W (backward), fp32 and bf16 inputs.
  const std::vector<float> dy = normal_values(s.M * s.N, 3);
  std::vector<float> dx(size_t(s.M * s.K));
  report(s, "bf16", "backward dx, fp32 inputs", threads,
         median_seconds(repeat, [&] { linear_backward_input(sgemm, dy.data(), s.M, W, dx.data()); }), {});
  report(s, "bf16", "backward dx, bf16 inputs: sgemm on widened values", threads, median_seconds(repeat, [&] {
           linear_backward_input(sgemm, dy.data(), s.M, W, dx.data(), false, MatmulPrecision::BF16);
         }), {});
  if (onednn.uses_onednn(Product::Bf16Linear) && s.M > 4)
    report(s, "bf16", "backward dx, bf16 inputs: oneDNN bf16 matmul", threads, median_seconds(repeat, [&] {
             linear_backward_input(onednn, dy.data(), s.M, W, dx.data(), false, MatmulPrecision::BF16);
           }), {});
}

// Every product kind's two routes (backend/cpu/routes.h) at a model shape, and whether the route a
// CpuBackend takes by default (measured once at 128 × 2048 × 2048) is within 5 % of the faster here.
void bench_routes(const Shape3& s, int threads, int repeat) {
  const CpuPath best = supported_cpu_paths().back();
  const KernelPath own = make_kernel_path(best), onednn = make_kernel_path(best, every_product_on_onednn());
  const KernelPath chosen = CpuBackend().path();
  ProductProbe probe(s.M, s.N, s.K);
  for (int p = 0; p < kProductKinds; ++p) {
    const Product kind = Product(p);
    if (!onednn_can_take(best, kind)) continue;
    const double own_s = median_seconds(repeat, [&] { probe.run(kind, own); });
    const double onednn_s = median_seconds(repeat, [&] { probe.run(kind, onednn); });
    const double chosen_s = chosen.uses_onednn(kind) ? onednn_s : own_s;
    const char* weights = kind == Product::Int8Linear ? "int8" : "routes";
    const bool bf16_inputs = kind == Product::Bf16Linear || kind == Product::Bf16InputGradient;
    const std::string name = product_name(kind);
    report(s, weights, name + ": own route", threads, own_s, {});
    report(s, weights, name + std::string(": oneDNN") + (bf16_inputs ? " bf16 inputs" : ""), threads, onednn_s, {});
    report(s, weights, name + ": default (measured) route" + (chosen.uses_onednn(kind) && bf16_inputs ? ", oneDNN bf16 inputs" : ""),
           threads, chosen_s,
           {{"default_route", chosen.uses_onednn(kind) ? "onednn" : "own"},
            {"default_within_5pct_of_fastest", chosen_s <= 1.05 * std::min(own_s, onednn_s)}});
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (time_sgemm_if_asked()) return 0;  // a child timing OpenBLAS' kernel families
  choose_blas_kernels(argv);
  int threads = 2, repeat = 5;
  CLI::App app("bench_gemm: int8 and bf16 matrix products, ours and oneDNN's; JSON lines on stdout");
  app.add_option("--threads", threads, "OpenMP threads (oneDNN uses the same pool)")->check(CLI::PositiveNumber);
  app.add_option("--repeat", repeat, "Timed repeats (the median is reported)")->check(CLI::PositiveNumber);
  bool routes_only = false;
  app.add_flag("--routes-only", routes_only, "Only the product kinds' two routes at the prefill shapes");
  CLI11_PARSE(app, argc, argv);
  try {
    omp_set_num_threads(threads);
    peaks = {bench::fma_f32_peak_gflops(threads), bench::bf16_dot_peak_gflops(threads), bench::int8_dot_peak_gops(threads)};
    std::cerr << "bench_gemm: peaks on " << threads << " threads: fp32 FMA " << peaks.fp32 << " GFLOP/s, bf16 dot "
              << peaks.bf16 << " GFLOP/s, int8 dot " << peaks.int8 << " GOP/s\n";
    const Shape3 shapes[] = {{"prefill q/gate (128x16384x2048)", 128, 16384, 2048},
                             {"prefill down (128x2048x16384)", 128, 2048, 16384},
                             {"decode gate (1x16384x2048)", 1, 16384, 2048},
                             {"LM head chunk (131x256000x2048)", 131, 256000, 2048}};
    for (const Shape3& s : shapes) {
      if (routes_only) break;
      const WeightMatrix W = quantize_matrix_int8(WeightMatrix::from_f32(s.N, s.K, normal_values(s.N * s.K, 1)));
      const std::vector<float> x = normal_values(s.M * s.K, 2);
      std::vector<float> want(size_t(s.M * s.N)), got(want.size());
      auto int8_report = [&](const std::string& impl, double seconds, bool equal) {
        report(s, "int8", impl, threads, seconds, {{"equal_to_reference", equal}});
      };
      ReferenceBackend().linear(x, s.M, W, want, MatmulPrecision::F32);
      for (CpuPath isa : supported_cpu_paths()) {
        const KernelPath ours = make_kernel_path(isa);  // our kernels at every row count
        const double t = median_seconds(repeat, [&] { linear(ours, x.data(), s.M, W, got.data()); });
        int8_report(std::string("meshtune ") + cpu_path_name(isa), t, got == want);
      }
      if (!cpu::onednn_available()) continue;
      // oneDNN at every shape, decode too (where linear_int8 would not take it): the same quantizing
      // of x as linear_int8, then the library's oneDNN route.
      std::vector<int8_t> codes(static_cast<size_t>(s.M * s.K));
      std::vector<float> x_scales(static_cast<size_t>(s.M));
      const double t = median_seconds(repeat, [&] {
        for (int64_t m = 0; m < s.M; ++m) x_scales[size_t(m)] = quantize_int8(x.data() + m * s.K, s.K, codes.data() + m * s.K);
        cpu::dot_int8_onednn(codes.data(), s.M, x_scales.data(), W.i8(), W.scales, W.rows, W.cols, got.data());
      });
      int8_report(std::string("oneDNN ") + cpu::onednn_version(), t, got == want);
    }
    for (const Shape3& s : shapes)
      if (!routes_only) bench_bf16(s, threads, repeat);
    for (const Shape3& s : shapes)
      if (s.M > 4 && s.N * s.K <= 16384 * 2048) bench_routes(s, threads, repeat);  // the LM head's 2 GB of fp32 W: left out
    // The tutorial's step: Gemma 7B's gate/up projection on a batch of 2 × 128 tokens.
    bench_routes({"7B train gate (256x24576x3072)", 256, 24576, 3072}, threads, repeat);
  } catch (const std::exception& e) {
    std::cerr << "bench_gemm: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
