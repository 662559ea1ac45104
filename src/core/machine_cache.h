// Small results measured on this machine (the matrix products' routes, OpenBLAS' kernel family),
// kept between runs so they are measured once: one JSON file per kind and key, named by a hash of
// the key (what the measurement depends on: CPU, library versions, thread count) and holding the key
// itself, in $MESHTUNE_CACHE_DIR, else $XDG_CACHE_HOME/meshtune, else ~/.cache/meshtune.
// A cache that cannot be read or written never stops a run: the caller measures again.
#pragma once
#include <optional>
#include <string>

#include "core/json.h"

namespace meshtune {

std::string cache_directory();  // may not exist yet
std::string machine_cache_path(const std::string& kind, const std::string& key);  // DIR/KIND-HASH.json

// The object stored under `key` ("key" and "measured" included), or nothing when the file is
// missing, unreadable, not JSON or measured under another key.
std::optional<json> read_machine_cache(const std::string& kind, const std::string& key);
// Stores `values` with "key" and "measured" (UTC time) added, atomically; returns a line saying
// where ("saved in PATH") or why not ("not cached: …").
std::string write_machine_cache(const std::string& kind, const std::string& key, json values);

// Whether MESHTUNE_RECALIBRATE (set, not empty, not "0") asks every measurement to be made again.
bool recalibration_asked();

// Held while a measurement of `kind` is made and saved (an flock on DIR/KIND.lock): processes that
// would measure the same thing at once — MPI ranks started together — wait for the first, then read
// its result from the cache, so they measure once, on an otherwise idle machine, and agree. Best
// effort: without a writable cache directory nothing is locked.
class MachineCacheLock {
 public:
  explicit MachineCacheLock(const std::string& kind);
  ~MachineCacheLock();
  MachineCacheLock(const MachineCacheLock&) = delete;
  MachineCacheLock& operator=(const MachineCacheLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace meshtune
