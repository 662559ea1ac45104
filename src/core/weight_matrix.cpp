#include "core/weight_matrix.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace meshtune {

// The loops here prepare weights on the host once, at load or export; they are threaded (a 7B
// model has billions of values to round or quantize) but are not per-step compute, which belongs
// to the backends.

void WeightMatrix::row_to_f32(int64_t r, float* out) const {
  const size_t first = size_t(r) * size_t(cols);
  switch (dtype) {
    case DType::BF16:
      for (int64_t c = 0; c < cols; ++c) out[c] = bf16_to_f32(bf16()[first + size_t(c)]);
      return;
    case DType::I8: return dequantize_int8(i8() + first, cols, scales[r], out);
    default: std::copy(f32() + first, f32() + first + size_t(cols), out);
  }
}

std::vector<float> WeightMatrix::to_f32() const {
  std::vector<float> out(static_cast<size_t>(rows * cols));
#pragma omp parallel for schedule(static) if (rows * cols > (int64_t(1) << 20))
  for (int64_t r = 0; r < rows; ++r) row_to_f32(r, out.data() + r * cols);
  return out;
}

WeightMatrix WeightMatrix::from_f32(int64_t rows, int64_t cols, std::vector<float> values) {
  auto data = std::make_shared<std::vector<float>>(std::move(values));
  WeightMatrix m;
  m.rows = rows;
  m.cols = cols;
  m.dtype = DType::F32;
  m.data = data->data();
  m.owner = data;
  return m;
}

WeightVector::WeightVector(std::vector<float> host) : storage_(std::make_shared<FloatBuffer>(host.size())) {
  std::copy(host.begin(), host.end(), storage_->data());
}

std::vector<float> WeightVector::to_f32() const {
  check(device() == Device::Host, "a weight vector in ", device_name(device()), " memory is read on the host");
  return std::vector<float>(data(), data() + size());
}

WeightMatrix to_bf16_matrix(const WeightMatrix& W) {
  if (W.dtype != DType::F32) return W;
  auto values = std::make_shared<std::vector<uint16_t>>(size_t(W.rows) * size_t(W.cols));
  const float* src = W.f32();
  uint16_t* dst = values->data();
  const int64_t n = W.rows * W.cols;
#pragma omp parallel for schedule(static) if (n > (int64_t(1) << 20))
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
  WeightMatrix b = W;
  b.dtype = DType::BF16;
  b.data = values->data();
  b.owner = values;
  b.mapped = false;
  return b;
}

float abs_max(const float* values, int64_t n) {
  float m = 0.f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(values[i]));
  return m;
}

void quantize_int8_scaled(const float* values, int64_t n, float s, int8_t* codes) {
  // core/scalar_math.h's int8_code, shared with the GPU's kernels (GCC keeps this loop scalar, with
  // branches for the clipped values).
  for (int64_t i = 0; i < n; ++i) codes[i] = int8_code(values[i], s);
}

float quantize_int8(const float* values, int64_t n, int8_t* codes) {
  const float s = int8_scale(abs_max(values, n));
  quantize_int8_scaled(values, n, s, codes);
  return s;
}

void dequantize_int8(const int8_t* codes, int64_t n, float scale, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = float(codes[i]) / scale;
}

void check_int8_columns(int64_t cols, const std::string& what) {
  check(cols <= kMaxInt8Columns, what, ": an int8 matrix with ", cols, " columns could overflow its int32 sums (at most ",
        kMaxInt8Columns, ")");
}

// An int8 matrix's own memory: its codes [rows, cols] and scales [rows].
struct Int8Storage {
  HostTensor codes;  // large ones from mmap: zero pages, not a memset the quantization overwrites
  std::vector<float> scales;
};

std::vector<float> matrix_row_abs_max(const WeightMatrix& W) {
  std::vector<float> maxima(static_cast<size_t>(W.rows));
#pragma omp parallel
  {
    std::vector<float> row(static_cast<size_t>(W.cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < W.rows; ++r) {
      W.row_to_f32(r, row.data());
      maxima[size_t(r)] = abs_max(row.data(), W.cols);
    }
  }
  return maxima;
}

// Quantizes a [rows, cols] matrix whose rows `band_of_rows(r0, n, band)` produces as floats, `n`
// rows at a time (called in parallel, one band per call): codes and scales per row, the scale from
// row_max[r] when given, else from the row's own maximum.
template <class BandOfRows>
static WeightMatrix quantize_rows_int8(int64_t rows, int64_t cols, const float* row_max, BandOfRows band_of_rows) {
  check_int8_columns(cols, "quantize_matrix_int8");
  constexpr int64_t kBand = 16;  // rows per band (the permutation's tile): 16 rows of a 7B matrix are 0.2–1.5 MiB of floats
  auto storage = std::make_shared<Int8Storage>();
  storage->codes = HostTensor::allocate(DType::I8, {rows, cols});
  int8_t* codes = storage->codes.mutable_as<int8_t>();
  storage->scales.resize(size_t(rows));
#pragma omp parallel
  {
    std::vector<float> band(static_cast<size_t>(kBand * cols));
#pragma omp for schedule(static)
    for (int64_t r0 = 0; r0 < rows; r0 += kBand) {
      const int64_t n = std::min(kBand, rows - r0);
      band_of_rows(r0, n, band.data());
      for (int64_t r = r0; r < r0 + n; ++r) {
        const float* row = band.data() + (r - r0) * cols;
        const float scale = int8_scale(row_max ? row_max[r] : abs_max(row, cols));
        quantize_int8_scaled(row, cols, scale, codes + r * cols);
        storage->scales[size_t(r)] = scale;
      }
    }
  }
  WeightMatrix q;
  q.rows = rows;
  q.cols = cols;
  q.dtype = DType::I8;
  q.data = storage->codes.data;
  q.scales = storage->scales.data();
  q.owner = storage;
  return q;
}

WeightMatrix quantize_matrix_int8(const WeightMatrix& W, const float* row_max) {
  return quantize_rows_int8(W.rows, W.cols, row_max, [&W](int64_t r0, int64_t n, float* band) {
    for (int64_t r = 0; r < n; ++r) W.row_to_f32(r0 + r, band + r * W.cols);
  });
}

WeightMatrix quantize_permuted_int8(const HostTensor& in, std::array<int64_t, 3> dims, std::array<int, 3> perm,
                                    int64_t rows, int64_t cols) {
  check(in.dtype == DType::F32 || in.dtype == DType::BF16, "quantize_permuted_int8: a ", dtype_name(in.dtype),
        " tensor (F32 or BF16 expected)");
  return quantize_rows_int8(rows, cols, nullptr, [&](int64_t r0, int64_t n, float* band) {
    thread_local std::vector<std::byte> permuted;
    permuted.resize(size_t(n * cols) * dtype_size(in.dtype));
    permute3_rows(in, dims, perm, cols, r0, n, permuted.data());
    WeightMatrix view;  // the band's rows, in the file's dtype
    view.rows = n;
    view.cols = cols;
    view.dtype = in.dtype;
    view.data = permuted.data();
    for (int64_t r = 0; r < n; ++r) view.row_to_f32(r, band + r * cols);
  });
}

}  // namespace meshtune
