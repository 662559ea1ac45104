#include "io/mapped_files.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace meshtune {

namespace {

// A fixed table, so that the signal handler reads it without locks or allocation. A slot is taken
// with `state` 0 → 1 (being written) → 2 (valid); the handler reads only valid slots.
struct Slot {
  std::atomic<int> state{0};
  const char* begin = nullptr;
  const char* end = nullptr;
  char path[1024] = {};
};
constexpr int kSlots = 256;
Slot g_slots[kSlots];

void write_all(const char* text) {
  size_t n = std::strlen(text);
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, text, n);
    if (w <= 0) return;
    text += w, n -= size_t(w);
  }
}

void on_sigbus(int signal, siginfo_t* info, void*) {
  const char* address = static_cast<const char*>(info->si_addr);
  for (Slot& s : g_slots) {
    if (s.state.load(std::memory_order_acquire) != 2 || address < s.begin || address >= s.end) continue;
    write_all("meshtune: error: ");
    write_all(s.path);
    write_all(": the file changed while it was in use (it was truncated or rewritten under this process, "
              "which reads it through a memory map); run again once it is complete\n");
    ::_exit(1);
  }
  ::signal(signal, SIG_DFL);  // not one of ours: the default action (a core dump) as before
  ::raise(signal);
}

}  // namespace

namespace {

// One read-only map; every tensor viewing it holds a shared_ptr to it.
struct Mapping {
  void* addr = nullptr;
  size_t size = 0;
  Mapping(void* a, size_t s, const std::string& path) : addr(a), size(s) { register_mapped_file(a, s, path); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    unregister_mapped_file(addr);
    munmap(addr, size);
  }
};

}  // namespace

MappedRange map_file_range(const std::string& path, uint64_t offset, uint64_t size, bool read_ahead) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, ": cannot open: ", std::strerror(errno));
  struct FdCloser {  // the map stays valid after close
    int fd;
    ~FdCloser() { close(fd); }
  } closer{fd};
  struct stat st;
  if (fstat(fd, &st) != 0) fail(path, ": cannot stat: ", std::strerror(errno));
  check(S_ISREG(st.st_mode), path, ": not a regular file");
  check(offset <= uint64_t(st.st_size) && size <= uint64_t(st.st_size) - offset, path, ": bytes [", offset, ", ",
        offset, " + ", size, ") run past the end of the file (", st.st_size, " bytes)");
  if (size == 0) return {};
  const uint64_t page = uint64_t(sysconf(_SC_PAGESIZE));
  const uint64_t start = offset / page * page;  // mmap's offset must be a multiple of the page size
  const size_t length = size_t(offset - start + size);
  // MAP_POPULATE reads the range in one go at mmap time instead of one page fault per 4 KiB page
  // as the caller walks it (in a virtual machine each fault costs an exit to the hypervisor).
  void* addr = mmap(nullptr, length, PROT_READ, MAP_PRIVATE | (read_ahead ? MAP_POPULATE : 0), fd, off_t(start));
  if (addr == MAP_FAILED) fail(path, ": cannot mmap: ", std::strerror(errno));
  auto mapping = std::make_shared<const Mapping>(addr, length, path);
  return {static_cast<const std::byte*>(addr) + (offset - start), mapping};
}

void register_mapped_file(const void* addr, size_t size, const std::string& path) {
  for (Slot& s : g_slots) {
    int free = 0;
    if (!s.state.compare_exchange_strong(free, 1)) continue;
    s.begin = static_cast<const char*>(addr);
    s.end = s.begin + size;
    std::strncpy(s.path, path.c_str(), sizeof(s.path) - 1);
    s.path[sizeof(s.path) - 1] = '\0';
    s.state.store(2, std::memory_order_release);
    return;
  }
  // A full table only loses the file's name in the message; the map itself works.
}

void unregister_mapped_file(const void* addr) {
  for (Slot& s : g_slots) {
    if (s.state.load(std::memory_order_acquire) == 2 && s.begin == addr) {
      s.state.store(1);
      s.begin = s.end = nullptr;
      s.state.store(0, std::memory_order_release);
      return;
    }
  }
}

void exit_on_fault_in_mapped_file() {
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_sigaction = on_sigbus;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGBUS, &action, nullptr);
}

}  // namespace meshtune
