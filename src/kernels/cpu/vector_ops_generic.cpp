// kernels/cpu/vector_ops.h for the build's baseline, and the choice of set at run time.
#define MESHTUNE_VECTOR_OPS vector_ops_generic
#include "kernels/cpu/vector_ops_body.h"

#include "kernels/cpu/features.h"

namespace meshtune::cpu {

const VectorOps& vector_ops() {
  switch (cpu_path()) {
    case CpuPath::Avx512:
    case CpuPath::Avx512Bf16: return vector_ops_avx512();
    case CpuPath::Avx2: return vector_ops_avx2();
    case CpuPath::Generic: break;
  }
  return vector_ops_generic();
}

}  // namespace meshtune::cpu
