// Fuzzes checkpoint reading as `export --checkpoint` does it: the input is a sharded manifest
// (first byte even) naming rank files in its directory, two of which exist and hold a block of one
// variable; or (odd) the placement metadata of a rank file. Placements set where blocks are
// written, so every offset, extent and overlap must be checked before any copy.
#include <filesystem>

#include "fuzz_util.h"
#include "io/safetensors.h"
#include "train/trainer.h"

namespace {

// A rank file holding a [2, 3] block of "v" (a [4, 3] variable) at row `row`, with `placement`.
void write_rank_file(const std::string& path, int row, const std::string& placement) {
  using namespace meshtune;
  HostTensor t = HostTensor::allocate(DType::F32, {6});
  for (int i = 0; i < 6; ++i) t.mutable_as<float>()[i] = float(row * 6 + i);
  write_safetensors(path, {{"param/v", t}},
                    {{"format", "meshtune-checkpoint-1"}, {"mode", "full"}, {"step", "3"}, {"lora_rank", "0"},
                     {"lora_alpha", "0"}, {"placement", placement}});
}

std::string placement_at(int row) {
  return R"({"v": {"full": [1, 4, 3], "local": [1, 2, 3], "offset": [0, )" + std::to_string(row) + ", 0]}}";
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtune;
  if (size == 0) return 0;
  const std::string dir = fuzz::scratch_dir() + "/run";
  std::filesystem::create_directories(dir);
  const std::string input(reinterpret_cast<const char*>(data) + 1, size - 1);
  const std::string manifest = dir + "/checkpoint.safetensors";
  if (data[0] % 2 == 0) {
    write_rank_file(dir + "/r0", 0, placement_at(0));
    write_rank_file(dir + "/r1", 2, placement_at(2));
    fuzz::write_input("run/checkpoint.safetensors", reinterpret_cast<const uint8_t*>(input.data()), input.size());
  } else {
    write_rank_file(dir + "/r0", 0, placement_at(0));
    fuzz::expect_only_errors([&] { write_rank_file(dir + "/r1", 2, input); });  // not valid UTF-8: refused
    const std::string m = R"({"format": "meshtune-sharded-checkpoint-1", "step": 3, "mesh": [1, 2], "axes": ["batch", "model"], "files": ["r0", "r1"]})";
    fuzz::write_input("run/checkpoint.safetensors", reinterpret_cast<const uint8_t*>(m.data()), m.size());
  }
  fuzz::expect_only_errors([&] { read_trained_parameters(manifest); });
  return 0;
}
