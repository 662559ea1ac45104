// DeviceMesh: ranks laid out row-major on the mesh (as jax reshapes its device list), with one
// sub-communicator per axis.
#include "distribution/mesh.h"

#include <charconv>
#include <cstdint>
#include <set>

#include "core/error.h"

namespace meshtune {

namespace {

std::string shape_text(const std::vector<int>& shape) {
  std::string text;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += "x";
    text += std::to_string(shape[i]);
  }
  return text;
}

bool valid_axis_name(const std::string& name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    char c = name[i];
    bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    bool digit = c >= '0' && c <= '9';
    if (!letter && !(digit && i > 0)) return false;
  }
  return true;
}

std::string trim(const std::string& text) {
  size_t begin = text.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  size_t end = text.find_last_not_of(" \t");
  return text.substr(begin, end - begin + 1);
}

// Splits on `separator`, keeping empty parts (so "1x" and ",a" are caught as errors).
std::vector<std::string> split_text(const std::string& text, char separator) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    size_t at = text.find(separator, start);
    parts.push_back(text.substr(start, at == std::string::npos ? std::string::npos : at - start));
    if (at == std::string::npos) break;
    start = at + 1;
  }
  return parts;
}

}  // namespace

DeviceMesh::DeviceMesh(std::vector<int> shape, std::vector<std::string> axis_names,
                       Communicator& comm)
    : shape_(std::move(shape)), names_(std::move(axis_names)), comm_(comm) {
  // Validation depends only on the arguments and comm.size(), so every rank throws (or not) alike,
  // before any collective below.
  check(!shape_.empty(), "mesh: the shape is empty");
  check(names_.size() == shape_.size(), "mesh ", shape_text(shape_), ": ", shape_.size(),
        " dimensions but ", names_.size(), " axis names");
  int64_t devices = 1;
  for (int s : shape_) {
    check(s > 0, "mesh ", shape_text(shape_), ": axis sizes must be positive");
    devices *= s;
    check(devices <= INT32_MAX, "mesh ", shape_text(shape_), " is too large");
  }
  std::set<std::string> seen;
  for (const std::string& name : names_) {
    check(valid_axis_name(name), "mesh ", shape_text(shape_), ": invalid axis name '", name, "'");
    check(seen.insert(name).second, "mesh ", shape_text(shape_), ": duplicate axis name '", name,
          "'");
  }
  check(devices == comm_.size(), "mesh ", shape_text(shape_), " has ", devices,
        " devices but the job has ", comm_.size(), " process", comm_.size() == 1 ? "" : "es");

  // Row-major: the last axis varies fastest.
  coords_.assign(shape_.size(), 0);
  int rest = comm_.rank();
  for (size_t a = shape_.size(); a-- > 0;) {
    coords_[a] = rest % shape_[a];
    rest /= shape_[a];
  }

  // Axis a's members share every other coordinate: color = their row-major linear index,
  // key = the coordinate along a (so the sub-communicator's rank is that coordinate).
  for (size_t a = 0; a < shape_.size(); ++a) {
    int color = 0;
    for (size_t b = 0; b < shape_.size(); ++b) {
      if (b != a) color = color * shape_[b] + coords_[b];
    }
    axis_comms_.push_back(comm_.split(color, coords_[a]));
  }
}

int DeviceMesh::size() const {
  int total = 1;
  for (int s : shape_) total *= s;
  return total;
}

int DeviceMesh::axis_index(const std::string& name) const {
  for (size_t a = 0; a < names_.size(); ++a) {
    if (names_[a] == name) return int(a);
  }
  return -1;
}

std::string DeviceMesh::describe() const {
  // Python tuple reprs, as keras prints them: "(1, 8) ('batch', 'model')", "(8,) ('batch',)".
  std::string sizes = "(", names = "(";
  for (size_t a = 0; a < shape_.size(); ++a) {
    if (a > 0) {
      sizes += ", ";
      names += ", ";
    }
    sizes += std::to_string(shape_[a]);
    names += "'" + names_[a] + "'";
  }
  if (shape_.size() == 1) {
    sizes += ",";
    names += ",";
  }
  return sizes + ") " + names + ")";
}

std::vector<int> DeviceMesh::parse_shape(const std::string& text) {
  std::vector<int> shape;
  for (const std::string& raw : split_text(text, 'x')) {
    std::string part = trim(raw);
    int value = 0;
    const char* end = part.data() + part.size();
    auto [ptr, ec] = std::from_chars(part.data(), end, value);
    check(!part.empty() && ec == std::errc() && ptr == end && value > 0, "invalid mesh shape '",
          text, "': expected positive sizes joined by 'x', such as 1x8 or 2x2");
    shape.push_back(value);
  }
  return shape;
}

std::vector<std::string> DeviceMesh::parse_axes(const std::string& text) {
  std::vector<std::string> names;
  for (const std::string& raw : split_text(text, ',')) {
    std::string name = trim(raw);
    check(valid_axis_name(name), "invalid mesh axis names '", text,
          "': expected names joined by commas, such as batch,model");
    for (const std::string& other : names) {
      check(other != name, "invalid mesh axis names '", text, "': '", name, "' appears twice");
    }
    names.push_back(name);
  }
  return names;
}

}  // namespace meshtune
