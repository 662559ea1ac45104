// LayoutMap with Keras ≥ 3.14 semantics (spec §10): keys are an exact variable path or a regex
// matched with full match; an exact key wins; several matching regexes is an error; no match means
// replicated. Each value has one mesh-axis name or null per tensor dimension (a PartitionSpec).
#pragma once
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "core/user_regex.h"
#include "distribution/mesh.h"

namespace meshtune {

using PartitionSpec = std::vector<std::optional<std::string>>;  // per dimension: axis name or none

std::string partition_spec_str(const PartitionSpec& spec);  // "PartitionSpec(None, 'model', None)"

class LayoutMap {
 public:
  // Adds a rule; throws Error naming the key for an invalid regex or a duplicate key.
  void add(const std::string& key, const PartitionSpec& spec);
  // Rules from a JSON object file {"regex": [null, "model"], ...}; errors name the file and key.
  static LayoutMap from_json_file(const std::string& path);
  // "REGEX=,model" / "REGEX=model,None,None": comma-separated entries, empty or None/null = none.
  void add_rule_text(const std::string& text);
  // The spec for a variable path: exact key, else the one full-matching regex; none → nullopt.
  // Throws Error naming the path and both keys when two regexes match.
  std::optional<PartitionSpec> lookup(const std::string& path) const;
  // As lookup(), but also returns the key that matched (for error messages).
  std::optional<std::pair<std::string, PartitionSpec>> lookup_rule(const std::string& path) const;
  // The checked spec for a variable of `shape` on `mesh`: nullopt lookups become all-None; throws
  // Error naming the variable, dimension and axis for a rank mismatch, an unknown axis, an axis used
  // twice, or a dimension the axis size does not divide.
  PartitionSpec resolve(const std::string& path, const Shape& shape, const DeviceMesh& mesh) const;
  // The same checks against axis names/sizes only (for `info --mesh` dry runs without processes).
  PartitionSpec resolve(const std::string& path, const Shape& shape, const std::vector<int>& mesh_shape,
                        const std::vector<std::string>& axis_names) const;
  // Warnings for a resolved spec; resolve() stays silent because only the CLI prints. Today: a
  // variable of ≥ 1 MiB as fp32 that no axis splits, on a mesh of more than one device.
  static std::vector<std::string> warnings_for(const std::string& path, const Shape& shape,
                                               const PartitionSpec& spec, const std::vector<int>& mesh_shape);
  bool empty() const { return rules_.empty(); }
  const std::vector<std::pair<std::string, PartitionSpec>>& rules() const { return rules_; }

 private:
  std::vector<std::pair<std::string, PartitionSpec>> rules_;
  std::vector<UserRegex> regexes_;  // rules_[i].first compiled (RE2), matched in full
};

}  // namespace meshtune
