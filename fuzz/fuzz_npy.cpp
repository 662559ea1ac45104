// Fuzzes the .npy reader (header dictionary, versions, shapes against the file size).
#include "io/npy.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = meshtune::fuzz::write_input("input.npy", data, size);
  meshtune::fuzz::expect_only_errors([&] { meshtune::read_npy(path); });
  return 0;
}
