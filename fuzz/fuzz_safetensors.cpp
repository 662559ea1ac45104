// Fuzzes the safetensors header and tensor table (parse_safetensors over an in-memory image, as
// read_safetensors sees a memory-mapped file) and the metadata reader.
#include "fuzz_util.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtune;
  fuzz::expect_only_errors([&] {
    for (const auto& [name, t] : parse_safetensors(data, size, "fuzz.safetensors")) {
      volatile uint8_t sink = 0;  // touch the first and last byte each entry claims
      if (t.nbytes() > 0) sink = uint8_t(t.data[0]) ^ uint8_t(t.data[t.nbytes() - 1]);
      (void)sink;
    }
  });
  const std::string path = fuzz::write_input("meta.safetensors", data, size);
  fuzz::expect_only_errors([&] { read_safetensors_metadata(path); });
  return 0;
}
