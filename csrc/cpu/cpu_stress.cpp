// CPU StressDevice (see core/stress_device.h): OpenMP loops and OpenBLAS sgemm. Also
// the reference the CUDA stress kernels are held against.
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../core/errors.h"
#include "../core/stress_device.h"
#include "../core/stress_math.h"
#include "cpu_backend.h"

extern "C" void openblas_set_num_threads(int num_threads);

namespace mgpu {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Scalar and not vectorised, so the burn and its reference run the very same
// instructions (vector libm variants may differ from scalar ones by an ulp).
__attribute__((optimize("no-tree-vectorize"))) float chain_n(float x, int iterations) {
  for (int k = 0; k < iterations; ++k) x = stress_chain(x);
  return x;
}

// Samples of c (n, n) against fp64 dot products of a (n, n) and b (n, n), all
// row-major (c = a b): the reference of the CUDA gemm_reference_kernel and the
// CPU burn's own check of its first result. counts: {mismatches, non-finite}.
StressCheck gemm_reference_check(int n, const float* a, const float* b, const float* c, size_t checks,
                                 double input_error, int threads) {
  const size_t nn = size_t(n) * n;
  int64_t wrong = 0, nonfinite = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : wrong, nonfinite) schedule(static)
  for (long s = 0; s < static_cast<long>(checks); ++s) {
    const size_t i = stress_sample_index(s, nn, checks), row = i / n, col = i % n;
    double ref = 0.0, abs_sum = 0.0;
    for (int k = 0; k < n; ++k) {
      const double p = double(a[row * n + k]) * double(b[size_t(k) * n + col]);
      ref += p;
      abs_sum += std::fabs(p);
    }
    wrong += !stress_gemm_element_ok(c[i], ref, abs_sum, n, input_error);
    nonfinite += !std::isfinite(c[i]);
  }
  StressCheck r;
  r.checked = static_cast<int64_t>(checks);
  r.mismatches = wrong;
  r.nonfinite = nonfinite;
  return r;
}

class CpuStress final : public StressDevice {
 public:
  explicit CpuStress(int threads) : threads_(threads > 0 ? threads : available_cpu_threads()) {}
  ~CpuStress() override { std::free(buffer_); }
  std::string name() const override { return "cpu"; }

  StressCheck compute(size_t n, int iterations, uint64_t seed, size_t sample, bool inject_fault) override {
    MGPU_CHECK(n >= 1 && iterations >= 1, ConfigError, "compute burn needs n >= 1 and iterations >= 1");
    values_.resize(n);
    StressCheck c;
    const long len = static_cast<long>(n);
    const auto t0 = Clock::now();
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (long i = 0; i < len; ++i) values_[i] = chain_n(stress_start(seed, i), iterations);
    c.seconds = since(t0);
    c.work = double(n) * iterations * kStressChainOps;
    const size_t checks = std::min(std::max<size_t>(sample, 1), n);
    if (inject_fault) flip_bit(&values_[stress_sample_index(checks / 2, n, checks)]);  // one of the sampled values
    for (size_t s = 0; s < checks; ++s) {
      const size_t i = stress_sample_index(s, n, checks);
      const float expect = chain_n(stress_start(seed, i), iterations);
      c.checked += 1;
      c.mismatches += std::memcmp(&values_[i], &expect, sizeof(float)) != 0;
      c.nonfinite += !std::isfinite(values_[i]);
    }
    return c;
  }

  StressCheck gemm(int n, int repeats, uint64_t seed, double tol, bool inject_fault,
                   const std::string& precision) override {
    MGPU_CHECK(precision == "fp32", ConfigError, "the CPU GEMM burn runs in fp32 only (asked for ", precision, ")");
    MGPU_CHECK(n >= 1 && repeats >= 1, ConfigError, "GEMM burn needs n >= 1 and repeats >= 1");
    MGPU_CHECK(tol >= 0, ConfigError, "tolerance must be >= 0");
    const size_t nn = size_t(n) * n;
    if (gemm_n_ != n || gemm_seed_ != seed) {
      a_.resize(nn);
      b_.resize(nn);
      for (size_t i = 0; i < nn; ++i) {
        a_[i] = stress_start(seed, i) - 0.5f;
        b_[i] = stress_start(seed + 1, i) - 0.5f;
      }
      first_.clear();
      gemm_n_ = n;
      gemm_seed_ = seed;
    }
    c_.resize(nn);
    openblas_set_num_threads(threads_);
    StressCheck c;
    for (int r = 0; r < repeats; ++r) {
      const auto t0 = Clock::now();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a_.data(), n, b_.data(), n, 0.0f, c_.data(),
                  n);
      c.seconds += since(t0);
      c.work += 2.0 * n * double(n) * n;
      if (first_.empty()) {  // the reference for every later result of these inputs
        first_ = c_;
        add(c, gemm_reference_check(n, a_.data(), b_.data(), first_.data(), std::min<size_t>(kStressGemmChecks, nn),
                                    0.0, threads_));
        continue;
      }
      if (inject_fault && r == repeats - 1) flip_bit(&c_[nn / 3]);
      int64_t wrong = 0, nonfinite = 0;
#pragma omp parallel for num_threads(threads_) reduction(+ : wrong, nonfinite) schedule(static)
      for (long i = 0; i < static_cast<long>(nn); ++i) {
        const float got = c_[i], want = first_[i];
        nonfinite += !std::isfinite(got);
        wrong += !(std::fabs(got - want) <= tol * std::fabs(want)) && got != want;
      }
      c.checked += static_cast<int64_t>(nn);
      c.mismatches += wrong;
      c.nonfinite += nonfinite;
    }
    return c;
  }

  StressCheck gemm_verify(int n, const float* a, const float* b, const float* c, const std::string& precision,
                          size_t samples) override {
    const double input_error = stress_gemm_input_error(precision);
    MGPU_CHECK(n >= 1, ConfigError, "GEMM check needs n >= 1");
    const size_t nn = size_t(n) * n;
    if (precision != "bf16")
      return gemm_reference_check(n, a, b, c, std::min(std::max<size_t>(samples, 1), nn), input_error, threads_);
    std::vector<float> a16(a, a + nn), b16(b, b + nn);  // the operands a bf16 GEMM sees
    for (size_t i = 0; i < nn; ++i) {
      a16[i] = stress_round_bf16(a16[i]);
      b16[i] = stress_round_bf16(b16[i]);
    }
    return gemm_reference_check(n, a16.data(), b16.data(), c, std::min(std::max<size_t>(samples, 1), nn), input_error,
                                threads_);
  }

  double copy_bandwidth(size_t bytes) override {
    MGPU_CHECK(bytes >= 1, ConfigError, "copy size must be >= 1 byte");
    std::vector<char> src(bytes, 1), dst(bytes, 0);
    std::memcpy(dst.data(), src.data(), bytes);  // fault the pages in before timing
    const auto t0 = Clock::now();
    constexpr int kRepeats = 5;
    for (int r = 0; r < kRepeats; ++r) std::memcpy(dst.data(), src.data(), bytes);
    return 2.0 * bytes * kRepeats / since(t0);
  }

  size_t resize_buffer(size_t bytes) override {
    const size_t words = bytes / sizeof(uint64_t);
    if (words == words_) return buffer_bytes();
    std::free(buffer_);
    buffer_ = nullptr;
    words_ = 0;
    if (words == 0) return 0;
    void* p = std::aligned_alloc(64, words * sizeof(uint64_t));
    MGPU_CHECK(p, DeviceError, "out of host memory: cannot hold a ", bytes, "-byte stress buffer");
    buffer_ = static_cast<uint64_t*>(p);
    words_ = words;
    return buffer_bytes();
  }
  size_t buffer_bytes() const override { return words_ * sizeof(uint64_t); }

  StressCheck memory(const std::string& pattern_name, uint64_t seed, int pass, bool inject_fault) override {
    const StressPattern pattern = parse_stress_pattern(pattern_name);
    MGPU_CHECK(words_ > 0, ConfigError, "the memory pass needs a buffer (resize_buffer first)");
    const long len = static_cast<long>(words_);
    StressCheck c;
    auto t0 = Clock::now();
    const long pairs = (len + 1) / 2;  // stress_word_pair's unit, as the GPU kernels'
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (long k = 0; k < pairs; ++k) {
      uint64_t w[2];
      stress_word_pair(pattern, seed, pass, k, w);
      buffer_[2 * k] = w[0];
      if (2 * k + 1 < len) buffer_[2 * k + 1] = w[1];
    }
    c.seconds = since(t0);
    if (inject_fault) buffer_[words_ / 2] ^= uint64_t{1} << 17;
    int64_t wrong = 0;
    t0 = Clock::now();
#pragma omp parallel for num_threads(threads_) reduction(+ : wrong) schedule(static)
    for (long k = 0; k < pairs; ++k) {
      uint64_t w[2];
      stress_word_pair(pattern, seed, pass, k, w);
      wrong += buffer_[2 * k] != w[0];
      if (2 * k + 1 < len) wrong += buffer_[2 * k + 1] != w[1];
    }
    c.seconds += since(t0);
    c.work = 2.0 * buffer_bytes();  // written once, read once
    c.checked = len;
    c.mismatches = wrong;
    return c;
  }

 private:
  static void add(StressCheck& total, const StressCheck& part) {
    total.checked += part.checked;
    total.mismatches += part.mismatches;
    total.nonfinite += part.nonfinite;
  }
  static void flip_bit(float* x) {
    uint32_t bits;
    std::memcpy(&bits, x, sizeof(bits));
    bits ^= 1u << 22;  // the top mantissa bit: a 25-50% error that any tolerance catches
    std::memcpy(x, &bits, sizeof(bits));
  }

  int threads_;
  std::vector<float> values_, a_, b_, c_, first_;
  int gemm_n_ = 0;
  uint64_t gemm_seed_ = 0;
  uint64_t* buffer_ = nullptr;
  size_t words_ = 0;
};

}  // namespace

#ifdef MGPU_HAVE_CUDA
std::shared_ptr<StressDevice> make_cuda_stress_device(int device_index);  // kernels/stress.cu
#endif

std::shared_ptr<StressDevice> make_stress_device(const std::string& device, int device_index, int threads) {
  if (device == "cpu") return std::make_shared<CpuStress>(threads);
  if (device == "cuda") {
#ifdef MGPU_HAVE_CUDA
    return make_cuda_stress_device(device_index);
#else
    (void)device_index;
    throw DeviceError("this build of mgpu has no CUDA backend (built without the CUDA toolkit); use --device cpu");
#endif
  }
  throw ConfigError("unknown device '" + device + "' (expected cpu or cuda)");
}

}  // namespace mgpu
