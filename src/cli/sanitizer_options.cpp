// Sanitized builds only (scripts/test --sanitize): LeakSanitizer is off in a process that OpenMPI
// started, whose libraries keep (and partly unload before exit) allocations that no suppression
// can name; every other process is checked for leaks. ASan calls this before main, before libc
// has set up getenv, so the environment is read from /proc with raw system calls.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MESHTUNE_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define MESHTUNE_ASAN 1
#endif

#ifdef MESHTUNE_ASAN
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

extern "C" const char* __asan_default_options() {
  static char environ_bytes[1 << 20];
  const long fd = syscall(SYS_open, "/proc/self/environ", O_RDONLY);
  if (fd < 0) return "";
  long size = 0, n = 0;
  while (size < long(sizeof environ_bytes) - 1 &&
         (n = syscall(SYS_read, fd, environ_bytes + size, sizeof environ_bytes - 1 - size)) > 0)
    size += n;
  syscall(SYS_close, fd);
  static const char kKey[] = "OMPI_COMM_WORLD_SIZE=";
  for (long i = 0; i < size; i += long(std::strlen(environ_bytes + i)) + 1)
    if (std::strncmp(environ_bytes + i, kKey, sizeof kKey - 1) == 0) return "detect_leaks=0";
  return "";
}
#endif
