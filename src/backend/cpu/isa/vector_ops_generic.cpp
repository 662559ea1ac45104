// backend/cpu/isa/vector_ops.h for the build's baseline (make_kernel_path picks a set for a path).
#define MESHTUNE_VECTOR_OPS vector_ops_generic
#include "backend/cpu/isa/vector_ops_body.h"
