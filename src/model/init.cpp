#include "model/init.h"

#include <cmath>

#include "core/error.h"
#include "core/random.h"

namespace meshtune {

DType random_variable_dtype(const VariableSpec& spec, DType dtype) {
  return spec.kind == VarKind::Norm ? DType::F32 : dtype;
}

HostTensor random_variable(const VariableSpec& spec, uint64_t seed, DType dtype) {
  check(dtype == DType::F32 || dtype == DType::BF16, "random weights: dtype must be float32 or bfloat16, got ",
        dtype_name(dtype));
  HostTensor t = HostTensor::allocate(random_variable_dtype(spec, dtype), spec.hf_shape);
  // Every matrix is (out, in) in our layout, the embedding (V, D): 1/√cols is 1/√fan_in, and 1/√D.
  const float stddev = spec.kind == VarKind::Norm ? 0.1f : float(1 / std::sqrt(double(spec.hf_shape[1])));
  // The variable's own stream: by layer and slot, not by its place in the list, which depends on
  // the config's optional norms.
  const uint64_t variable_seed = derive_seed(seed, (uint64_t(spec.layer + 1) << 8) | uint64_t(spec.slot));
  if (t.dtype == DType::F32) fill_normal(t.mutable_as<float>(), size_t(num_elements(t.shape)), variable_seed, stddev);
  else fill_normal_bf16(t.mutable_as<uint16_t>(), size_t(num_elements(t.shape)), variable_seed, stddev);
  return t;
}

GemmaModel random_model(const GemmaConfig& c, uint64_t seed, DType dtype) {
  GemmaModel m;
  m.config = c;
  m.layers.resize(size_t(c.num_layers));
  for (const VariableSpec& spec : gemma_variables(c)) {
    const HostTensor t = random_variable(spec, seed, dtype);
    if (WeightMatrix* w = m.matrix(spec.slot, spec.layer))
      *w = WeightMatrix{.rows = t.shape[0], .cols = t.shape[1], .dtype = t.dtype, .data = t.data, .owner = t.owner};
    else *m.vector(spec.slot, spec.layer) = to_f32(t);
  }
  return m;
}

}  // namespace meshtune
