// Chooses a Backend implementation by device name (the only place that knows
// every backend), and names the precisions backends compute in.
#include "core/backend.h"
#include "core/errors.h"
#include "cpu/cpu_backend.h"

namespace mgpu {

Precision parse_precision(const std::string& name) {
  if (name == "fp32") return Precision::kFP32;
  if (name == "tf32") return Precision::kTF32;
  if (name == "bf16") return Precision::kBF16;
  if (name == "fp16") return Precision::kFP16;
  throw ConfigError("unknown precision '" + name + "' (expected fp32, tf32, bf16 or fp16)");
}

std::string precision_name(Precision precision) {
  switch (precision) {
    case Precision::kFP32: return "fp32";
    case Precision::kTF32: return "tf32";
    case Precision::kBF16: return "bf16";
    case Precision::kFP16: return "fp16";
  }
  return "unknown";
}

#ifdef MGPU_HAVE_CUDA
std::shared_ptr<Backend> make_cuda_backend(int device_index);
#endif

std::shared_ptr<Backend> make_backend(const std::string& device, int device_index, int threads) {
  if (device == "cpu") return std::make_shared<CpuBackend>(threads > 0 ? threads : available_cpu_threads());
  if (device == "cuda") {
#ifdef MGPU_HAVE_CUDA
    return make_cuda_backend(device_index);
#else
    (void)device_index;
    throw DeviceError(
        "this build of mgpu has no CUDA backend (it was built without the CUDA toolkit); use device='cpu'");
#endif
  }
  throw ConfigError("unknown device '" + device + "' (expected 'cpu' or 'cuda')");
}

}  // namespace mgpu
