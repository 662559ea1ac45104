// Where a GPU's time goes over a measured region of a benchmark: every kernel, copy and memset the
// GPU ran, with its start and end on the GPU's clock, from CUPTI's activity records (what Nsight
// Systems reads; libcupti is opened when asked, so a run without --gpu-profile needs none).
//   GpuProfile profile;   // starts recording (one clear error if CUPTI cannot be opened)
//   ... the region's work, then synchronize the stream ...
//   json = profile.stop();
// The summary: span_ms (first start to last end), busy_ms (the time at least one kernel or copy ran:
// span − busy is the GPU waiting for the host), the kernels by total time, and the host's time
// inside CUDA's runtime and driver calls (the launches, cuBLAS' calls into the driver) — what to
// speed up first, and whether launching, not computing, is what costs.
#pragma once
#include <memory>

#include <nlohmann/json.hpp>

namespace meshtune::bench {

class GpuProfile {
 public:
  GpuProfile();
  ~GpuProfile();
  GpuProfile(const GpuProfile&) = delete;
  GpuProfile& operator=(const GpuProfile&) = delete;

  // Stops recording and summarises what was recorded since the constructor, divided by `repeats`
  // (the region's steps or tokens: the numbers are per step): the `top` kernels by total time, the
  // rest summed into one row.
  nlohmann::ordered_json stop(int repeats, int top = 20);
};

}  // namespace meshtune::bench
