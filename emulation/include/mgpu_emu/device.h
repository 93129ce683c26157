// Force-included (g++ -include) into every CUDA translation unit of the GPU
// emulation build: the same kernels/*.cu and csrc/cuda/* sources that nvcc
// compiles are compiled here by the host compiler. Execution-space qualifiers
// become host C++, __shared__ becomes per-block storage (a block's threads run
// as fibers on one worker thread), and the device built-ins (threadIdx,
// __syncthreads, warp shuffles and votes, atomics, bit casts) come from the
// emulated thread's context. NVIDIA's own headers are included unchanged: they
// keep a qualifier that is already defined.
#pragma once

#define __global__
#define __device__
#define __host__
#define __shared__ static thread_local
#define __constant__ static

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#include "mgpu_emu/kernel.h"

// The launch parameters of the emulated thread that is running.
#define threadIdx (::mgpu_emu::current_thread().thread_idx)
#define blockIdx (::mgpu_emu::current_thread().block_idx)
#define blockDim (::mgpu_emu::current_thread().block_dim)
#define gridDim (::mgpu_emu::current_thread().grid_dim)
#define warpSize 32

// Barriers name their call site, so threads waiting at different barriers are
// reported instead of silently meeting.
#define __syncthreads() ::mgpu_emu::sync_block(__FILE__, __LINE__)
#define __syncwarp(...) ::mgpu_emu::sync_warp(__FILE__, __LINE__, ##__VA_ARGS__)

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return ::mgpu_emu::shuffle(mask, var, ::mgpu_emu::ShuffleKind::kIndex, src_lane, width, "__shfl_sync");
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return ::mgpu_emu::shuffle(mask, var, ::mgpu_emu::ShuffleKind::kXor, lane_mask, width, "__shfl_xor_sync");
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::mgpu_emu::shuffle(mask, var, ::mgpu_emu::ShuffleKind::kDown, int(delta), width, "__shfl_down_sync");
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::mgpu_emu::shuffle(mask, var, ::mgpu_emu::ShuffleKind::kUp, int(delta), width, "__shfl_up_sync");
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return ::mgpu_emu::vote(mask, predicate, ::mgpu_emu::VoteKind::kBallot, "__ballot_sync");
}
inline int __any_sync(unsigned mask, int predicate) {
  return ::mgpu_emu::vote(mask, predicate, ::mgpu_emu::VoteKind::kAny, "__any_sync") != 0;
}
inline int __all_sync(unsigned mask, int predicate) {
  return ::mgpu_emu::vote(mask, predicate, ::mgpu_emu::VoteKind::kAll, "__all_sync") != 0;
}
inline unsigned __activemask() { return ::mgpu_emu::active_mask(); }

// Atomics: memory is shared by the worker threads that run blocks.
template <typename T>
inline T atomicAdd(T* address, T val) {
  return __atomic_fetch_add(address, val, __ATOMIC_SEQ_CST);
}
// Floating-point adds as a compare-and-swap loop on the value's bits (Bits: same size).
template <typename T, typename Bits>
inline T atomic_float_add(T* address, T val) {
  static_assert(sizeof(T) == sizeof(Bits), "bit pattern of the same size");
  Bits* bits = reinterpret_cast<Bits*>(address);
  Bits expected = __atomic_load_n(bits, __ATOMIC_SEQ_CST);
  for (;;) {
    T old;
    std::memcpy(&old, &expected, sizeof(old));
    const T updated = old + val;
    Bits desired;
    std::memcpy(&desired, &updated, sizeof(desired));
    if (__atomic_compare_exchange_n(bits, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return old;
  }
}
inline float atomicAdd(float* address, float val) { return atomic_float_add<float, uint32_t>(address, val); }
inline double atomicAdd(double* address, double val) { return atomic_float_add<double, uint64_t>(address, val); }
template <typename T>
inline T atomicMax(T* address, T val) {
  T old = __atomic_load_n(address, __ATOMIC_SEQ_CST);
  while (old < val && !__atomic_compare_exchange_n(address, &old, val, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
template <typename T>
inline T atomicMin(T* address, T val) {
  T old = __atomic_load_n(address, __ATOMIC_SEQ_CST);
  while (old > val && !__atomic_compare_exchange_n(address, &old, val, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
template <typename T>
inline T atomicExch(T* address, T val) {
  return __atomic_exchange_n(address, val, __ATOMIC_SEQ_CST);
}
template <typename T>
inline T atomicCAS(T* address, T compare, T val) {
  __atomic_compare_exchange_n(address, &compare, val, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// Rounded float product that nvcc never contracts into an FMA. The emulated
// kernels are built without -march (no FMA instructions, so g++ cannot contract
// either): the plain product is the same single rounding.
inline float __fmul_rn(float a, float b) { return a * b; }

// Bit casts and integer intrinsics.
inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}
inline float __uint_as_float(unsigned u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}
inline int __float_as_int(float x) { return static_cast<int>(__float_as_uint(x)); }
inline float __int_as_float(int i) { return __uint_as_float(static_cast<unsigned>(i)); }
inline long long __double_as_longlong(double x) {
  long long u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}
inline unsigned __umulhi(unsigned a, unsigned b) {
  return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32);
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }

// Dynamic shared memory of the running block (the launch's shared-memory bytes).
#define MGPU_DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(::mgpu_emu::dynamic_shared())

// The one launch macro of the CUDA sources (kernels/launch.h has nvcc's form).
#define MGPU_LAUNCH(kernel, grid, block, shared_bytes, stream) \
  ::mgpu_emu::Launcher<decltype(&kernel)>(#kernel, &kernel, grid, block, shared_bytes, stream)
