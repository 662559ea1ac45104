#include "backend/backend.h"

#include "core/error.h"

namespace meshtune {
namespace {

// Operand checks shared by every backend: on its device and long enough (count ≤ 0: not read).
// Written `if (…) fail(…)` rather than check(…) here and below: the message's backend.name() is built
// only on failure (as check's argument it was built three times per operand of every op, and on a
// GPU each build asked the driver for the device's properties: 3,000 calls per decoded token).
template <class E>
void need(const Backend& backend, const Span<E>& s, int64_t count, const char* op, const char* operand) {
  if (count <= 0) return;
  if (s.data == nullptr) fail(backend.name(), " backend: ", op, "'s ", operand, " is missing");
  if (s.device != backend.device()) fail(backend.name(), " backend: ", op, "'s ", operand, " is in ",
        device_name(s.device), " memory, the backend computes in ", device_name(backend.device()), " memory");
  if (s.size < size_t(count)) fail(backend.name(), " backend: ", op, "'s ", operand, " holds ", s.size,
        " values, ", count, " needed");
}

// An optional operand: empty, or checked as above.
template <class E>
E* optional(const Backend& backend, const Span<E>& s, int64_t count, const char* op, const char* operand) {
  if (s.empty()) return nullptr;
  need(backend, s, count, op, operand);
  return s.data;
}

void need_term(const Backend& backend, const LowRankTerm& t, const char* op) {
  if (t.a == nullptr || t.b == nullptr) fail(backend.name(), " backend: ", op, "'s LoRA term has no A or B");
  if (t.device != backend.device()) fail(backend.name(), " backend: ", op, "'s LoRA term is in ", device_name(t.device),
        " memory, the backend computes in ", device_name(backend.device()), " memory");
}

void need_matrix(const Backend& backend, const WeightMatrix& W, const char* op) {
  if (W.data == nullptr || (W.dtype == DType::I8 && W.scales == nullptr)) fail(backend.name(), " backend: ", op,
        "'s weight matrix is missing");
  if (W.device != backend.device()) fail(backend.name(), " backend: ", op, "'s weight matrix is in ",
        device_name(W.device), " memory, the backend computes in ", device_name(backend.device()), " memory");
}

// A bf16 input's product: the weights' dtypes whose BF16-precision products round their input to bf16.
void need_bf16_product(const Backend& b, const WeightMatrix& W, const char* op) {
  need_matrix(b, W, op);
  if (W.dtype == DType::I8) fail(b.name(), " backend: ", op, " of a bf16 input over int8 weights (int8 products "
                                 "quantize the fp32 input)");
}

// The operands of linear_backward_input over several weights of one input (their dys fp32 or bf16):
// each weight as `need_weight` wants it and as wide as the first, each dy and dx long enough.
template <class Gradient, class NeedWeight>
void need_output_gradients(const Backend& b, const std::vector<Gradient>& gradients, int64_t M, Floats dx,
                           const NeedWeight& need_weight) {
  const int64_t cols = gradients[0].W ? gradients[0].W->cols : 0;
  for (const Gradient& g : gradients) {
    if (g.W == nullptr) fail(b.name(), " backend: linear_backward_input's weight matrix is missing");
    need_weight(b, *g.W, "linear_backward_input");
    if (g.W->cols != cols) fail(b.name(), " backend: linear_backward_input of one input over matrices of ", cols,
                                " and ", g.W->cols, " columns");
    need(b, g.dy, M * g.W->rows, "linear_backward_input", "dy");
  }
  need(b, dx, M * cols, "linear_backward_input", "dx");
}

}  // namespace

float* Backend::scratch_floats(size_t n) {
  if (host_scratch_.size() < n) host_scratch_.resize(n);
  return host_scratch_.data();
}

void* Backend::allocate(size_t bytes) {
  ++allocations_;
  return allocate_impl(bytes);
}

void Backend::release(void* p) { release_impl(p); }

template <class E>
static void check_upload(const Backend& backend, Span<const E> host, Span<E> device_values) {
  if (host.device != Device::Host) fail(backend.name(), " backend: upload's source is not host memory");
  need(backend, device_values, int64_t(host.size), "upload", "destination");
}

void Backend::upload(Span<const float> host, Floats device_values) {
  check_upload(*this, host, device_values);
  upload_impl(host.data, host.size * sizeof(float), device_values.data);
}
void Backend::upload(Span<const int32_t> host, Span<int32_t> device_values) {
  check_upload(*this, host, device_values);
  upload_impl(host.data, host.size * sizeof(int32_t), device_values.data);
}
void Backend::upload(Span<const int64_t> host, Span<int64_t> device_values) {
  check_upload(*this, host, device_values);
  upload_impl(host.data, host.size * sizeof(int64_t), device_values.data);
}
void Backend::upload(Span<const uint8_t> host, Span<uint8_t> device_values) {
  check_upload(*this, host, device_values);
  upload_impl(host.data, host.size, device_values.data);
}

void Backend::upload(Span<const double> host, Span<double> device_values) {
  check_upload(*this, host, device_values);
  upload_impl(host.data, host.size * sizeof(double), device_values.data);
}

template <class E>
static void check_download(const Backend& backend, Span<const E> device_values, Span<E> host) {
  if (host.device != Device::Host) fail(backend.name(), " backend: download's destination is not host memory");
  need(backend, device_values, int64_t(host.size), "download", "source");
}

void Backend::download(ConstFloats device_values, Span<float> host) {
  check_download(*this, device_values, host);
  download_impl(device_values.data, host.size * sizeof(float), host.data);
}
void Backend::download(Span<const double> device_values, Span<double> host) {
  check_download(*this, device_values, host);
  download_impl(device_values.data, host.size * sizeof(double), host.data);
}

void Backend::download(Span<const int32_t> device_values, Span<int32_t> host) {
  check_download(*this, device_values, host);
  download_impl(device_values.data, host.size * sizeof(int32_t), host.data);
}

Backend::PendingDownload Backend::start_download(Span<const int32_t> device_values, Span<int32_t> host) {
  check_download(*this, device_values, host);
  return {start_download_impl(device_values.data, host.size * sizeof(int32_t), host.data)};
}
void Backend::finish_download(PendingDownload& pending) {
  if (pending.id != 0) finish_download_impl(pending.id);
  pending.id = 0;
}
uint64_t Backend::start_download_impl(const void* device_values, size_t bytes, void* host) {
  if (bytes > 0) download_impl(device_values, bytes, host);
  return 0;
}
void Backend::finish_download_impl(uint64_t) {}

WeightMatrix Backend::upload(const WeightMatrix& W) {
  if (W.device == device() || W.data == nullptr) return W;
  if (W.device != Device::Host)
    fail(name(), " backend: a weight matrix in ", device_name(W.device), " memory is uploaded");
  struct Stored {
    Buffer<uint8_t> values;
    FloatBuffer scales;  // I8
  };
  auto stored = std::make_shared<Stored>();
  const size_t bytes = size_t(W.rows) * size_t(W.cols) * dtype_size(W.dtype);
  resize(stored->values, bytes);
  upload(Span<const uint8_t>(static_cast<const uint8_t*>(W.data), bytes), stored->values);
  WeightMatrix out = W;
  if (W.dtype == DType::I8) {
    resize(stored->scales, size_t(W.rows));
    upload(Span<const float>(W.scales, size_t(W.rows)), stored->scales);
    out.scales = stored->scales.data();
  }
  out.data = stored->values.data();
  out.owner = stored;
  out.mapped = false;
  out.device = device();
  return out;
}

WeightVector Backend::upload(const WeightVector& v) {
  if (v.device() == device() || v.empty()) return v;
  auto stored = std::make_shared<FloatBuffer>();
  resize(*stored, v.size());
  upload(Span<const float>(v), *stored);
  return WeightVector(std::move(stored));
}

// RoPE's operands other than q and k: the positions of `tokens`, and the cache write inside its cache.
static void need_rope_operands(const Backend& b, int64_t tokens, int64_t k_heads, int64_t head_dim,
                               Span<const int64_t> positions, const CacheWrite* cache, const char* op) {
  need(b, positions, tokens, op, "positions");
  if (!cache) return;
  const int64_t B = cache->batch, width = k_heads * head_dim;
  if (B <= 0 || tokens % B != 0) fail(b.name(), " backend: ", op, "'s cache write of ", tokens, " tokens in ", B, " rows");
  const int64_t T = tokens / B;
  if (cache->start < 0 || cache->start + T > cache->capacity) fail(b.name(), " backend: ", op, "'s cache write at ",
        cache->start, "…", cache->start + T, " past the cache's ", cache->capacity, " positions");
  need(b, cache->values, tokens * width, op, "values");
  need(b, cache->key_cache, B * cache->capacity * width, op, "key_cache");
  need(b, cache->value_cache, B * cache->capacity * width, op, "value_cache");
}

void Backend::linear(ConstFloats x, int64_t M, const WeightMatrix& W, Floats y, MatmulPrecision precision,
                     ConstFloats x_row_max) {
  need_matrix(*this, W, "linear");
  need(*this, x, M * W.cols, "linear", "x");
  need(*this, y, M * W.rows, "linear", "y");
  linear_impl(x.data, M, W, y.data, precision, optional(*this, x_row_max, M, "linear", "x_row_max"));
}

void Backend::linear(ConstFloats x, int64_t M, const std::vector<LinearOutput>& outputs, MatmulPrecision precision) {
  if (outputs.empty()) return;
  const int64_t cols = outputs[0].W ? outputs[0].W->cols : 0;
  for (const LinearOutput& out : outputs) {
    if (out.W == nullptr) fail(name(), " backend: linear's weight matrix is missing");
    need_matrix(*this, *out.W, "linear");
    if (out.W->cols != cols) fail(name(), " backend: linear of one input over matrices of ", cols, " and ",
                                  out.W->cols, " columns");
    need(*this, out.y, M * out.W->rows, "linear", "y");
  }
  need(*this, x, M * cols, "linear", "x");
  linear_shared_input_impl(x.data, M, outputs, precision);
}

void Backend::linear_shared_input_impl(const float* x, int64_t M, const std::vector<LinearOutput>& outputs,
                                       MatmulPrecision precision) {
  for (const LinearOutput& out : outputs) linear_impl(x, M, *out.W, out.y.data, precision, nullptr);
}

void Backend::linear_geglu(ConstFloats x, int64_t M, const WeightMatrix& W_gate, const WeightMatrix& W_up,
                           Floats gate, Floats up, Floats out, MatmulPrecision precision) {
  need_matrix(*this, W_gate, "linear_geglu");
  need_matrix(*this, W_up, "linear_geglu");
  if (W_gate.rows != W_up.rows || W_gate.cols != W_up.cols)
    fail(name(), " backend: linear_geglu over a gate matrix of ", W_gate.rows, "×", W_gate.cols, " and an up matrix of ",
         W_up.rows, "×", W_up.cols, " (they must be alike)");
  const int64_t n = M * W_gate.rows;
  need(*this, x, M * W_gate.cols, "linear_geglu", "x");
  need(*this, gate, n, "linear_geglu", "gate");
  need(*this, up, n, "linear_geglu", "up");
  need(*this, out, n, "linear_geglu", "out");
  linear_geglu_impl(x.data, M, W_gate, W_up, gate.data, up.data, out.data, precision);
}

void Backend::linear_geglu_impl(const float* x, int64_t M, const WeightMatrix& W_gate, const WeightMatrix& W_up,
                                float* gate, float* up, float* out, MatmulPrecision precision) {
  const int64_t n = M * W_gate.rows;
  const std::vector<LinearOutput> products{{&W_gate, Floats(gate, size_t(n), device())},
                                           {&W_up, Floats(up, size_t(n), device())}};
  linear_shared_input_impl(x, M, products, precision);
  geglu_impl(gate, up, n, out);
}

void Backend::linear_rope(ConstFloats x, int64_t M, const WeightMatrix& W_q, const WeightMatrix& W_k,
                          const WeightMatrix& W_v, Floats q, Floats k, Floats v, const RopeStep& rope,
                          MatmulPrecision precision) {
  const int64_t H = rope.head_dim;
  const struct {
    const WeightMatrix& W;
    Floats y;
    int64_t rows;
    const char* name;
  } products[3] = {{W_q, q, rope.q_heads * H, "q"}, {W_k, k, rope.k_heads * H, "k"}, {W_v, v, rope.k_heads * H, "v"}};
  for (const auto& p : products) {
    need_matrix(*this, p.W, "linear_rope");
    if (p.W.rows != p.rows || p.W.cols != W_q.cols)
      fail(name(), " backend: linear_rope's ", p.name, " matrix is ", p.W.rows, "×", p.W.cols, ", not ", p.rows, "×",
           W_q.cols, " (heads of ", H, ", the input's width)");
    need(*this, p.y, M * p.rows, "linear_rope", p.name);
  }
  if (rope.cache && rope.cache->values.data != v.data)
    fail(name(), " backend: linear_rope's cache write must take its values from v");
  need(*this, x, M * W_q.cols, "linear_rope", "x");
  need_rope_operands(*this, M, rope.k_heads, H, rope.positions, rope.cache, "linear_rope");
  linear_rope_impl(x.data, M, W_q, W_k, W_v, q.data, k.data, v.data, rope, precision);
}

void Backend::linear_rope_impl(const float* x, int64_t M, const WeightMatrix& W_q, const WeightMatrix& W_k,
                               const WeightMatrix& W_v, float* q, float* k, float* v, const RopeStep& rope,
                               MatmulPrecision precision) {
  const auto out = [&](float* y, const WeightMatrix& W) { return Floats(y, size_t(M * W.rows), device()); };
  linear_shared_input_impl(x, M, {{&W_q, out(q, W_q)}, {&W_k, out(k, W_k)}, {&W_v, out(v, W_v)}}, precision);
  rope_impl(q, rope.q_heads, k, rope.k_heads, M, rope.head_dim, rope.positions.data, rope.base, rope.scaling,
            rope.q_scale, rope.cache);
}

void Backend::linear_backward_input(ConstFloats dy, int64_t M, const WeightMatrix& W, Floats dx, bool accumulate,
                                    MatmulPrecision precision) {
  need_matrix(*this, W, "linear_backward_input");
  need(*this, dy, M * W.rows, "linear_backward_input", "dy");
  need(*this, dx, M * W.cols, "linear_backward_input", "dx");
  linear_backward_input_impl(dy.data, M, W, dx.data, accumulate, precision);
}

void Backend::linear_backward_input(const std::vector<LinearOutputGradient>& gradients, int64_t M, Floats dx,
                                    bool accumulate, MatmulPrecision precision) {
  if (gradients.empty()) return;
  need_output_gradients(*this, gradients, M, dx, need_matrix);
  linear_backward_input_shared_impl(gradients, M, dx.data, accumulate, precision);
}

void Backend::linear_backward_input_shared_impl(const std::vector<LinearOutputGradient>& gradients, int64_t M,
                                                float* dx, bool accumulate, MatmulPrecision precision) {
  for (size_t i = 0; i < gradients.size(); ++i)
    linear_backward_input_impl(gradients[i].dy.data, M, *gradients[i].W, dx, accumulate || i > 0, precision);
}

void Backend::linear_backward_weight(ConstFloats dy, ConstFloats x, int64_t M, int64_t rows, int64_t cols,
                                     Floats dW) {
  need(*this, dy, M * rows, "linear_backward_weight", "dy");
  need(*this, x, M * cols, "linear_backward_weight", "x");
  need(*this, dW, rows * cols, "linear_backward_weight", "dW");
  linear_backward_weight_impl(dy.data, x.data, M, rows, cols, dW.data);
}

void Backend::linear(Span<const uint16_t> x, int64_t M, const WeightMatrix& W, Floats y) {
  need_bf16_product(*this, W, "linear");
  need(*this, x, M * W.cols, "linear", "x");
  need(*this, y, M * W.rows, "linear", "y");
  if (M > 0) linear_bf16_input_impl(x.data, M, W, y.data);
}

void Backend::linear_backward_input(const std::vector<Bf16OutputGradient>& gradients, int64_t M, Floats dx,
                                    bool accumulate) {
  if (gradients.empty()) return;
  need_output_gradients(*this, gradients, M, dx, need_bf16_product);
  if (M > 0) linear_backward_input_bf16_impl(gradients, M, dx.data, accumulate);
}

void Backend::linear_bf16_input_impl(const uint16_t* x, int64_t M, const WeightMatrix& W, float* y) {
  float* widened = scratch_floats(size_t(M * W.cols));
  widen_bf16_impl(x, M * W.cols, widened);
  linear_impl(widened, M, W, y, MatmulPrecision::BF16, nullptr);
}

void Backend::linear_backward_input_bf16_impl(const std::vector<Bf16OutputGradient>& gradients, int64_t M, float* dx,
                                              bool accumulate) {
  int64_t total = 0;
  for (const Bf16OutputGradient& g : gradients) total += M * g.W->rows;
  float* widened = scratch_floats(size_t(total));
  std::vector<LinearOutputGradient> fp32;
  for (const Bf16OutputGradient& g : gradients) {
    widen_bf16_impl(g.dy.data, M * g.W->rows, widened);
    fp32.push_back({g.W, ConstFloats(widened, size_t(M * g.W->rows), device())});
    widened += M * g.W->rows;
  }
  linear_backward_input_shared_impl(fp32, M, dx, accumulate, MatmulPrecision::BF16);
}

void Backend::low_rank(ConstFloats x, int64_t M, const LowRankTerm& term, Floats y) {
  if (!term.active()) return;
  need_term(*this, term, "low_rank");
  need(*this, x, M * term.in, "low_rank", "x");
  need(*this, y, M * term.out(), "low_rank", "y");
  low_rank_impl(x.data, M, term, y.data);
}

void Backend::low_rank_backward(ConstFloats x, ConstFloats dy, int64_t M, const LowRankTerm& term, Floats dx) {
  if (!term.active()) return;
  need_term(*this, term, "low_rank_backward");
  // x is only read for the gradients of A and B.
  if (term.grad_a || term.grad_b) need(*this, x, M * term.in, "low_rank_backward", "x");
  need(*this, dy, M * term.out(), "low_rank_backward", "dy");
  low_rank_backward_impl(x.data, dy.data, M, term, optional(*this, dx, M * term.in, "low_rank_backward", "dx"));
}

void Backend::row_abs_max(ConstFloats x, int64_t rows, int64_t cols, Floats out) {
  need(*this, x, rows * cols, "row_abs_max", "x");
  need(*this, out, rows, "row_abs_max", "out");
  row_abs_max_impl(x.data, rows, cols, out.data);
}

void Backend::rmsnorm(ConstFloats x, ConstFloats scale, int64_t rows, int64_t dim, float eps, Floats y) {
  need(*this, x, rows * dim, "rmsnorm", "x");
  need(*this, scale, dim, "rmsnorm", "scale");
  need(*this, y, rows * dim, "rmsnorm", "y");
  rmsnorm_impl(x.data, scale.data, rows, dim, eps, y.data);
}

void Backend::add_rmsnorm(Floats x, ConstFloats branch, ConstFloats scale, int64_t rows, int64_t dim, float eps,
                          Floats y, Floats x_copy, ConstFloats branch_scale) {
  need(*this, x, rows * dim, "add_rmsnorm", "x");
  need(*this, branch, rows * dim, "add_rmsnorm", "branch");
  need(*this, scale, dim, "add_rmsnorm", "scale");
  need(*this, y, rows * dim, "add_rmsnorm", "y");
  float* copy = optional(*this, x_copy, rows * dim, "add_rmsnorm", "x_copy");
  const float* branch_norm = optional(*this, branch_scale, dim, "add_rmsnorm", "branch_scale");
  if (rows * dim > 0 && (y.data == x.data || y.data == branch.data))
    fail(name(), " backend: add_rmsnorm writes y apart from x and branch");
  if (rows * dim > 0 && copy && (copy == x.data || copy == branch.data || copy == y.data))
    fail(name(), " backend: add_rmsnorm writes x_copy apart from x, branch and y");
  add_rmsnorm_impl(x.data, branch.data, branch_norm, scale.data, rows, dim, eps, y.data, copy);
}

void Backend::add_rmsnorm_impl(float* x, const float* branch, const float* branch_scale, const float* scale,
                               int64_t rows, int64_t dim, float eps, float* y, float* x_copy) {
  if (branch_scale) {  // y holds the normalized branch until the join's own norm overwrites it
    rmsnorm_impl(branch, branch_scale, rows, dim, eps, y);
    branch = y;
  }
  add_into_impl(x, branch, rows * dim);
  rmsnorm_impl(x, scale, rows, dim, eps, y);
  if (x_copy) copy_impl(x, rows * dim, x_copy);
}

void Backend::rmsnorm_backward(ConstFloats x, ConstFloats scale, int64_t rows, int64_t dim, float eps, ConstFloats dy,
                               Floats dx, Floats dscale, bool accumulate) {
  need(*this, x, rows * dim, "rmsnorm_backward", "x");
  need(*this, scale, dim, "rmsnorm_backward", "scale");
  need(*this, dy, rows * dim, "rmsnorm_backward", "dy");
  need(*this, dx, rows * dim, "rmsnorm_backward", "dx");
  if (accumulate && rows * dim > 0 && dx.data == dy.data)
    fail(name(), " backend: rmsnorm_backward adding into dx needs dx apart from dy");
  rmsnorm_backward_impl(x.data, scale.data, rows, dim, eps, dy.data, dx.data,
                        optional(*this, dscale, dim, "rmsnorm_backward", "dscale"), accumulate);
}

void Backend::rope(Floats q, int64_t q_heads, Floats k, int64_t k_heads, int64_t tokens, int64_t head_dim,
                   Span<const int64_t> positions, float base, float scaling, float q_scale, const CacheWrite* cache) {
  need(*this, q, tokens * q_heads * head_dim, "rope", "q");
  need(*this, k, tokens * k_heads * head_dim, "rope", "k");
  need_rope_operands(*this, tokens, k_heads, head_dim, positions, cache, "rope");
  rope_impl(q.data, q_heads, k.data, k_heads, tokens, head_dim, positions.data, base, scaling, q_scale, cache);
}

void Backend::rope_backward(Floats dq, int64_t q_heads, Floats dk, int64_t k_heads, int64_t tokens, int64_t head_dim,
                            Span<const int64_t> positions, float base, float scaling, float q_scale) {
  need(*this, dq, tokens * q_heads * head_dim, "rope_backward", "dq");
  need(*this, dk, tokens * k_heads * head_dim, "rope_backward", "dk");
  need(*this, positions, tokens, "rope_backward", "positions");
  rope_backward_impl(dq.data, q_heads, dk.data, k_heads, tokens, head_dim, positions.data, base, scaling, q_scale);
}

void Backend::attention(ConstFloats q, ConstFloats k, ConstFloats v, Span<const uint8_t> key_valid,
                        const AttentionShape& s, Floats out) {
  const int64_t queries = s.batch * s.query_len * s.heads * s.head_dim,
                keys = s.batch * s.capacity * s.kv_heads * s.head_dim;
  need(*this, q, queries, "attention", "q");
  need(*this, k, keys, "attention", "k");
  need(*this, v, keys, "attention", "v");
  need(*this, key_valid, s.batch * s.capacity, "attention", "key_valid");
  need(*this, out, queries, "attention", "out");
  attention_impl(q.data, k.data, v.data, key_valid.data, s, out.data);
}

void Backend::attention_backward(ConstFloats q, ConstFloats k, ConstFloats v, Span<const uint8_t> key_valid,
                                 const AttentionShape& s, ConstFloats dout, Floats dq, Floats dk, Floats dv) {
  const int64_t queries = s.batch * s.query_len * s.heads * s.head_dim,
                keys = s.batch * s.capacity * s.kv_heads * s.head_dim;
  need(*this, q, queries, "attention_backward", "q");
  need(*this, k, keys, "attention_backward", "k");
  need(*this, v, keys, "attention_backward", "v");
  need(*this, key_valid, s.batch * s.capacity, "attention_backward", "key_valid");
  need(*this, dout, queries, "attention_backward", "dout");
  need(*this, dq, queries, "attention_backward", "dq");
  need(*this, dk, keys, "attention_backward", "dk");
  need(*this, dv, keys, "attention_backward", "dv");
  attention_backward_impl(q.data, k.data, v.data, key_valid.data, s, dout.data, dq.data, dk.data, dv.data);
}

void Backend::geglu(ConstFloats gate, ConstFloats up, int64_t n, Floats out) {
  need(*this, gate, n, "geglu", "gate");
  need(*this, up, n, "geglu", "up");
  need(*this, out, n, "geglu", "out");
  geglu_impl(gate.data, up.data, n, out.data);
}

void Backend::geglu_backward(ConstFloats gate, ConstFloats up, ConstFloats dout, int64_t n, Floats dgate,
                             Floats dup) {
  need(*this, gate, n, "geglu_backward", "gate");
  need(*this, up, n, "geglu_backward", "up");
  need(*this, dout, n, "geglu_backward", "dout");
  need(*this, dgate, n, "geglu_backward", "dgate");
  need(*this, dup, n, "geglu_backward", "dup");
  geglu_backward_impl(gate.data, up.data, dout.data, n, dgate.data, dup.data);
}

void Backend::geglu_to_bf16(ConstFloats gate, ConstFloats up, int64_t n, Span<uint16_t> out,
                            Span<uint16_t> gate_copy, Span<uint16_t> up_copy) {
  need(*this, gate, n, "geglu_to_bf16", "gate");
  need(*this, up, n, "geglu_to_bf16", "up");
  need(*this, out, n, "geglu_to_bf16", "out");
  need(*this, gate_copy, n, "geglu_to_bf16", "gate_copy");
  need(*this, up_copy, n, "geglu_to_bf16", "up_copy");
  if (n > 0) geglu_to_bf16_impl(gate.data, up.data, n, out.data, gate_copy.data, up_copy.data);
}

void Backend::geglu_backward_bf16(Span<const uint16_t> gate, Span<const uint16_t> up, ConstFloats dout, int64_t n,
                                  Span<uint16_t> dgate, Span<uint16_t> dup) {
  need(*this, gate, n, "geglu_backward_bf16", "gate");
  need(*this, up, n, "geglu_backward_bf16", "up");
  need(*this, dout, n, "geglu_backward_bf16", "dout");
  need(*this, dgate, n, "geglu_backward_bf16", "dgate");
  need(*this, dup, n, "geglu_backward_bf16", "dup");
  if (n > 0) geglu_backward_bf16_impl(gate.data, up.data, dout.data, n, dgate.data, dup.data);
}

void Backend::geglu_to_bf16_impl(const float* gate, const float* up, int64_t n, uint16_t* out, uint16_t* gate_copy,
                                 uint16_t* up_copy) {
  float* activated = scratch_floats(size_t(n));
  geglu_impl(gate, up, n, activated);
  narrow_to_bf16_impl(activated, n, out);
  narrow_to_bf16_impl(gate, n, gate_copy);
  narrow_to_bf16_impl(up, n, up_copy);
}

void Backend::geglu_backward_bf16_impl(const uint16_t* gate, const uint16_t* up, const float* dout, int64_t n,
                                       uint16_t* dgate, uint16_t* dup) {
  float* room = scratch_floats(size_t(4 * n));  // gate, up, then their gradients
  widen_bf16_impl(gate, n, room);
  widen_bf16_impl(up, n, room + n);
  geglu_backward_impl(room, room + n, dout, n, room + 2 * n, room + 3 * n);
  narrow_to_bf16_impl(room + 2 * n, n, dgate);
  narrow_to_bf16_impl(room + 3 * n, n, dup);
}

void Backend::soft_cap(Floats x, int64_t n, float cap) {
  need(*this, x, n, "soft_cap", "x");
  soft_cap_impl(x.data, n, cap);
}

void Backend::soft_cap_backward(ConstFloats y, Floats dy, int64_t n, float cap) {
  need(*this, y, n, "soft_cap_backward", "y");
  need(*this, dy, n, "soft_cap_backward", "dy");
  soft_cap_backward_impl(y.data, dy.data, n, cap);
}

// The statistics' buffers of a chunk of n rows are made by the first two steps; the later steps
// check that they were (an Error naming the step that is missing).
static void need_statistics(const Backend& backend, const SoftmaxRows& stats, int64_t n, bool sums, const char* op) {
  if (stats.max_and_argmax.size() < size_t(2 * n)) fail(backend.name(), " backend: ", op, " before softmax_row_max");
  need(backend, stats.max_and_argmax.span(), 2 * n, op, "row maxima");
  if (!sums) return;
  if (stats.sum_exp_and_target.size() < size_t(2 * n))
    fail(backend.name(), " backend: ", op, " before softmax_row_sums");
  need(backend, stats.sum_exp_and_target.span(), 2 * n, op, "row sums");
}

void Backend::softmax_row_max(ConstFloats z, int64_t n, int64_t cols, int64_t v0, SoftmaxRows& stats) {
  need(*this, z, n * cols, "softmax_row_max", "z");
  resize(stats.max_and_argmax, size_t(2 * n));
  softmax_row_max_impl(z.data, n, cols, v0, stats.max_and_argmax.data());
}

void Backend::greedy_tokens(const SoftmaxRows& row_max, int64_t rows, Span<const uint8_t> keep, Span<int32_t> ids) {
  need_statistics(*this, row_max, rows, false, "greedy_tokens");
  need(*this, keep, rows, "greedy_tokens", "keep");
  need(*this, ids, rows, "greedy_tokens", "ids");
  greedy_tokens_impl(row_max.max_and_argmax.data(), rows, keep.data, ids.data);
}

void Backend::softmax_combine_max(ConstFloats gathered, int parts, int64_t n, SoftmaxRows& stats) {
  need(*this, gathered, 2 * n * parts, "softmax_combine_max", "gathered");
  need_statistics(*this, stats, n, false, "softmax_combine_max");
  softmax_combine_max_impl(gathered.data, parts, n, stats.max_and_argmax.data());
}

void Backend::softmax_row_sums(ConstFloats z, int64_t n, int64_t cols, int64_t v0, Span<const int32_t> targets,
                               SoftmaxRows& stats) {
  need(*this, z, n * cols, "softmax_row_sums", "z");
  need(*this, targets, n, "softmax_row_sums", "targets");
  need_statistics(*this, stats, n, false, "softmax_row_sums");
  resize(stats.sum_exp_and_target, size_t(2 * n));
  softmax_row_sums_impl(z.data, n, cols, v0, targets.data, stats.max_and_argmax.data(),
                        stats.sum_exp_and_target.data());
}

void Backend::softmax_cross_entropy_sums(const SoftmaxRows& stats, Span<const int32_t> targets, ConstFloats weights,
                                         int64_t n, Span<double> sums) {
  need(*this, targets, n, "softmax_cross_entropy_sums", "targets");
  need(*this, weights, n, "softmax_cross_entropy_sums", "weights");
  need(*this, sums, 3, "softmax_cross_entropy_sums", "sums");
  need_statistics(*this, stats, n, true, "softmax_cross_entropy_sums");
  softmax_cross_entropy_sums_impl(stats.max_and_argmax.data(), stats.sum_exp_and_target.data(), targets.data,
                                  weights.data, n, sums.data);
}

void Backend::softmax_cross_entropy_backward(Floats z, int64_t n, int64_t cols, int64_t v0,
                                             Span<const int32_t> targets, ConstFloats weights, double loss_scale,
                                             const SoftmaxRows& stats, float cap) {
  need(*this, z, n * cols, "softmax_cross_entropy_backward", "z");
  need(*this, targets, n, "softmax_cross_entropy_backward", "targets");
  need(*this, weights, n, "softmax_cross_entropy_backward", "weights");
  need_statistics(*this, stats, n, true, "softmax_cross_entropy_backward");
  softmax_cross_entropy_backward_impl(z.data, n, cols, v0, targets.data, weights.data, loss_scale,
                                      stats.max_and_argmax.data(), stats.sum_exp_and_target.data(), cap);
}

void Backend::embedding_lookup(const WeightMatrix& table, int64_t first_row, Span<const int32_t> ids, int64_t M,
                               Floats out, float factor) {
  need_matrix(*this, table, "embedding_lookup");
  need(*this, ids, M, "embedding_lookup", "ids");
  need(*this, out, M * table.cols, "embedding_lookup", "out");
  embedding_lookup_impl(table, first_row, ids.data, M, factor, out.data);
}

void Backend::embedding_lookup_backward(ConstFloats dy, Span<const int32_t> ids, int64_t M, int64_t dim,
                                        int64_t first_row, int64_t rows, float factor, Floats grad) {
  need(*this, dy, M * dim, "embedding_lookup_backward", "dy");
  need(*this, ids, M, "embedding_lookup_backward", "ids");
  need(*this, grad, rows * dim, "embedding_lookup_backward", "grad");
  embedding_lookup_backward_impl(dy.data, ids.data, M, dim, first_row, rows, factor, grad.data);
}

void Backend::gather_rows(ConstFloats src, Span<const int64_t> rows, int64_t dim, Floats dst) {
  const int64_t n = int64_t(rows.size);
  need(*this, dst, n * dim, "gather_rows", "dst");
  // Row numbers in device memory are the caller's to keep in range (the loss's come from
  // weighted_rows, below M by construction): reading them here would fault on a GPU, or cost a round
  // trip per call.
  for (int64_t i = 0; rows.device == Device::Host && i < n; ++i)
    if (rows.data[i] < 0 || size_t((rows.data[i] + 1) * dim) > src.size) fail(name(), " backend: gather_rows' row ",
          rows.data[i], " is outside its source");
  if (n > 0) need(*this, src, dim, "gather_rows", "src");
  gather_rows_impl(src.data, rows.data, n, dim, dst.data);
}

void Backend::scatter_rows(ConstFloats src, Span<const int64_t> rows, int64_t dim, Floats dst) {
  const int64_t n = int64_t(rows.size);
  need(*this, src, n * dim, "scatter_rows", "src");
  for (int64_t i = 0; rows.device == Device::Host && i < n; ++i)  // as gather_rows'
    if (rows.data[i] < 0 || size_t((rows.data[i] + 1) * dim) > dst.size) fail(name(),
          " backend: scatter_rows' row ", rows.data[i], " is outside its destination");
  if (n > 0) need(*this, dst, dim, "scatter_rows", "dst");
  scatter_rows_impl(src.data, rows.data, n, dim, dst.data);
}

void Backend::interleave_column_blocks(ConstFloats blocks, int parts, int64_t M, int64_t part, Floats out) {
  need(*this, blocks, parts * M * part, "interleave_column_blocks", "blocks");
  need(*this, out, parts * M * part, "interleave_column_blocks", "out");
  interleave_column_blocks_impl(blocks.data, parts, M, part, out.data);
}

void Backend::copy(ConstFloats src, int64_t n, Floats dst) {
  need(*this, src, n, "copy", "src");
  need(*this, dst, n, "copy", "dst");
  copy_impl(src.data, n, dst.data);
}

void Backend::zero(Floats x, int64_t n) {
  need(*this, x, n, "zero", "x");
  zero_impl(x.data, n);
}

void Backend::zero(const std::vector<Floats>& arrays) {
  for (const Floats& x : arrays) need(*this, x, int64_t(x.size), "zero", "an array");
  zero_many_impl(arrays);
}

void Backend::zero_many_impl(const std::vector<Floats>& arrays) {
  for (const Floats& x : arrays) zero_impl(x.data, int64_t(x.size));
}

void Backend::add_into(Floats x, ConstFloats y, int64_t n) {
  need(*this, x, n, "add_into", "x");
  need(*this, y, n, "add_into", "y");
  add_into_impl(x.data, y.data, n);
}

void Backend::scale(Floats x, int64_t n, float factor) {
  need(*this, x, n, "scale", "x");
  scale_impl(x.data, n, factor);
}

void Backend::narrow_to_bf16(ConstFloats src, int64_t n, Span<uint16_t> dst) {
  need(*this, src, n, "narrow_to_bf16", "src");
  need(*this, dst, n, "narrow_to_bf16", "dst");
  narrow_to_bf16_impl(src.data, n, dst.data);
}

void Backend::widen_bf16(Span<const uint16_t> src, int64_t n, Floats dst) {
  need(*this, src, n, "widen_bf16", "src");
  need(*this, dst, n, "widen_bf16", "dst");
  widen_bf16_impl(src.data, n, dst.data);
}

void Backend::adamw_update(Floats theta, ConstFloats grad, Floats m, Floats v, int64_t n, const AdamWStep& step) {
  need(*this, theta, n, "adamw_update", "theta");
  need(*this, grad, n, "adamw_update", "grad");
  need(*this, m, n, "adamw_update", "m");
  need(*this, v, n, "adamw_update", "v");
  adamw_update_impl(theta.data, grad.data, m.data, v.data, n, step);
}

void Backend::adamw_update(const std::vector<AdamWVariable>& variables, const AdamWStep& step) {
  for (const AdamWVariable& x : variables) {
    need(*this, x.theta, x.n, "adamw_update", "theta");
    need(*this, x.grad, x.n, "adamw_update", "grad");
    need(*this, x.m, x.n, "adamw_update", "m");
    need(*this, x.v, x.n, "adamw_update", "v");
  }
  adamw_update_many_impl(variables, step);
}

void Backend::adamw_update_many_impl(const std::vector<AdamWVariable>& variables, const AdamWStep& step) {
  for (const AdamWVariable& x : variables) {
    AdamWStep own = step;
    own.decay = x.decay;
    if (x.n > 0) adamw_update_impl(x.theta.data, x.grad.data, x.m.data, x.v.data, x.n, own);
  }
}

double Backend::sum_of_squares(ConstFloats x, int64_t n) {
  need(*this, x, n, "sum_of_squares", "x");
  return n > 0 ? sum_of_squares_impl(x.data, n) : 0.0;
}

void Backend::scale_by_ratio(Floats x, int64_t n, float numerator, float denominator) {
  need(*this, x, n, "scale_by_ratio", "x");
  scale_by_ratio_impl(x.data, n, numerator, denominator);
}

void Backend::clamp(Floats x, int64_t n, float limit) {
  need(*this, x, n, "clamp", "x");
  clamp_impl(x.data, n, limit);
}

void Backend::narrow_to_bf16(const std::vector<ConstFloats>& parts, Span<uint16_t> dst) {
  int64_t total = 0;
  for (const ConstFloats& part : parts) {
    need(*this, part, int64_t(part.size), "narrow_to_bf16", "part");
    total += int64_t(part.size);
  }
  need(*this, dst, total, "narrow_to_bf16", "dst");
  narrow_parts_to_bf16_impl(parts, dst.data);
}

void Backend::widen_bf16(Span<const uint16_t> src, const std::vector<Floats>& parts) {
  int64_t total = 0;
  for (const Floats& part : parts) {
    need(*this, part, int64_t(part.size), "widen_bf16", "part");
    total += int64_t(part.size);
  }
  need(*this, src, total, "widen_bf16", "src");
  widen_bf16_parts_impl(src.data, parts);
}

void Backend::narrow_parts_to_bf16_impl(const std::vector<ConstFloats>& parts, uint16_t* dst) {
  for (const ConstFloats& part : parts) {
    if (part.size > 0) narrow_to_bf16_impl(part.data, int64_t(part.size), dst);
    dst += part.size;
  }
}

void Backend::widen_bf16_parts_impl(const uint16_t* src, const std::vector<Floats>& parts) {
  for (const Floats& part : parts) {
    if (part.size > 0) widen_bf16_impl(src, int64_t(part.size), part.data);
    src += part.size;
  }
}

int64_t Backend::first_not_finite(const std::vector<ConstFloats>& arrays) {
  for (const ConstFloats& a : arrays) need(*this, a, int64_t(a.size), "first_not_finite", "array");
  return first_not_finite_impl(arrays);
}

}  // namespace meshtune
