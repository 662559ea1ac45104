// The op registry (in the spirit of llama.cpp's test-backend-ops): each op of the Backend, forward
// and backward, is one case, run on every backend this machine has — CpuBackend on each CPU path
// it supports — against ReferenceBackend, on odd shapes and every dtype the op takes; and each
// backward case is checked on ReferenceBackend against central finite differences of
// L = Σ c·forward(inputs) (random c). A CUDA backend joins by adding itself to `backends()`.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cpu_backend.h"
#include "backend/cuda_devices.h"
#include "backend/reference_backend.h"
#include "core/error.h"
#include "cpu_path_test.h"
#include "backend/cpu/int8.h"
#include "test_util.h"

using namespace meshtune;
using meshtune::testing::random_vector;

namespace {

using Values = std::vector<float>;
using Inputs = std::vector<Values>;

struct OpCase {
  std::string name;
  std::function<Inputs()> make_inputs;
  // Runs the op on `in` (which it may overwrite: in-place ops), returning its outputs.
  std::function<Inputs(Backend&, Inputs& in)> forward;
  // The gradients of Σ dy·forward with respect to the inputs named by `differentiable` (in order).
  std::function<Inputs(Backend&, Inputs& in, const Values& dy)> backward;
  std::vector<size_t> differentiable;
  double tolerance = 1e-5;     // backend against reference, relative to max(1, |reference|)
  double fd_tolerance = 2e-3;  // reference backward against finite differences
  float fd_step = 1e-2f;
};

WeightMatrix matrix(int64_t rows, int64_t cols, const Values& values, DType dtype) {
  WeightMatrix W = WeightMatrix::from_f32(rows, cols, values);
  if (dtype == DType::BF16) return to_bf16_matrix(W);
  if (dtype == DType::I8) return quantize_matrix_int8(W);
  return W;
}

Values zeros(int64_t n) { return Values(size_t(n), 0.f); }

// Each case hands the op operands in the backend's memory — host values uploaded, results
// downloaded — so a device backend (CUDA, or the reference with device-tagged memory) runs the
// registry unchanged.
template <class E>
Buffer<E> put(Backend& b, const std::vector<E>& host) {
  Buffer<E> d;
  b.resize(d, host.size());
  b.upload(Span<const E>(host.data(), host.size()), d);
  return d;
}
Values get(Backend& b, const FloatBuffer& d) {
  Values host(d.size());
  b.download(d, host);
  return host;
}

// bf16 operands: fp32 values narrowed on the backend, and brought back widened.
Buffer<uint16_t> put_bf16(Backend& b, const Values& host) {
  const FloatBuffer wide = put(b, host);
  Buffer<uint16_t> narrow;
  b.resize(narrow, host.size());
  b.narrow_to_bf16(wide, int64_t(host.size()), narrow);
  return narrow;
}
Values get_bf16(Backend& b, Span<const uint16_t> d) {
  FloatBuffer wide = put(b, zeros(int64_t(d.size)));
  b.widen_bf16(d, int64_t(d.size), wide);
  return get(b, wide);
}

std::vector<OpCase> linear_cases() {
  std::vector<OpCase> cases;
  struct Shape {
    int64_t M, rows, cols;
  };
  // Few rows (the CPU's matrix-vector path for ≤ 4, the GPU's few-row kernel for ≤ 8), more rows
  // (sgemm / oneDNN, cuBLAS), odd widths and widths of whole 16-byte loads.
  for (Shape s : {Shape{1, 7, 33}, Shape{3, 17, 9}, Shape{5, 31, 65}, Shape{19, 13, 40}, Shape{8, 9, 64},
                  Shape{2, 40, 24}})
    for (DType dtype : {DType::F32, DType::BF16, DType::I8})
      for (MatmulPrecision precision : {MatmulPrecision::F32, MatmulPrecision::BF16}) {
        if (dtype == DType::I8 && precision == MatmulPrecision::BF16) continue;  // int8 keeps its own arithmetic
        const std::string name = std::string("linear_") + dtype_name(dtype) +
                                 (precision == MatmulPrecision::BF16 ? "_bf16inputs_" : "_") + std::to_string(s.M) +
                                 "x" + std::to_string(s.rows) + "x" + std::to_string(s.cols);
        OpCase c;
        c.name = name;
        c.make_inputs = [s] { return Inputs{random_vector(size_t(s.M * s.cols), 1), random_vector(size_t(s.rows * s.cols), 2, 0.3f)}; };
        c.forward = [s, dtype, precision](Backend& b, Inputs& in) {
          const WeightMatrix W = b.upload(matrix(s.rows, s.cols, in[1], dtype));
          FloatBuffer y = put(b, zeros(s.M * s.rows));
          b.linear(put(b, in[0]), s.M, W, y, precision);
          return Inputs{get(b, y)};
        };
        // dx = dy·W always; dW = dyᵀ·x only for trainable fp32 weights.
        c.backward = [s, dtype, precision](Backend& b, Inputs& in, const Values& dy) {
          const WeightMatrix W = b.upload(matrix(s.rows, s.cols, in[1], dtype));
          FloatBuffer dx = put(b, zeros(s.M * s.cols)), dW = put(b, zeros(s.rows * s.cols)), d_y = put(b, dy);
          b.linear_backward_input(d_y, s.M, W, dx, false, precision);
          if (dtype != DType::F32 || precision != MatmulPrecision::F32) return Inputs{get(b, dx)};
          b.linear_backward_weight(d_y, put(b, in[0]), s.M, s.rows, s.cols, dW);
          return Inputs{get(b, dx), get(b, dW)};
        };
        if (dtype == DType::F32 && precision == MatmulPrecision::F32) c.differentiable = {0, 1};
        c.tolerance = dtype == DType::I8 ? 1e-5 : precision == MatmulPrecision::BF16 ? 1e-4 : 1e-5;
        cases.push_back(std::move(c));
      }
  // Several weights of one input (q, k and v), of mixed dtypes: each output as linear gives it.
  for (int64_t M : {1, 3, 12})
    for (MatmulPrecision precision : {MatmulPrecision::F32, MatmulPrecision::BF16}) {
      OpCase c;
      c.name = std::string("linear_shared_input_") + (precision == MatmulPrecision::BF16 ? "bf16inputs_" : "") +
               std::to_string(M);
      const int64_t cols = 32, rows[3] = {24, 8, 9};
      c.make_inputs = [=] {
        return Inputs{random_vector(size_t(M * cols), 5), random_vector(size_t(rows[0] * cols), 6, 0.3f),
                      random_vector(size_t(rows[1] * cols), 7, 0.3f), random_vector(size_t(rows[2] * cols), 8, 0.3f)};
      };
      c.forward = [=](Backend& b, Inputs& in) {
        const WeightMatrix W0 = b.upload(matrix(rows[0], cols, in[1], DType::F32)),
                           W1 = b.upload(matrix(rows[1], cols, in[2], DType::BF16)),
                           W2 = b.upload(matrix(rows[2], cols, in[3], DType::BF16));
        FloatBuffer y0 = put(b, zeros(M * rows[0])), y1 = put(b, zeros(M * rows[1])), y2 = put(b, zeros(M * rows[2]));
        b.linear(put(b, in[0]), M, {{&W0, y0}, {&W1, y1}, {&W2, y2}}, precision);
        return Inputs{get(b, y0), get(b, y1), get(b, y2)};
      };
      // dx (+)= Σ dy_i·W_i, each dy_i a different stretch of dy (the first all of it, the others its
      // last values: no dy_i is another's prefix); at M = 3 added into a dx that holds x.
      c.backward = [=](Backend& b, Inputs& in, const Values& dy) {
        const WeightMatrix W0 = b.upload(matrix(rows[0], cols, in[1], DType::F32)),
                           W1 = b.upload(matrix(rows[1], cols, in[2], DType::BF16)),
                           W2 = b.upload(matrix(rows[2], cols, in[3], DType::BF16));
        const auto part = [&](int i) { return put(b, Values(dy.end() - M * rows[i], dy.end())); };
        const FloatBuffer dy0 = part(0), dy1 = part(1), dy2 = part(2);
        const bool accumulate = M == 3;
        FloatBuffer dx = put(b, accumulate ? in[0] : zeros(M * cols));
        b.linear_backward_input({{&W0, dy0}, {&W1, dy1}, {&W2, dy2}}, M, dx, accumulate, precision);
        return Inputs{get(b, dx)};
      };
      c.tolerance = precision == MatmulPrecision::BF16 ? 1e-4 : 1e-5;
      cases.push_back(std::move(c));
    }
  // Gate and up ending in GeGLU (linear_geglu): few rows (a GPU's one-launch kernel) and more; a bf16
  // gate beside an fp32 (odd M) or bf16 up; widths of whole 16-byte loads and an odd one; out apart
  // from gate, or onto it (M = 5).
  for (int64_t M : {1, 5, 8, 12})
    for (MatmulPrecision precision : {MatmulPrecision::F32, MatmulPrecision::BF16}) {
      OpCase c;
      c.name = std::string("linear_geglu_") + (precision == MatmulPrecision::BF16 ? "bf16inputs_" : "") +
               std::to_string(M);
      const int64_t cols = M == 5 ? 33 : 40, rows = 23;
      c.make_inputs = [=] {
        return Inputs{random_vector(size_t(M * cols), 9), random_vector(size_t(rows * cols), 10, 0.3f),
                      random_vector(size_t(rows * cols), 11, 0.3f)};
      };
      c.forward = [=](Backend& b, Inputs& in) {
        const WeightMatrix gate_W = b.upload(matrix(rows, cols, in[1], DType::BF16)),
                           up_W = b.upload(matrix(rows, cols, in[2], M % 2 ? DType::F32 : DType::BF16));
        FloatBuffer gate = put(b, zeros(M * rows)), up = put(b, zeros(M * rows)), out = put(b, zeros(M * rows));
        FloatBuffer& result = M == 5 ? gate : out;
        b.linear_geglu(put(b, in[0]), M, gate_W, up_W, gate, up, result, precision);
        return Inputs{get(b, result)};
      };
      c.tolerance = precision == MatmulPrecision::BF16 ? 1e-4 : 1e-5;
      cases.push_back(std::move(c));
    }
  // Inputs already in bf16 (a training step's feed-forward under the bf16 policies): y = x·Wᵀ, and dx
  // (+)= Σ dy_i·W_i over two weights (gate and up: bf16 and fp32 storage), at M = 19 added into a dx
  // holding x. Few rows and more; an odd width.
  for (int64_t M : {3, 19}) {
    OpCase c;
    c.name = "linear_bf16_input_" + std::to_string(M);
    const int64_t cols = M == 3 ? 33 : 40, rows = 23;
    c.make_inputs = [=] {
      return Inputs{random_vector(size_t(M * cols), 12), random_vector(size_t(rows * cols), 13, 0.3f),
                    random_vector(size_t(rows * cols), 14, 0.3f)};
    };
    c.forward = [=](Backend& b, Inputs& in) {
      const WeightMatrix W0 = b.upload(matrix(rows, cols, in[1], DType::BF16)),
                         W1 = b.upload(matrix(rows, cols, in[2], DType::F32));
      FloatBuffer y0 = put(b, zeros(M * rows)), y1 = put(b, zeros(M * rows));
      const Buffer<uint16_t> x = put_bf16(b, in[0]);
      b.linear(x, M, W0, y0);
      b.linear(x, M, W1, y1);
      return Inputs{get(b, y0), get(b, y1)};
    };
    c.backward = [=](Backend& b, Inputs& in, const Values& dy) {
      const WeightMatrix W0 = b.upload(matrix(rows, cols, in[1], DType::BF16)),
                         W1 = b.upload(matrix(rows, cols, in[2], DType::F32));
      const Buffer<uint16_t> dy0 = put_bf16(b, Values(dy.begin(), dy.begin() + M * rows)),
                             dy1 = put_bf16(b, Values(dy.rbegin(), dy.rbegin() + M * rows));
      const bool accumulate = M == 19;
      FloatBuffer dx = put(b, accumulate ? in[0] : zeros(M * cols));
      b.linear_backward_input({{&W0, dy0}, {&W1, dy1}}, M, dx, accumulate);
      return Inputs{get(b, dx)};
    };
    c.tolerance = 1e-4;
    cases.push_back(std::move(c));
  }
  // int8 with the rows' maxima given (a split input's combined maxima): larger than the slice's own.
  OpCase c;
  c.name = "linear_int8_given_row_max";
  c.make_inputs = [] { return Inputs{random_vector(6 * 20, 3), random_vector(9 * 20, 4, 0.3f)}; };
  c.forward = [](Backend& b, Inputs& in) {
    const WeightMatrix W = b.upload(matrix(9, 20, in[1], DType::I8));
    FloatBuffer x = put(b, in[0]), row_max = put(b, zeros(6)), y = put(b, zeros(6 * 9));
    b.row_abs_max(x, 6, 20, row_max);
    b.scale(row_max, 6, 1.5f);
    b.linear(x, 6, W, y, MatmulPrecision::F32, row_max);
    return Inputs{get(b, y), get(b, row_max)};
  };
  cases.push_back(std::move(c));
  return cases;
}

// A LoRA term over strided views of A and B (two column groups, like a query matrix of 2 heads;
// A stored [in, groups·rank], B [per_group, rank], PEFT's transposed way), or in Keras' layout
// (A [groups, in, rank], B [rank, per_group]).
struct LowRankViews {
  int64_t M = 5, in = 11, groups = 2, per_group = 7, rank = 3;
  bool keras_layout = false;
  LowRankTerm term(Device device, const float* a, const float* b, float* ga = nullptr, float* gb = nullptr) const {
    LowRankTerm t;
    t.device = device;
    t.rank = rank, t.groups = groups, t.in = in, t.out_per_group = per_group, t.scale = 0.75f;
    t.a = a, t.b = b;
    if (keras_layout) {
      t.a_group = in * rank, t.a_row = rank, t.a_col = 1;
      t.b_row = per_group, t.b_col = 1;
    } else {
      t.a_group = rank, t.a_row = groups * rank, t.a_col = 1;
      t.b_row = 1, t.b_col = rank;
    }
    t.grad_a = ga, t.grad_b = gb;
    return t;
  }
};

// With `accumulating`, the gradients and dx start from values of their own (backward adds to them),
// so the case is not checked against finite differences.
OpCase low_rank_case(const std::string& name, LowRankViews v, bool accumulating) {
  OpCase c;
  c.name = name;
  c.make_inputs = [v] {
    return Inputs{random_vector(size_t(v.M * v.in), 5), random_vector(size_t(v.in * v.groups * v.rank), 6),
                  random_vector(size_t(v.per_group * v.rank), 7), random_vector(size_t(v.M * v.groups * v.per_group), 8)};
  };
  c.forward = [v](Backend& b, Inputs& in) {
    FloatBuffer y = put(b, in[3]), a = put(b, in[1]), bb = put(b, in[2]);  // the term is added to y
    b.low_rank(put(b, in[0]), v.M, v.term(b.device(), a.data(), bb.data()), y);
    return Inputs{get(b, y)};
  };
  c.backward = [v, accumulating](Backend& b, Inputs& in, const Values& dy) {
    auto start = [&](size_t n, uint64_t seed) { return accumulating ? random_vector(n, seed) : zeros(int64_t(n)); };
    FloatBuffer dx = put(b, start(size_t(v.M * v.in), 9)), ga = put(b, start(in[1].size(), 10)),
                gb = put(b, start(in[2].size(), 11)), a = put(b, in[1]), bb = put(b, in[2]);
    b.low_rank_backward(put(b, in[0]), put(b, dy), v.M, v.term(b.device(), a.data(), bb.data(), ga.data(), gb.data()),
                        dx);
    return Inputs{get(b, dx), get(b, ga), get(b, gb)};
  };
  if (!accumulating) c.differentiable = {0, 1, 2};
  // The reference sums in double; backends in fp32 over sums of up to M·groups terms (∂B), from the
  // fp32-rounded x·A.
  if (accumulating) c.tolerance = 5e-5;
  return c;
}

std::vector<OpCase> norm_cases() {
  std::vector<OpCase> cases;
  // Small rows, and enough rows × width to take the threaded path.
  // The model runs backward in place (dx = dy): the last shape again that way, where a backend that
  // wrote dx before every row's ∂scale was summed would be wrong; and adding into a residual's dx,
  // with ∂scale (full fine-tuning) and without (a frozen scale: LoRA).
  enum class Dx { Apart, InPlace, Added, AddedFrozenScale };
  struct NormShape {
    int64_t rows, dim;
    Dx dx;
  };
  for (const NormShape& shape : {NormShape{3, 7, Dx::Apart}, {2, 33, Dx::Apart}, {300, 256, Dx::Apart}, {2, 2000, Dx::Apart},
                                 {300, 256, Dx::InPlace}, {3, 7, Dx::Added}, {300, 256, Dx::Added},
                                 {3, 7, Dx::AddedFrozenScale}, {300, 256, Dx::AddedFrozenScale}}) {
    const int64_t rows = shape.rows, dim = shape.dim;  // named variables: lambdas capture them
    const bool in_place = shape.dx == Dx::InPlace, frozen = shape.dx == Dx::AddedFrozenScale,
               added = shape.dx == Dx::Added || frozen;
    OpCase c;
    c.name = std::string(in_place ? "rmsnorm_in_place_" : frozen ? "rmsnorm_added_frozen_scale_" : added ? "rmsnorm_added_"
                                                                                                     : "rmsnorm_") +
             std::to_string(rows) + "x" + std::to_string(dim);
    c.make_inputs = [rows, dim] { return Inputs{random_vector(size_t(rows * dim), 9), random_vector(size_t(dim), 10, 0.5f)}; };
    c.forward = [rows, dim](Backend& b, Inputs& in) {
      FloatBuffer y = put(b, zeros(rows * dim));
      b.rmsnorm(put(b, in[0]), put(b, in[1]), rows, dim, 1e-6f, y);
      return Inputs{get(b, y)};
    };
    c.backward = [rows, dim, in_place, added, frozen](Backend& b, Inputs& in, const Values& dy) {
      FloatBuffer dx = put(b, in_place ? dy : added ? random_vector(size_t(rows * dim), 12) : zeros(rows * dim)),
                  dscale = put(b, zeros(dim));
      if (in_place)
        b.rmsnorm_backward(put(b, in[0]), put(b, in[1]), rows, dim, 1e-6f, dx, dx, dscale);
      else
        b.rmsnorm_backward(put(b, in[0]), put(b, in[1]), rows, dim, 1e-6f, put(b, dy), dx,
                           frozen ? Floats() : Floats(dscale), added);
      return Inputs{get(b, dx), get(b, dscale)};
    };
    // Finite differences on the small ones (not where dx starts from other values).
    if (rows * dim < 1000 && !added) c.differentiable = {0, 1};
    // ∂scale sums 300 rows in fp32, in one part per thread: the error depends on the thread count
    // (1.06e-5 on the GPU machine's 16 cores, generic path).
    c.tolerance = rows * dim < 1000 ? 1e-5 : 2e-5;
    cases.push_back(std::move(c));
  }
  // The residual join and the next norm in one op: x += branch (returned), y = RMSNorm(x); the
  // `_branch_norm` cases normalize the branch first (Gemma 2/3's post-norm, a fourth input). Few long
  // rows (2 × 2000, 1 × 2100: decode's) take a GPU's larger blocks.
  struct JoinShape {
    int64_t rows, dim;
    bool branch_norm;
  };
  for (const JoinShape& shape : {JoinShape{3, 7, false}, {300, 256, false}, {3, 7, true}, {300, 256, true},
                                 {1, 2100, true}}) {
    const int64_t rows = shape.rows, dim = shape.dim;
    const bool branch_norm = shape.branch_norm;
    OpCase c;
    c.name = "add_rmsnorm_" + std::to_string(rows) + "x" + std::to_string(dim) + (branch_norm ? "_branch_norm" : "");
    c.make_inputs = [rows, dim, branch_norm] {
      Inputs in{random_vector(size_t(rows * dim), 13), random_vector(size_t(rows * dim), 14),
                random_vector(size_t(dim), 15, 0.5f)};
      if (branch_norm) in.push_back(random_vector(size_t(dim), 16, 0.5f));
      return in;
    };
    // The longer cases also write the new x into x_copy (training's kept residual stream).
    c.forward = [rows, dim, branch_norm](Backend& b, Inputs& in) {
      FloatBuffer x = put(b, in[0]), y = put(b, zeros(rows * dim));
      FloatBuffer branch_scale = branch_norm ? put(b, in[3]) : FloatBuffer();
      if (rows < 300) {
        b.add_rmsnorm(x, put(b, in[1]), put(b, in[2]), rows, dim, 1e-6f, y, {}, branch_scale);
        return Inputs{get(b, y), get(b, x)};
      }
      FloatBuffer x_copy = put(b, zeros(rows * dim));
      b.add_rmsnorm(x, put(b, in[1]), put(b, in[2]), rows, dim, 1e-6f, y, x_copy, branch_scale);
      return Inputs{get(b, y), get(b, x), get(b, x_copy)};
    };
    cases.push_back(std::move(c));
  }
  return cases;
}

// Queries of `heads` heads and keys of `kv_heads`, as one input and one output: [q | k].
OpCase rope_case(int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim, float base, float scaling,
                 float q_scale) {
  OpCase c;
  c.name = "rope_" + std::to_string(tokens) + "x" + std::to_string(heads) + "q" + std::to_string(kv_heads) + "kx" +
           std::to_string(head_dim) + (scaling != 1.f ? "_scaled" : "");
  const int64_t nq = tokens * heads * head_dim, nk = tokens * kv_heads * head_dim;
  c.make_inputs = [=] { return Inputs{random_vector(size_t(nq + nk), 11)}; };
  auto positions = [tokens] {
    std::vector<int64_t> p(static_cast<size_t>(tokens));
    for (int64_t t = 0; t < tokens; ++t) p[size_t(t)] = 3 * t + 1;
    return p;
  };
  auto split = [=](Backend& b, const Values& x) {  // [q | k] as two arrays
    return std::pair{put(b, Values(x.begin(), x.begin() + nq)), put(b, Values(x.begin() + nq, x.end()))};
  };
  auto join = [](Backend& b, const FloatBuffer& q, const FloatBuffer& k) {
    Values out = get(b, q), tail = get(b, k);
    out.insert(out.end(), tail.begin(), tail.end());
    return out;
  };
  c.forward = [=](Backend& b, Inputs& in) {
    auto [q, k] = split(b, in[0]);
    b.rope(q, heads, k, kv_heads, tokens, head_dim, put(b, positions()), base, scaling, q_scale);
    return Inputs{join(b, q, k)};
  };
  c.backward = [=](Backend& b, Inputs&, const Values& dy) {
    auto [dq, dk] = split(b, dy);
    b.rope_backward(dq, heads, dk, kv_heads, tokens, head_dim, put(b, positions()), base, scaling, q_scale);
    return Inputs{join(b, dq, dk)};
  };
  c.differentiable = {0};
  c.tolerance = 2e-5;  // cos/sin of fp32 angles against double ones
  return c;
}

// Inputs of `scale`: the bf16 cases take larger ones, so that rounding q and k moves the scores
// visibly (attention_bf16_cases_tell_rounding_apart).
OpCase attention_case(const std::string& name, AttentionShape s, std::vector<int64_t> padding, bool backward,
                      float scale = 1.f) {
  OpCase c;
  c.name = "attention_" + name;
  const int64_t queries = s.batch * s.query_len * s.heads * s.head_dim,
                keys = s.batch * s.capacity * s.kv_heads * s.head_dim;
  auto valid = [s, padding] {
    std::vector<uint8_t> v(size_t(s.batch * s.capacity), 1);
    for (int64_t p : padding) v[size_t(p)] = 0;
    return v;
  };
  c.make_inputs = [=] {
    return Inputs{random_vector(size_t(queries), 12, scale), random_vector(size_t(keys), 13, scale),
                  random_vector(size_t(keys), 14, scale)};
  };
  c.forward = [=](Backend& b, Inputs& in) {
    FloatBuffer out = put(b, zeros(queries));
    b.attention(put(b, in[0]), put(b, in[1]), put(b, in[2]), put(b, valid()), s, out);
    return Inputs{get(b, out)};
  };
  if (backward) {
    c.backward = [=](Backend& b, Inputs& in, const Values& dy) {
      FloatBuffer dq = put(b, zeros(queries)), dk = put(b, zeros(keys)), dv = put(b, zeros(keys));
      b.attention_backward(put(b, in[0]), put(b, in[1]), put(b, in[2]), put(b, valid()), s, put(b, dy), dq, dk, dv);
      return Inputs{get(b, dq), get(b, dk), get(b, dv)};
    };
    c.differentiable = {0, 1, 2};
  }
  c.tolerance = 2e-5;
  return c;
}

OpCase long_attention_case() {
  OpCase c = attention_case("long_cache", {1, 2, 4190, 4200, 2, 1, 8, 1000, 0.f}, {17, 4100}, true);
  c.differentiable = {};  // finite differences over 4200 key slots would take minutes: the small cases do it
  return c;
}

OpCase shared_limit_case(const std::string& name, AttentionShape s, bool backward) {
  OpCase c = attention_case(name, s, {17}, backward);
  c.differentiable = {};  // thousands of key slots: the small cases check against finite differences
  return c;
}

std::vector<int64_t> decode_long_padding() {
  std::vector<int64_t> padding;
  for (int64_t j = 32; j < 48; ++j) padding.push_back(j);
  for (int64_t j = 0; j < 320; ++j) padding.push_back(320 + j);
  return padding;
}

std::vector<OpCase> attention_cases() {
  // AttentionShape{batch, query_len, start, capacity, heads, kv_heads, head_dim, window, soft_cap}
  return {
      // GQA 4→2; row 0's first key is padding, so its query 0 sees nothing (zeros).
      attention_case("gqa_padding", {2, 7, 0, 7, 4, 2, 5, 0, 0.f}, {0, 7 + 4}, true),
      // MQA 4→1, window 2, soft-cap 1.5.
      attention_case("mqa_window_cap", {1, 9, 0, 9, 4, 1, 3, 2, 1.5f}, {3}, true),
      // Plain multi-head, a window of 3 and a cap, odd head_dim.
      attention_case("mha_window3", {2, 6, 0, 6, 3, 3, 7, 3, 30.f}, {6 + 5}, true),
      // Decode: one query at position 5 of a cache of 8 slots, and a prefill continuing at 2.
      attention_case("decode", {2, 1, 5, 8, 4, 2, 8, 0, 0.f}, {3}, false),
      attention_case("prefill_at_2", {1, 4, 2, 9, 2, 1, 16, 3, 0.f}, {}, false),
      // Decode over more key slots than a GPU's split of them (16): row 0 with a whole split padded
      // (slots 32–47: a split without one allowed key), row 1 with no real key at all (zeros).
      attention_case("decode_long", {2, 1, 300, 320, 4, 2, 8, 0, 0.f}, decode_long_padding(), false),
      // A window and a cap: the splits start at the window (slot 131), whose first split is partial.
      attention_case("decode_window_cap", {1, 1, 200, 256, 4, 1, 16, 70, 20.f}, {150}, false),
      // A short prefill: its queries' positions end in different splits.
      attention_case("prefill_few_queries", {1, 3, 40, 48, 2, 1, 8, 0, 0.f}, {20}, false),
      // A long cache: a GPU's attention kernels then need more than the default 48 KB of shared
      // memory per block (three arrays of 4200 slots in backward) and take their widest blocks.
      long_attention_case(),
      // Caches whose dynamic shared memory is exactly the 48 KB default in a GPU's kernels (backward:
      // 3 × 4096 slots; decode: 2 × 5120 slots and 128 slot groups' partial sums at head_dim 8), which
      // leaves no room for the kernels' own __shared__ arrays without the opt-in. The emulator has no
      // such arrays' limit: the GPU run of the registry is the check.
      shared_limit_case("cache_4096", {1, 2, 4094, 4096, 2, 1, 8, 0, 0.f}, true),
      shared_limit_case("decode_5120", {1, 1, 5119, 5120, 2, 1, 8, 0, 0.f}, false),
  };
}

// The same under the bf16 policies' precision (AttentionShape::bf16_products): bf16 inputs to both
// products, fp32 sums. Backends round the same values but sum in other orders, so a probability or
// score gradient near a bf16 rounding boundary may round the other way (4e-5 at most measured on the
// CPU paths and the emulated GPU's two routes), while ignoring the rounding is off by more than 2e-2
// (BackendChecks.Bf16AttentionCasesTellRoundingApart). Rounding is piecewise constant: no finite
// differences.
struct Bf16AttentionCase {
  std::string name;
  AttentionShape shape;
  std::vector<int64_t> padding;
  bool backward;
  float scale;  // of the inputs: large enough that rounding q and k moves the scores visibly

  OpCase make(bool bf16_products) const {
    AttentionShape s = shape;
    s.bf16_products = bf16_products;
    OpCase c = attention_case(name, s, padding, backward, scale);
    c.differentiable = {};
    c.tolerance = 1e-3;
    return c;
  }
};
const std::vector<Bf16AttentionCase>& bf16_attention_cases() {
  static const std::vector<Bf16AttentionCase> cases = {
      {"bf16_gqa_padding", {2, 7, 0, 7, 4, 2, 5, 0, 0.f}, {0, 7 + 4}, true, 3.f},
      {"bf16_mqa_window_cap", {1, 9, 0, 9, 4, 1, 16, 2, 10.f}, {3}, true, 3.f},
      {"bf16_long_rows", {2, 40, 0, 40, 2, 1, 32, 0, 0.f}, {45}, true, 2.f},
      {"bf16_decode", {2, 1, 5, 8, 4, 2, 8, 0, 0.f}, {3}, false, 3.f},
      {"bf16_decode_long", {2, 1, 100, 128, 4, 2, 32, 0, 0.f}, {7, 128 + 60}, false, 3.f},
  };
  return cases;
}
std::vector<OpCase> attention_bf16_cases() {
  std::vector<OpCase> cases;
  for (const Bf16AttentionCase& c : bf16_attention_cases()) cases.push_back(c.make(true));
  return cases;
}

std::vector<OpCase> activation_cases() {
  std::vector<OpCase> cases;
  // The first case runs in place (out = gate, as inference does); the last starts one value into its
  // arrays: not 16-byte aligned, which GPU kernels reading four values at a time must handle value by
  // value.
  for (std::pair<int64_t, int64_t> length_offset : {std::pair<int64_t, int64_t>{37, 0}, {5000, 0}, {5001, 1}}) {
    // Plain variables, not a structured binding: clang 14 cannot capture bindings in lambdas.
    const int64_t n = length_offset.first, offset = length_offset.second;
    OpCase g;
    g.name = "geglu_" + std::to_string(n) + (offset ? "_unaligned" : "");
    g.make_inputs = [n] { return Inputs{random_vector(size_t(n), 15, 2.f), random_vector(size_t(n), 16)}; };
    const auto view = [offset, n](auto& buffer) { return buffer.span().part(size_t(offset), size_t(n - offset)); };
    g.forward = [n, offset, view](Backend& b, Inputs& in) {
      FloatBuffer gate = put(b, in[0]), up = put(b, in[1]), out = put(b, zeros(n));
      FloatBuffer& result = n == 37 ? gate : out;
      b.geglu(view(gate), view(up), n - offset, view(result));
      return Inputs{get(b, result)};
    };
    g.backward = [n, offset, view](Backend& b, Inputs& in, const Values& dy) {
      FloatBuffer dgate = put(b, zeros(n)), dup = put(b, zeros(n)), gate = put(b, in[0]), up = put(b, in[1]),
                  dout = put(b, dy);
      b.geglu_backward(view(gate), view(up), view(dout), n - offset, view(dgate), view(dup));
      return Inputs{get(b, dgate), get(b, dup)};
    };
    if (n < 100) g.differentiable = {0, 1};
    cases.push_back(std::move(g));
  }
  // GeGLU's bf16 forms: out, gate and up narrowed (forward); the gradients from bf16 gate and up,
  // narrowed (backward). Lengths and offsets as above (5001 − 1 unaligned for the four-value paths).
  // Up to one bf16 step apart (2⁻⁷ relative) where a backend's fp32 value and the reference's lie on
  // the two sides of a rounding boundary.
  for (std::pair<int64_t, int64_t> length_offset : {std::pair<int64_t, int64_t>{37, 0}, {5000, 0}, {5001, 1}}) {
    const int64_t n = length_offset.first, offset = length_offset.second, m = n - offset;
    const auto view = [offset, m](auto& buffer) { return buffer.span().part(size_t(offset), size_t(m)); };
    OpCase g;
    g.name = "geglu_to_bf16_" + std::to_string(n) + (offset ? "_unaligned" : "");
    g.make_inputs = [n] { return Inputs{random_vector(size_t(n), 15, 2.f), random_vector(size_t(n), 16)}; };
    g.forward = [n, view](Backend& b, Inputs& in) {
      const FloatBuffer gate = put(b, in[0]), up = put(b, in[1]);
      Buffer<uint16_t> out, gate_copy, up_copy;
      for (Buffer<uint16_t>* x : {&out, &gate_copy, &up_copy}) b.resize(*x, size_t(n));
      b.geglu_to_bf16(view(gate), view(up), view(out).size, view(out), view(gate_copy), view(up_copy));
      return Inputs{get_bf16(b, view(out)), get_bf16(b, view(gate_copy)), get_bf16(b, view(up_copy))};
    };
    g.tolerance = 8e-3;
    cases.push_back(std::move(g));
    OpCase d;
    d.name = "geglu_backward_bf16_" + std::to_string(n) + (offset ? "_unaligned" : "");
    d.make_inputs = [n] {
      return Inputs{random_vector(size_t(n), 15, 2.f), random_vector(size_t(n), 16), random_vector(size_t(n), 17)};
    };
    d.forward = [n, view](Backend& b, Inputs& in) {
      const Buffer<uint16_t> gate = put_bf16(b, in[0]), up = put_bf16(b, in[1]);
      const FloatBuffer dout = put(b, in[2]);
      Buffer<uint16_t> dgate, dup;
      for (Buffer<uint16_t>* x : {&dgate, &dup}) b.resize(*x, size_t(n));
      b.geglu_backward_bf16(view(gate), view(up), view(dout), view(dout).size, view(dgate), view(dup));
      return Inputs{get_bf16(b, view(dgate)), get_bf16(b, view(dup))};
    };
    d.tolerance = 8e-3;
    cases.push_back(std::move(d));
  }
  for (float cap : {1.5f, 30.f}) {
    OpCase c;
    c.name = "soft_cap_" + std::to_string(int(cap * 10));
    c.make_inputs = [] { return Inputs{random_vector(41, 17, 2.f)}; };
    c.forward = [cap](Backend& b, Inputs& in) {
      FloatBuffer y = put(b, in[0]);
      b.soft_cap(y, int64_t(y.size()), cap);
      return Inputs{get(b, y)};
    };
    c.backward = [cap](Backend& b, Inputs& in, const Values& dy) {
      FloatBuffer y = put(b, in[0]), dx = put(b, dy);
      b.soft_cap(y, int64_t(y.size()), cap);
      b.soft_cap_backward(y, dx, int64_t(dx.size()), cap);
      return Inputs{get(b, dx)};
    };
    c.differentiable = {0};
    cases.push_back(std::move(c));
  }
  return cases;
}

// The loss steps over a chunk of logits: outputs are the statistics, the loss sums and the
// gradient; FD of the weighted loss in the logits checks the backward (the loss is Σ w·CE, so dy
// of the single output "loss" is its scale).
std::vector<OpCase> cross_entropy_cases() {
  std::vector<OpCase> cases;
  // 4 rows of 23, and 3 wide rows (more columns than a CUDA block's threads load in one batch),
  // each with its targets and weights.
  for (const bool wide : {false, true})
  for (float cap : {0.f, 5.f}) {
    const int64_t n = wide ? 3 : 4, cols = wide ? 4099 : 23;
    const std::vector<int32_t> targets = wide ? std::vector<int32_t>{5, 4098, 2100} : std::vector<int32_t>{1, 22, 7, 11};
    const Values weights = wide ? Values{1.f, 0.5f, 2.f} : Values{1.f, 0.5f, 2.f, 1.f};
    auto loss = [=](Backend& b, const FloatBuffer& z, SoftmaxRows& stats) {
      const Buffer<int32_t> t = put(b, targets);
      b.softmax_row_max(z, n, cols, 0, stats);
      b.softmax_row_sums(z, n, cols, 0, t, stats);
      Buffer<double> d_sums = put(b, std::vector<double>{0.25, 0, 0});  // the sums add to what is there
      b.softmax_cross_entropy_sums(stats, t, put(b, weights), n, d_sums);
      std::vector<double> sums(3);
      b.download(d_sums, sums);
      return Values{float(sums[0] - 0.25), float(sums[1]), float(sums[2])};  // Σ w·CE, Σ w·correct, Σ w
    };
    // The combining step of a split vocabulary: two parts' maxima, the later one larger in some rows
    // and tied in one (the first part wins a tie).
    auto combined = [=](Backend& b, SoftmaxRows& stats) {
      if (wide) return Values{};
      const Values gathered = {3, 1, 2, 5, /*argmax*/ 0, 1, 2, 3, /*part 2*/ 4, 1, 1, 9, /*argmax*/ 10, 11, 12, 13};
      b.softmax_combine_max(put(b, gathered), 2, n, stats);
      return get(b, stats.max_and_argmax);
    };
    OpCase c;
    c.name = std::string("softmax_cross_entropy") + (wide ? "_wide" : "") + (cap > 0 ? "_capped" : "");
    c.make_inputs = [=] {
      Values z = random_vector(size_t(n * cols), 18, 3.f);
      if (cap > 0)
        for (float& v : z) v = cap * std::tanh(v / cap);  // capped logits, as the model hands them over
      // Tied maxima (the first column wins): in two threads' columns, in one batch of a thread, in
      // two batches of a thread.
      if (wide)
        for (const auto& [row, first, second] : {std::tuple{0, 100, 3000}, {1, 2100, 2612}, {2, 52, 2100}}) {
          const float top = *std::max_element(z.begin() + row * cols, z.begin() + (row + 1) * cols);
          z[size_t(row * cols + first)] = z[size_t(row * cols + second)] = cap > 0 ? (top + cap) / 2 : top + 1;
        }
      return Inputs{z};
    };
    c.forward = [=](Backend& b, Inputs& in) {
      SoftmaxRows stats;
      const Values sums = loss(b, put(b, in[0]), stats);
      const Values max_and_argmax = get(b, stats.max_and_argmax);
      // The loss first (what finite differences look at); accuracy and weight are steps, not smooth.
      return Inputs{{sums[0]}, {sums[1], sums[2]}, max_and_argmax, combined(b, stats)};
    };
    c.backward = [=](Backend& b, Inputs& in, const Values& dy) {
      SoftmaxRows stats;
      FloatBuffer z = put(b, in[0]);
      loss(b, z, stats);
      b.softmax_cross_entropy_backward(z, n, cols, 0, put(b, targets), put(b, weights), dy[0], stats, cap);
      Values dz = get(b, z);
      if (cap > 0)  // the gradient before the cap, turned into the one of the capped logits for FD
        for (size_t i = 0; i < dz.size(); ++i) dz[i] /= 1.f - (in[0][i] / cap) * (in[0][i] / cap);
      return Inputs{dz};
    };
    if (!wide) c.differentiable = {0};  // finite differences on the small ones
    cases.push_back(std::move(c));
  }
  return cases;
}

std::vector<OpCase> data_movement_cases() {
  std::vector<OpCase> cases;
  {
    // Greedy decoding's choice: 5 rows of 37 logits (a tie in row 1: the first index wins), rows 0
    // and 3 inside their prompts (their tokens kept), the others take their argmax.
    OpCase c;
    c.name = "greedy_tokens";
    c.make_inputs = [] {
      Values z = random_vector(5 * 37, 23, 3.f);
      z[37 + 30] = z[37 + 4] = 9.f;
      return Inputs{z};
    };
    c.forward = [](Backend& b, Inputs& in) {
      SoftmaxRows stats;
      b.softmax_row_max(put(b, in[0]), 5, 37, 0, stats);
      Buffer<int32_t> ids = put(b, std::vector<int32_t>{101, 102, 103, 104, 105});
      b.greedy_tokens(stats, 5, put(b, std::vector<uint8_t>{1, 0, 0, 1, 0}), ids);
      std::vector<int32_t> host(5);
      b.download(ids, host);
      return Inputs{Values(host.begin(), host.end())};
    };
    cases.push_back(std::move(c));
  }
  {
    // Decode's rows: few and long (a GPU cuts each into parts of 4096 or more columns). Row 0's
    // maximum is tied in two parts (the earlier wins), row 1's is its last column, row 2's first.
    OpCase c;
    c.name = "greedy_tokens_long_rows";
    constexpr int64_t n = 3, cols = 50000;
    c.make_inputs = [] {
      Values z = random_vector(size_t(n * cols), 24, 3.f);
      z[100] = z[30000] = z[30001] = 99.f;  // above every random logit
      z[cols + cols - 1] = 99.f;
      z[2 * cols] = z[2 * cols + 49999] = 99.f;
      return Inputs{z};
    };
    c.forward = [](Backend& b, Inputs& in) {
      SoftmaxRows stats;
      b.softmax_row_max(put(b, in[0]), n, cols, 7, stats);
      Buffer<int32_t> ids = put(b, std::vector<int32_t>{0, 0, 0});
      b.greedy_tokens(stats, n, put(b, std::vector<uint8_t>{0, 0, 0}), ids);
      std::vector<int32_t> host(3);
      b.download(ids, host);
      return Inputs{Values(host.begin(), host.end()), get(b, stats.max_and_argmax)};
    };
    cases.push_back(std::move(c));
  }
  {
    // A vocabulary part: rows 3 … 10 of a 14-row table, in fp32, bf16 and int8, scaled by 2.75 (Gemma's √D).
    for (DType dtype : {DType::F32, DType::BF16, DType::I8}) {
      OpCase c;
      c.name = std::string("embedding_lookup_") + dtype_name(dtype);
      const std::vector<int32_t> ids = {0, 3, 10, 7, 13, 3, 5};
      const int64_t M = 7, dim = 9, first = 3, rows = 8;
      c.make_inputs = [=] { return Inputs{random_vector(size_t(rows * dim), 19)}; };
      c.forward = [=](Backend& b, Inputs& in) {
        FloatBuffer out = put(b, zeros(M * dim));
        b.embedding_lookup(b.upload(matrix(rows, dim, in[0], dtype)), first, put(b, ids), M, out, 2.75f);
        return Inputs{get(b, out)};
      };
      if (dtype == DType::F32) {
        c.backward = [=](Backend& b, Inputs&, const Values& dy) {
          FloatBuffer grad = put(b, zeros(rows * dim));
          b.embedding_lookup_backward(put(b, dy), put(b, ids), M, dim, first, rows, 2.75f, grad);
          return Inputs{get(b, grad)};
        };
        c.differentiable = {0};
      }
      cases.push_back(std::move(c));
    }
  }
  // RoPE writing a step's keys and values into a KV cache: B = 2 rows of T = 3 tokens, 3 query and 2
  // key heads of 4, into 7 positions from 4 (the other positions keep their values).
  OpCase cache;
  cache.name = "rope_into_cache";
  cache.make_inputs = [] {
    return Inputs{random_vector(6 * 3 * 4, 20), random_vector(6 * 2 * 4, 24), random_vector(6 * 2 * 4, 26),
                  random_vector(2 * 7 * 8, 21), random_vector(2 * 7 * 8, 25)};
  };
  cache.forward = [](Backend& b, Inputs& in) {
    FloatBuffer q = put(b, in[0]), k = put(b, in[1]), values = put(b, in[2]), key_cache = put(b, in[3]),
                value_cache = put(b, in[4]);
    const CacheWrite into{values, 2, 7, 4, key_cache, value_cache};
    b.rope(q, 3, k, 2, 6, 4, put(b, std::vector<int64_t>{4, 5, 6, 4, 5, 6}), 10000.f, 1.f, 0.5f, &into);
    return Inputs{get(b, q), get(b, k), get(b, key_cache), get(b, value_cache)};
  };
  cache.tolerance = 2e-5;  // as rope's
  cases.push_back(std::move(cache));

  // q, k and v ending in RoPE (linear_rope): few rows (a GPU's one-launch kernel) and more, 4 query
  // and 2 key heads of 8, bf16 q and k weights beside fp32 (odd M) or bf16 v; with a cache write for
  // M = 3 (3 rows of 1 token: decode), 8 (2 of 4) and 12 (2 of 6), none for M = 1.
  for (int64_t M : {1, 3, 8, 12})
    for (MatmulPrecision precision : {MatmulPrecision::F32, MatmulPrecision::BF16}) {
      OpCase c;
      c.name = std::string("linear_rope_") + (precision == MatmulPrecision::BF16 ? "bf16inputs_" : "") +
               std::to_string(M);
      const int64_t cols = 40, N = 4, K = 2, H = 8, batch = M == 3 ? 3 : 2, capacity = 9, start = 2;
      const bool cached = M > 1;
      c.make_inputs = [=] {
        return Inputs{random_vector(size_t(M * cols), 30), random_vector(size_t(N * H * cols), 31, 0.3f),
                      random_vector(size_t(K * H * cols), 32, 0.3f), random_vector(size_t(K * H * cols), 33, 0.3f),
                      random_vector(size_t(batch * capacity * K * H), 34),
                      random_vector(size_t(batch * capacity * K * H), 35)};
      };
      c.forward = [=](Backend& b, Inputs& in) {
        const WeightMatrix W_q = b.upload(matrix(N * H, cols, in[1], DType::BF16)),
                           W_k = b.upload(matrix(K * H, cols, in[2], DType::BF16)),
                           W_v = b.upload(matrix(K * H, cols, in[3], M % 2 ? DType::F32 : DType::BF16));
        FloatBuffer q = put(b, zeros(M * N * H)), k = put(b, zeros(M * K * H)), v = put(b, zeros(M * K * H)),
                    key_cache = put(b, in[4]), value_cache = put(b, in[5]);
        std::vector<int64_t> positions(static_cast<size_t>(M));
        for (int64_t m = 0; m < M; ++m) positions[size_t(m)] = start + m % (M / (cached ? batch : 1)) + 7 * (M == 1);
        const Buffer<int64_t> device_positions = put(b, positions);
        const CacheWrite into{v, batch, capacity, start, key_cache, value_cache};
        b.linear_rope(put(b, in[0]), M, W_q, W_k, W_v, q, k, v,
                      {N, K, H, device_positions, 10000.f, 2.f, 0.35f, cached ? &into : nullptr}, precision);
        return Inputs{get(b, q), get(b, k), get(b, v), get(b, key_cache), get(b, value_cache)};
      };
      c.tolerance = precision == MatmulPrecision::BF16 ? 1e-4 : 2e-5;  // 2e-5: as rope's
      cases.push_back(std::move(c));
    }

  OpCase rows;
  rows.name = "gather_scatter_interleave";
  rows.make_inputs = [] { return Inputs{random_vector(6 * 4, 22), random_vector(3 * 5 * 2, 23)}; };
  rows.forward = [](Backend& b, Inputs& in) {
    const Buffer<int64_t> which = put(b, std::vector<int64_t>{5, 0, 3});
    FloatBuffer gathered = put(b, zeros(3 * 4)), scattered = put(b, zeros(6 * 4)), interleaved = put(b, zeros(30));
    b.gather_rows(put(b, in[0]), which, 4, gathered);
    b.scatter_rows(gathered, which, 4, scattered);
    b.interleave_column_blocks(put(b, in[1]), 3, 5, 2, interleaved);
    return Inputs{get(b, gathered), get(b, scattered), get(b, interleaved)};
  };
  cases.push_back(std::move(rows));

  OpCase elementwise;
  elementwise.name = "copy_zero_add_scale_bf16_row_max";
  elementwise.make_inputs = [] { return Inputs{random_vector(70001, 24, 3.f), random_vector(70001, 25)}; };
  elementwise.forward = [](Backend& b, Inputs& in) {
    const int64_t n = int64_t(in[0].size());
    const FloatBuffer x = put(b, in[0]);
    FloatBuffer copied = put(b, zeros(n)), row_max = put(b, zeros(7)), widened = put(b, zeros(n)), zeroed = put(b, in[1]);
    Buffer<uint16_t> narrow;
    b.resize(narrow, size_t(n));
    b.copy(x, n, copied);
    b.zero(zeroed, n - 1);  // all but the last
    b.add_into(copied, zeroed, n);
    b.add_into(copied.span().part(1, size_t(n - 2)), x.span().part(2, size_t(n - 2)), n - 2);  // unaligned views
    b.scale(copied, n, 0.37f);
    b.narrow_to_bf16(copied, n, narrow);
    b.widen_bf16(narrow, n, widened);
    b.row_abs_max(x, 7, 10000, row_max);
    return Inputs{get(b, copied), get(b, widened), get(b, row_max)};
  };
  elementwise.tolerance = 0;  // exact on every backend
  cases.push_back(std::move(elementwise));

  // Many arrays zeroed at once (a step's gradients): every other one of 140 parts of one array, of
  // sizes 0 … 4999 — 70 arrays, more than a GPU launch takes; the parts between keep their values.
  OpCase zero_many;
  zero_many.name = "zero_many";
  const auto part_sizes = [] {
    std::vector<size_t> sizes;
    for (size_t i = 0; i < 140; ++i) sizes.push_back(i * 3637 % 5000);
    return sizes;
  };
  zero_many.make_inputs = [part_sizes] {
    const std::vector<size_t> sizes = part_sizes();
    return Inputs{random_vector(std::accumulate(sizes.begin(), sizes.end(), size_t(0)), 27)};
  };
  zero_many.forward = [part_sizes](Backend& b, Inputs& in) {
    FloatBuffer x = put(b, in[0]);
    const std::vector<size_t> sizes = part_sizes();
    std::vector<Floats> zeroed;
    size_t offset = 0;
    for (size_t i = 0; i < sizes.size(); offset += sizes[i], ++i)
      if (i % 2 == 0) zeroed.push_back(x.span().part(offset, sizes[i]));
    b.zero(zeroed);
    return Inputs{get(b, x)};
  };
  zero_many.tolerance = 0;
  cases.push_back(std::move(zero_many));

  // Arrays narrowed into consecutive parts of one bf16 array and widened back (as training keeps a
  // block's activations under mixed_bfloat16): 20 parts of different sizes, some empty — more than
  // one launch of the CUDA backend takes (16).
  OpCase parts;
  parts.name = "bf16_parts";
  parts.make_inputs = [] { return Inputs{random_vector(30000, 31, 3.f)}; };
  parts.forward = [](Backend& b, Inputs& in) {
    const FloatBuffer x = put(b, in[0]);
    std::vector<ConstFloats> from;
    std::vector<FloatBuffer> widened(20);
    std::vector<Floats> to;
    size_t offset = 0, total = 0;
    for (size_t p = 0; p < 20; ++p) {
      // The first three are aligned for the CUDA kernels' four-values-a-thread path (sizes and
      // offsets multiples of 4); the rest are not.
      const size_t n = p < 3 ? 1000 + 4 * p : p % 7 == 3 ? 0 : 97 * p * p % 2900 + 1;
      from.push_back(ConstFloats(x).part(offset, n));
      offset += p < 3 ? n + 16 : n + 13;  // the parts need not be adjacent
      total += n;
      widened[p] = put(b, zeros(int64_t(n)));
      to.push_back(widened[p]);
    }
    Buffer<uint16_t> packed;
    b.resize(packed, total);
    b.narrow_to_bf16(from, packed);
    b.widen_bf16(packed, to);
    Inputs out;
    for (const FloatBuffer& w : widened) out.push_back(get(b, w));
    return out;
  };
  parts.tolerance = 0;
  cases.push_back(std::move(parts));

  // Parts long enough that the CUDA backend's threads each take several values of the longest (at most
  // 1024 blocks per array), beside a short one.
  OpCase long_parts;
  long_parts.name = "bf16_parts_long";
  long_parts.make_inputs = [] { return Inputs{random_vector(1500000, 32, 3.f), random_vector(999, 33)}; };
  long_parts.forward = [](Backend& b, Inputs& in) {
    std::vector<FloatBuffer> from, widened;
    std::vector<ConstFloats> from_spans;
    std::vector<Floats> to;
    size_t total = 0;
    for (const Values& part : in) {
      from.push_back(put(b, part));
      widened.push_back(put(b, zeros(int64_t(part.size()))));
      total += part.size();
    }
    for (size_t p = 0; p < in.size(); ++p) from_spans.push_back(from[p]), to.push_back(widened[p]);
    Buffer<uint16_t> packed;
    b.resize(packed, total);
    b.narrow_to_bf16(from_spans, packed);
    b.widen_bf16(packed, to);
    return Inputs{get(b, widened[0]), get(b, widened[1])};
  };
  long_parts.tolerance = 0;
  cases.push_back(std::move(long_parts));

  OpCase adamw;
  adamw.name = "adamw_update";
  adamw.make_inputs = [] {
    return Inputs{random_vector(1001, 26), random_vector(1001, 27), random_vector(1001, 28, 0.1f),
                  random_vector(1001, 29, 0.1f)};
  };
  adamw.forward = [](Backend& b, Inputs& in) {
    for (float& v : in[3]) v = v * v;  // second moments are ≥ 0
    FloatBuffer theta = put(b, in[0]), m = put(b, in[2]), v = put(b, in[3]);
    AdamWStep step{true, 0.01f, 5e-5f, 0.1f, 0.001f, 5e-5f * 0.5f, 1e-7f};
    for (bool decay : {true, false}) {
      step.decay = decay;
      b.adamw_update(theta, put(b, in[1]), m, v, int64_t(in[0].size()), step);
    }
    // Then 30 variables (parts of the same arrays, some empty) in one call, decay on every third —
    // more than one launch of the CUDA backend takes (24).
    const FloatBuffer grad = put(b, in[1]);
    std::vector<AdamWVariable> variables;
    size_t offset = 0;
    for (size_t x = 0; x < 30; ++x) {
      const size_t n = x % 11 == 4 ? 0 : x + 3;
      variables.push_back({Floats(theta).part(offset, n), ConstFloats(grad).part(offset, n), Floats(m).part(offset, n),
                           Floats(v).part(offset, n), int64_t(n), x % 3 == 0});
      offset += n;
    }
    step.decay = true;  // ignored: each variable's own
    b.adamw_update(variables, step);
    return Inputs{get(b, theta), get(b, m), get(b, v)};
  };
  adamw.tolerance = 0;  // Keras' order of roundings, bit for bit on every path
  cases.push_back(std::move(adamw));

  // Gradient clipping and the finiteness check, over more values than one block of the CPU's sum.
  OpCase clipping;
  clipping.name = "clip_sum_of_squares_ratio_clamp_first_not_finite";
  clipping.make_inputs = [] { return Inputs{random_vector(150001, 30, 2.f)}; };
  clipping.forward = [](Backend& b, Inputs& in) {
    const int64_t n = int64_t(in[0].size());
    const FloatBuffer x = put(b, in[0]);
    const double sum = b.sum_of_squares(x, n);
    FloatBuffer ratio = put(b, in[0]), clamped = put(b, in[0]);
    b.scale_by_ratio(ratio, n, 0.7f, float(std::sqrt(sum)));
    b.clamp(clamped, n, 0.5f);
    Values with_nan = in[0];
    with_nan[size_t(n - 3)] = NAN;
    const FloatBuffer not_finite = put(b, with_nan);
    const ConstFloats finite = x, bad = not_finite, empty;
    // More arrays than one launch of the CUDA backend takes (64), the first bad one past them.
    std::vector<ConstFloats> many;
    for (int i = 0; i < 70; ++i) many.push_back(i == 66 || i == 68 ? bad : i % 5 == 0 ? empty : finite.part(size_t(i), 1000));
    const Values flags = {float(b.first_not_finite({finite})), float(b.first_not_finite({finite, empty, bad, finite})),
                          float(b.first_not_finite({bad.part(0, size_t(n - 3)), finite})),
                          float(b.first_not_finite({bad, bad})), float(b.first_not_finite({})),
                          float(b.first_not_finite(many))};
    return Inputs{Values{float(sum)}, get(b, ratio), get(b, clamped), flags};
  };
  clipping.tolerance = 1e-7;  // the sum's order differs (blocks); the rest is exact
  cases.push_back(std::move(clipping));
  return cases;
}

const std::vector<OpCase>& registry() {
  static const std::vector<OpCase> cases = [] {
    std::vector<OpCase> all;
    auto add = [&all](std::vector<OpCase> more) {
      for (OpCase& c : more) all.push_back(std::move(c));
    };
    add(linear_cases());
    // Sums long enough that the CUDA backend cuts them into chunks: x·A over 601 columns (two chunks,
    // the last shorter), ∂A over 530 rows, ∂B over 530 · 3 rows; fp32 sums of 1590 terms against the
    // reference's double ones.
    OpCase long_sums =
        low_rank_case("low_rank_long_sums_accumulating",
                      LowRankViews{.M = 530, .in = 601, .groups = 3, .per_group = 10, .rank = 2, .keras_layout = true},
                      true);
    long_sums.tolerance = 4e-4;
    add({low_rank_case("low_rank", LowRankViews{}, false),
         low_rank_case("low_rank_keras_layout_accumulating",
                       LowRankViews{.M = 70, .in = 40, .groups = 4, .per_group = 24, .rank = 4, .keras_layout = true},
                       true),
         std::move(long_sums)});
    add(norm_cases());
    add({rope_case(5, 3, 1, 8, 10000.f, 1.f, 0.35f), rope_case(4, 2, 2, 6, 1e6f, 8.f, 0.125f)});
    add(attention_cases());
    add(attention_bf16_cases());
    add(activation_cases());
    add(cross_entropy_cases());
    add(data_movement_cases());
    return all;
  }();
  return cases;
}

double relative_error(const Values& a, const Values& b) {
  EXPECT_EQ(a.size(), b.size());
  return meshtune::testing::max_relative_error(a, b);
}

void expect_close(const Inputs& got, const Inputs& want, double tolerance, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = relative_error(got[i], want[i]);
    EXPECT_LE(err, tolerance) << what << " output " << i;
  }
}

std::vector<std::string> case_names() {
  std::vector<std::string> names;
  for (const OpCase& c : registry()) names.push_back(c.name);
  return names;
}

const OpCase& find_case(const std::string& name) {
  for (const OpCase& c : registry())
    if (c.name == name) return c;
  throw std::runtime_error("no op case " + name);
}

// Runs case `name` on `backend` and on the reference and holds them to the case's tolerance.
void expect_matches_reference(Backend& backend, const std::string& name) {
  const OpCase& c = find_case(name);
  ReferenceBackend reference;
  Inputs in_ref = c.make_inputs(), in_dev = c.make_inputs();
  const Inputs want = c.forward(reference, in_ref), got = c.forward(backend, in_dev);
  expect_close(got, want, c.tolerance, backend.name() + " " + name + " forward");
  if (!c.backward) return;
  const Values dy = random_vector(want[0].size(), 99);
  Inputs b_ref = c.make_inputs(), b_dev = c.make_inputs();
  expect_close(c.backward(backend, b_dev, dy), c.backward(reference, b_ref, dy), c.tolerance,
               backend.name() + " " + name + " backward");
}

// ---- every op on every CPU path against the reference ----

class BackendOps : public ::testing::TestWithParam<std::tuple<std::string, CpuPath>> {};

TEST_P(BackendOps, CpuMatchesReference) {
  const auto& [name, path] = GetParam();
  if (!cpu_supports(path)) GTEST_SKIP() << "this CPU has no " << cpu_path_name(path) << " path";
  expect_matches_reference(*meshtune::testing::cpu_backend_on(path), name);
}

std::string param_name(const ::testing::TestParamInfo<std::tuple<std::string, CpuPath>>& info) {
  return std::get<0>(info.param) + "_" + cpu_path_name(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Registry, BackendOps,
                         ::testing::Combine(::testing::ValuesIn(case_names()), meshtune::testing::kEveryCpuPath),
                         param_name);

// ---- each matrix product's routes forced (backend/cpu/routes.h): both must match the reference ----

class ForcedRoutes : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(ForcedRoutes, EachRouteMatchesReference) {
  const auto& [name, onednn] = GetParam();
  CpuBackendOptions options;
  for (int p = 0; p < kProductKinds; ++p) options.onednn[size_t(p)] = onednn;
  CpuBackend backend(options);
  if (onednn && !backend.path().uses_onednn(Product::F32Linear)) GTEST_SKIP() << "built without oneDNN";
  expect_matches_reference(backend, name);
}

std::vector<std::string> product_case_names() {
  std::vector<std::string> names;
  for (const std::string& name : case_names())
    if (name.rfind("linear_", 0) == 0) names.push_back(name);
  return names;
}

INSTANTIATE_TEST_SUITE_P(Registry, ForcedRoutes,
                         ::testing::Combine(::testing::ValuesIn(product_case_names()), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<std::string, bool>>& info) {
                           return std::get<0>(info.param) + (std::get<1>(info.param) ? "_onednn" : "_own");
                         });

// ---- on device memory: every case through upload/download only ----

// The reference's loops on memory tagged as a GPU's: a case that handed an op host memory would
// fail its operand check — so the registry runs as it is on a real device backend.
class DeviceMemoryOps : public ::testing::TestWithParam<std::string> {};

TEST_P(DeviceMemoryOps, EveryCaseRunsOnDeviceTaggedMemory) {
  ReferenceBackend device(Device::Cuda);
  expect_matches_reference(device, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Registry, DeviceMemoryOps, ::testing::ValuesIn(case_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

#ifdef MESHTUNE_GPU_TESTS
// Built again as gpu_test_backend_ops (ctest label gpu): every case on the CUDA backend.
class CudaOps : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaOps, CudaMatchesReference) {
  static const std::unique_ptr<Backend> gpu = make_cuda_backend(0);
  expect_matches_reference(*gpu, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Registry, CudaOps, ::testing::ValuesIn(case_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });
#endif

// ---- every backward of the reference against finite differences ----

class BackendBackward : public ::testing::TestWithParam<std::string> {};

TEST_P(BackendBackward, ReferenceMatchesFiniteDifferences) {
  const OpCase& c = find_case(GetParam());
  if (c.differentiable.empty()) GTEST_SKIP() << c.name << " has no differentiable inputs";
  ReferenceBackend reference;
  Inputs in = c.make_inputs(), scratch = in;
  const Values dy = random_vector(c.forward(reference, scratch).at(0).size(), 99);
  scratch = in;
  const Inputs grads = c.backward(reference, scratch, dy);
  auto loss = [&](const Inputs& at) {
    Inputs copy = at;
    const Values y = c.forward(reference, copy).at(0);
    double L = 0;
    for (size_t i = 0; i < y.size(); ++i) L += double(dy[i]) * y[i];
    return L;
  };
  double worst = 0;
  for (size_t g = 0; g < c.differentiable.size(); ++g) {
    const size_t input = c.differentiable[g];
    ASSERT_LT(g, grads.size());
    for (size_t i = 0; i < in[input].size(); ++i) {
      const float orig = in[input][i], plus = orig + c.fd_step, minus = orig - c.fd_step;
      in[input][i] = plus;
      const double lp = loss(in);
      in[input][i] = minus;
      const double lm = loss(in);
      in[input][i] = orig;
      const double fd = (lp - lm) / (double(plus) - double(minus));
      const double err = std::abs(fd - grads[g][i]) / std::max(1.0, std::abs(double(grads[g][i])));
      worst = std::max(worst, err);
      EXPECT_LE(err, c.fd_tolerance) << c.name << " input " << input << "[" << i << "]: fd " << fd << " analytic "
                                     << grads[g][i];
    }
  }
  std::printf("%s: max relative error against finite differences %.2e\n", c.name.c_str(), worst);
}

std::vector<std::string> backward_case_names() {
  std::vector<std::string> names;
  for (const OpCase& c : registry())
    if (!c.differentiable.empty()) names.push_back(c.name);
  return names;
}

INSTANTIATE_TEST_SUITE_P(Registry, BackendBackward, ::testing::ValuesIn(backward_case_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// The bf16 attention cases' tolerance tells a backend that rounds from one that does not: on the
// reference, rounding moves every output of each case by more than twice the tolerance.
TEST(BackendChecks, Bf16AttentionCasesTellRoundingApart) {
  ReferenceBackend reference;
  for (const Bf16AttentionCase& bf16 : bf16_attention_cases()) {
    const OpCase rounded = bf16.make(true), plain = bf16.make(false);
    Inputs in_rounded = rounded.make_inputs(), in_plain = plain.make_inputs();
    const Inputs a = rounded.forward(reference, in_rounded), b = plain.forward(reference, in_plain);
    EXPECT_GT(relative_error(a[0], b[0]), 2 * rounded.tolerance) << bf16.name << " forward";
    if (!bf16.backward) continue;
    const Values dy = random_vector(a[0].size(), 99);
    const Inputs ga = rounded.backward(reference, in_rounded, dy), gb = plain.backward(reference, in_plain, dy);
    for (size_t i = 0; i < ga.size(); ++i)
      EXPECT_GT(relative_error(ga[i], gb[i]), 2 * rounded.tolerance) << bf16.name << " gradient " << i;
  }
}

// ---- the operand checks every backend shares ----

TEST(BackendChecks, WrongDeviceAndShortOperandsAreErrors) {
  CpuBackend cpu;
  Values x(12, 1.f), scale(4, 0.f), y(12);
  std::vector<float> device_memory(12);
  const Span<float> on_device(device_memory.data(), device_memory.size(), Device::Cuda);
  try {
    cpu.rmsnorm(x, scale, 3, 4, 1e-6f, on_device);
    FAIL() << "an operand in device memory was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rmsnorm's y is in cuda memory"), std::string::npos) << e.what();
  }
  try {
    cpu.rmsnorm(x, scale, 4, 4, 1e-6f, y);
    FAIL() << "a short operand was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rmsnorm's x holds 12 values, 16 needed"), std::string::npos) << e.what();
  }
  WeightMatrix W = WeightMatrix::from_f32(2, 6, Values(12, 1.f));
  W.device = Device::Cuda;
  EXPECT_THROW(cpu.linear(x, 2, W, y, MatmulPrecision::F32), Error);
  EXPECT_THROW(cpu.gather_rows(x, std::vector<int64_t>{0, 3}, 4, y), Error);  // row 3 is outside 12 values
  // y written over x (or the branch) while the row is still being read.
  EXPECT_THROW(cpu.add_rmsnorm(x, y, scale, 3, 4, 1e-6f, x), Error);
  Values y3(12);
  EXPECT_THROW(cpu.add_rmsnorm(x, y, scale, 3, 4, 1e-6f, y3, y3), Error);  // x_copy over y
  EXPECT_THROW(cpu.add_rmsnorm(x, y, scale, 3, 4, 1e-6f, y3, {}, Values(3)), Error);  // branch scale of 3, not 4
  // Adding into dx while reading dy from the same memory would add a half-overwritten gradient.
  EXPECT_THROW(cpu.rmsnorm_backward(x, scale, 3, 4, 1e-6f, y, y, {}, /*accumulate=*/true), Error);
  // RoPE's cache write: inside the cache, whole rows of tokens, caches as long as they say.
  Values q(2 * 2 * 4), k(2 * 4), v(2 * 4), key_cache(2 * 3 * 4), value_cache(2 * 3 * 4);
  const std::vector<int64_t> positions = {2, 2};
  const auto rope_into = [&](const CacheWrite& into) { cpu.rope(q, 2, k, 1, 2, 4, positions, 1e4f, 1.f, 1.f, &into); };
  EXPECT_NO_THROW(rope_into({v, 2, 3, 2, key_cache, value_cache}));
  EXPECT_THROW(rope_into({v, 2, 3, 3, key_cache, value_cache}), Error);  // position 3 of 3
  EXPECT_THROW(rope_into({v, 3, 3, 0, key_cache, value_cache}), Error);  // 2 tokens in 3 rows
  EXPECT_THROW(rope_into({v, 2, 4, 0, key_cache, value_cache}), Error);  // caches of 3 positions, not 4
  // Several weights of one input must all be as wide as it.
  const WeightMatrix narrow = WeightMatrix::from_f32(2, 6, Values(12, 1.f)), wide = WeightMatrix::from_f32(1, 12, x);
  Values y2(2);
  EXPECT_THROW(cpu.linear(x, 2, {{&narrow, y}, {&wide, y2}}, MatmulPrecision::F32), Error);
  EXPECT_THROW(cpu.linear_geglu(x, 1, narrow, wide, y, y, y, MatmulPrecision::F32), Error);  // gate and up unlike
  // A bf16 input's products take no int8 weights (those quantize the fp32 input).
  std::vector<uint16_t> x16(12), dy16(2);
  const WeightMatrix codes = quantize_matrix_int8(WeightMatrix::from_f32(1, 12, x));
  EXPECT_NO_THROW(cpu.linear(Span<const uint16_t>(x16), 1, wide, y));
  EXPECT_THROW(cpu.linear(Span<const uint16_t>(x16), 1, codes, y), Error);
  EXPECT_THROW(cpu.linear_backward_input({{&codes, Span<const uint16_t>(dy16)}}, 1, x, false), Error);
  // linear_rope: matrices of the heads' rows, a cache write of v's values.
  const WeightMatrix heads = WeightMatrix::from_f32(4, 3, Values(12, 1.f));  // 1 head of 4 over 3 columns
  Values rows(8), key_rows(8), value_rows(8);
  const RopeStep step{1, 1, 4, positions, 1e4f, 1.f, 1.f};
  EXPECT_NO_THROW(cpu.linear_rope(x, 2, heads, heads, heads, rows, key_rows, value_rows, step, MatmulPrecision::F32));
  EXPECT_THROW(cpu.linear_rope(x, 2, heads, narrow, heads, rows, key_rows, value_rows, step, MatmulPrecision::F32),
               Error);  // k of 2 rows, not 4
  const CacheWrite elsewhere{v, 2, 3, 2, key_cache, value_cache};
  RopeStep into_cache = step;
  into_cache.cache = &elsewhere;
  EXPECT_THROW(cpu.linear_rope(x, 2, heads, heads, heads, rows, key_rows, value_rows, into_cache,
                               MatmulPrecision::F32), Error);  // the cache's values are not v
}

// The registry holds every backend to the reference; this holds the reference to what greedy
// decoding means: prompt rows keep their token, the others take their argmax, the first on ties.
TEST(BackendChecks, GreedyTokensAreEachRowsFirstArgmaxOutsideThePrompt) {
  ReferenceBackend reference;
  const Values z = {1, 5, 2, /**/ 7, 0, 7, /**/ 3, 1, 4};
  SoftmaxRows stats;
  reference.softmax_row_max(z, 3, 3, 0, stats);
  std::vector<int32_t> ids = {9, 9, 9};
  const std::vector<uint8_t> keep = {0, 0, 1};
  reference.greedy_tokens(stats, 3, keep, ids);
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 0, 9}));
  std::vector<int32_t> four(4);
  EXPECT_THROW(reference.greedy_tokens(stats, 4, std::vector<uint8_t>(4, 0), four), Error);  // statistics of 3 rows
}

TEST(BackendChecks, BuffersCountTheirAllocations) {
  CpuBackend cpu;
  FloatBuffer a;
  cpu.resize(a, 100);
  cpu.resize(a, 50);  // fits: no new allocation
  EXPECT_EQ(cpu.allocations(), 1u);
  EXPECT_EQ(a.device(), Device::Host);
  cpu.resize(a, 200);
  EXPECT_EQ(cpu.allocations(), 2u);
}

}  // namespace

