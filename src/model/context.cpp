#include "model/context.h"

#include <vector>

#include "core/error.h"

namespace meshtune {

// MPI reads and writes host memory.
template <class E>
static E* on_host(const Span<E>& s, const char* what) {
  check(s.device == Device::Host, "tensor parallelism: ", what, " is in ", device_name(s.device),
        " memory; the MPI communicator needs host memory");
  return s.data;
}

void TensorParallelGroup::sum_partials(Floats x) const {
  if (comm_) comm_->all_reduce_sum(on_host(x, "a partial sum"), x.size);
}

void TensorParallelGroup::max_over_slices(Floats row_max) const {
  if (comm_) comm_->all_reduce_max(on_host(row_max, "a row maximum"), row_max.size);
}

void TensorParallelGroup::combine_row_max(SoftmaxRows& stats, int64_t n) const {
  if (!comm_) return;
  std::vector<float> mine(stats.max.begin(), stats.max.begin() + n), all(size_t(2 * n * comm_->size()));
  mine.insert(mine.end(), stats.argmax.begin(), stats.argmax.begin() + n);
  comm_->all_gather(mine.data(), mine.size(), all.data());
  softmax_combine_max(all.data(), comm_->size(), n, stats);
}

void TensorParallelGroup::sum_row_sums(SoftmaxRows& stats) const {
  if (comm_) comm_->all_reduce_sum(stats.sum_exp_and_target.data(), stats.sum_exp_and_target.size());
}

void TensorParallelGroup::gather_columns(Backend& backend, ConstFloats mine, int64_t M, int64_t part, Floats gathered,
                                         Floats out) const {
  if (!comm_) return backend.copy(mine, M * part, out);
  check(mine.size >= size_t(M * part) && gathered.size >= size_t(M * part * comm_->size()),
        "tensor parallelism: gather_columns' buffers are too small");
  comm_->all_gather(on_host(mine, "a column block"), size_t(M * part), on_host(gathered, "the gathered columns"));
  backend.interleave_column_blocks(gathered, comm_->size(), M, part, out);
}

}  // namespace meshtune
