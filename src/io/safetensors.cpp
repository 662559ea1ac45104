#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "io/mapped_files.h"
#include "core/error.h"
#include "core/file_util.h"
#include "core/json.h"

namespace meshtune {

namespace {

const char* safetensors_dtype_name(DType dt) {
  switch (dt) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::I8: return "I8";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
  }
  return "?";
}

bool parse_dtype(const std::string& s, DType* out) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64, DType::I8, DType::U8, DType::BOOL}) {
    if (s == safetensors_dtype_name(dt)) {
      *out = dt;
      return true;
    }
  }
  return false;
}

// A parsed header entry, before it becomes a HostTensor.
struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

// Validates one header entry against the data size. Sizes are checked with overflow-safe
// arithmetic so a hostile shape can neither overflow nor make us allocate anything.
Entry parse_entry(const std::string& path, const std::string& name, const json& value, uint64_t data_size) {
  const std::string where = path + ": tensor \"" + brief(name) + "\"";
  check(value.is_object(), where, ": header entry is not a JSON object");

  Entry e;
  e.name = name;
  auto dtype_it = value.find("dtype");
  check(dtype_it != value.end() && dtype_it->is_string(), where, ": missing or non-string \"dtype\"");
  const std::string& dtype_str = dtype_it->get_ref<const std::string&>();
  check(parse_dtype(dtype_str, &e.dtype), where, ": unsupported dtype \"", dtype_str,
        "\" (supported: F32, BF16, F16, I32, I64, I8, U8, BOOL)");

  auto shape_it = value.find("shape");
  check(shape_it != value.end() && shape_it->is_array(), where, ": missing or non-array \"shape\"");
  // Product of the non-zero dims must fit in int64 even when some dim is zero, so that
  // num_elements() (which multiplies in order) can never overflow.
  const uint64_t max_elems = uint64_t(std::numeric_limits<int64_t>::max());
  uint64_t nonzero_product = 1;
  bool has_zero = false;
  for (const json& d : *shape_it) {
    if (!d.is_number_unsigned()) fail(where, ": shape entries must be non-negative integers, got ", brief(d.dump()));
    uint64_t dim = d.get<uint64_t>();
    check(dim <= max_elems, where, ": shape dimension ", dim, " is too large");
    if (dim == 0) {
      has_zero = true;
    } else {
      if (__builtin_mul_overflow(nonzero_product, dim, &nonzero_product) || nonzero_product > max_elems)
        fail(where, ": shape ", brief(shape_it->dump()), " has too many elements");
    }
    e.shape.push_back(int64_t(dim));
  }
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(nonzero_product, uint64_t(dtype_size(e.dtype)), &nbytes))
    fail(where, ": shape ", brief(shape_it->dump()), " is too large");
  if (has_zero) nbytes = 0;

  auto off_it = value.find("data_offsets");
  check(off_it != value.end() && off_it->is_array() && off_it->size() == 2 && (*off_it)[0].is_number_unsigned() &&
            (*off_it)[1].is_number_unsigned(),
        where, ": \"data_offsets\" must be [begin, end] with non-negative integers");
  e.begin = (*off_it)[0].get<uint64_t>();
  e.end = (*off_it)[1].get<uint64_t>();
  check(e.begin <= e.end, where, ": data_offsets [", e.begin, ", ", e.end, "] have begin > end");
  check(e.end <= data_size, where, ": data_offsets [", e.begin, ", ", e.end, "] run past the end of the data (",
        data_size, " bytes)");
  check(e.end - e.begin == nbytes, where, ": shape ", shape_str(e.shape), " of ", safetensors_dtype_name(e.dtype),
        " needs ", nbytes, " bytes but data_offsets [", e.begin, ", ", e.end, "] span ", e.end - e.begin);
  return e;
}

uint64_t read_u64_le(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

std::map<std::string, HostTensor> parse_safetensors(const unsigned char* base, uint64_t file_size,
                                                    const std::string& path, std::shared_ptr<const void> owner) {
  check(file_size >= 8, path, ": file is ", file_size, " bytes, too short for a safetensors header (needs 8)");
  // Compare against size - 8 rather than computing 8 + N, which could overflow.
  const uint64_t header_len = read_u64_le(base);
  check(header_len <= file_size - 8, path, ": header length ", header_len, " runs past the end of the file (size ",
        file_size, ")");
  const char* header_begin = reinterpret_cast<const char*>(base + 8);
  const json header = parse_json(std::string_view(header_begin, header_len), path + ": header");
  check(header.is_object(), path, ": header is not a JSON object");

  const uint64_t data_size = file_size - 8 - header_len;
  const std::byte* data = reinterpret_cast<const std::byte*>(base + 8 + header_len);
  std::vector<Entry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    entries.push_back(parse_entry(path, it.key(), it.value(), data_size));
  }

  // No two tensors may share bytes. Empty tensors occupy nothing, so they cannot overlap.
  std::vector<const Entry*> by_offset;
  for (const Entry& e : entries)
    if (e.end > e.begin) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const Entry& prev = *by_offset[i - 1];
    const Entry& cur = *by_offset[i];
    check(cur.begin >= prev.end, path, ": tensors \"", brief(prev.name), "\" [", prev.begin, ", ", prev.end, ") and \"",
          brief(cur.name), "\" [", cur.begin, ", ", cur.end, ") overlap");
  }

  std::map<std::string, HostTensor> out;
  for (Entry& e : entries) {
    HostTensor t;
    t.dtype = e.dtype;
    t.shape = std::move(e.shape);
    t.data = data + e.begin;
    t.owner = owner;
    t.mapped = true;
    out.emplace(e.name, std::move(t));
  }
  return out;
}

std::map<std::string, HostTensor> read_safetensors(const std::string& path) {
  std::error_code ec;
  check(std::filesystem::is_regular_file(path, ec), path, ": not a regular file (or cannot be read)");
  const uint64_t file_size = std::filesystem::file_size(path, ec);
  check(!ec, path, ": cannot read its size: ", ec.message());
  const MappedRange map = map_file_range(path, 0, file_size, /*read_ahead=*/false);
  return parse_safetensors(reinterpret_cast<const unsigned char*>(map.data), file_size, path, map.owner);
}

std::map<std::string, std::string> read_safetensors_metadata(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  check(bool(in), path, ": cannot open safetensors file: ", std::strerror(errno));
  std::error_code ec;
  const uint64_t file_size = std::filesystem::file_size(path, ec);
  check(!ec && file_size >= 8, path, ": not a safetensors file (", ec ? ec.message() : "shorter than 8 bytes", ")");
  unsigned char len_bytes[8];
  check(bool(in.read(reinterpret_cast<char*>(len_bytes), 8)), path, ": cannot read the safetensors header length");
  const uint64_t header_len = read_u64_le(len_bytes);
  check(header_len <= file_size - 8, path, ": header length ", header_len, " runs past the end of the file (size ",
        file_size, ")");
  std::string text(size_t(header_len), '\0');
  check(bool(in.read(text.data(), std::streamsize(header_len))), path, ": cannot read the safetensors header");
  const json header = parse_json(text, path + ": header");
  const JsonValue root(header, path, "header");
  check(root.is_object(), path, ": header is not a JSON object");
  std::map<std::string, std::string> out;
  if (auto meta = root.find("__metadata__"))
    for (const auto& [key, value] : meta->members()) out[key] = value.string();
  return out;
}

std::map<std::string, HostTensor> read_safetensors_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single_path = fs::path(dir) / "model.safetensors";
  std::error_code ec;
  if (!fs::exists(index_path, ec)) {
    if (fs::exists(single_path, ec)) return read_safetensors(single_path.string());
    fail("no model.safetensors or model.safetensors.index.json in ", dir);
  }

  const std::string index = index_path.string();
  const json doc = read_json_file(index);
  check(doc.is_object() && doc.contains("weight_map") && doc["weight_map"].is_object(), index,
        ": expected an object with a \"weight_map\" object");

  // Read each distinct shard once, then pick exactly the tensors the weight map names.
  std::map<std::string, std::map<std::string, HostTensor>> shards;
  std::map<std::string, HostTensor> out;
  for (const auto& [name, file_json] : doc["weight_map"].items()) {
    check(file_json.is_string(), index, ": weight_map entry for \"", brief(name), "\" is not a string");
    const std::string& file = file_json.get_ref<const std::string&>();
    // Shards live beside the index; a path here would let the index point anywhere.
    const fs::path shard_path = plain_file_in(dir, file, index + ": weight_map[\"" + brief(name) + "\"]");
    auto shard_it = shards.find(file);
    if (shard_it == shards.end()) {
      check(fs::exists(shard_path, ec), index, ": shard ", file, " (listed for tensor \"", name, "\") is missing");
      shard_it = shards.emplace(file, read_safetensors(shard_path.string())).first;
    }
    auto t = shard_it->second.find(name);
    check(t != shard_it->second.end(), index, ": tensor \"", brief(name), "\" is listed in shard ", file,
          " but that file does not contain it");
    out.emplace(name, t->second);
  }
  return out;
}

void write_safetensors(const std::string& path, const std::vector<TensorSpec>& tensors, const TensorSource& tensor,
                       const std::map<std::string, std::string>& metadata) {
  // The header from the declared dtypes and shapes, in the given order; data follows in that order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = meta;
  }
  uint64_t offset = 0;
  std::set<std::string> seen;
  for (const TensorSpec& spec : tensors) {
    const std::string& name = spec.name;
    check(name != "__metadata__", path, ": \"__metadata__\" cannot be a tensor name");
    check(seen.insert(name).second, path, ": tensor \"", name, "\" is given twice");
    for (int64_t d : spec.shape)
      check(d >= 0, path, ": tensor \"", name, "\" has negative shape ", shape_str(spec.shape));
    const uint64_t nbytes = uint64_t(num_elements(spec.shape)) * dtype_size(spec.dtype);
    header[name] = {{"dtype", safetensors_dtype_name(spec.dtype)},
                    {"shape", spec.shape},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const nlohmann::ordered_json::exception& e) {  // e.g. a name that is not valid UTF-8
    fail(path, ": cannot encode safetensors header: ", e.what());
  }
  // Pad with spaces so the data starts at an 8-byte boundary (8 + N is a multiple of 8).
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  unsigned char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(uint64_t(header_text.size()) >> (8 * i));

  write_stream_atomically(path, [&](std::FILE* out) {
    std::fwrite(len_bytes, 1, 8, out);
    std::fwrite(header_text.data(), 1, header_text.size(), out);
    for (size_t i = 0; i < tensors.size(); ++i) {
      const TensorSpec& spec = tensors[i];
      const HostTensor t = tensor(i);  // freed (unless someone else holds it) once written
      check_declared(t, spec, path);
      if (t.nbytes() > 0) std::fwrite(t.data, 1, t.nbytes(), out);
    }
  });
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, HostTensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.dtype, t.shape});
  write_safetensors(path, specs, [&](size_t i) { return tensors[i].second; }, metadata);
}

}  // namespace meshtune
