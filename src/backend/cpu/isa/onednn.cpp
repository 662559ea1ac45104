// oneDNN's matmul for the int8, fp32 and bf16 GEMMs (cpu/onednn.h). Integer sums are exact either way,
// and the int8 dequantization is ours, so those floats are the same bit for bit as our kernels'.
// Primitives are JIT-compiled once per shape and kept.
#include "backend/cpu/isa/onednn.h"

#ifdef MESHTUNE_HAVE_ONEDNN
#include <array>
#include <cstring>
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <vector>

namespace meshtune::cpu {

bool onednn_available() { return true; }

const char* onednn_version() {
  static const std::string v = [] {
    const dnnl_version_t* d = dnnl_version();
    return std::to_string(d->major) + "." + std::to_string(d->minor) + "." + std::to_string(d->patch);
  }();
  return v.c_str();
}

namespace {

struct Context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  // By (M, rows or K, cols or N, kind, leading dimensions): kind 0 int8; else 1 + bf16 + 2·a_transposed +
  // 4·b_transposed + 8·accumulate.
  std::map<std::array<int64_t, 7>, dnnl::matmul::primitive_desc> primitives;
  std::mutex mutex;
};

Context& context() {
  static Context c;
  return c;
}

}  // namespace

void dot_int8_onednn(const int8_t* x, int64_t M, const float* x_scales, const int8_t* w, const float* w_scales,
                     int64_t rows, int64_t cols, float* y) {
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  Context& c = context();
  std::lock_guard lock(c.mutex);
  // x codes [M, cols] row-major; W codes [rows, cols] row-major read as a [cols, rows] matrix
  // ("ba"); the sums [M, rows] in int32.
  const dnnl::memory::desc x_md({M, cols}, dt::s8, tag::ab), w_md({cols, rows}, dt::s8, tag::ba),
      acc_md({M, rows}, dt::s32, tag::ab);
  const std::array<int64_t, 7> key{M, rows, cols, 0, 0, 0, 0};
  auto it = c.primitives.find(key);
  if (it == c.primitives.end())
    it = c.primitives.emplace(key, dnnl::matmul::primitive_desc(dnnl::matmul::desc(x_md, w_md, acc_md), c.engine)).first;
  // The int32 sums go into y's own memory (4 bytes each, like the floats) and become floats in
  // place: no second [M, rows] buffer (up to 128 MiB for a chunk of the LM head's logits).
  dnnl::memory x_mem(x_md, c.engine, const_cast<int8_t*>(x)), w_mem(w_md, c.engine, const_cast<int8_t*>(w)),
      acc_mem(acc_md, c.engine, y);
  dnnl::matmul(it->second).execute(c.stream, {{DNNL_ARG_SRC, x_mem}, {DNNL_ARG_WEIGHTS, w_mem}, {DNNL_ARG_DST, acc_mem}});
  c.stream.wait();
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < rows; ++r) {
      int32_t acc;
      std::memcpy(&acc, y + m * rows + r, 4);  // the bytes oneDNN wrote, read as what they are
      y[m * rows + r] = float(acc) / (x_scales[m] * w_scales[r]);
    }
}

bool onednn_int8_exact() {
  static const bool exact = [] {
    // More rows than the few-row kernel takes, codes spread over −127 … 127 with runs at the ends
    // (where 16-bit pair sums would saturate), scales 1: every sum is an integer a float holds.
    const int64_t M = 8, rows = 8, cols = 256;
    std::vector<int8_t> x(size_t(M * cols)), w(size_t(rows * cols));
    uint32_t state = 12345;
    auto code = [&state](int64_t i) {
      state = state * 1664525u + 1013904223u;
      if (i % 3 == 0) return int8_t((state >> 16) & 1 ? 127 : -127);
      return int8_t(int((state >> 16) % 255) - 127);
    };
    for (int64_t i = 0; i < M * cols; ++i) x[size_t(i)] = code(i);
    for (int64_t i = 0; i < rows * cols; ++i) w[size_t(i)] = i < cols ? int8_t(127) : code(i);
    for (int64_t c = 0; c < cols; ++c) x[size_t(c)] = 127;  // row 0 · row 0: the largest sum
    std::vector<float> ones(8, 1.f), y(size_t(M * rows));
    dot_int8_onednn(x.data(), M, ones.data(), w.data(), ones.data(), rows, cols, y.data());
    for (int64_t m = 0; m < M; ++m)
      for (int64_t r = 0; r < rows; ++r) {
        int64_t sum = 0;
        for (int64_t c = 0; c < cols; ++c) sum += int64_t(x[size_t(m * cols + c)]) * w[size_t(r * cols + c)];
        if (y[size_t(m * rows + r)] != float(sum)) return false;
      }
    return true;
  }();
  return exact;
}

void matmul_onednn(bool bf16, int64_t M, int64_t K, int64_t N, const void* a, int64_t lda, bool a_transposed,
                   const void* b, int64_t ldb, bool b_transposed, float* c, int64_t ldc, bool accumulate) {
  using dt = dnnl::memory::data_type;
  Context& ctx = context();
  std::lock_guard lock(ctx.mutex);
  const dt type = bf16 ? dt::bf16 : dt::f32;
  // Row-major with a leading dimension; a transposed operand swaps the strides.
  auto strides = [](int64_t ld, bool transposed) { return transposed ? dnnl::memory::dims{1, ld} : dnnl::memory::dims{ld, 1}; };
  const dnnl::memory::desc a_md({M, K}, type, strides(lda, a_transposed)), b_md({K, N}, type, strides(ldb, b_transposed)),
      c_md({M, N}, dt::f32, strides(ldc, false));
  const std::array<int64_t, 7> key{M, K, N, 1 + int(bf16) + 2 * int(a_transposed) + 4 * int(b_transposed) + 8 * int(accumulate),
                                   lda, ldb, ldc};
  auto it = ctx.primitives.find(key);
  if (it == ctx.primitives.end()) {
    dnnl::primitive_attr attr;
    if (accumulate) {
      dnnl::post_ops sum;
      sum.append_sum(1.f);
      attr.set_post_ops(sum);
    }
    it = ctx.primitives.emplace(key, dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), attr, ctx.engine))
             .first;
  }
  dnnl::memory a_mem(a_md, ctx.engine, const_cast<void*>(a)), b_mem(b_md, ctx.engine, const_cast<void*>(b)),
      c_mem(c_md, ctx.engine, c);
  dnnl::matmul(it->second).execute(ctx.stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}});
  ctx.stream.wait();
}

}  // namespace meshtune::cpu

#else  // built without oneDNN: our own kernels do all of it

namespace meshtune::cpu {
bool onednn_available() { return false; }
const char* onednn_version() { return ""; }
void dot_int8_onednn(const int8_t*, int64_t, const float*, const int8_t*, const float*, int64_t, int64_t, float*) {}
bool onednn_int8_exact() { return false; }
void matmul_onednn(bool, int64_t, int64_t, int64_t, const void*, int64_t, bool, const void*, int64_t, bool, float*, int64_t,
                   bool) {}
}  // namespace meshtune::cpu

#endif
