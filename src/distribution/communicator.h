// Collectives between processes (one device per process, as torchrun / Megatron / llm.c do). Under
// `mpirun` the communicator wraps MPI (OpenMPI); without it, a one-process communicator whose
// collectives are copies. Every call is blocking. Errors (a peer that died, a size mismatch) throw
// meshtune::Error; callers exit, and MPI's default error handler ends the other ranks.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace meshtune {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In-place sum over all members.
  virtual void all_reduce_sum(float* data, size_t count) = 0;
  virtual void all_reduce_sum(double* data, size_t count) = 0;
  // In-place element-wise maximum over all members.
  virtual void all_reduce_max(float* data, size_t count) = 0;
  // out[r·count + i] = member r's in[i]  (out holds size()·count elements).
  virtual void all_gather(const float* in, size_t count, float* out) = 0;
  // Sums in[size()·count] over members; member r keeps elements [r·count, (r+1)·count) in out.
  virtual void reduce_scatter_sum(const float* in, size_t count, float* out) = 0;
  virtual void broadcast(float* data, size_t count, int root) = 0;
  virtual void broadcast_bytes(std::string& bytes, int root) = 0;
  virtual void barrier() = 0;
  // A sub-communicator of the members passing the same `color`, ordered by `key` (MPI_Comm_split).
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
};

// The process-wide communicator: MPI when launched by mpirun (OMPI_COMM_WORLD_SIZE / PMI_SIZE set),
// else a single-process one. Initialises MPI on first use; MPI is finalised at exit.
Communicator& world();
bool launched_by_mpirun();

// Seconds this process has spent inside MPI collectives so far (for benchmarks and logs).
double collective_seconds();

// A one-member communicator (tests, and the non-MPI path).
std::unique_ptr<Communicator> make_single_communicator();

// Ends every rank of the job with `code` after printing `message` on this rank's stderr (MPI_Abort
// under mpirun, exit otherwise): the path every error takes in a multi-rank run, so no rank hangs.
[[noreturn]] void abort_job(const std::string& message, int code = 1);

}  // namespace meshtune
