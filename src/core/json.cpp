#include "core/json.h"

#include <cmath>

#include "core/file_util.h"

namespace meshtune {

namespace {

// The deepest nesting of arrays/objects in `text`, stopping early past `limit` (strings skipped).
int nesting_depth(std::string_view text, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
      if (deepest > limit) return deepest;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

const char* type_name(const json& v) { return v.type_name(); }

// A short rendering of a value for "got …" (bounded: values are at most kMaxJsonDepth deep).
std::string shown(const json& v) { return brief(v.dump(-1, ' ', false, json::error_handler_t::replace), 60); }

}  // namespace

json parse_json(std::string_view text, const std::string& source, int max_depth) {
  check(nesting_depth(text, max_depth) <= max_depth, source, ": JSON nested more than ", max_depth, " levels deep");
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    fail(source, ": not valid JSON: ", brief(e.what(), 200));
  }
}

json read_json_file(const std::string& path) {
  return parse_json(read_file(path, kMaxJsonFileBytes), path);
}

JsonValue::JsonValue(const json& value, std::string source, std::string path)
    : value_(&value), source_(std::move(source)), path_(std::move(path)) {}

std::string JsonValue::where() const { return path_.empty() ? source_ : source_ + ": " + path_; }

std::string JsonValue::child_path(const std::string& key) const {
  const std::string k = brief(key, 60);
  const bool plain = !k.empty() && k.find_first_of(".[]\" ") == std::string::npos;
  const std::string part = plain ? k : "['" + k + "']";
  if (path_.empty()) return part;
  return plain ? path_ + "." + part : path_ + part;
}

bool JsonValue::has(const std::string& key) const {
  if (!value_->is_object()) return false;
  auto it = value_->find(key);
  return it != value_->end() && !it->is_null();
}

JsonValue JsonValue::operator[](const std::string& key) const {
  if (!value_->is_object()) fail("expected an object, got ", type_name(*value_));
  auto it = value_->find(key);
  if (it == value_->end()) fail("missing \"", brief(key, 60), "\"");
  return JsonValue(*it, source_, child_path(key));
}

std::optional<JsonValue> JsonValue::find(const std::string& key) const {
  if (!value_->is_object()) fail("expected an object, got ", type_name(*value_));
  auto it = value_->find(key);
  if (it == value_->end() || it->is_null()) return std::nullopt;
  return JsonValue(*it, source_, child_path(key));
}

std::vector<std::pair<std::string, JsonValue>> JsonValue::members() const {
  if (!value_->is_object()) fail("expected an object, got ", type_name(*value_));
  std::vector<std::pair<std::string, JsonValue>> out;
  for (auto it = value_->begin(); it != value_->end(); ++it)
    out.emplace_back(it.key(), JsonValue(it.value(), source_, child_path(it.key())));
  return out;
}

size_t JsonValue::size() const {
  if (!value_->is_array()) fail("expected an array, got ", type_name(*value_));
  return value_->size();
}

JsonValue JsonValue::operator[](size_t i) const {
  if (i >= size()) fail("has ", size(), " entries, entry ", i, " is missing");
  return JsonValue((*value_)[i], source_, path_ + "[" + std::to_string(i) + "]");
}

std::vector<JsonValue> JsonValue::elements() const {
  std::vector<JsonValue> out;
  const size_t n = size();
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.push_back((*this)[i]);
  return out;
}

int64_t JsonValue::integer(int64_t lo, int64_t hi) const {
  auto range = [&] { fail("must be an integer in [", lo, ", ", hi, "], got ", shown(*value_)); };
  int64_t v = 0;
  if (value_->is_number_unsigned()) {
    const uint64_t u = value_->get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max())) range();
    v = int64_t(u);
  } else if (value_->is_number_integer()) {
    v = value_->get<int64_t>();
  } else if (value_->is_number_float()) {  // 4096.0 is 4096; 0.5 and 1e300 are not integers
    const double d = value_->get<double>();
    if (!(std::fabs(d) < 9.0e18) || d != std::floor(d)) range();
    v = int64_t(d);
  } else {
    range();
  }
  if (v < lo || v > hi) range();
  return v;
}

double JsonValue::number() const {
  if (!value_->is_number()) fail("must be a number, got ", shown(*value_));
  const double d = value_->get<double>();
  if (!std::isfinite(d)) fail("must be a finite number, got ", shown(*value_));
  return d;
}

double JsonValue::number(double lo, double hi) const {
  const double d = number();
  if (d < lo || d > hi) fail("must be a number in [", lo, ", ", hi, "], got ", shown(*value_));
  return d;
}

bool JsonValue::boolean() const {
  if (!value_->is_boolean()) fail("must be true or false, got ", shown(*value_));
  return value_->get<bool>();
}

const std::string& JsonValue::string() const {
  if (!value_->is_string()) fail("must be a string, got ", shown(*value_));
  return value_->get_ref<const std::string&>();
}

std::vector<int64_t> JsonValue::integers(size_t count, int64_t lo, int64_t hi) const {
  if (size() != count) fail("must have ", count, " entries, got ", size());
  std::vector<int64_t> out;
  for (size_t i = 0; i < count; ++i) out.push_back((*this)[i].integer(lo, hi));
  return out;
}

int64_t JsonValue::integer_or(const std::string& key, int64_t fallback, int64_t lo, int64_t hi) const {
  auto v = find(key);
  return v ? v->integer(lo, hi) : fallback;
}

double JsonValue::number_or(const std::string& key, double fallback) const {
  auto v = find(key);
  return v ? v->number() : fallback;
}

bool JsonValue::boolean_or(const std::string& key, bool fallback) const {
  auto v = find(key);
  return v ? v->boolean() : fallback;
}

std::string JsonValue::string_or(const std::string& key, const std::string& fallback) const {
  auto v = find(key);
  return v ? v->string() : fallback;
}

}  // namespace meshtune
