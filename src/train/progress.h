// Keras' progress bar (keras.utils.Progbar, spec §8) for fit(): on a terminal,
//   `\x1b[1m 12/100\x1b[0m \x1b[32m━━━\x1b[0m\x1b[37m━━━…\x1b[0m \x1b[1m3s\x1b[0m 163ms/step - loss: 2.7145 - acc: 0.4329`
// redrawn in place at most every 0.05 s (ETA while running, elapsed at the end, ms/step excluding
// step 1 from step 2 on, values `.4f` if |v| > 1e-3 else `.4e`); when the stream is not a
// terminal, plain lines without colours every `plain_every` steps and at the end.
#pragma once
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace meshtune {

class ProgressBar {
 public:
  ProgressBar(int64_t total_steps, FILE* stream, bool is_terminal, int64_t plain_every = 10);
  // After step `step` (1-based) with the running values to show, e.g. {{"loss", 2.71}, ...}.
  void update(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  static std::string format_value(double v);  // Keras: .4f if |v| > 1e-3 else .4e
  // The line as Keras draws it (no leading \b/\r), for tests: `finished` chooses elapsed vs ETA.
  std::string render(int64_t step, const std::vector<std::pair<std::string, double>>& values, double elapsed_s,
                     double seconds_per_step, bool finished, bool colours) const;

 private:
  int64_t total_;
  FILE* stream_;
  bool terminal_;
  int64_t plain_every_;
  std::chrono::steady_clock::time_point start_, first_step_done_, last_draw_;
  size_t previous_width_ = 0;
  bool have_first_step_ = false;  // first_step_done_ is set (Keras: _time_after_first_step)
  bool drawn_ = false;            // the first terminal draw is never throttled
};

}  // namespace meshtune
