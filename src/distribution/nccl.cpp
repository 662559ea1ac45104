#include "distribution/nccl.h"

#include "core/error.h"

#ifdef MESHTUNE_HAVE_CUDA
#include <dlfcn.h>
#include <nccl.h>
#endif

namespace meshtune {

#ifdef MESHTUNE_HAVE_CUDA

static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes, "NCCL's unique id changed size");

// Rank 0's id: NCCL opened here (see nccl.h), its ncclGetUniqueId called once.
static std::string make_unique_id() {
  void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (!lib) lib = dlopen(MESHTUNE_CUDA_LIBRARY_DIR "/libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  check(lib != nullptr, "NCCL: cannot open libnccl.so.2: ", dlerror());
  using GetUniqueId = ncclResult_t (*)(ncclUniqueId*);
  auto get_unique_id = reinterpret_cast<GetUniqueId>(dlsym(lib, "ncclGetUniqueId"));
  check(get_unique_id != nullptr, "NCCL: libnccl.so.2 has no ncclGetUniqueId");
  ncclUniqueId id;
  const ncclResult_t status = get_unique_id(&id);
  check(status == ncclSuccess, "NCCL: ncclGetUniqueId failed (result ", int(status), ")");
  return std::string(id.internal, sizeof(id.internal));
}

std::string nccl_unique_id(Communicator& comm) {
  // Rank 0's failure must not leave the others waiting for the id: its message is broadcast first,
  // and every rank fails with it.
  std::string id, error;
  if (comm.rank() == 0) {
    try {
      id = make_unique_id();
    } catch (const Error& e) {
      error = e.what();
    }
  }
  comm.broadcast_bytes(error, 0);
  check(error.empty(), error);
  comm.broadcast_bytes(id, 0);
  check(id.size() == kNcclUniqueIdBytes, "NCCL: the unique id from rank 0 has ", id.size(), " bytes, not ",
        kNcclUniqueIdBytes);
  return id;
}

#else

std::string nccl_unique_id(Communicator&) {
  fail("NCCL: this meshtune was built without the CUDA backend (no CUDA toolkit when it was built)");
}

#endif

}  // namespace meshtune
