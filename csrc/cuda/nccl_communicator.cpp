// NCCL communicator implementation (see nccl_communicator.h).
#include "nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <sstream>
#include <thread>

#include "../../kernels/cuda_check.cuh"
#include "../core/errors.h"
#include "../core/thread_sidecar.h"
#include "cuda_backend.h"

namespace mgpu {

namespace {

// How errors name a rank's GPU: the emulation's are never mistakable for real ones.
#ifdef MGPU_GPU_EMULATION
constexpr const char* kGpuWord = " (emulated GPU ";
#else
constexpr const char* kGpuWord = " (GPU ";
#endif

[[noreturn]] void throw_nccl(ncclResult_t rc, ncclComm_t comm, const char* call, const char* file, int line) {
  const char* last = ncclGetLastError(comm);
  throw CommError(detail::concat(call, " failed: ", ncclGetErrorString(rc),
                                 last && *last ? std::string(" (") + last + ")" : std::string(), " (", file, ":", line,
                                 ")"));
}

#define MGPU_NCCL_CHECK(comm, call)                                                                                   \
  do {                                                                                                                \
    const ncclResult_t mgpu_rc_ = (call);                                                                             \
    if (mgpu_rc_ != ncclSuccess && mgpu_rc_ != ncclInProgress) throw_nccl(mgpu_rc_, comm, #call, __FILE__, __LINE__); \
  } while (0)

bool is_device_pointer(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

// DeviceError unless device_index names a GPU this process sees.
void check_device(int device_index) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) {
    cudaGetLastError();
    gpus = 0;
  }
  MGPU_CHECK(gpus > 0, DeviceError, "no CUDA GPU is visible to this process: the NCCL communicator needs one");
  MGPU_CHECK(device_index >= 0 && device_index < gpus, DeviceError, "device index ", device_index,
             " out of range: ", gpus, " GPU", gpus == 1 ? "" : "s", " visible");
}

// Opens each GPU's default stream-ordered pool (where the backend's arrays
// live) to the other GPUs of the list that can reach it: NCCL within one
// process reads and writes peers' buffers directly ("P2P/direct pointer"),
// which pool memory allows only when granted (openxla/xla#14891).
void grant_peer_pool_access(const std::vector<int>& devices) {
  for (int owner : devices) {
    cudaMemPool_t pool = nullptr;
    MGPU_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, owner));
    std::vector<cudaMemAccessDesc> access;
    for (int peer : devices) {
      int reachable = 0;
      if (peer == owner) continue;
      MGPU_CUDA_CHECK(cudaDeviceCanAccessPeer(&reachable, peer, owner));
      if (!reachable) continue;  // NCCL goes through host memory then, never the pointer
      cudaMemAccessDesc d{};
      d.location.type = cudaMemLocationTypeDevice;
      d.location.id = peer;
      d.flags = cudaMemAccessFlagsProtReadWrite;
      access.push_back(d);
    }
    if (!access.empty()) MGPU_CUDA_CHECK(cudaMemPoolSetAccess(pool, access.data(), access.size()));
  }
}

// One queued collective, in place: an allreduce of `count` elements, or a
// reduce-scatter / all-gather of the `count` elements cut into `parts` (one
// per rank), issued as one NCCL call per nonzero part.
struct Pending {
  enum Kind { kAllReduce, kReduceScatter, kAllGather } kind;
  void* data;
  size_t count;
  ncclDataType_t type;
  std::vector<size_t> parts;  // reduce-scatter and all-gather only
};

const char* name_of(Pending::Kind kind) {
  switch (kind) {
    case Pending::kReduceScatter: return "reduce-scatter";
    case Pending::kAllGather: return "all-gather";
    default: return "allreduce";
  }
}

// float32, or a half type (bf16, fp16): the types the communicator reduces.
size_t element_bytes(ncclDataType_t type) { return type == ncclFloat32 ? sizeof(float) : 2; }

}  // namespace

struct NcclCommunicator::Impl {
  ncclComm_t comm = nullptr;  // owned: closed, or aborted by ~Impl
  int rank = 0, size = 1, device = 0;
  cudaStream_t comm_stream = nullptr;
  std::shared_ptr<CudaBackend> backend;  // attached; keeps `compute` valid
  cudaStream_t compute = nullptr;        // attached backend's stream (none: order by device sync)
  cudaEvent_t compute_ready = nullptr, comm_done = nullptr;
  std::shared_ptr<Communicator> sidecar;
  std::vector<Pending> queued;         // enqueued by *_async, launched at progress()/wait_all()
  bool outstanding = false;            // launched since the last wait
  std::string launched = "allreduce";  // what is outstanding, for errors: one kind's name, or "collectives"
  bool broken = false;                 // aborted after a timeout or an asynchronous error
  bool closed = false;                 // close() ended it normally
  std::string broken_why;              // what aborted it
  float* staging = nullptr;            // device copy of host buffers (grows, never shrinks)
  size_t staging_capacity = 0;
  // Collective timing (start_collective_timing, timed steps only): an origin
  // event, then one event per launched group on the communication stream,
  // read after the step's own synchronisation (no wait of their own). A
  // group's collectives share its event: NCCL runs a group as one launch.
  bool timing = false;
  std::chrono::steady_clock::time_point timing_start;
  cudaEvent_t timing_origin = nullptr;
  std::vector<cudaEvent_t> timing_events;  // pool: grows, reused step to step
  size_t groups_timed = 0;
  std::vector<double> queued_at;          // host seconds since the origin, per queued collective
  std::vector<cudaEvent_t> fence_events;  // fence(slot)'s marks on the communication stream
  std::vector<bool> fence_set;            // whether fence(slot) was ever called
  std::vector<size_t> group_of;           // per launched collective: its group's event

  // The watchdog thread (watch()) shares this state: `m` guards the comm, the
  // broken/failure state and the watch. Public methods hold it while they use
  // NCCL; the watchdog takes it to poll and to abort. Lock order: m, then sidecar_m.
  std::mutex m;
  std::mutex sidecar_m;  // the sidecar is called from both threads
  std::condition_variable watch_cv;
  std::thread watchdog;
  bool watching = false, stopping = false;
  std::chrono::steady_clock::time_point watch_start;  // of the oldest wait not yet complete
  uint64_t watch_step = 0;
  std::string watch_what;  // what the watched waits cover, as `launched`
  double watch_timeout = 0.0;
  std::string failure;            // the watchdog's CommError, thrown by raise_if_failed()
  int* failed_flag = nullptr;     // host-pinned, 1 from the first abort on (failure_flag())
  bool watchdog_may_beat = true;  // false: the sidecar's heartbeats must stay on the calling thread

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  // Whatever state construction, a failure or close() left: a live comm is
  // aborted (local; a destroy would be an intra-node collective), then the
  // streams drain and everything is freed. Errors cannot be reported here.
  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(m);
      stopping = true;
    }
    watch_cv.notify_all();
    if (watchdog.joinable()) watchdog.join();
    cudaSetDevice(device);
    if (comm) ncclCommAbort(comm);
    comm = nullptr;
    if (comm_stream) {
      if (staging) cudaFreeAsync(staging, comm_stream);
      cudaStreamSynchronize(comm_stream);
    }
    if (compute_ready) cudaEventDestroy(compute_ready);
    if (comm_done) cudaEventDestroy(comm_done);
    if (timing_origin) cudaEventDestroy(timing_origin);
    for (cudaEvent_t e : timing_events) cudaEventDestroy(e);
    for (cudaEvent_t e : fence_events) cudaEventDestroy(e);
    if (comm_stream) cudaStreamDestroy(comm_stream);
    if (failed_flag) cudaFreeHost(failed_flag);
    cudaGetLastError();
  }

  void activate() const { MGPU_CUDA_CHECK(cudaSetDevice(device)); }
  void note_queued() {
    if (timing)
      queued_at.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - timing_start).count());
  }

  void ensure_usable() const {
    MGPU_CHECK(!closed, CommError, "the NCCL communicator of rank ", rank, " was closed");
    MGPU_CHECK(!broken, CommError, "the NCCL communicator of rank ", rank, " was aborted (", broken_why,
               "); restart the job");
  }

  // Ends every NCCL kernel of this comm and waits for the stream to drain:
  // from here on the memory its collectives used may be freed or reused.
  void abort_comm(const std::string& why) {
    if (broken) return;
    flag_failure();
    broken = true;
    broken_why = why;
    queued.clear();
    outstanding = false;
    if (comm) ncclCommAbort(comm);
    comm = nullptr;
    if (comm_stream) cudaStreamSynchronize(comm_stream);
    cudaGetLastError();
  }

  // Collectives enqueued from now on start after everything the compute stream holds.
  void order_after_compute() {
    if (compute) {
      MGPU_CUDA_CHECK(cudaEventRecord(compute_ready, compute));
      MGPU_CUDA_CHECK(cudaStreamWaitEvent(comm_stream, compute_ready, 0));
    } else {
      MGPU_CUDA_CHECK(cudaDeviceSynchronize());  // no backend attached: whoever wrote the data is done
    }
  }

  void launch(const std::vector<Pending>& ops, double timeout_seconds) {
    if (ops.empty()) return;
    order_after_compute();
    issue_group(ops);
    // A non-blocking comm may queue the group's kernels on a thread of its own until it
    // settles: nothing else goes on its stream before, or the timing event would precede them.
    settle(launched.c_str(), timeout_seconds);
    if (timing) {
      if (groups_timed == timing_events.size()) {
        timing_events.push_back(nullptr);
        MGPU_CUDA_CHECK(cudaEventCreate(&timing_events.back()));  // timing: no DisableTiming flag
      }
      MGPU_CUDA_CHECK(cudaEventRecord(timing_events[groups_timed], comm_stream));
      group_of.insert(group_of.end(), ops.size(), groups_timed++);
    }
  }

  // The ops as one NCCL group on the communication stream. `outstanding` is
  // set before the group closes; a failed call inside the group still closes
  // it: an open group would silently defer every later NCCL call of this thread.
  void issue_group(const std::vector<Pending>& ops) {
    MGPU_NCCL_CHECK(comm, ncclGroupStart());
    struct GroupEnd {
      bool armed = true;
      ~GroupEnd() {
        if (armed) ncclGroupEnd();
      }
    } group_end;
    std::string what = outstanding ? launched : std::string();
    outstanding = true;
    for (const Pending& op : ops) {
      what = what.empty() || what == name_of(op.kind) ? name_of(op.kind) : "collectives";
      issue(op);
    }
    launched = what;
    group_end.armed = false;
    MGPU_NCCL_CHECK(comm, ncclGroupEnd());
  }

  // One collective's NCCL calls on the communication stream, inside the
  // caller's group. NCCL has no uneven reduce-scatter or all-gather: a part
  // is reduced to its owner (ncclReduce) or broadcast from it, in place.
  void issue(const Pending& op) {
    if (op.kind == Pending::kAllReduce) {
      MGPU_NCCL_CHECK(comm, ncclAllReduce(op.data, op.data, op.count, op.type, ncclSum, comm, comm_stream));
      return;
    }
    char* part = static_cast<char*>(op.data);
    for (int r = 0; r < size; part += op.parts[size_t(r)] * element_bytes(op.type), ++r) {
      const size_t n = op.parts[size_t(r)];
      if (!n) continue;
      if (op.kind == Pending::kReduceScatter)
        MGPU_NCCL_CHECK(comm, ncclReduce(part, part, n, op.type, ncclSum, r, comm, comm_stream));
      else
        MGPU_NCCL_CHECK(comm, ncclBroadcast(part, part, n, op.type, r, comm, comm_stream));
    }
  }

  // Queues an *_async collective (m held); nothing for an empty range.
  void enqueue(Pending op) {
    ensure_usable();
    if (!op.count) return;
    queued.push_back(std::move(op));
    note_queued();
  }

  // A reduce-scatter or all-gather that completes before returning (m held):
  // device memory queued behind what is queued and waited for, host memory staged.
  void run_now(Pending op, double timeout_seconds) {
    ensure_usable();
    if (!op.count) return;
    activate();
    if (!is_device_pointer(op.data)) {
      float* host = static_cast<float*>(op.data);
      return run_staged(std::move(op), host, timeout_seconds);
    }
    queued.push_back(std::move(op));
    wait_launched(timeout_seconds, false);
  }

  // A float32 collective of host memory, synchronous: earlier collectives
  // complete first, against the deadline (the pageable copy would otherwise
  // block the host behind them with no timeout at all); it then runs on a
  // device copy, and what it defines is copied back (a reduce-scatter: this
  // rank's part).
  void run_staged(Pending op, float* host, double timeout_seconds) {
    wait_launched(timeout_seconds, true);
    float* dev = stage(op.count);
    MGPU_CUDA_CHECK(cudaMemcpyAsync(dev, host, op.count * sizeof(float), cudaMemcpyHostToDevice, comm_stream));
    op.data = dev;
    issue_group({op});
    settle(launched.c_str(), timeout_seconds);
    wait(name_of(op.kind), timeout_seconds, true);
    size_t first = 0, count = op.count;
    if (op.kind == Pending::kReduceScatter) {
      for (int r = 0; r < rank; ++r) first += op.parts[size_t(r)];
      count = op.parts[size_t(rank)];
    }
    if (count) copy_back(host + first, dev + first, count);
  }

  // Launches what is queued, then completes everything launched, named by what it is.
  void wait_launched(double timeout_seconds, bool host_wait) {
    flush(timeout_seconds);
    const std::string what = launched;
    wait(what.c_str(), timeout_seconds, host_wait);
  }

  // A non-blocking comm's calls may return before NCCL finished them
  // (ncclInProgress: connecting at the first collective, initialising,
  // finalising); nothing else may be called on it until the state settles.
  // Polled against the deadline, with heartbeats, like wait().
  void settle(const char* what, double timeout_seconds, bool during_step = true) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    const auto beat_interval =
        std::chrono::duration<double>(timeout_seconds > 0 ? std::min(1.0, timeout_seconds / 4) : 1.0);
    auto next_beat = start + beat_interval;
    for (unsigned polls = 0;; ++polls) {
      ncclResult_t state = ncclInProgress;
      MGPU_NCCL_CHECK(comm, ncclCommGetAsyncError(comm, &state));
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        const char* last = ncclGetLastError(comm);
        fail(what,
             detail::concat("NCCL reported an error: ", ncclGetErrorString(state),
                            last && *last ? std::string(" (") + last + ")" : std::string(), "; ", ranks_at_error()),
             during_step);
      }
      const auto now = clock::now();
      if (sidecar && now > next_beat) {
        sidecar_heartbeat();
        next_beat = now + beat_interval;
      }
      if (timeout_seconds > 0 && now - start > std::chrono::duration<double>(timeout_seconds))
        fail(what,
             detail::concat("did not complete within ", timeout_seconds,
                            " s: ", missing_ranks_text(2.5 * beat_interval.count())),
             during_step);
      if (polls > 64) std::this_thread::sleep_for(std::chrono::microseconds(polls > 4096 ? 1000 : 50));
    }
  }

  // The queue is emptied before launching, and `outstanding` set before the
  // group closes: a failure half-way neither relaunches ops later (counts
  // would no longer match the peers') nor leaves launched ops unwaited.
  void flush(double timeout_seconds) {
    std::vector<Pending> ops;
    ops.swap(queued);
    launch(ops, timeout_seconds);
  }

  uint64_t step = 0;  // of the last begin_step

  [[noreturn]] void fail(const std::string& what, const std::string& why, bool during_step = true) {
    const std::string where = during_step ? detail::concat(" at step ", step) : std::string();
    const std::string message = detail::concat(what, where, " on rank ", rank, kGpuWord, device, "): ", why);
    abort_comm(message);
    throw CommError(message);
  }

  std::string missing_ranks_text(double silence) {
    if (!sidecar) return "no heartbeat sidecar, so the missing ranks are unknown";
    std::lock_guard<std::mutex> lock(sidecar_m);
    return sidecar->diagnose_stall(silence);
  }

  // Beside an error NCCL reported, nothing is stuck: only who, if anyone, had not arrived.
  std::string ranks_at_error() {
    std::string text = missing_ranks_text(1e300);
    const std::string stuck = kStuckTail;
    if (text.size() >= stuck.size() && text.compare(text.size() - stuck.size(), stuck.size(), stuck) == 0)
      text.resize(text.size() - stuck.size());
    return text;
  }

  void sidecar_heartbeat() {
    if (!sidecar) return;
    std::lock_guard<std::mutex> lock(sidecar_m);
    sidecar->heartbeat();
  }

  // The step's wait (m held): the compute stream already waits for comm_done;
  // the watchdog thread keeps the deadline, so this thread never polls. The
  // newest record of comm_done completes last, so one watch covers every wait
  // since the oldest incomplete one, whose start sets the deadline.
  void watch(double timeout_seconds) {
    const bool watching_before = watching;
    if (!watching) watch_start = std::chrono::steady_clock::now();
    watching = true;
    watch_step = step;
    watch_what = watching_before && watch_what != launched ? "collectives" : launched;
    watch_timeout = timeout_seconds;
    if (!watchdog.joinable()) watchdog = std::thread([this] { watchdog_loop(); });
    watch_cv.notify_all();
  }

  // Polls with backoff (20 us to 1 ms) on its own thread, beats while the wait
  // lasts, and on expiry or an asynchronous error aborts the comm: its kernels
  // end, so the compute stream and the host's read-back move on, and
  // raise_if_failed() then throws the message kept here.
  void watchdog_loop() {
    std::unique_lock<std::mutex> lock(m);
    try {
      watch_until_stopped(lock);
    } catch (const std::exception& e) {  // an exception leaving a thread would terminate the process
      watchdog_fail(detail::concat("the watchdog failed: ", e.what()));
    } catch (...) {
      watchdog_fail("the watchdog failed");
    }
  }

  void watch_until_stopped(std::unique_lock<std::mutex>& lock) {
    using clock = std::chrono::steady_clock;
    cudaSetDevice(device);
    auto poll = std::chrono::microseconds(20);
    auto next_beat = clock::time_point::max();
    while (!stopping) {
      if (!watching) {
        watch_cv.wait(lock);
        poll = std::chrono::microseconds(20);
        next_beat = clock::time_point::max();
        continue;
      }
      ncclResult_t state = ncclSuccess;
      if (comm && ncclCommGetAsyncError(comm, &state) != ncclSuccess) state = ncclSuccess;
      if (state != ncclSuccess && state != ncclInProgress) {
        const char* last = ncclGetLastError(comm);
        watchdog_fail(detail::concat("NCCL reported an asynchronous error: ", ncclGetErrorString(state),
                                     last && *last ? std::string(" (") + last + ")" : std::string(), "; ",
                                     ranks_at_error()));
        continue;
      }
      const cudaError_t rc = cudaEventQuery(comm_done);
      if (rc == cudaSuccess) {
        watching = false;
        continue;
      }
      if (rc != cudaErrorNotReady) {
        cudaGetLastError();
        watchdog_fail(detail::concat("the communication stream failed: ", cudaGetErrorString(rc)));
        continue;
      }
      const auto now = clock::now();
      const auto beat = std::chrono::duration<double>(std::min(1.0, watch_timeout / 4));
      if (now - watch_start > std::chrono::duration<double>(watch_timeout)) {
        watchdog_fail(
            detail::concat("did not complete within ", watch_timeout, " s: ", missing_ranks_text(2.5 * beat.count())));
        continue;
      }
      if (watchdog_may_beat && sidecar && now - watch_start > beat &&
          (next_beat == clock::time_point::max() || now > next_beat)) {
        sidecar_heartbeat();
        next_beat = now + std::chrono::duration_cast<clock::duration>(beat);
      }
      watch_cv.wait_for(lock, poll);
      poll = std::min(poll * 2, std::chrono::microseconds(1000));
    }
  }

  void watchdog_fail(const std::string& why) {  // m held
    failure = detail::concat(watch_what, " at step ", watch_step, " on rank ", rank, kGpuWord, device, "): ", why);
    watching = false;
    flag_failure();  // before the abort lets the compute stream run on to the step's verdict
    broken = true;
    broken_why = failure;
    if (comm) ncclCommAbort(comm);  // ends its kernels: the streams waiting on them drain
    comm = nullptr;
  }

  void check_async_error(const char* what) {
    ncclResult_t state = ncclSuccess;
    MGPU_NCCL_CHECK(comm, ncclCommGetAsyncError(comm, &state));
    if (state != ncclSuccess && state != ncclInProgress) {
      const char* last = ncclGetLastError(comm);
      fail(what,
           detail::concat("NCCL reported an asynchronous error: ", ncclGetErrorString(state),
                          last && *last ? std::string(" (") + last + ")" : std::string(), "; ", ranks_at_error()));
    }
  }

  // Completes everything launched; the compute stream waits for it. With
  // timeout_seconds > 0 the host waits too, against the deadline.
  void wait(const char* what, double timeout_seconds, bool host_wait) {
    flush(timeout_seconds);
    if (!outstanding) return;
    MGPU_CUDA_CHECK(cudaEventRecord(comm_done, comm_stream));
    if (compute) MGPU_CUDA_CHECK(cudaStreamWaitEvent(compute, comm_done, 0));
    outstanding = false;
    if (timeout_seconds <= 0.0) {
      if (host_wait || !compute) MGPU_CUDA_CHECK(cudaEventSynchronize(comm_done));
      check_async_error(what);
      return;
    }
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + std::chrono::duration<double>(timeout_seconds);
    // While waiting, repeat the heartbeat so peers can tell a waiting rank from a frozen one.
    const auto beat_interval = std::chrono::duration<double>(std::min(1.0, timeout_seconds / 4));
    auto next_beat = clock::now() + beat_interval;
    for (unsigned polls = 0;; ++polls) {
      const cudaError_t rc = cudaEventQuery(comm_done);
      if (rc == cudaSuccess) break;
      if (rc != cudaErrorNotReady) MGPU_CUDA_CHECK(rc);
      check_async_error(what);
      if (sidecar && clock::now() > next_beat) {
        sidecar_heartbeat();
        next_beat = clock::now() + beat_interval;
      }
      if (clock::now() > deadline)
        fail(what, detail::concat("did not complete within ", timeout_seconds,
                                  " s: ", missing_ranks_text(2.5 * beat_interval.count())));
      // Short sleeps: a collective of a healthy job finishes in micro- to milliseconds.
      if (polls > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    check_async_error(what);
  }

  // After the collective completed (waited on against the deadline): a copy to
  // pageable memory blocks the host, so it must never queue behind a collective.
  void copy_back(float* host, const float* dev, size_t count) {
    MGPU_CUDA_CHECK(cudaMemcpyAsync(host, dev, count * sizeof(float), cudaMemcpyDeviceToHost, comm_stream));
    MGPU_CUDA_CHECK(cudaStreamSynchronize(comm_stream));
  }

  // Streams and events of the comm (~Impl releases them if this fails half-way).
  void flag_failure() {
    if (failed_flag) __atomic_store_n(failed_flag, 1, __ATOMIC_RELEASE);
  }

  void create_streams() {
    activate();
    MGPU_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&failed_flag), sizeof(int), cudaHostAllocPortable));
    *failed_flag = 0;
    int low = 0, high = 0;
    MGPU_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&low, &high));
    // Higher priority than compute: bucket reductions should not queue behind backward kernels.
    MGPU_CUDA_CHECK(cudaStreamCreateWithPriority(&comm_stream, cudaStreamNonBlocking, high));
    MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&compute_ready, cudaEventDisableTiming));
    MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&comm_done, cudaEventDisableTiming));
  }

  // Stream-ordered on the communication stream, as the backend's arrays (see
  // CudaBackend::allocate_bytes): no device-wide synchronisation.
  float* stage(size_t count) {
    if (staging_capacity < count) {
      if (staging) MGPU_CUDA_CHECK(cudaFreeAsync(staging, comm_stream));
      staging = nullptr;
      staging_capacity = 0;
      MGPU_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&staging), count * sizeof(float), comm_stream));
      staging_capacity = count;
    }
    return staging;
  }
};

NcclCommunicator::NcclCommunicator(const std::string& unique_id, int rank, int size, int device_index,
                                   std::shared_ptr<Communicator> sidecar, double setup_timeout)
    : impl_(std::make_unique<Impl>()) {
  MGPU_CHECK(setup_timeout >= 0.0, ConfigError, "the NCCL setup timeout must be >= 0 seconds, got ", setup_timeout);
  MGPU_CHECK(unique_id.size() == NCCL_UNIQUE_ID_BYTES, ConfigError, "an NCCL unique id has ", NCCL_UNIQUE_ID_BYTES,
             " bytes, got ", unique_id.size());
  MGPU_CHECK(size >= 1 && rank >= 0 && rank < size, ConfigError, "NCCL rank ", rank, " outside [0, ", size, ")");
  MGPU_CHECK(!sidecar || (sidecar->rank() == rank && sidecar->size() == size), ConfigError,
             "the heartbeat sidecar must span the same ranks (it is rank ", sidecar ? sidecar->rank() : -1, " of ",
             sidecar ? sidecar->size() : 0, ", NCCL rank ", rank, " of ", size, ")");
  check_device(device_index);
  Impl& s = *impl_;
  s.rank = rank;
  s.size = size;
  s.device = device_index;
  s.sidecar = std::move(sidecar);
  s.watchdog_may_beat = !s.sidecar || s.sidecar->heartbeat_from_any_thread();
  timeout_seconds_ = setup_timeout;
  s.create_streams();
  ncclUniqueId id;
  std::copy(unique_id.begin(), unique_id.end(), id.internal);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // returns at once; settle() waits for the other ranks against the deadline
  MGPU_NCCL_CHECK(nullptr, ncclCommInitRankConfig(&s.comm, size, id, rank, &config));
  s.settle("NCCL setup", setup_timeout, /*during_step=*/false);
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::vector<std::shared_ptr<NcclCommunicator>> NcclCommunicator::init_all(const std::vector<int>& devices) {
  const int n = static_cast<int>(devices.size());
  MGPU_CHECK(n >= 1, ConfigError, "init_all needs at least one device");
  for (int d : devices) check_device(d);
  grant_peer_pool_access(devices);
  std::vector<ncclComm_t> comms(n, nullptr);
  MGPU_NCCL_CHECK(nullptr, ncclCommInitAll(comms.data(), n, devices.data()));
  std::vector<std::unique_ptr<Impl>> impls;
  auto heartbeats = std::make_shared<ThreadHeartbeats>(n);  // the threads' sidecars: timeouts name the missing one
  try {
    for (int i = 0; i < n; ++i) {
      impls.push_back(std::make_unique<Impl>());
      Impl& impl = *impls.back();
      impl.rank = i;
      impl.size = n;
      impl.device = devices[i];
      impl.sidecar = std::make_shared<ThreadSidecar>(heartbeats, i);
      impl.comm = comms[i];  // owned by impl from here: ~Impl aborts it on failure
      comms[i] = nullptr;
      impl.create_streams();
    }
  } catch (...) {
    for (ncclComm_t c : comms)
      if (c) ncclCommAbort(c);
    throw;  // the Impls made so far abort theirs
  }
  std::vector<std::shared_ptr<NcclCommunicator>> out;
  for (auto& impl : impls) out.push_back(std::shared_ptr<NcclCommunicator>(new NcclCommunicator(std::move(impl))));
  return out;
}

// Not closed: ~Impl aborts (queued buckets are dropped; a collective still
// running may wait for a peer that is gone, and must not be waited for here).
NcclCommunicator::~NcclCommunicator() = default;

void NcclCommunicator::abort(const std::string& why) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.m);
  if (s.closed) return;
  cudaSetDevice(s.device);
  s.abort_comm(why);
}

void NcclCommunicator::close() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.m);
  if (s.closed) return;
  s.ensure_usable();
  s.activate();
  s.wait("close", timeout_seconds_, true);  // everything launched completes first
  MGPU_NCCL_CHECK(s.comm, ncclCommFinalize(s.comm));
  s.settle("close", timeout_seconds_, false);
  MGPU_NCCL_CHECK(s.comm, ncclCommDestroy(s.comm));
  s.comm = nullptr;
  s.closed = true;
}

int NcclCommunicator::rank() const { return impl_->rank; }
int NcclCommunicator::size() const { return impl_->size; }
int NcclCommunicator::device() const { return impl_->device; }

void NcclCommunicator::attach(const std::shared_ptr<Backend>& backend) {
  auto cuda = std::dynamic_pointer_cast<CudaBackend>(backend);
  MGPU_CHECK(cuda, ConfigError, "the NCCL communicator needs the CUDA backend (the model is on '",
             backend ? backend->name() : "none", "'); use the MPI communicator for CPU training");
  MGPU_CHECK(cuda->device() == impl_->device, ConfigError, "the model is on GPU ", cuda->device(),
             " but this rank's NCCL communicator on GPU ", impl_->device);
  impl_->backend = cuda;  // its stream must outlive our uses of it
  impl_->compute = cuda->stream();
}

void NcclCommunicator::begin_step(uint64_t step) {
  Communicator::begin_step(step);
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lock(s.m);
    s.step = step;
  }
  if (s.sidecar) {
    std::lock_guard<std::mutex> lock(s.sidecar_m);
    s.sidecar->begin_step(step);
  }
}

std::vector<int> NcclCommunicator::missing_peers() {
  Impl& s = *impl_;
  if (!s.sidecar) return {};
  std::lock_guard<std::mutex> lock(s.sidecar_m);
  return s.sidecar->missing_peers();
}

// Heartbeats travel through the sidecar, so peers can tell this rank waiting
// in a control-plane collective from a frozen one.
void NcclCommunicator::heartbeat() { impl_->sidecar_heartbeat(); }

std::string NcclCommunicator::diagnose_stall(double silence) {
  return impl_->sidecar ? impl_->missing_ranks_text(silence) : Communicator::diagnose_stall(silence);
}

void NcclCommunicator::allreduce_sum_async(float* data, size_t count) {
  Impl& s = *impl_;
  if (count && !is_device_pointer(data)) {
    allreduce_sum(data, count);  // host memory: staged, synchronous
    return;
  }
  std::lock_guard<std::mutex> lock(s.m);
  s.enqueue({Pending::kAllReduce, data, count, ncclFloat32, {}});
}

void NcclCommunicator::allreduce_sum_bf16_async(void* data, size_t count) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.m);
  s.ensure_usable();
  MGPU_CHECK(!count || is_device_pointer(data), ConfigError, "bf16 allreduce needs device memory");
  s.enqueue({Pending::kAllReduce, data, count, ncclBfloat16, {}});
}

void NcclCommunicator::allreduce_sum_fp16_async(void* data, size_t count) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.m);
  s.ensure_usable();
  MGPU_CHECK(!count || is_device_pointer(data), ConfigError, "fp16 allreduce needs device memory");
  s.enqueue({Pending::kAllReduce, data, count, ncclFloat16, {}});
}

void NcclCommunicator::reduce_scatter_sum(float* data, const std::vector<size_t>& parts) {
  Pending op{Pending::kReduceScatter, data, parts_total(parts), ncclFloat32, parts};
  std::lock_guard<std::mutex> lock(impl_->m);
  impl_->run_now(std::move(op), timeout_seconds_);
}

void NcclCommunicator::all_gather(float* data, const std::vector<size_t>& parts) {
  Pending op{Pending::kAllGather, data, parts_total(parts), ncclFloat32, parts};
  std::lock_guard<std::mutex> lock(impl_->m);
  impl_->run_now(std::move(op), timeout_seconds_);
}

void NcclCommunicator::reduce_scatter_sum_async(float* data, const std::vector<size_t>& parts) {
  const size_t total = parts_total(parts);
  if (total && !is_device_pointer(data)) return reduce_scatter_sum(data, parts);  // host memory: staged, synchronous
  std::lock_guard<std::mutex> lock(impl_->m);
  impl_->enqueue({Pending::kReduceScatter, data, total, ncclFloat32, parts});
}

void NcclCommunicator::all_gather_async(float* data, const std::vector<size_t>& parts) {
  const size_t total = parts_total(parts);
  if (total && !is_device_pointer(data)) return all_gather(data, parts);  // host memory: staged, synchronous
  std::lock_guard<std::mutex> lock(impl_->m);
  impl_->enqueue({Pending::kAllGather, data, total, ncclFloat32, parts});
}

void NcclCommunicator::reduce_scatter_sum_bf16_async(void* data, const std::vector<size_t>& parts) {
  const size_t total = parts_total(parts);
  std::lock_guard<std::mutex> lock(impl_->m);
  impl_->ensure_usable();
  MGPU_CHECK(!total || is_device_pointer(data), ConfigError, "bf16 reduce-scatter needs device memory");
  impl_->enqueue({Pending::kReduceScatter, data, total, ncclBfloat16, parts});
}

void NcclCommunicator::reduce_scatter_sum_fp16_async(void* data, const std::vector<size_t>& parts) {
  const size_t total = parts_total(parts);
  std::lock_guard<std::mutex> lock(impl_->m);
  impl_->ensure_usable();
  MGPU_CHECK(!total || is_device_pointer(data), ConfigError, "fp16 reduce-scatter needs device memory");
  impl_->enqueue({Pending::kReduceScatter, data, total, ncclFloat16, parts});
}

void NcclCommunicator::progress() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.m);
  if (s.broken || s.closed || s.queued.empty()) return;
  s.activate();
  s.flush(timeout_seconds_);
}

void NcclCommunicator::wait_all() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.m);
  s.ensure_usable();
  s.activate();
  if (timeout_seconds_ <= 0.0 || !s.compute || !s.watchdog_may_beat) {
    s.wait_launched(timeout_seconds_, false);  // no deadline, or one this thread keeps
    return;
  }
  s.flush(timeout_seconds_);
  if (!s.outstanding) return;
  MGPU_CUDA_CHECK(cudaEventRecord(s.comm_done, s.comm_stream));
  MGPU_CUDA_CHECK(cudaStreamWaitEvent(s.compute, s.comm_done, 0));
  s.outstanding = false;
  s.watch(timeout_seconds_);
}

void NcclCommunicator::fence(size_t slot) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.m);
  s.ensure_usable();
  s.activate();
  s.flush(timeout_seconds_);
  while (s.fence_events.size() <= slot) {
    s.fence_events.push_back(nullptr);
    s.fence_set.push_back(false);
    MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&s.fence_events.back(), cudaEventDisableTiming));
  }
  MGPU_CUDA_CHECK(cudaEventRecord(s.fence_events[slot], s.comm_stream));
  s.fence_set[slot] = true;
}

// A closed or aborted communicator's fences still order: close() completed
// everything, and an abort ends the collectives, so their events fire.
void NcclCommunicator::wait_fence(size_t slot) {
  Impl& s = *impl_;
  std::unique_lock<std::mutex> lock(s.m);
  if (s.closed) return;
  MGPU_CHECK(slot < s.fence_set.size() && s.fence_set[slot], ConfigError, "fence ", slot,
             " was never set on this communicator");
  s.activate();
  if (s.compute) {
    MGPU_CUDA_CHECK(cudaStreamWaitEvent(s.compute, s.fence_events[slot], 0));
    return;
  }
  cudaEvent_t event = s.fence_events[slot];
  lock.unlock();                                 // the watchdog takes m to abort what this waits for
  MGPU_CUDA_CHECK(cudaEventSynchronize(event));  // no backend attached: the host waits
}

void NcclCommunicator::complete_all() {
  Impl& s = *impl_;
  bool broken = false;
  {
    std::lock_guard<std::mutex> lock(s.m);
    if (s.closed) return;  // close() completed everything
    broken = s.broken;
    s.activate();
    if (!broken) s.wait_launched(timeout_seconds_, /*host_wait=*/true);  // not yet waited for: this thread's deadline
  }
  // What an earlier wait_all() handed to the watchdog ends done, or aborted by it (m not
  // held: it takes m); an aborted comm's stream drains once its kernels end.
  if (s.comm_done) MGPU_CUDA_CHECK(cudaEventSynchronize(s.comm_done));
  {
    std::lock_guard<std::mutex> lock(s.m);
    broken = s.broken;
  }
  if (broken) MGPU_CUDA_CHECK(cudaStreamSynchronize(s.comm_stream));
  raise_if_failed();
  std::lock_guard<std::mutex> lock(s.m);
  s.ensure_usable();  // aborted: what its collectives wrote is not to be trusted
}

void NcclCommunicator::start_collective_timing() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.m);
  if (s.broken || s.closed) return;
  s.activate();
  if (!s.timing_origin) MGPU_CUDA_CHECK(cudaEventCreate(&s.timing_origin));
  // Recorded on the communication stream, idle at a step's start (the previous
  // step's read-back waited for its collectives): the event's time is the host's
  // start, nearly.
  MGPU_CUDA_CHECK(cudaEventRecord(s.timing_origin, s.comm_stream));
  s.timing_start = std::chrono::steady_clock::now();
  s.timing = true;
  s.groups_timed = 0;
  s.queued_at.clear();
  s.group_of.clear();
}

std::vector<std::pair<double, double>> NcclCommunicator::collective_times() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.m);
  if (!s.timing) return {};
  s.timing = false;
  // Collectives of host memory ran staged and synchronously, without events: unknown.
  if (s.broken || s.group_of.size() != s.queued_at.size()) return {};
  s.activate();
  std::vector<double> group_done(s.groups_timed);
  for (size_t g = 0; g < s.groups_timed; ++g) {
    float ms = 0.0f;
    // Complete by now: the caller read the step's results back after the compute stream waited for them.
    MGPU_CUDA_CHECK(cudaEventElapsedTime(&ms, s.timing_origin, s.timing_events[g]));
    group_done[g] = ms * 1e-3;
  }
  std::vector<std::pair<double, double>> out;
  out.reserve(s.queued_at.size());
  for (size_t i = 0; i < s.queued_at.size(); ++i) out.emplace_back(s.queued_at[i], group_done[s.group_of[i]]);
  return out;
}

const int* NcclCommunicator::failure_flag() const { return impl_->failed_flag; }

void NcclCommunicator::raise_if_failed() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.m);
  if (s.failure.empty()) return;
  std::string message;
  message.swap(s.failure);
  throw CommError(message);
}

void NcclCommunicator::allreduce_sum(float* data, size_t count) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.m);
  s.ensure_usable();
  if (!count) return;
  s.activate();
  if (is_device_pointer(data)) {
    s.queued.push_back({Pending::kAllReduce, data, count, ncclFloat32, {}});
    s.wait_launched(timeout_seconds_, false);
    return;
  }
  // Earlier collectives first, against the deadline: the pageable copy below
  // would otherwise block the host behind them with no timeout at all.
  s.wait_launched(timeout_seconds_, true);
  float* dev = s.stage(count);
  MGPU_CUDA_CHECK(cudaMemcpyAsync(dev, data, count * sizeof(float), cudaMemcpyHostToDevice, s.comm_stream));
  MGPU_NCCL_CHECK(s.comm, ncclAllReduce(dev, dev, count, ncclFloat32, ncclSum, s.comm, s.comm_stream));
  s.settle("allreduce", timeout_seconds_);
  s.outstanding = true;
  s.wait("allreduce", timeout_seconds_, true);
  s.copy_back(data, dev, count);
}

void NcclCommunicator::broadcast(float* data, size_t count, int root) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.m);
  s.ensure_usable();
  MGPU_CHECK(root >= 0 && root < s.size, CommError, "broadcast root ", root, " outside [0, ", s.size, ")");
  if (!count) return;
  s.activate();
  const bool device = is_device_pointer(data);
  if (device)
    s.flush(timeout_seconds_);
  else
    s.wait("broadcast", timeout_seconds_, true);  // as in allreduce_sum: no pageable copy behind them
  float* buf = data;
  if (device) {
    s.order_after_compute();
  } else {
    buf = s.stage(count);
    MGPU_CUDA_CHECK(cudaMemcpyAsync(buf, data, count * sizeof(float), cudaMemcpyHostToDevice, s.comm_stream));
  }
  MGPU_NCCL_CHECK(s.comm, ncclBroadcast(buf, buf, count, ncclFloat32, root, s.comm, s.comm_stream));
  s.settle("broadcast", timeout_seconds_);
  s.outstanding = true;
  s.wait("broadcast", timeout_seconds_, !device);
  if (!device) s.copy_back(data, buf, count);
}

void NcclCommunicator::barrier() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.m);
  s.ensure_usable();
  s.activate();
  s.flush(timeout_seconds_);
  // NCCL has no barrier: a one-element allreduce every rank must join, waited on from the host.
  float* one = s.stage(1);
  MGPU_CUDA_CHECK(cudaMemsetAsync(one, 0, sizeof(float), s.comm_stream));
  MGPU_NCCL_CHECK(s.comm, ncclAllReduce(one, one, 1, ncclFloat32, ncclSum, s.comm, s.comm_stream));
  s.settle("barrier", timeout_seconds_);
  s.outstanding = true;
  s.wait("barrier", timeout_seconds_, true);
}

}  // namespace mgpu
