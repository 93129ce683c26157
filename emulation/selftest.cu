// Scenarios that prove the GPU emulation strict (built into mgpu._core_emu
// only; run by tests/emulation): each runs a small piece of CUDA that is
// correct, or breaks one rule a GPU would not report, and returns what the
// emulation said ("" when it accepted the work). Written as ordinary CUDA,
// compiled like kernels/*.cu.
#include <cuda_runtime.h>
#include <nccl.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kernels/common.cuh"

namespace mgpu_selftest {

namespace {

constexpr int kN = 256;

// sum of x (kN) by a shared-memory tree; with_sync=false drops the barriers.
__global__ void block_sum_kernel(float* out, const float* x, bool with_sync) {
  __shared__ float smem[kN];
  smem[threadIdx.x] = x[threadIdx.x];
  if (with_sync) __syncthreads();
  for (int stride = kN / 2; stride > 0; stride >>= 1) {
    if (static_cast<int>(threadIdx.x) < stride) smem[threadIdx.x] += smem[threadIdx.x + stride];
    if (with_sync) __syncthreads();
  }
  if (threadIdx.x == 0) *out = smem[0];
}

__global__ void divergent_barrier_kernel(float* x) {
  if (threadIdx.x < 16) __syncthreads();
  x[threadIdx.x] = 1.0f;
}

__global__ void shuffle_kernel(float* x, unsigned mask, int active) {
  if (static_cast<int>(threadIdx.x) >= active) return;
  x[threadIdx.x] = __shfl_xor_sync(mask, x[threadIdx.x], 1);
}

__global__ void warp_sum_kernel(float* x) {
  float v = x[threadIdx.x];
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) x[threadIdx.x] = v;
}

__global__ void write_kernel(float* x, int n, float value) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = value;
}

__global__ void copy_kernel(float* dst, const float* src, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

__global__ void dynamic_shared_kernel(float* out) {
  MGPU_DYNAMIC_SHARED(float, buf);
  buf[threadIdx.x] = float(threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) *out = buf[blockDim.x - 1];
}

__global__ void atomic_kernel(unsigned long long* count) { atomicAdd(count, 1ull); }

// 16-byte loads through a float pointer: legal only where src is 16-byte aligned.
__global__ void float4_copy_kernel(float4* dst, const float* src) {
  dst[threadIdx.x] = reinterpret_cast<const float4*>(src)[threadIdx.x];
}

std::string error_text(cudaError_t e) { return e == cudaSuccess ? "" : cudaGetErrorString(e); }

// Runs fn, synchronises, returns the first error seen ("" for none).
std::string run(const std::function<cudaError_t()>& fn) {
  cudaError_t e = fn();
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  const std::string text = error_text(e);
  cudaGetLastError();
  return text;
}

struct Buffers {
  float* d = nullptr;
  float* e = nullptr;
  cudaStream_t s1 = nullptr, s2 = nullptr;
  Buffers() {
    cudaMalloc(reinterpret_cast<void**>(&d), kN * sizeof(float));
    cudaMalloc(reinterpret_cast<void**>(&e), kN * sizeof(float));
    cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking);
    std::vector<float> ones(kN, 1.0f);
    cudaMemcpy(d, ones.data(), kN * sizeof(float), cudaMemcpyHostToDevice);
  }
  ~Buffers() {
    cudaDeviceSynchronize();
    cudaFree(d);
    cudaFree(e);
    cudaStreamDestroy(s1);
    cudaStreamDestroy(s2);
  }
  float read(const float* p) {
    float v = 0.0f;
    cudaMemcpy(&v, p, sizeof(v), cudaMemcpyDeviceToHost);
    return v;
  }
};

}  // namespace

// name -> what happened: the sum for the reductions, else the error text ("" = accepted).
std::string run_scenario(const std::string& name) {
  cudaGetLastError();  // nothing left over from an earlier scenario
  Buffers b;
  if (name == "block_sum" || name == "block_sum_without_barriers") {
    const std::string err = run([&] {
      MGPU_LAUNCH(block_sum_kernel, 1, kN, 0, b.s1)(b.e, b.d, name == "block_sum");
      return cudaSuccess;
    });
    return err.empty() ? std::to_string(b.read(b.e)) : err;
  }
  if (name == "warp_sum") {
    const std::string err = run([&] {
      MGPU_LAUNCH(warp_sum_kernel, 1, 64, 0, b.s1)(b.d);
      return cudaSuccess;
    });
    return err.empty() ? std::to_string(b.read(b.d)) : err;
  }
  if (name == "divergent_barrier")
    return run([&] {
      MGPU_LAUNCH(divergent_barrier_kernel, 1, 64, 0, b.s1)(b.d);
      return cudaSuccess;
    });
  if (name == "shuffle_names_absent_lane")  // a block of 16 threads, full mask
    return run([&] {
      MGPU_LAUNCH(shuffle_kernel, 1, 16, 0, b.s1)(b.d, 0xffffffffu, 16);
      return cudaSuccess;
    });
  if (name == "shuffle_names_exited_lane")  // lanes 16..31 return first
    return run([&] {
      MGPU_LAUNCH(shuffle_kernel, 1, 32, 0, b.s1)(b.d, 0xffffffffu, 16);
      return cudaSuccess;
    });
  if (name == "shuffle_half_warp")  // the right mask for 16 active lanes
    return run([&] {
      MGPU_LAUNCH(shuffle_kernel, 1, 32, 0, b.s1)(b.d, 0x0000ffffu, 16);
      return cudaSuccess;
    });
  if (name == "out_of_bounds_write")
    return run([&] {
      MGPU_LAUNCH(write_kernel, 1, 64, 0, b.s1)(b.d, kN + 1, 2.0f);
      return cudaSuccess;
    });
  if (name == "use_after_free")
    return run([&] {
      float* gone = nullptr;
      cudaMalloc(reinterpret_cast<void**>(&gone), kN * sizeof(float));
      cudaFree(gone);
      MGPU_LAUNCH(write_kernel, 1, 64, 0, b.s1)(gone, kN, 2.0f);
      return cudaSuccess;
    });
  if (name == "host_pointer_argument")
    return run([&] {
      std::vector<float> host(kN);
      MGPU_LAUNCH(write_kernel, 1, 64, 0, b.s1)(host.data(), kN, 2.0f);
      return cudaSuccess;
    });
  if (name == "wrong_memcpy_kind")
    return run([&] {
      float host = 0.0f;
      return cudaMemcpy(&host, b.d, sizeof(float), cudaMemcpyHostToDevice);
    });
  if (name == "too_many_threads")
    return run([&] {
      MGPU_LAUNCH(write_kernel, 1, 2048, 0, b.s1)(b.d, kN, 2.0f);
      return cudaSuccess;
    });
  if (name == "dynamic_shared_over_default")
    return run([&] {
      MGPU_LAUNCH(dynamic_shared_kernel, 1, 64, 64 * 1024, b.s1)(b.e);
      return cudaSuccess;
    });
  if (name == "dynamic_shared_opt_in") {
    const std::string err = run([&] {
      cudaFuncSetAttribute(reinterpret_cast<const void*>(&dynamic_shared_kernel),
                           cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024);
      MGPU_LAUNCH(dynamic_shared_kernel, 1, 64, 64 * 1024, b.s1)(b.e);
      return cudaSuccess;
    });
    return err.empty() ? std::to_string(b.read(b.e)) : err;
  }
  if (name == "misaligned_vector_load" || name == "aligned_vector_load")  // src one float past alignment
    return run([&] {
      MGPU_LAUNCH(float4_copy_kernel, 1, 8, 0, b.s1)
      (reinterpret_cast<float4*>(b.e), b.d + (name == "misaligned_vector_load" ? 1 : 0));
      return cudaSuccess;
    });
  if (name == "atomics") {
    unsigned long long* count = nullptr;
    cudaMalloc(reinterpret_cast<void**>(&count), sizeof(*count));
    cudaMemset(count, 0, sizeof(*count));
    std::string err = run([&] {
      MGPU_LAUNCH(atomic_kernel, 3, 100, 0, b.s1)(count);
      return cudaSuccess;
    });
    unsigned long long host = 0;
    cudaMemcpy(&host, count, sizeof(host), cudaMemcpyDeviceToHost);
    cudaFree(count);
    return err.empty() ? std::to_string(host) : err;
  }
  if (name == "race_between_streams" || name == "ordered_by_event") {
    cudaEvent_t ev;
    cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    const std::string err = run([&] {
      MGPU_LAUNCH(write_kernel, 1, 64, 0, b.s1)(b.d, kN, 3.0f);
      if (name == "ordered_by_event") {
        cudaEventRecord(ev, b.s1);
        cudaStreamWaitEvent(b.s2, ev, 0);
      }
      MGPU_LAUNCH(copy_kernel, 1, 64, 0, b.s2)(b.e, b.d, kN);
      return cudaSuccess;
    });
    cudaEventDestroy(ev);
    return err;
  }
  if (name == "sync_during_capture") {
    cudaGraph_t graph = nullptr;
    cudaStreamBeginCapture(b.s1, cudaStreamCaptureModeThreadLocal);
    MGPU_LAUNCH(write_kernel, 1, 64, 0, b.s1)(b.d, kN, 2.0f);
    const std::string during = error_text(cudaStreamSynchronize(b.s1));
    const std::string end = error_text(cudaStreamEndCapture(b.s1, &graph));
    cudaGetLastError();
    if (graph) cudaGraphDestroy(graph);
    return during + " | " + end;
  }
  if (name == "graph_replay") {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    cudaStreamBeginCapture(b.s1, cudaStreamCaptureModeThreadLocal);
    MGPU_LAUNCH(write_kernel, 1, 64, 0, b.s1)(b.e, kN, 5.0f);
    MGPU_LAUNCH(block_sum_kernel, 1, kN, 0, b.s1)(b.e, b.e, true);
    const std::string err = run([&] {
      cudaError_t e = cudaStreamEndCapture(b.s1, &graph);
      if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
      if (e == cudaSuccess) e = cudaGraphLaunch(exec, b.s1);
      return e;
    });
    const float v = b.read(b.e);
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    return err.empty() ? std::to_string(v) : err;
  }
  if (name == "free_during_in_process_collective" || name == "free_async_during_in_process_collective") {
    // GPU 0's half of a two-GPU allreduce waits for GPU 1's; meanwhile GPU 1 frees memory.
    int gpus = 0;
    cudaGetDeviceCount(&gpus);
    if (gpus < 2) return "needs 2 emulated GPUs";
    ncclComm_t comms[2] = {nullptr, nullptr};
    const int devices[2] = {0, 1};
    if (ncclCommInitAll(comms, 2, devices) != ncclSuccess) return "ncclCommInitAll failed";
    float* data[2] = {nullptr, nullptr};
    float* spare = nullptr;
    cudaStream_t streams[2] = {nullptr, nullptr};
    for (int g = 0; g < 2; ++g) {
      cudaSetDevice(g);
      cudaMalloc(reinterpret_cast<void**>(&data[g]), kN * sizeof(float));
      cudaMemset(data[g], 0, kN * sizeof(float));
      cudaStreamCreateWithFlags(&streams[g], cudaStreamNonBlocking);
    }
    cudaMalloc(reinterpret_cast<void**>(&spare), kN * sizeof(float));  // on GPU 1
    cudaDeviceSynchronize();
    cudaSetDevice(0);
    ncclAllReduce(data[0], data[0], kN, ncclFloat32, ncclSum, comms[0], streams[0]);
    cudaSetDevice(1);
    std::string err;
    if (name == "free_during_in_process_collective") {
      err = error_text(cudaFree(spare));
    } else {
      err = error_text(cudaFreeAsync(spare, streams[1]));
    }
    ncclAllReduce(data[1], data[1], kN, ncclFloat32, ncclSum, comms[1], streams[1]);
    // Both halves finish before anything is freed: GPU 0's stream can drain while GPU 1's
    // half is still running, and a cudaFree then would be this very violation.
    for (int g = 0; g < 2; ++g) {
      cudaSetDevice(g);
      cudaStreamSynchronize(streams[g]);
    }
    for (int g = 0; g < 2; ++g) {
      cudaSetDevice(g);
      cudaFree(data[g]);
      cudaStreamDestroy(streams[g]);
      ncclCommDestroy(comms[g]);
    }
    cudaSetDevice(0);
    return err;
  }
  if (name == "reduce_matches_allreduce") {
    // Two GPUs reduce to GPU 1 (in a buffer of its own) and allreduce the same
    // inputs: the root's values equal the allreduce's bit for bit; GPU 0 passes
    // no receive buffer at all, as NCCL allows a reduce's non-roots.
    int gpus = 0;
    cudaGetDeviceCount(&gpus);
    if (gpus < 2) return "needs 2 emulated GPUs";
    constexpr int kRoot = 1;
    ncclComm_t comms[2] = {nullptr, nullptr};
    const int devices[2] = {0, 1};
    if (ncclCommInitAll(comms, 2, devices) != ncclSuccess) return "ncclCommInitAll failed";
    float *send[2] = {nullptr, nullptr}, *both[2] = {nullptr, nullptr}, *reduced = nullptr;
    cudaStream_t streams[2] = {nullptr, nullptr};
    std::vector<float> host[2];
    for (int g = 0; g < 2; ++g) {
      cudaSetDevice(g);
      for (int i = 0; i < kN; ++i) host[g].push_back(0.1f * float(i + 1) / float(g + 3) - 0.7f * float(g));
      cudaMalloc(reinterpret_cast<void**>(&send[g]), kN * sizeof(float));
      cudaMalloc(reinterpret_cast<void**>(&both[g]), kN * sizeof(float));
      cudaMemcpy(send[g], host[g].data(), kN * sizeof(float), cudaMemcpyHostToDevice);
      cudaMemcpy(both[g], host[g].data(), kN * sizeof(float), cudaMemcpyHostToDevice);
      cudaStreamCreateWithFlags(&streams[g], cudaStreamNonBlocking);
    }
    cudaMalloc(reinterpret_cast<void**>(&reduced), kN * sizeof(float));  // on GPU 1, the root
    cudaMemset(reduced, 0, kN * sizeof(float));
    cudaDeviceSynchronize();
    std::string err;
    for (int g = 0; g < 2 && err.empty(); ++g) {
      cudaSetDevice(g);
      if (ncclReduce(send[g], g == kRoot ? reduced : nullptr, kN, ncclFloat32, ncclSum, kRoot, comms[g], streams[g]) !=
              ncclSuccess ||
          ncclAllReduce(both[g], both[g], kN, ncclFloat32, ncclSum, comms[g], streams[g]) != ncclSuccess)
        err = ncclGetLastError(comms[g]);
    }
    for (int g = 0; g < 2; ++g) {
      cudaSetDevice(g);
      cudaStreamSynchronize(streams[g]);
    }
    std::vector<float> root(kN), all(kN);
    cudaMemcpy(root.data(), reduced, kN * sizeof(float), cudaMemcpyDeviceToHost);
    cudaMemcpy(all.data(), both[kRoot], kN * sizeof(float), cudaMemcpyDeviceToHost);
    for (int i = 0; i < kN && err.empty(); ++i)
      if (root[size_t(i)] != all[size_t(i)] || root[size_t(i)] != host[0][size_t(i)] + host[1][size_t(i)])
        err = "element " + std::to_string(i) + ": reduce " + std::to_string(root[size_t(i)]) + ", allreduce " +
              std::to_string(all[size_t(i)]);
    cudaFree(reduced);
    for (int g = 0; g < 2; ++g) {
      cudaSetDevice(g);
      cudaFree(send[g]);
      cudaFree(both[g]);
      cudaStreamDestroy(streams[g]);
      ncclCommDestroy(comms[g]);
    }
    cudaSetDevice(0);
    return err;
  }
  return "unknown scenario " + name;
}

}  // namespace mgpu_selftest
