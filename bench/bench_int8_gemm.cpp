// bench_int8_gemm: `linear` over an int8 matrix (kernels/int8.h) with our own kernel on each CPU
// path the machine has, against the same call through oneDNN's s8 × s8 → s32 matmul (Debian
// libdnnl-dev, where the build found it), on the Gemma-2B projection shapes. Each does the whole
// job — quantize x per row, integer products, dequantize (y = acc / (s_x·s_W)) — and must give the
// reference's floats (checked). One JSON line per (shape, implementation) on stdout.
//
//   bench_int8_gemm [--threads 2] [--repeat 5]
#include <CLI/CLI.hpp>
#include <omp.h>

#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/features.h"
#include "kernels/cpu/int8_dot.h"
#include "kernels/int8.h"
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

}  // namespace

int main(int argc, char** argv) {
  choose_blas_kernels(argv);
  int threads = 2, repeat = 5;
  CLI::App app("bench_int8_gemm: our int8 linear kernel vs oneDNN's s8 matmul; JSON lines on stdout");
  app.add_option("--threads", threads, "OpenMP threads (oneDNN uses the same pool)")->check(CLI::PositiveNumber);
  app.add_option("--repeat", repeat, "Timed repeats (the median is reported)")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    omp_set_num_threads(threads);
    const Shape3 shapes[] = {{"prefill q/gate (128x16384x2048)", 128, 16384, 2048},
                             {"prefill down (128x2048x16384)", 128, 2048, 16384},
                             {"decode gate (1x16384x2048)", 1, 16384, 2048}};
    const CpuPath best = cpu_path();
    for (const Shape3& s : shapes) {
      const WeightMatrix W = quantize_matrix_int8(WeightMatrix::from_f32(s.N, s.K, normal_values(s.N * s.K, 1)));
      const std::vector<float> x = normal_values(s.M * s.K, 2);
      std::vector<float> want(size_t(s.M * s.N)), got(want.size());
      const double ops = 2.0 * double(s.M) * double(s.N) * double(s.K);
      auto report = [&](const std::string& impl, double seconds, bool equal) {
        nlohmann::ordered_json j;
        j["shape"] = s.name;
        j["impl"] = impl;
        j["threads"] = threads;
        j["cpu_features"] = cpu_features().summary();
        j["ms"] = seconds * 1e3;
        j["gops"] = ops / seconds / 1e9;
        j["equal_to_reference"] = equal;
        std::cout << j.dump() << std::endl;
      };
      set_cpu_path(best);
      linear_int8_reference(x.data(), s.M, W, want.data());
      use_onednn_for_int8(false);  // our kernels at every row count
      for (CpuPath path : supported_cpu_paths()) {
        set_cpu_path(path);
        const double t = median_seconds(repeat, [&] { linear(x.data(), s.M, W, got.data()); });
        report(std::string("meshtune ") + cpu_path_name(path), t, got == want);
      }
      set_cpu_path(best);
      use_onednn_for_int8(true);
      if (!cpu::onednn_available()) continue;
      // oneDNN at every shape, decode too (where linear_int8 would not take it): the same quantizing
      // of x as linear_int8, then the library's oneDNN route.
      std::vector<int8_t> codes(static_cast<size_t>(s.M * s.K));
      std::vector<float> x_scales(static_cast<size_t>(s.M));
      const double t = median_seconds(repeat, [&] {
        for (int64_t m = 0; m < s.M; ++m) x_scales[size_t(m)] = quantize_int8(x.data() + m * s.K, s.K, codes.data() + m * s.K);
        cpu::dot_int8_onednn(codes.data(), s.M, x_scales.data(), W.i8(), W.scales, W.rows, W.cols, got.data());
      });
      report(std::string("oneDNN ") + cpu::onednn_version(), t, got == want);
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_int8_gemm: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
