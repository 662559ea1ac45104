// The CPU's instruction sets and the kernel path in use, chosen at run time so one generic x86-64
// binary runs on every host of a cluster and still uses AVX-512 where a host has it.
// MESHTUNE_CPU=generic|avx2|avx512|avx512bf16 forces a path (one the CPU supports); tests switch
// paths with set_cpu_path() to check each against the plain-loop references.
#pragma once
#include <string>
#include <vector>

namespace meshtune {

// Avx512Bf16 also means AVX512_VNNI (every CPU with the one has the other; its int8 kernel uses it).
enum class CpuPath { Generic, Avx2, Avx512, Avx512Bf16 };

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_bf16 = false, avx512_vnni = false, avx_vnni = false, amx_bf16 = false;
  std::string summary() const;  // "avx2 fma avx512f … " — the flags that matter here
};

const CpuFeatures& cpu_features();
bool cpu_supports(CpuPath path);
std::vector<CpuPath> supported_cpu_paths();  // generic first, best last
// The path kernels use: set_cpu_path's, else MESHTUNE_CPU's, else the best the CPU supports.
// Throws Error for an unknown or unsupported MESHTUNE_CPU value.
CpuPath cpu_path();
void set_cpu_path(CpuPath path);  // throws Error if the CPU does not support it
const char* cpu_path_name(CpuPath path);  // "generic", "avx2", "avx512", "avx512bf16"

// OpenBLAS (DYNAMIC_ARCH) picks its kernels from the CPU's family/model numbers when it loads;
// virtual machines often mask them, and it then falls back to SSE3 ("Prescott") kernels, 4× slower
// than its AVX-512 ones on the same CPU (64 vs 282 GFLOP/s measured here). When that happened and
// OPENBLAS_CORETYPE is unset, this re-executes the program (argv as given) with
// OPENBLAS_CORETYPE=SkylakeX (AVX-512) or Haswell (AVX2) — it must be set before the library
// loads. Call it first thing in main(), before MPI starts. Returns if nothing needs doing.
void choose_blas_kernels(char** argv);

// Lines for `meshtune info --system` and benchmarks: the CPU and its features, the path each
// kernel takes, and the BLAS library with its threading.
std::vector<std::string> kernel_report();

}  // namespace meshtune
