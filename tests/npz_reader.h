// Test-only reader of NumPy .npz archives (numpy.savez: an uncompressed zip of .npy members),
// converting numeric members (<f8, <f4, <i4, <i8) to double. Enough for the PyTorch fixtures.
#pragma once
#include <cstdint>
#include <cstring>
#include <map>
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

#include "test_util.h"

namespace meshtune::testing {

struct NpzArray {
  std::vector<int64_t> shape;
  std::vector<double> values;
};

inline std::map<std::string, NpzArray> read_npz(const std::string& path) {
  const std::string zip = read_text_file(path);
  std::map<std::string, NpzArray> out;
  size_t pos = 0;
  auto u16 = [&](size_t at) { uint16_t v; std::memcpy(&v, zip.data() + at, 2); return uint32_t(v); };
  auto u32 = [&](size_t at) { uint32_t v; std::memcpy(&v, zip.data() + at, 4); return v; };
  while (pos + 30 <= zip.size() && u32(pos) == 0x04034b50) {  // local file header
    const uint32_t method = u16(pos + 8), name_len = u16(pos + 26), extra_len = u16(pos + 28);
    uint64_t size = u32(pos + 18);
    std::string name = zip.substr(pos + 30, name_len);
    size_t data = pos + 30 + name_len + extra_len;
    if (size == 0xffffffffu) {  // zip64: sizes in the extra field
      std::memcpy(&size, zip.data() + pos + 30 + name_len + 4 + 8, 8);
    }
    if (method != 0) throw std::runtime_error(path + ": compressed npz members are not supported");
    const std::string npy = zip.substr(data, size);
    pos = data + size;
    if (name.size() > 4 && name.substr(name.size() - 4) == ".npy") name.resize(name.size() - 4);
    const uint32_t header_len = npy[6] == 1 ? u16(data + 8) : u32(data + 8);
    const std::string header = npy.substr(npy[6] == 1 ? 10 : 12, header_len);
    std::smatch m;
    std::regex_search(header, m, std::regex("'descr': *'([^']*)'"));
    const std::string descr = m[1];
    std::regex_search(header, m, std::regex("'shape': *\\(([^)]*)\\)"));
    NpzArray a;
    std::string dims = m[1];
    static const std::regex number("[0-9]+");
    for (std::sregex_iterator it(dims.begin(), dims.end(), number), end; it != end; ++it)
      a.shape.push_back(std::stoll(it->str()));
    size_t count = 1;
    for (int64_t d : a.shape) count *= size_t(d);
    const char* raw = npy.data() + (npy[6] == 1 ? 10 : 12) + header_len;
    for (size_t i = 0; i < count; ++i) {
      if (descr == "<f8") { double v; std::memcpy(&v, raw + 8 * i, 8); a.values.push_back(v); }
      else if (descr == "<f4") { float v; std::memcpy(&v, raw + 4 * i, 4); a.values.push_back(v); }
      else if (descr == "<i4") { int32_t v; std::memcpy(&v, raw + 4 * i, 4); a.values.push_back(v); }
      else if (descr == "<i8") { int64_t v; std::memcpy(&v, raw + 8 * i, 8); a.values.push_back(double(v)); }
      else break;  // strings (the meta member) are skipped
    }
    out[name] = std::move(a);
  }
  return out;
}

}  // namespace meshtune::testing
