// Where fit() reports its progress: logging sinks behind one small interface. The Keras progress
// bar (plain lines when stderr is not a terminal) and the JSONL log are sinks; a new one (TensorBoard,
// a test hook) is one class. fit() calls every sink it is given; the caller decides which process
// gets which (the command line gives them to rank 0 only).
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "train/progress.h"

namespace meshtune {

// One optimizer step, as fit() reports it.
struct StepReport {
  int64_t step = 0;                            // optimizer steps done, counting this one
  int64_t epoch = 0;                           // 1-based
  int64_t step_in_epoch = 0, epoch_steps = 0;  // this step's 1-based position in its epoch's pass
  double loss = 0;                             // this step's batch loss
  double epoch_loss = 0, accuracy = 0;         // running means over the epoch (what Keras shows)
  double learning_rate = 0, tokens_per_s = 0, ms_per_step = 0;
};

class TrainingLog {
 public:
  virtual ~TrainingLog() = default;
  // fit() starts at `first_step` of `total_steps`; `epochs` = 0 runs by steps (epochs cycled).
  virtual void run_begin(int64_t first_step, int64_t total_steps, int epochs) {}
  // A pass over epoch `epoch` (1-based) starts; `steps` of it will run.
  virtual void epoch_begin(int64_t epoch, int epochs, int64_t steps) {}
  virtual void step_end(const StepReport& report) {}
  virtual void checkpoint_saved(int64_t step, const std::string& path) {}
  virtual void run_end(bool interrupted) {}
};

// Keras' fit() display on `stream`: one bar per epoch ("Epoch 2/3" above it when there are
// several), or one bar over the run when training by steps.
class ProgressLog : public TrainingLog {
 public:
  explicit ProgressLog(FILE* stream = stderr);
  void run_begin(int64_t first_step, int64_t total_steps, int epochs) override;
  void epoch_begin(int64_t epoch, int epochs, int64_t steps) override;
  void step_end(const StepReport& report) override;
  void run_end(bool interrupted) override;

 private:
  FILE* stream_;
  bool terminal_;
  bool by_steps_ = false;
  std::unique_ptr<ProgressBar> bar_;
};

// One JSON line per step: step, epoch, loss, epoch_loss, accuracy, learning_rate, tokens_per_s,
// ms_per_step. A resumed run (first step > 0) appends to the file.
class JsonlLog : public TrainingLog {
 public:
  explicit JsonlLog(std::string path) : path_(std::move(path)) {}
  ~JsonlLog() override;
  void run_begin(int64_t first_step, int64_t total_steps, int epochs) override;
  void step_end(const StepReport& report) override;
  void run_end(bool interrupted) override;

 private:
  std::string path_;
  FILE* file_ = nullptr;
};

}  // namespace meshtune
