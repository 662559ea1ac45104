// NCCL, the GPUs' collectives: the communicator of a mesh of GPUs, one process per GPU. Rank 0 of
// a communicator makes NCCL's unique id and broadcasts it over MPI; every rank then joins the NCCL
// communicator with it on its own GPU (ncclCommInitRank). NCCL is opened with dlopen when first
// needed (its library is 200 MB; linking it would map it into every CPU-only run), so a CUDA build
// runs on machines without it.
#pragma once
#include <memory>
#include <string>

#include "distribution/communicator.h"

namespace meshtune {

constexpr size_t kNcclUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES

// The same 128-byte NCCL unique id on every rank of `comm` (rank 0's, broadcast). An Error naming
// the reason when NCCL is not available (a build without the CUDA backend, no libnccl).
std::string nccl_unique_id(Communicator& comm);

// The NCCL communicator of the members of `host` (world() or another MPI communicator that
// outlives it): collectives on CUDA memory are queued on `cuda_stream` (the CUDA backend's, so
// they run in order with its ops), host operands go to `host`. split() makes the sub-communicator
// of a mesh axis: the host's split, and a NCCL communicator bootstrapped over it. Every member
// calls it together, on the thread whose current GPU is its own (the one that made the backend).
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, void* cuda_stream);

}  // namespace meshtune
