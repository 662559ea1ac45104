#include "backend/cpu/int8.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "backend/cpu/isa/int8_dot.h"
#include "backend/cpu/isa/onednn.h"

namespace meshtune {

void row_abs_max(const float* x, int64_t rows, int64_t cols, float* out) {
  for (int64_t r = 0; r < rows; ++r) out[r] = abs_max(x + r * cols, cols);
}

// Rows of x at or below which our kernel (W streamed once at memory bandwidth) beats oneDNN.
static constexpr int64_t kFewRows = 4;
// Whether oneDNN's sums are exact here is checked at the first product that would use it (so a run
// without int8 products never starts oneDNN).
bool int8_uses_onednn(const KernelPath& path, int64_t M) {
  return path.uses_onednn(Product::Int8Linear) && M > kFewRows && cpu::onednn_int8_exact();
}

void linear_int8(const KernelPath& path, const float* x, int64_t M, const WeightMatrix& W, float* y, const float* x_row_max) {
  check_int8_columns(W.cols, "linear_int8");
  // Per-thread scratch kept between calls: decode calls this hundreds of times per token.
  thread_local std::vector<int8_t> codes;
  thread_local std::vector<float> x_scales;
  codes.resize(static_cast<size_t>(M * W.cols));
  x_scales.resize(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * W.cols;
    x_scales[size_t(m)] = int8_scale(x_row_max ? x_row_max[m] : abs_max(row, W.cols));
    quantize_int8_scaled(row, W.cols, x_scales[size_t(m)], codes.data() + m * W.cols);
  }
  if (int8_uses_onednn(path, M))
    return cpu::dot_int8_onednn(codes.data(), M, x_scales.data(), W.i8(), W.scales, W.rows, W.cols, y);
  switch (path.isa) {
    case CpuPath::Avx512Bf16:  // implies VNNI
      return cpu::dot_int8_avx512vnni(codes.data(), M, x_scales.data(), W.i8(), W.scales, W.rows, W.cols, y);
    case CpuPath::Avx512:
      return cpu::dot_int8_avx512(codes.data(), M, x_scales.data(), W.i8(), W.scales, W.rows, W.cols, y);
    case CpuPath::Avx2: return cpu::dot_int8_avx2(codes.data(), M, x_scales.data(), W.i8(), W.scales, W.rows, W.cols, y);
    case CpuPath::Generic:
      return cpu::dot_int8_generic(codes.data(), M, x_scales.data(), W.i8(), W.scales, W.rows, W.cols, y);
  }
}

}  // namespace meshtune
