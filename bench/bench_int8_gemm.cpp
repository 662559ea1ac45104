// bench_int8_gemm: our int8 linear kernel (kernels/int8.h) against oneDNN's s8 × s8 → s32 matmul
// (Debian libdnnl-dev) on the Gemma-2B projection shapes, each path the CPU has. Both sides do the
// same whole job — quantize x per row, integer products, dequantize (y = acc / (s_x·s_W)) — and
// both must give the same floats (checked). One JSON line per (shape, implementation) on stdout.
//
//   bench_int8_gemm [--threads 2] [--repeat 5]
#include <CLI/CLI.hpp>
#include <cblas.h>
#include <omp.h>

#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <oneapi/dnnl/dnnl.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/features.h"
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

// oneDNN's matmul of x codes [M, K] (s8) with W codes as [K, N] (s8, our [N, K] rows read as
// columns: format "ba"), into s32; then our dequantization. The primitive is made once.
struct OneDnnInt8 {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  dnnl::matmul matmul;
  dnnl::memory src, weights, dst;

  OneDnnInt8(int64_t M, int64_t N, int64_t K, const int8_t* w) {
    using dt = dnnl::memory::data_type;
    using tag = dnnl::memory::format_tag;
    const dnnl::memory::desc src_md({M, K}, dt::s8, tag::ab), w_md({K, N}, dt::s8, tag::ba),
        dst_md({M, N}, dt::s32, tag::ab);
    matmul = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(src_md, w_md, dst_md), engine));
    src = dnnl::memory(src_md, engine);
    weights = dnnl::memory(w_md, engine, const_cast<int8_t*>(w));
    dst = dnnl::memory(dst_md, engine);
  }
  void run(const float* x, int64_t M, const WeightMatrix& W, float* y) {
    int8_t* codes = static_cast<int8_t*>(src.get_data_handle());
    std::vector<float> x_scales(static_cast<size_t>(M));
    for (int64_t m = 0; m < M; ++m) x_scales[size_t(m)] = quantize_int8(x + m * W.cols, W.cols, codes + m * W.cols);
    matmul.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, dst}});
    stream.wait();
    const int32_t* acc = static_cast<const int32_t*>(dst.get_data_handle());
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t r = 0; r < W.rows; ++r) y[m * W.rows + r] = float(acc[m * W.rows + r]) / (x_scales[size_t(m)] * W.scales[r]);
  }
};

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
      for (CpuPath path : supported_cpu_paths()) {
        set_cpu_path(path);
        const double t = median_seconds(repeat, [&] { linear(x.data(), s.M, W, got.data()); });
        report(std::string("meshtune ") + cpu_path_name(path), t, got == want);
      }
      set_cpu_path(best);
      OneDnnInt8 dnnl(s.M, s.N, s.K, W.i8());
      const double t = median_seconds(repeat, [&] { dnnl.run(x.data(), s.M, W, got.data()); });
      report("oneDNN " + std::string(dnnl_version()->cpu_runtime == DNNL_RUNTIME_OMP ? "omp" : "seq"), t, got == want);
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_int8_gemm: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
