// Fuzzes config.json parsing: the checked JSON layer, then the Keras and the Hugging Face readers,
// then the JSONL data reader on the same bytes.
#include "core/json.h"
#include "data/dataset.h"
#include "fuzz_util.h"
#include "model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtune;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_only_errors([&] {
    const json j = parse_json(text, "config.json");
    fuzz::expect_only_errors([&] { GemmaConfig::from_keras_json(j, "config.json"); });
    fuzz::expect_only_errors([&] { GemmaConfig::from_hf_json(j, "config.json"); });
  });
  const std::string path = fuzz::write_input("input.jsonl", data, size);
  fuzz::expect_only_errors([&] { load_dataset("jsonl:" + path); });
  return 0;
}
