// Run by test_mesh_single under `mpirun -np 2`: rank 1 calls abort_job while rank 0 waits in a
// barrier that can never complete. The job must end non-zero instead of hanging.
#include <cstdio>

#include "distribution/communicator.h"

int main() {
  meshtune::Communicator& comm = meshtune::world();
  if (comm.size() != 2) {
    std::fprintf(stderr, "mpi_abort_probe: expected 2 ranks, got %d\n", comm.size());
    return 2;
  }
  if (comm.rank() == 1) meshtune::abort_job("rank 1 failed", 3);
  comm.barrier();
  std::fprintf(stderr, "mpi_abort_probe: rank 0 left the barrier\n");
  return 0;
}
