// kernels/cpu/vector_ops.h for AVX2 + FMA (compiled with -mavx2 -mfma).
#define MESHTUNE_VECTOR_OPS vector_ops_avx2
#include "kernels/cpu/vector_ops_body.h"
