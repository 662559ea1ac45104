// backend/cpu/isa/vector_ops.h for AVX-512 (compiled with -mavx512f … -mfma).
#define MESHTUNE_VECTOR_OPS vector_ops_avx512
#include "backend/cpu/isa/vector_ops_body.h"
