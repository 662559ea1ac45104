// NCCL, the GPUs' collectives, as far as it is built: the bootstrap of a NCCL communicator over MPI.
// Rank 0 of a communicator makes NCCL's unique id and broadcasts it; every rank then joins the
// NCCL communicator with it on its own GPU (ncclCommInitRank, with the NCCL communicator itself —
// issue #20). NCCL is opened with dlopen when first needed (its library is 200 MB; linking it
// would map it into every CPU-only run), so it works in every process of a CUDA build, GPU or not.
#pragma once
#include <string>

#include "distribution/communicator.h"

namespace meshtune {

constexpr size_t kNcclUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES

// The same 128-byte NCCL unique id on every rank of `comm` (rank 0's, broadcast). An Error naming
// the reason when NCCL is not available (a build without the CUDA backend, no libnccl).
std::string nccl_unique_id(Communicator& comm);

}  // namespace meshtune
