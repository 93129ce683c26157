// Micro-benchmarks that calibrate the performance model (perf_model.h): GEMM,
// elementwise, copy and graph-replay timings of a Backend, and the allreduce of
// a Communicator, as `mgpu topo` and `mgpu bench` run them. Each returns seconds
// per call; nothing here knows Python.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "backend.h"
#include "communicator.h"

namespace mgpu {

// inp (B, IN), weight (OUT, IN) -> out (B, OUT): the forward GEMM of a Linear layer, on
// uniform random operands (a GPU multiplies zeros faster than a training step's data).
// sweep_bytes > 0: each timed call after sweeping that much host memory (a cold layer).
std::vector<double> time_linear(Backend& be, int B, int IN, int OUT, int repeats, size_t sweep_bytes);
// dout (B, OUT), inp (B, IN), weight (OUT, IN) -> dinp (B, IN), dweight (OUT, IN), dbias (OUT):
// linear_backward as training calls it (input_gradient false: no dinp, the first layer);
// random operands as time_linear's.
std::vector<double> time_linear_backward(Backend& be, int B, int IN, int OUT, int repeats, bool input_gradient,
                                         size_t sweep_bytes);
// y += a x over n floats: 12 bytes of traffic per element.
std::vector<double> time_axpy(Backend& be, size_t n, int repeats);
// One captured graph of `nodes` dependent 1-element axpys, replayed as training
// replays a step (argument update + launch): the replay's fixed cost plus nodes x
// the per-node cost, which two node counts separate. Releases the backend's graphs.
std::vector<double> time_graph_replay(Backend& be, int nodes, int repeats);
// h (B, C) -> h: the ReLU that follows each hidden layer's GEMM, with dropout p
// (p = 0: the plain ReLU, whose cost the layer's pass already prices).
std::vector<double> time_relu_dropout(Backend& be, int B, int C, float p, int repeats);
// host -> backend copies of `bytes` (staging bandwidth; a memcpy on the CPU).
std::vector<double> time_copy_to_backend(Backend& be, size_t bytes, int repeats);

// The allreduce of nccl-tests, on a communicator and a backend's memory: one
// buffer of max_count floats allocated (and touched) once and reused for every
// size, so no size pays for fresh pages. run() first checks one allreduce bit
// for bit (rank r contributes (r + 1) * (i % 13 + 1): sums are exact in float32),
// then times `iters` allreduces.
class AllreduceProbe {
 public:
  AllreduceProbe(std::shared_ptr<Communicator> comm, std::shared_ptr<Backend> backend, size_t max_count);
  // (seconds per allreduce on this rank, elements that were not bit-exact)
  std::pair<double, int64_t> run(size_t count, int iters, int warmup);

 private:
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Backend> be_;
  std::vector<float> host_;
  BackendArray<float> buffer_;
};

}  // namespace mgpu
