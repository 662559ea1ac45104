// How the CPU kernels compute, chosen once when a CpuBackend is made (backend/cpu_backend.h) and
// handed to every kernel that has more than one way: the instruction-set path, its elementwise
// loops, and which matrix products go to oneDNN. There is no process-wide kernel state, so two
// backends on two paths can run side by side (the op registry test does).
#pragma once
#include <array>

#include "backend/cpu/isa/features.h"
#include "backend/cpu/isa/vector_ops.h"

namespace meshtune {

// The kinds of matrix product of more than 4 rows (prefill, training, the LM head's chunks) that
// have two implementations: OpenBLAS sgemm (for int8: our own kernel) or oneDNN's matmul. Which
// one is faster depends on the machine, so a CpuBackend times both (backend/cpu/routes.h).
enum class Product {
  F32Linear,          // y = x·Wᵀ, fp32 inputs (fp32 weights)
  F32InputGradient,   // dx = dy·W, fp32
  F32WeightGradient,  // dW += dyᵀ·x, fp32 (full fine-tuning)
  WidenedLinear,      // y = x·Wᵀ, fp32 inputs, bf16 W widened to fp32 (frozen bf16 weights under float32)
  WidenedInputGradient,  // dx = dy·W, fp32 dy, bf16 or int8 W widened to fp32
  Bf16Linear,         // y = x·Wᵀ with bf16 inputs, fp32 sums (mixed_bfloat16 / bfloat16)
  Bf16InputGradient,  // dx = dy·W with bf16 inputs
  Int8Linear,         // Keras int8: exact int32 sums either way
};
inline constexpr int kProductKinds = 8;
const char* product_name(Product p);  // "f32 x·Wᵀ", …
using ProductRoutes = std::array<bool, kProductKinds>;  // per kind: true = oneDNN
inline ProductRoutes every_product_on_onednn() {
  ProductRoutes routes;
  routes.fill(true);
  return routes;
}

struct KernelPath {
  CpuPath isa = CpuPath::Generic;
  const cpu::VectorOps* vector = &cpu::vector_ops_generic();  // the elementwise loops of `isa`
  ProductRoutes onednn{};  // which products of more than 4 rows go to oneDNN

  const cpu::VectorOps& ops() const { return *vector; }
  bool uses_onednn(Product p) const { return onednn[size_t(p)]; }
};

// The path for `isa` (which the CPU must support: Error otherwise), with oneDNN taking the products
// `onednn` asks for where it can: a build with oneDNN, and for bf16 inputs the avx512bf16 path (bf16
// dot products in hardware). Int8 also needs oneDNN's sums to be exact on this CPU, checked at the
// first such product (int8.cpp).
KernelPath make_kernel_path(CpuPath isa, ProductRoutes onednn = {});

}  // namespace meshtune
