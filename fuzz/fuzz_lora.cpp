// Fuzzes the PEFT adapter reader on a tiny Gemma: the input replaces adapter_config.json (first
// byte even) or adapter_model.safetensors (odd) of a valid adapter written once at start-up, so
// both the config (ranks, patterns — RE2 —, alpha) and the tensor names and shapes are reached.
#include <filesystem>

#include "fuzz_util.h"
#include "model/lora.h"
#include "store/lora_files.h"
#include "model/init.h"

namespace {

const meshtune::GemmaConfig& config() {
  static const meshtune::GemmaConfig c = meshtune::preset_config("tiny", 512);
  return c;
}

// The valid adapter's two files, as bytes.
const std::pair<std::string, std::string>& valid_adapter() {
  static const std::pair<std::string, std::string> files = [] {
    using namespace meshtune;
    const std::string dir = fuzz::scratch_dir() + "/valid-adapter";
    LoraWeights lora = enable_lora(config(), 2, parse_lora_targets({"query", "value"}), 1, 0);
    save_peft_adapter(dir, config(), lora);
    auto read = [](const std::string& p) {
      std::ifstream in(p, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(in), {});
    };
    return std::make_pair(read(dir + "/adapter_config.json"), read(dir + "/adapter_model.safetensors"));
  }();
  return files;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtune;
  if (size == 0) return 0;
  const auto& [config_json, weights] = valid_adapter();
  const std::string dir = fuzz::scratch_dir() + "/adapter";
  std::filesystem::create_directories(dir);
  const bool replace_config = data[0] % 2 == 0;
  auto write = [&](const std::string& name, const std::string& bytes) {
    fuzz::write_input("adapter/" + name, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  };
  const std::string input(reinterpret_cast<const char*>(data) + 1, size - 1);
  write("adapter_config.json", replace_config ? input : config_json);
  write("adapter_model.safetensors", replace_config ? weights : input);
  fuzz::expect_only_errors([&] { load_peft_adapter(dir, config()); });
  return 0;
}
