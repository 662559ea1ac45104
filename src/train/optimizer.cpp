// AdamW and learning-rate schedules (spec §8). The update is done in fp32, one rounded operation
// at a time in Keras' order, so that it matches Keras bit for bit.

// A fused multiply-add rounds once where Keras rounds twice; keep every product and sum separate.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "train/optimizer.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace meshtune {
namespace {

constexpr double kPi = 3.14159265358979323846;

}  // namespace

AdamW::AdamW(Backend& backend, const AdamWOptions& options, const std::vector<Parameter>& params)
    : backend_(&backend), options_(options) {
  int clip_options = (options.clipnorm != 0) + (options.clipvalue != 0) + (options.global_clipnorm != 0);
  check(clip_options <= 1, "AdamW: only one of clipnorm, clipvalue and global_clipnorm may be set (got clipnorm=",
        options.clipnorm, ", clipvalue=", options.clipvalue, ", global_clipnorm=", options.global_clipnorm, ")");
  check(options.clipnorm >= 0 && options.clipvalue >= 0 && options.global_clipnorm >= 0,
        "AdamW: clipnorm, clipvalue and global_clipnorm must not be negative");

  // Keras joins the names into one regex (re.search); an empty list means no exclusion at all.
  if (!options.exclude_from_weight_decay.empty()) {
    for (const auto& name : options.exclude_from_weight_decay) {
      UserRegex single(name, "AdamW: exclude_from_weight_decay pattern \"" + brief(name) + "\"");
      if (!exclude_regex_.empty()) exclude_regex_ += "|";
      exclude_regex_ += name;
    }
    exclude_.emplace(exclude_regex_, "AdamW: exclude_from_weight_decay regex \"" + brief(exclude_regex_) + "\"");
  }

  momentums.reserve(params.size());
  velocities.reserve(params.size());
  for (const auto& p : params)
    for (auto* slots : {&momentums, &velocities}) backend.resize_zeroed(slots->emplace_back(), p.size);
}

bool AdamW::decays(const Parameter& p) const {
  return !exclude_ || !exclude_->search(p.name);
}

void AdamW::step(const std::vector<Parameter>& params, double lr_value) {
  Backend& backend = *backend_;
  check(params.size() == momentums.size(), "AdamW: step got ", params.size(), " parameters but slots were made for ",
        momentums.size());
  for (size_t i = 0; i < params.size(); ++i) {
    check(params[i].size == momentums[i].size(), "AdamW: parameter ", params[i].path, " has ", params[i].size,
          " elements but its slots have ", momentums[i].size());
  }

  // 1. Clip the gradients (Keras checks clipnorm, then global_clipnorm, then clipvalue). Keras:
  // ops.sum(ops.square(g)) per tensor; summed in double here (the order of an fp32 reduction is the
  // backend's business anyway, so no bit-exact match is possible there).
  std::vector<double> squared_norms;
  if (options_.clipnorm > 0 || options_.global_clipnorm > 0) {
    for (const auto& p : params) squared_norms.push_back(backend.sum_of_squares(p.grad, int64_t(p.size)));
    if (sum_squared_norms) sum_squared_norms(squared_norms);
  }
  if (options_.clipnorm > 0) {
    const float c = float(options_.clipnorm);
    for (size_t k = 0; k < params.size(); ++k) {
      const float norm = std::sqrt(float(squared_norms[k]));
      backend.scale_by_ratio(params[k].grad, int64_t(params[k].size), c, std::max(norm, c));
    }
  } else if (options_.global_clipnorm > 0) {
    double total = 0;
    for (double n : squared_norms) total += n;
    const float c = float(options_.global_clipnorm);
    const float norm = std::sqrt(float(total));
    // Keras: scale = c·min(1/norm, 1/c), plus (norm − norm) so a non-finite norm gives NaN.
    const float scale = c * std::min(1.0f / norm, 1.0f / c) + (norm - norm);
    for (const auto& p : params) backend.scale(p.grad, int64_t(p.size), scale);
  } else if (options_.clipvalue > 0) {
    for (const auto& p : params) backend.clamp(p.grad, int64_t(p.size), float(options_.clipvalue));
  }

  // Keras casts every scalar to the variable dtype (fp32) before using it.
  const float lr = float(lr_value);
  const float wd = float(options_.weight_decay);
  const float local_step = float(iterations + 1);
  const float beta_1_power = std::pow(float(options_.beta_1), local_step);
  const float beta_2_power = std::pow(float(options_.beta_2), local_step);
  const float alpha = lr * std::sqrt(1.0f - beta_2_power) / (1.0f - beta_1_power);
  // `1 - self.beta_1` is a Python float subtraction, cast to fp32 afterwards.
  const float one_minus_beta_1 = float(1.0 - options_.beta_1);
  const float one_minus_beta_2 = float(1.0 - options_.beta_2);
  const float epsilon = float(options_.epsilon);

  // 2. Decay the pre-update value: θ − (θ·wd)·lr; 3.–4. moments, then the step with ε added to the
  // uncorrected √v (backend/cpu/adamw.h). Every variable in one call (a few launches on a GPU).
  const AdamWStep step{.weight_decay = wd,
                       .learning_rate = lr,
                       .one_minus_beta_1 = one_minus_beta_1,
                       .one_minus_beta_2 = one_minus_beta_2,
                       .alpha = alpha,
                       .epsilon = epsilon};
  std::vector<AdamWVariable> variables;
  for (size_t k = 0; k < params.size(); ++k) {
    const Parameter& p = params[k];
    variables.push_back({p.value, p.grad, momentums[k], velocities[k], int64_t(p.size), decays(p)});
  }
  backend.adamw_update(variables, step);
  ++iterations;
}

double LearningRateSchedule::at(int64_t step) const {
  check(kind == "constant" || kind == "linear" || kind == "cosine", "learning-rate schedule \"", kind,
        "\" is unknown (use constant, linear or cosine)");
  check(step >= 0, "learning-rate schedule: step ", step, " is negative");
  check(warmup_steps >= 0, "learning-rate schedule: warmup_steps ", warmup_steps, " is negative");

  if (step < warmup_steps) return base * double(step + 1) / double(warmup_steps);
  if (kind == "constant") return base;

  check(total_steps >= warmup_steps, "learning-rate schedule \"", kind, "\": total_steps ", total_steps,
        " is smaller than warmup_steps ", warmup_steps);
  const double final_rate = final_fraction * base;
  if (step >= total_steps) return final_rate;
  // From base at the end of warm-up to final_rate at total_steps.
  const double progress = double(step - warmup_steps) / double(total_steps - warmup_steps);
  const double remaining = kind == "linear" ? 1.0 - progress : 0.5 * (1.0 + std::cos(kPi * progress));
  return final_rate + (base - final_rate) * remaining;
}

}  // namespace meshtune
