// CUDA backend implementation (see cuda_backend.h). Row-major matrices meet
// column-major cuBLAS through the identity (row-major X) = (column-major X^T):
// the row-major product C = A B^T is computed as column-major C^T = B A^T, so
// every GEMM below swaps its operands instead of transposing any data.
#include "cuda_backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "../../kernels/cuda_check.cuh"
#include "../../kernels/kernels.cuh"

namespace mgpu {

namespace {
// cuBLAS's recommended workspace on Hopper; set once so cuBLAS never allocates
// inside a step.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

// Whether p is ordinary (pageable) host memory: a copy from it is staged by the
// driver before cudaMemcpyAsync returns, and a copy to it returns once done
// (CUDA's "API synchronization behavior"), so neither needs a stream sync of ours.
bool pageable(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;  // unknown: synchronise to be safe
  }
  return attr.type == cudaMemoryTypeUnregistered;
}
}  // namespace

CudaBackend::CudaBackend(int device_index) : device_(device_index) {
  const char* reuse = std::getenv("MGPU_CUDA_HALF_OPERANDS");
  reuse_half_operands_ = !(reuse && std::string(reuse) == "0");
  try {
    activate();
    MGPU_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MGPU_CUBLAS_CHECK(cublasCreate(&cublas_));
    MGPU_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
    MGPU_CUDA_CHECK(cudaMalloc(&cublas_workspace_, kCublasWorkspaceBytes));
    MGPU_CUBLAS_CHECK(cublasSetWorkspace(cublas_, cublas_workspace_, kCublasWorkspaceBytes));
    MGPU_CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
    MGPU_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&partials_), kernels::kPartialsSize * sizeof(double)));
    MGPU_CUDA_CHECK(
        cudaMalloc(reinterpret_cast<void**>(&column_partials_), kernels::kColumnPartialsSize * sizeof(float)));
    MGPU_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&sum_out_), sizeof(double)));
    MGPU_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&replay_dev_), sizeof(ReplayArgs)));
    MGPU_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&label_errors_.device), 2 * sizeof(unsigned long long)));
    MGPU_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&label_errors_.host), 3 * sizeof(unsigned long long)));
    const unsigned long long none[3] = {0, kernels::kNoLabelError, 0};
    MGPU_CUDA_CHECK(cudaMemcpyAsync(label_errors_.device, none, 2 * sizeof(none[0]), cudaMemcpyHostToDevice, stream_));
    MGPU_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::copy(none, none + 3, label_errors_.host);
  } catch (...) {
    release();
    throw;
  }
}

CudaBackend::~CudaBackend() { release(); }

void CudaBackend::release() noexcept {
  // Errors here cannot be reported (destructor); a broken context frees everything anyway.
  cudaSetDevice(device_);
  abort_capture();
  if (stream_) cudaStreamSynchronize(stream_);
  if (copy_stream_) cudaStreamSynchronize(copy_stream_);
  fences_.destroy();
  marks_.destroy();
  if (clock_stream_) cudaStreamDestroy(clock_stream_);
  clock_stream_ = nullptr;
  if (copy_stream_) cudaStreamDestroy(copy_stream_);
  copy_stream_ = nullptr;
  if (prefetch_read_) cudaEventDestroy(prefetch_read_);
  if (prefetched_) cudaEventDestroy(prefetched_);
  prefetch_read_ = prefetched_ = nullptr;
  prefetch_read_marked_ = false;
  for (PinnedArea& area : prefetch_areas_) {
    for (char* chunk : area.outgrown) cudaFreeHost(chunk);
    if (area.data) cudaFreeHost(area.data);
    if (area.done) cudaEventDestroy(area.done);
    area = PinnedArea();
  }
  prefetch_used_ = 0;
  captures_.release([](cudaGraphExec_t g) { cudaGraphExecDestroy(g); });
  if (cublas_) cublasDestroy(cublas_);
  cudaFree(cublas_workspace_);
  for (HalfOperand& h : half_operands_)
    if (h.half && stream_) cudaFreeAsync(h.half, stream_);
  half_operands_.clear();
  cudaFree(partials_);
  cudaFree(column_partials_);
  column_partials_ = nullptr;
  cudaFree(sum_out_);
  cudaFree(replay_dev_);
  replay_dev_ = nullptr;
  cudaFree(master_half_);
  master_half_ = nullptr;
  master_half_n_ = 0;
  for (char* chunk : staging_outgrown_) cudaFreeHost(chunk);
  staging_outgrown_.clear();
  if (staging_) cudaFreeHost(staging_);
  staging_ = nullptr;
  staging_capacity_ = staging_used_ = 0;
  cudaFree(label_errors_.device);
  if (label_errors_.host) cudaFreeHost(label_errors_.host);
  label_errors_ = kernels::LabelErrors();
  for (void* p : half_)
    if (p && stream_) cudaFreeAsync(p, stream_);  // stream-ordered allocations (gemm_input)
  if (stream_) cudaStreamSynchronize(stream_);
  if (stream_) cudaStreamDestroy(stream_);
  cublas_ = nullptr;
  stream_ = nullptr;
  cublas_workspace_ = nullptr;
  partials_ = sum_out_ = nullptr;
  half_[0] = half_[1] = nullptr;
  cudaGetLastError();  // leave no sticky error behind for the next user of the device
}

void CudaBackend::activate() const { MGPU_CUDA_CHECK(cudaSetDevice(device_)); }

void CudaBackend::set_threads(int threads) {
  MGPU_CHECK(threads >= 1, ConfigError, "threads must be >= 1, got ", threads);
  threads_ = threads;
}

// Model arrays are stream-ordered (the device's default pool, on the compute
// stream): cudaMalloc and cudaFree can synchronise the device and its peers,
// which deadlocks with a collective of another thread's GPU that waits for this
// one (NVIDIA/nccl#48), and the first steps allocate while peers' allreduces run.
void* CudaBackend::allocate_bytes(size_t bytes) {
  activate();
  void* p = nullptr;
  const cudaError_t rc = cudaMallocAsync(&p, bytes, stream_);
  if (rc != cudaSuccess) {
    cudaGetLastError();
    size_t free_bytes = 0, total = 0;
    cudaMemGetInfo(&free_bytes, &total);
    cudaGetLastError();
    throw DeviceError(detail::concat("cudaMallocAsync of ", bytes, " bytes on GPU ", device_,
                                     " failed: ", cudaGetErrorString(rc), " (", free_bytes >> 20, " MiB free of ",
                                     total >> 20, " MiB)"));
  }
  allocation_bytes_[p] = bytes;
  return p;
}

void CudaBackend::free_bytes(void* ptr) noexcept {
  if (!ptr) return;
  cudaSetDevice(device_);
  if (ptr == master_) {  // the model is going: its half copy too, before the memory is reused
    master_ = nullptr;
    master_n_ = 0;
    if (master_half_) cudaFreeAsync(master_half_, stream_);
    master_half_ = nullptr;
    master_half_n_ = 0;
    master_half_stale_.clear();
  }
  free_half_operands(ptr);  // before the memory is reused
  // After everything queued on the compute stream; a collective on the array
  // was ordered before it (wait_all), or aborted when the step failed.
  cudaFreeAsync(ptr, stream_);
  cudaGetLastError();
}

void CudaBackend::copy_to_backend(void* dst, const void* host_src, size_t bytes) {
  if (!bytes) return;
  activate();
  writes(dst, bytes);
  MGPU_CHECK(!captures_.capturing(), DeviceError, "copy_to_backend synchronises: not allowed in a capture");
  MGPU_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
  // The caller may reuse host_src on return: pinned memory is read by the DMA later.
  if (!pageable(host_src)) {
    MGPU_CUDA_CHECK(cudaStreamSynchronize(stream_));
    drained();
  }
}

void CudaBackend::copy_to_host(void* host_dst, const void* src, size_t bytes) {
  if (!bytes) return;
  activate();
  MGPU_CHECK(!captures_.capturing(), DeviceError, "copy_to_host synchronises: not allowed in a capture");
  MGPU_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  // A copy to pageable memory returns once done in practice, but CUDA promises only that it
  // "might be synchronous": the stream seen idle, or waited for, before host_dst is read.
  const cudaError_t idle = pageable(host_dst) ? cudaStreamQuery(stream_) : cudaErrorNotReady;
  if (idle == cudaErrorNotReady) {
    MGPU_CUDA_CHECK(cudaStreamSynchronize(stream_));
  } else {
    MGPU_CUDA_CHECK(idle);
  }
  drained();
  raise_label_errors();
}

void CudaBackend::stage_to_backend(void* dst, const void* host_src, size_t bytes) {
  if (!bytes) return;
  activate();
  MGPU_CHECK(!captures_.capturing(), DeviceError, "stage_to_backend reads host memory: not allowed in a capture");
  writes(dst, bytes);
  constexpr size_t kAlign = 256;
  const size_t need = (bytes + kAlign - 1) / kAlign * kAlign;
  char* slot = pinned_slot(staging_, staging_capacity_, staging_outgrown_, staging_used_, need, "input staging");
  if (slot == staging_) staging_used_ = 0;  // a fresh chunk
  std::memcpy(slot, host_src, bytes);
  // Pinned source: queued, never a wait (a pageable one may make the driver wait for the stream).
  MGPU_CUDA_CHECK(cudaMemcpyAsync(dst, slot, bytes, cudaMemcpyHostToDevice, stream_));
  staging_used_ = size_t(slot - staging_) + need;
}

// The region of `need` bytes at `used` of a pinned area, which grows while the bytes
// staged between two refills grow (the first steps); a chunk outgrown may still feed
// a queued copy: kept until the backend goes.
char* CudaBackend::pinned_slot(char*& area, size_t& capacity, std::vector<char*>& outgrown, size_t used, size_t need,
                               const char* what) {
  if (used + need <= capacity) return area + used;
  const size_t grown = std::max({need, 2 * capacity, size_t{1} << 20});
  void* fresh = nullptr;
  const cudaError_t rc = cudaMallocHost(&fresh, grown);
  if (rc != cudaSuccess) {
    cudaGetLastError();
    throw DeviceError(detail::concat("cudaMallocHost of ", grown, " bytes (", what, ") for GPU ", device_,
                                     " failed: ", cudaGetErrorString(rc)));
  }
  if (area) outgrown.push_back(area);
  area = static_cast<char*>(fresh);
  capacity = grown;
  return area;
}

void CudaBackend::ensure_copy_stream() {
  if (copy_stream_) return;
  MGPU_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&prefetch_read_, cudaEventDisableTiming));
  MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&prefetched_, cudaEventDisableTiming));
  for (PinnedArea& area : prefetch_areas_)
    MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&area.done, cudaEventDisableTiming));
}

void CudaBackend::prefetch_read() {
  activate();
  MGPU_CHECK(!captures_.capturing(), DeviceError, "prefetch_read marks the compute stream: not allowed in a capture");
  ensure_copy_stream();
  MGPU_CUDA_CHECK(cudaEventRecord(prefetch_read_, stream_));
  prefetch_read_marked_ = true;
}

void CudaBackend::prefetch_to_backend(void* dst, const void* host_src, size_t bytes) {
  if (!bytes) return;
  activate();
  MGPU_CHECK(!captures_.capturing(), DeviceError, "prefetch_to_backend reads host memory: not allowed in a capture");
  ensure_copy_stream();
  if (prefetch_waited_) {  // a new batch, in the other area, once the copies that last read it are done
    prefetch_area_ ^= 1;
    const cudaError_t rc = cudaEventQuery(prefetch_areas_[prefetch_area_].done);
    if (rc == cudaErrorNotReady) {
      MGPU_CUDA_CHECK(cudaEventSynchronize(prefetch_areas_[prefetch_area_].done));
    } else {
      MGPU_CUDA_CHECK(rc);
    }
    prefetch_used_ = 0;
    prefetch_waited_ = false;
  }
  PinnedArea& area = prefetch_areas_[prefetch_area_];
  writes(dst, bytes);
  constexpr size_t kAlign = 256;
  const size_t need = (bytes + kAlign - 1) / kAlign * kAlign;
  char* slot = pinned_slot(area.data, area.capacity, area.outgrown, prefetch_used_, need, "input prefetch");
  std::memcpy(slot, host_src, bytes);
  // After the last compute work that reads dst (or allocated it); before any mark, after all so far.
  if (!prefetch_read_marked_) MGPU_CUDA_CHECK(cudaEventRecord(prefetch_read_, stream_));
  MGPU_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, prefetch_read_, 0));
  MGPU_CUDA_CHECK(cudaMemcpyAsync(dst, slot, bytes, cudaMemcpyHostToDevice, copy_stream_));
  MGPU_CUDA_CHECK(cudaEventRecord(prefetched_, copy_stream_));
  MGPU_CUDA_CHECK(cudaEventRecord(area.done, copy_stream_));
  prefetch_used_ = size_t(slot - area.data) + need;
}

void CudaBackend::wait_prefetched() {
  if (!copy_stream_) return;
  activate();
  MGPU_CUDA_CHECK(cudaStreamWaitEvent(stream_, prefetched_, 0));
  prefetch_waited_ = true;
}

void CudaBackend::copy_within_backend(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  activate();
  writes(dst, bytes);
  MGPU_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
}

void CudaBackend::zero(float* x, size_t n) {
  if (!n) return;
  activate();
  writes(x, n * sizeof(float));
  MGPU_CUDA_CHECK(cudaMemsetAsync(x, 0, n * sizeof(float), stream_));
}

void* CudaBackend::allocate_host(size_t bytes) {
  activate();
  void* ptr = nullptr;
  const cudaError_t rc = cudaMallocHost(&ptr, std::max<size_t>(bytes, 1));
  if (rc != cudaSuccess) {
    cudaGetLastError();
    throw DeviceError(detail::concat("cudaMallocHost of ", bytes, " bytes (host staging) for GPU ", device_,
                                     " failed: ", cudaGetErrorString(rc)));
  }
  return ptr;
}

void CudaBackend::free_host(void* ptr) noexcept {
  if (ptr) cudaFreeHost(ptr);  // waits for the device: nothing queued still reads or writes it
}

void CudaBackend::copy_to_host_async(void* host_dst, const void* src, size_t bytes) {
  if (!bytes) return;
  activate();
  MGPU_CHECK(!captures_.capturing(), DeviceError, "copy_to_host_async: not allowed in a capture");
  MGPU_CHECK(!pageable(host_dst), DeviceError, "copy_to_host_async needs pinned host memory (allocate_host)");
  MGPU_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
}

void CudaBackend::copy_to_backend_async(void* dst, const void* host_src, size_t bytes) {
  if (!bytes) return;
  activate();
  MGPU_CHECK(!captures_.capturing(), DeviceError, "copy_to_backend_async: not allowed in a capture");
  MGPU_CHECK(!pageable(host_src), DeviceError, "copy_to_backend_async needs pinned host memory (allocate_host)");
  writes(dst, bytes);
  MGPU_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
}

uint64_t NumberedEvents::record(cudaStream_t stream) {
  cudaEvent_t event = nullptr;
  if (!spare_.empty()) {
    event = spare_.back();
    spare_.pop_back();
  } else {
    MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&event, flags_));
  }
  // Recording again is fine while a former record is pending. Numbered first,
  // so a failed record leaves the event owned (destroy() frees it).
  const uint64_t number = events_.push(event);
  MGPU_CUDA_CHECK(cudaEventRecord(event, stream));
  return number;
}

void NumberedEvents::destroy() noexcept {
  for (cudaEvent_t e : events_.items()) cudaEventDestroy(e);
  for (cudaEvent_t e : spare_) cudaEventDestroy(e);
  events_.clear();
  spare_.clear();
}

uint64_t CudaBackend::fence() {
  activate();
  MGPU_CHECK(!captures_.capturing(), DeviceError, "fences are not allowed in a capture");
  return fences_.record(stream_);
}

bool CudaBackend::fence_passed(uint64_t fence) {
  if (fences_.forgotten(fence)) return true;  // seen passed before
  const cudaEvent_t event = fences_.find(fence);
  MGPU_CHECK(event, ConfigError, "unknown fence ", fence);
  activate();
  const cudaError_t rc = cudaEventQuery(event);
  if (rc == cudaErrorNotReady) return false;  // not a failure (nor recorded as one): not run yet
  MGPU_CUDA_CHECK(rc);
  fences_.forget_before(fence + 1);  // the stream runs in order: every earlier fence has passed too
  return true;
}

void CudaBackend::wait_fence(uint64_t fence) {
  if (fences_.forgotten(fence)) return;
  const cudaEvent_t event = fences_.find(fence);
  MGPU_CHECK(event, ConfigError, "unknown fence ", fence);
  activate();
  MGPU_CUDA_CHECK(cudaEventSynchronize(event));
  fences_.forget_before(fence + 1);
  // Label errors wait for the step's read-back: raised here, mid-collectives, they
  // would leave the ranks with different numbers of collectives started.
}

uint64_t CudaBackend::record_mark(cudaStream_t stream) {
  activate();
  MGPU_CHECK(!captures_.capturing(), DeviceError, "trace marks are not allowed in a capture");
  return marks_.record(stream);
}

uint64_t CudaBackend::trace_clock_mark() {
  activate();
  if (!clock_stream_) MGPU_CUDA_CHECK(cudaStreamCreateWithFlags(&clock_stream_, cudaStreamNonBlocking));
  return record_mark(clock_stream_);
}

double CudaBackend::trace_elapsed(uint64_t from, uint64_t to) {
  const double unknown = std::numeric_limits<double>::quiet_NaN();
  const cudaEvent_t a = marks_.find(from), b = marks_.find(to);
  if (!a || !b) return unknown;
  activate();
  float ms = 0.0f;
  const cudaError_t rc = cudaEventElapsedTime(&ms, a, b);
  if (rc == cudaErrorNotReady) return unknown;  // not a failure (nor recorded as one): not run yet
  MGPU_CUDA_CHECK(rc);
  return ms * 1e-3;
}

void CudaBackend::trace_forget(uint64_t before) { marks_.forget_before(before); }

void CudaBackend::synchronize() {
  activate();
  MGPU_CHECK(!captures_.capturing(), DeviceError, "synchronize() is not allowed in a capture");
  MGPU_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (clock_stream_) MGPU_CUDA_CHECK(cudaStreamSynchronize(clock_stream_));  // trace clock marks (event records only)
  if (copy_stream_) MGPU_CUDA_CHECK(cudaStreamSynchronize(copy_stream_));    // prefetches
  drained();
  raise_label_errors();
}

void CudaBackend::raise_label_errors() {
  unsigned long long* h = label_errors_.host;
  if (!h || h[0] == 0) return;  // a pinned read: nearly free on every synchronisation
  const unsigned long long count = h[0], first = h[1], classes = h[2];
  h[0] = 0;  // reported once; the backend stays usable
  h[1] = kernels::kNoLabelError;
  throw ConfigError(label_range_error(static_cast<long long>(first >> 32), static_cast<int32_t>(first & 0xffffffffu),
                                      static_cast<int>(classes), count));
}

void CudaBackend::set_precision(Precision precision) {
  activate();
  MGPU_CHECK(!captures_.capturing(), ConfigError, "the precision cannot change during a capture");
  release_captures();  // graphs hold the old GEMM configuration
  // Shapes seen in the old precision have not sized the new precision's
  // scratch: they must run uncaptured once more before being captured.
  if (precision != precision_) captures_.invalidate();
  // TF32 only when asked: fp32 GEMMs stay IEEE fp32 so results match the CPU backend.
  MGPU_CUBLAS_CHECK(
      cublasSetMathMode(cublas_, precision == Precision::kTF32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  precision_ = precision;
  stale_all_half_operands();  // of the old half type
  size_master_half();
}

const void* CudaBackend::gemm_input(int slot, const float* src, size_t n) {
  if (precision_ == Precision::kFP32 || precision_ == Precision::kTF32) return src;
  if (const void* weights = master_half_view(src, n)) return weights;
  if (HalfOperand* h = reuse_half_operands_ ? half_operand(src, n) : nullptr) {
    if (h->valid != n) {  // not produced with its values: cast once, for every GEMM that reads it
      cast_half(h->half, src, n);
      h->valid = n;
    }
    return h->half;
  }
  if (half_capacity_[slot] < n) {
    // Grows only while shapes grow (the first steps).
    MGPU_CHECK(!captures_.capturing(), DeviceError,
               "a GEMM operand outgrew its buffer during a capture "
               "(run the shape uncaptured first)");
    const size_t cap = std::max(n, half_capacity_[slot] + half_capacity_[slot] / 2);
    regrow_half(half_[slot], half_capacity_[slot], cap, "GEMM operand scratch");
  }
  cast_half(half_[slot], src, n);
  return half_[slot];
}

void CudaBackend::cast_half(void* dst, const float* src, size_t n) {
  (precision_ == Precision::kBF16 ? kernels::cast_to_bf16 : kernels::cast_to_fp16)(dst, src, n, stream_);
}

void* CudaBackend::allocate_half(size_t n, const char* what) {
  // Stream-ordered: no device-wide synchronisation (cudaFree's), which could
  // wait forever on a collective of another rank sharing this GPU.
  void* p = nullptr;
  const cudaError_t rc = cudaMallocAsync(&p, n * 2, stream_);  // 2-byte elements
  if (rc != cudaSuccess) {
    cudaGetLastError();
    throw DeviceError(detail::concat("cudaMallocAsync of ", n * 2, " bytes (", what, ") on GPU ", device_,
                                     " failed: ", cudaGetErrorString(rc)));
  }
  return p;
}

void CudaBackend::regrow_half(void*& half, size_t& capacity, size_t n, const char* what) {
  release_captures();  // graphs point at the buffer about to go
  if (half) MGPU_CUDA_CHECK(cudaFreeAsync(half, stream_));
  half = nullptr;
  capacity = 0;
  half = allocate_half(n, what);
  capacity = n;
}

void CudaBackend::gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* A, int lda,
                       const void* B, int ldb, float beta, float* C, int ldc) {
  const float alpha = 1.0f;
  if (precision_ == Precision::kFP32 || precision_ == Precision::kTF32) {
    MGPU_CUBLAS_CHECK(cublasSgemm(cublas_, ta, tb, m, n, k, &alpha, static_cast<const float*>(A), lda,
                                  static_cast<const float*>(B), ldb, &beta, C, ldc));
    return;
  }
  // Half-precision inputs, fp32 accumulation and fp32 output (master values stay fp32).
  const cudaDataType_t in_type = precision_ == Precision::kBF16 ? CUDA_R_16BF : CUDA_R_16F;
  MGPU_CUBLAS_CHECK(cublasGemmEx(cublas_, ta, tb, m, n, k, &alpha, A, in_type, lda, B, in_type, ldb, &beta, C,
                                 CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// --- half operands --------------------------------------------------------------
CudaBackend::HalfOperand* CudaBackend::half_operand(const float* base, size_t n) {
  if (precision_ != Precision::kBF16 && precision_ != Precision::kFP16) return nullptr;
  HalfOperand* h = nullptr;
  for (HalfOperand& e : half_operands_)
    if (e.base == base) h = &e;
  if (h && h->capacity >= n) return h;
  if (captures_.capturing()) return nullptr;  // no allocation in a graph: the caller's scratch path
  if (!h) {
    half_operands_.push_back(HalfOperand{base, 0, 0, nullptr});
    h = &half_operands_.back();
  }
  h->valid = 0;
  regrow_half(h->half, h->capacity, n, "half operand");  // only while shapes grow (the first steps)
  return h;
}

kernels::HalfShadow CudaBackend::produce_half_operand(float* base, size_t n) {
  writes(base, n * sizeof(float));
  HalfOperand* h = reuse_half_operands_ && n ? half_operand(base, n) : nullptr;
  if (!h) return {};
  h->valid = n;  // the producing kernel, queued next, writes every value of it
  return kernels::HalfShadow{h->half, precision_ == Precision::kBF16};
}

void CudaBackend::stale_all_half_operands() noexcept {
  for (HalfOperand& h : half_operands_) h.valid = 0;
}

void CudaBackend::stale_half_operands(const void* dst, size_t bytes) {
  const char* d = static_cast<const char*>(dst);
  for (HalfOperand& h : half_operands_) {
    const char* b = reinterpret_cast<const char*>(h.base);
    if (h.valid && d < b + h.valid * sizeof(float) && b < d + bytes) h.valid = 0;
  }
}

void CudaBackend::free_half_operands(const void* allocation) noexcept {
  const auto found = allocation_bytes_.find(allocation);
  const size_t bytes = found == allocation_bytes_.end() ? 1 : found->second;
  if (found != allocation_bytes_.end()) allocation_bytes_.erase(found);
  const char* a = static_cast<const char*>(allocation);
  for (size_t i = 0; i < half_operands_.size();) {
    HalfOperand& h = half_operands_[i];
    const char* b = reinterpret_cast<const char*>(h.base);
    if (b >= a && b < a + bytes) {
      try {
        release_captures();  // graphs may point at the copy
      } catch (...) {
      }
      if (h.half) cudaFreeAsync(h.half, stream_);
      half_operands_.erase(half_operands_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
}

// --- persistent half weights ------------------------------------------------
void CudaBackend::set_master_weights(const float* params, size_t n) {
  activate();
  master_ = params;
  master_n_ = n;
  size_master_half();
}

void CudaBackend::size_master_half() {
  stale_master_half(0, master_n_);
  const bool half = precision_ == Precision::kBF16 || precision_ == Precision::kFP16;
  if (master_half_ && (!half || master_half_n_ < master_n_)) {  // not wanted, or too small for these weights
    release_captures();                                         // graphs may point at it
    MGPU_CUDA_CHECK(cudaFreeAsync(master_half_, stream_));
    master_half_ = nullptr;
    master_half_n_ = 0;
  }
  if (half && !master_half_ && master_n_) {
    master_half_ = allocate_half(master_n_, "half weights");
    master_half_n_ = master_n_;
  }
}

const void* CudaBackend::master_half_view(const float* src, size_t n) {
  if (!master_half_ || src < master_ || src + n > master_ + master_n_) return nullptr;
  refresh_master_half(static_cast<size_t>(src - master_), n);
  return static_cast<const uint16_t*>(master_half_) + (src - master_);
}

void CudaBackend::refresh_master_half(size_t first, size_t count) {
  if (!master_half_ || master_half_stale_.empty()) return;
  const size_t end = first + std::min(count, master_n_ - first);
  std::vector<std::pair<size_t, size_t>> still;
  for (const auto& [lo, hi] : master_half_stale_) {
    const size_t a = std::max(lo, first), b = std::min(hi, end);
    if (a >= b) {
      still.emplace_back(lo, hi);
      continue;
    }
    MGPU_CHECK(!captures_.capturing(), DeviceError,
               "stale half weights during a capture (the parameters "
               "changed after begin_capture)");
    cast_half(static_cast<uint16_t*>(master_half_) + a, master_ + a, b - a);
    if (lo < a) still.emplace_back(lo, a);
    if (b < hi) still.emplace_back(b, hi);
  }
  master_half_stale_.swap(still);
}

void CudaBackend::stale_master_half(size_t first, size_t count) {
  if (first >= master_n_ || count == 0) return;
  size_t lo = first, hi = first + std::min(count, master_n_ - first);
  std::vector<std::pair<size_t, size_t>> merged;
  for (const auto& range : master_half_stale_) {
    if (range.second < lo || range.first > hi) {  // apart (touching ranges merge)
      merged.push_back(range);
    } else {
      lo = std::min(lo, range.first);
      hi = std::max(hi, range.second);
    }
  }
  merged.emplace_back(lo, hi);
  std::sort(merged.begin(), merged.end());
  master_half_stale_.swap(merged);
}

void CudaBackend::writes(const void* dst, size_t bytes) {
  stale_half_operands(dst, bytes);
  const char* d = static_cast<const char*>(dst);
  const char* m = reinterpret_cast<const char*>(master_);
  if (master_ && d < m + master_n_ * sizeof(float) && m < d + bytes) {
    const size_t first = d > m ? static_cast<size_t>(d - m) / sizeof(float) : 0;
    const size_t end = std::min(master_n_, static_cast<size_t>(d + bytes - m + sizeof(float) - 1) / sizeof(float));
    stale_master_half(first, end - first);
  }
}

kernels::HalfShadow CudaBackend::shadow_for_update(const float* param, size_t n) {
  if (master_half_ && param == master_ && n == master_n_) {
    // A verdict may refuse the update, which then writes nothing: the copy must
    // be current before it (a rank without rows ran no forward to refresh it).
    refresh_master_half();  // the update writes every value of the copy as it writes the parameter
    return kernels::HalfShadow{master_half_, precision_ == Precision::kBF16};
  }
  writes(param, n * sizeof(float));
  return {};
}

// inp (B, IN), weight (OUT, IN), bias (OUT) -> out (B, OUT)
void CudaBackend::linear_forward(float* out, const float* inp, const float* weight, const float* bias, int B, int IN,
                                 int OUT) {
  if (B == 0) return;
  activate();
  writes(out, size_t(B) * OUT * sizeof(float));
  // Seed out with the bias and let the GEMM add onto it (beta = 1), as the CPU backend does.
  kernels::broadcast_rows(out, bias, B, OUT, stream_);
  // column-major out^T (OUT, B) = W (IN, OUT)^T . inp^T (IN, B)
  const void* w = gemm_input(0, weight, size_t(OUT) * IN);
  const void* x = gemm_input(1, inp, size_t(B) * IN);
  gemm(CUBLAS_OP_T, CUBLAS_OP_N, OUT, B, IN, w, IN, x, IN, 1.0f, out, OUT);
}

// dout (B, OUT), inp (B, IN), weight (OUT, IN) -> dweight (OUT, IN), dbias (OUT), dinp (B, IN)
void CudaBackend::linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                  const float* weight, int B, int IN, int OUT, bool accumulate) {
  activate();
  if (dinp) writes(dinp, size_t(B) * IN * sizeof(float));
  writes(dweight, size_t(OUT) * IN * sizeof(float));
  writes(dbias, size_t(OUT) * sizeof(float));
  if (B == 0) {
    // The CPU's GEMM with k = 0 leaves beta * dweight: zero unless accumulating.
    if (!accumulate) {
      zero(dweight, size_t(OUT) * IN);
      zero(dbias, size_t(OUT));
    }
    return;
  }
  const void* d = gemm_input(1, dout, size_t(B) * OUT);  // shared by both GEMMs
  if (dinp) {
    // column-major dinp^T (IN, B) = W^T (IN, OUT) . dout^T (OUT, B)
    const void* w = gemm_input(0, weight, size_t(OUT) * IN);
    gemm(CUBLAS_OP_N, CUBLAS_OP_N, IN, B, OUT, w, IN, d, OUT, 0.0f, dinp, IN);
  }
  // column-major dW^T (IN, OUT) = inp^T (IN, B) . dout (B, OUT)
  const void* x = gemm_input(0, inp, size_t(B) * IN);
  gemm(CUBLAS_OP_N, CUBLAS_OP_T, IN, OUT, B, x, IN, d, OUT, accumulate ? 1.0f : 0.0f, dweight, IN);
  kernels::column_sums(dbias, dout, B, OUT, accumulate, column_partials_, stream_);
}

// Both write the GEMMs' half copy of what they produce (see HalfOperand).
void CudaBackend::relu_dropout_forward(float* h, int B, int C, float p, const DropoutKey& key) {
  activate();
  const kernels::HalfShadow shadow = produce_half_operand(h, size_t(B) * C);
  kernels::relu_dropout_forward(h, B, C, p, key, stream_, captured_args(), shadow);
}

void CudaBackend::relu_dropout_backward(float* dh, const float* h, size_t n, float p) {
  activate();
  const kernels::HalfShadow shadow = produce_half_operand(dh, n);
  kernels::relu_dropout_backward(dh, h, n, p, stream_, shadow);
}

void CudaBackend::mse_forward_backward(float* loss_out, float* dpred, const float* pred, const float* target, int B,
                                       int D, float grad_scale) {
  activate();
  writes(loss_out, sizeof(float));
  if (dpred) writes(dpred, size_t(B) * D * sizeof(float));
  kernels::mse_forward_backward(loss_out, dpred, pred, target, B, D, grad_scale, partials_, stream_, captured_args());
}

void CudaBackend::cross_entropy_forward_backward(float* loss_out, float* dlogits, float* correct_out,
                                                 const float* logits, const int32_t* labels, int B, int C,
                                                 float grad_scale) {
  activate();
  writes(loss_out, sizeof(float));
  if (dlogits) writes(dlogits, size_t(B) * C * sizeof(float));
  if (correct_out) writes(correct_out, sizeof(float));
  kernels::cross_entropy_forward_backward(loss_out, dlogits, correct_out, logits, labels, B, C, grad_scale, partials_,
                                          label_errors_, stream_, captured_args());
}

void CudaBackend::sgd_update(float* param, const float* grad, float* momentum_buf, size_t n, const SgdParams& hp) {
  activate();
  if (momentum_buf && hp.momentum > 0.0f) writes(momentum_buf, n * sizeof(float));
  kernels::sgd_update(param, grad, momentum_buf, n, hp, stream_, shadow_for_update(param, n), captured_args());
}

void CudaBackend::adamw_update(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t n,
                               const AdamWParams& hp) {
  activate();
  writes(exp_avg, n * sizeof(float));
  writes(exp_avg_sq, n * sizeof(float));
  kernels::adamw_update(param, grad, exp_avg, exp_avg_sq, n, hp, stream_, shadow_for_update(param, n), captured_args());
}

void CudaBackend::step_verdict(StepVerdict* verdict, const float* grads, size_t n, const float* slots, float loss_scale,
                               float max_norm, const int* comm_failed) {
  activate();
  writes(verdict, sizeof(StepVerdict));
  kernels::sum_squares(&verdict->sum_squares, grads, n, partials_, stream_);
  // Labels a loss kernel found out of range are folded into pinned host memory
  // in stream order: a nonzero count there refuses the update before the host
  // learns of it (it throws at the read-back).
  kernels::step_verdict(verdict, slots, loss_scale, max_norm, label_errors_.host, comm_failed, stream_,
                        captured_args());
}

void CudaBackend::shard_health_sums(float* sums, const float* grads, size_t n, const float* slots) {
  activate();
  writes(sums, kShardSums * sizeof(float));
  kernels::sum_squares(sum_out_, grads, n, partials_, stream_);
  kernels::shard_health_sums(sums, slots, sum_out_, stream_);
}

void CudaBackend::step_verdict_from_shards(StepVerdict* verdict, const float* all_sums, int ranks, float loss_scale,
                                           float max_norm, const int* comm_failed) {
  activate();
  writes(verdict, sizeof(StepVerdict));
  kernels::step_verdict_from_shards(verdict, all_sums, ranks, loss_scale, max_norm, label_errors_.host, comm_failed,
                                    stream_, captured_args());
}

double CudaBackend::sum_squares(const float* x, size_t n) {
  activate();
  MGPU_CHECK(!captures_.capturing(), DeviceError, "sum_squares reads back to the host: not allowed in a capture");
  kernels::sum_squares(sum_out_, x, n, partials_, stream_);
  double sum = 0.0;
  copy_to_host(&sum, sum_out_, sizeof(double));
  return sum;
}

void CudaBackend::scale(float* x, size_t n, float alpha) {
  activate();
  writes(x, n * sizeof(float));
  kernels::scale(x, n, alpha, stream_);
}

void CudaBackend::narrow(void* half, const float* x, size_t n, Precision dtype) {
  const bool bf16 = is_bf16_not_fp16(dtype, "narrow");
  activate();
  writes(half, n * 2);
  (bf16 ? kernels::cast_to_bf16 : kernels::cast_to_fp16)(half, x, n, stream_);
}

void CudaBackend::widen(float* x, const void* half, size_t n, Precision dtype) {
  const bool bf16 = is_bf16_not_fp16(dtype, "widen");
  activate();
  writes(x, n * sizeof(float));
  (bf16 ? kernels::widen_from_bf16 : kernels::widen_from_fp16)(x, half, n, stream_);
}

void CudaBackend::axpy(float* y, const float* x, size_t n, float alpha) {
  activate();
  writes(y, n * sizeof(float));
  kernels::axpy(y, x, n, alpha, stream_);
}

void CudaBackend::gather_rows(void* dst, const void* src, const int64_t* index, int rows, int W) {
  activate();
  writes(dst, size_t(rows) * W * 4);
  kernels::gather_rows(static_cast<uint32_t*>(dst), static_cast<const uint32_t*>(src), index, rows, W, stream_);
}

// --- CUDA graphs ------------------------------------------------------------
// Thread-local capture mode: only this thread's calls are checked against the
// capture, so a communicator's watchdog thread may go on querying events.
void CudaBackend::begin_capture() {
  activate();
  refresh_master_half();      // now, not as a node of the graph
  stale_all_half_operands();  // the graph makes its own half operands
  captures_.begin();
  const cudaError_t rc = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
  if (rc != cudaSuccess) captures_.abort();
  MGPU_CUDA_CHECK(rc);
}

int CudaBackend::end_capture() {
  activate();
  captures_.end();
  stale_all_half_operands();  // recorded, not run: nothing was written yet
  cudaGraph_t graph = nullptr;
  MGPU_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t rc = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  MGPU_CUDA_CHECK(rc);
  return captures_.store(exec);
}

void CudaBackend::abort_capture() noexcept {
  // Copies the capture marked current were never written (also after a failed end_capture).
  stale_all_half_operands();
  if (!captures_.capturing()) return;
  captures_.abort();
  cudaSetDevice(device_);
  cudaGraph_t graph = nullptr;
  if (cudaStreamEndCapture(stream_, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
  cudaGetLastError();  // capture errors are not sticky; leave none behind
}

void CudaBackend::replay(int graph, const ReplayArgs& args) {
  activate();
  cudaGraphExec_t exec = captures_.get(graph);
  // A kernel argument, not a copy from one pinned slot: a slot rewritten by the
  // next replay before this one's copy ran would give this graph the next
  // one's values (back-to-back replays, the host running ahead of the stream).
  refresh_master_half();  // the parameters changed since the graph last ran (a checkpoint loaded)
  kernels::set_replay_args(replay_dev_, args, stream_);
  MGPU_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
  // What the graph wrote is not tracked here: its half operands count as stale after it.
  stale_all_half_operands();
}

void CudaBackend::release_captures() {
  if (captures_.empty()) return;
  activate();
  MGPU_CUDA_CHECK(cudaStreamSynchronize(stream_));  // no replay may still be running
  drained();
  captures_.release([](cudaGraphExec_t g) { cudaGraphExecDestroy(g); });
}

}  // namespace mgpu
