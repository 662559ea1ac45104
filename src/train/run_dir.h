// A fine-tuning run's directory (`finetune --out DIR`): what a run writes there, and how a new run
// may take a directory that already holds one. A run is never replaced by accident: without
// --resume or --overwrite a directory holding run outputs is refused.
#pragma once
#include <string>
#include <vector>

namespace meshtune {

// The run outputs present in `dir` (file names): checkpoint.safetensors and its per-rank files,
// adapter.lora.h5, adapter/, model/ and the temp files of interrupted writes. Other files are not
// the run's and are left alone.
std::vector<std::string> run_outputs(const std::string& dir);

enum class RunDirMode { Fresh, Resume, Overwrite };

// Readies `dir` for a run: creates it; Fresh refuses a directory that holds run outputs (naming
// them and the flags); Overwrite removes the old outputs first — the checkpoint before anything
// else, so the directory stops being a resumable run at once — and the new run writes nothing
// until they are all gone. Resume changes nothing (the checkpoint is checked when it is read).
void prepare_run_dir(const std::string& dir, RunDirMode mode);

// An exclusive lock on a run directory for as long as the object lives: flock on DIR/.meshtune.lock
// (created with the directory if need be), which the kernel releases when the process ends however
// it ends — a crashed run leaves no stale lock. A second run on the same directory is refused at
// once, naming the directory. Taken before the directory is checked, so two runs started together
// cannot both find it free.
class RunDirLock {
 public:
  explicit RunDirLock(const std::string& dir);
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace meshtune
