#include "core/shared_library.h"

#include <dlfcn.h>

#include "core/error.h"

namespace meshtune {

void* open_shared_library(const std::string& soname, const std::string& fallback_dir, const std::string& what) {
  void* library = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!library && !fallback_dir.empty()) library = dlopen((fallback_dir + "/" + soname).c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!library) {
    const char* reason = dlerror();
    fail(what, ": cannot open ", soname, ": ", reason ? reason : "not found");
  }
  return library;
}

void* library_symbol(void* library, const std::string& soname, const char* name, const std::string& what) {
  void* symbol = dlsym(library, name);
  check(symbol != nullptr, what, ": ", soname, " has no ", name);
  return symbol;
}

}  // namespace meshtune
