// AdamW exactly as Keras 3 does it (spec §8), in fp32:
//   clip (at most one of clipnorm / clipvalue / global_clipnorm);
//   θ ← θ − (θ·wd)·lr  unless re.search(exclude regex, variable short name) matches;
//   m ← m + (g − m)(1 − β1);  v ← v + (g² − v)(1 − β2);
//   θ ← θ − (m·α̂)/(√v + ε),  α̂ = lr·√(1 − β2ᵗ)/(1 − β1ᵗ),  t = iterations + 1.
// Plus learning-rate schedules (constant; linear warm-up then linear or cosine decay).
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/user_regex.h"
#include "train/parameter.h"

namespace meshtune {

struct AdamWOptions {
  double learning_rate = 1e-3;
  double weight_decay = 0.004;
  double beta_1 = 0.9, beta_2 = 0.999, epsilon = 1e-7;
  std::vector<std::string> exclude_from_weight_decay;  // names joined with "|" into one regex (Keras)
  double clipnorm = 0, clipvalue = 0, global_clipnorm = 0;  // 0 = off; at most one may be set
};

class AdamW {
 public:
  // Slots are created for `params` (zeros, in `backend`'s memory, where the parameters are and the
  // update runs). Throws Error if more than one clipping option is set or an exclusion pattern is
  // not a valid regex.
  AdamW(Backend& backend, const AdamWOptions& options, const std::vector<Parameter>& params);
  // One update of every parameter from its grad, at learning rate `lr` (from a schedule).
  // Increments iterations. Gradients are left as they are (clipped in place if clipping is on).
  void step(const std::vector<Parameter>& params, double lr);
  bool decays(const Parameter& p) const;  // false when the exclusion regex matches p.name

  int64_t iterations = 0;
  std::vector<FloatBuffer> momentums, velocities;  // per parameter, same order, on the backend
  // When parameters are blocks of variables split over processes: turns each parameter's local
  // sum of squared gradients into its whole variable's (clipnorm / global_clipnorm need those).
  std::function<void(std::vector<double>& squared_norms)> sum_squared_norms;
  const AdamWOptions& options() const { return options_; }

 private:
  Backend* backend_;
  AdamWOptions options_;
  std::string exclude_regex_;
  std::optional<UserRegex> exclude_;  // compiled exclude_regex_; none: an empty list excludes nothing (Keras: None)
};

struct LearningRateSchedule {
  std::string kind = "constant";  // constant | linear | cosine
  double base = 1e-3;
  int64_t warmup_steps = 0;       // linear warm-up from 0 to base over these steps
  int64_t total_steps = 0;        // decay reaches `final_fraction·base` at total_steps
  double final_fraction = 0.0;
  double at(int64_t step) const;  // the rate for the update with 0-based index `step`
};

}  // namespace meshtune
