// The CUDA emulator's runtime (emulator.h says what it is for and what it checks): fibers for a
// block's threads, the device memory, the runtime calls and cuBLAS' products.
#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/scalar_math.h"
#include "cublas_v2.h"
#include "cuda_runtime.h"
#include "device_work.h"

#if defined(__SANITIZE_ADDRESS__)
#define CUDA_EMULATOR_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CUDA_EMULATOR_ASAN 1
#endif
#endif
#ifdef CUDA_EMULATOR_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

namespace cuda_emulator {
namespace {

constexpr unsigned kMaxThreads = 1024;                 // per block
constexpr size_t kDefaultSharedBytes = 48 * 1024;      // dynamic shared memory without the opt-in
constexpr int kOptInSharedBytes = 227 * 1024;          // an H100/H200's opt-in limit per block
constexpr size_t kStackBytes = 256 * 1024;             // per emulated thread (kernels and libm)

cudaError_t last_error = cudaSuccess;
std::string& last_error_text = *new std::string;  // never destroyed (see allocations())

cudaError_t record(cudaError_t error, const std::string& text) {
  if (last_error == cudaSuccess) last_error = error, last_error_text = text;
  return error;
}

// ---- device memory: every allocation is known, so that copies can be checked against it ----

// The emulator's state is never destroyed: a backend held in a static (as the op registry's is) frees
// its memory after other statics are gone.
std::map<const char*, size_t>& allocations() {
  static auto* blocks = new std::map<const char*, size_t>;
  return *blocks;
}

// Whether [p, p + bytes) lies inside one of `blocks` (start → bytes): a device allocation, or
// pinned host memory.
bool inside_one(const std::map<const char*, size_t>& blocks, const void* p, size_t bytes) {
  auto it = blocks.upper_bound(static_cast<const char*>(p));
  if (it == blocks.begin()) return false;
  --it;
  const char* c = static_cast<const char*>(p);
  return c >= it->first && c + bytes <= it->first + it->second;
}
bool on_device(const void* p, size_t bytes) { return inside_one(allocations(), p, bytes); }

// Device memory outside AddressSanitizer (device_work.h): allocations in whole pages of one reserved
// range, which is readable only while a DeviceWork lives (one mprotect each way for all of it).
#ifndef CUDA_EMULATOR_ASAN
constexpr size_t kPage = 4096;
constexpr size_t kReservedBytes = size_t(1) << 40;  // address space only (16 GB is the emulated GPU's)

struct DeviceRange {
  char* base = nullptr;
  size_t end = 0;                       // bytes from base ever handed out (the range mprotect toggles)
  std::map<size_t, size_t> free_pages;  // offset → bytes, coalesced
  int open = 0;                         // 1 while a DeviceWork lives
};

void report_host_access(int, siginfo_t*, void*);

DeviceRange& device_range() {
  static DeviceRange& range = *[] {
    auto* made = new DeviceRange;
    void* base = mmap(nullptr, kReservedBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) {
      std::fprintf(stderr, "cuda emulator: cannot reserve the device memory's address range\n");
      std::abort();
    }
    made->base = static_cast<char*>(base);
    struct sigaction action = {};
    action.sa_sigaction = report_host_access;
    action.sa_flags = SA_SIGINFO | SA_RESETHAND;  // the second fault (after the report) ends the process
    sigaction(SIGSEGV, &action, nullptr);
    return made;
  }();
  return range;
}

void set_access(DeviceRange& range, int protection) {
  if (range.end > 0 && mprotect(range.base, range.end, protection) != 0) {
    std::fprintf(stderr, "cuda emulator: mprotect of the device memory failed\n");
    std::abort();
  }
}

// SIGSEGV: when the address is device memory, say so (with the stack, for addr2line); then the fault
// repeats with the default action.
void report_host_access(int, siginfo_t* info, void*) {
  const DeviceRange& range = device_range();
  const char* address = static_cast<const char*>(info->si_addr);
  if (address >= range.base && address < range.base + kReservedBytes) {
    const char message[] =
        "cuda emulator: host code touched device memory outside a launch, product or copy (a segfault on a GPU "
        "too). Stack:\n";
    (void)!write(2, message, sizeof message - 1);
    void* frames[64];
    backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  }
}

void* allocate_device(size_t bytes) {
  DeviceRange& range = device_range();
  const size_t size = (std::max<size_t>(bytes, 1) + kPage - 1) / kPage * kPage;
  for (auto it = range.free_pages.begin(); it != range.free_pages.end(); ++it) {
    if (it->second < size) continue;
    const size_t offset = it->first, left = it->second - size;
    range.free_pages.erase(it);
    if (left > 0) range.free_pages[offset + size] = left;
    return range.base + offset;
  }
  if (range.end + size > kReservedBytes) return nullptr;
  const size_t offset = range.end;
  range.end += size;
  if (range.open > 0) set_access(range, PROT_READ | PROT_WRITE);
  return range.base + offset;
}

void free_device(void* p, size_t bytes) {
  DeviceRange& range = device_range();
  size_t offset = size_t(static_cast<char*>(p) - range.base);
  size_t size = (std::max<size_t>(bytes, 1) + kPage - 1) / kPage * kPage;
  madvise(p, size, MADV_DONTNEED);  // give the pages back
  auto next = range.free_pages.lower_bound(offset);
  if (next != range.free_pages.end() && next->first == offset + size) size += next->second, range.free_pages.erase(next);
  auto before = range.free_pages.lower_bound(offset);
  if (before != range.free_pages.begin() && std::prev(before)->first + std::prev(before)->second == offset) {
    --before;
    offset = before->first, size += before->second;
  }
  range.free_pages[offset] = size;
}
#else
void* allocate_device(size_t bytes) {
  // Exactly `bytes` (cudaMalloc rounds up; AddressSanitizer then sees a kernel's overrun at once).
  void* memory = nullptr;
  return posix_memalign(&memory, 256, bytes == 0 ? 1 : bytes) == 0 ? memory : nullptr;
}
void free_device(void* p, size_t) { std::free(p); }
#endif

}  // namespace

// The outermost DeviceWork also times the emulated GPU's work (Counts::device_seconds).
namespace {
int open_work = 0;
std::chrono::steady_clock::time_point work_started;
}  // namespace

DeviceWork::DeviceWork() {
  if (open_work++ > 0) return;
  work_started = std::chrono::steady_clock::now();  // the emulator's own protection calls count as the GPU's
#ifndef CUDA_EMULATOR_ASAN
  DeviceRange& range = device_range();
  range.open = 1;
  set_access(range, PROT_READ | PROT_WRITE);
#endif
}
DeviceWork::~DeviceWork() {
  if (--open_work > 0) return;
#ifndef CUDA_EMULATOR_ASAN
  DeviceRange& range = device_range();
  range.open = 0;
  set_access(range, PROT_NONE);
#endif
  counts().device_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - work_started).count();
}

namespace {

// ---- a block's threads as fibers ----
// One fiber per thread slot of a block, made when first needed and reused by every later block (a
// kernel thread that ends waits for the next one), switched by `switch_stack` below: six registers
// and the stack pointer, no system call (swapcontext's signal-mask calls made the emulated tests
// twice as slow).

#if !defined(__x86_64__)
#error "the CUDA emulator's fiber switch is written for x86-64"
#endif

// Saves the callee-saved registers on the running stack, stores its stack pointer in *save, loads
// `next` and returns into whatever saved it (or into a new fiber's entry, see fresh_stack).
extern "C" void cuda_emulator_switch_stack(void** save, void* next);
asm(R"(
  .text
  .globl cuda_emulator_switch_stack
  .type cuda_emulator_switch_stack, @function
cuda_emulator_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_emulator_switch_stack, .-cuda_emulator_switch_stack
)");

enum class Wait { Running, Barrier, Shuffle, Done };

struct Thread {
  void* stack_pointer = nullptr;  // where the fiber stopped; nullptr: not made (or abandoned)
  Wait wait = Wait::Running;
  uint64_t offered = 0, received = 0;  // a shuffle's value, sent and got
  size_t size = 0;
  Shuffle kind = Shuffle::Down;
  unsigned argument = 0, mask = 0;
#ifdef CUDA_EMULATOR_ASAN
  void* fake_stack = nullptr;
#endif
};

struct Block {
  std::vector<Thread> threads;
  unsigned current = 0;
  void* scheduler = nullptr;  // the scheduler's stack pointer while a fiber runs
  const std::function<void()>* body = nullptr;
  std::vector<char> shared;
  char* stacks = nullptr;  // kMaxThreads stacks, mapped once
#ifdef CUDA_EMULATOR_ASAN
  void* scheduler_fake_stack = nullptr;
  const void* scheduler_stack = nullptr;
  size_t scheduler_stack_size = 0;
#endif
};

Block& block() {
  static Block& b = *[] {
    auto* made = new Block;
    void* stacks = mmap(nullptr, kMaxThreads * kStackBytes, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stacks == MAP_FAILED) {
      std::fprintf(stderr, "cuda emulator: cannot map the threads' stacks\n");
      std::abort();
    }
    made->stacks = static_cast<char*>(stacks);
    made->threads.resize(kMaxThreads);
    return made;
  }();
  return b;
}

// Switches from the running thread back to the scheduler (and returns when resumed).
void yield_to_scheduler(Thread& t) {
  Block& b = block();
#ifdef CUDA_EMULATOR_ASAN
  __sanitizer_start_switch_fiber(&t.fake_stack, b.scheduler_stack, b.scheduler_stack_size);
#endif
  cuda_emulator_switch_stack(&t.stack_pointer, b.scheduler);
#ifdef CUDA_EMULATOR_ASAN
  __sanitizer_finish_switch_fiber(t.fake_stack, nullptr, nullptr);
#endif
}

// A fiber's life: run the kernel for the thread the scheduler resumed it as, report Done, wait for
// the next block. Never returns.
void fiber_main() {
  Block& b = block();
#ifdef CUDA_EMULATOR_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &b.scheduler_stack, &b.scheduler_stack_size);
#endif
  for (;;) {
    Thread& t = b.threads[b.current];
    try {
      (*b.body)();
    } catch (const std::exception& e) {
      record(cudaErrorLaunchFailure, std::string("a kernel thread threw: ") + e.what());
    }
    t.wait = Wait::Done;
    yield_to_scheduler(t);
  }
}

// A new fiber's stack: switch_stack's six registers (zero) over fiber_main's address, which its
// `ret` jumps to with the stack aligned as after a call.
void* fresh_stack(char* bottom) {
  auto* top = reinterpret_cast<uintptr_t*>(bottom + kStackBytes);  // 16-byte aligned
  top[-1] = 0;                                         // fiber_main's return address: never used
  top[-2] = reinterpret_cast<uintptr_t>(&fiber_main);  // where the first switch's ret goes
  for (int r = 3; r <= 8; ++r) top[-r] = 0;            // rbp, rbx, r12–r15
  return top - 8;
}

void resume(Block& b, unsigned index) {
  Thread& t = b.threads[index];
  char* stack = b.stacks + size_t(index) * kStackBytes;
  if (!t.stack_pointer) t.stack_pointer = fresh_stack(stack);
  b.current = index;
  const unsigned per_row = blockDim.x, per_plane = blockDim.x * blockDim.y;
  threadIdx = uint3{index % per_row, (index % per_plane) / per_row, index / per_plane};
  t.wait = Wait::Running;
#ifdef CUDA_EMULATOR_ASAN
  __sanitizer_start_switch_fiber(&b.scheduler_fake_stack, stack, kStackBytes);
#endif
  cuda_emulator_switch_stack(&b.scheduler, t.stack_pointer);
#ifdef CUDA_EMULATOR_ASAN
  __sanitizer_finish_switch_fiber(b.scheduler_fake_stack, nullptr, nullptr);
#endif
}

// Completes the shuffle of warp w if all its lanes are at one; false if they are not (yet).
// An error (a string) when the warp can never complete it.
bool complete_shuffle(Block& b, unsigned w, unsigned count, std::string& error) {
  const unsigned first = 32 * w;
  bool any = false, all = true;
  for (unsigned l = 0; l < 32 && first + l < count; ++l) {
    const Wait wait = b.threads[first + l].wait;
    any |= wait == Wait::Shuffle;
    all &= wait == Wait::Shuffle;
  }
  if (!any || !all) return false;
  if (count % 32 != 0) {
    error = "a warp shuffle in a block of " + std::to_string(count) + " threads (not whole warps)";
    return false;
  }
  for (unsigned l = 0; l < 32; ++l) {
    Thread& t = b.threads[first + l];
    if (t.mask != 0xffffffffu) {
      error = "a warp shuffle with a partial mask";
      return false;
    }
    if (t.kind != b.threads[first].kind || t.size != b.threads[first].size) {
      error = "lanes of warp " + std::to_string(w) + " at different shuffles";
      return false;
    }
  }
  for (unsigned l = 0; l < 32; ++l) {
    Thread& t = b.threads[first + l];
    unsigned source = t.kind == Shuffle::Down ? l + t.argument : (l ^ t.argument);
    if (source >= 32) source = l;  // shfl_down past the warp's end keeps the lane's own value
    t.received = b.threads[first + source].offered;
    t.wait = Wait::Running;
  }
  return true;
}

// Why the block cannot go on (threads waiting that nothing will release), for the launch error.
std::string stuck_block(const Block& b, unsigned count) {
  unsigned barrier = 0, shuffle = 0, done = 0;
  for (unsigned i = 0; i < count; ++i) {
    barrier += b.threads[i].wait == Wait::Barrier;
    shuffle += b.threads[i].wait == Wait::Shuffle;
    done += b.threads[i].wait == Wait::Done;
  }
  return "block stuck: " + std::to_string(barrier) + " threads at __syncthreads, " + std::to_string(shuffle) +
         " at a warp shuffle, " + std::to_string(done) + " exited (of " + std::to_string(count) +
         ") — a barrier or full-mask shuffle that not every thread reaches";
}

// The order a block's threads run in between barriers: by index, or — MESHTUNE_CUDA_EMULATOR_ORDER=
// reverse — last first. A missing barrier shows as a wrong result when the reader runs before the
// writer: ctest runs the op registry both ways, so it shows whichever of the two comes first.
bool reverse_order() {
  static const bool reverse = [] {
    const char* order = std::getenv("MESHTUNE_CUDA_EMULATOR_ORDER");
    const std::string name = order ? order : "forward";
    if (name != "forward" && name != "reverse") {
      std::fprintf(stderr, "MESHTUNE_CUDA_EMULATOR_ORDER=%s: expected forward or reverse\n", name.c_str());
      std::exit(2);
    }
    return name == "reverse";
  }();
  return reverse;
}

// Runs one block to its end; false (with `error`) if it gets stuck.
bool run_block(Block& b, unsigned count, std::string& error) {
  for (unsigned i = 0; i < count; ++i) b.threads[i].wait = Wait::Running;
  const bool reverse = reverse_order();
  for (;;) {
    for (unsigned k = 0; k < count; ++k) {
      const unsigned i = reverse ? count - 1 - k : k;
      if (b.threads[i].wait == Wait::Running) resume(b, i);
    }
    bool released = false;
    for (unsigned w = 0; 32 * w < count; ++w) released |= complete_shuffle(b, w, count, error);
    if (!error.empty()) break;
    if (released) continue;
    unsigned at_barrier = 0, done = 0;
    for (unsigned i = 0; i < count; ++i) {
      at_barrier += b.threads[i].wait == Wait::Barrier;
      done += b.threads[i].wait == Wait::Done;
    }
    if (done == count) return true;
    if (at_barrier == count) {
      for (unsigned i = 0; i < count; ++i) b.threads[i].wait = Wait::Running;
      continue;
    }
    error = stuck_block(b, count);
    break;
  }
  for (unsigned i = 0; i < count; ++i) b.threads[i].stack_pointer = nullptr;  // abandoned mid-kernel
  return false;
}

std::unordered_map<const void*, int>& max_dynamic_shared() {
  static auto* limits = new std::unordered_map<const void*, int>;
  return *limits;
}

}  // namespace

Counts& counts() {
  static auto* counted = new Counts;
  return *counted;
}

// ---- CUDA graphs: while the stream is captured, its calls are recorded as the graph's nodes ----
}  // namespace cuda_emulator

struct CUgraph_st {
  struct Node {
    std::string what;                // the kernel's name, "memset", "copy" or "product"
    const void* function = nullptr;  // the kernel
    std::function<void()> run;
  };
  std::vector<Node> nodes;
};
struct CUgraphExec_st {
  std::vector<CUgraph_st::Node> nodes;
};

namespace cuda_emulator {
namespace {

struct Capture {
  CUgraph_st* graph = nullptr;  // null: not capturing
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  bool invalidated = false;  // a call a capture does not allow: cudaStreamEndCapture fails
};
Capture& capture() {
  static auto* state = new Capture;
  return *state;
}

// Records `run` as a node of the capture in progress (true), or returns false: no capture, run it now.
bool captured(const std::string& what, const void* function, std::function<void()> run) {
  if (!capture().graph) return false;
  capture().graph->nodes.push_back({what, function, std::move(run)});
  return true;
}

// A call a stream capture does not allow (it synchronizes, or crosses to the host): CUDA fails it and
// invalidates the capture. cudaSuccess when there is no capture.
cudaError_t not_while_capturing(const char* call) {
  if (!capture().graph) return cudaSuccess;
  capture().invalidated = true;
  return record(cudaErrorStreamCaptureUnsupported, std::string(call) + " while the stream is being captured");
}

void execute_kernel(dim3 grid, dim3 block_shape, size_t shared_bytes, const char* name, const std::function<void()>& thread);

}  // namespace

void run_kernel(dim3 grid, dim3 block_shape, size_t shared_bytes, const void* kernel, const char* name,
                std::function<void()> thread) {
  ++counts().launches[name];
  const uint64_t threads = uint64_t(block_shape.x) * block_shape.y * block_shape.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    record(cudaErrorInvalidConfiguration, std::string(name) + ": a launch of " + std::to_string(grid.x) + " x " + std::to_string(grid.y) +
                                              " x " + std::to_string(grid.z) + " blocks");
    return;
  }
  if (threads == 0 || threads > kMaxThreads || block_shape.z > 64) {
    record(cudaErrorInvalidConfiguration, std::string(name) + ": a launch of blocks of " + std::to_string(threads) + " threads");
    return;
  }
  const auto raised = max_dynamic_shared().find(kernel);
  const size_t allowed = raised != max_dynamic_shared().end() ? size_t(raised->second) : kDefaultSharedBytes;
  if (shared_bytes > allowed) {
    record(cudaErrorInvalidValue, std::string(name) + ": a launch with " + std::to_string(shared_bytes) +
                                      " bytes of dynamic shared memory, more than the kernel's " +
                                      std::to_string(allowed));
    return;
  }
  if (captured(name, kernel, [=] { execute_kernel(grid, block_shape, shared_bytes, name, thread); })) return;
  execute_kernel(grid, block_shape, shared_bytes, name, thread);
}

namespace {
void execute_kernel(dim3 grid, dim3 block_shape, size_t shared_bytes, const char* name,
                    const std::function<void()>& thread) {
  const uint64_t threads = uint64_t(block_shape.x) * block_shape.y * block_shape.z;
  const DeviceWork working;
  Block& b = block();
  b.body = &thread;
  b.shared.assign(shared_bytes + 1, char(0x7f));  // not zero: a kernel must not read what it did not write
  gridDim = grid;
  blockDim = block_shape;
  // Blocks in index order, or last first under MESHTUNE_CUDA_EMULATOR_ORDER=reverse (as the threads
  // of a block): a kernel that counts on an order of its blocks (which block finishes last) fails one.
  const bool reverse = reverse_order();
  const auto at = [reverse](unsigned i, unsigned n) { return reverse ? n - 1 - i : i; };
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = uint3{at(x, grid.x), at(y, grid.y), at(z, grid.z)};
        std::string error;
        if (!run_block(b, unsigned(threads), error)) {
          record(cudaErrorLaunchFailure, std::string(name) + ", block (" + std::to_string(blockIdx.x) + ", " +
                                             std::to_string(blockIdx.y) + ", " + std::to_string(blockIdx.z) + "): " + error);
          return;
        }
      }
}
}  // namespace

cudaError_t set_function_attribute(const void* kernel, int attribute, int value) {
  if (attribute != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || value > kOptInSharedBytes)
    return record(cudaErrorInvalidValue, "cudaFuncSetAttribute(" + std::to_string(attribute) + ", " +
                                             std::to_string(value) + ")");
  max_dynamic_shared()[kernel] = value;
  return cudaSuccess;
}

bool device_pointer(const void* p) { return on_device(p, 0); }

void record_bad_argument(const char* kernel, size_t index) {
  record(cudaErrorInvalidValue, std::string(kernel) + ": argument " + std::to_string(index) +
                                    " points outside device memory (host memory on a GPU faults)");
}

void* dynamic_shared_bytes() { return block().shared.data(); }

uint64_t shuffle(unsigned mask, uint64_t bits, size_t size, Shuffle kind, unsigned argument) {
  Block& b = block();
  Thread& t = b.threads[b.current];
  t.mask = mask, t.offered = bits, t.size = size, t.kind = kind, t.argument = argument;
  t.wait = Wait::Shuffle;
  yield_to_scheduler(t);
  return t.received;
}

// ---- cuBLAS: C = α·op(A)·op(B) + β·C, column-major, fp32 or bf16 inputs, fp32 C ----

namespace {

float element(const void* base, cudaDataType type, int64_t index) {
  return type == CUDA_R_32F ? static_cast<const float*>(base)[index]
                            : meshtune::bf16_to_f32(static_cast<const uint16_t*>(base)[index]);
}

cublasStatus_t gemm_run(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float a, const void* A,
                        cudaDataType Atype, int lda, long long strideA, const void* B, cudaDataType Btype, int ldb,
                        long long strideB, float bt, void* C, int ldc, long long strideC, int batch);

cublasStatus_t gemm_checked(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, long long strideA, const void* B,
                            cudaDataType Btype, int ldb, long long strideB, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, long long strideC, int batch, cublasComputeType_t compute) {
  const int a_rows = ta == CUBLAS_OP_N ? m : k, b_rows = tb == CUBLAS_OP_N ? k : n;
  if (m < 0 || n < 0 || k < 0 || batch < 0 || lda < std::max(1, a_rows) || ldb < std::max(1, b_rows) ||
      ldc < std::max(1, m))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (Atype != Btype || (Atype != CUDA_R_32F && Atype != CUDA_R_16BF) || Ctype != CUDA_R_32F ||
      compute != CUBLAS_COMPUTE_32F)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  ++counts().products;
  // α and β are host values, read at the call (a captured product keeps them).
  const float a = *static_cast<const float*>(alpha), bt = *static_cast<const float*>(beta);
  const auto run = [=] {
    return gemm_run(ta, tb, m, n, k, a, A, Atype, lda, strideA, B, Btype, ldb, strideB, bt, C, ldc, strideC, batch);
  };
  if (captured("product", nullptr, [run] {
        if (run() != CUBLAS_STATUS_SUCCESS) record(cudaErrorLaunchFailure, "a captured cuBLAS product: invalid operands");
      }))
    return CUBLAS_STATUS_SUCCESS;
  return run();
}

cublasStatus_t gemm_run(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float a, const void* A,
                        cudaDataType Atype, int lda, long long strideA, const void* B, cudaDataType Btype, int ldb,
                        long long strideB, float bt, void* C, int ldc, long long strideC, int batch) {
  const int a_rows = ta == CUBLAS_OP_N ? m : k, b_rows = tb == CUBLAS_OP_N ? k : n;
  const DeviceWork working;
  const size_t in_size = Atype == CUDA_R_32F ? 4 : 2;
  // Every matrix the product reads or writes lies inside one device allocation (a GPU faults on host
  // memory; one past an allocation reads another's).
  auto inside = [&](const void* p, int64_t rows, int64_t cols, int64_t ld, long long stride, size_t size) {
    if (rows == 0 || cols == 0 || batch == 0) return true;
    const int64_t last = (rows - 1) + (cols - 1) * ld + (batch - 1) * int64_t(stride);
    return stride >= 0 && on_device(p, size_t(last + 1) * size);
  };
  if (!inside(A, a_rows, ta == CUBLAS_OP_N ? k : m, lda, strideA, in_size) ||
      !inside(B, b_rows, tb == CUBLAS_OP_N ? n : k, ldb, strideB, in_size) || !inside(C, m, n, ldc, strideC, 4))
    return CUBLAS_STATUS_INVALID_VALUE;
  for (int64_t batch_index = 0; batch_index < batch; ++batch_index) {
    const char* Ab = static_cast<const char*>(A) + batch_index * strideA * int64_t(in_size);
    const char* Bb = static_cast<const char*>(B) + batch_index * strideB * int64_t(in_size);
    float* Cb = static_cast<float*>(C) + batch_index * strideC;
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        double sum = 0;
        for (int l = 0; l < k; ++l) {
          const float x = element(Ab, Atype, ta == CUBLAS_OP_N ? i + int64_t(l) * lda : l + int64_t(i) * lda);
          const float y = element(Bb, Btype, tb == CUBLAS_OP_N ? l + int64_t(j) * ldb : j + int64_t(l) * ldb);
          sum += double(x) * double(y);
        }
        float& c = Cb[i + int64_t(j) * ldc];
        c = bt == 0.f ? float(a * sum) : float(a * sum + double(bt) * c);  // β = 0: C is not read
      }
  }
  return CUBLAS_STATUS_SUCCESS;
}

struct cublasContextState {
  bool created = true;
};

}  // namespace

void* cublas_symbol(const char* name) {
  static const auto* symbols = new std::map<std::string, void*>{
      {"cublasCreate_v2", reinterpret_cast<void*>(&cublasCreate_v2)},
      {"cublasDestroy_v2", reinterpret_cast<void*>(&cublasDestroy_v2)},
      {"cublasSetStream_v2", reinterpret_cast<void*>(&cublasSetStream_v2)},
      {"cublasSetMathMode", reinterpret_cast<void*>(&cublasSetMathMode)},
      {"cublasSetWorkspace_v2", reinterpret_cast<void*>(&cublasSetWorkspace_v2)},
      {"cublasGemmEx", reinterpret_cast<void*>(&cublasGemmEx)},
      {"cublasGemmStridedBatchedEx", reinterpret_cast<void*>(&cublasGemmStridedBatchedEx)},
  };
  const auto it = symbols->find(name);
  return it == symbols->end() ? nullptr : it->second;
}

}  // namespace cuda_emulator

using namespace cuda_emulator;

// ---- the runtime ----

void __syncthreads() {
  Block& b = block();
  Thread& t = b.threads[b.current];
  t.wait = Wait::Barrier;
  yield_to_scheduler(t);
}

int __dp4a(int a, int b, int c) {
  int sum = c;
  for (int i = 0; i < 4; ++i) sum += int(int8_t(uint32_t(a) >> (8 * i))) * int(int8_t(uint32_t(b) >> (8 * i)));
  return sum;
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : record(cudaErrorInvalidDevice, "cudaSetDevice(" + std::to_string(device) + ")");
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return record(cudaErrorInvalidDevice, "cudaGetDeviceProperties");
  std::snprintf(prop->name, sizeof prop->name, "%s", "CUDA emulator");
  prop->totalGlobalMem = size_t(16) << 30;
  prop->major = 9, prop->minor = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int) {
  if (attribute != cudaDevAttrMaxSharedMemoryPerBlockOptin) return record(cudaErrorInvalidValue, "cudaDeviceGetAttribute");
  *value = kOptInSharedBytes;
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
  static char the_stream;
  *stream = reinterpret_cast<cudaStream_t>(&the_stream);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
// ---- pinned host memory: copies to and from it land when the host has waited for them ----
// The emulator runs every call to its end at once, but a GPU copies to or from pinned memory when
// its stream gets there, and the host may not look before it has waited (an event recorded after
// the copy, or the stream). So a copy into pinned memory lands only then — a host reading it sooner
// sees what was there before (0xff bytes at first) — and a copy out of pinned memory is checked
// then to have read what the host has left there since (a host that overwrote it sooner fails).
namespace {
std::map<const char*, size_t>& pinned_blocks() {
  static auto* blocks = new std::map<const char*, size_t>;
  return *blocks;
}
bool is_pinned(const void* p, size_t bytes) { return inside_one(pinned_blocks(), p, bytes); }
struct PinnedCopy {
  uint64_t order = 0;       // its place in the stream
  char* pinned = nullptr;   // the pinned side
  std::vector<char> bytes;  // a download's values, still to land; an upload's source as it was read
  bool download = false;
};
std::vector<PinnedCopy>& pinned_copies() {
  static auto* copies = new std::vector<PinnedCopy>;
  return *copies;
}
uint64_t stream_order = 0;  // calls on the stream that touch pinned memory or are events, so far

// The host has waited for every call up to `order`.
cudaError_t land_pinned_copies(uint64_t order) {
  cudaError_t status = cudaSuccess;
  auto& copies = pinned_copies();
  for (auto it = copies.begin(); it != copies.end();) {
    if (it->order > order) {
      ++it;
      continue;
    }
    if (it->download) std::memcpy(it->pinned, it->bytes.data(), it->bytes.size());
    else if (std::memcmp(it->pinned, it->bytes.data(), it->bytes.size()) != 0)
      status = record(cudaErrorIllegalState, "the host wrote the pinned source of an upload before it had waited for it");
    it = copies.erase(it);
  }
  return status;
}
}  // namespace

cudaError_t cudaMallocHost(void** p, size_t bytes) {
  if (const cudaError_t refused = not_while_capturing("cudaMallocHost")) return refused;
  char* memory = static_cast<char*>(std::malloc(bytes == 0 ? 1 : bytes));
  if (!memory) return record(cudaErrorMemoryAllocation, "cudaMallocHost(" + std::to_string(bytes) + ")");
  std::memset(memory, 0xff, bytes);
  pinned_blocks()[memory] = bytes;
  *p = memory;
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  if (!p) return cudaSuccess;
  auto it = pinned_blocks().find(static_cast<const char*>(p));
  if (it == pinned_blocks().end()) return record(cudaErrorInvalidValue, "cudaFreeHost of memory cudaMallocHost did not give");
  for (const PinnedCopy& copy : pinned_copies())
    if (copy.pinned >= it->first && copy.pinned < it->first + it->second)
      return record(cudaErrorIllegalState, "cudaFreeHost of pinned memory a copy not waited for uses");
  pinned_blocks().erase(it);
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) {  // every call ran to its end
  if (const cudaError_t refused = not_while_capturing("cudaStreamSynchronize")) return refused;
  ++cuda_emulator::counts().synchronizations;
  return land_pinned_copies(stream_order);
}

struct CUevent_st {
  std::chrono::steady_clock::time_point when;
  bool recorded = false;
  uint64_t order = 0;  // the stream's calls before it
};
cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = new CUevent_st;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned) { return cudaEventCreate(event); }
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t) {
  if (!event) return record(cudaErrorInvalidResourceHandle, "cudaEventRecord: no event");
  // CUDA would record it as a node; the backend records none in a captured step (its events time
  // routes and guard pinned slots, both host business).
  if (const cudaError_t refused = not_while_capturing("cudaEventRecord")) return refused;
  event->when = std::chrono::steady_clock::now(), event->recorded = true, event->order = ++stream_order;
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (const cudaError_t refused = not_while_capturing("cudaEventSynchronize")) return refused;
  ++cuda_emulator::counts().synchronizations;
  if (!event) return record(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: no event");
  return land_pinned_copies(event->order);
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (!start || !end || !start->recorded || !end->recorded)
    return record(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: an event that was not recorded");
  *ms = std::chrono::duration<float, std::milli>(end->when - start->when).count();
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  // Not a stream call: a capture in relaxed mode allows it (and does not record it).
  if (capture().graph && capture().mode != cudaStreamCaptureModeRelaxed)
    if (const cudaError_t refused = not_while_capturing("cudaMalloc (outside relaxed mode)")) return refused;
  void* memory = allocate_device(bytes);
  if (!memory) return record(cudaErrorMemoryAllocation, "cudaMalloc(" + std::to_string(bytes) + ")");
  // Fresh device memory is not zero: fill it with a NaN pattern so that reading unwritten memory shows.
  const DeviceWork working;
  std::memset(memory, 0xff, bytes);
  allocations()[static_cast<const char*>(memory)] = bytes;
  *p = memory;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  if (const cudaError_t refused = not_while_capturing("cudaFree")) return refused;  // it synchronizes
  auto it = allocations().find(static_cast<const char*>(p));
  if (it == allocations().end()) return record(cudaErrorInvalidValue, "cudaFree of memory cudaMalloc did not give");
  free_device(p, it->second);
  allocations().erase(it);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
  const bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  const bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  if ((src_device && !on_device(src, bytes)) || (dst_device && !on_device(dst, bytes)))
    return record(cudaErrorInvalidValue, "cudaMemcpyAsync of " + std::to_string(bytes) +
                                             " bytes outside a device allocation (kind " + std::to_string(int(kind)) +
                                             ")");
  if (!src_device && on_device(src, 1)) return record(cudaErrorInvalidValue, "cudaMemcpyAsync: host source on the device");
  if (!dst_device && on_device(dst, 1)) return record(cudaErrorInvalidValue, "cudaMemcpyAsync: host target on the device");
  if (kind == cudaMemcpyDeviceToDevice && captured("copy", nullptr, [=] {
        const DeviceWork working;
        std::memmove(dst, src, bytes);
      }))
    return cudaSuccess;
  // A graph could copy to or from the host too, but the backend's captured steps never cross.
  if (kind != cudaMemcpyDeviceToDevice)
    if (const cudaError_t refused = not_while_capturing("cudaMemcpyAsync to or from the host")) return refused;
  const DeviceWork working;
  if (kind == cudaMemcpyDeviceToHost && is_pinned(dst, bytes)) {  // lands when the host waits for it
    const char* from = static_cast<const char*>(src);
    pinned_copies().push_back({++stream_order, static_cast<char*>(dst), std::vector<char>(from, from + bytes), true});
  } else {
    std::memmove(dst, src, bytes);
  }
  if (kind == cudaMemcpyHostToDevice && is_pinned(src, bytes)) {  // its source checked when the host waits
    const char* from = static_cast<const char*>(src);
    pinned_copies().push_back({++stream_order, const_cast<char*>(from), std::vector<char>(from, from + bytes), false});
  }
  if (kind == cudaMemcpyHostToDevice) ++counts().uploads;
  if (kind == cudaMemcpyDeviceToHost) ++counts().downloads;
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  if (!on_device(p, bytes))
    return record(cudaErrorInvalidValue, "cudaMemsetAsync of " + std::to_string(bytes) + " bytes outside a device allocation");
  if (captured("memset", nullptr, [=] {
        const DeviceWork working;
        std::memset(p, value, bytes);
      }))
    return cudaSuccess;
  const DeviceWork working;
  std::memset(p, value, bytes);
  return cudaSuccess;
}
// ---- CUDA graphs ----

cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode mode) {
  if (capture().graph) return record(cudaErrorIllegalState, "cudaStreamBeginCapture: the stream is being captured already");
  capture() = {new CUgraph_st, mode, false};
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t* graph) {
  if (!capture().graph) return record(cudaErrorIllegalState, "cudaStreamEndCapture without a capture");
  const Capture ended = capture();
  capture() = {};
  if (ended.invalidated) {
    delete ended.graph;
    *graph = nullptr;
    return record(cudaErrorStreamCaptureInvalidated, "the stream capture was invalidated by a call it does not allow");
  }
  *graph = ended.graph;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  if (!graph) return record(cudaErrorInvalidValue, "cudaGraphInstantiate: no graph");
  *exec = new CUgraphExec_st{graph->nodes};
  return cudaSuccess;
}
// As CUDA's: the new graph's parameters into the instantiated one, when both have the same nodes in
// the same order (kernels of the same functions); otherwise the update fails and changes nothing.
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph, cudaGraphExecUpdateResultInfo* info) {
  if (!exec || !graph) return record(cudaErrorInvalidValue, "cudaGraphExecUpdate: no graph");
  *info = {cudaGraphExecUpdateSuccess, nullptr, nullptr};
  bool same = exec->nodes.size() == graph->nodes.size();
  for (size_t i = 0; same && i < graph->nodes.size(); ++i)
    same = exec->nodes[i].what == graph->nodes[i].what && exec->nodes[i].function == graph->nodes[i].function;
  if (!same) {
    info->result = cudaGraphExecUpdateErrorTopologyChanged;
    return cudaErrorGraphExecUpdateFailure;  // CUDA leaves it for the caller to see in the result, not sticky
  }
  exec->nodes = graph->nodes;
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t) {
  if (!exec) return record(cudaErrorInvalidValue, "cudaGraphLaunch: no graph");
  if (const cudaError_t refused = not_while_capturing("cudaGraphLaunch")) return refused;
  ++counts().graph_launches;
  for (const CUgraph_st::Node& node : exec->nodes) node.run();
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  const cudaError_t error = last_error;
  last_error = cudaSuccess;
  return error;
}
const char* cudaGetErrorString(cudaError_t error) {
  static std::string& text = *new std::string;
  text = error == cudaSuccess ? "no error" : "CUDA emulator: " + (last_error_text.empty() ? "error" : last_error_text);
  if (error != cudaSuccess) last_error_text.clear();
  return text.c_str();
}

// ---- cuBLAS ----

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  *handle = reinterpret_cast<cublasHandle_t>(new cuda_emulator::cublasContextState);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  delete reinterpret_cast<cuda_emulator::cublasContextState*>(handle);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t) {
  return handle ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t bytes) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  return bytes == 0 || on_device(workspace, bytes) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  return mode == CUBLAS_DEFAULT_MATH ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;  // no TF32 here
}
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  return gemm_checked(transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb, 0, beta, C, Ctype, ldc, 0, 1,
                      compute);
}
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                          int m, int n, int k, const void* alpha, const void* A, cudaDataType Atype,
                                          int lda, long long strideA, const void* B, cudaDataType Btype, int ldb,
                                          long long strideB, const void* beta, void* C, cudaDataType Ctype, int ldc,
                                          long long strideC, int batchCount, cublasComputeType_t compute,
                                          cublasGemmAlgo_t) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  return gemm_checked(transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB, beta, C, Ctype,
                      ldc, strideC, batchCount, compute);
}
