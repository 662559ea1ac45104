// Fuzzes the layout map: the input as a layout JSON file (rules compiled with RE2) resolved
// against every variable of a tiny Gemma on a (1, 2) mesh, and each input line as a --layout-rule.
#include <sstream>

#include "distribution/layout.h"
#include "fuzz_util.h"
#include "model/init.h"
#include "model/variables.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtune;
  static const GemmaConfig config = preset_config("tiny", 512);
  static const std::vector<VariableSpec> variables = gemma_variables(config);
  auto resolve_all = [&](const LayoutMap& map) {
    for (const VariableSpec& v : variables)
      fuzz::expect_only_errors([&] { map.resolve(v.keras_path, v.keras_shape, {1, 2}, {"batch", "model"}); });
  };
  const std::string path = fuzz::write_input("layout.json", data, size);
  fuzz::expect_only_errors([&] { resolve_all(LayoutMap::from_json_file(path)); });
  LayoutMap rules;
  std::istringstream lines(std::string(reinterpret_cast<const char*>(data), size));
  for (std::string line; std::getline(lines, line);) fuzz::expect_only_errors([&] { rules.add_rule_text(line); });
  resolve_all(rules);
  return 0;
}
