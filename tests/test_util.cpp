#include "test_util.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

namespace meshtune::testing {

std::string fixture(const std::string& relative) { return std::string(MESHTUNE_FIXTURES_DIR) + "/" + relative; }

std::string make_temp_dir(const std::string& tag) {
  std::random_device rd;
  auto dir = std::filesystem::temp_directory_path() /
             ("meshtune-test-" + tag + "-" + std::to_string(getpid()) + "-" + std::to_string(rd()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

CommandResult run_meshtune(const std::string& args, const std::string& env, const std::string& launcher) {
  std::string dir = make_temp_dir("cmd");
  std::string out_path = dir + "/out", err_path = dir + "/err";
  std::string cmd = env + " " + launcher + std::string("'") + MESHTUNE_BINARY + "' " + args + " >'" + out_path + "' 2>'" + err_path + "' </dev/null";
  int status = std::system(cmd.c_str());
  CommandResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  result.out = read_text_file(out_path);
  result.err = read_text_file(err_path);
  std::filesystem::remove_all(dir);
  return result;
}

}  // namespace meshtune::testing
