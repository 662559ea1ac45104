#include "machine_limits.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include <immintrin.h>

#include "backend/cpu/isa/features.h"

// GCC 12 warns falsely inside _mm512_reduce_add_ps.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace meshtune::bench {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// A 64-byte aligned buffer whose pages are touched (by all threads, in the layout they will read)
// before any timing, so page faults never land inside a measurement.
struct AlignedBuffer {
  std::unique_ptr<char, decltype(&std::free)> ptr{nullptr, &std::free};
  size_t bytes = 0;
  explicit AlignedBuffer(size_t n) : ptr(static_cast<char*>(std::aligned_alloc(64, (n + 63) / 64 * 64)), &std::free), bytes(n) {
    if (!ptr) throw std::bad_alloc();
    char* p = ptr.get();
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i += 4096) std::memset(p + i, 1, std::min<size_t>(4096, n - i));
  }
  char* data() { return ptr.get(); }
};

// Thread t of n gets bytes [begin, end) of a buffer, split on 64-byte lines.
void share(size_t bytes, int t, int n, size_t& begin, size_t& end) {
  const size_t lines = bytes / 64;
  begin = lines * size_t(t) / size_t(n) * 64;
  end = t == n - 1 ? bytes : lines * size_t(t + 1) / size_t(n) * 64;
}

// The read probe sums the buffer with the widest adds the CPU has and eight independent sums, so
// the adds keep up with memory whatever the build's baseline (a plain loop is one dependent add
// per float: 9 GB/s here against 27). Chosen as the kernels are (backend/cpu/isa/features.h).
__attribute__((target("avx512f"))) float sum_floats_avx512(const float* p, size_t n) {
  __m512 a[8];
  for (auto& v : a) v = _mm512_setzero_ps();
  size_t i = 0;
  for (; i + 128 <= n; i += 128)
    for (int j = 0; j < 8; ++j) a[j] = _mm512_add_ps(a[j], _mm512_loadu_ps(p + i + 16 * j));
  for (int j = 1; j < 8; ++j) a[0] = _mm512_add_ps(a[0], a[j]);
  float s = _mm512_reduce_add_ps(a[0]);
  for (; i < n; ++i) s += p[i];
  return s;
}

__attribute__((target("avx2"))) float sum_floats_avx2(const float* p, size_t n) {
  __m256 a[8];
  for (auto& v : a) v = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int j = 0; j < 8; ++j) a[j] = _mm256_add_ps(a[j], _mm256_loadu_ps(p + i + 8 * j));
  for (int j = 1; j < 8; ++j) a[0] = _mm256_add_ps(a[0], a[j]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, a[0]);
  float s = 0;
  for (float v : lanes) s += v;
  for (; i < n; ++i) s += p[i];
  return s;
}

float sum_floats_generic(const float* p, size_t n) {
  float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) a[j] += p[i + j];
  float s = 0;
  for (float v : a) s += v;
  for (; i < n; ++i) s += p[i];
  return s;
}

float sum_floats(const float* p, size_t n) {
  switch (supported_cpu_paths().back()) {  // the best this CPU has
    case CpuPath::Avx512:
    case CpuPath::Avx512Bf16: return sum_floats_avx512(p, n);
    case CpuPath::Avx2: return sum_floats_avx2(p, n);
    case CpuPath::Generic: break;
  }
  return sum_floats_generic(p, n);
}

// One thread's share of a peak probe: `iterations` × 16 instructions on 16 independent
// accumulators; returns a value the caller keeps so the loop is not optimised away.
constexpr int64_t kPeakIterations = 1 << 22;

__attribute__((target("avx512f"))) float fma_loop_avx512() {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_set1_ps(float(j));
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.001f);
  for (int64_t i = 0; i < kPeakIterations; ++i)
    for (auto& v : acc) v = _mm512_fmadd_ps(v, a, b);
  for (int j = 1; j < 16; ++j) acc[0] = _mm512_add_ps(acc[0], acc[j]);
  return _mm512_reduce_add_ps(acc[0]);
}

__attribute__((target("avx2,fma"))) float fma_loop_avx2() {
  __m256 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm256_set1_ps(float(j));
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(0.001f);
  for (int64_t i = 0; i < kPeakIterations; ++i)
    for (auto& v : acc) v = _mm256_fmadd_ps(v, a, b);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc[15]);
  return lanes[0];
}

__attribute__((target("avx512f,avx512bf16"))) float bf16_dot_loop() {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_set1_ps(float(j));
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3a83);  // 1.0, ~0.001
  for (int64_t i = 0; i < kPeakIterations; ++i)
    for (auto& v : acc) v = _mm512_dpbf16_ps(v, a, b);
  for (int j = 1; j < 16; ++j) acc[0] = _mm512_add_ps(acc[0], acc[j]);
  return _mm512_reduce_add_ps(acc[0]);
}

__attribute__((target("avx512f,avx512vnni"))) float int8_dot_loop() {
  __m512i acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_set1_epi32(j);
  const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(-1);
  for (int64_t i = 0; i < kPeakIterations; ++i)
    for (auto& v : acc) v = _mm512_dpbusd_epi32(v, a, b);
  for (int j = 1; j < 16; ++j) acc[0] = _mm512_add_epi32(acc[0], acc[j]);
  return float(_mm512_reduce_add_epi32(acc[0]));
}

// Runs `loop` on `threads` threads at once, 5 times after a warm-up: the median rate, counting
// `ops_per_instruction` for each of the threads' kPeakIterations × 16 instructions.
double peak_rate(float (*loop)(), double ops_per_instruction, int threads) {
  static volatile float sink = 0;
  std::vector<double> rates;
  for (int r = 0; r < 6; ++r) {
    float total = 0;
    auto t0 = Clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    total += loop();
    const double s = seconds_since(t0);
    sink = sink + total;
    if (r > 0) rates.push_back(double(threads) * double(kPeakIterations) * 16 * ops_per_instruction / s / 1e9);
  }
  return median(rates);
}

}  // namespace

double fma_f32_peak_gflops(int threads) {
  if (cpu_supports(CpuPath::Avx512)) return peak_rate(fma_loop_avx512, 32, threads);
  if (cpu_supports(CpuPath::Avx2)) return peak_rate(fma_loop_avx2, 16, threads);
  return 0;
}

double bf16_dot_peak_gflops(int threads) {
  return cpu_supports(CpuPath::Avx512Bf16) ? peak_rate(bf16_dot_loop, 64, threads) : 0;
}

double int8_dot_peak_gops(int threads) {
  return cpu_supports(CpuPath::Avx512Bf16) ? peak_rate(int8_dot_loop, 128, threads) : 0;  // that path implies VNNI
}

double sgemm_gflops(int M, int N, int K, bool b_transposed, int reps) {
  std::vector<float> a(size_t(M) * K), b(size_t(N) * K), c(size_t(M) * N);
  for (size_t i = 0; i < a.size(); ++i) a[i] = float(i % 7) * 0.1f - 0.3f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = float(i % 5) * 0.1f - 0.2f;
  auto call = [&] {
    if (b_transposed)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.f, a.data(), K, b.data(), K, 0.f, c.data(), N);
    else
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, 1.f, a.data(), K, b.data(), N, 0.f, c.data(), N);
  };
  call();  // warm-up: OpenBLAS thread start, page faults
  std::vector<double> rates;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    call();
    rates.push_back(2.0 * M * N * K / seconds_since(t0) / 1e9);
  }
  return median(rates);
}

double copy_gbps(size_t bytes, int reps) {
  AlignedBuffer src(bytes), dst(bytes);
  std::vector<double> rates;
  for (int r = 0; r < reps + 1; ++r) {
    auto t0 = Clock::now();
#pragma omp parallel
    {
      size_t begin, end;
      share(bytes, omp_get_thread_num(), omp_get_num_threads(), begin, end);
      std::memcpy(dst.data() + begin, src.data() + begin, end - begin);
    }
    const double s = seconds_since(t0);
    if (r > 0) rates.push_back(double(bytes) / s / 1e9);  // r = 0 is a warm-up
  }
  return median(rates);
}

double read_gbps_once(const void* p, size_t bytes, int threads) {
  const float* f = static_cast<const float*>(p);
  static volatile float sink = 0;  // keeps the sums alive
  float total = 0;
  auto t0 = Clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    size_t begin, end;
    share(bytes, omp_get_thread_num(), omp_get_num_threads(), begin, end);
    total += sum_floats(f + begin / 4, (end - begin) / 4);
  }
  const double s = seconds_since(t0);
  sink = sink + total;
  return double(bytes) / s / 1e9;
}

double read_gbps(size_t bytes, int reps, int threads) {
  AlignedBuffer buf(bytes);
  std::vector<double> rates;
  for (int r = 0; r < reps + 1; ++r) {
    const double rate = read_gbps_once(buf.data(), bytes, threads);
    if (r > 0) rates.push_back(rate);  // r = 0 is a warm-up
  }
  return median(rates);
}

}  // namespace meshtune::bench
