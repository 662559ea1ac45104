// Files read through a memory map (safetensors checkpoints) and what happens when one changes under
// a running process: truncating a mapped file makes the next read of its vanished pages raise
// SIGBUS, which would kill the process without a word. The maps register here while they live, and
// exit_on_fault_in_mapped_file() installs a handler that turns such a SIGBUS into one line naming
// the file and exit code 1. The command line installs it; a library leaves its host's signals alone.
#pragma once
#include <cstddef>
#include <string>

namespace meshtune {

void register_mapped_file(const void* addr, size_t size, const std::string& path);
void unregister_mapped_file(const void* addr);
void exit_on_fault_in_mapped_file();

}  // namespace meshtune
