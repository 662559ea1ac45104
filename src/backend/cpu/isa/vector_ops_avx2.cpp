// backend/cpu/isa/vector_ops.h for AVX2 + FMA (compiled with -mavx2 -mfma).
#define MESHTUNE_VECTOR_OPS vector_ops_avx2
#include "backend/cpu/isa/vector_ops_body.h"
