#include "distribution/collectives.h"

#include <algorithm>

#include "core/error.h"

namespace meshtune {

void all_reduce_sum_bucketed(Communicator& comm, const std::vector<Span<float>>& arrays) {
  constexpr size_t kBucket = size_t(1) << 24;
  std::vector<float> bucket;
  std::vector<Span<float>> members;
  std::vector<Span<float>> on_device;  // summed in place as one group: the bucket is host memory
  auto flush = [&] {
    if (bucket.empty()) return;
    comm.all_reduce_sum(bucket);
    size_t o = 0;
    for (const Span<float>& member : members) {
      std::copy_n(bucket.begin() + long(o), member.size, member.data);
      o += member.size;
    }
    bucket.clear();
    members.clear();
  };
  for (const Span<float>& array : arrays) {
    if (array.size >= kBucket) {  // large arrays go on their own, in place
      comm.all_reduce_sum(array);
      continue;
    }
    if (array.device != Device::Host) {
      on_device.push_back(array);
      continue;
    }
    if (bucket.size() + array.size > kBucket) flush();
    bucket.insert(bucket.end(), array.data, array.data + array.size);
    members.push_back(array);
  }
  flush();
  if (!on_device.empty()) comm.all_reduce_sum_group(on_device);
}

}  // namespace meshtune
