// Implementation of cuda_api.h: device discovery, versions, the backend
// factory and host-side test hooks.
#include "cuda_api.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <curand.h>
#ifdef MGPU_HAVE_NCCL
#include <nccl.h>
#endif

#include "../../kernels/cuda_check.cuh"
#include "../../kernels/kernels.cuh"
#include "cuda_backend.h"

namespace mgpu {

namespace cuda {

namespace {
// 13000 -> "13.0" (CUDA runtime and driver encoding: 1000 major + 10 minor).
std::string cuda_version_string(int v) {
  if (v <= 0) return "";
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}
std::string triple(int a, int b, int c) {
  return std::to_string(a) + "." + std::to_string(b) + "." + std::to_string(c);
}
}  // namespace

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // not sticky, but leave nothing behind
    return 0;
  }
  return n;
}

std::string no_device_reason() {
  int n = 0;
  const cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc == cudaSuccess) return n > 0 ? "" : "the CUDA runtime reports 0 devices";
  cudaGetLastError();
  return std::string(cudaGetErrorName(rc)) + ": " + cudaGetErrorString(rc);
}

DeviceInfo device_info(int index) {
  const int n = device_count();
  MGPU_CHECK(index >= 0 && index < n, DeviceError, "device index ", index, " out of range: ", n, " GPU",
             n == 1 ? "" : "s", " visible");
  cudaDeviceProp prop{};
  MGPU_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  DeviceInfo info;
  info.index = index;
  info.name = prop.name;
  info.total_memory = prop.totalGlobalMem;
  info.multiprocessors = prop.multiProcessorCount;
  info.major = prop.major;
  info.minor = prop.minor;
  char bus[32] = {};
  MGPU_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof(bus), index));
  info.pci_bus_id = bus;
  return info;
}

std::pair<size_t, size_t> memory_info(int index) {
  MGPU_CUDA_CHECK(cudaSetDevice(index));
  size_t free_bytes = 0, total = 0;
  MGPU_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  return {free_bytes, total};
}

Versions versions() {
  Versions v;
  v.runtime_compiled = cuda_version_string(CUDART_VERSION);
  int rt = 0, drv = 0;
  if (cudaRuntimeGetVersion(&rt) == cudaSuccess) v.runtime_loaded = cuda_version_string(rt);
  if (cudaDriverGetVersion(&drv) == cudaSuccess) v.driver = cuda_version_string(drv);  // 0 -> "": no driver
  cudaGetLastError();
  v.cublas_compiled = triple(CUBLAS_VER_MAJOR, CUBLAS_VER_MINOR, CUBLAS_VER_PATCH);
  int ma = 0, mi = 0, pa = 0;
  if (cublasGetProperty(MAJOR_VERSION, &ma) == CUBLAS_STATUS_SUCCESS &&
      cublasGetProperty(MINOR_VERSION, &mi) == CUBLAS_STATUS_SUCCESS &&
      cublasGetProperty(PATCH_LEVEL, &pa) == CUBLAS_STATUS_SUCCESS)
    v.cublas_loaded = triple(ma, mi, pa);
  v.curand_compiled = triple(CURAND_VER_MAJOR, CURAND_VER_MINOR, CURAND_VER_PATCH);
  int cr = 0;
  if (curandGetVersion(&cr) == CURAND_STATUS_SUCCESS) v.curand_loaded = triple(cr / 1000, (cr % 1000) / 100, cr % 100);
#ifdef MGPU_HAVE_NCCL
  v.nccl_compiled = triple(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
  int nv = 0;
  if (ncclGetVersion(&nv) == ncclSuccess && nv > 0) {
    v.nccl_loaded_code = nv;
    // NCCL_VERSION_CODE: 10000 major + 100 minor + patch (since 2.9).
    v.nccl_loaded =
        nv >= 10000 ? triple(nv / 10000, (nv % 10000) / 100, nv % 100) : triple(nv / 1000, (nv % 1000) / 100, nv % 100);
  }
#endif
  return v;
}

std::string nccl_unique_id() {
#ifdef MGPU_HAVE_NCCL
  ncclUniqueId id;
  const ncclResult_t rc = ncclGetUniqueId(&id);
  if (rc != ncclSuccess)
    throw CommError(
        detail::concat("ncclGetUniqueId failed: ", ncclGetErrorString(rc), ": ", ncclGetLastError(nullptr)));
  return std::string(id.internal, sizeof(id.internal));
#else
  throw CommError("this build of mgpu has no NCCL (built without NCCL); use the MPI communicator");
#endif
}

std::array<uint32_t, 4> curand_philox_on_host(const std::array<uint32_t, 4>& counter,
                                              const std::array<uint32_t, 2>& key) {
  std::array<uint32_t, 4> out{};
  kernels::curand_philox_on_host(counter.data(), key.data(), out.data());
  return out;
}

std::vector<float> dropout_mask_on_host(int B, int C, float p, const DropoutKey& key) {
  MGPU_CHECK(B >= 0 && C >= 1 && p > 0.0f && p < 1.0f, ConfigError,
             "dropout_mask_on_host needs B >= 0, C >= 1 and 0 < p < 1");
  std::vector<float> mask(size_t(B) * C);
  kernels::dropout_mask_on_host(mask.data(), B, C, p, key);
  return mask;
}

}  // namespace cuda

std::shared_ptr<Backend> make_cuda_backend(int device_index) {
  const int n = cuda::device_count();
  MGPU_CHECK(n > 0, DeviceError, "no CUDA GPU is visible to this process (", cuda::no_device_reason(),
             "); check nvidia-smi and CUDA_VISIBLE_DEVICES, or use device 'cpu'");
  MGPU_CHECK(device_index >= 0 && device_index < n, DeviceError, "device index ", device_index, " out of range: ", n,
             " GPU", n == 1 ? "" : "s", " visible");
  return std::make_shared<CudaBackend>(device_index);
}

}  // namespace mgpu
