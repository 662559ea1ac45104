// Files read through a memory map (safetensors checkpoints, a Keras preset's contiguous datasets) and what happens when one changes under
// a running process: truncating a mapped file makes the next read of its vanished pages raise
// SIGBUS, which would kill the process without a word. The maps register here while they live, and
// exit_on_fault_in_mapped_file() installs a handler that turns such a SIGBUS into one line naming
// the file and exit code 1. The command line installs it; a library leaves its host's signals alone.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace meshtune {

// Bytes [offset, offset + size) of the regular file `path`, mapped read-only (MAP_PRIVATE) and
// registered below while `owner` lives. `read_ahead` reads them all in now (for a caller about to
// read every byte). Error naming the file when it cannot be opened or mapped
// or is shorter than offset + size.
struct MappedRange {
  const std::byte* data = nullptr;
  std::shared_ptr<const void> owner;  // unmaps when the last holder lets go
};
MappedRange map_file_range(const std::string& path, uint64_t offset, uint64_t size, bool read_ahead);

void register_mapped_file(const void* addr, size_t size, const std::string& path);
void unregister_mapped_file(const void* addr);
void exit_on_fault_in_mapped_file();

}  // namespace meshtune
