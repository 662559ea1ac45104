// Collectives between processes (one device per process, as torchrun / Megatron / llm.c do). Under
// `mpirun` the communicator wraps MPI (OpenMPI); without it, a one-process communicator whose
// collectives are copies. Every call is blocking. Errors (a peer that died, a size mismatch) throw
// meshtune::Error; callers exit, and MPI's default error handler ends the other ranks.
//
// Collectives take device-tagged spans, as backend ops do: the public functions check that every
// operand is in the communicator's memory (MPI's: host) and long enough, then call the
// implementation with raw pointers — so a device communicator (NCCL, on a backend's stream) plugs
// in by implementing the *_impl functions over device pointers. A device communicator also takes
// host operands (a flag, the gradients' squared norms, names): they go to its host twin, the same
// members over MPI (DeviceCommunicator).
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "core/buffer.h"

namespace meshtune {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Device device() const { return Device::Host; }  // where its operands must be

  // In-place sum over all members (all of `data`).
  void all_reduce_sum(Span<float> data);
  void all_reduce_sum(Span<double> data);
  // In-place element-wise maximum over all members.
  void all_reduce_max(Span<float> data);
  // out[r·n + i] = member r's in[i], n = in.size (out holds at least size()·n elements).
  void all_gather(Span<const float> in, Span<float> out);
  // Sums in[size()·n] over members, n = out.size; member r keeps elements [r·n, (r+1)·n) in out.
  void reduce_scatter_sum(Span<const float> in, Span<float> out);
  void broadcast(Span<float> data, int root);
  // Sums each array in place, as all_reduce_sum on each does; a device communicator may fuse them
  // (NCCL: one group of calls).
  virtual void all_reduce_sum_group(const std::vector<Span<float>>& arrays);
  virtual void broadcast_bytes(std::string& bytes, int root) = 0;  // host bytes (names, manifests)
  virtual void barrier() = 0;
  // A sub-communicator of the members passing the same `color`, ordered by `key` (MPI_Comm_split).
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

 protected:
  // Where host operands go when this communicator works on a device's memory (null: nowhere).
  virtual Communicator* host_twin() { return nullptr; }
  Communicator* for_memory(Device where);
  virtual void all_reduce_sum_impl(float* data, size_t count) = 0;
  virtual void all_reduce_sum_impl(double* data, size_t count) = 0;
  virtual void all_reduce_max_impl(float* data, size_t count) = 0;
  virtual void all_gather_impl(const float* in, size_t count, float* out) = 0;
  virtual void reduce_scatter_sum_impl(const float* in, size_t count, float* out) = 0;
  virtual void broadcast_impl(float* data, size_t count, int root) = 0;
};

// A communicator of a device's memory over the members of `host` (its twin for host operands, and
// what rank(), size(), broadcast_bytes() and barrier() are). It owns the host communicator it was
// split from, or borrows one (world()) that outlives it.
class DeviceCommunicator : public Communicator {
 public:
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  Device device() const override { return device_; }
  void broadcast_bytes(std::string& bytes, int root) override { host_->broadcast_bytes(bytes, root); }
  void barrier() override { host_->barrier(); }

 protected:
  DeviceCommunicator(Communicator& borrowed, Device device) : host_(&borrowed), device_(device) {}
  DeviceCommunicator(std::unique_ptr<Communicator> owned, Device device)
      : host_(owned.get()), owned_(std::move(owned)), device_(device) {}
  Communicator* host_twin() override { return host_; }
  Communicator& host() { return *host_; }

 private:
  Communicator* host_;
  std::unique_ptr<Communicator> owned_;
  Device device_;
};

// A DeviceCommunicator for a backend whose device memory is host memory under a device's tag
// (ReferenceBackend(Device::Cuda), the tests' stand-in for a GPU): the host's collectives on it.
// It lets the GPU meshes' code paths — which operands are device memory, which host — run and be
// checked against host meshes without a GPU.
std::unique_ptr<Communicator> make_device_tagged_communicator(Communicator& host, Device device);

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
