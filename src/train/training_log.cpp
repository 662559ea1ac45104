#include "train/training_log.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace meshtune {

ProgressLog::ProgressLog(FILE* stream) : stream_(stream), terminal_(isatty(fileno(stream))) {}

void ProgressLog::run_begin(int64_t first_step, int64_t total_steps, int epochs) {
  by_steps_ = epochs == 0;
  if (by_steps_ && first_step < total_steps) bar_ = std::make_unique<ProgressBar>(total_steps, stream_, terminal_);
}

void ProgressLog::epoch_begin(int64_t epoch, int epochs, int64_t steps) {
  if (by_steps_) return;
  if (epochs > 1) std::fprintf(stream_, "Epoch %lld/%d\n", (long long)epoch, epochs);
  bar_ = std::make_unique<ProgressBar>(steps, stream_, terminal_);
}

void ProgressLog::step_end(const StepReport& r) {
  if (bar_)
    bar_->update(by_steps_ ? r.step : r.step_in_epoch,
                 {{"loss", r.epoch_loss}, {"sparse_categorical_accuracy", r.accuracy}});
}

void ProgressLog::run_end(bool interrupted) {
  if (interrupted && bar_) std::fprintf(stream_, "\n");
}

JsonlLog::~JsonlLog() {
  if (file_) std::fclose(file_);
}

void JsonlLog::run_begin(int64_t first_step, int64_t, int) {
  file_ = std::fopen(path_.c_str(), first_step > 0 ? "a" : "w");
  check(file_, path_, ": cannot open for writing");
}

void JsonlLog::step_end(const StepReport& r) {
  const nlohmann::json line = {{"step", r.step},
                               {"epoch", r.epoch},
                               {"loss", r.loss},
                               {"epoch_loss", r.epoch_loss},
                               {"accuracy", r.accuracy},
                               {"learning_rate", r.learning_rate},
                               {"tokens_per_s", r.tokens_per_s},
                               {"ms_per_step", r.ms_per_step}};
  std::fprintf(file_, "%s\n", line.dump().c_str());
  std::fflush(file_);
}

void JsonlLog::run_end(bool) {
  if (file_) std::fclose(file_);
  file_ = nullptr;
}

}  // namespace meshtune
