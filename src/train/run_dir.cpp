#include "train/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "core/file_util.h"

namespace meshtune {

namespace fs = std::filesystem;

namespace {

bool is_run_output(const std::string& name) {
  static const char* kOutputs[] = {"checkpoint.safetensors", "adapter.lora.h5", "adapter", "model"};
  for (const char* output : kOutputs) {
    const std::string o = output;
    if (name == o || is_temp_file_of(name, o)) return true;
    if (o == "checkpoint.safetensors" && name.rfind(o + ".step", 0) == 0) return true;  // sharded rank files
  }
  return false;
}

}  // namespace

std::vector<std::string> run_outputs(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (is_run_output(name)) out.push_back(name);
  }
  // The manifest / single checkpoint first: removing it first ends the old run as a resumable one.
  std::sort(out.begin(), out.end(), [](const std::string& a, const std::string& b) {
    const bool ka = a == "checkpoint.safetensors", kb = b == "checkpoint.safetensors";
    return ka != kb ? ka : a < b;
  });
  return out;
}

void prepare_run_dir(const std::string& dir, RunDirMode mode) {
  std::error_code ec;
  check(!fs::exists(dir, ec) || fs::is_directory(dir, ec), "--out ", dir, ": exists and is not a directory");
  const std::vector<std::string> old = run_outputs(dir);
  if (mode == RunDirMode::Fresh && !old.empty()) {
    std::string listed;
    for (size_t i = 0; i < old.size() && i < 4; ++i) listed += (i ? ", " : "") + old[i];
    if (old.size() > 4) listed += ", …";
    fail("--out ", dir, ": already holds a run (", listed,
         "); pass --resume to continue it or --overwrite to replace it");
  }
  if (mode == RunDirMode::Overwrite && !old.empty()) {
    // Move the old outputs aside (each rename is atomic, the checkpoint first), then delete them.
    const fs::path trash = fs::path(dir) / (".meshtune-overwritten-" + std::to_string(::getpid()));
    fs::create_directory(trash, ec);
    check(!ec, "--overwrite: cannot create ", trash.string(), ": ", ec.message());
    for (const std::string& name : old) {
      fs::rename(fs::path(dir) / name, trash / name, ec);
      check(!ec, "--overwrite: cannot move ", (fs::path(dir) / name).string(), " aside: ", ec.message());
    }
    fs::remove_all(trash, ec);
    check(!ec, "--overwrite: cannot remove the old run's outputs in ", trash.string(), ": ", ec.message());
  }
  fs::create_directories(dir, ec);
  check(!ec, "--out ", dir, ": cannot create: ", ec.message());
}

RunDirLock::RunDirLock(const std::string& dir) {
  std::error_code ec;
  check(!fs::exists(dir, ec) || fs::is_directory(dir, ec), "--out ", dir, ": exists and is not a directory");
  fs::create_directories(dir, ec);
  check(!ec, "--out ", dir, ": cannot create: ", ec.message());
  const std::string path = (fs::path(dir) / ".meshtune.lock").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  check(fd_ >= 0, "--out ", dir, ": cannot open its lock file ", path, ": ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    ::close(fd_);
    fd_ = -1;
    check(error != EWOULDBLOCK, "--out ", dir, ": another process is using this run directory (it holds ", path,
          "); wait for that run to end or choose another --out");
    fail("--out ", dir, ": cannot lock ", path, ": ", std::strerror(error));
  }
}

RunDirLock::~RunDirLock() {
  if (fd_ >= 0) ::close(fd_);  // closing releases the lock
}

}  // namespace meshtune
