// CPU backend implementation (see cpu_backend.h). Loops are written so that the
// result never depends on the thread count except through floating-point
// reductions (loss sums, sum_squares), which are deterministic for a fixed count,
// and on AVX-512 CPUs through the library of narrow GEMMs (CpuGemm's rule).
#include "cpu_backend.h"

#include <cblas.h>
#include <sched.h>
#include <sys/mman.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#ifdef MGPU_HAVE_ONEDNN
#include <dnnl.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

#include "../core/async_signals.h"
#include "../core/errors.h"
#include "../core/philox.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef MGPU_HAVE_OPENBLAS
extern "C" void openblas_set_num_threads(int num_threads);
#endif

namespace mgpu {

namespace {
constexpr size_t kAlign = 64;
constexpr size_t kHugePage = size_t(2) << 20;  // x86-64's transparent huge page
// Below this many elements a parallel region costs more than it saves. The loops say
// `if (parallel: ...)`: a bare if clause on `parallel for simd` also governs the simd
// part (OpenMP 5.0), and GCC then runs every loop under the limit scalar.
constexpr long kParallelMin = 1 << 15;

constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;

#ifdef __AVX2__
// Eight Philox4x32-10 counters {g0 + l, sample, layer, step} in AVX2 registers, words
// stored to w_k[g0 .. g0 + 7]. vpmuludq multiplies the even 32-bit lanes into 64-bit
// products; the odd lanes are shifted down for a second multiply, and the high and
// low halves are blended back into lanes. GCC's own vectorisation of the lane loop
// shuffled through 64-bit lanes and cost about twice as much.
inline void philox_avx2_8(int g0, uint32_t sample, uint32_t layer, uint32_t step, uint32_t key0, uint32_t key1,
                          uint32_t* w0, uint32_t* w1, uint32_t* w2, uint32_t* w3) {
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(kMul0)), m1 = _mm256_set1_epi32(static_cast<int>(kMul1));
  __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(g0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i c1 = _mm256_set1_epi32(static_cast<int>(sample)), c2 = _mm256_set1_epi32(static_cast<int>(layer));
  __m256i c3 = _mm256_set1_epi32(static_cast<int>(step));
  uint32_t k0 = key0, k1 = key1;
  for (int round = 0; round < 10; ++round) {
    const __m256i e0 = _mm256_mul_epu32(c0, m0), o0 = _mm256_mul_epu32(_mm256_srli_epi64(c0, 32), m0);
    const __m256i e1 = _mm256_mul_epu32(c2, m1), o1 = _mm256_mul_epu32(_mm256_srli_epi64(c2, 32), m1);
    const __m256i hi0 = _mm256_blend_epi32(_mm256_srli_epi64(e0, 32), o0, 0xAA);
    const __m256i lo0 = _mm256_blend_epi32(e0, _mm256_slli_epi64(o0, 32), 0xAA);
    const __m256i hi1 = _mm256_blend_epi32(_mm256_srli_epi64(e1, 32), o1, 0xAA);
    const __m256i lo1 = _mm256_blend_epi32(e1, _mm256_slli_epi64(o1, 32), 0xAA);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(static_cast<int>(k0)));
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
    c1 = lo1;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w0 + g0), c0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w1 + g0), c1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w2 + g0), c2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w3 + g0), c3);
}
#endif

// philox_draw (philox.h) for counters {g, sample, layer, step}, g = 0..groups-1,
// eight counters at a time (AVX2 registers, or lane arrays the compiler vectorises);
// word k of counter g goes to w_k[g]. Same numbers as the scalar function.
void philox_lanes(const DropoutKey& key, uint32_t sample, int groups, uint32_t* w0, uint32_t* w1, uint32_t* w2,
                  uint32_t* w3) {
  constexpr int kLanes = 8;
  const uint32_t key0 = static_cast<uint32_t>(key.seed);
  const uint32_t key1 =
      static_cast<uint32_t>(key.seed >> 32) ^ (static_cast<uint32_t>(RngStream::kDropout) * 0x9E3779B9u);
  int first = 0;
#ifdef __AVX2__
  for (; first + kLanes <= groups; first += kLanes)
    philox_avx2_8(first, sample, key.layer, static_cast<uint32_t>(key.step), key0, key1, w0, w1, w2, w3);
#endif
  for (int g0 = first; g0 < groups; g0 += kLanes) {
    uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      c0[l] = static_cast<uint32_t>(g0 + l);
      c1[l] = sample;
      c2[l] = key.layer;
      c3[l] = static_cast<uint32_t>(key.step);
    }
    uint32_t k0 = key0, k1 = key1;
    for (int round = 0; round < 10; ++round) {
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) {
        const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0[l];
        const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2[l];
        const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1[l] ^ k0;
        const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3[l] ^ k1;
        c1[l] = static_cast<uint32_t>(p1);
        c3[l] = static_cast<uint32_t>(p0);
        c0[l] = n0;
        c2[l] = n2;
      }
      k0 += kWeyl0;
      k1 += kWeyl1;
    }
    const int n = std::min(kLanes, groups - g0);
    if (n == kLanes) {  // fixed-size copies compile to vector stores
      std::memcpy(w0 + g0, c0, sizeof(c0));
      std::memcpy(w1 + g0, c1, sizeof(c1));
      std::memcpy(w2 + g0, c2, sizeof(c2));
      std::memcpy(w3 + g0, c3, sizeof(c3));
      continue;
    }
    for (int l = 0; l < n; ++l) {
      w0[g0 + l] = c0[l];
      w1[g0 + l] = c1[l];
      w2[g0 + l] = c2[l];
      w3[g0 + l] = c3[l];
    }
  }
}
}  // namespace

int available_cpu_threads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

bool onednn_available() {
#ifdef MGPU_HAVE_ONEDNN
  return true;
#else
  return false;
#endif
}

std::string onednn_version() {
#ifdef MGPU_HAVE_ONEDNN
  const dnnl_version_t* v = dnnl_version();
  return std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
#else
  return "";
#endif
}

#if defined(MGPU_HAVE_ONEDNN) && defined(_OPENMP)
namespace {
// oneDNN runs its GEMMs on the calling thread's OpenMP team, whose workers only compute:
// they hold asynchronous signals for good (async_signals.h says why). The runtime keeps
// a pool of workers per calling thread, but not always the same threads: a smaller team
// of two or more ends the extra workers, and a larger one after it starts new ones, with
// the mask their creator had then, maybe outside any hold. So once per hold of the
// caller (and again if the team grows within it) a region checks every worker: one that
// does not hold yet starts to. Called with the caller's signals held, so that workers
// the region itself creates start held.
void hold_signals_in_openmp_workers(int threads) {
  static thread_local uint64_t checked_in = 0;  // the caller's hold whose team was checked
  static thread_local int checked_threads = 0;
  const uint64_t hold = AsynchronousSignalsHeld::generation();
  if (threads <= 1 || (hold == checked_in && threads <= checked_threads)) return;
#pragma omp parallel num_threads(threads)
  {
    static thread_local bool holds = false;
    if (!holds && omp_get_thread_num() != 0) {
      pthread_sigmask(SIG_BLOCK, &asynchronous_signals(), nullptr);
      holds = true;
    }
  }
  checked_in = hold;
  checked_threads = threads;
}
}  // namespace
#endif

CpuGemm parse_cpu_gemm(const std::string& name) {
  if (name == "auto") return CpuGemm::kAuto;
  if (name == "openblas") return CpuGemm::kOpenBlas;
  if (name == "onednn") return CpuGemm::kOneDnn;
  throw ConfigError("CPU GEMM library must be 'auto', 'openblas' or 'onednn', got '" + name + "'");
}

const char* cpu_gemm_name(CpuGemm gemm) {
  switch (gemm) {
    case CpuGemm::kOpenBlas: return "openblas";
    case CpuGemm::kOneDnn: return "onednn";
    default: return "auto";
  }
}

CpuBackend::CpuBackend(int threads) {
  set_threads(threads);
  if (const char* env = std::getenv("MGPU_CPU_GEMM"); env && *env) {
    try {
      set_gemm(parse_cpu_gemm(env));
    } catch (const ConfigError& e) {
      throw ConfigError(std::string("MGPU_CPU_GEMM: ") + e.what());
    }
  }
}

void CpuBackend::set_gemm(CpuGemm gemm) {
  MGPU_CHECK(gemm != CpuGemm::kOneDnn || onednn_available(), ConfigError,
             "this build of mgpu has no oneDNN (install libdnnl-dev and rebuild), so the CPU GEMM "
             "cannot be 'onednn'");
  gemm_ = gemm;
}

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

CpuGemm auto_cpu_gemm(int M, int N, int K, int threads, bool avx512, bool onednn) {
  if (!onednn || M == 0 || N == 0 || K == 0) return CpuGemm::kOpenBlas;
  if (avx512) return threads > 1 || N >= kOneDnnMinWidthAvx512 ? CpuGemm::kOneDnn : CpuGemm::kOpenBlas;
  if (threads > 1) return CpuGemm::kOpenBlas;
  return double(M) * N * K <= kOneDnnMaxWork ? CpuGemm::kOneDnn : CpuGemm::kOpenBlas;
}

CpuGemm CpuBackend::gemm_library(int M, int N, int K) const {
  if (gemm_ != CpuGemm::kAuto) return gemm_;
  return auto_cpu_gemm(M, N, K, threads_, cpu_has_avx512(), onednn_available());
}

void CpuBackend::sgemm(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda, const float* B,
                       int ldb, float beta, float* C, int ldc) {
#ifdef MGPU_HAVE_ONEDNN
  if (gemm_library(M, N, K) == CpuGemm::kOneDnn) {
    const AsynchronousSignalsHeld no_handler_inside_the_kernel;  // async_signals.h
    // oneDNN threads with OpenMP: this thread's team size is its ICV, set per call
    // because ranks-as-threads (thread_group.py) call from several threads.
#ifdef _OPENMP
    omp_set_num_threads(threads_);
    hold_signals_in_openmp_workers(threads_);
#endif
    const dnnl_status_t status =
        dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
    MGPU_CHECK(status == dnnl_success, DeviceError, "oneDNN sgemm (", M, " x ", N, " x ", K, ") failed with status ",
               int(status));
    return;
  }
#endif
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, A,
              lda, B, ldb, beta, C, ldc);
}

void CpuBackend::set_threads(int threads) {
  MGPU_CHECK(threads >= 1, ConfigError, "threads must be >= 1, got ", threads);
  threads_ = threads;
#ifdef MGPU_HAVE_OPENBLAS
  openblas_set_num_threads(threads);
#endif
}

void* CpuBackend::allocate_bytes(size_t bytes) {
  // Buffers of a huge page or more are huge-page aligned and ask for transparent huge
  // pages (Debian's default THP mode serves only regions that ask): MPI's shared-memory
  // allreduce runs markedly slower over 4 KiB pages (docs/journal.md), and GEMMs walk
  // fewer TLB entries. Best effort: without THP the memory is simply 4 KiB pages.
  const size_t align = bytes >= kHugePage ? kHugePage : kAlign;
  const size_t rounded = std::max((bytes + align - 1) / align * align, align);
  void* p = std::aligned_alloc(align, rounded);
  MGPU_CHECK(p, DeviceError, "out of host memory allocating ", bytes, " bytes");
  if (align == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);
  return p;
}
void CpuBackend::free_bytes(void* ptr) noexcept { std::free(ptr); }
void CpuBackend::copy_to_backend(void* dst, const void* src, size_t bytes) {
  refuse_in_capture("copy_to_backend");
  if (bytes) std::memcpy(dst, src, bytes);
}
void CpuBackend::copy_to_host(void* dst, const void* src, size_t bytes) {
  refuse_in_capture("copy_to_host");
  if (bytes) std::memcpy(dst, src, bytes);
}
void CpuBackend::zero(float* x, size_t n) {
  if (record([=] { zero(x, n); })) return;
  if (n) std::memset(x, 0, n * sizeof(float));
}

// --- capture: the CPU reference of CUDA graphs -------------------------------
bool CpuBackend::record(std::function<void()> call) {
  if (!captures_.capturing()) return false;
  recording_.push_back(std::move(call));
  return true;
}

// The same calls a CUDA graph cannot hold (they synchronise or read back).
void CpuBackend::refuse_in_capture(const char* what) const {
  MGPU_CHECK(!captures_.capturing(), DeviceError, what, " is not allowed in a capture");
}

void CpuBackend::begin_capture() {
  captures_.begin();
  recording_.clear();
}

int CpuBackend::end_capture() {
  captures_.end();
  const int graph = captures_.store(std::move(recording_));
  recording_.clear();
  return graph;
}

void CpuBackend::abort_capture() noexcept {
  captures_.abort();
  recording_.clear();
}

void CpuBackend::replay(int graph, const ReplayArgs& args) {
  const auto& calls = captures_.get(graph);
  replay_args_ = args;
  for (const auto& call : calls) call();
}

void CpuBackend::release_captures() {
  captures_.release([](auto&) {});
}

// inp (B, IN), weight (OUT, IN), bias (OUT) -> out (B, OUT)
void CpuBackend::linear_forward(float* out, const float* inp, const float* weight, const float* bias, int B, int IN,
                                int OUT) {
  if (record([=] { linear_forward(out, inp, weight, bias, B, IN, OUT); })) return;
  if (B == 0) return;
    // Seed the output with the bias so the GEMM adds onto it (beta = 1): no extra pass.
#pragma omp parallel for num_threads(threads_) if (long(B) * OUT > kParallelMin) schedule(static)
  for (int b = 0; b < B; ++b) std::memcpy(out + size_t(b) * OUT, bias, size_t(OUT) * sizeof(float));
  sgemm(false, true, B, OUT, IN, inp, IN, weight, IN, 1.0f, out, OUT);
}

// dout (B, OUT), inp (B, IN), weight (OUT, IN) -> dweight (OUT, IN), dbias (OUT), dinp (B, IN)
void CpuBackend::linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                 const float* weight, int B, int IN, int OUT, bool accumulate) {
  if (record([=] { linear_backward(dinp, dweight, dbias, dout, inp, weight, B, IN, OUT, accumulate); })) return;
  const float beta = accumulate ? 1.0f : 0.0f;
  if (dinp) sgemm(false, false, B, IN, OUT, dout, OUT, weight, IN, 0.0f, dinp, IN);
  sgemm(true, false, OUT, IN, B, dout, OUT, inp, IN, beta, dweight, IN);
  // Column sums, split by columns so each thread owns its outputs (deterministic).
  constexpr int kCols = 256;
  const int blocks = (OUT + kCols - 1) / kCols;
#pragma omp parallel for num_threads(threads_) if (long(B) * OUT > kParallelMin) schedule(static)
  for (int blk = 0; blk < blocks; ++blk) {
    const int j0 = blk * kCols, j1 = std::min(OUT, j0 + kCols);
    float* db = dbias + j0;
    if (!accumulate)
      for (int j = 0; j < j1 - j0; ++j) db[j] = 0.0f;
    for (int b = 0; b < B; ++b) {
      const float* row = dout + size_t(b) * OUT + j0;
#pragma omp simd
      for (int j = 0; j < j1 - j0; ++j) db[j] += row[j];
    }
  }
}

void CpuBackend::relu_dropout_forward(float* h, int B, int C, float p, const DropoutKey& key) {
  // Replays draw the mask of the replayed step and rows (as the CUDA graph reads them from device memory).
  if (record([=] {
        DropoutKey replayed = key;
        replayed.step = replay_args_.step;
        replayed.first_sample = replay_args_.first_sample;
        relu_dropout_forward(h, B, C, p, replayed);
      }))
    return;
  if (p <= 0.0f) {
    const long n = long(B) * C;
#pragma omp parallel for simd num_threads(threads_) if (parallel : n > kParallelMin) schedule(static)
    for (long i = 0; i < n; ++i) h[i] = h[i] <= 0.0f ? 0.0f : h[i];
    return;
  }
  const float keep_scale = 1.0f / (1.0f - p);
  const int groups = dropout_groups(C);
#pragma omp parallel num_threads(threads_) if (long(B) * C > kParallelMin)
  {
    // bits[k * groups + g] = word k of Philox counter g: four contiguous streams,
    // so the generator loop vectorises across counters.
    std::vector<uint32_t> bits(4 * size_t(groups));
#pragma omp for schedule(static)
    for (int b = 0; b < B; ++b) {
      const uint32_t sample = static_cast<uint32_t>(key.first_sample + b);
      uint32_t* w0 = bits.data();
      uint32_t* w1 = w0 + groups;
      uint32_t* w2 = w1 + groups;
      uint32_t* w3 = w2 + groups;
      philox_lanes(key, sample, groups, w0, w1, w2, w3);
      float* row = h + size_t(b) * C;
#pragma omp simd
      for (int j = 0; j < C; ++j) {
        const float v = row[j];
        const float keep = uniform01(bits[j]) >= p ? keep_scale : 0.0f;
        row[j] = (v <= 0.0f ? 0.0f : v) * keep;
      }
    }
  }
}

void CpuBackend::relu_dropout_backward(float* dh, const float* h, size_t n, float p) {
  if (record([=] { relu_dropout_backward(dh, h, n, p); })) return;
  const float keep_scale = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
  const long len = static_cast<long>(n);
#pragma omp parallel for simd num_threads(threads_) if (parallel : len > kParallelMin) schedule(static)
  for (long i = 0; i < len; ++i) {
    // The product computed on both paths: GCC does not speculate a (possibly trapping)
    // FP multiply, and a branch on a random mask is mispredicted half the time.
    const float scaled = dh[i] * keep_scale;
    dh[i] = h[i] <= 0.0f ? 0.0f : scaled;
  }
}

// pred (B, D), target (B, D) -> loss_out = grad_scale * sum (pred - target)^2, dpred
void CpuBackend::mse_forward_backward(float* loss_out, float* dpred, const float* pred, const float* target, int B,
                                      int D, float grad_scale) {
  if (record([=] { mse_forward_backward(loss_out, dpred, pred, target, B, D, replay_args_.grad_scale); })) return;
  const long n = long(B) * D;
  double sum = 0.0;
  const float two_scale = 2.0f * grad_scale;
#pragma omp parallel for simd num_threads(threads_) if (parallel : n > kParallelMin) reduction(+ : sum) schedule(static)
  for (long i = 0; i < n; ++i) {
    const float diff = pred[i] - target[i];
    sum += double(diff) * diff;
    if (dpred) dpred[i] = two_scale * diff;
  }
  *loss_out = static_cast<float>(sum * grad_scale);
}

// logits (B, C), labels (B) -> loss_out = grad_scale * sum -log softmax[label], dlogits, correct
void CpuBackend::cross_entropy_forward_backward(float* loss_out, float* dlogits, float* correct_out,
                                                const float* logits, const int32_t* labels, int B, int C,
                                                float grad_scale) {
  if (record([=] {
        cross_entropy_forward_backward(loss_out, dlogits, correct_out, logits, labels, B, C, replay_args_.grad_scale);
      }))
    return;
  double sum = 0.0;
  long hits = 0, bad = 0, first_bad = B;  // rows whose label is outside [0, C): left out, then reported
#pragma omp parallel for num_threads(threads_) if (long(B) * C > kParallelMin) \
    reduction(+ : sum, hits, bad) reduction(min : first_bad) schedule(static)
  for (int b = 0; b < B; ++b) {
    const float* x = logits + size_t(b) * C;
    const int y = labels[b];
    const bool valid = y >= 0 && y < C;
    if (!valid) {
      bad += 1;
      first_bad = std::min<long>(first_bad, b);
      if (dlogits) std::fill(dlogits + size_t(b) * C, dlogits + size_t(b + 1) * C, 0.0f);
      continue;
    }
    int argmax = 0;
    for (int j = 1; j < C; ++j)
      if (x[j] > x[argmax]) argmax = j;
    const float mx = x[argmax];
    double denom = 0.0;
    for (int j = 0; j < C; ++j) denom += std::exp(double(x[j] - mx));
    sum += std::log(denom) - double(x[y] - mx);
    hits += argmax == y;
    if (dlogits) {
      float* g = dlogits + size_t(b) * C;
      const float inv = static_cast<float>(1.0 / denom);
      for (int j = 0; j < C; ++j) g[j] = grad_scale * (std::exp(x[j] - mx) * inv - (j == y ? 1.0f : 0.0f));
    }
  }
  *loss_out = static_cast<float>(sum * grad_scale);
  if (correct_out) *correct_out = static_cast<float>(hits);
  if (bad) throw ConfigError(label_range_error(first_bad, labels[first_bad], C, static_cast<unsigned long long>(bad)));
}

namespace {
// g + w * p as this build computes it without a scaled g (one FMA where the
// hardware has one, else two roundings), spelled out: left to GCC's contraction
// (-ffp-contract=fast with -march=native), g = grad * grad_scale would be the
// product fused into the FMA instead, and the fused update would no longer equal
// a separate scale pass followed by the update.
inline float plus_product(float g, float w, float p) {
#ifdef FP_FAST_FMAF
  return std::fma(w, p, g);
#else
  return g + w * p;
#endif
}
}  // namespace

void CpuBackend::sgd_update(float* param, const float* grad, float* buf, size_t n, const SgdParams& hp) {
  // Replays take the replayed step's learning rate and first-step flag (as the CUDA graph reads them).
  if (record([=] { sgd_apply(param, grad, buf, n, hp, replay_args_.update); })) return;
  sgd_apply(param, grad, buf, n, hp, update_scalars(hp));
}

void CpuBackend::sgd_apply(float* param, const float* grad, float* buf, size_t n, const SgdParams& hp,
                           const UpdateScalars& s) {
  float gs = 1.0f;
  if (!update_runs(hp.verdict, hp.grad_scale, gs)) return;
  const long len = static_cast<long>(n);
  const float lr = s.lr, wd = hp.weight_decay, mom = hp.momentum;
  if (mom > 0.0f && s.first_step) {  // the buffer starts as the first gradient
#pragma omp parallel for simd num_threads(threads_) if (parallel : len > kParallelMin) schedule(static)
    for (long i = 0; i < len; ++i) {
      const float g = plus_product(grad[i] * gs, wd, param[i]);
      buf[i] = g;
      param[i] -= lr * g;
    }
  } else if (mom > 0.0f) {
#pragma omp parallel for simd num_threads(threads_) if (parallel : len > kParallelMin) schedule(static)
    for (long i = 0; i < len; ++i) {
      const float g = plus_product(grad[i] * gs, wd, param[i]);
      const float b = mom * buf[i] + g;
      buf[i] = b;
      param[i] -= lr * b;
    }
  } else {
#pragma omp parallel for simd num_threads(threads_) if (parallel : len > kParallelMin) schedule(static)
    for (long i = 0; i < len; ++i) {
      const float gi = grad[i] * gs;
      param[i] -= lr * plus_product(gi, wd, param[i]);
    }
  }
}

void CpuBackend::adamw_update(float* param, const float* grad, float* m, float* v, size_t n, const AdamWParams& hp) {
  // Replays take the replayed step's bias-corrected step size and decay.
  if (record([=] { adamw_apply(param, grad, m, v, n, hp, replay_args_.update); })) return;
  adamw_apply(param, grad, m, v, n, hp, update_scalars(hp));
}

void CpuBackend::adamw_apply(float* param, const float* grad, float* m, float* v, size_t n, const AdamWParams& hp,
                             const UpdateScalars& s) {
  float gs = 1.0f;
  if (!update_runs(hp.verdict, hp.grad_scale, gs)) return;
  const long len = static_cast<long>(n);
  const float step_size = s.step_size, inv_sqrt_bc2 = s.inv_sqrt_bc2, decay = s.decay;
  const float one_minus_b1 = 1.0f - hp.beta1, one_minus_b2 = 1.0f - hp.beta2;
  const float b2 = hp.beta2, eps = hp.eps;
#pragma omp parallel for simd num_threads(threads_) if (parallel : len > kParallelMin) schedule(static)
  for (long i = 0; i < len; ++i) {
    // Not contracted into g - m[i]: g also feeds a product (g * g), and GCC only
    // fuses a product all of whose uses are additions. The bit-identity test
    // (test_backend_ops_cpu.py) guards this.
    const float g = grad[i] * gs;
    const float mi = m[i] + one_minus_b1 * (g - m[i]);
    const float vi = b2 * v[i] + one_minus_b2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) * inv_sqrt_bc2 + eps;
    param[i] = param[i] * decay - step_size * (mi / denom);
  }
}

void CpuBackend::step_verdict(StepVerdict* verdict, const float* grads, size_t n, const float* slots, float loss_scale,
                              float max_norm, const int* comm_failed) {
  // Replays divide by the replayed step's loss scale. Invalid labels threw at the loss already.
  if (record([=] { decide(verdict, grads, n, slots, replay_args_.loss_scale, max_norm, comm_failed); })) return;
  decide(verdict, grads, n, slots, loss_scale, max_norm, comm_failed);
}

void CpuBackend::decide(StepVerdict* verdict, const float* grads, size_t n, const float* slots, float loss_scale,
                        float max_norm, const int* comm_failed) {
  verdict->sum_squares = sum_of_squares(grads, n);
  const bool usable = !(comm_failed && __atomic_load_n(comm_failed, __ATOMIC_ACQUIRE));
  decide_step(*verdict, slots, loss_scale, max_norm, usable);
}

void CpuBackend::shard_health_sums(float* sums, const float* grads, size_t n, const float* slots) {
  if (record([=] { shard_health_sums(sums, grads, n, slots); })) return;
  write_shard_sums(sums, slots, sum_of_squares(grads, n));
}

void CpuBackend::step_verdict_from_shards(StepVerdict* verdict, const float* all_sums, int ranks, float loss_scale,
                                          float max_norm, const int* comm_failed) {
  auto decide_at = [=](float scale) {
    const bool usable = !(comm_failed && __atomic_load_n(comm_failed, __ATOMIC_ACQUIRE));
    decide_sharded_step(*verdict, all_sums, ranks, scale, max_norm, usable);
  };
  // Replays divide by the replayed step's loss scale.
  if (record([this, decide_at] { decide_at(replay_args_.loss_scale); })) return;
  decide_at(loss_scale);
}

double CpuBackend::sum_squares(const float* x, size_t n) {
  refuse_in_capture("sum_squares (it reads back)");
  return sum_of_squares(x, n);
}

double CpuBackend::sum_of_squares(const float* x, size_t n) const {
  const long len = static_cast<long>(n);
  double sum = 0.0;
#pragma omp parallel for simd num_threads(threads_) if (parallel: len > kParallelMin) reduction(+ : sum) schedule(static)
  for (long i = 0; i < len; ++i) sum += double(x[i]) * x[i];
  return sum;
}

void CpuBackend::scale(float* x, size_t n, float alpha) {
  if (record([=] { scale(x, n, alpha); })) return;
  const long len = static_cast<long>(n);
#pragma omp parallel for simd num_threads(threads_) if (parallel : len > kParallelMin) schedule(static)
  for (long i = 0; i < len; ++i) x[i] *= alpha;
}

namespace {
// bf16 is fp32's top half: round to nearest even on the dropped 16 bits (NaN stays NaN).
uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16_bits(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
}  // namespace

// The CUDA kernels' reference (kernels/elementwise.cu): the same roundings,
// fp16 through the compiler's IEEE binary16 (_Float16).
void CpuBackend::narrow(void* half, const float* x, size_t n, Precision dtype) {
  const bool bf16 = is_bf16_not_fp16(dtype, "narrow");
  if (record([=] { narrow(half, x, n, dtype); })) return;
  if (bf16) {
    auto* out = static_cast<uint16_t*>(half);
    for (size_t i = 0; i < n; ++i) out[i] = bf16_bits(x[i]);
  } else {
    auto* out = static_cast<_Float16*>(half);
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<_Float16>(x[i]);
  }
}

void CpuBackend::widen(float* x, const void* half, size_t n, Precision dtype) {
  const bool bf16 = is_bf16_not_fp16(dtype, "widen");
  if (record([=] { widen(x, half, n, dtype); })) return;
  if (bf16) {
    const auto* in = static_cast<const uint16_t*>(half);
    for (size_t i = 0; i < n; ++i) x[i] = from_bf16_bits(in[i]);
  } else {
    const auto* in = static_cast<const _Float16*>(half);
    for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(in[i]);
  }
}

// The reference of kernels::gather_rows: a row copy each.
void CpuBackend::gather_rows(void* dst, const void* src, const int64_t* index, int rows, int W) {
  if (record([=] { gather_rows(dst, src, index, rows, W); })) return;
  const size_t row_bytes = size_t(W) * 4;
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
#pragma omp parallel for num_threads(threads_) if (parallel : long(rows) * W > kParallelMin) schedule(static)
  for (int r = 0; r < rows; ++r) std::memcpy(out + size_t(r) * row_bytes, in + size_t(index[r]) * row_bytes, row_bytes);
}

void CpuBackend::copy_within_backend(void* dst, const void* src, size_t bytes) {
  if (record([=] { copy_within_backend(dst, src, bytes); })) return;
  std::memcpy(dst, src, bytes);
}

void CpuBackend::axpy(float* y, const float* x, size_t n, float alpha) {
  if (record([=] { axpy(y, x, n, alpha); })) return;
  const long len = static_cast<long>(n);
#pragma omp parallel for simd num_threads(threads_) if (parallel : len > kParallelMin) schedule(static)
  for (long i = 0; i < len; ++i) y[i] += alpha * x[i];
}

}  // namespace mgpu
