// Kernel execution of the GPU emulation: a launch is checked as a GPU checks
// it (H100 limits, same error codes) and stricter (every pointer argument must
// be device memory of the launching GPU), then runs on its stream's worker
// thread block after block. A block's CUDA threads are fibers (Boost.Context)
// scheduled in order: each runs until it finishes or waits at a barrier or a
// warp operation; a barrier opens when every thread of the block waits at the
// same one, a warp operation when every lane its mask names has arrived with
// the same mask. Anything else (a barrier some threads never reach, a mask
// naming an absent or exited lane, lanes meeting at different operations) is
// an error naming the kernel. Memory accesses of the kernel sources reach this
// file through GCC's thread-sanitizer instrumentation (-fsanitize=thread on
// the kernel translation units only, with these hooks in place of TSan's
// runtime): each access is bounds-checked against its allocation and logged
// for the happens-before checker.
#include <sys/mman.h>
#include <unistd.h>

#include <boost/context/fiber.hpp>
#include <cstdio>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

#include "mgpu_emu/kernel.h"
#include "mgpu_emu/runtime.h"

namespace mgpu_emu {

namespace bctx = boost::context;

namespace {

constexpr size_t kStackBytes = size_t{256} << 10;

// Fiber stacks of one worker thread, reused: a thread that finishes without
// waiting hands its stack to the next, so only barrier kernels need many.
struct StackPool {
  std::vector<bctx::stack_context> free;
  ~StackPool() {
    for (auto& sc : free) munmap(static_cast<char*>(sc.sp) - sc.size, sc.size);
  }
};
thread_local StackPool tl_stacks;
thread_local bctx::stack_context tl_last_stack;  // the stack PooledStack handed out last

class PooledStack {
 public:
  bctx::stack_context allocate() {
    if (!tl_stacks.free.empty()) {
      bctx::stack_context sc = tl_stacks.free.back();
      tl_stacks.free.pop_back();
      tl_last_stack = sc;
      return sc;
    }
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    const size_t size = kStackBytes + page;
    void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) throw std::bad_alloc();
    mprotect(base, page, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting
    bctx::stack_context sc;
    sc.size = size;
    sc.sp = static_cast<char*>(base) + size;
    tl_last_stack = sc;
    return sc;
  }
  void deallocate(bctx::stack_context& sc) noexcept { tl_stacks.free.push_back(sc); }
};

enum class ThreadState { kNew, kRunnable, kAtBarrier, kAtWarp, kDone };

struct EmuThread {
  ThreadContext ctx;
  int warp = 0, lane = 0;
  ThreadState state = ThreadState::kNew;
  const char* site_file = "";
  int site_line = 0;
  unsigned mask = 0;
  const char* what = "";
  uint64_t warp_ops = 0;
  bctx::fiber fiber;                     // the suspended fiber running this thread
  bctx::fiber* sink = nullptr;           // the scheduler, while the thread runs (in its fiber's frame)
  uintptr_t stack_lo = 0, stack_hi = 0;  // the fiber stack it runs on (its locals: not device memory)
  struct BlockRun* block = nullptr;
};

struct WarpSlots {
  uint64_t bits[2][32];
};

struct BlockRun {
  const std::string* kernel = nullptr;
  std::vector<EmuThread> threads;
  std::vector<WarpSlots> warps;
  std::vector<unsigned char> dynamic_shared;
  int lanes_in_last_warp = 32;
  bool faulted = false;
  cudaError_t fault_code = cudaSuccess;
  std::string fault;
  unsigned next_new = 0;     // threads not started yet begin here
  AccessLog* log = nullptr;  // of the operation running the kernel
};

thread_local EmuThread* tl_thread = nullptr;
thread_local BlockRun* tl_block = nullptr;

std::mutex g_attr_m;
std::map<const void*, int> g_max_dynamic_shared;  // cudaFuncAttributeMaxDynamicSharedMemorySize per kernel

[[noreturn]] void kernel_error(const std::string& what) {
  throw Fault(cudaErrorLaunchFailure, "kernel " + *tl_block->kernel + ": " + what);
}

std::string block_text(const EmuThread& t) {
  std::ostringstream o;
  o << "block (" << t.ctx.block_idx.x << "," << t.ctx.block_idx.y << "," << t.ctx.block_idx.z << ") thread ("
    << t.ctx.thread_idx.x << "," << t.ctx.thread_idx.y << "," << t.ctx.thread_idx.z << ")";
  return o.str();
}

void yield_to_scheduler() {
  EmuThread* t = tl_thread;
  *t->sink = std::move(*t->sink).resume();
  tl_thread = t;  // the scheduler ran other threads meanwhile
}

EmuThread& running(const char* what) {
  if (!tl_thread) throw std::logic_error(std::string(what) + " used outside a kernel");
  return *tl_thread;
}

// Every lane of `mask` must exist in this (possibly partial) warp, and the caller must be one of them.
void check_mask(const EmuThread& t, unsigned mask, const char* what) {
  const int lanes = t.warp + 1 == int(tl_block->warps.size()) ? tl_block->lanes_in_last_warp : 32;
  const unsigned present = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
  if (mask & ~present) {
    std::ostringstream o;
    o << what << " mask 0x" << std::hex << mask << std::dec << " names lanes that do not exist (warp " << t.warp
      << " has " << lanes << " lanes) at " << block_text(t);
    kernel_error(o.str());
  }
  if (!(mask & (1u << t.lane))) {
    std::ostringstream o;
    o << what << " called by lane " << t.lane << " which its mask 0x" << std::hex << mask << std::dec
      << " does not name, at " << block_text(t);
    kernel_error(o.str());
  }
}

void arrive_warp(EmuThread& t, unsigned mask, const char* what, const char* file, int line) {
  check_mask(t, mask, what);
  t.state = ThreadState::kAtWarp;
  t.mask = mask;
  t.what = what;
  t.site_file = file;
  t.site_line = line;
  yield_to_scheduler();
}

// Releases every warp operation whose lanes have all arrived. Returns whether any was released.
bool release_warps(BlockRun& b) {
  bool released = false;
  const int nthreads = int(b.threads.size());
  for (int w = 0; w < int(b.warps.size()); ++w) {
    const int first = w * 32;
    for (int l = 0; l < 32 && first + l < nthreads; ++l) {
      EmuThread& t = b.threads[size_t(first + l)];
      if (t.state != ThreadState::kAtWarp) continue;
      bool all_here = true;
      for (int k = 0; k < 32; ++k) {
        if (!(t.mask & (1u << k))) continue;
        const EmuThread& o = b.threads[size_t(first + k)];
        if (o.state == ThreadState::kDone) {
          std::ostringstream msg;
          msg << t.what << " (mask 0x" << std::hex << t.mask << std::dec << ") at " << t.site_file << ":" << t.site_line
              << " waits for lane " << k << " of warp " << w << ", which has exited (" << block_text(t) << ")";
          kernel_error(msg.str());
        }
        if (o.state == ThreadState::kAtBarrier) {
          std::ostringstream msg;
          msg << "divergence: lane " << t.lane << " waits at " << t.what << " (" << t.site_file << ":" << t.site_line
              << ") while lane " << k << " waits at __syncthreads (" << o.site_file << ":" << o.site_line << ") in "
              << block_text(t);
          kernel_error(msg.str());
        }
        if (o.state != ThreadState::kAtWarp) {
          all_here = false;
          break;
        }
        if (o.mask != t.mask || o.what != t.what || o.site_line != t.site_line || o.site_file != t.site_file) {
          std::ostringstream msg;
          msg << "lanes of warp " << w << " meet at different warp operations: lane " << t.lane << " at " << t.what
              << " mask 0x" << std::hex << t.mask << std::dec << " (" << t.site_file << ":" << t.site_line << "), lane "
              << k << " at " << o.what << " mask 0x" << std::hex << o.mask << std::dec << " (" << o.site_file << ":"
              << o.site_line << ") in " << block_text(t);
          kernel_error(msg.str());
        }
      }
      if (!all_here) continue;
      for (int k = 0; k < 32; ++k)
        if (t.mask & (1u << k)) b.threads[size_t(first + k)].state = ThreadState::kRunnable;
      released = true;
    }
  }
  return released;
}

bool release_barrier(BlockRun& b) {
  const EmuThread* waiting = nullptr;
  int at_barrier = 0, done = 0;
  for (const EmuThread& t : b.threads) {
    if (t.state == ThreadState::kAtBarrier) {
      if (waiting && (t.site_line != waiting->site_line || t.site_file != waiting->site_file)) {
        std::ostringstream o;
        o << "divergent __syncthreads: " << block_text(*waiting) << " waits at " << waiting->site_file << ":"
          << waiting->site_line << ", " << block_text(t) << " at " << t.site_file << ":" << t.site_line;
        kernel_error(o.str());
      }
      waiting = &t;
      ++at_barrier;
    } else if (t.state == ThreadState::kDone) {
      ++done;
    } else if (t.state == ThreadState::kAtWarp) {
      return false;  // reported by the caller as a deadlock
    }
  }
  if (!waiting) return false;
  if (done > 0) {
    std::ostringstream o;
    o << "__syncthreads at " << waiting->site_file << ":" << waiting->site_line << " reached by " << at_barrier
      << " of " << b.threads.size() << " threads of block (" << waiting->ctx.block_idx.x << ","
      << waiting->ctx.block_idx.y << "," << waiting->ctx.block_idx.z << "); " << done
      << " exited without reaching it (a barrier in divergent code)";
    kernel_error(o.str());
  }
  for (EmuThread& t : b.threads) t.state = ThreadState::kRunnable;
  return true;
}

// A runner fiber runs not-yet-started threads one after another on one stack
// until a thread waits (barrier or warp operation): the fiber then belongs to
// that thread, and the next runner starts the threads after it. Kernels without
// barriers thus run a whole block on one fiber.
bctx::fiber make_runner(BlockRun& b, const std::function<void()>& body) {
  return bctx::fiber(std::allocator_arg, PooledStack(), [&b, &body](bctx::fiber&& sink) {
    const bctx::stack_context stack = tl_last_stack;  // allocated for this fiber just before it first ran
    while (!b.faulted && b.next_new < b.threads.size()) {
      EmuThread& t = b.threads[b.next_new++];
      t.state = ThreadState::kRunnable;
      t.sink = &sink;
      t.stack_hi = uintptr_t(stack.sp);
      t.stack_lo = t.stack_hi - stack.size;
      t.block = &b;
      tl_thread = &t;
      try {
        body();
      } catch (const Fault& f) {
        if (!b.faulted) {
          b.faulted = true;
          b.fault_code = f.code;
          b.fault = f.what();
        }
      } catch (const std::exception& e) {
        if (!b.faulted) {
          b.faulted = true;
          b.fault_code = cudaErrorLaunchFailure;
          b.fault = "kernel " + *b.kernel + ": " + e.what();
        }
      }
      t.state = ThreadState::kDone;
      t.sink = nullptr;
      tl_thread = nullptr;
    }
    return std::move(sink);
  });
}

// Runs fibers until every thread has started; returns with each thread done or waiting.
void start_threads(BlockRun& b, const std::function<void()>& body) {
  while (!b.faulted && b.next_new < b.threads.size()) {
    tl_block = &b;
    bctx::fiber runner = std::move(make_runner(b, body)).resume();
    tl_thread = nullptr;
    if (runner) {
      // Suspended: the thread started last waits, and keeps the fiber.
      b.threads[b.next_new - 1].fiber = std::move(runner);
    }
  }
}

void resume(BlockRun& b, EmuThread& t) {
  tl_thread = &t;
  tl_block = &b;
  // Every thread has started by now, so a fiber that comes back is t's, waiting again.
  bctx::fiber rest = std::move(t.fiber).resume();
  tl_thread = nullptr;
  if (rest) t.fiber = std::move(rest);
}

void run_block(BlockRun& b, const std::function<void()>& body) {
  b.next_new = 0;
  for (;;) {
    start_threads(b, body);
    if (b.faulted) throw Fault(b.fault_code, b.fault);
    bool all_done = true;
    for (EmuThread& t : b.threads) {
      if (t.state == ThreadState::kRunnable) resume(b, t);
      if (b.faulted) throw Fault(b.fault_code, b.fault);
      all_done = all_done && t.state == ThreadState::kDone;
    }
    if (all_done) return;
    tl_block = &b;
    if (release_warps(b) || release_barrier(b)) continue;
    // Nobody can move: a warp operation waits for lanes that are themselves waiting elsewhere.
    for (const EmuThread& t : b.threads)
      if (t.state == ThreadState::kAtWarp) {
        std::ostringstream o;
        o << "deadlock: " << block_text(t) << " waits at " << t.what << " (" << t.site_file << ":" << t.site_line
          << ") with mask 0x" << std::hex << t.mask << " for lanes that never arrive";
        kernel_error(o.str());
      }
    kernel_error("deadlock: no thread of the block can proceed");
  }
}

}  // namespace

// --- Device built-ins -----------------------------------------------------------

ThreadContext& current_thread() { return running("threadIdx/blockIdx/blockDim/gridDim").ctx; }

void sync_block(const char* file, int line) {
  EmuThread& t = running("__syncthreads");
  t.state = ThreadState::kAtBarrier;
  t.site_file = file;
  t.site_line = line;
  yield_to_scheduler();
}

void sync_warp(const char* file, int line, unsigned mask) {
  EmuThread& t = running("__syncwarp");
  arrive_warp(t, mask, "__syncwarp", file, line);
  ++t.warp_ops;
}

uint64_t shuffle_bits(unsigned mask, uint64_t bits, ShuffleKind kind, int arg, int width, const char* what) {
  EmuThread& t = running(what);
  if (width < 1 || width > 32 || (width & (width - 1)))
    kernel_error(std::string(what) + ": width " + std::to_string(width) + " is not a power of two in [1, 32]");
  WarpSlots& slots = tl_block->warps[size_t(t.warp)];
  const int parity = int(t.warp_ops & 1);
  slots.bits[parity][t.lane] = bits;
  arrive_warp(t, mask, what, "", 0);
  ++t.warp_ops;
  const int seg = (t.lane / width) * width;
  int src = t.lane;
  switch (kind) {
    case ShuffleKind::kIndex: src = seg + (((arg % width) + width) % width); break;
    case ShuffleKind::kXor:
      src = t.lane ^ arg;
      if (src < seg || src >= seg + width) src = t.lane;
      break;
    case ShuffleKind::kDown:
      src = t.lane + arg;
      if (src >= seg + width) src = t.lane;
      break;
    case ShuffleKind::kUp:
      src = t.lane - arg;
      if (src < seg) src = t.lane;
      break;
  }
  if (src < 0 || src > 31 || !(mask & (1u << src))) {
    std::ostringstream o;
    o << what << ": lane " << t.lane << " reads lane " << src << ", which mask 0x" << std::hex << mask
      << " does not name (undefined on a GPU) at " << block_text(t);
    kernel_error(o.str());
  }
  return slots.bits[parity][src];
}

unsigned vote(unsigned mask, int predicate, VoteKind kind, const char* what) {
  EmuThread& t = running(what);
  WarpSlots& slots = tl_block->warps[size_t(t.warp)];
  const int parity = int(t.warp_ops & 1);
  slots.bits[parity][t.lane] = predicate != 0;
  arrive_warp(t, mask, what, "", 0);
  ++t.warp_ops;
  unsigned ballot = 0;
  for (int k = 0; k < 32; ++k)
    if ((mask & (1u << k)) && slots.bits[parity][k]) ballot |= 1u << k;
  switch (kind) {
    case VoteKind::kBallot: return ballot;
    case VoteKind::kAny: return ballot != 0;
    case VoteKind::kAll: return ballot == mask;
  }
  return 0;
}

unsigned active_mask() {
  EmuThread& t = running("__activemask");
  unsigned m = 0;
  const int first = t.warp * 32;
  for (int k = 0; k < 32 && first + k < int(tl_block->threads.size()); ++k)
    if (tl_block->threads[size_t(first + k)].state != ThreadState::kDone) m |= 1u << k;
  return m;
}

void* dynamic_shared() {
  running("dynamic shared memory");
  return tl_block->dynamic_shared.empty() ? nullptr : tl_block->dynamic_shared.data();
}

// --- Launch ---------------------------------------------------------------------

void run_grid(const std::string& name, const std::function<void()>& body, dim3 grid, dim3 block, size_t shared_bytes) {
  counters().kernels_executed++;
  const unsigned nthreads = block.x * block.y * block.z;
  BlockRun b;
  b.kernel = &name;
  b.log = current_access_log();
  b.threads.resize(nthreads);
  b.warps.resize((nthreads + 31) / 32);
  b.lanes_in_last_warp = int(nthreads - (b.warps.size() - 1) * 32);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        b.dynamic_shared.assign(shared_bytes, 0xFF);  // uninitialised: NaN, as float or double
        for (unsigned i = 0; i < nthreads; ++i) {
          EmuThread& t = b.threads[i];
          t = EmuThread();
          t.warp = int(i / 32);
          t.lane = int(i % 32);
          t.ctx.thread_idx = make_uint3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
          t.ctx.block_idx = make_uint3(bx, by, bz);
          t.ctx.block_dim = block;
          t.ctx.grid_dim = grid;
        }
        try {
          run_block(b, body);
        } catch (...) {
          for (EmuThread& t : b.threads) t.fiber = bctx::fiber();  // unwinds the threads still suspended
          tl_block = nullptr;
          throw;
        }
      }
  tl_block = nullptr;
}

namespace {
std::mutex g_fault_m;
std::string g_fault_kernel;
int g_fault_device = -1;
long g_fault_countdown = 0;

bool injected_failure(const char* name, int device) {
  std::lock_guard<std::mutex> lock(g_fault_m);
  if (g_fault_countdown <= 0 || (g_fault_device >= 0 && g_fault_device != device) ||
      std::string(name).find(g_fault_kernel) == std::string::npos)
    return false;
  return --g_fault_countdown == 0;
}
}  // namespace

void inject_launch_failure(const std::string& kernel, int device, long nth) {
  std::lock_guard<std::mutex> lock(g_fault_m);
  g_fault_kernel = kernel;
  g_fault_device = device;
  g_fault_countdown = nth;
}

void launch(const char* name, const void* kernel_ptr, std::function<void()> body, dim3 grid, dim3 block,
            size_t shared_bytes, cudaStream_t stream, const std::vector<PointerArg>& pointers) {
  const int device = device_of(stream);
  if (device < 0) {
    set_error(cudaErrorInvalidResourceHandle, std::string("launch of ") + name + " on an unknown stream");
    return;
  }
  if (injected_failure(name, device)) {
    set_error(cudaErrorLaunchOutOfResources, std::string(name) + " on GPU " + std::to_string(device) +
                                                 ": launch failure injected by emulation.inject_launch_failure");
    return;
  }
  if (const cudaError_t e = sticky_error(device)) {
    set_error(e, "launch of " + std::string(name) + " on a broken context");
    return;
  }
  const unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
  if (grid.x < 1 || grid.y < 1 || grid.z < 1 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535 ||
      block.x < 1 || block.y < 1 || block.z < 1 || block.x > 1024 || block.y > 1024 || block.z > 64 || threads > 1024) {
    std::ostringstream why;
    why << name << ": grid (" << grid.x << "," << grid.y << "," << grid.z << ") block (" << block.x << "," << block.y
        << "," << block.z << ") outside an H100's limits (grid 1..2^31-1 x 1..65535 x 1..65535; "
        << "block at most 1024 threads, x and y <= 1024, z <= 64)";
    set_error(cudaErrorInvalidConfiguration, why.str());
    return;
  }
  size_t max_shared = 48 * 1024;
  {
    std::lock_guard<std::mutex> lock(g_attr_m);
    auto it = g_max_dynamic_shared.find(kernel_ptr);
    if (it != g_max_dynamic_shared.end()) max_shared = size_t(it->second);
  }
  if (shared_bytes > max_shared) {
    set_error(cudaErrorInvalidValue, std::string(name) + ": " + std::to_string(shared_bytes) +
                                         " bytes of dynamic shared memory exceed the kernel's limit of " +
                                         std::to_string(max_shared) + " (cudaFuncAttributeMaxDynamicSharedMemorySize)");
    return;
  }
  for (const PointerArg& p : pointers) {
    if (!p.ptr) continue;
    const std::string bad = check_device_range(p.ptr, 1, device, true);
    if (!bad.empty()) {
      set_error(cudaErrorInvalidValue, std::string(name) + " argument " + std::to_string(p.index) + ": " + bad);
      return;
    }
  }
  if (!stream_is_capturing(stream)) counters().kernel_launches++;
  const std::string kernel = name;
  enqueue(stream, kernel, OpKind::kKernel, [kernel, body = std::move(body), grid, block, shared_bytes] {
    run_grid(kernel, body, grid, block, shared_bytes);
  });
}

// --- Memory access hooks (GCC -fsanitize=thread instrumentation) -----------------

namespace {
inline void on_access(const void* p, size_t n, bool write) {
  const EmuThread* t = tl_thread;
  if (!t) return;  // host code of the same translation unit
  const uintptr_t a = uintptr_t(p);
  if (a >= t->stack_lo && a < t->stack_hi) return;  // the thread's own locals
  if (t->block->log) log_access(t->block->log, a, n, write, t->block->kernel->c_str());
}

// The compiler's aligned hooks: it knows the access's type is n-byte aligned
// (a float4 is 16), as a GPU's vector load requires; one at an address that is
// not (a float4 read through a float pointer offset by one float) faults there.
inline void on_aligned_access(const void* p, size_t n, bool write) {
  const EmuThread* t = tl_thread;
  if (t && uintptr_t(p) % n != 0) {
    std::ostringstream o;
    o << *t->block->kernel << (write ? " writes " : " reads ") << n << " bytes at misaligned address 0x" << std::hex
      << uintptr_t(p);
    throw Fault(cudaErrorMisalignedAddress, o.str());
  }
  on_access(p, n, write);
}
}  // namespace

}  // namespace mgpu_emu

using mgpu_emu::on_access;
using mgpu_emu::on_aligned_access;

extern "C" {
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_ignore_thread_begin() {}
void __tsan_ignore_thread_end() {}
#define MGPU_EMU_RW(n)                                                        \
  void __tsan_read##n(void* p) { on_aligned_access(p, n, false); }            \
  void __tsan_write##n(void* p) { on_aligned_access(p, n, true); }            \
  void __tsan_unaligned_read##n(void* p) { on_access(p, n, false); }          \
  void __tsan_unaligned_write##n(void* p) { on_access(p, n, true); }          \
  void __tsan_volatile_read##n(void* p) { on_access(p, n, false); }           \
  void __tsan_volatile_write##n(void* p) { on_access(p, n, true); }           \
  void __tsan_unaligned_volatile_read##n(void* p) { on_access(p, n, false); } \
  void __tsan_unaligned_volatile_write##n(void* p) { on_access(p, n, true); }
MGPU_EMU_RW(1)
MGPU_EMU_RW(2)
MGPU_EMU_RW(4)
MGPU_EMU_RW(8)
MGPU_EMU_RW(16)
#undef MGPU_EMU_RW
void __tsan_read_range(void* p, unsigned long n) { on_access(p, n, false); }
void __tsan_write_range(void* p, unsigned long n) { on_access(p, n, true); }
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}

// Atomics: performed for real (blocks of other kernels may run concurrently), and logged.
#define MGPU_EMU_ATOMICS(bits, T)                                                           \
  T __tsan_atomic##bits##_load(const volatile T* a, int) {                                  \
    on_access((const void*)a, sizeof(T), false);                                            \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                            \
  }                                                                                         \
  void __tsan_atomic##bits##_store(volatile T* a, T v, int) {                               \
    on_access((const void*)a, sizeof(T), true);                                             \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                               \
  }                                                                                         \
  T __tsan_atomic##bits##_exchange(volatile T* a, T v, int) {                               \
    on_access((const void*)a, sizeof(T), true);                                             \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                     \
  }                                                                                         \
  T __tsan_atomic##bits##_fetch_add(volatile T* a, T v, int) {                              \
    on_access((const void*)a, sizeof(T), true);                                             \
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                      \
  }                                                                                         \
  T __tsan_atomic##bits##_fetch_sub(volatile T* a, T v, int) {                              \
    on_access((const void*)a, sizeof(T), true);                                             \
    return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                      \
  }                                                                                         \
  T __tsan_atomic##bits##_fetch_and(volatile T* a, T v, int) {                              \
    on_access((const void*)a, sizeof(T), true);                                             \
    return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);                                      \
  }                                                                                         \
  T __tsan_atomic##bits##_fetch_or(volatile T* a, T v, int) {                               \
    on_access((const void*)a, sizeof(T), true);                                             \
    return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);                                       \
  }                                                                                         \
  T __tsan_atomic##bits##_fetch_xor(volatile T* a, T v, int) {                              \
    on_access((const void*)a, sizeof(T), true);                                             \
    return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST);                                      \
  }                                                                                         \
  int __tsan_atomic##bits##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {   \
    on_access((const void*)a, sizeof(T), true);                                             \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
  }                                                                                         \
  int __tsan_atomic##bits##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {     \
    on_access((const void*)a, sizeof(T), true);                                             \
    return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);  \
  }                                                                                         \
  T __tsan_atomic##bits##_compare_exchange_val(volatile T* a, T c, T v, int, int) {         \
    on_access((const void*)a, sizeof(T), true);                                             \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);       \
    return c;                                                                               \
  }
MGPU_EMU_ATOMICS(8, unsigned char)
MGPU_EMU_ATOMICS(16, unsigned short)
MGPU_EMU_ATOMICS(32, unsigned int)
MGPU_EMU_ATOMICS(64, unsigned long long)
#undef MGPU_EMU_ATOMICS
void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  if (value < 0 || value > 227 * 1024)
    return mgpu_emu::set_error(cudaErrorInvalidValue,
                               "cudaFuncSetAttribute: dynamic shared memory above the 227 KiB of an H100");
  std::lock_guard<std::mutex> lock(mgpu_emu::g_attr_m);
  mgpu_emu::g_max_dynamic_shared[func] = value;
  return cudaSuccess;
}
}  // extern "C"
