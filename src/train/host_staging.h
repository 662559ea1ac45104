// Host access to a backend's memory for the train layer's host-side work: cutting and placing
// blocks of split variables, their MPI collectives, checkpoint files. On a host backend the memory
// itself; on a device, staged copies — downloaded when read, uploaded by flush() when written. On a
// mesh of GPUs only variables whose block differs from their working copy (split by the layout
// map, or by tensor parallelism) take this path; replicated ones never leave the GPU.
#pragma once
#include <deque>
#include <utility>
#include <vector>

#include "backend/backend.h"

namespace meshtune {

class HostStaging {
 public:
  explicit HostStaging(Backend& backend) : backend_(&backend) {}

  // `values` readable (and writable) on the host: the memory itself, or a downloaded copy that
  // lives as long as this object.
  Floats read(Floats values) {
    if (backend_->device() == Device::Host) return values;
    std::vector<float>& copy = copies_.emplace_back(values.size);
    backend_->download(values, copy);
    return copy;
  }
  // Host memory whose contents flush() puts into `values` (undefined until written).
  Floats write(Floats values) {
    if (backend_->device() == Device::Host) return values;
    std::vector<float>& copy = copies_.emplace_back(values.size);
    pending_.emplace_back(&copy, values);
    return copy;
  }
  void flush() {
    for (auto& [host, values] : pending_) backend_->upload(*host, values);
    pending_.clear();
  }

 private:
  Backend* backend_;
  std::deque<std::vector<float>> copies_;  // a deque: the spans handed out stay valid
  std::vector<std::pair<std::vector<float>*, Floats>> pending_;
};

}  // namespace meshtune
