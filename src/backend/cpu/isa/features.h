// The CPU's instruction sets and the kernel path in use, chosen at run time so one generic x86-64
// binary runs on every host of a cluster and still uses AVX-512 where a host has it.
// The path is a value (backend/cpu/kernel_path.h) a CpuBackend chooses once: the best the CPU supports,
// or the one MESHTUNE_CPU=generic|avx2|avx512|avx512bf16 names; tests make one backend per path.
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
std::string cpu_model_name();  // /proc/cpuinfo's "model name"; empty when unknown
// The model name, CPUID family/model/stepping ("AMD EPYC" names several generations) and the
// features: what a measurement cached for this CPU is keyed on.
std::string cpu_identity();
bool cpu_supports(CpuPath path);
std::vector<CpuPath> supported_cpu_paths();  // generic first, best last
const char* cpu_path_name(CpuPath path);  // "generic", "avx2", "avx512", "avx512bf16"
// The path named `name` (one of the above) that the CPU supports; Error naming `what` otherwise.
CpuPath cpu_path_named(const std::string& name, const std::string& what);

// Lines for `meshtune info --system` and benchmarks: the CPU and its features, the path each
// kernel takes on `path`, and the BLAS library with its threading.
struct KernelPath;
std::vector<std::string> kernel_report(const KernelPath& path, bool forced);

}  // namespace meshtune
