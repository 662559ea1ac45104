#include "data/dataset.h"
#include "data/sample_chat.h"
#include "data/sample_reviews.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string_view>

#include "core/error.h"
#include "core/file_util.h"
#include "core/json.h"
#include "io/npy.h"
#include "data/crc32c.h"

namespace meshtune {

namespace fs = std::filesystem;

namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

// Python's bytes.strip(): tfds strips every aclImdb review this way.
std::string strip(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && is_space(s[b])) ++b;
  while (e > b && is_space(s[e - 1])) --e;
  return s.substr(b, e - b);
}

bool is_blank(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return is_space(c); });
}

// Regular files directly in `dir` whose name satisfies `keep`, sorted by file name.
template <typename Pred>
std::vector<fs::path> list_files(const fs::path& dir, Pred keep) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_regular_file() && keep(entry.path().filename().string())) files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end(),
            [](const fs::path& a, const fs::path& b) { return a.filename().string() < b.filename().string(); });
  return files;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_tfrecord_name(const std::string& name) { return name.find(".tfrecord") != std::string::npos; }

// Splits into lines (without '\n' or a trailing '\r'), keeping their 1-based numbers implicit.
std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
    start = end + 1;
  }
  return lines;
}

uint64_t load_u64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // little-endian host (see core/npy.cpp)
  return v;
}
uint32_t load_u32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
void append_u64(std::string& out, uint64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); }
void append_u32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }

// ---- tf.train.Example in protobuf wire format ----
// Hand-written rather than protoc-generated: Debian's libsentencepiece.so exports its own bundled
// protobuf-lite, and loading the system libprotobuf beside it mixes two protobuf versions in one
// process (it crashes at start-up). The messages involved are tiny:
//   Example { Features features = 1; }
//   Features { map<string, Feature> feature = 1; }   // entry: key = 1, value = 2
//   Feature { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
//   BytesList { repeated bytes value = 1; }

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLen = 2, kFixed32 = 5 };

struct WireError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Reads one message's fields in order.
class WireReader {
 public:
  explicit WireReader(std::string_view data) : p_(data.data()), end_(data.data() + data.size()) {}
  bool done() const { return p_ == end_; }

  // The next field's number and wire type.
  void next(uint32_t& number, uint32_t& wire_type) {
    const uint64_t tag = varint();
    number = uint32_t(tag >> 3);
    wire_type = uint32_t(tag & 7);
    if (number == 0 || tag >> 32) throw WireError("bad field tag");
  }
  // The payload of a length-delimited field.
  std::string_view bytes() {
    const uint64_t n = varint();
    if (n > uint64_t(end_ - p_)) throw WireError("length past the end");
    std::string_view out(p_, size_t(n));
    p_ += n;
    return out;
  }
  void skip(uint32_t wire_type) {
    switch (wire_type) {
      case kVarint: varint(); break;
      case kFixed64: advance(8); break;
      case kLen: bytes(); break;
      case kFixed32: advance(4); break;
      default: throw WireError("unsupported wire type " + std::to_string(wire_type));
    }
  }

 private:
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_ == end_) throw WireError("truncated varint");
      const uint8_t b = uint8_t(*p_++);
      v |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    throw WireError("varint longer than 10 bytes");
  }
  void advance(size_t n) {
    if (n > size_t(end_ - p_)) throw WireError("truncated fixed-width field");
    p_ += n;
  }
  const char* p_;
  const char* end_;
};

// Calls visit(number, payload) for each length-delimited field; skips others after checking them.
template <typename Visit>
void for_each_len_field(std::string_view message, Visit visit) {
  WireReader r(message);
  while (!r.done()) {
    uint32_t number, wire_type;
    r.next(number, wire_type);
    if (wire_type == kLen) {
      visit(number, r.bytes());
    } else {
      r.skip(wire_type);
    }
  }
}

// One feature as found in an Example: which oneof member is set, and a BytesList's values.
struct FeatureValue {
  bool found = false;
  int kind = 0;  // Feature field number: 1 bytes_list, 2 float_list, 3 int64_list, 0 unset
  std::vector<std::string> bytes;
};

// Looks up feature `name` in a serialized Example. Later occurrences override earlier ones, as a
// protobuf parser merges repeated message fields and map entries. Throws WireError if malformed.
FeatureValue find_feature(std::string_view example, const std::string& name) {
  FeatureValue result;
  for_each_len_field(example, [&](uint32_t number, std::string_view features) {
    if (number != 1) return;  // Example.features
    for_each_len_field(features, [&](uint32_t number, std::string_view entry) {
      if (number != 1) return;  // Features.feature map entry
      std::string_view key, value;
      for_each_len_field(entry, [&](uint32_t number, std::string_view payload) {
        if (number == 1) key = payload;
        if (number == 2) value = payload;
      });
      if (key != name) return;
      result = FeatureValue{};
      result.found = true;
      for_each_len_field(value, [&](uint32_t number, std::string_view list) {
        if (number < 1 || number > 3) return;
        result.kind = int(number);  // oneof: the last member seen wins
        result.bytes.clear();
        if (number != 1) {
          for_each_len_field(list, [](uint32_t, std::string_view) {});  // still must be well-formed
          return;
        }
        for_each_len_field(list, [&](uint32_t number, std::string_view v) {
          if (number == 1) result.bytes.emplace_back(v);
        });
      });
    });
  });
  return result;
}

void append_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(uint8_t(v) | 0x80));
    v >>= 7;
  }
  out.push_back(char(v));
}

// Appends a length-delimited field: tag, length, payload.
void append_len_field(std::string& out, uint32_t number, std::string_view payload) {
  append_varint(out, (uint64_t(number) << 3) | kLen);
  append_varint(out, payload.size());
  out.append(payload);
}

// Example { features { feature { key: "text" value { bytes_list { value: text } } } } }
std::string serialize_text_example(const std::string& text) {
  std::string bytes_list, feature, entry, features, example;
  append_len_field(bytes_list, 1, text);
  append_len_field(feature, 1, bytes_list);
  append_len_field(entry, 1, "text");
  append_len_field(entry, 2, feature);
  append_len_field(features, 1, entry);
  append_len_field(example, 1, features);
  return example;
}

// ---- TFRecord ----

void read_tfrecord_file(const fs::path& file, const std::string& field, std::vector<std::string>& texts) {
  const std::string path = file.string();
  const std::string bytes = read_file(path);
  size_t pos = 0;
  for (size_t record = 0; pos < bytes.size(); ++record) {
    // Framing: u64 length, u32 masked CRC of the length, data, u32 masked CRC of the data.
    check(bytes.size() - pos >= 12, "file ", path, ": record ", record, ": truncated header at byte ", pos);
    const uint64_t length = load_u64(bytes.data() + pos);
    check(masked_crc32c(bytes.data() + pos, 8) == load_u32(bytes.data() + pos + 8), "file ", path, ": record ",
          record, ": length CRC mismatch at byte ", pos, " (corrupt TFRecord)");
    pos += 12;
    check(length <= bytes.size() - pos && bytes.size() - pos - length >= 4, "file ", path, ": record ", record,
          ": truncated data (", length, " bytes announced)");
    const char* data = bytes.data() + pos;
    check(masked_crc32c(data, length) == load_u32(data + length), "file ", path, ": record ", record,
          ": data CRC mismatch (corrupt TFRecord)");
    pos += length + 4;

    FeatureValue feature;
    try {
      feature = find_feature(std::string_view(data, size_t(length)), field);
    } catch (const WireError& e) {
      fail("file ", path, ": record ", record, " is not a tf.train.Example (", e.what(), ")");
    }
    check(feature.found, "file ", path, ": record ", record, " has no feature '", field, "'");
    check(feature.kind == 1 && feature.bytes.size() == 1, "file ", path, ": record ", record, ": feature '",
          field, "' is not a single bytes value");
    texts.push_back(std::move(feature.bytes[0]));
  }
}

std::vector<std::string> load_tfrecord(const fs::path& path, const std::string& field) {
  std::vector<fs::path> files;
  if (fs::is_directory(path)) {
    files = list_files(path, is_tfrecord_name);
  } else {
    files.push_back(path);
  }
  std::vector<std::string> texts;
  for (const auto& f : files) read_tfrecord_file(f, field, texts);
  return texts;
}

std::vector<std::string> load_aclimdb(const fs::path& path) {
  // Either the aclImdb root (its train split) or a split folder holding pos/neg/unsup.
  const fs::path split = fs::is_directory(path / "train") ? path / "train" : path;
  std::vector<std::string> texts;
  bool any_folder = false;
  for (const char* label : {"pos", "neg", "unsup"}) {
    const fs::path dir = split / label;
    if (!fs::is_directory(dir)) continue;
    any_folder = true;
    for (const auto& f : list_files(dir, [](const std::string& n) { return ends_with(n, ".txt"); })) {
      texts.push_back(strip(read_file(f.string())));
    }
  }
  check(any_folder, "aclImdb folder ", path.string(), ": no train/ or pos/neg/unsup folders in ", split.string());
  return texts;
}

// A field of one JSONL object: `name`, or its singular/plural twin when `name` is a default.
const json* find_field(const json& obj, const std::string& name, const char* twin) {
  if (auto it = obj.find(name); it != obj.end()) return &*it;
  if (twin)
    if (auto it = obj.find(twin); it != obj.end()) return &*it;
  return nullptr;
}

// Text examples, or prompt/response pairs when the first example has both pair fields.
void load_jsonl(const fs::path& path, const DataFields& fields, Dataset& data) {
  const std::string file = path.string();
  const std::vector<std::string> lines = split_lines(read_file(file));
  const char* prompt_twin = fields.prompt == "prompts" ? "prompt" : nullptr;
  const char* response_twin = fields.response == "responses" ? "response" : nullptr;
  int pairs = -1;  // decided by the first example: 0 texts, 1 prompt/response pairs, 2 conversations
  for (size_t i = 0; i < lines.size(); ++i) {
    if (is_blank(lines[i])) continue;
    const std::string where = "file " + file + " line " + std::to_string(i + 1);
    const json obj = parse_json(lines[i], where);
    check(obj.is_object(), where, ": not a JSON object");
    const json* prompt = find_field(obj, fields.prompt, prompt_twin);
    const json* response = find_field(obj, fields.response, response_twin);
    if (pairs < 0) pairs = obj.contains("messages") ? 2 : prompt && response && !obj.contains(fields.text) ? 1 : 0;
    if (pairs == 2) {  // a conversation
      const JsonValue messages = JsonValue(obj, where)["messages"];
      std::vector<ChatMessage> conversation;
      for (const JsonValue& m : messages.elements()) conversation.push_back({m["role"].string(), m["content"].string()});
      validate_chat(conversation, true, where);
      data.conversations.push_back(std::move(conversation));
    } else if (pairs == 1) {
      check(prompt && response, where, ": no field '", brief(prompt ? fields.response : fields.prompt),
            "' (the file's first example is a prompt/response pair)");
      check(prompt->is_string() && response->is_string(), where, ": fields '", brief(fields.prompt), "' and '",
            brief(fields.response), "' must be strings");
      check(!response->get_ref<const std::string&>().empty(), where, ": empty response");
      data.texts.push_back(prompt->get<std::string>());
      data.responses.push_back(response->get<std::string>());
    } else {
      auto it = obj.find(fields.text);
      check(it != obj.end(), where, ": no field '", brief(fields.text), "'");
      check(it->is_string(), where, ": field '", brief(fields.text), "' is not a string");
      data.texts.push_back(it->get<std::string>());
    }
  }
}

std::vector<std::string> load_text(const fs::path& path) {
  std::vector<std::string> texts;
  if (fs::is_directory(path)) {
    // One example per file; empty files are skipped like blank lines.
    for (const auto& f : list_files(path, [](const std::string& n) { return ends_with(n, ".txt"); })) {
      std::string text = strip(read_file(f.string()));
      if (!text.empty()) texts.push_back(std::move(text));
    }
    return texts;
  }
  for (auto& line : split_lines(read_file(path.string()))) {
    if (!is_blank(line)) texts.push_back(std::move(line));
  }
  return texts;
}

std::vector<std::vector<int32_t>> load_npy_rows(const fs::path& path) {
  const std::string file = path.string();
  const HostTensor t = read_npy(file);
  check(t.dtype == DType::I32 || t.dtype == DType::I64, "file ", file, ": token ids must be int32 or int64, got ",
        dtype_name(t.dtype));
  check(t.shape.size() == 2, "file ", file, ": token ids must be 2-D [N, T+1], got shape ", shape_str(t.shape));
  check(t.shape[1] >= 2, "file ", file, ": rows need T+1 >= 2 ids, got shape ", shape_str(t.shape));
  const int64_t n = t.shape[0], width = t.shape[1];
  std::vector<std::vector<int32_t>> rows(static_cast<size_t>(n), std::vector<int32_t>(static_cast<size_t>(width)));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < width; ++c) {
      const int64_t i = r * width + c;
      int64_t v = t.dtype == DType::I32 ? t.as<int32_t>()[i] : t.as<int64_t>()[i];
      check(v >= 0 && v <= INT32_MAX, "file ", file, ": row ", r, " column ", c, ": token id ", v, " out of range");
      rows[size_t(r)][size_t(c)] = int32_t(v);
    }
  }
  return rows;
}

}  // namespace

Dataset load_dataset(const std::string& spec, const DataFields& fields) {
  if (spec == "sample-chat") {  // the project's own question/answer conversations, built in
    Dataset data;
    data.source = spec;
    data.conversations = sample_chat();
    return data;
  }
  if (spec == "sample") {  // the project's own movie reviews, built in
    Dataset data;
    data.source = spec;
    data.texts = sample_reviews();
    return data;
  }
  // An explicit KIND: prefix, else detect the kind from the path.
  std::string kind, path = spec;
  for (const char* k : {"tfrecord", "aclimdb", "jsonl", "text", "npy"}) {
    const std::string prefix = std::string(k) + ":";
    if (spec.compare(0, prefix.size(), prefix) == 0) {
      kind = k;
      path = spec.substr(prefix.size());
      break;
    }
  }
  check(!path.empty(), "data ", spec, ": no path given");
  if (!fs::exists(path)) fail_not_found("data ", spec, ": ", path, " does not exist");
  if (kind.empty()) {
    const std::string name = fs::path(path).filename().string();
    if (fs::is_directory(path)) {
      kind = fs::is_directory(fs::path(path) / "train") ? "aclimdb" : "text";
    } else if (ends_with(name, ".jsonl")) {
      kind = "jsonl";
    } else if (ends_with(name, ".npy")) {
      kind = "npy";
    } else if (is_tfrecord_name(name)) {
      kind = "tfrecord";
    } else {
      kind = "text";
    }
  }
  if (kind == "aclimdb") check(fs::is_directory(path), "data ", spec, ": ", path, " is not a directory");
  if (kind == "jsonl" || kind == "npy") check(fs::is_regular_file(path), "data ", spec, ": ", path, " is not a file");

  Dataset data;
  data.source = spec;
  if (kind == "tfrecord") data.texts = load_tfrecord(path, fields.text);
  if (kind == "aclimdb") data.texts = load_aclimdb(path);
  if (kind == "jsonl") load_jsonl(path, fields, data);
  if (kind == "text") data.texts = load_text(path);
  if (kind == "npy") data.token_rows = load_npy_rows(path);
  check(data.size() > 0, "data ", spec, ": no examples in ", path);
  return data;
}

void write_tfrecord_texts(const std::string& path, const std::vector<std::string>& texts) {
  std::string out;
  for (const auto& text : texts) {
    const std::string record = serialize_text_example(text);
    std::string length;
    append_u64(length, record.size());
    out += length;
    append_u32(out, masked_crc32c(length.data(), length.size()));
    out += record;
    append_u32(out, masked_crc32c(record.data(), record.size()));
  }
  write_file_atomic(path, out);
}

}  // namespace meshtune
