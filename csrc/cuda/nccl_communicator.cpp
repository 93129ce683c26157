// NCCL communicator implementation (see nccl_communicator.h).
#include "nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <sstream>
#include <thread>

#include "../core/errors.h"
#include "cuda_backend.h"
#include "cuda_check.h"

namespace mgpu {

namespace {

[[noreturn]] void throw_nccl(ncclResult_t rc, ncclComm_t comm, const char* call, const char* file, int line) {
  const char* last = ncclGetLastError(comm);
  throw CommError(detail::concat(call, " failed: ", ncclGetErrorString(rc),
                                 last && *last ? std::string(" (") + last + ")" : std::string(), " (", file, ":",
                                 line, ")"));
}

#define MGPU_NCCL_CHECK(comm, call)                                                  \
  do {                                                                               \
    const ncclResult_t mgpu_rc_ = (call);                                            \
    if (mgpu_rc_ != ncclSuccess && mgpu_rc_ != ncclInProgress)                       \
      throw_nccl(mgpu_rc_, comm, #call, __FILE__, __LINE__);                         \
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

struct Pending {
  void* data;
  size_t count;
  ncclDataType_t type;
};

}  // namespace

struct NcclCommunicator::Impl {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 1, device = 0;
  cudaStream_t comm_stream = nullptr;
  std::shared_ptr<CudaBackend> backend;  // attached; keeps `compute` valid
  cudaStream_t compute = nullptr;  // attached backend's stream (none: order by device sync)
  cudaEvent_t compute_ready = nullptr, comm_done = nullptr;
  std::shared_ptr<Communicator> sidecar;
  std::vector<Pending> queued;  // enqueued by *_async, launched at progress()/wait_all()
  bool outstanding = false;     // launched since the last wait
  bool broken = false;          // aborted after a timeout or an asynchronous error
  float* staging = nullptr;     // device copy of host buffers (grows, never shrinks)
  size_t staging_capacity = 0;

  void activate() const { MGPU_CUDA_CHECK(cudaSetDevice(device)); }

  void ensure_usable() const {
    MGPU_CHECK(!broken, CommError,
               "the NCCL communicator was aborted after an earlier timeout or error; restart the job");
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

  void launch(const std::vector<Pending>& ops) {
    if (ops.empty()) return;
    order_after_compute();
    MGPU_NCCL_CHECK(comm, ncclGroupStart());
    // A failed call inside the group must still close it: an open group would
    // silently defer every later NCCL call of this thread.
    struct GroupEnd {
      bool armed = true;
      ~GroupEnd() {
        if (armed) ncclGroupEnd();
      }
    } group_end;
    outstanding = true;
    for (const Pending& op : ops)
      MGPU_NCCL_CHECK(comm, ncclAllReduce(op.data, op.data, op.count, op.type, ncclSum, comm, comm_stream));
    group_end.armed = false;
    MGPU_NCCL_CHECK(comm, ncclGroupEnd());
  }

  // The queue is emptied before launching, and `outstanding` set before the
  // group closes: a failure half-way neither relaunches ops later (counts
  // would no longer match the peers') nor leaves launched ops unwaited.
  void flush() {
    std::vector<Pending> ops;
    ops.swap(queued);
    launch(ops);
  }

  uint64_t step = 0;  // of the last begin_step

  [[noreturn]] void fail(const std::string& what, const std::string& why) {
    broken = true;
    // Aborting ends NCCL's kernels, so the streams waiting on them drain.
    ncclCommAbort(comm);
    comm = nullptr;
    throw CommError(detail::concat(what, " at step ", step, " on rank ", rank, " (GPU ", device, "): ", why));
  }

  std::string missing_ranks_text(double silence) {
    if (!sidecar) return "no heartbeat sidecar, so the missing ranks are unknown";
    return sidecar->diagnose_stall(silence);
  }

  void check_async_error(const char* what) {
    ncclResult_t state = ncclSuccess;
    MGPU_NCCL_CHECK(comm, ncclCommGetAsyncError(comm, &state));
    if (state != ncclSuccess && state != ncclInProgress) {
      const char* last = ncclGetLastError(comm);
      fail(what, detail::concat("NCCL reported an asynchronous error: ", ncclGetErrorString(state),
                                last && *last ? std::string(" (") + last + ")" : std::string(), "; ",
                                missing_ranks_text(1e300)));
    }
  }

  // Completes everything launched; the compute stream waits for it. With
  // timeout_seconds > 0 the host waits too, against the deadline.
  void wait(const char* what, double timeout_seconds, bool host_wait) {
    flush();
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
        sidecar->heartbeat();
        next_beat = clock::now() + beat_interval;
      }
      if (clock::now() > deadline)
        fail(what, detail::concat("did not complete within ", timeout_seconds, " s: ",
                                  missing_ranks_text(2.5 * beat_interval.count())));
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

  // Streams and events of a freshly initialised comm; destroys the comm if that fails.
  void create_streams() {
    try {
      activate();
      int low = 0, high = 0;
      MGPU_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&low, &high));
      // Higher priority than compute: bucket reductions should not queue behind backward kernels.
      MGPU_CUDA_CHECK(cudaStreamCreateWithPriority(&comm_stream, cudaStreamNonBlocking, high));
      MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&compute_ready, cudaEventDisableTiming));
      MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&comm_done, cudaEventDisableTiming));
    } catch (...) {
      ncclCommDestroy(comm);
      comm = nullptr;
      if (comm_stream) cudaStreamDestroy(comm_stream);
      if (compute_ready) cudaEventDestroy(compute_ready);
      comm_stream = nullptr;
      compute_ready = nullptr;
      throw;
    }
  }

  float* stage(size_t count) {
    if (staging_capacity < count) {
      MGPU_CUDA_CHECK(cudaStreamSynchronize(comm_stream));
      MGPU_CUDA_CHECK(cudaFree(staging));
      staging = nullptr;
      staging_capacity = 0;
      MGPU_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&staging), count * sizeof(float)));
      staging_capacity = count;
    }
    return staging;
  }
};

NcclCommunicator::NcclCommunicator(const std::string& unique_id, int rank, int size, int device_index,
                                   std::shared_ptr<Communicator> sidecar)
    : impl_(std::make_unique<Impl>()) {
  MGPU_CHECK(unique_id.size() == NCCL_UNIQUE_ID_BYTES, ConfigError, "an NCCL unique id has ",
             NCCL_UNIQUE_ID_BYTES, " bytes, got ", unique_id.size());
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
  s.activate();
  ncclUniqueId id;
  std::copy(unique_id.begin(), unique_id.end(), id.internal);
  MGPU_NCCL_CHECK(nullptr, ncclCommInitRank(&s.comm, size, id, rank));
  s.create_streams();
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::vector<std::shared_ptr<NcclCommunicator>> NcclCommunicator::init_all(const std::vector<int>& devices) {
  const int n = static_cast<int>(devices.size());
  MGPU_CHECK(n >= 1, ConfigError, "init_all needs at least one device");
  for (int d : devices) check_device(d);
  std::vector<ncclComm_t> comms(n, nullptr);
  MGPU_NCCL_CHECK(nullptr, ncclCommInitAll(comms.data(), n, devices.data()));
  std::vector<std::shared_ptr<NcclCommunicator>> out;
  int adopted = 0;
  try {
    for (; adopted < n; ++adopted) {
      auto impl = std::make_unique<Impl>();
      impl->comm = comms[adopted];
      impl->rank = adopted;
      impl->size = n;
      impl->device = devices[adopted];
      comms[adopted] = nullptr;  // owned by impl from here (create_streams destroys it on failure)
      impl->create_streams();
      out.push_back(std::shared_ptr<NcclCommunicator>(new NcclCommunicator(std::move(impl))));
    }
  } catch (...) {
    for (int i = adopted + 1; i < n; ++i)
      if (comms[i]) ncclCommDestroy(comms[i]);
    throw;  // the communicators already made destroy theirs
  }
  return out;
}

NcclCommunicator::~NcclCommunicator() {
  Impl& s = *impl_;
  cudaSetDevice(s.device);
  if (!s.broken && s.comm) {
    // Queued but never launched buckets are dropped. A collective still running
    // may wait for a peer that is gone (an error unwound the step): abort it
    // rather than wait forever in a destructor.
    const cudaError_t idle = s.comm_stream ? cudaStreamQuery(s.comm_stream) : cudaSuccess;
    cudaGetLastError();
    if (idle == cudaSuccess)
      ncclCommDestroy(s.comm);
    else
      ncclCommAbort(s.comm);
  }
  if (s.comm_stream) cudaStreamSynchronize(s.comm_stream);
  cudaFree(s.staging);
  if (s.compute_ready) cudaEventDestroy(s.compute_ready);
  if (s.comm_done) cudaEventDestroy(s.comm_done);
  if (s.comm_stream) cudaStreamDestroy(s.comm_stream);
  cudaGetLastError();
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
  impl_->step = step;
  if (impl_->sidecar) impl_->sidecar->begin_step(step);
}

std::vector<int> NcclCommunicator::missing_peers() {
  return impl_->sidecar ? impl_->sidecar->missing_peers() : std::vector<int>{};
}

// Heartbeats travel through the sidecar, so peers can tell this rank waiting
// in a control-plane collective from a frozen one.
void NcclCommunicator::heartbeat() {
  if (impl_->sidecar) impl_->sidecar->heartbeat();
}

std::string NcclCommunicator::diagnose_stall(double silence) {
  return impl_->sidecar ? impl_->sidecar->diagnose_stall(silence) : Communicator::diagnose_stall(silence);
}

void NcclCommunicator::allreduce_sum_async(float* data, size_t count) {
  Impl& s = *impl_;
  s.ensure_usable();
  if (!count) return;
  if (!is_device_pointer(data)) {
    allreduce_sum(data, count);  // host memory: staged, synchronous
    return;
  }
  s.queued.push_back({data, count, ncclFloat32});
}

void NcclCommunicator::allreduce_sum_bf16_async(void* data, size_t count) {
  Impl& s = *impl_;
  s.ensure_usable();
  MGPU_CHECK(!count || is_device_pointer(data), ConfigError, "bf16 allreduce needs device memory");
  if (count) s.queued.push_back({data, count, ncclBfloat16});
}

void NcclCommunicator::allreduce_sum_fp16_async(void* data, size_t count) {
  Impl& s = *impl_;
  s.ensure_usable();
  MGPU_CHECK(!count || is_device_pointer(data), ConfigError, "fp16 allreduce needs device memory");
  if (count) s.queued.push_back({data, count, ncclFloat16});
}

void NcclCommunicator::progress() {
  Impl& s = *impl_;
  if (s.broken || s.queued.empty()) return;
  s.activate();
  s.flush();
}

void NcclCommunicator::wait_all() {
  Impl& s = *impl_;
  s.ensure_usable();
  s.activate();
  s.wait("allreduce", timeout_seconds_, false);
}

void NcclCommunicator::allreduce_sum(float* data, size_t count) {
  Impl& s = *impl_;
  s.ensure_usable();
  if (!count) return;
  s.activate();
  if (is_device_pointer(data)) {
    s.queued.push_back({data, count, ncclFloat32});
    s.wait("allreduce", timeout_seconds_, false);
    return;
  }
  // Earlier collectives first, against the deadline: the pageable copy below
  // would otherwise block the host behind them with no timeout at all.
  s.wait("allreduce", timeout_seconds_, true);
  float* dev = s.stage(count);
  MGPU_CUDA_CHECK(cudaMemcpyAsync(dev, data, count * sizeof(float), cudaMemcpyHostToDevice, s.comm_stream));
  MGPU_NCCL_CHECK(s.comm, ncclAllReduce(dev, dev, count, ncclFloat32, ncclSum, s.comm, s.comm_stream));
  s.outstanding = true;
  s.wait("allreduce", timeout_seconds_, true);
  s.copy_back(data, dev, count);
}

void NcclCommunicator::broadcast(float* data, size_t count, int root) {
  Impl& s = *impl_;
  s.ensure_usable();
  MGPU_CHECK(root >= 0 && root < s.size, CommError, "broadcast root ", root, " outside [0, ", s.size, ")");
  if (!count) return;
  s.activate();
  const bool device = is_device_pointer(data);
  if (device)
    s.flush();
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
  s.outstanding = true;
  s.wait("broadcast", timeout_seconds_, !device);
  if (!device) s.copy_back(data, buf, count);
}

void NcclCommunicator::barrier() {
  Impl& s = *impl_;
  s.ensure_usable();
  s.activate();
  s.flush();
  // NCCL has no barrier: a one-element allreduce every rank must join, waited on from the host.
  float* one = s.stage(1);
  MGPU_CUDA_CHECK(cudaMemsetAsync(one, 0, sizeof(float), s.comm_stream));
  MGPU_NCCL_CHECK(s.comm, ncclAllReduce(one, one, 1, ncclFloat32, ncclSum, s.comm, s.comm_stream));
  s.outstanding = true;
  s.wait("barrier", timeout_seconds_, true);
}

}  // namespace mgpu
