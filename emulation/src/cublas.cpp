// cuBLAS stand-in of the GPU emulation (the calls mgpu makes, NVIDIA's
// prototypes from cublas_v2.h): column-major GEMMs on OpenBLAS, run as
// operations of the handle's stream. cuBLAS's own argument checks come first
// (CUBLAS_STATUS_INVALID_VALUE for a bad size or leading dimension); operands
// must be device memory of the handle's GPU. TF32 math rounds both inputs to
// TF32 (10-bit mantissa) first, and bf16/fp16 inputs are exact in float, so
// the numerics that mixed-precision tolerances must absorb are present. Also
// here: the cuRAND library call mgpu makes (the Philox header itself is NVIDIA's).
#include <cblas.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <curand.h>

#include <cstring>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "mgpu_emu/runtime.h"

struct cublasContext {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// OpenBLAS's own threads would spin beside the emulation's stream threads: one
// thread per GEMM (weak: any CBLAS serves).
extern "C" void openblas_set_num_threads(int num_threads) __attribute__((weak));

namespace {

std::mutex g_m;
std::unordered_set<const cublasContext*> g_handles;

bool valid(cublasHandle_t h) {
  std::lock_guard<std::mutex> lock(g_m);
  return h && g_handles.count(h);
}

// Round to nearest even at TF32's 10 explicit mantissa bits (Inf/NaN kept).
float to_tf32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7f800000u) == 0x7f800000u) return x;
  u += 0x0fffu + ((u >> 13) & 1u);
  u &= 0xffffe000u;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// Bytes spanned by a column-major (rows, cols) operand with leading dimension ld.
size_t span(int rows, int cols, int ld, size_t elem) {
  if (rows <= 0 || cols <= 0) return 0;
  return (size_t(cols - 1) * size_t(ld) + size_t(rows)) * elem;
}

size_t elem_size(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F: return 4;
    case CUDA_R_16F:
    case CUDA_R_16BF: return 2;
    default: return 0;
  }
}

// One operand as float: TF32-rounded, or widened from bf16/fp16.
std::vector<float> load(const void* p, int rows, int cols, int ld, cudaDataType_t type, bool tf32) {
  std::vector<float> out(size_t(ld) * size_t(cols > 0 ? cols : 0));
  for (int c = 0; c < cols; ++c)
    for (int r = 0; r < rows; ++r) {
      const size_t i = size_t(c) * size_t(ld) + size_t(r);
      float v;
      if (type == CUDA_R_32F)
        v = static_cast<const float*>(p)[i];
      else if (type == CUDA_R_16BF)
        v = __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
      else
        v = __half2float(static_cast<const __half*>(p)[i]);
      out[i] = tf32 ? to_tf32(v) : v;
    }
  return out;
}

cublasStatus_t gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                    const float* alpha, const void* A, cudaDataType_t a_type, int lda, const void* B,
                    cudaDataType_t b_type, int ldb, const float* beta, float* C, int ldc, bool tf32_allowed,
                    const char* call) {
  if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  auto op_ok = [](cublasOperation_t t) { return t == CUBLAS_OP_N || t == CUBLAS_OP_T || t == CUBLAS_OP_C; };
  if (!op_ok(ta) || !op_ok(tb) || m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
  const int a_rows = ta == CUBLAS_OP_N ? m : k, a_cols = ta == CUBLAS_OP_N ? k : m;
  const int b_rows = tb == CUBLAS_OP_N ? k : n, b_cols = tb == CUBLAS_OP_N ? n : k;
  if (lda < std::max(1, a_rows) || ldb < std::max(1, b_rows) || ldc < std::max(1, m))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (!alpha || !beta) return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const float a = *alpha, b = *beta;  // host pointer mode: read at the call
  const int device = h->device;
  const size_t ea = elem_size(a_type), eb = elem_size(b_type);
  for (const auto& chk : {std::make_pair(static_cast<const void*>(A), span(a_rows, a_cols, lda, ea)),
                          std::make_pair(static_cast<const void*>(B), span(b_rows, b_cols, ldb, eb)),
                          std::make_pair(static_cast<const void*>(C), span(m, n, ldc, 4))}) {
    if (chk.second == 0) continue;
    const std::string why = mgpu_emu::check_device_range(chk.first, chk.second, device, false);
    if (!why.empty()) {
      mgpu_emu::report_violation(device, cudaErrorIllegalAddress, std::string(call) + ": operand " + why);
      return CUBLAS_STATUS_EXECUTION_FAILED;
    }
  }
  const bool tf32 = tf32_allowed && h->math == CUBLAS_TF32_TENSOR_OP_MATH;
  mgpu_emu::counters().blas_calls++;
  const cudaError_t rc = mgpu_emu::enqueue(h->stream, call, mgpu_emu::OpKind::kBlas, [=] {
    mgpu_emu::touch(A, span(a_rows, a_cols, lda, ea), false, false);
    mgpu_emu::touch(B, span(b_rows, b_cols, ldb, eb), false, false);
    if (b != 0.0f) mgpu_emu::touch(C, span(m, n, ldc, 4), false, false);
    mgpu_emu::touch(C, span(m, n, ldc, 4), true, false);
    const auto cb = [](cublasOperation_t t) { return t == CUBLAS_OP_N ? CblasNoTrans : CblasTrans; };
    if (openblas_set_num_threads) openblas_set_num_threads(1);
    if (k == 0) {
      // C = beta C (cuBLAS's definition with an empty inner dimension).
      for (int c = 0; c < n; ++c)
        for (int r = 0; r < m; ++r) {
          float& v = C[size_t(c) * size_t(ldc) + size_t(r)];
          v = b == 0.0f ? 0.0f : b * v;
        }
      return;
    }
    if (a_type == CUDA_R_32F && b_type == CUDA_R_32F && !tf32) {
      cblas_sgemm(CblasColMajor, cb(ta), cb(tb), m, n, k, a, static_cast<const float*>(A), lda,
                  static_cast<const float*>(B), ldb, b, C, ldc);
      return;
    }
    const std::vector<float> fa = load(A, a_rows, a_cols, lda, a_type, tf32);
    const std::vector<float> fb = load(B, b_rows, b_cols, ldb, b_type, tf32);
    cblas_sgemm(CblasColMajor, cb(ta), cb(tb), m, n, k, a, fa.data(), lda, fb.data(), ldb, b, C, ldc);
  });
  return rc == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

}  // namespace

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return CUBLAS_STATUS_NOT_INITIALIZED;  // as cuBLAS without a GPU
  }
  auto* h = new cublasContext;
  h->device = device;
  std::lock_guard<std::mutex> lock(g_m);
  g_handles.insert(h);
  *handle = h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  std::lock_guard<std::mutex> lock(g_m);
  if (!handle || !g_handles.erase(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (!valid(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  const int device = mgpu_emu::device_of(stream);
  if (device < 0 || device != handle->device) return CUBLAS_STATUS_INVALID_VALUE;
  handle->stream = stream;
  // As cuBLAS: setting a stream resets a user workspace to the default one.
  handle->workspace = nullptr;
  handle->workspace_bytes = 0;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t bytes) {
  if (!valid(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (bytes > 0 && !mgpu_emu::check_device_range(workspace, bytes, handle->device, false).empty())
    return CUBLAS_STATUS_INVALID_VALUE;
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0) return CUBLAS_STATUS_INVALID_VALUE;
  handle->workspace = workspace;
  handle->workspace_bytes = bytes;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (!valid(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->math = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetProperty(libraryPropertyType type, int* value) {
  if (!value) return CUBLAS_STATUS_INVALID_VALUE;
  switch (type) {
    case MAJOR_VERSION: *value = CUBLAS_VER_MAJOR; break;
    case MINOR_VERSION: *value = CUBLAS_VER_MINOR; break;
    case PATCH_LEVEL: *value = CUBLAS_VER_PATCH; break;
    default: return CUBLAS_STATUS_INVALID_VALUE;
  }
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                              int k, const float* alpha, const float* A, int lda, const float* B, int ldb,
                              const float* beta, float* C, int ldc) {
  return gemm(handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, B, CUDA_R_32F, ldb, beta, C, ldc, true,
              "cublasSgemm");
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t) {
  // The combinations mgpu uses: fp32 output and accumulation over fp32/bf16/fp16 inputs.
  if (Ctype != CUDA_R_32F || Atype != Btype || elem_size(Atype) == 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  const bool tf32 = computeType == CUBLAS_COMPUTE_32F_FAST_TF32;
  if (computeType != CUBLAS_COMPUTE_32F && computeType != CUBLAS_COMPUTE_32F_PEDANTIC && !tf32)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  return gemm(handle, transa, transb, m, n, k, static_cast<const float*>(alpha), A, Atype, lda, B, Btype, ldb,
              static_cast<const float*>(beta), static_cast<float*>(C), ldc, Atype == CUDA_R_32F && tf32,
              "cublasGemmEx");
}

curandStatus_t curandGetVersion(int* version) {
  if (!version) return CURAND_STATUS_NOT_INITIALIZED;
  *version = CURAND_VERSION;
  return CURAND_STATUS_SUCCESS;
}

}  // extern "C"
