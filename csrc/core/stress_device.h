// StressDevice: the seam for burn-in kernels that load a device and verify
// every result (so a faulty device is caught, not just heated): a
// transcendental compute burn, repeated GEMMs on fixed random inputs, and
// memory patterns written and read back. CPU: csrc/cpu/cpu_stress.cpp.
// `inject_fault` flips one bit of one result before it is checked: the test
// hook that proves the verification can fail.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace mgpu {

struct StressCheck {
  int64_t checked = 0;     // results compared
  int64_t mismatches = 0;  // results that differed from their reference
  int64_t nonfinite = 0;   // NaN/Inf among the results
  double seconds = 0.0;    // time of the kernel work (verification excluded)
  double work = 0.0;       // transcendental ops, FLOPs or bytes moved, by kernel
};

class StressDevice {
 public:
  virtual ~StressDevice() = default;
  virtual std::string name() const = 0;
  // Transcendental chain (sin cos tan atan exp log sqrt pow sinh cosh) over n
  // values, `iterations` times; `sample` of them recomputed by the reference.
  virtual StressCheck compute(size_t n, int iterations, uint64_t seed, size_t sample, bool inject_fault) = 0;
  // C (n, n) = A B on fixed random inputs, `repeats` times; every result
  // compared element by element with the first (relative tolerance `tol`),
  // and the first, once per (n, seed, precision), checked on its own at
  // kStressGemmChecks samples (gemm_verify's check; counted in the result).
  // precision: "fp32", or "tf32" / "bf16" where the device has them.
  virtual StressCheck gemm(int n, int repeats, uint64_t seed, double tol, bool inject_fault,
                           const std::string& precision) = 0;
  // The independent check alone, on host matrices a, b, c (n, n) row-major:
  // `samples` elements of c (stress_sample_index over n * n) recomputed as fp64
  // dot products of a and b (rounded to bf16 first for "bf16") must lie within
  // stress_gemm_bound (stress_math.h). Lets tests hand it a corrupted c.
  virtual StressCheck gemm_verify(int n, const float* a, const float* b, const float* c, const std::string& precision,
                                  size_t samples) = 0;
  // Reference for the memory pass: bytes/s (read + written) of a plain
  // device-to-device copy of `bytes`.
  virtual double copy_bandwidth(size_t bytes) = 0;
  // The pattern buffer: grown (or shrunk) to `bytes`; returns what it holds.
  virtual size_t resize_buffer(size_t bytes) = 0;
  virtual size_t buffer_bytes() const = 0;
  // Write "walking_ones" | "address" | "random" over the buffer, read it back,
  // count words that differ. `pass` varies the pattern between passes.
  virtual StressCheck memory(const std::string& pattern, uint64_t seed, int pass, bool inject_fault) = 0;
};

// "cpu" (threads: OpenMP/BLAS threads; 0 = every available core).
std::shared_ptr<StressDevice> make_stress_device(const std::string& device, int device_index, int threads);

}  // namespace mgpu
