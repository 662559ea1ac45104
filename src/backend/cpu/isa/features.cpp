#include "backend/cpu/isa/features.h"

#include <cblas.h>
#include <cpuid.h>
#include <omp.h>

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <fstream>

#include "core/error.h"
#include "backend/cpu/blas_kernels.h"
#include "backend/cpu/isa/onednn.h"
#include "backend/cpu/kernel_path.h"

namespace meshtune {

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "";
}

std::string cpu_identity() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  __get_cpuid(1, &eax, &ebx, &ecx, &edx);  // family, model and stepping
  return cpu_model_name() + " (signature " + std::to_string(eax) + "); " + cpu_features().summary();
}

// CPUID and XGETBV, read directly (GCC's and clang's __builtin_cpu_supports know different
// names): an instruction set counts only when the OS also saves its registers.
static uint64_t xgetbv0() {
  uint32_t lo = 0, hi = 0;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = [] {
    CpuFeatures c;
    unsigned a = 0, b = 0, cx = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &cx, &d)) return c;
    const bool osxsave = cx & (1u << 27), avx = cx & (1u << 28);
    const uint64_t xcr0 = osxsave ? xgetbv0() : 0;
    const bool ymm = (xcr0 & 0x6) == 0x6, zmm = (xcr0 & 0xe6) == 0xe6;
    c.fma = ymm && avx && (cx & (1u << 12));
    c.f16c = ymm && avx && (cx & (1u << 29));
    unsigned max_leaf = __get_cpuid_max(0, nullptr);
    if (max_leaf < 7) return c;
    __cpuid_count(7, 0, a, b, cx, d);
    const unsigned leaf7_subleaves = a;
    c.avx2 = ymm && (b & (1u << 5));
    c.avx512f = zmm && (b & (1u << 16));
    c.avx512dq = zmm && (b & (1u << 17));
    c.avx512bw = zmm && (b & (1u << 30));
    c.avx512vl = zmm && (b & (1u << 31));
    c.avx512_vnni = zmm && (cx & (1u << 11));
    c.amx_bf16 = d & (1u << 22);
    if (leaf7_subleaves >= 1) {
      __cpuid_count(7, 1, a, b, cx, d);
      c.avx_vnni = ymm && (a & (1u << 4));
      c.avx512_bf16 = zmm && (a & (1u << 5));
    }
    return c;
  }();
  return f;
}

std::string CpuFeatures::summary() const {
  std::string s;
  auto add = [&](bool on, const char* name) {
    if (on) s += (s.empty() ? "" : " ") + std::string(name);
  };
  add(avx2, "avx2");
  add(fma, "fma");
  add(f16c, "f16c");
  add(avx512f, "avx512f");
  add(avx512bw, "avx512bw");
  add(avx512vl, "avx512vl");
  add(avx512dq, "avx512dq");
  add(avx512_bf16, "avx512_bf16");
  add(avx512_vnni, "avx512_vnni");
  add(avx_vnni, "avx_vnni");
  add(amx_bf16, "amx_bf16");
  return s.empty() ? "none of avx2/avx512" : s;
}

bool cpu_supports(CpuPath path) {
  const CpuFeatures& f = cpu_features();
  const bool avx2 = f.avx2 && f.fma && f.f16c, avx512 = avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
  switch (path) {
    case CpuPath::Generic: return true;
    case CpuPath::Avx2: return avx2;
    case CpuPath::Avx512: return avx512;
    case CpuPath::Avx512Bf16: return avx512 && f.avx512_bf16 && f.avx512_vnni;  // every such CPU has both
  }
  return false;
}

std::vector<CpuPath> supported_cpu_paths() {
  std::vector<CpuPath> paths;
  for (CpuPath p : {CpuPath::Generic, CpuPath::Avx2, CpuPath::Avx512, CpuPath::Avx512Bf16})
    if (cpu_supports(p)) paths.push_back(p);
  return paths;
}

const char* cpu_path_name(CpuPath path) {
  switch (path) {
    case CpuPath::Generic: return "generic";
    case CpuPath::Avx2: return "avx2";
    case CpuPath::Avx512: return "avx512";
    case CpuPath::Avx512Bf16: return "avx512bf16";
  }
  return "?";
}

CpuPath cpu_path_named(const std::string& name, const std::string& what) {
  for (CpuPath p : {CpuPath::Generic, CpuPath::Avx2, CpuPath::Avx512, CpuPath::Avx512Bf16}) {
    if (name != cpu_path_name(p)) continue;
    check(cpu_supports(p), what, name, ": this CPU does not support that path (it has: ", cpu_features().summary(), ")");
    return p;
  }
  fail(what, brief(name), ": expected generic, avx2, avx512 or avx512bf16");
}

const char* product_name(Product p) {
  switch (p) {
    case Product::F32Linear: return "f32 x·Wᵀ";
    case Product::F32InputGradient: return "f32 dy·W";
    case Product::F32WeightGradient: return "f32 dyᵀ·x";
    case Product::WidenedLinear: return "f32 x·Wᵀ, W bf16";
    case Product::WidenedInputGradient: return "f32 dy·W, W bf16/int8";
    case Product::Bf16Linear: return "bf16 x·Wᵀ";
    case Product::Bf16InputGradient: return "bf16 dy·W";
    case Product::Int8Linear: return "int8 x·Wᵀ";
  }
  return "?";
}

KernelPath make_kernel_path(CpuPath isa, ProductRoutes onednn) {
  check(cpu_supports(isa), "kernel path ", cpu_path_name(isa), " is not supported by this CPU (it has: ",
        cpu_features().summary(), ")");
  KernelPath path;
  path.isa = isa;
  path.vector = isa == CpuPath::Generic ? &cpu::vector_ops_generic()
                : isa == CpuPath::Avx2  ? &cpu::vector_ops_avx2()
                                        : &cpu::vector_ops_avx512();
  for (int p = 0; p < kProductKinds; ++p) {
    const bool bf16 = Product(p) == Product::Bf16Linear || Product(p) == Product::Bf16InputGradient;
    path.onednn[size_t(p)] = onednn[size_t(p)] && cpu::onednn_available() && (!bf16 || isa == CpuPath::Avx512Bf16);
  }
  return path;
}

std::vector<std::string> kernel_report(const KernelPath& kernels, bool forced) {
  const CpuFeatures& f = cpu_features();
  const CpuPath path = kernels.isa;
  std::string supported;
  for (CpuPath p : supported_cpu_paths()) supported += (supported.empty() ? "" : ", ") + std::string(cpu_path_name(p));
  const std::string vector_path = path == CpuPath::Generic ? "generic (scalar, compiler-vectorised)"
                                  : path == CpuPath::Avx2  ? "avx2 (256-bit FMA)"
                                                           : "avx512 (512-bit FMA)";
  const int parallel = openblas_get_parallel();  // 0 sequential, 1 pthreads, 2 OpenMP
  return {
      "cpu: " + [] {  // read only for the report: start-up needs just the feature bits
        const std::string model = cpu_model_name();
        return model.empty() ? std::string("unknown model") : model;
      }(),
      "cpu features: " + f.summary(),
      std::string("kernel path: ") + cpu_path_name(path) + (forced ? " (forced by MESHTUNE_CPU)" : " (the best this CPU supports)") +
          "; supported: " + supported,
      "decode matrix-vector (fp32 and bf16 weights): " + vector_path,
      "bf16 widening for the sgemm path: " + vector_path,
      "int8 matrix-vector (Keras int8, decode): " +
          std::string(path == CpuPath::Avx512Bf16 ? "avx512 vnni (vpdpwssd)" : vector_path),
      "elementwise kernels (norms, RoPE, attention, GeGLU, loss, AdamW): " + vector_path,
      std::string("BLAS: OpenBLAS ") + openblas_get_config() + ", core " + openblas_get_corename() + ", threading " +
          (parallel == 2 ? "OpenMP" : parallel == 1 ? "pthreads" : "sequential") + ", " +
          std::to_string(openblas_get_num_threads()) + " threads",
      blas_kernel_choice(),
      "OpenMP threads: " + std::to_string(omp_get_max_threads()),
  };
}

}  // namespace meshtune
