// Keras' Progbar (verbose=1) as fit() draws it; spec §8 and keras/src/utils/progbar.py.
#include "train/progress.h"

#include <cmath>
#include <cstdio>

#include "core/error.h"

namespace meshtune {
namespace {

constexpr int kBarWidth = 20;          // Progbar(width=20)
constexpr double kRedrawInterval = 0.05;  // Progbar(interval=0.05)
const char* const kBarChar = "\xe2\x94\x81";  // "━" U+2501

std::string printf_string(const char* format, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, format, value);
  return buffer;
}

// Python's "%d" % x of a float truncates towards zero.
long long trunc_int(double x) { return static_cast<long long>(x); }

// ETA as Keras writes it: %ds, %d:%02d above a minute, %d:%02d:%02d above an hour.
std::string format_eta(double eta) {
  char buffer[64];
  if (eta > 3600) {
    std::snprintf(buffer, sizeof buffer, "%lld:%02lld:%02lld", trunc_int(std::floor(eta / 3600)),
                  trunc_int(std::floor(std::fmod(eta, 3600) / 60)), trunc_int(std::fmod(eta, 60)));
  } else if (eta > 60) {
    std::snprintf(buffer, sizeof buffer, "%lld:%02lld", trunc_int(std::floor(eta / 60)), trunc_int(std::fmod(eta, 60)));
  } else {
    std::snprintf(buffer, sizeof buffer, "%llds", trunc_int(eta));
  }
  return buffer;
}

// Keras' _format_time: " 13ms/step" etc.; exactly 0 is shown as "0s/step".
std::string format_step_time(double seconds) {
  if (seconds >= 1 || seconds == 0) return printf_string(" %.0fs/step", seconds);
  if (seconds >= 1e-3) return printf_string(" %.0fms/step", seconds * 1000.0);
  return printf_string(" %.0fus/step", seconds * 1000000.0);
}

// The width Keras pads against: characters on screen, i.e. UTF-8 code points of the plain line.
size_t display_width(const std::string& plain) {
  size_t width = 0;
  for (unsigned char c : plain) width += (c & 0xC0) != 0x80;
  return width;
}

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

ProgressBar::ProgressBar(int64_t total_steps, FILE* stream, bool is_terminal, int64_t plain_every)
    : total_(total_steps), stream_(stream), terminal_(is_terminal), plain_every_(plain_every) {
  check(total_steps > 0, "progress bar: total_steps must be positive, got ", total_steps);
  start_ = std::chrono::steady_clock::now();
  first_step_done_ = start_;
  last_draw_ = start_;
}

std::string ProgressBar::format_value(double v) {
  // Python prints NaN as "nan" whatever its sign bit; printf may print "-nan".
  if (std::isnan(v)) return "nan";
  return printf_string(std::fabs(v) > 1e-3 ? "%.4f" : "%.4e", v);
}

std::string ProgressBar::render(int64_t step, const std::vector<std::pair<std::string, double>>& values,
                                double elapsed_s, double seconds_per_step, bool finished, bool colours) const {
  auto style = [&](const char* code) { return colours ? std::string(code) : std::string(); };
  const std::string reset = style("\x1b[0m");

  std::string line;
  const int digits = int(std::to_string(total_).size());
  char count[64];
  std::snprintf(count, sizeof count, "%*lld/%lld", digits, (long long)step, (long long)total_);
  line += style("\x1b[1m") + count + reset + " ";

  // int(width·k/n) as Keras computes it, in floating point.
  int done = int(kBarWidth * (double(step) / double(total_)));
  done = std::max(0, std::min(kBarWidth, done));
  if (done > 0) {
    line += style("\x1b[32m");
    for (int i = 0; i < done; ++i) line += kBarChar;
    line += reset;
  }
  // Keras writes the white part even when it is empty.
  line += style("\x1b[37m");
  for (int i = done; i < kBarWidth; ++i) line += kBarChar;
  line += reset;

  const std::string when = finished ? printf_string("%.0fs", elapsed_s)
                                    : format_eta(seconds_per_step * double(total_ - step));
  line += " " + style("\x1b[1m") + when + reset;
  line += format_step_time(seconds_per_step);
  for (const auto& [name, value] : values) line += " - " + name + ": " + format_value(value);
  return line;
}

void ProgressBar::update(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  const auto now = std::chrono::steady_clock::now();
  const bool finished = step >= total_;

  // Keras' _estimate_step_duration: leave the first (compiling) step out once there is a second.
  double seconds_per_step = 0;
  if (step > 0) {
    if (have_first_step_ && step > 1) {
      seconds_per_step = seconds_between(first_step_done_, now) / double(step - 1);
    } else {
      seconds_per_step = seconds_between(start_, now) / double(step);
    }
    if (step == 1) {
      first_step_done_ = now;
      have_first_step_ = true;
    }
  }
  const double elapsed = seconds_between(start_, now);

  if (!terminal_) {
    const bool due = plain_every_ > 0 && step % plain_every_ == 0;
    if (!due && !finished) return;
    const std::string line = render(step, values, elapsed, seconds_per_step, finished, false) + "\n";
    std::fputs(line.c_str(), stream_);
    std::fflush(stream_);
    return;
  }

  // The first draw always happens (Keras starts with _last_update = 0).
  if (drawn_ && seconds_between(last_draw_, now) < kRedrawInterval && !finished) return;

  std::string message(previous_width_, '\b');
  message += "\r";
  message += render(step, values, elapsed, seconds_per_step, finished, true);
  const size_t width = display_width(render(step, values, elapsed, seconds_per_step, finished, false));
  // Blank out what is left of a longer previous line.
  if (previous_width_ > width) message += std::string(previous_width_ - width, ' ');
  if (finished) message += "\n";
  std::fputs(message.c_str(), stream_);
  std::fflush(stream_);
  previous_width_ = width;
  last_draw_ = now;
  drawn_ = true;
}

}  // namespace meshtune
