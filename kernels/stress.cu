// Stress kernels (CPU reference: csrc/cpu/cpu_stress.cpp; the element functions
// are shared in csrc/core/stress_math.h) and the CUDA StressDevice that runs
// them: a transcendental burn verified by recomputing a sample in a second,
// differently mapped launch; cuBLAS GEMMs on fixed random inputs, each result
// compared element by element with the first, and the first checked at samples
// against fp64 dot products (gemm_reference_check in cpu_stress.cpp); memory
// patterns written and read back with a mismatch counter. Times come from CUDA
// events; the GEMM repeats are enqueued back to back, each between its own pair
// of events, with one host wait at the end (the host's launch latency is not GEMM
// time). The random memory pattern draws two words per Philox call.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "../csrc/core/errors.h"
#include "../csrc/core/stress_device.h"
#include "../csrc/core/stress_math.h"
#include "common.cuh"
#include "cuda_check.cuh"
#include "kernels.cuh"

namespace mgpu {
namespace {

using kernels::grid_for;
using kernels::kThreads;

__device__ float chain_n(float x, int iterations) {
  for (int k = 0; k < iterations; ++k) x = stress_chain(x);
  return x;
}

// out (n) = chain^iterations(start(seed, i))
__global__ void compute_kernel(float* __restrict__ out, size_t n, int iterations, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = chain_n(stress_start(seed, i), iterations);
}

// The sample, recomputed with the threads mapped in reverse (other SMs and
// lanes than the burn used), compared bit for bit with the burn's values.
__global__ void compute_check_kernel(unsigned long long* __restrict__ counts, const float* __restrict__ values,
                                     size_t n, size_t checks, int iterations, uint64_t seed) {
  for (size_t s = blockIdx.x * size_t(blockDim.x) + threadIdx.x; s < checks; s += size_t(gridDim.x) * blockDim.x) {
    const size_t i = stress_sample_index(checks - 1 - s, n, checks);
    const float want = chain_n(stress_start(seed, i), iterations);
    const float got = values[i];
    if (__float_as_uint(got) != __float_as_uint(want)) atomicAdd(&counts[0], 1ull);
    if (!isfinite(got)) atomicAdd(&counts[1], 1ull);
  }
}

// a, b (n, n): uniform in [-0.5, 0.5), as the CPU's inputs
__global__ void gemm_inputs_kernel(float* __restrict__ a, float* __restrict__ b, size_t nn, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < nn; i += size_t(gridDim.x) * blockDim.x) {
    a[i] = stress_start(seed, i) - 0.5f;
    b[i] = stress_start(seed + 1, i) - 0.5f;
  }
}

__global__ void gemm_check_kernel(unsigned long long* __restrict__ counts, const float* __restrict__ got,
                                  const float* __restrict__ want, size_t nn, double tol) {
  unsigned long long wrong = 0, nonfinite = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < nn; i += size_t(gridDim.x) * blockDim.x) {
    const float g = got[i], w = want[i];
    nonfinite += !isfinite(g);
    wrong += !(fabs(double(g) - double(w)) <= tol * fabs(double(w))) && g != w;
  }
  if (wrong) atomicAdd(&counts[0], wrong);
  if (nonfinite) atomicAdd(&counts[1], nonfinite);
}

__device__ __forceinline__ double widen(float x) { return x; }
__device__ __forceinline__ double widen(__nv_bfloat16 x) { return __bfloat162float(x); }

// c (n, n) = a (n, n) b (n, n), row-major: `checks` samples of c recomputed as
// fp64 dot products of the operands the GEMM read (no cuBLAS, no tensor cores:
// a path independent of the burn's), each within stress_gemm_bound.
// CPU reference: gemm_reference_check (csrc/cpu/cpu_stress.cpp).
template <typename T>
__global__ void gemm_reference_kernel(unsigned long long* __restrict__ counts, const float* __restrict__ c,
                                      const T* __restrict__ a, const T* __restrict__ b, int n, size_t checks,
                                      double input_error) {
  const size_t nn = size_t(n) * n;
  for (size_t s = blockIdx.x * size_t(blockDim.x) + threadIdx.x; s < checks; s += size_t(gridDim.x) * blockDim.x) {
    const size_t i = stress_sample_index(s, nn, checks), row = i / n, col = i % n;
    double ref = 0.0, abs_sum = 0.0;
    for (int k = 0; k < n; ++k) {
      const double p = widen(a[row * n + k]) * widen(b[size_t(k) * n + col]);
      ref += p;
      abs_sum += fabs(p);
    }
    const float got = c[i];
    if (!stress_gemm_element_ok(got, ref, abs_sum, n, input_error)) atomicAdd(&counts[0], 1ull);
    if (!isfinite(got)) atomicAdd(&counts[1], 1ull);
  }
}

// One thread per pair of words (stress_word_pair: one Philox call gives both
// random words), written and read as one 16-byte access: buf is cudaMalloc'd
// (256-byte aligned), and a warp covers 512 contiguous bytes. An odd last word
// is accessed alone.
__global__ void memory_write_kernel(uint64_t* __restrict__ buf, size_t words, StressPattern p, uint64_t seed,
                                    int pass) {
  const size_t pairs = (words + 1) / 2;
  for (size_t k = blockIdx.x * size_t(blockDim.x) + threadIdx.x; k < pairs; k += size_t(gridDim.x) * blockDim.x) {
    uint64_t w[2];
    stress_word_pair(p, seed, pass, k, w);
    if (2 * k + 1 < words)
      reinterpret_cast<ulonglong2*>(buf)[k] = make_ulonglong2(w[0], w[1]);
    else
      buf[2 * k] = w[0];
  }
}

__global__ void memory_check_kernel(unsigned long long* __restrict__ counts, const uint64_t* __restrict__ buf,
                                    size_t words, StressPattern p, uint64_t seed, int pass) {
  const size_t pairs = (words + 1) / 2;
  unsigned long long wrong = 0;
  for (size_t k = blockIdx.x * size_t(blockDim.x) + threadIdx.x; k < pairs; k += size_t(gridDim.x) * blockDim.x) {
    uint64_t w[2];
    stress_word_pair(p, seed, pass, k, w);
    if (2 * k + 1 < words) {
      const ulonglong2 got = reinterpret_cast<const ulonglong2*>(buf)[k];
      wrong += (got.x != w[0]) + (got.y != w[1]);
    } else {
      wrong += buf[2 * k] != w[0];
    }
  }
  if (wrong) atomicAdd(&counts[0], wrong);
}

// Device memory owned by the stress device; freed without throwing.
template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  void resize(size_t n) {
    if (n == count) return;
    release();
    if (n) MGPU_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr), n * sizeof(T)));
    count = n;
  }
  void release() noexcept {
    if (ptr) cudaFree(ptr);
    ptr = nullptr;
    count = 0;
  }
  ~DeviceBuffer() { release(); }
};

class CudaStress final : public StressDevice {
 public:
  explicit CudaStress(int device) : device_(device) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    MGPU_CHECK(count > 0, DeviceError, "no CUDA GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)");
    MGPU_CHECK(device >= 0 && device < count, DeviceError, "device index ", device, " out of range: ", count,
               " GPU(s) visible");
    // A throw below skips the destructor: release what was created so far (the
    // DeviceBuffer members free themselves).
    try {
      MGPU_CUDA_CHECK(cudaSetDevice(device_));
      MGPU_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      MGPU_CUDA_CHECK(cudaEventCreate(&start_));
      MGPU_CUDA_CHECK(cudaEventCreate(&stop_));
      for (cudaEvent_t& e : ring_) MGPU_CUDA_CHECK(cudaEventCreate(&e));
      MGPU_CUBLAS_CHECK(cublasCreate(&blas_));
      MGPU_CUBLAS_CHECK(cublasSetStream(blas_, stream_));
      MGPU_CUBLAS_CHECK(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH));  // FP32: never TF32 in this mode
      MGPU_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&counts_host_), 4 * sizeof(unsigned long long)));
      counts_.resize(4);  // [0, 1]: a check's (mismatches, nonfinite); [2, 3]: the GEMM reference check's
    } catch (...) {
      release();
      throw;
    }
  }
  ~CudaStress() override { release(); }
  CudaStress(const CudaStress&) = delete;
  CudaStress& operator=(const CudaStress&) = delete;
  std::string name() const override {
    cudaDeviceProp prop{};
    return cudaGetDeviceProperties(&prop, device_) == cudaSuccess ? std::string(prop.name) : "cuda";
  }

  StressCheck compute(size_t n, int iterations, uint64_t seed, size_t sample, bool inject_fault) override {
    MGPU_CHECK(n >= 1 && iterations >= 1, ConfigError, "compute burn needs n >= 1 and iterations >= 1");
    MGPU_CUDA_CHECK(cudaSetDevice(device_));
    values_.resize(n);
    StressCheck c;
    begin();
    MGPU_LAUNCH(compute_kernel, grid_for(n), kThreads, 0, stream_)(values_.ptr, n, iterations, seed);
    MGPU_CUDA_CHECK_LAUNCH("compute_kernel");
    c.seconds = end();
    c.work = double(n) * iterations * kStressChainOps;
    const size_t checks = std::min(std::max<size_t>(sample, 1), n);
    if (inject_fault) flip_bit(values_.ptr + stress_sample_index(checks / 2, n, checks));
    zero_counts();
    MGPU_LAUNCH(compute_check_kernel, grid_for(checks), kThreads, 0, stream_)
    (counts_.ptr, values_.ptr, n, checks, iterations, seed);
    MGPU_CUDA_CHECK_LAUNCH("compute_check_kernel");
    const auto counts = read_counts();
    c.checked = static_cast<int64_t>(checks);
    c.mismatches = static_cast<int64_t>(counts[0]);
    c.nonfinite = static_cast<int64_t>(counts[1]);
    return c;
  }

  StressCheck gemm(int n, int repeats, uint64_t seed, double tol, bool inject_fault,
                   const std::string& precision) override {
    MGPU_CHECK(precision == "fp32" || precision == "tf32" || precision == "bf16", ConfigError,
               "GEMM burn precision must be fp32, tf32 or bf16, got '", precision, "'");
    MGPU_CHECK(n >= 1 && repeats >= 1, ConfigError, "GEMM burn needs n >= 1 and repeats >= 1");
    MGPU_CHECK(tol >= 0, ConfigError, "tolerance must be >= 0");
    MGPU_CUDA_CHECK(cudaSetDevice(device_));
    const size_t nn = size_t(n) * n;
    if (gemm_n_ != n || gemm_seed_ != seed || gemm_precision_ != precision) {
      a_.resize(nn);
      b_.resize(nn);
      c_.resize(nn);
      first_.resize(nn);
      MGPU_LAUNCH(gemm_inputs_kernel, grid_for(nn), kThreads, 0, stream_)(a_.ptr, b_.ptr, nn, seed);
      MGPU_CUDA_CHECK_LAUNCH("gemm_inputs_kernel");
      if (precision == "bf16") {
        a16_.resize(nn);
        b16_.resize(nn);
        kernels::cast_to_bf16(a16_.ptr, a_.ptr, nn, stream_);
        kernels::cast_to_bf16(b16_.ptr, b_.ptr, nn, stream_);
      }
      // The mode training's GEMMs and the burn's reference (time_linear) use, so the burn is
      // held against the same kernels: the default keeps fp32 at full precision (TF32 only
      // where asked) and is bit-reproducible run to run.
      MGPU_CUBLAS_CHECK(
          cublasSetMathMode(blas_, precision == "tf32" ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
      have_first_ = false;
      gemm_n_ = n;
      gemm_seed_ = seed;
      gemm_precision_ = precision;
    }
    // Every repeat is enqueued between its own pair of ring events, its check
    // behind it, and the host waits once per kRingRepeats repeats (once per call
    // at the CLI's repeats): the GPU never idles on the host between GEMMs, and
    // each GEMM's time is its own, without the host's launch latency in it.
    const size_t checks = std::min<size_t>(kStressGemmChecks, nn);
    const double input_error = stress_gemm_input_error(precision);
    bool reference_checked = false;
    StressCheck c;
    zero_counts(4);
    for (int r0 = 0; r0 < repeats; r0 += kRingRepeats) {
      const int chunk = std::min(kRingRepeats, repeats - r0);
      for (int i = 0; i < chunk; ++i) {
        MGPU_CUDA_CHECK(cudaEventRecord(ring_[2 * i], stream_));
        enqueue_gemm(n, precision);
        MGPU_CUDA_CHECK(cudaEventRecord(ring_[2 * i + 1], stream_));
        if (!have_first_) {
          MGPU_CUDA_CHECK(cudaMemcpyAsync(first_.ptr, c_.ptr, nn * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
          have_first_ = true;
          // Every later result is held against this one: check it on its own.
          if (precision == "bf16")
            enqueue_reference_check(counts_.ptr + 2, first_.ptr, a16_.ptr, b16_.ptr, n, checks, input_error);
          else
            enqueue_reference_check(counts_.ptr + 2, first_.ptr, a_.ptr, b_.ptr, n, checks, input_error);
          reference_checked = true;
          continue;
        }
        if (inject_fault && r0 + i == repeats - 1) flip_bit(c_.ptr + nn / 3);
        MGPU_LAUNCH(gemm_check_kernel, grid_for(nn), kThreads, 0, stream_)(counts_.ptr, c_.ptr, first_.ptr, nn, tol);
        MGPU_CUDA_CHECK_LAUNCH("gemm_check_kernel");
        c.checked += static_cast<int64_t>(nn);
      }
      // The ring is reused by the next chunk: read its times first.
      if (r0 + chunk == repeats) {
        read_counts_async(4);
        MGPU_CUDA_CHECK(cudaStreamSynchronize(stream_));
      } else {
        MGPU_CUDA_CHECK(cudaEventSynchronize(ring_[2 * chunk - 1]));
      }
      for (int i = 0; i < chunk; ++i) c.seconds += elapsed(ring_[2 * i], ring_[2 * i + 1]);
      c.work += chunk * 2.0 * n * double(n) * n;
    }
    c.mismatches = static_cast<int64_t>(counts_host_[0] + counts_host_[2]);
    c.nonfinite = static_cast<int64_t>(counts_host_[1] + counts_host_[3]);
    if (reference_checked) c.checked += static_cast<int64_t>(checks);
    return c;
  }

  StressCheck gemm_verify(int n, const float* a, const float* b, const float* c, const std::string& precision,
                          size_t samples) override {
    const double input_error = stress_gemm_input_error(precision);
    MGPU_CHECK(n >= 1, ConfigError, "GEMM check needs n >= 1");
    MGPU_CUDA_CHECK(cudaSetDevice(device_));
    const size_t nn = size_t(n) * n;
    DeviceBuffer<float> da, db, dc;  // apart from the burn's buffers, which keep their first result
    da.resize(nn);
    db.resize(nn);
    dc.resize(nn);
    MGPU_CUDA_CHECK(cudaMemcpyAsync(da.ptr, a, nn * sizeof(float), cudaMemcpyHostToDevice, stream_));
    MGPU_CUDA_CHECK(cudaMemcpyAsync(db.ptr, b, nn * sizeof(float), cudaMemcpyHostToDevice, stream_));
    MGPU_CUDA_CHECK(cudaMemcpyAsync(dc.ptr, c, nn * sizeof(float), cudaMemcpyHostToDevice, stream_));
    const size_t checks = std::min(std::max<size_t>(samples, 1), nn);
    if (precision != "bf16") return reference_check(dc.ptr, da.ptr, db.ptr, n, checks, input_error);
    DeviceBuffer<__nv_bfloat16> a16, b16;
    a16.resize(nn);
    b16.resize(nn);
    kernels::cast_to_bf16(a16.ptr, da.ptr, nn, stream_);
    kernels::cast_to_bf16(b16.ptr, db.ptr, nn, stream_);
    return reference_check(dc.ptr, a16.ptr, b16.ptr, n, checks, input_error);
  }

  double copy_bandwidth(size_t bytes) override {
    MGPU_CHECK(bytes >= 1, ConfigError, "copy size must be >= 1 byte");
    MGPU_CUDA_CHECK(cudaSetDevice(device_));
    DeviceBuffer<char> src, dst;
    src.resize(bytes);
    dst.resize(bytes);
    MGPU_CUDA_CHECK(cudaMemcpyAsync(dst.ptr, src.ptr, bytes, cudaMemcpyDeviceToDevice, stream_));  // warm-up
    constexpr int kRepeats = 10;
    begin();
    for (int r = 0; r < kRepeats; ++r)
      MGPU_CUDA_CHECK(cudaMemcpyAsync(dst.ptr, src.ptr, bytes, cudaMemcpyDeviceToDevice, stream_));
    return 2.0 * bytes * kRepeats / end();
  }

  size_t resize_buffer(size_t bytes) override {
    MGPU_CUDA_CHECK(cudaSetDevice(device_));
    buffer_.resize(bytes / sizeof(uint64_t));
    return buffer_bytes();
  }
  size_t buffer_bytes() const override { return buffer_.count * sizeof(uint64_t); }

  StressCheck memory(const std::string& pattern_name, uint64_t seed, int pass, bool inject_fault) override {
    const StressPattern p = parse_stress_pattern(pattern_name);
    MGPU_CHECK(buffer_.count > 0, ConfigError, "the memory pass needs a buffer (resize_buffer first)");
    MGPU_CUDA_CHECK(cudaSetDevice(device_));
    StressCheck c;
    begin();
    const size_t pairs = (buffer_.count + 1) / 2;
    MGPU_LAUNCH(memory_write_kernel, grid_for(pairs), kThreads, 0, stream_)(buffer_.ptr, buffer_.count, p, seed, pass);
    MGPU_CUDA_CHECK_LAUNCH("memory_write_kernel");
    c.seconds = end();
    if (inject_fault) {
      uint64_t word = 0;
      uint64_t* target = buffer_.ptr + buffer_.count / 2;
      MGPU_CUDA_CHECK(cudaMemcpyAsync(&word, target, sizeof(word), cudaMemcpyDeviceToHost, stream_));
      MGPU_CUDA_CHECK(cudaStreamSynchronize(stream_));
      word ^= uint64_t{1} << 17;
      MGPU_CUDA_CHECK(cudaMemcpyAsync(target, &word, sizeof(word), cudaMemcpyHostToDevice, stream_));
      MGPU_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    zero_counts();
    begin();
    MGPU_LAUNCH(memory_check_kernel, grid_for(pairs), kThreads, 0, stream_)
    (counts_.ptr, buffer_.ptr, buffer_.count, p, seed, pass);
    MGPU_CUDA_CHECK_LAUNCH("memory_check_kernel");
    c.seconds += end();
    c.work = 2.0 * buffer_bytes();
    c.checked = static_cast<int64_t>(buffer_.count);
    c.mismatches = static_cast<int64_t>(read_counts()[0]);
    return c;
  }

 private:
  void release() noexcept {
    cudaSetDevice(device_);
    if (stream_) cudaStreamSynchronize(stream_);  // nothing may still use the buffers freed after this
    if (blas_) cublasDestroy(blas_);
    if (start_) cudaEventDestroy(start_);
    if (stop_) cudaEventDestroy(stop_);
    for (cudaEvent_t& e : ring_) {
      if (e) cudaEventDestroy(e);
      e = nullptr;
    }
    if (counts_host_) cudaFreeHost(counts_host_);
    counts_host_ = nullptr;
    if (stream_) cudaStreamDestroy(stream_);
    blas_ = nullptr;
    start_ = stop_ = nullptr;
    stream_ = nullptr;
  }
  // row-major C = A B is column-major C^T = B^T A^T: swap the operands
  void enqueue_gemm(int n, const std::string& precision) {
    const float one = 1.0f, zero = 0.0f;
    if (precision == "bf16")
      MGPU_CUBLAS_CHECK(cublasGemmEx(blas_, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, b16_.ptr, CUDA_R_16BF, n, a16_.ptr,
                                     CUDA_R_16BF, n, &zero, c_.ptr, CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT));
    else
      MGPU_CUBLAS_CHECK(
          cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, b_.ptr, n, a_.ptr, n, &zero, c_.ptr, n));
  }
  // gemm_reference_kernel over c (n, n) = a b, adding to counts (mismatches, nonfinite).
  template <typename T>
  void enqueue_reference_check(unsigned long long* counts, const float* c, const T* a, const T* b, int n, size_t checks,
                               double input_error) {
    MGPU_LAUNCH(gemm_reference_kernel<T>, grid_for(checks), kThreads, 0, stream_)
    (counts, c, a, b, n, checks, input_error);
    MGPU_CUDA_CHECK_LAUNCH("gemm_reference_kernel");
  }
  // The same check on its own; synchronises (reads the counts).
  template <typename T>
  StressCheck reference_check(const float* c, const T* a, const T* b, int n, size_t checks, double input_error) {
    zero_counts();
    enqueue_reference_check(counts_.ptr, c, a, b, n, checks, input_error);
    const auto counts = read_counts();
    StressCheck r;
    r.checked = static_cast<int64_t>(checks);
    r.mismatches = static_cast<int64_t>(counts[0]);
    r.nonfinite = static_cast<int64_t>(counts[1]);
    return r;
  }
  void begin() { MGPU_CUDA_CHECK(cudaEventRecord(start_, stream_)); }
  double end() {
    MGPU_CUDA_CHECK(cudaEventRecord(stop_, stream_));
    MGPU_CUDA_CHECK(cudaEventSynchronize(stop_));
    return elapsed(start_, stop_);
  }
  // Seconds between two completed events.
  static double elapsed(cudaEvent_t start, cudaEvent_t stop) {
    float ms = 0.0f;
    MGPU_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms * 1e-3;
  }
  void zero_counts(int count = 2) {
    MGPU_CUDA_CHECK(cudaMemsetAsync(counts_.ptr, 0, count * sizeof(unsigned long long), stream_));
  }
  // counts_host_[0, count) = counts_ once the stream has reached this point.
  void read_counts_async(int count) {
    MGPU_CUDA_CHECK(cudaMemcpyAsync(counts_host_, counts_.ptr, count * sizeof(unsigned long long),
                                    cudaMemcpyDeviceToHost, stream_));
  }
  std::array<unsigned long long, 2> read_counts() {
    read_counts_async(2);
    MGPU_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return {counts_host_[0], counts_host_[1]};
  }
  // The test hook: the top mantissa bit of one float, a 25-50% error.
  void flip_bit(float* device_value) {
    float v = 0.0f;
    MGPU_CUDA_CHECK(cudaMemcpyAsync(&v, device_value, sizeof(v), cudaMemcpyDeviceToHost, stream_));
    MGPU_CUDA_CHECK(cudaStreamSynchronize(stream_));
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    bits ^= 1u << 22;
    std::memcpy(&v, &bits, sizeof(bits));
    MGPU_CUDA_CHECK(cudaMemcpyAsync(device_value, &v, sizeof(v), cudaMemcpyHostToDevice, stream_));
    MGPU_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  // The GEMM burn's (start, stop) event pairs, one per repeat of a chunk.
  static constexpr int kRingRepeats = 64;
  std::array<cudaEvent_t, 2 * kRingRepeats> ring_{};
  unsigned long long* counts_host_ = nullptr;  // pinned: 4 counts, read without a pageable copy
  cublasHandle_t blas_ = nullptr;
  DeviceBuffer<float> values_, a_, b_, c_, first_;
  DeviceBuffer<__nv_bfloat16> a16_, b16_;
  std::string gemm_precision_;
  DeviceBuffer<uint64_t> buffer_;
  DeviceBuffer<unsigned long long> counts_;
  int gemm_n_ = 0;
  uint64_t gemm_seed_ = 0;
  bool have_first_ = false;
};

}  // namespace

std::shared_ptr<StressDevice> make_cuda_stress_device(int device_index) {
  return std::make_shared<CudaStress>(device_index);
}

}  // namespace mgpu
