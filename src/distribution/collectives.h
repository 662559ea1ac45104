// Collectives over many arrays at once.
#pragma once
#include <cstddef>
#include <utility>
#include <vector>

#include "distribution/communicator.h"

namespace meshtune {

// Sums every array over `comm` in place, with one all-reduce per bucket of up to 16 Mi floats rather
// than one per array (LoRA has two small arrays per adapter: latency, not bandwidth, would
// dominate). Arrays of a bucket's size or more go on their own, in place; arrays in a device's
// memory go to the communicator as one group (NCCL fuses its calls).
void all_reduce_sum_bucketed(Communicator& comm, const std::vector<Span<float>>& arrays);

}  // namespace meshtune
