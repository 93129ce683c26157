// The emulated device as kernels see it: the running CUDA thread's launch
// parameters, block and warp synchronisation, and the launch of a kernel onto
// a stream (argument check, then the grid runs on the stream's worker thread,
// each CUDA thread a fiber). Implemented in emulation/src/kernel_exec.cpp.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace mgpu_emu {

struct ThreadContext {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

// The context of the emulated CUDA thread running on this OS thread; calling
// a device built-in outside a kernel is an error (thrown).
ThreadContext& current_thread();

void sync_block(const char* file, int line);
void sync_warp(const char* file, int line, unsigned mask = 0xffffffffu);
enum class ShuffleKind { kIndex, kXor, kDown, kUp };
enum class VoteKind { kBallot, kAny, kAll };
// Exchanges 8 bytes per lane among the lanes of `mask`; every named lane must arrive.
uint64_t shuffle_bits(unsigned mask, uint64_t bits, ShuffleKind kind, int arg, int width, const char* what);
unsigned vote(unsigned mask, int predicate, VoteKind kind, const char* what);
unsigned active_mask();
void* dynamic_shared();

template <typename T>
T shuffle(unsigned mask, T var, ShuffleKind kind, int arg, int width, const char* what) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffles move values of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = shuffle_bits(mask, bits, kind, arg, width, what);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// A pointer argument of a kernel, checked at launch (it must be device memory
// of the launching device, or pinned host memory, or null).
struct PointerArg {
  int index;
  const void* ptr;
  bool is_const;
};

// Validates the launch and enqueues `body` (run once per CUDA thread) on
// `stream`; errors go to cudaGetLastError, as on a GPU.
void launch(const char* name, const void* kernel, std::function<void()> body, dim3 grid, dim3 block,
            size_t shared_bytes, cudaStream_t stream, const std::vector<PointerArg>& pointers);

template <typename T>
void collect_pointer(std::vector<PointerArg>& out, int index, const T& value) {
  if constexpr (std::is_pointer<T>::value)
    out.push_back(
        {index, static_cast<const void*>(value), std::is_const<typename std::remove_pointer<T>::type>::value});
}

template <typename Kernel>
class Launcher;

// MGPU_LAUNCH(kernel, grid, block, shared, stream)(args...): converts the
// arguments to the kernel's parameter types (as nvcc does), copies them into
// the launch, and enqueues it.
template <typename... Params>
class Launcher<void (*)(Params...)> {
 public:
  Launcher(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream)
      : name_(name), kernel_(kernel), grid_(grid), block_(block), shared_(shared_bytes), stream_(stream) {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    static_assert(sizeof...(Args) == sizeof...(Params), "wrong number of kernel arguments");
    std::tuple<std::decay_t<Params>...> values(std::forward<Args>(args)...);
    std::vector<PointerArg> pointers;
    collect(pointers, values, std::index_sequence_for<Params...>{});
    auto kernel = kernel_;
    launch(
        name_, reinterpret_cast<const void*>(kernel_), [kernel, values]() { std::apply(kernel, values); }, grid_,
        block_, shared_, stream_, pointers);
  }

 private:
  template <typename Tuple, size_t... I>
  static void collect(std::vector<PointerArg>& out, const Tuple& t, std::index_sequence<I...>) {
    (collect_pointer(out, int(I), std::get<I>(t)), ...);
  }
  const char* name_;
  void (*kernel_)(Params...);
  dim3 grid_, block_;
  size_t shared_;
  cudaStream_t stream_;
};

}  // namespace mgpu_emu
