// OpenBLAS' kernel family, chosen by measurement.
//
// OpenBLAS (DYNAMIC_ARCH) picks its kernel family from the CPU's family/model numbers when it loads,
// and is often wrong: virtual machines mask the numbers and it falls back to SSE3 ("Prescott", 64 vs
// 282 GFLOP/s measured on one AVX-512 CPU), and CPUs newer than the library get older kernels (Zen
// 4/5: Haswell's AVX2 ones, 1.5–1.8× slower than SkylakeX's). The family must be named in
// OPENBLAS_CORETYPE before the library loads, so the families this CPU can run are timed in child
// processes, each started with OPENBLAS_CORETYPE set, once per machine (cached: core/machine_cache.h,
// under a lock so that concurrent processes — MPI ranks — wait for one measurement and agree);
// then the program runs with the fastest: the command line re-executes itself, the Python package
// sets the variable before it loads the engine (python/meshtune/_engine.py).
#pragma once
#include <string>
#include <vector>

namespace meshtune {

// What a timing child does: when MESHTUNE_TIME_SGEMM is set, prints "sgemm CORE GFLOPS" for the
// kernels OpenBLAS loaded and returns true (the caller then exits).
bool time_sgemm_if_asked();

// The kernel family to run (`core`, empty when nothing could be measured) and the line saying why
// (`note`: the rates measured): the cached choice for this CPU and OpenBLAS, or measured now by
// running `timing_command` (argv; a program that calls time_sgemm_if_asked first) once per family
// this CPU runs, and cached. MESHTUNE_RECALIBRATE=1 measures again. Call it only while
// OPENBLAS_CORETYPE is unset: it compares the families against OpenBLAS' own choice.
struct BlasChoice {
  std::string core, note;
};
BlasChoice blas_kernels_to_use(const std::vector<std::string>& timing_command);

// For main(), first thing, before MPI starts: unless OPENBLAS_CORETYPE is set (the user's choice,
// or ours in an earlier exec), sets it to blas_kernels_to_use() — child processes inherit it, and
// MESHTUNE_BLAS_NOTE to the note — and
// re-executes the program (argv as given) when that differs from the family OpenBLAS loaded.
void choose_blas_kernels(char** argv);

// The line `info --system` prints: the family in use and why (measured rates, or the user's).
std::string blas_kernel_choice();

}  // namespace meshtune
