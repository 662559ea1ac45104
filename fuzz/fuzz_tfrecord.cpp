// Fuzzes the TFRecord framing (lengths, masked CRCs) and the tf.train.Example decoder. CRC checks
// would stop most inputs at the framing, so the input is the Example payload, framed here with
// correct CRCs when its first byte is even, and the raw file otherwise.
#include <string>

#include "data/crc32c.h"
#include "data/dataset.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshtune;
  std::string file;
  if (size > 0 && data[0] % 2 == 0) {
    const std::string payload(reinterpret_cast<const char*>(data) + 1, size - 1);
    std::string len(8, '\0');
    for (int i = 0; i < 8; ++i) len[size_t(i)] = char((uint64_t(payload.size()) >> (8 * i)) & 0xff);
    auto crc = [](const std::string& s) {
      const uint32_t c = masked_crc32c(s.data(), s.size());
      return std::string(reinterpret_cast<const char*>(&c), 4);
    };
    file = len + crc(len) + payload + crc(payload);
  } else {
    file.assign(reinterpret_cast<const char*>(data), size);
  }
  const std::string path =
      fuzz::write_input("input.tfrecord", reinterpret_cast<const uint8_t*>(file.data()), file.size());
  fuzz::expect_only_errors([&] { load_dataset("tfrecord:" + path); });
  return 0;
}
