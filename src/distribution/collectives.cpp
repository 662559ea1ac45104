#include "distribution/collectives.h"

#include <algorithm>

namespace meshtune {

void all_reduce_sum_bucketed(Communicator& comm, const std::vector<std::pair<float*, size_t>>& arrays) {
  constexpr size_t kBucket = size_t(1) << 24;
  std::vector<float> bucket;
  std::vector<std::pair<float*, size_t>> members;
  auto flush = [&] {
    if (bucket.empty()) return;
    comm.all_reduce_sum(bucket.data(), bucket.size());
    size_t o = 0;
    for (const auto& [data, n] : members) {
      std::copy_n(bucket.begin() + long(o), n, data);
      o += n;
    }
    bucket.clear();
    members.clear();
  };
  for (const auto& [data, n] : arrays) {
    if (n >= kBucket) {  // large arrays go on their own, in place
      comm.all_reduce_sum(data, n);
      continue;
    }
    if (bucket.size() + n > kBucket) flush();
    bucket.insert(bucket.end(), data, data + n);
    members.push_back({data, n});
  }
  flush();
}

}  // namespace meshtune
