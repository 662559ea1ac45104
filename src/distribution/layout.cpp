// LayoutMap (spec §10): exact key, else the single full-matching regex, else replicated; resolve()
// checks a spec against a variable's shape and the mesh so a bad layout fails before any work.
#include "distribution/layout.h"

#include <sstream>

#include "core/error.h"
#include "core/file_util.h"
#include "core/json.h"

namespace meshtune {

namespace {

std::string trim(const std::string& s) {
  size_t begin = s.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  size_t end = s.find_last_not_of(" \t\r\n");
  return s.substr(begin, end - begin + 1);
}

std::string join_axes(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + names[i];
  return out;
}

}  // namespace

std::string partition_spec_str(const PartitionSpec& spec) {
  std::string out = "PartitionSpec(";
  for (size_t i = 0; i < spec.size(); ++i) {
    if (i) out += ", ";
    out += spec[i] ? "'" + *spec[i] + "'" : "None";
  }
  return out + ")";
}

void LayoutMap::add(const std::string& key, const PartitionSpec& spec) {
  check(!key.empty(), "layout rule has an empty key");
  for (const auto& [existing, _] : rules_)
    check(existing != key, "layout rule '", brief(key), "' is given twice");
  UserRegex regex(key, "layout rule '" + brief(key) + "'");  // a broken regex fails here, not at the first lookup
  for (const auto& axis : spec)
    check(!axis || !axis->empty(), "layout rule '", brief(key), "' has an empty axis name (use null/None for none)");
  rules_.emplace_back(key, spec);
  regexes_.push_back(std::move(regex));
}

LayoutMap LayoutMap::from_json_file(const std::string& path) {
  const std::string source = "layout file " + path;
  const json doc = parse_json(read_file(path, kMaxJsonFileBytes), source);
  const JsonValue root(doc, source);
  check(root.is_object(), source, ": expected a JSON object {\"regex\": [null, \"model\"], ...}");
  LayoutMap map;
  for (const auto& [key, value] : root.members()) {
    const std::string rule = source + ": rule '" + brief(key) + "'";
    check(value.is_array(), rule, " must be an array of axis names or null");
    PartitionSpec spec;
    for (const JsonValue& entry : value.elements()) {
      check(entry.is_null() || entry.is_string(), rule, " must be an array of axis names or null");
      if (entry.is_null()) spec.push_back(std::nullopt);
      else spec.push_back(entry.string());
    }
    try {
      map.add(key, spec);
    } catch (const Error& e) {
      fail(source, ": ", e.what());
    }
  }
  return map;
}

void LayoutMap::add_rule_text(const std::string& text) {
  // Split at the LAST '=': a regex may contain '=' (e.g. "a{1,}=?"), an axis list never does.
  size_t eq = text.rfind('=');
  check(eq != std::string::npos, "layout rule '", text, "' has no '=' (expected REGEX=axis,axis,... e.g. 'decoder_block.*ffw_linear.kernel=model,None')");
  std::string key = text.substr(0, eq), axes = text.substr(eq + 1);
  check(!key.empty(), "layout rule '", text, "' has an empty regex before '='");
  check(!trim(axes).empty(), "layout rule '", text, "' has no axis entries after '=' (use None for a replicated dimension)");
  PartitionSpec spec;
  std::stringstream ss(axes);
  std::string entry;
  while (std::getline(ss, entry, ',')) {
    entry = trim(entry);
    if (entry.empty() || entry == "None" || entry == "null") spec.push_back(std::nullopt);
    else spec.push_back(entry);
  }
  if (!axes.empty() && axes.back() == ',') spec.push_back(std::nullopt);  // getline drops a trailing empty entry
  add(key, spec);
}

std::optional<std::pair<std::string, PartitionSpec>> LayoutMap::lookup_rule(const std::string& path) const {
  for (const auto& rule : rules_)
    if (rule.first == path) return rule;
  const std::pair<std::string, PartitionSpec>* found = nullptr;
  for (size_t i = 0; i < rules_.size(); ++i) {
    if (!regexes_[i].full_match(path)) continue;  // full match, as Keras ≥ 3.14 (re.fullmatch)
    check(!found, "variable ", path, " matches more than one layout rule: '", found ? found->first : "", "' and '",
          rules_[i].first, "' (each variable may match at most one rule)");
    found = &rules_[i];
  }
  if (!found) return std::nullopt;
  return *found;
}

std::optional<PartitionSpec> LayoutMap::lookup(const std::string& path) const {
  auto rule = lookup_rule(path);
  if (!rule) return std::nullopt;
  return rule->second;
}

PartitionSpec LayoutMap::resolve(const std::string& path, const Shape& shape, const DeviceMesh& mesh) const {
  return resolve(path, shape, mesh.shape(), mesh.axis_names());
}

PartitionSpec LayoutMap::resolve(const std::string& path, const Shape& shape, const std::vector<int>& mesh_shape,
                                 const std::vector<std::string>& axis_names) const {
  check(mesh_shape.size() == axis_names.size(), "mesh has ", mesh_shape.size(), " sizes but ", axis_names.size(),
        " axis names");
  auto rule = lookup_rule(path);
  if (!rule) return PartitionSpec(shape.size(), std::nullopt);
  const std::string& key = rule->first;
  const PartitionSpec& spec = rule->second;
  check(spec.size() == shape.size(), "layout rule '", brief(key), "' gives ", spec.size(), " entries for ", path,
        " of shape ", shape_str(shape), " (rank ", shape.size(), ")");
  for (size_t d = 0; d < spec.size(); ++d) {
    if (!spec[d]) continue;
    const std::string& axis = *spec[d];
    size_t a = 0;
    while (a < axis_names.size() && axis_names[a] != axis) ++a;
    check(a < axis_names.size(), "layout rule '", brief(key), "': dimension ", d, " of ", path, ": axis '", axis,
          "' is not a mesh axis (mesh axes: ", join_axes(axis_names), ")");
    for (size_t e = 0; e < d; ++e)
      check(spec[e] != spec[d], "layout rule '", brief(key), "': axis '", axis, "' is used for both dimension ", e,
            " and dimension ", d, " of ", path, " (an axis may split one dimension only)");
    int size = mesh_shape[a];
    check(shape[d] % size == 0, "layout rule '", brief(key), "': dimension ", d, " (size ", shape[d], ") of ", path,
          " is not divisible by axis '", axis, "' of size ", size);
  }
  return spec;
}

std::vector<std::string> LayoutMap::warnings_for(const std::string& path, const Shape& shape,
                                                 const PartitionSpec& spec, const std::vector<int>& mesh_shape) {
  long long devices = 1;
  for (int s : mesh_shape) devices *= s;
  bool replicated = true;
  for (const auto& axis : spec) replicated = replicated && !axis;
  double bytes = double(num_elements(shape)) * 4;
  std::vector<std::string> out;
  if (devices > 1 && replicated && bytes >= 1024.0 * 1024.0) {
    std::ostringstream msg;
    msg << "warning: " << path << " " << shape_str(shape) << " (" << bytes / (1024.0 * 1024.0)
        << " MiB as fp32) is replicated (no mesh axis splits it) on all " << devices << " devices";
    out.push_back(msg.str());
  }
  return out;
}

}  // namespace meshtune
