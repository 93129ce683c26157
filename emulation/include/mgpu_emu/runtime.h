// Internals of the emulated CUDA runtime shared by its parts (runtime.cpp,
// kernel_exec.cpp, the cuBLAS and NCCL stand-ins): asynchronous streams whose
// operations record the memory they touch, the allocation registry, the
// happens-before checker, sticky errors, counters. Not for mgpu's own sources:
// those see only NVIDIA's prototypes.
#pragma once
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace mgpu_emu {

// Thrown inside an operation (kernel, copy, GEMM, collective) that breaks a
// rule: the device's context gets the sticky error `code`, the message is kept
// as a violation and shown by cudaGetErrorString.
struct Fault : std::runtime_error {
  Fault(cudaError_t c, const std::string& what) : std::runtime_error(what), code(c) {}
  cudaError_t code;
};

// Enqueues `run` on `stream` (or records it into the stream's capture).
// `name` names the operation in reports. Returns the API's error code.
enum class OpKind { kKernel, kCopy, kMemset, kBlas, kCollective, kOther };
cudaError_t enqueue(cudaStream_t stream, const std::string& name, OpKind kind, std::function<void()> run);

// Inside a running operation: declares that it reads or writes [p, p + bytes).
// Throws Fault unless the range is live device memory of the operation's
// device (or pinned host memory when allow_pinned).
void touch(const void* p, size_t bytes, bool write, bool allow_pinned = true);
// The same check from the host at API time (argument validation): "" when fine, else why not.
std::string check_device_range(const void* p, size_t bytes, int device, bool allow_pinned);
// True when p lies in a live emulated device allocation (of any device).
bool is_device_pointer(const void* p);
int device_of(cudaStream_t stream);
int current_device();
bool device_valid(int device);
// The sticky error of a device's context (cudaSuccess when healthy).
cudaError_t sticky_error(int device);
// A rule violation found outside an operation (a stand-in's check): kept and printed.
void report_violation(int device, cudaError_t code, const std::string& what);
// Sets the calling thread's last error with a detail shown by cudaGetErrorString.
cudaError_t set_error(cudaError_t code, const std::string& detail);
// Called by thread-local-capture-unsafe API calls: cudaErrorStreamCaptureUnsupported
// (and the capture invalidated) when this thread is capturing, else cudaSuccess.
cudaError_t capture_guard(const char* call);
bool stream_is_capturing(cudaStream_t stream);

struct Counters {
  std::atomic<uint64_t> kernel_launches{0}, graph_launches{0}, host_syncs{0}, allocations{0}, frees{0}, h2d_bytes{0},
      d2h_bytes{0}, d2d_bytes{0}, blas_calls{0}, collectives{0}, kernels_executed{0},
      // cudaMemcpyAsync host -> device from pageable memory: "the driver may synchronize
      // with the stream" to stage it (CUDA runtime API, API synchronization behavior),
      // so each is a possible host synchronisation that host_syncs cannot count.
      pageable_h2d_copies{0};
};
Counters& counters();
// Rule violations seen so far (races, out-of-bounds, use after free, divergence, mismatched collectives).
std::vector<std::string> violations();
void clear_violations();
// Live allocations as text, one per line (leak checks).
std::vector<std::string> live_allocations();
int emulated_device_count();
size_t device_memory_limit(int device);

// Collectives of single-process multi-GPU communicators (ncclCommInitAll) that
// are queued or running. On a GPU, cudaMalloc, cudaFree and cudaFreeHost can
// synchronise the device and its peer-enabled GPUs; called while a collective
// of such a communicator waits for this thread's GPU to launch its part, they
// deadlock (NVIDIA/nccl#48, pytorch/pytorch#50925). The emulation would not
// hang, so it reports the call as a violation instead.
void in_process_collective_queued();
void in_process_collective_done();
// NCCL within one process reads and writes peer GPUs' buffers directly
// ("P2P/direct pointer"); memory of a stream-ordered pool (cudaMallocAsync) is
// accessible to other GPUs only after cudaMemPoolSetAccess (openxla/xla#14891).
// "" when GPU `peer` may access [p, p + bytes), else why not.
std::string check_peer_access(const void* p, size_t bytes, int peer);

// Fault injection for tests of error paths: the nth launch from now (1-based)
// of a kernel whose name contains `kernel`, on `device` (-1: any), fails with
// cudaErrorLaunchOutOfResources. nth 0 disarms.
void inject_launch_failure(const std::string& kernel, int device, long nth);

// Kernel execution hook (kernel_exec.cpp): runs the grid of one launch.
void run_grid(const std::string& name, const std::function<void()>& body, dim3 grid, dim3 block, size_t shared_bytes);

// Access recording used by the instrumentation hooks (kernel_exec.cpp).
struct Allocation;
struct AccessLog;
AccessLog* current_access_log();
void log_access(AccessLog* log, uintptr_t p, size_t bytes, bool write, const char* kernel);

}  // namespace mgpu_emu
