// Libraries opened when first needed instead of linked: CUDA's (cuBLAS, NCCL) are hundreds of MB,
// and mapping them at start-up would cost every CPU-only run memory and time.
#pragma once
#include <string>

namespace meshtune {

// `soname` (e.g. "libnccl.so.2") as the dynamic linker finds it, else from `fallback_dir` (the
// toolkit's library directory of the build). An Error "WHAT: cannot open SONAME: reason".
void* open_shared_library(const std::string& soname, const std::string& fallback_dir, const std::string& what);

// The address of `name` in `library`; an Error "WHAT: SONAME has no NAME" when it is missing.
void* library_symbol(void* library, const std::string& soname, const char* name, const std::string& what);

}  // namespace meshtune
