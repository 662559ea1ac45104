// Helpers shared by the tests: fixture paths, temp dirs, running the CLI.
#pragma once
#include <string>

namespace meshtune::testing {

// Absolute path of a file under ../shared/fixtures, e.g. fixture("keras/preset-gemma-tiny").
std::string fixture(const std::string& relative);

// A fresh empty directory under the system temp dir, removed by the OS eventually.
std::string make_temp_dir(const std::string& tag);

struct CommandResult {
  int exit_code = 0;
  std::string out;  // stdout
  std::string err;  // stderr
};
// Runs the meshtune binary with the given argument string (shell-quoted by the caller).
// `env` is prepended to the command line, e.g. "VAR=1"; `launcher` goes before the binary (e.g.
// "mpirun -np 2 ").
CommandResult run_meshtune(const std::string& args, const std::string& env = "", const std::string& launcher = "");

std::string read_text_file(const std::string& path);

}  // namespace meshtune::testing
