// The emulated CUDA runtime: NVIDIA's prototypes (cuda_runtime_api.h)
// implemented on the CPU for MGPU_EMULATE_GPU=N emulated devices. Streams run
// asynchronously, each on a worker thread of its own; events, stream waits and
// synchronisation order them. Every operation records the device memory it
// touches, and a happens-before checker (vector clocks over streams and host
// threads) reports two operations on different streams that touch the same
// bytes, one of them writing, without an ordering edge between them.
// Stricter than a GPU: exact-size, NaN-poisoned allocations with red zones,
// use after free and out-of-bounds accesses are faults naming the operation,
// wrong cudaMemcpyKind and host/device confusion are errors, capture-unsafe
// calls fail during a capture, leaks are listed at exit.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "mgpu_emu/runtime.h"

namespace mgpu_emu {

namespace {

using VClock = std::vector<uint64_t>;
using SteadyClock = std::chrono::steady_clock;

void join(VClock& a, const VClock& b) {
  if (a.size() < b.size()) a.resize(b.size(), 0);
  for (size_t i = 0; i < b.size(); ++i) a[i] = std::max(a[i], b[i]);
}
uint64_t at(const VClock& v, int i) { return size_t(i) < v.size() ? v[size_t(i)] : 0; }

std::string hex(uintptr_t p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%zx", size_t(p));
  return buf;
}

// --- Errors -------------------------------------------------------------------

struct ErrorText {
  const char* name;
  const char* text;
};
ErrorText error_text(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return {"cudaSuccess", "no error"};
    case cudaErrorInvalidValue: return {"cudaErrorInvalidValue", "invalid argument"};
    case cudaErrorMemoryAllocation: return {"cudaErrorMemoryAllocation", "out of memory"};
    case cudaErrorInvalidConfiguration: return {"cudaErrorInvalidConfiguration", "invalid configuration argument"};
    case cudaErrorInvalidDevice: return {"cudaErrorInvalidDevice", "invalid device ordinal"};
    case cudaErrorInvalidMemcpyDirection:
      return {"cudaErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"};
    case cudaErrorInvalidDevicePointer: return {"cudaErrorInvalidDevicePointer", "invalid device pointer"};
    case cudaErrorNoDevice: return {"cudaErrorNoDevice", "no CUDA-capable device is detected"};
    case cudaErrorInvalidResourceHandle: return {"cudaErrorInvalidResourceHandle", "invalid resource handle"};
    case cudaErrorNotReady: return {"cudaErrorNotReady", "device not ready"};
    case cudaErrorIllegalAddress: return {"cudaErrorIllegalAddress", "an illegal memory access was encountered"};
    case cudaErrorLaunchFailure: return {"cudaErrorLaunchFailure", "unspecified launch failure"};
    case cudaErrorLaunchOutOfResources:
      return {"cudaErrorLaunchOutOfResources", "too many resources requested for launch"};
    case cudaErrorAssert: return {"cudaErrorAssert", "device-side assert triggered"};
    case cudaErrorStreamCaptureUnsupported:
      return {"cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing"};
    case cudaErrorStreamCaptureInvalidated:
      return {"cudaErrorStreamCaptureInvalidated", "operation failed due to a previous error during capture"};
    case cudaErrorStreamCaptureIsolation:
      return {"cudaErrorStreamCaptureIsolation",
              "operation would make the legacy stream depend on a capturing blocking stream"};
    case cudaErrorIllegalState: return {"cudaErrorIllegalState", "the operation is not permitted in the current state"};
    case cudaErrorInvalidDeviceFunction: return {"cudaErrorInvalidDeviceFunction", "invalid device function"};
    case cudaErrorNotSupported: return {"cudaErrorNotSupported", "operation not supported"};
    default: return {"cudaErrorUnknown", "unknown error"};
  }
}

// --- Allocations --------------------------------------------------------------

constexpr size_t kRedZone = 256;                        // bytes before and after every allocation
constexpr size_t kQuarantineBytes = size_t{256} << 20;  // freed memory kept poisoned for use-after-free checks
constexpr size_t kHistoryLimit = 512;                   // access records kept per allocation

enum class MemKind { kDevice, kPinned };

}  // namespace

struct Allocation {
  uint64_t id = 0;
  char* raw = nullptr;
  size_t raw_size = 0;
  uintptr_t user = 0;
  size_t size = 0;
  int device = 0;
  MemKind kind = MemKind::kDevice;
  const char* how = "";  // the allocating call
  bool freed = false;
  const char* freed_how = "";
  struct Record {
    int stream;
    uint64_t epoch;
    uintptr_t lo, hi;
    bool write;
    std::shared_ptr<const std::string> op;
  };
  std::vector<Record> history;

  std::string describe() const {
    std::ostringstream o;
    o << "allocation #" << id << " (" << size << " bytes, " << how;
    if (kind == MemKind::kDevice) o << " on GPU " << device;
    o << ")";
    return o.str();
  }
};

struct Interval {
  Allocation* a;
  uintptr_t lo, hi;
  bool write;
};
struct AccessLog {
  std::vector<Interval> items;
  int device = 0;
  const char* op = "";
  Allocation* recent[4] = {nullptr, nullptr, nullptr, nullptr};  // the allocations last touched
  uintptr_t gap_lo[4] = {0, 0, 0, 0}, gap_hi[4] = {0, 0, 0, 0};  // address ranges holding no emulated memory
  size_t next_compact = 4096;
};

namespace {

struct Registry {
  std::shared_mutex m;
  std::map<uintptr_t, Allocation*> by_raw;
  std::deque<Allocation*> quarantine;
  size_t quarantine_bytes = 0;
  uint64_t next_id = 1;

  Allocation* find_locked(uintptr_t p) const {
    auto it = by_raw.upper_bound(p);
    if (it == by_raw.begin()) return nullptr;
    --it;
    Allocation* a = it->second;
    return p < uintptr_t(a->raw) + a->raw_size ? a : nullptr;
  }
};
Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: workers may outlive static destruction
  return *r;
}

// --- Devices, streams, events ------------------------------------------------

struct Stream;

struct Op {
  std::string name;
  std::shared_ptr<const std::string> shared_name;
  OpKind kind = OpKind::kOther;
  std::function<void()> run;
  std::vector<std::pair<Stream*, uint64_t>> waits;
  VClock vc;
  uint64_t epoch = 0;
};

struct Capture {
  std::vector<std::shared_ptr<Op>> ops;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id thread;
  bool invalidated = false;
  std::string why;
};

struct Stream {
  int id = 0;
  int device = 0;
  bool blocking = true;
  bool legacy = false;  // the device's NULL stream
  int priority = 0;
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::shared_ptr<Op>> queue;
  uint64_t enqueued = 0, completed = 0;
  VClock vc;
  std::shared_ptr<Capture> capture;
  bool stopping = false;
  std::thread worker;
};

struct EventRecord {
  Stream* stream = nullptr;
  uint64_t seq = 0;
  VClock vc;
  double time = 0.0;                  // seconds, set when the record is reached
  std::shared_ptr<Capture> captured;  // recorded inside a capture
};

struct Event {
  int device = 0;
  unsigned flags = 0;
  std::shared_ptr<EventRecord> rec;
};

struct Graph {
  std::vector<std::shared_ptr<Op>> ops;
  int device = 0;
};

struct Device {
  int index = 0;     // as the process sees it (after CUDA_VISIBLE_DEVICES)
  int physical = 0;  // of the MGPU_EMULATE_GPU emulated GPUs
  size_t limit = 0;
  size_t used = 0;
  cudaError_t sticky = cudaSuccess;
  std::string sticky_detail;
  Stream* null_stream = nullptr;
  std::vector<Stream*> streams;
};

struct State {
  std::mutex m;  // devices, stream list, vector clocks, captures, handles
  std::vector<Device> devices;
  int next_stream_id = 0;
  std::unordered_set<const void*> streams, events, graphs, execs;
  std::mutex violations_m;
  std::vector<std::string> violations;
  std::mutex hb_m;  // allocation histories
  Counters counters;
  std::string config_error;  // why MGPU_EMULATE_GPU could not be read
};

size_t parse_bytes(const char* text, size_t fallback) {
  if (!text || !*text) return fallback;
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  std::string unit = end ? end : "";
  for (auto& c : unit) c = char(std::tolower(c));
  double scale = 1;
  if (unit == "k" || unit == "kib" || unit == "kb")
    scale = 1024.0;
  else if (unit == "m" || unit == "mib" || unit == "mb")
    scale = 1024.0 * 1024;
  else if (unit == "g" || unit == "gib" || unit == "gb")
    scale = 1024.0 * 1024 * 1024;
  else if (!unit.empty())
    return fallback;
  const double bytes = v * scale;
  return bytes >= 1 && bytes < 9.0e18 ? size_t(bytes) : fallback;  // NaN, inf and beyond size_t too
}

void print_leaks();

State& state() {
  static State* s = [] {
    auto* st = new State;
    const char* env = std::getenv("MGPU_EMULATE_GPU");
    int n = 0;
    if (env && *env) {
      char* end = nullptr;
      const long v = std::strtol(env, &end, 10);
      if (end && *end == '\0' && v >= 0 && v <= 64)
        n = int(v);
      else
        st->config_error = std::string("MGPU_EMULATE_GPU='") + env + "' is not a GPU count in 0..64";
    }
    // Emulated device memory is host memory: by default each device gets a quarter
    // of this machine's RAM shared among the devices (at most an H100's 80 GiB), so
    // "use most of the GPU's memory" stays possible; MGPU_EMULATE_GPU_MEMORY sets it
    // (an allocation beyond it fails, so out-of-memory paths can be tested).
    const double ram = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
    const size_t share = size_t(ram / 4 / std::max(n, 1));
    const size_t fallback = std::min(share, size_t{80} << 30);
    const char* memory = std::getenv("MGPU_EMULATE_GPU_MEMORY");
    const size_t limit = memory && *memory ? parse_bytes(memory, 0) : fallback;
    if (memory && *memory && limit == 0 && n > 0) {  // a size it cannot read: no GPU, and the reason why
      st->config_error = std::string("MGPU_EMULATE_GPU_MEMORY='") + memory +
                         "' is not a size in bytes > 0 (a number, or with K, M or G, KiB, MiB or GiB)";
      n = 0;
    }
    // CUDA_VISIBLE_DEVICES as the CUDA runtime reads it: indices up to the first invalid one.
    std::vector<int> visible;
    const char* mask = std::getenv("CUDA_VISIBLE_DEVICES");
    if (mask) {
      std::stringstream in(mask);
      std::string item;
      std::set<int> seen;
      while (std::getline(in, item, ',')) {
        char* end = nullptr;
        const long v = std::strtol(item.c_str(), &end, 10);
        if (item.empty() || (end && *end) || v < 0 || v >= n || seen.count(int(v))) break;
        seen.insert(int(v));
        visible.push_back(int(v));
      }
    } else {
      for (int i = 0; i < n; ++i) visible.push_back(i);
    }
    st->devices.resize(visible.size());
    for (size_t i = 0; i < visible.size(); ++i) {
      st->devices[i].index = int(i);
      st->devices[i].physical = visible[i];
      st->devices[i].limit = limit;
    }
    std::atexit(print_leaks);
    return st;
  }();
  return *s;
}

thread_local int tl_device = 0;
thread_local cudaError_t tl_last_error = cudaSuccess;
thread_local std::unordered_map<int, std::string> tl_details;
thread_local VClock tl_host_vc;
thread_local AccessLog* tl_log = nullptr;
thread_local std::vector<std::shared_ptr<Capture>> tl_captures;  // captures begun by this thread

cudaError_t record_error(cudaError_t e) {
  if (e != cudaSuccess) tl_last_error = e;
  return e;
}

void add_violation(const std::string& what) {
  State& s = state();
  std::fprintf(stderr, "mgpu GPU emulation: %s\n", what.c_str());
  // Also to a file shared by every process of a test (tests/gpu/conftest.py),
  // so that violations in mpirun ranks and subprocesses fail the test too.
  if (const char* path = std::getenv("MGPU_EMULATE_VIOLATIONS_FILE"); path && *path) {
    if (FILE* f = std::fopen(path, "a")) {
      std::fprintf(f, "pid %d: %s\n", int(getpid()), what.c_str());
      std::fclose(f);
    }
  }
  std::lock_guard<std::mutex> lock(s.violations_m);
  s.violations.push_back(what);
}

void make_sticky(int device, cudaError_t code, const std::string& what) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.m);
  Device& d = s.devices.at(size_t(device));
  if (d.sticky == cudaSuccess) {
    d.sticky = code;
    d.sticky_detail = std::string(error_text(code).text) + " [GPU emulation: " + what + "]";
  }
}

Stream* as_stream(cudaStream_t s) { return reinterpret_cast<Stream*>(s); }
Event* as_event(cudaEvent_t e) { return reinterpret_cast<Event*>(e); }

// The health check every API call starts with: a context with a sticky error refuses all work.
cudaError_t check_context(int device) {
  State& s = state();
  if (device < 0 || size_t(device) >= s.devices.size()) return cudaErrorInvalidDevice;
  std::lock_guard<std::mutex> lock(s.m);
  return s.devices[size_t(device)].sticky;
}

void wait_completed(Stream* st, uint64_t seq) {
  std::unique_lock<std::mutex> lock(st->m);
  st->cv.wait(lock, [&] { return st->completed >= seq; });
}

void hb_check_and_record(const Op& op, int stream_id, AccessLog& log);

void execute(Stream* st, Op& op) {
  AccessLog log;
  log.device = st->device;
  log.op = op.name.c_str();
  const bool broken = check_context(st->device) != cudaSuccess;
  if (!broken && op.run) {
    tl_log = &log;
    try {
      op.run();
    } catch (const Fault& f) {
      add_violation(f.what());
      make_sticky(st->device, f.code, f.what());
    } catch (const std::exception& e) {
      const std::string what = op.name + " failed: " + e.what();
      add_violation(what);
      make_sticky(st->device, cudaErrorLaunchFailure, what);
    }
    tl_log = nullptr;
    hb_check_and_record(op, st->id, log);
  }
}

void worker_loop(Stream* st) {
  for (;;) {
    std::shared_ptr<Op> op;
    {
      std::unique_lock<std::mutex> lock(st->m);
      st->cv.wait(lock, [&] { return st->stopping || !st->queue.empty(); });
      if (st->queue.empty()) return;  // stopping and drained
      op = st->queue.front();
    }
    for (const auto& w : op->waits) wait_completed(w.first, w.second);
    execute(st, *op);
    {
      std::lock_guard<std::mutex> lock(st->m);
      st->queue.pop_front();
      ++st->completed;
    }
    st->cv.notify_all();
  }
}

// Caller holds state().m.
Stream* new_stream_locked(int device, bool blocking, bool legacy, int priority) {
  State& s = state();
  auto* st = new Stream;
  st->id = s.next_stream_id++;
  st->device = device;
  st->blocking = blocking;
  st->legacy = legacy;
  st->priority = priority;
  s.devices[size_t(device)].streams.push_back(st);
  s.streams.insert(st);
  st->worker = std::thread(worker_loop, st);
  st->worker.detach();  // may outlive static destruction at exit; holds no resources then
  return st;
}

// The stream a handle names; nullptr (the legacy stream) is per device.
Stream* resolve_locked(cudaStream_t handle, int device) {
  State& s = state();
  if (handle == nullptr || handle == cudaStreamLegacy || handle == cudaStreamPerThread) {
    Device& d = s.devices[size_t(device)];
    if (!d.null_stream) d.null_stream = new_stream_locked(device, true, true, 0);
    return d.null_stream;
  }
  return s.streams.count(handle) ? as_stream(handle) : nullptr;
}

uint64_t now_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now().time_since_epoch()).count());
}

// Enqueue on a resolved stream (caller holds state().m): vector clock, legacy
// stream semantics, capture.
cudaError_t enqueue_locked(Stream* st, std::shared_ptr<Op> op) {
  State& s = state();
  if (st->capture) {
    if (st->capture->invalidated) return cudaErrorStreamCaptureInvalidated;
    st->capture->ops.push_back(std::move(op));
    return cudaSuccess;
  }
  Device& d = s.devices[size_t(st->device)];
  if (st->legacy) {
    for (Stream* other : d.streams)
      if (other != st && other->blocking) {
        std::lock_guard<std::mutex> lock(other->m);
        if (other->enqueued > other->completed) op->waits.push_back({other, other->enqueued});
        join(st->vc, other->vc);
      }
  } else if (st->blocking && d.null_stream && d.null_stream != st) {
    Stream* legacy = d.null_stream;
    std::lock_guard<std::mutex> lock(legacy->m);
    if (legacy->enqueued > legacy->completed) op->waits.push_back({legacy, legacy->enqueued});
    join(st->vc, legacy->vc);
  }
  join(st->vc, tl_host_vc);
  if (st->vc.size() <= size_t(st->id)) st->vc.resize(size_t(st->id) + 1, 0);
  op->epoch = ++st->vc[size_t(st->id)];
  op->vc = st->vc;
  if (!op->shared_name) op->shared_name = std::make_shared<const std::string>(op->name);
  {
    std::lock_guard<std::mutex> lock(st->m);
    st->queue.push_back(std::move(op));
    ++st->enqueued;
  }
  st->cv.notify_all();
  return cudaSuccess;
}

// Blocks the host until `st` has run everything enqueued so far; the host then
// knows all of it happened (vector clock join).
void host_wait_stream(Stream* st) {
  uint64_t target;
  VClock vc;
  {
    std::lock_guard<std::mutex> lock(state().m);
    std::lock_guard<std::mutex> lock2(st->m);
    target = st->enqueued;
    vc = st->vc;
  }
  state().counters.host_syncs++;
  wait_completed(st, target);
  join(tl_host_vc, vc);
}

// The synchronous APIs' end: the host waits for the stream, then sees its device's health.
cudaError_t host_sync(cudaStream_t stream, int device) {
  Stream* st;
  {
    std::lock_guard<std::mutex> lock(state().m);
    st = resolve_locked(stream, device);
  }
  host_wait_stream(st);
  return record_error(check_context(device));
}

void host_wait_device(int device) {
  std::vector<Stream*> streams;
  {
    std::lock_guard<std::mutex> lock(state().m);
    streams = state().devices[size_t(device)].streams;
  }
  for (Stream* st : streams) host_wait_stream(st);
}

// --- Happens-before checker ---------------------------------------------------

void finish_log(AccessLog& log) {
  auto& v = log.items;
  std::sort(v.begin(), v.end(), [](const Interval& a, const Interval& b) {
    if (a.a != b.a) return a.a < b.a;
    if (a.write != b.write) return a.write < b.write;
    return a.lo < b.lo;
  });
  std::vector<Interval> merged;
  for (const Interval& i : v) {
    if (!merged.empty() && merged.back().a == i.a && merged.back().write == i.write && i.lo <= merged.back().hi)
      merged.back().hi = std::max(merged.back().hi, i.hi);
    else
      merged.push_back(i);
  }
  v.swap(merged);
  log.next_compact = std::max<size_t>(4096, 2 * v.size());
}

// For the checker: at most kCheckRanges ranges per allocation and direction;
// more (a scattered access pattern) are joined, which can only add reports
// between ranges the operation did not touch, never hide one.
constexpr size_t kCheckRanges = 64;
void coarsen(std::vector<Interval>& v) {
  std::vector<Interval> out;
  for (size_t begin = 0; begin < v.size();) {
    size_t end = begin;
    while (end < v.size() && v[end].a == v[begin].a && v[end].write == v[begin].write) ++end;
    const size_t per = (end - begin + kCheckRanges - 1) / kCheckRanges;
    for (size_t k = begin; k < end; k += per) {
      Interval joined = v[k];
      joined.hi = v[std::min(end, k + per) - 1].hi;
      out.push_back(joined);
    }
    begin = end;
  }
  v.swap(out);
}

void hb_check_and_record(const Op& op, int stream_id, AccessLog& log) {
  if (log.items.empty()) return;
  finish_log(log);
  coarsen(log.items);
  State& s = state();
  std::vector<std::string> races;
  {
    std::lock_guard<std::mutex> lock(s.hb_m);
    for (const Interval& i : log.items) {
      Allocation* a = i.a;
      for (const Allocation::Record& r : a->history) {
        if (r.stream == stream_id || !(i.write || r.write)) continue;
        if (r.hi <= i.lo || i.hi <= r.lo) continue;
        if (at(op.vc, r.stream) >= r.epoch) continue;  // ordered: r happened before op
        std::ostringstream o;
        o << "race on " << a->describe() << " bytes [" << (std::max(r.lo, i.lo) - a->user) << ", "
          << (std::min(r.hi, i.hi) - a->user) << "): '" << *r.op << "' on stream " << r.stream
          << (r.write ? " writes" : " reads") << " and '" << op.name << "' on stream " << stream_id
          << (i.write ? " writes" : " reads")
          << " with no ordering between them (no event wait, synchronisation or graph edge)";
        races.push_back(o.str());
        break;
      }
      if (a->history.size() >= kHistoryLimit)
        a->history.erase(a->history.begin(), a->history.begin() + kHistoryLimit / 2);
      a->history.push_back({stream_id, op.epoch, i.lo, i.hi, i.write, op.shared_name});
    }
  }
  for (const std::string& r : races) {
    add_violation(r);
    make_sticky(log.device, cudaErrorLaunchFailure, r);
  }
}

// --- Allocation helpers ---------------------------------------------------------

cudaError_t allocate(void** out, size_t size, int device, MemKind kind, const char* how) {
  if (!out) return cudaErrorInvalidValue;
  *out = nullptr;
  State& s = state();
  if (kind == MemKind::kDevice) {
    std::lock_guard<std::mutex> lock(s.m);
    Device& d = s.devices[size_t(device)];
    if (size > d.limit - std::min(d.limit, d.used)) return cudaErrorMemoryAllocation;
    d.used += size;
  }
  auto* a = new Allocation;
  a->size = size;
  a->raw_size = kRedZone + ((size + kRedZone - 1) / kRedZone) * kRedZone + kRedZone;
  a->raw = static_cast<char*>(std::aligned_alloc(kRedZone, a->raw_size));
  if (!a->raw) {
    delete a;
    if (kind == MemKind::kDevice) {
      std::lock_guard<std::mutex> lock(s.m);
      s.devices[size_t(device)].used -= size;
    }
    return cudaErrorMemoryAllocation;
  }
  a->user = uintptr_t(a->raw) + kRedZone;
  a->device = device;
  a->kind = kind;
  a->how = how;
  std::memset(a->raw, 0xFD, kRedZone);
  // Never zero: 0xFF bytes are NaN as float and as double, so reading memory
  // that was never written shows up in results.
  std::memset(a->raw + kRedZone, 0xFF, a->raw_size - kRedZone);
  {
    Registry& r = registry();
    std::unique_lock<std::shared_mutex> lock(r.m);
    a->id = r.next_id++;
    r.by_raw[uintptr_t(a->raw)] = a;
  }
  s.counters.allocations++;
  *out = reinterpret_cast<void*>(a->user);
  return cudaSuccess;
}

// Finds the live allocation whose user range starts at p.
Allocation* allocation_at(const void* p, MemKind kind) {
  Registry& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.m);
  Allocation* a = r.find_locked(uintptr_t(p));
  return a && !a->freed && a->kind == kind && a->user == uintptr_t(p) ? a : nullptr;
}

void release(Allocation* a, const char* how) {
  State& s = state();
  Registry& r = registry();
  std::vector<Allocation*> evict;
  {
    std::unique_lock<std::shared_mutex> lock(r.m);
    a->freed = true;
    a->freed_how = how;
    std::memset(reinterpret_cast<void*>(a->user), 0xFB, a->size);  // freed: poisoned
    r.quarantine.push_back(a);
    r.quarantine_bytes += a->raw_size;
    while (r.quarantine_bytes > kQuarantineBytes && r.quarantine.size() > 1) {
      Allocation* old = r.quarantine.front();
      r.quarantine.pop_front();
      r.quarantine_bytes -= old->raw_size;
      r.by_raw.erase(uintptr_t(old->raw));
      evict.push_back(old);
    }
  }
  {
    std::lock_guard<std::mutex> lock(s.hb_m);
    for (Allocation* old : evict) {
      std::free(old->raw);
      delete old;
    }
  }
  if (a->kind == MemKind::kDevice) {
    std::lock_guard<std::mutex> lock(s.m);
    s.devices[size_t(a->device)].used -= a->size;
  }
  s.counters.frees++;
}

enum class Space { kDevice, kPinned, kPageable };

// Where p lies; for device/pinned memory the whole [p, p + bytes) must be inside one live allocation.
Space classify(const void* p, size_t bytes, int* device, std::string* why) {
  Registry& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.m);
  Allocation* a = r.find_locked(uintptr_t(p));
  if (!a) return Space::kPageable;
  if (device) *device = a->device;
  if (a->freed) {
    if (why) *why = hex(uintptr_t(p)) + " lies in " + a->describe() + ", freed by " + a->freed_how;
    return a->kind == MemKind::kDevice ? Space::kDevice : Space::kPinned;
  }
  if (uintptr_t(p) < a->user || uintptr_t(p) + bytes > a->user + a->size) {
    if (why)
      *why = "[" + hex(uintptr_t(p)) + ", +" + std::to_string(bytes) + ") is outside " + a->describe() + " (offset " +
             std::to_string(int64_t(uintptr_t(p) - a->user)) + ")";
  }
  return a->kind == MemKind::kDevice ? Space::kDevice : Space::kPinned;
}

void print_leaks() {
  const auto leaks = live_allocations();
  if (leaks.empty()) return;
  std::fprintf(stderr, "mgpu GPU emulation: %zu allocation(s) never freed at exit:\n", leaks.size());
  for (size_t i = 0; i < leaks.size() && i < 20; ++i) std::fprintf(stderr, "  leak: %s\n", leaks[i].c_str());
}

int physical(int device) { return state().devices.at(size_t(device)).physical; }

// One name for every emulated GPU, as identical real GPUs share theirs: tools that
// group devices by name (topo's medians, the selector's mixed-device rule) see them
// as the equal devices they are. The index is the device number, beside the name.
std::string device_name(int /*device*/) { return "Emulated GPU (mgpu CPU emulation, not a real GPU)"; }

}  // namespace

// --- Internal API (runtime.h) -------------------------------------------------

Counters& counters() { return state().counters; }

std::vector<std::string> violations() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.violations_m);
  return s.violations;
}

void clear_violations() {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.violations_m);
    s.violations.clear();
  }
  // Tests continue on a fresh context, as after cudaDeviceReset.
  std::lock_guard<std::mutex> lock(s.m);
  for (Device& d : s.devices) {
    d.sticky = cudaSuccess;
    d.sticky_detail.clear();
  }
}

std::vector<std::string> live_allocations() {
  std::vector<std::string> out;
  Registry& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.m);
  for (const auto& kv : r.by_raw)
    if (!kv.second->freed) out.push_back(kv.second->describe());
  return out;
}

int emulated_device_count() { return int(state().devices.size()); }
size_t device_memory_limit(int device) { return state().devices.at(size_t(device)).limit; }
int current_device() { return tl_device; }
bool device_valid(int device) { return device >= 0 && size_t(device) < state().devices.size(); }

cudaError_t sticky_error(int device) { return check_context(device); }

void report_violation(int device, cudaError_t code, const std::string& what) {
  add_violation(what);
  if (device_valid(device)) make_sticky(device, code, what);
}

cudaError_t set_error(cudaError_t code, const std::string& detail) {
  if (code != cudaSuccess)
    tl_details[int(code)] = std::string(error_text(code).text) + " [GPU emulation: " + detail + "]";
  return record_error(code);
}

int device_of(cudaStream_t stream) {
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread) return tl_device;
  std::lock_guard<std::mutex> lock(state().m);
  return state().streams.count(stream) ? as_stream(stream)->device : -1;
}

bool stream_is_capturing(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(state().m);
  Stream* st = state().streams.count(stream) ? as_stream(stream) : nullptr;
  return st && st->capture;
}

cudaError_t capture_guard(const char* call) {
  std::lock_guard<std::mutex> lock(state().m);
  for (auto& c : tl_captures) {
    if (c->mode == cudaStreamCaptureModeRelaxed) continue;
    c->invalidated = true;
    c->why = std::string(call) + " was called during the capture";
    return set_error(cudaErrorStreamCaptureUnsupported,
                     std::string(call) + " is not permitted while this thread captures a stream");
  }
  return cudaSuccess;
}

cudaError_t enqueue(cudaStream_t stream, const std::string& name, OpKind kind, std::function<void()> run) {
  const int device = device_of(stream);
  if (device < 0) return set_error(cudaErrorInvalidResourceHandle, name + ": unknown or destroyed stream");
  if (const cudaError_t e = check_context(device)) return record_error(e);
  auto op = std::make_shared<Op>();
  op->name = name;
  op->kind = kind;
  op->run = std::move(run);
  std::lock_guard<std::mutex> lock(state().m);
  Stream* st = resolve_locked(stream, device);
  if (!st) return set_error(cudaErrorInvalidResourceHandle, name + ": unknown or destroyed stream");
  return record_error(enqueue_locked(st, std::move(op)));
}

std::string check_device_range(const void* p, size_t bytes, int device, bool allow_pinned) {
  int where = -1;
  std::string why;
  const Space space = classify(p, bytes, &where, &why);
  if (space == Space::kPageable)
    return hex(uintptr_t(p)) + " is host memory, not device memory (a host pointer where a device pointer belongs)";
  if (!why.empty()) return why;
  if (space == Space::kPinned)
    return allow_pinned ? "" : hex(uintptr_t(p)) + " is pinned host memory, not device memory";
  if (where != device)
    return hex(uintptr_t(p)) + " is memory of GPU " + std::to_string(where) + ", used on GPU " + std::to_string(device);
  return "";
}

bool is_device_pointer(const void* p) {
  int where = -1;
  std::string why;
  return p && classify(p, 1, &where, &why) == Space::kDevice && why.empty();
}

void touch(const void* p, size_t bytes, bool write, bool allow_pinned) {
  AccessLog* log = tl_log;
  if (!log || bytes == 0) return;
  const std::string why = check_device_range(p, bytes, log->device, allow_pinned);
  if (!why.empty()) throw Fault(cudaErrorIllegalAddress, std::string(log->op) + (write ? " writes " : " reads ") + why);
  log_access(log, uintptr_t(p), bytes, write, log->op);
}

AccessLog* current_access_log() { return tl_log; }

void log_access(AccessLog* log, uintptr_t p, size_t bytes, bool write, const char* kernel) {
  Allocation* a = nullptr;
  for (Allocation* c : log->recent)
    if (c && p >= uintptr_t(c->raw) && p < uintptr_t(c->raw) + c->raw_size) {
      a = c;
      break;
    }
  if (!a) {
    for (int k = 0; k < 4; ++k)
      if (p >= log->gap_lo[k] && p < log->gap_hi[k]) return;
    Registry& r = registry();
    std::shared_lock<std::shared_mutex> lock(r.m);
    a = r.find_locked(p);
    if (!a) {
      // Not emulated memory (shared memory, the launch's arguments, pageable
      // host memory): remember the whole gap between the allocations around
      // it (an operation cannot use memory allocated after its launch).
      auto next = r.by_raw.upper_bound(p);
      const uintptr_t hi = next == r.by_raw.end() ? ~uintptr_t(0) : next->first;
      uintptr_t lo = 0;
      if (next != r.by_raw.begin()) {
        auto prev = std::prev(next);
        lo = uintptr_t(prev->second->raw) + prev->second->raw_size;
      }
      std::copy_backward(log->gap_lo, log->gap_lo + 3, log->gap_lo + 4);
      std::copy_backward(log->gap_hi, log->gap_hi + 3, log->gap_hi + 4);
      log->gap_lo[0] = lo;
      log->gap_hi[0] = hi;
      return;
    }
    std::copy_backward(log->recent, log->recent + 3, log->recent + 4);
    log->recent[0] = a;
  }
  auto fail = [&](const std::string& what) {
    std::ostringstream o;
    o << kernel << (write ? " writes " : " reads ") << bytes << " bytes at " << hex(p) << ": " << what;
    throw Fault(cudaErrorIllegalAddress, o.str());
  };
  if (a->freed) fail("use after free of " + a->describe() + " (freed by " + a->freed_how + ")");
  if (p < a->user || p + bytes > a->user + a->size)
    fail("out of bounds of " + a->describe() + " at offset " + std::to_string(int64_t(p - a->user)));
  if (a->kind == MemKind::kDevice && a->device != log->device)
    fail("memory of GPU " + std::to_string(a->device) + " used on GPU " + std::to_string(log->device));
  // Extend one of the most recent intervals where the access is adjacent.
  auto& items = log->items;
  const size_t n = items.size();
  for (size_t k = n; k > 0 && k + 4 > n; --k) {
    Interval& i = items[k - 1];
    if (i.a == a && i.write == write && p <= i.hi && p + bytes >= i.lo) {
      i.lo = std::min(i.lo, p);
      i.hi = std::max(i.hi, p + bytes);
      return;
    }
  }
  items.push_back({a, p, p + bytes, write});
  if (items.size() > log->next_compact) finish_log(*log);
}

namespace {
std::atomic<int> g_in_process_collectives{0};

// A device-synchronising memory call while an in-process collective is pending
// (see runtime.h): a hang on a GPU, a violation here.
void check_no_pending_in_process_collective(const char* call, int device) {
  const int pending = g_in_process_collectives.load();
  if (pending == 0) return;
  add_violation(std::string(call) + " on GPU " + std::to_string(device) + " while " + std::to_string(pending) +
                " collective(s) of a single-process multi-GPU NCCL communicator are queued or running: on a GPU " +
                call +
                " can synchronise the device and its peers and deadlock with a collective that waits for "
                "this thread (NVIDIA/nccl#48); allocate stream-ordered (cudaMallocAsync/cudaFreeAsync) instead");
}
}  // namespace

void in_process_collective_queued() { ++g_in_process_collectives; }
void in_process_collective_done() { --g_in_process_collectives; }

// --- Stream-ordered pools: each GPU's default pool, and which other GPUs may access it.

namespace {
struct PoolHandle {
  int device;
};
std::mutex g_pool_m;
std::map<int, std::set<int>> g_pool_access;  // pool's GPU -> other GPUs granted read/write
PoolHandle* pool_handle(int device) {
  static std::vector<PoolHandle>* handles = [] {
    auto* h = new std::vector<PoolHandle>;
    for (int d = 0; d < emulated_device_count(); ++d) h->push_back({d});
    return h;
  }();
  return device_valid(device) ? &(*handles)[size_t(device)] : nullptr;
}
int pool_device(cudaMemPool_t pool) {
  for (int d = 0; d < emulated_device_count(); ++d)
    if (reinterpret_cast<cudaMemPool_t>(pool_handle(d)) == pool) return d;
  return -1;
}
}  // namespace

std::string check_peer_access(const void* p, size_t bytes, int peer) {
  Registry& r = registry();
  Allocation* a = nullptr;
  {
    std::shared_lock<std::shared_mutex> lock(r.m);
    a = r.find_locked(uintptr_t(p));
  }
  if (!a || a->freed || a->kind != MemKind::kDevice || a->device == peer || bytes == 0) return "";
  if (std::string(a->how) != "cudaMallocAsync") return "";  // cudaMalloc memory: peer access follows the context
  std::lock_guard<std::mutex> lock(g_pool_m);
  if (g_pool_access[a->device].count(peer)) return "";
  return "GPU " + std::to_string(a->device) + "'s stream-ordered pool memory at " + hex(uintptr_t(p)) +
         " is not accessible to GPU " + std::to_string(peer) +
         ": NCCL in one process accesses peers' buffers directly; grant access with cudaMemPoolSetAccess "
         "(openxla/xla#14891)";
}

}  // namespace mgpu_emu

using namespace mgpu_emu;

// --- cuda_runtime_api.h -------------------------------------------------------

extern "C" {

const char* cudaGetErrorName(cudaError_t error) { return error_text(error).name; }

const char* cudaGetErrorString(cudaError_t error) {
  State& s = state();
  {
    // A device's sticky error first: its text says what broke the context.
    std::lock_guard<std::mutex> lock(s.m);
    for (const Device& d : s.devices)
      if (d.sticky == error && !d.sticky_detail.empty()) {
        tl_details[int(error)] = d.sticky_detail;  // kept per thread: the pointer outlives the lock
        return tl_details[int(error)].c_str();
      }
  }
  auto it = tl_details.find(int(error));
  if (it != tl_details.end()) return it->second.c_str();
  if (error == cudaErrorNoDevice && !s.config_error.empty()) {
    tl_details[int(error)] = std::string(error_text(error).text) + " [GPU emulation: " + s.config_error + "]";
    return tl_details[int(error)].c_str();
  }
  return error_text(error).text;
}

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = tl_last_error;
  tl_last_error = cudaSuccess;
  if (e == cudaSuccess) {
    const cudaError_t sticky = check_context(tl_device);
    if (sticky != cudaSuccess && sticky != cudaErrorInvalidDevice) return sticky;
  }
  return e;
}

cudaError_t cudaPeekAtLastError(void) { return tl_last_error; }

cudaError_t cudaGetDeviceCount(int* count) {
  if (!count) return record_error(cudaErrorInvalidValue);
  *count = int(state().devices.size());
  if (*count == 0) {
    *count = 0;
    return set_error(cudaErrorNoDevice, state().config_error.empty() ? "MGPU_EMULATE_GPU is not set: no emulated GPU"
                                                                     : state().config_error);
  }
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (!device_valid(device))
    return set_error(cudaErrorInvalidDevice, "device " + std::to_string(device) + " of " +
                                                 std::to_string(emulated_device_count()) + " emulated");
  tl_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (!device) return record_error(cudaErrorInvalidValue);
  *device = tl_device;
  return device_valid(tl_device) ? cudaSuccess : record_error(cudaErrorNoDevice);
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (!prop) return record_error(cudaErrorInvalidValue);
  if (!device_valid(device)) return record_error(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof(*prop));
  std::snprintf(prop->name, sizeof(prop->name), "%s", device_name(device).c_str());
  // An H100 SXM's limits, so launches fail where they would fail there.
  prop->totalGlobalMem = device_memory_limit(device);
  prop->sharedMemPerBlock = 48 * 1024;
  prop->sharedMemPerBlockOptin = 227 * 1024;
  prop->sharedMemPerMultiprocessor = 228 * 1024;
  prop->regsPerBlock = 65536;
  prop->regsPerMultiprocessor = 65536;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024;
  prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 2147483647;
  prop->maxGridSize[1] = 65535;
  prop->maxGridSize[2] = 65535;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->maxBlocksPerMultiProcessor = 32;
  prop->l2CacheSize = 50 * 1024 * 1024;
  prop->memoryBusWidth = 5120;
  prop->concurrentKernels = 1;
  prop->asyncEngineCount = 3;
  prop->unifiedAddressing = 1;
  prop->streamPrioritiesSupported = 1;
  prop->memoryPoolsSupported = 1;
  prop->canMapHostMemory = 1;
  prop->pciDomainID = 0;
  prop->pciBusID = 0xE0 + physical(device);  // fictitious, one per emulated device
  prop->pciDeviceID = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (!value) return record_error(cudaErrorInvalidValue);
  cudaDeviceProp p;
  if (const cudaError_t e = cudaGetDeviceProperties(&p, device)) return e;
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
    case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
    case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = int(p.sharedMemPerBlock); break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = int(p.sharedMemPerBlockOptin); break;
    case cudaDevAttrWarpSize: *value = 32; break;
    default: return set_error(cudaErrorNotSupported, "cudaDeviceGetAttribute: attribute not emulated");
  }
  return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char* pciBusId, int len, int device) {
  if (!pciBusId || len <= 0) return record_error(cudaErrorInvalidValue);
  if (!device_valid(device)) return record_error(cudaErrorInvalidDevice);
  std::snprintf(pciBusId, size_t(len), "0000:%02X:00.0", 0xE0 + physical(device));
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* v) {
  if (!v) return record_error(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* v) {
  if (!v) return record_error(cudaErrorInvalidValue);
  *v = CUDART_VERSION;  // the emulation is its own driver
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  if (!free_bytes || !total) return record_error(cudaErrorInvalidValue);
  if (!device_valid(tl_device)) return record_error(cudaErrorNoDevice);
  std::lock_guard<std::mutex> lock(state().m);
  const Device& d = state().devices[size_t(tl_device)];
  *total = d.limit;
  *free_bytes = d.limit - std::min(d.limit, d.used);
  return cudaSuccess;
}

cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  if (!device_valid(tl_device)) return record_error(cudaErrorNoDevice);
  if (const cudaError_t e = capture_guard("cudaDeviceSynchronize")) return e;
  host_wait_device(tl_device);
  return record_error(check_context(tl_device));
}

cudaError_t cudaDeviceReset(void) {
  if (!device_valid(tl_device)) return record_error(cudaErrorNoDevice);
  host_wait_device(tl_device);
  std::lock_guard<std::mutex> lock(state().m);
  Device& d = state().devices[size_t(tl_device)];
  d.sticky = cudaSuccess;
  d.sticky_detail.clear();
  return cudaSuccess;
}

// --- Memory ---------------------------------------------------------------------

cudaError_t cudaMalloc(void** devPtr, size_t size) {
  if (!device_valid(tl_device)) return record_error(cudaErrorNoDevice);
  if (const cudaError_t e = capture_guard("cudaMalloc")) return e;
  if (const cudaError_t e = check_context(tl_device)) return record_error(e);
  check_no_pending_in_process_collective("cudaMalloc", tl_device);
  const cudaError_t e = allocate(devPtr, size, tl_device, MemKind::kDevice, "cudaMalloc");
  if (e == cudaErrorMemoryAllocation)
    return set_error(e, "cudaMalloc of " + std::to_string(size) +
                            " bytes exceeds the emulated GPU's memory (MGPU_EMULATE_GPU_MEMORY)");
  return record_error(e);
}

cudaError_t cudaFree(void* devPtr) {
  if (!devPtr) return cudaSuccess;
  if (const cudaError_t e = capture_guard("cudaFree")) return e;
  Allocation* a = allocation_at(devPtr, MemKind::kDevice);
  if (!a)
    return set_error(cudaErrorInvalidValue,
                     "cudaFree(" + hex(uintptr_t(devPtr)) +
                         "): not the start of a live cudaMalloc allocation (double free, or a host pointer)");
  check_no_pending_in_process_collective("cudaFree", a->device);
  // cudaFree synchronises the device: every stream's work finishes first.
  host_wait_device(a->device);
  release(a, "cudaFree");
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t size) {
  if (const cudaError_t e = capture_guard("cudaMallocHost")) return e;
  return record_error(allocate(ptr, size, tl_device, MemKind::kPinned, "cudaMallocHost"));
}

cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int) { return cudaMallocHost(ptr, size); }

cudaError_t cudaFreeHost(void* ptr) {
  if (!ptr) return cudaSuccess;
  if (const cudaError_t e = capture_guard("cudaFreeHost")) return e;
  Allocation* a = allocation_at(ptr, MemKind::kPinned);
  if (!a)
    return set_error(cudaErrorInvalidValue,
                     "cudaFreeHost(" + hex(uintptr_t(ptr)) + "): not a live cudaMallocHost allocation");
  check_no_pending_in_process_collective("cudaFreeHost", tl_device);
  for (int d = 0; d < emulated_device_count(); ++d) host_wait_device(d);
  release(a, "cudaFreeHost");
  return cudaSuccess;
}

cudaError_t cudaMallocAsync(void** devPtr, size_t size, cudaStream_t stream) {
  const int device = device_of(stream);
  if (device < 0) return set_error(cudaErrorInvalidResourceHandle, "cudaMallocAsync: unknown stream");
  if (stream_is_capturing(stream))
    return set_error(cudaErrorStreamCaptureUnsupported,
                     "cudaMallocAsync inside a capture (graph memory nodes) is not emulated");
  if (const cudaError_t e = check_context(device)) return record_error(e);
  void* p = nullptr;
  const cudaError_t e = allocate(&p, size, device, MemKind::kDevice, "cudaMallocAsync");
  if (e != cudaSuccess)
    return set_error(e, "cudaMallocAsync of " + std::to_string(size) + " bytes exceeds the emulated GPU's memory");
  *devPtr = p;
  // The memory belongs to the stream from here: other streams must be ordered after this point.
  return enqueue(stream, "cudaMallocAsync", OpKind::kOther, [p, size] { touch(p, size, true, false); });
}

cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t stream) {
  if (!devPtr) return cudaSuccess;
  if (stream_is_capturing(stream))
    return set_error(cudaErrorStreamCaptureUnsupported, "cudaFreeAsync inside a capture is not emulated");
  Allocation* a = allocation_at(devPtr, MemKind::kDevice);
  if (!a)
    return set_error(cudaErrorInvalidValue, "cudaFreeAsync(" + hex(uintptr_t(devPtr)) + "): not a live allocation");
  return enqueue(stream, "cudaFreeAsync", OpKind::kOther, [a, devPtr] {
    touch(devPtr, a->size, true, false);  // the free is a write: unordered users on other streams race with it
    release(a, "cudaFreeAsync");
  });
}

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* memPool, int device) {
  if (!memPool) return record_error(cudaErrorInvalidValue);
  if (!device_valid(device))
    return set_error(cudaErrorInvalidDevice, "cudaDeviceGetDefaultMemPool: no GPU " + std::to_string(device));
  *memPool = reinterpret_cast<cudaMemPool_t>(pool_handle(device));
  return cudaSuccess;
}

cudaError_t cudaMemPoolSetAccess(cudaMemPool_t memPool, const cudaMemAccessDesc* descList, size_t count) {
  const int owner = pool_device(memPool);
  if (owner < 0 || (count && !descList))
    return set_error(cudaErrorInvalidValue, "cudaMemPoolSetAccess: not a pool of the emulation");
  std::lock_guard<std::mutex> lock(g_pool_m);
  for (size_t i = 0; i < count; ++i) {
    const cudaMemAccessDesc& d = descList[i];
    if (d.location.type != cudaMemLocationTypeDevice || !device_valid(d.location.id))
      return set_error(cudaErrorInvalidValue, "cudaMemPoolSetAccess: location is not an emulated GPU");
    if (d.location.id == owner) {
      if (d.flags != cudaMemAccessFlagsProtReadWrite)
        return set_error(cudaErrorInvalidValue, "cudaMemPoolSetAccess: the pool's own GPU keeps read/write access");
      continue;
    }
    if (d.flags == cudaMemAccessFlagsProtReadWrite)
      g_pool_access[owner].insert(d.location.id);
    else
      g_pool_access[owner].erase(d.location.id);  // read-only access is not enough for a collective's output
  }
  return cudaSuccess;
}

cudaError_t cudaDeviceCanAccessPeer(int* canAccessPeer, int device, int peerDevice) {
  if (!canAccessPeer) return record_error(cudaErrorInvalidValue);
  if (!device_valid(device) || !device_valid(peerDevice)) return record_error(cudaErrorInvalidDevice);
  *canAccessPeer = device != peerDevice ? 1 : 0;  // emulated GPUs share one NVLink-like fabric
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) {
  if (!attributes) return record_error(cudaErrorInvalidValue);
  std::memset(attributes, 0, sizeof(*attributes));
  int device = -1;
  std::string why;
  const Space space = classify(ptr, 1, &device, &why);
  if (space == Space::kPageable || !why.empty()) {
    attributes->type = cudaMemoryTypeUnregistered;
    attributes->device = -2;
    attributes->hostPointer = const_cast<void*>(ptr);
    return cudaSuccess;
  }
  attributes->device = device;
  if (space == Space::kDevice) {
    attributes->type = cudaMemoryTypeDevice;
    attributes->devicePointer = const_cast<void*>(ptr);
  } else {
    attributes->type = cudaMemoryTypeHost;
    attributes->hostPointer = attributes->devicePointer = const_cast<void*>(ptr);
  }
  return cudaSuccess;
}

namespace {

const char* kind_name(cudaMemcpyKind k) {
  switch (k) {
    case cudaMemcpyHostToHost: return "cudaMemcpyHostToHost";
    case cudaMemcpyHostToDevice: return "cudaMemcpyHostToDevice";
    case cudaMemcpyDeviceToHost: return "cudaMemcpyDeviceToHost";
    case cudaMemcpyDeviceToDevice: return "cudaMemcpyDeviceToDevice";
    case cudaMemcpyDefault: return "cudaMemcpyDefault";
  }
  return "an invalid cudaMemcpyKind";
}

// A copy, checked against what the pointers really are (stricter than a GPU,
// where a wrong kind may silently work under unified addressing).
cudaError_t memcpy_impl(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream,
                        bool sync_api, const char* call) {
  if (count == 0) return cudaSuccess;
  if (!dst || !src) return set_error(cudaErrorInvalidValue, std::string(call) + " with a null pointer");
  const int device = device_of(stream);
  if (device < 0) return set_error(cudaErrorInvalidResourceHandle, std::string(call) + ": unknown stream");
  std::string why_src, why_dst;
  int dev_src = -1, dev_dst = -1;
  const Space s_src = classify(src, count, &dev_src, &why_src);
  const Space s_dst = classify(dst, count, &dev_dst, &why_dst);
  if (!why_src.empty()) return set_error(cudaErrorInvalidValue, std::string(call) + " source: " + why_src);
  if (!why_dst.empty()) return set_error(cudaErrorInvalidValue, std::string(call) + " destination: " + why_dst);
  const bool src_dev = s_src == Space::kDevice, dst_dev = s_dst == Space::kDevice;
  const bool ok = kind == cudaMemcpyDefault || (kind == cudaMemcpyHostToDevice && !src_dev && dst_dev) ||
                  (kind == cudaMemcpyDeviceToHost && src_dev && !dst_dev) ||
                  (kind == cudaMemcpyDeviceToDevice && src_dev && dst_dev) ||
                  (kind == cudaMemcpyHostToHost && !src_dev && !dst_dev);
  if (!ok)
    return set_error(cudaErrorInvalidMemcpyDirection, std::string(call) + " with " + kind_name(kind) +
                                                          " but the source is " + (src_dev ? "device" : "host") +
                                                          " memory and the destination " +
                                                          (dst_dev ? "device" : "host") + " memory");
  const bool capturing = stream_is_capturing(stream);
  const bool pageable = s_src == Space::kPageable || s_dst == Space::kPageable;
  if (capturing && pageable)
    return set_error(cudaErrorStreamCaptureUnsupported,
                     std::string(call) + " with pageable host memory inside a capture (use pinned memory)");
  if (sync_api)
    if (const cudaError_t e = capture_guard(call)) return e;
  Counters& c = state().counters;
  std::shared_ptr<std::vector<char>> staged;
  const void* from = src;
  if (s_src == Space::kPageable && !sync_api) {
    if (dst_dev) c.pageable_h2d_copies++;
    // The driver stages pageable sources at the call: the caller may reuse its buffer at once.
    staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + count);
    from = staged->data();
  }
  const bool src_tracked = s_src != Space::kPageable, dst_tracked = s_dst != Space::kPageable;
  const std::string name =
      std::string(call) + (src_dev ? (dst_dev ? " DtoD" : " DtoH") : (dst_dev ? " HtoD" : " HtoH"));
  auto* counter = src_dev ? (dst_dev ? &c.d2d_bytes : &c.d2h_bytes) : (dst_dev ? &c.h2d_bytes : nullptr);
  const cudaError_t e = enqueue(stream, name, OpKind::kCopy, [=, staged = std::move(staged)] {
    (void)staged;  // owns the staged copy of a pageable source until the copy has run
    if (src_tracked) touch(src, count, false);
    if (dst_tracked) touch(dst, count, true);
    std::memmove(dst, from, count);
    if (counter) *counter += count;
  });
  if (e != cudaSuccess) return e;
  // Copies to pageable memory, and the synchronous API, return when done.
  if (!capturing && (sync_api || s_dst == Space::kPageable)) {
    return host_sync(stream, device);
  }
  return cudaSuccess;
}

cudaError_t memset_impl(void* devPtr, int value, size_t count, cudaStream_t stream, bool sync_api, const char* call) {
  if (count == 0) return cudaSuccess;
  const int device = device_of(stream);
  if (device < 0) return set_error(cudaErrorInvalidResourceHandle, std::string(call) + ": unknown stream");
  const std::string why = check_device_range(devPtr, count, device, false);
  if (!why.empty()) return set_error(cudaErrorInvalidValue, std::string(call) + ": " + why);
  if (sync_api)
    if (const cudaError_t e = capture_guard(call)) return e;
  const cudaError_t e = enqueue(stream, call, OpKind::kMemset, [=] {
    touch(devPtr, count, true, false);
    std::memset(devPtr, value, count);
  });
  if (e != cudaSuccess || !sync_api) return e;
  return host_sync(stream, device);
}

}  // namespace

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  return memcpy_impl(dst, src, count, kind, nullptr, true, "cudaMemcpy");
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream) {
  return memcpy_impl(dst, src, count, kind, stream, false, "cudaMemcpyAsync");
}
cudaError_t cudaMemset(void* devPtr, int value, size_t count) {
  return memset_impl(devPtr, value, count, nullptr, true, "cudaMemset");
}
cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream) {
  return memset_impl(devPtr, value, count, stream, false, "cudaMemsetAsync");
}

// --- Streams --------------------------------------------------------------------

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* pStream, unsigned int flags, int priority) {
  if (!pStream) return record_error(cudaErrorInvalidValue);
  if (!device_valid(tl_device)) return record_error(cudaErrorNoDevice);
  if (const cudaError_t e = check_context(tl_device)) return record_error(e);
  std::lock_guard<std::mutex> lock(state().m);
  *pStream = reinterpret_cast<cudaStream_t>(
      new_stream_locked(tl_device, (flags & cudaStreamNonBlocking) == 0, false, priority));
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int flags) {
  return cudaStreamCreateWithPriority(pStream, flags, 0);
}
cudaError_t cudaStreamCreate(cudaStream_t* pStream) { return cudaStreamCreateWithPriority(pStream, 0, 0); }

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  Stream* st;
  {
    std::lock_guard<std::mutex> lock(state().m);
    if (!state().streams.count(stream))
      return set_error(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: unknown stream");
    st = as_stream(stream);
    if (st->capture) return set_error(cudaErrorStreamCaptureUnsupported, "cudaStreamDestroy of a capturing stream");
    state().streams.erase(stream);
    auto& list = state().devices[size_t(st->device)].streams;
    list.erase(std::remove(list.begin(), list.end(), st), list.end());
  }
  // Work already enqueued still runs (as on a GPU); the worker ends after it.
  {
    std::lock_guard<std::mutex> lock(st->m);
    st->stopping = true;
  }
  st->cv.notify_all();
  return cudaSuccess;  // the Stream object stays allocated: late event records may still name it
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  const int device = device_of(stream);
  if (device < 0) return set_error(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize: unknown stream");
  if (stream_is_capturing(stream)) {
    capture_guard("cudaStreamSynchronize");
    return set_error(cudaErrorStreamCaptureUnsupported, "cudaStreamSynchronize of a capturing stream");
  }
  if (const cudaError_t e = capture_guard("cudaStreamSynchronize")) return e;
  return host_sync(stream, device);
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  const int device = device_of(stream);
  if (device < 0) return set_error(cudaErrorInvalidResourceHandle, "cudaStreamQuery: unknown stream");
  if (stream_is_capturing(stream))
    return set_error(cudaErrorStreamCaptureUnsupported, "cudaStreamQuery of a capturing stream");
  Stream* st;
  VClock vc;
  bool done;
  {
    std::lock_guard<std::mutex> lock(state().m);
    st = resolve_locked(stream, device);
    std::lock_guard<std::mutex> lock2(st->m);
    done = st->completed == st->enqueued;
    vc = st->vc;
  }
  if (!done) return cudaErrorNotReady;
  join(tl_host_vc, vc);
  return record_error(check_context(device));
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  const int device = device_of(stream);
  if (device < 0) return set_error(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: unknown stream");
  std::lock_guard<std::mutex> lock(state().m);
  if (!state().events.count(event))
    return set_error(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: unknown event");
  Stream* st = resolve_locked(stream, device);
  std::shared_ptr<EventRecord> rec = as_event(event)->rec;
  if (!rec) return cudaSuccess;  // never recorded: nothing to wait for
  if (st->capture) {
    if (rec->captured != st->capture) {
      st->capture->invalidated = true;
      st->capture->why = "cudaStreamWaitEvent on an event recorded outside the capture";
      return set_error(cudaErrorStreamCaptureIsolation,
                       "cudaStreamWaitEvent in a capture on an event recorded outside it");
    }
    return cudaSuccess;  // same capture, same stream order: already ordered
  }
  if (rec->captured)
    return set_error(cudaErrorStreamCaptureUnsupported,
                     "cudaStreamWaitEvent on an event recorded in a capture (cross-stream capture is not emulated)");
  auto op = std::make_shared<Op>();
  op->name = "cudaStreamWaitEvent";
  op->waits.push_back({rec->stream, rec->seq});
  join(st->vc, rec->vc);
  return record_error(enqueue_locked(st, std::move(op)));
}

cudaError_t cudaStreamGetPriority(cudaStream_t stream, int* priority) {
  std::lock_guard<std::mutex> lock(state().m);
  if (!priority || !state().streams.count(stream)) return record_error(cudaErrorInvalidResourceHandle);
  *priority = as_stream(stream)->priority;
  return cudaSuccess;
}

// --- Events ---------------------------------------------------------------------

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (!event) return record_error(cudaErrorInvalidValue);
  if (!device_valid(tl_device)) return record_error(cudaErrorNoDevice);
  auto* e = new Event;
  e->device = tl_device;
  e->flags = flags;
  std::lock_guard<std::mutex> lock(state().m);
  state().events.insert(e);
  *event = reinterpret_cast<cudaEvent_t>(e);
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, 0); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(state().m);
  if (!state().events.erase(event)) return set_error(cudaErrorInvalidResourceHandle, "cudaEventDestroy: unknown event");
  delete as_event(event);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  const int device = device_of(stream);
  if (device < 0) return set_error(cudaErrorInvalidResourceHandle, "cudaEventRecord: unknown stream");
  if (const cudaError_t e = check_context(device)) return record_error(e);
  std::lock_guard<std::mutex> lock(state().m);
  if (!state().events.count(event)) return set_error(cudaErrorInvalidResourceHandle, "cudaEventRecord: unknown event");
  Event* ev = as_event(event);
  Stream* st = resolve_locked(stream, device);
  if (ev->device != st->device)
    return set_error(cudaErrorInvalidResourceHandle, "cudaEventRecord: event of GPU " + std::to_string(ev->device) +
                                                         " on a stream of GPU " + std::to_string(st->device));
  auto rec = std::make_shared<EventRecord>();
  rec->stream = st;
  if (st->capture) {
    rec->captured = st->capture;
    ev->rec = rec;
    return cudaSuccess;
  }
  auto op = std::make_shared<Op>();
  op->name = "cudaEventRecord";
  EventRecord* raw = rec.get();
  auto keep = rec;
  op->run = [raw, keep] { raw->time = std::chrono::duration<double>(SteadyClock::now().time_since_epoch()).count(); };
  const cudaError_t e = enqueue_locked(st, std::move(op));
  if (e != cudaSuccess) return record_error(e);
  {
    std::lock_guard<std::mutex> lock2(st->m);
    rec->seq = st->enqueued;
  }
  rec->vc = st->vc;
  ev->rec = rec;
  return cudaSuccess;
}

namespace {
// The event's current record, or an error for captured records.
cudaError_t event_record(cudaEvent_t event, std::shared_ptr<EventRecord>* out, const char* call) {
  std::lock_guard<std::mutex> lock(state().m);
  if (!state().events.count(event))
    return set_error(cudaErrorInvalidResourceHandle, std::string(call) + ": unknown event");
  *out = as_event(event)->rec;
  if (*out && (*out)->captured)
    return set_error(cudaErrorStreamCaptureUnsupported, std::string(call) + " on an event recorded in a capture");
  return cudaSuccess;
}
bool record_done(const EventRecord& r) {
  std::lock_guard<std::mutex> lock(r.stream->m);
  return r.stream->completed >= r.seq;
}
}  // namespace

cudaError_t cudaEventQuery(cudaEvent_t event) {
  std::shared_ptr<EventRecord> rec;
  if (const cudaError_t e = event_record(event, &rec, "cudaEventQuery")) return e;
  if (!rec) return cudaSuccess;
  if (!record_done(*rec)) return cudaErrorNotReady;  // not an error: not recorded as last error
  join(tl_host_vc, rec->vc);
  return record_error(check_context(rec->stream->device));
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  std::shared_ptr<EventRecord> rec;
  if (const cudaError_t e = event_record(event, &rec, "cudaEventSynchronize")) return e;
  if (const cudaError_t e = capture_guard("cudaEventSynchronize")) return e;
  if (!rec) return cudaSuccess;
  state().counters.host_syncs++;
  wait_completed(rec->stream, rec->seq);
  join(tl_host_vc, rec->vc);
  return record_error(check_context(rec->stream->device));
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (!ms) return record_error(cudaErrorInvalidValue);
  std::shared_ptr<EventRecord> a, b;
  if (const cudaError_t e = event_record(start, &a, "cudaEventElapsedTime")) return e;
  if (const cudaError_t e = event_record(end, &b, "cudaEventElapsedTime")) return e;
  {
    std::lock_guard<std::mutex> lock(state().m);
    if ((as_event(start)->flags | as_event(end)->flags) & cudaEventDisableTiming)
      return set_error(cudaErrorInvalidResourceHandle,
                       "cudaEventElapsedTime on an event created with cudaEventDisableTiming");
  }
  if (!a || !b) return set_error(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime on an event never recorded");
  if (!record_done(*a) || !record_done(*b)) return cudaErrorNotReady;
  *ms = float((b->time - a->time) * 1e3);
  return cudaSuccess;
}

// --- Capture and graphs ---------------------------------------------------------

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  std::lock_guard<std::mutex> lock(state().m);
  if (stream == nullptr || stream == cudaStreamLegacy || !state().streams.count(stream))
    return set_error(cudaErrorStreamCaptureUnsupported,
                     "cudaStreamBeginCapture needs a stream other than the legacy stream");
  Stream* st = as_stream(stream);
  if (st->capture) return set_error(cudaErrorIllegalState, "cudaStreamBeginCapture: the stream is already capturing");
  auto c = std::make_shared<Capture>();
  c->mode = mode;
  c->thread = std::this_thread::get_id();
  st->capture = c;
  tl_captures.push_back(c);
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* pGraph) {
  if (!pGraph) return record_error(cudaErrorInvalidValue);
  *pGraph = nullptr;
  std::lock_guard<std::mutex> lock(state().m);
  if (!state().streams.count(stream))
    return set_error(cudaErrorInvalidResourceHandle, "cudaStreamEndCapture: unknown stream");
  Stream* st = as_stream(stream);
  if (!st->capture) return set_error(cudaErrorIllegalState, "cudaStreamEndCapture: the stream is not capturing");
  std::shared_ptr<Capture> c = std::move(st->capture);
  st->capture.reset();
  tl_captures.erase(std::remove(tl_captures.begin(), tl_captures.end(), c), tl_captures.end());
  if (c->thread != std::this_thread::get_id() && c->mode != cudaStreamCaptureModeRelaxed)
    return set_error(cudaErrorStreamCaptureInvalidated,
                     "cudaStreamEndCapture from another thread than the one that began it");
  if (c->invalidated) return set_error(cudaErrorStreamCaptureInvalidated, "the capture was invalidated: " + c->why);
  auto* g = new Graph;
  g->ops = std::move(c->ops);
  g->device = st->device;
  state().graphs.insert(g);
  *pGraph = reinterpret_cast<cudaGraph_t>(g);
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  if (!status) return record_error(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(state().m);
  Stream* st = state().streams.count(stream) ? as_stream(stream) : nullptr;
  *status = !st || !st->capture        ? cudaStreamCaptureStatusNone
            : st->capture->invalidated ? cudaStreamCaptureStatusInvalidated
                                       : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  std::lock_guard<std::mutex> lock(state().m);
  if (!state().graphs.erase(graph)) return set_error(cudaErrorInvalidResourceHandle, "cudaGraphDestroy: unknown graph");
  delete reinterpret_cast<Graph*>(graph);
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* pGraphExec, cudaGraph_t graph, unsigned long long) {
  if (!pGraphExec) return record_error(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(state().m);
  if (!state().graphs.count(graph))
    return set_error(cudaErrorInvalidResourceHandle, "cudaGraphInstantiate: unknown graph");
  auto* exec = new Graph(*reinterpret_cast<Graph*>(graph));
  state().execs.insert(exec);
  *pGraphExec = reinterpret_cast<cudaGraphExec_t>(exec);
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  std::lock_guard<std::mutex> lock(state().m);
  if (!state().execs.erase(exec))
    return set_error(cudaErrorInvalidResourceHandle, "cudaGraphExecDestroy: unknown graph");
  delete reinterpret_cast<Graph*>(exec);
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  const int device = device_of(stream);
  if (device < 0) return set_error(cudaErrorInvalidResourceHandle, "cudaGraphLaunch: unknown stream");
  if (const cudaError_t e = check_context(device)) return record_error(e);
  std::lock_guard<std::mutex> lock(state().m);
  if (!state().execs.count(exec))
    return set_error(cudaErrorInvalidResourceHandle, "cudaGraphLaunch: unknown or destroyed graph");
  const Graph* g = reinterpret_cast<const Graph*>(exec);
  Stream* st = resolve_locked(stream, device);
  if (st->capture)
    return set_error(cudaErrorStreamCaptureUnsupported, "cudaGraphLaunch into a capture is not emulated");
  if (g->device != st->device) return set_error(cudaErrorInvalidValue, "cudaGraphLaunch on another GPU's stream");
  state().counters.graph_launches++;
  for (const auto& templ : g->ops) {
    auto op = std::make_shared<Op>();
    op->name = "graph: " + templ->name;
    op->kind = templ->kind;
    op->run = templ->run;
    if (const cudaError_t e = enqueue_locked(st, std::move(op))) return record_error(e);
  }
  return cudaSuccess;
}

}  // extern "C"
