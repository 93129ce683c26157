// Chooses a Backend implementation by device name; the only place that knows
// every backend.
#include "core/backend.h"
#include "core/errors.h"
#include "cpu/cpu_backend.h"

namespace mgpu {

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
    throw DeviceError("this build of mgpu has no CUDA backend (it was built without the CUDA toolkit); use device='cpu'");
#endif
  }
  throw ConfigError("unknown device '" + device + "' (expected 'cpu' or 'cuda')");
}

}  // namespace mgpu
