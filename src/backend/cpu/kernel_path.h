// How the CPU kernels compute, chosen once when a CpuBackend is made (backend/cpu_backend.h) and
// handed to every kernel that has more than one way: the instruction-set path, its elementwise
// loops, and which products go to oneDNN. There is no process-wide kernel state, so two backends
// on two paths can run side by side (the op registry test does).
#pragma once
#include "backend/cpu/isa/features.h"
#include "backend/cpu/isa/vector_ops.h"

namespace meshtune {

struct KernelPath {
  CpuPath isa = CpuPath::Generic;
  const cpu::VectorOps* vector = &cpu::vector_ops_generic();  // the elementwise loops of `isa`
  bool onednn_bf16 = false;  // more than 4 rows at bf16 precision: oneDNN's bf16 matmul
  bool onednn_int8 = false;  // more than 4 rows with int8 weights: oneDNN's s8 matmul (where exact)

  const cpu::VectorOps& ops() const { return *vector; }
};

// The path for `isa` (which the CPU must support: Error otherwise). oneDNN's bf16 matmul is taken
// where asked for (`onednn_bf16`; unset = only with AMX-BF16, where it was measured to beat sgemm)
// and possible (the avx512bf16 path and a build with oneDNN); its int8 matmul wherever the build has it
// and its sums are exact on this CPU (cpu::onednn_int8_exact: not without VNNI)
// unless `onednn_int8` is false.
KernelPath make_kernel_path(CpuPath isa, int onednn_bf16 = -1, bool onednn_int8 = true);

}  // namespace meshtune
