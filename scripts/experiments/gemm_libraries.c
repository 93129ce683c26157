// Times one fp32 GEMM shape with OpenBLAS (cblas_sgemm), oneDNN (dnnl_sgemm),
// libxsmm's BLAS interface (libxsmm_sgemm: JIT kernels for products up to its
// size threshold, the BLAS for the rest) and libxsmm's JIT kernel asked for this
// shape directly (libxsmm_smmdispatch; "nan" where it makes none), alternating
// within every repeat so the machine's drift falls on all.
// Driven by scripts/experiments/gemm_libraries.py, which compiles it and feeds it a model's
// GEMM shapes; not part of the package (libxsmm is not one of mgpu's libraries; the
// answer, measured and not adopted, is in docs/journal.md).
//
//   gemm_libraries FORM M N K REPEATS    FORM: nt (forward), nn (input gradient),
//                                              tn (weight gradient), row-major
// prints: "openblas_s onednn_s libxsmm_s libxsmm_jit_s max_abs_diff" (median seconds per call)
#include <cblas.h>
#include <dnnl.h>
#include <libxsmm.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int by_value(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static double median(double* v, int n) {
  qsort(v, n, sizeof(double), by_value);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Row-major C (M, N) = op(A) op(B): A is (M, K) or, transposed, (K, M); B is (K, N) or (N, K).
typedef struct {
  int ta, tb, M, N, K;
  const float *A, *B;
  float* C;
} Gemm;

static void run_openblas(const Gemm* g) {
  cblas_sgemm(CblasRowMajor, g->ta ? CblasTrans : CblasNoTrans, g->tb ? CblasTrans : CblasNoTrans, g->M, g->N,
              g->K, 1.0f, g->A, g->ta ? g->M : g->K, g->B, g->tb ? g->K : g->N, 0.0f, g->C, g->N);
}

static void run_onednn(const Gemm* g) {
  dnnl_sgemm(g->ta ? 'T' : 'N', g->tb ? 'T' : 'N', g->M, g->N, g->K, 1.0f, g->A, g->ta ? g->M : g->K, g->B,
             g->tb ? g->K : g->N, 0.0f, g->C, g->N);
}

// libxsmm is column-major: row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T.
static void run_libxsmm(const Gemm* g) {
  const char ta = g->tb ? 'T' : 'N', tb = g->ta ? 'T' : 'N';
  const libxsmm_blasint m = g->N, n = g->M, k = g->K;
  const libxsmm_blasint lda = g->tb ? g->K : g->N, ldb = g->ta ? g->M : g->K, ldc = g->N;
  const float alpha = 1.0f, beta = 0.0f;
  libxsmm_sgemm(&ta, &tb, &m, &n, &k, &alpha, g->B, &lda, g->A, &ldb, &beta, g->C, &ldc);
}

static libxsmm_smmfunction jit_kernel;  // dispatched once for the shape (column-major, as above)

static libxsmm_smmfunction dispatch_jit(const Gemm* g) {
  const libxsmm_blasint lda = g->tb ? g->K : g->N, ldb = g->ta ? g->M : g->K, ldc = g->N;
  const float alpha = 1.0f, beta = 0.0f;
  const int flags = (g->tb ? LIBXSMM_GEMM_FLAG_TRANS_A : 0) | (g->ta ? LIBXSMM_GEMM_FLAG_TRANS_B : 0);
  return libxsmm_smmdispatch(g->N, g->M, g->K, &lda, &ldb, &ldc, &alpha, &beta, &flags, NULL);
}

static void run_libxsmm_jit(const Gemm* g) { jit_kernel(g->B, g->A, g->C); }

int main(int argc, char** argv) {
  if (argc != 6 || strlen(argv[1]) != 2) {
    fprintf(stderr, "usage: %s nt|nn|tn M N K REPEATS\n", argv[0]);
    return 2;
  }
  Gemm g;
  g.ta = argv[1][0] == 't';
  g.tb = argv[1][1] == 't';
  g.M = atoi(argv[2]);
  g.N = atoi(argv[3]);
  g.K = atoi(argv[4]);
  const int repeats = atoi(argv[5]);
  if (g.M < 1 || g.N < 1 || g.K < 1 || repeats < 1) {
    fprintf(stderr, "M, N, K and REPEATS must be >= 1\n");
    return 2;
  }
  libxsmm_init();
  float* A = malloc(sizeof(float) * (size_t)g.M * g.K);
  float* B = malloc(sizeof(float) * (size_t)g.K * g.N);
  enum { kLibs = 4 };
  float* C[kLibs];
  for (int l = 0; l < kLibs; ++l) C[l] = calloc((size_t)g.M * g.N, sizeof(float));
  srand(7);
  for (size_t i = 0; i < (size_t)g.M * g.K; ++i) A[i] = (float)rand() / RAND_MAX - 0.5f;
  for (size_t i = 0; i < (size_t)g.K * g.N; ++i) B[i] = (float)rand() / RAND_MAX - 0.5f;
  g.A = A;
  g.B = B;
  jit_kernel = dispatch_jit(&g);
  void (*run[kLibs])(const Gemm*) = {run_openblas, run_onednn, run_libxsmm, run_libxsmm_jit};
  const int libs = jit_kernel ? kLibs : kLibs - 1;
  // Enough calls per timing for ~1 ms, so clock reads do not count.
  const double flops = 2.0 * g.M * g.N * g.K;
  const int calls = flops > 2e8 ? 1 : (int)(2e8 / flops) > 1000 ? 1000 : (int)(2e8 / flops);
  double* times[kLibs];
  for (int l = 0; l < kLibs; ++l) times[l] = malloc(sizeof(double) * repeats);
  for (int l = 0; l < libs; ++l) {  // warm-up: JIT, page faults
    g.C = C[l];
    run[l](&g);
  }
  for (int r = 0; r < repeats; ++r)
    for (int j = 0; j < libs; ++j) {
      const int l = (r + j) % libs;  // each library in every position
      g.C = C[l];
      const double t0 = now();
      for (int c = 0; c < calls; ++c) run[l](&g);
      times[l][r] = (now() - t0) / calls;
    }
  double diff = 0.0;
  for (size_t i = 0; i < (size_t)g.M * g.N; ++i)
    for (int l = 1; l < libs; ++l) diff = fmax(diff, fabs((double)C[l][i] - C[0][i]));
  const double jit = jit_kernel ? median(times[3], repeats) : NAN;
  printf("%.9g %.9g %.9g %.9g %.3g\n", median(times[0], repeats), median(times[1], repeats),
         median(times[2], repeats), jit, diff);
  libxsmm_finalize();
  return 0;
}
