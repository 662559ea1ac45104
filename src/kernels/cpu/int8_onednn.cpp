// The int8 GEMM for many rows of x (prefill, training) through oneDNN's s8 × s8 → s32 matmul
// (Debian libdnnl-dev), where the build found it: 3.6× our own VNNI kernel at 128 × 16384 × 2048
// on the development machine (bench/bench_int8_gemm). Integer sums are exact either way, and the
// dequantization is ours, so the floats are the same bit for bit. oneDNN picks its own instruction
// set (ONEDNN_MAX_CPU_ISA limits it); MESHTUNE_CPU does not reach it. Primitives are JIT-compiled
// once per shape and kept.
#include "kernels/cpu/int8_dot.h"

#ifdef MESHTUNE_HAVE_ONEDNN
#include <cstring>
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <tuple>

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
  std::map<std::tuple<int64_t, int64_t, int64_t>, dnnl::matmul::primitive_desc> primitives;
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
  auto key = std::make_tuple(M, rows, cols);
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

}  // namespace meshtune::cpu

#else  // built without oneDNN: our own kernels do all of it

namespace meshtune::cpu {
bool onednn_available() { return false; }
const char* onednn_version() { return ""; }
void dot_int8_onednn(const int8_t*, int64_t, const float*, const int8_t*, const float*, int64_t, int64_t, float*) {}
}  // namespace meshtune::cpu

#endif
