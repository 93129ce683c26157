// What the host-compiled parts of mgpu (the bindings) may ask of the CUDA
// build: device discovery and properties, library versions, the NCCL unique id
// and test hooks. Free of CUDA types on purpose: module.cpp is compiled by the
// host compiler without the CUDA headers (tiny-cuda-nn style).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../core/backend.h"

namespace mgpu {

std::shared_ptr<Backend> make_cuda_backend(int device_index);

namespace cuda {

// GPUs visible to this process; 0 (never an exception) without a driver or GPU.
int device_count() noexcept;
// Why device_count() is 0 ("" when a GPU is visible): the runtime's error.
std::string no_device_reason();

struct DeviceInfo {
  int index = 0;
  std::string name;
  size_t total_memory = 0;  // bytes
  int multiprocessors = 0;
  int major = 0, minor = 0;  // compute capability
  std::string pci_bus_id;    // tells ranks sharing one GPU apart from ranks on distinct GPUs
};
DeviceInfo device_info(int index);
// (free, total) bytes of device memory, for leak checks.
std::pair<size_t, size_t> memory_info(int index);

// Versions as "major.minor[.patch]"; "" where unknown or absent (no driver, no NCCL).
struct Versions {
  std::string runtime_compiled, runtime_loaded, driver;
  std::string cublas_compiled, cublas_loaded;
  std::string curand_compiled, curand_loaded;
  std::string nccl_compiled, nccl_loaded;
  int nccl_loaded_code = 0;  // NCCL_VERSION_CODE of the loaded library (22809 = 2.28.9), 0 without
};
Versions versions();

// ncclGetUniqueId as bytes (rank 0 creates it; every rank passes it to NcclCommunicator).
std::string nccl_unique_id();

// Test hooks, runnable without a GPU: cuRAND's Philox4x32-10 on the host, and
// the dropout kernel's per-element mask code run on the host (mask (B, C) of 0
// or 1/(1-p)).
std::array<uint32_t, 4> curand_philox_on_host(const std::array<uint32_t, 4>& counter,
                                              const std::array<uint32_t, 2>& key);
std::vector<float> dropout_mask_on_host(int B, int C, float p, const DropoutKey& key);

}  // namespace cuda
}  // namespace mgpu
