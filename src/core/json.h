// Checked JSON access. Every JSON value read from a file goes through `JsonValue`, which carries the
// file and the key path it came from, so each error is one line such as
//   model/config.json: config.vocabulary_size: must be an integer in [1, 16777216], got 4294967297
// Integers are range-checked before they are narrowed (nothing wraps), nesting is limited before
// parsing (nlohmann's dump, copy and compare recurse), and nothing is dumped unless an error is raised.
#pragma once
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace meshtune {

using json = nlohmann::json;

inline constexpr int kMaxJsonDepth = 64;
inline constexpr size_t kMaxJsonFileBytes = size_t(256) << 20;  // any config, index, manifest or layout

// Parses `text`; errors name `source`. Refuses nesting deeper than `max_depth`, invalid UTF-8 and
// anything that is not one JSON document.
json parse_json(std::string_view text, const std::string& source, int max_depth = kMaxJsonDepth);
// Reads and parses a file (at most kMaxJsonFileBytes).
json read_json_file(const std::string& path);

class JsonValue {
 public:
  // `value` must outlive this view (and every view taken from it).
  JsonValue(const json& value, std::string source, std::string path = "");

  const json& raw() const { return *value_; }
  // "source: path" (or "source" at the root): the prefix of every error about this value.
  std::string where() const;

  bool is_null() const { return value_->is_null(); }
  bool is_object() const { return value_->is_object(); }
  bool is_array() const { return value_->is_array(); }
  bool is_string() const { return value_->is_string(); }
  bool is_number() const { return value_->is_number(); }

  // Object members. `has` is true for a present, non-null member.
  bool has(const std::string& key) const;
  JsonValue operator[](const std::string& key) const;            // required member
  std::optional<JsonValue> find(const std::string& key) const;   // absent or null → nullopt
  std::vector<std::pair<std::string, JsonValue>> members() const;  // requires an object
  // Array elements.
  size_t size() const;                   // requires an array
  JsonValue operator[](size_t i) const;  // requires an array and i < size()
  std::vector<JsonValue> elements() const;

  // Typed values; each fails naming where() when the type or range is wrong.
  int64_t integer(int64_t lo = std::numeric_limits<int64_t>::min(),
                  int64_t hi = std::numeric_limits<int64_t>::max()) const;  // exact integers only
  int to_int(int lo, int hi) const { return int(integer(lo, hi)); }
  double number() const;  // finite
  double number(double lo, double hi) const;
  bool boolean() const;
  const std::string& string() const;
  std::vector<int64_t> integers(size_t count, int64_t lo, int64_t hi) const;  // an array of exactly `count`

  // Optional members with a fallback when absent or null.
  int64_t integer_or(const std::string& key, int64_t fallback, int64_t lo, int64_t hi) const;
  double number_or(const std::string& key, double fallback) const;
  bool boolean_or(const std::string& key, bool fallback) const;
  std::string string_or(const std::string& key, const std::string& fallback) const;

  template <typename... Args>
  [[noreturn]] void fail(const Args&... args) const {
    meshtune::fail(where(), ": ", args...);
  }

 private:
  std::string child_path(const std::string& key) const;
  const json* value_;
  std::string source_, path_;
};

}  // namespace meshtune
