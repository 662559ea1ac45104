#include "model/context.h"

#include <vector>

#include "core/error.h"

namespace meshtune {

void TensorParallelGroup::sum_partials(Floats x) const {
  if (comm_) comm_->all_reduce_sum(x);
}

void TensorParallelGroup::max_over_slices(Floats row_max) const {
  if (comm_) comm_->all_reduce_max(row_max);
}

void TensorParallelGroup::combine_row_max(Backend& backend, SoftmaxRows& stats, int64_t n) const {
  if (!comm_) return;
  backend.resize(stats.gathered, size_t(2 * n * comm_->size()));
  comm_->all_gather(stats.max_and_argmax.span().part(0, size_t(2 * n)), stats.gathered);
  backend.softmax_combine_max(stats.gathered, comm_->size(), n, stats);
}

void TensorParallelGroup::sum_row_sums(SoftmaxRows& stats, int64_t n) const {
  if (comm_) comm_->all_reduce_sum(stats.sum_exp_and_target.span().part(0, size_t(2 * n)));
}

void TensorParallelGroup::gather_columns(Backend& backend, ConstFloats mine, int64_t M, int64_t part, Floats gathered,
                                         Floats out) const {
  if (!comm_) return backend.copy(mine, M * part, out);
  check(mine.size >= size_t(M * part), "tensor parallelism: gather_columns' block holds ", mine.size, " values, ",
        M * part, " needed");
  comm_->all_gather(mine.part(0, size_t(M * part)), gathered);
  backend.interleave_column_blocks(gathered, comm_->size(), M, part, out);
}

}  // namespace meshtune
