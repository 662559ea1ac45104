// The Keras progress bar (spec §8): exact lines for the spec and tutorial examples, the coloured
// bytes, ETA and step-time formats, and what update() writes to a terminal and to a plain stream.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <thread>

#include "core/error.h"
#include "train/progress.h"

namespace meshtune {
namespace {

std::string bars(int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += "━";
  return s;
}

// Everything written to a tmpfile so far.
std::string contents(FILE* f) {
  std::fflush(f);
  long size = std::ftell(f);
  std::string text(size_t(size), '\0');
  std::rewind(f);
  size_t got = std::fread(text.data(), 1, text.size(), f);
  text.resize(got);
  std::fseek(f, 0, SEEK_END);
  return text;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

// The line Keras printed for evaluate() on gemma-tiny (spec §8, verified against real Keras output).
TEST(ProgressBar, SpecExampleLine) {
  ProgressBar bar(3, stdout, false);
  EXPECT_EQ(bar.render(3, {{"loss", 7.6721}, {"sparse_categorical_accuracy", 0}}, 0.2, 0.013, true, false),
            "3/3 " + bars(20) + " 0s 13ms/step - loss: 7.6721 - sparse_categorical_accuracy: 0.0000e+00");
}

TEST(ProgressBar, SpecExampleBytesWithColours) {
  ProgressBar bar(3, stdout, true);
  // The white part is written (empty) even when the bar is full, as Keras does.
  EXPECT_EQ(bar.render(3, {{"loss", 7.6721}, {"sparse_categorical_accuracy", 0}}, 0.2, 0.013, true, true),
            "\x1b[1m3/3\x1b[0m \x1b[32m" + bars(20) + "\x1b[0m\x1b[37m\x1b[0m \x1b[1m0s\x1b[0m 13ms/step"
            " - loss: 7.6721 - sparse_categorical_accuracy: 0.0000e+00");
}

TEST(ProgressBar, TutorialFinalLine) {
  ProgressBar bar(2000, stdout, false);
  EXPECT_EQ(bar.render(2000, {{"loss", 2.7145}, {"sparse_categorical_accuracy", 0.4329}}, 358.2, 0.163, true, false),
            "2000/2000 " + bars(20) + " 358s 163ms/step - loss: 2.7145 - sparse_categorical_accuracy: 0.4329");
}

TEST(ProgressBar, RunningLineShowsEtaAndPaddedCount) {
  ProgressBar bar(100, stdout, false);
  // ⌊20·12/100⌋ = 2 green; ETA 88 × 0.163 s = 14.3 s.
  EXPECT_EQ(bar.render(12, {{"loss", 2.7145}, {"acc", 0.4329}}, 2.0, 0.163, false, false),
            " 12/100 " + bars(20) + " 14s 163ms/step - loss: 2.7145 - acc: 0.4329");
  EXPECT_EQ(bar.render(12, {{"loss", 2.7145}}, 2.0, 0.163, false, true),
            "\x1b[1m 12/100\x1b[0m \x1b[32m" + bars(2) + "\x1b[0m\x1b[37m" + bars(18) +
                "\x1b[0m \x1b[1m14s\x1b[0m 163ms/step - loss: 2.7145");
  // No green part at all before the first twentieth.
  EXPECT_EQ(bar.render(4, {}, 0.5, 0.1, false, true),
            "\x1b[1m  4/100\x1b[0m \x1b[37m" + bars(20) + "\x1b[0m \x1b[1m9s\x1b[0m 100ms/step");
}

TEST(ProgressBar, EtaFormats) {
  ProgressBar bar(2, stdout, false);
  auto eta = [&](double seconds) {  // one step left, taking `seconds`
    std::string line = bar.render(1, {}, 0, seconds, false, false);
    size_t start = line.find(' ', line.find(' ') + 1) + 1;
    return line.substr(start, line.find(' ', start) - start);
  };
  EXPECT_EQ(eta(59.9), "59s");
  EXPECT_EQ(eta(60), "60s");
  EXPECT_EQ(eta(125.5), "2:05");
  EXPECT_EQ(eta(3600), "60:00");
  EXPECT_EQ(eta(3725.5), "1:02:05");
  EXPECT_EQ(eta(90061), "25:01:01");
}

TEST(ProgressBar, StepTimeUnits) {
  ProgressBar bar(2, stdout, false);
  auto step_time = [&](double seconds) {
    std::string line = bar.render(2, {}, 7.4, seconds, true, false);
    return line.substr(line.rfind(' ') + 1);
  };
  EXPECT_EQ(step_time(2.6), "3s/step");
  EXPECT_EQ(step_time(1.0), "1s/step");
  EXPECT_EQ(step_time(0.0), "0s/step");
  EXPECT_EQ(step_time(0.163), "163ms/step");
  EXPECT_EQ(step_time(0.001), "1ms/step");
  EXPECT_EQ(step_time(0.0005), "500us/step");
  EXPECT_EQ(bar.render(2, {}, 7.4, 0.5, true, false).substr(0, 25), "2/2 " + bars(7));
  EXPECT_NE(bar.render(2, {}, 7.4, 0.5, true, false).find(" 7s "), std::string::npos);
}

TEST(ProgressBar, ValueFormat) {
  EXPECT_EQ(ProgressBar::format_value(0), "0.0000e+00");
  EXPECT_EQ(ProgressBar::format_value(0.001), "1.0000e-03");
  EXPECT_EQ(ProgressBar::format_value(1e-5), "1.0000e-05");
  EXPECT_EQ(ProgressBar::format_value(-2e-4), "-2.0000e-04");
  EXPECT_EQ(ProgressBar::format_value(0.0011), "0.0011");
  EXPECT_EQ(ProgressBar::format_value(-2.5), "-2.5000");
  EXPECT_EQ(ProgressBar::format_value(7.67214), "7.6721");
  EXPECT_EQ(ProgressBar::format_value(std::nan("")), "nan");
}

TEST(ProgressBar, NonPositiveTotalIsAnError) { EXPECT_THROW(ProgressBar(0, stdout, false), Error); }

TEST(ProgressBar, PlainStreamWritesEveryNthStepAndTheEnd) {
  FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  ProgressBar bar(25, f, false, 10);
  for (int step = 1; step <= 25; ++step) bar.update(step, {{"loss", 1.5}});
  std::string text = contents(f);
  std::fclose(f);
  EXPECT_EQ(count(text, "\n"), 3u) << text;
  EXPECT_EQ(text.find('\x1b'), std::string::npos);
  EXPECT_EQ(text.find('\r'), std::string::npos);
  // Without colours the green and white parts look the same.
  EXPECT_EQ(text.find("10/25 " + bars(20) + " "), 0u) << text;
  EXPECT_NE(text.find("\n20/25 " + bars(20) + " "), std::string::npos) << text;
  EXPECT_NE(text.find("\n25/25 " + bars(20) + " 0s "), std::string::npos) << text;
  EXPECT_EQ(text.substr(text.size() - 16), " - loss: 1.5000\n");
}

// What the screen shows of a drawn line: escape codes removed, characters (not bytes) counted.
size_t screen_width(const std::string& line) {
  size_t width = 0;
  for (size_t i = 0; i < line.size(); ++i) {
    if (line[i] == '\x1b') {
      i = line.find('m', i);
      continue;
    }
    width += (static_cast<unsigned char>(line[i]) & 0xC0) != 0x80;
  }
  return width;
}

// Checks one redraw: `previous` backspaces, "\r", the line, blanks over what is left of the previous
// line, and "\n" if final. Returns the width of the line drawn.
size_t check_redraw(const std::string& draw, size_t previous, bool final) {
  EXPECT_EQ(draw.substr(0, previous + 1), std::string(previous, '\b') + "\r");
  std::string line = draw.substr(previous + 1);
  if (final) {
    EXPECT_EQ(line.back(), '\n');
    line.pop_back();
  }
  EXPECT_EQ(line.find_first_of("\b\r\n"), std::string::npos);
  const size_t last = line.find_last_not_of(' ');
  const size_t width = screen_width(line.substr(0, last + 1));
  EXPECT_EQ(line.size() - last - 1, previous > width ? previous - width : 0) << "padding of " << line;
  return width;
}

TEST(ProgressBar, TerminalRedrawsInPlaceAtMostEvery50ms) {
  FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  ProgressBar bar(4, f, true);
  bar.update(1, {{"loss", 12.25}});  // the first draw is immediate
  bar.update(2, {{"loss", 2.5}});    // within 0.05 s of the first: skipped
  const std::string draw1 = contents(f);
  const size_t width1 = check_redraw(draw1, 0, false);
  EXPECT_EQ(draw1.find("\r\x1b[1m1/4\x1b[0m \x1b[32m" + bars(5) + "\x1b[0m\x1b[37m" + bars(15) + "\x1b[0m \x1b[1m"), 0u)
      << draw1;
  EXPECT_NE(draw1.find(" - loss: 12.2500"), std::string::npos);

  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  bar.update(3, {{"loss", 2.5}});
  const std::string upto3 = contents(f);
  const std::string draw3 = upto3.substr(draw1.size());
  const size_t width3 = check_redraw(draw3, width1, false);
  EXPECT_NE(draw3.find(" - loss: 2.5000"), std::string::npos);

  bar.update(4, {{"loss", 2.5}});  // the final draw is never skipped
  const std::string text = contents(f);
  std::fclose(f);
  const std::string draw4 = text.substr(upto3.size());
  check_redraw(draw4, width3, true);
  EXPECT_NE(draw4.find("\r\x1b[1m4/4\x1b[0m \x1b[32m" + bars(20) + "\x1b[0m\x1b[37m\x1b[0m \x1b[1m0s\x1b[0m "),
            std::string::npos)
      << draw4;
}

}  // namespace
}  // namespace meshtune
