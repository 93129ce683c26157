// The micro-benchmarks of microbench.h.
#include "microbench.h"

#include <algorithm>
#include <chrono>

#include "async_signals.h"
#include "errors.h"
#include "philox.h"
#include "staged_communicator.h"

namespace mgpu {
namespace {

using Clock = std::chrono::steady_clock;

// Host memory swept between timed calls (read and written, a cache line at a time), so
// that each call finds its arrays evicted from a last-level cache smaller than it. One
// buffer per thread, kept: topo sweeps before each of a few thousand timed calls.
class CacheSweep {
 public:
  explicit CacheSweep(size_t bytes) : count_(bytes / sizeof(Line)) {
    if (buffer().size() < count_) buffer().resize(count_);
  }
  void operator()() {
    Line* lines = buffer().data();
    for (size_t i = 0; i < count_; ++i) lines[i].v[0] += 1;
    sink_ = count_ ? lines[count_ - 1].v[0] : 0;
  }

 private:
  struct alignas(64) Line {
    uint64_t v[8] = {};
  };
  static std::vector<Line>& buffer() {
    static thread_local std::vector<Line> lines;
    return lines;
  }
  size_t count_;
  volatile uint64_t sink_ = 0;
};

// Seconds of each of `repeats` timed calls of fn (after one untimed warm-up). On
// a device backend a call is what it costs in a step's stream of calls: a sample
// is the mean of back-to-back calls filling about a millisecond between two waits
// (a step waits once, not after every kernel; one call with its wait would add the
// wait's latency to every GEMM and kernel priced from it). Host backends: one call.
template <typename Fn>
std::vector<double> time_calls(Backend& be, int repeats, Fn fn, size_t sweep_bytes = 0) {
  MGPU_CHECK(repeats >= 1, ConfigError, "repeats must be >= 1");
  MGPU_CHECK(sweep_bytes == 0 || be.host_accessible(), ConfigError, "a cold timing sweeps host caches: the ", be.name(),
             " backend's memory is not the host's");
  CacheSweep sweep(sweep_bytes);
  // As in a step: one hold for all the calls, so that a oneDNN GEMM's own costs nothing.
  const AsynchronousSignalsHeld signals_after_the_timing;
  auto seconds_since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  fn();
  be.synchronize();
  int calls = 1;
  if (!be.host_accessible()) {
    const auto t0 = Clock::now();
    fn();
    be.synchronize();
    calls = static_cast<int>(std::clamp(1e-3 / std::max(seconds_since(t0), 1e-9), 1.0, 1000.0));
  }
  std::vector<double> out;
  for (int i = 0; i < repeats; ++i) {
    if (sweep_bytes) sweep();
    const auto t0 = Clock::now();
    for (int c = 0; c < calls; ++c) fn();
    be.synchronize();
    out.push_back(seconds_since(t0) / calls);
  }
  return out;
}

// Fills a GEMM operand with U(-1, 1) from Philox (drawn on the host, copied once): GPUs
// multiply zeros measurably faster (less switching), so a rate timed on zeros would flatter
// the reference every step and burn is held against. `operand` separates the operands' draws.
void fill_random(Backend& be, float* dst, size_t n, uint32_t operand) {
  std::vector<float> host(n);
  for (size_t i = 0; i < n; i += 4) {
    const Philox4 r = philox_draw(0x6E3Cu, RngStream::kStress, static_cast<uint32_t>(i >> 2),
                                  static_cast<uint32_t>(i >> 34), operand, 0x7E57u);
    for (size_t k = 0; k < 4 && i + k < n; ++k) host[i + k] = 2.0f * uniform01(r.v[k]) - 1.0f;
  }
  be.copy_to_backend(dst, host.data(), n * sizeof(float));
}

}  // namespace

std::vector<double> time_linear(Backend& be, int B, int IN, int OUT, int repeats, size_t sweep_bytes) {
  MGPU_CHECK(B >= 1 && IN >= 1 && OUT >= 1, ConfigError, "GEMM sizes must be >= 1");
  BackendArray<float> inp(&be, size_t(B) * IN), w(&be, size_t(OUT) * IN), bias(&be, OUT), out(&be, size_t(B) * OUT);
  fill_random(be, inp.data(), inp.size(), 0);
  fill_random(be, w.data(), w.size(), 1);
  fill_random(be, bias.data(), bias.size(), 2);
  return time_calls(
      be, repeats, [&] { be.linear_forward(out.data(), inp.data(), w.data(), bias.data(), B, IN, OUT); }, sweep_bytes);
}

std::vector<double> time_linear_backward(Backend& be, int B, int IN, int OUT, int repeats, bool input_gradient,
                                         size_t sweep_bytes) {
  MGPU_CHECK(B >= 1 && IN >= 1 && OUT >= 1, ConfigError, "GEMM sizes must be >= 1");
  BackendArray<float> inp(&be, size_t(B) * IN), w(&be, size_t(OUT) * IN), dout(&be, size_t(B) * OUT),
      dinp(&be, size_t(B) * IN), dw(&be, size_t(OUT) * IN), db(&be, OUT);
  fill_random(be, inp.data(), inp.size(), 0);
  fill_random(be, w.data(), w.size(), 1);
  fill_random(be, dout.data(), dout.size(), 3);
  return time_calls(
      be, repeats,
      [&] {
        be.linear_backward(input_gradient ? dinp.data() : nullptr, dw.data(), db.data(), dout.data(), inp.data(),
                           w.data(), B, IN, OUT, false);
      },
      sweep_bytes);
}

std::vector<double> time_axpy(Backend& be, size_t n, int repeats) {
  MGPU_CHECK(n >= 1, ConfigError, "n must be >= 1");
  BackendArray<float> x(&be, n), y(&be, n);
  be.zero(x.data(), n);
  be.zero(y.data(), n);
  return time_calls(be, repeats, [&] { be.axpy(y.data(), x.data(), n, 0.5f); });
}

std::vector<double> time_graph_replay(Backend& be, int nodes, int repeats) {
  MGPU_CHECK(nodes >= 1, ConfigError, "nodes must be >= 1");
  MGPU_CHECK(repeats >= 1, ConfigError, "repeats must be >= 1");
  MGPU_CHECK(be.supports_capture(), ConfigError, "the ", be.name(), " backend cannot capture");
  BackendArray<float> x(&be, 1), y(&be, 1);
  be.zero(x.data(), 1);
  be.zero(y.data(), 1);
  be.synchronize();
  be.begin_capture();
  int graph = -1;
  try {
    for (int i = 0; i < nodes; ++i) be.axpy(y.data(), x.data(), 1, 0.5f);
    graph = be.end_capture();
  } catch (...) {
    be.abort_capture();
    throw;
  }
  std::vector<double> out;
  try {
    out = time_calls(be, repeats, [&] { be.replay(graph, ReplayArgs{0, 0, 1.0f, 1.0f, UpdateScalars{}}); });
  } catch (...) {
    be.release_captures();
    throw;
  }
  be.release_captures();
  return out;
}

// Zeros stay zeros, so every call does the same work on the same values.
std::vector<double> time_relu_dropout(Backend& be, int B, int C, float p, int repeats) {
  MGPU_CHECK(B >= 1 && C >= 1, ConfigError, "rows and columns must be >= 1");
  MGPU_CHECK(p >= 0.0f && p < 1.0f, ConfigError, "dropout probability must be in [0, 1), got ", p);
  BackendArray<float> h(&be, size_t(B) * C);
  be.zero(h.data(), h.size());
  const DropoutKey key{1, 0, 0, 0};
  return time_calls(be, repeats, [&] { be.relu_dropout_forward(h.data(), B, C, p, key); });
}

std::vector<double> time_copy_to_backend(Backend& be, size_t bytes, int repeats) {
  MGPU_CHECK(bytes >= 1, ConfigError, "bytes must be >= 1");
  std::vector<float> host((bytes + 3) / 4, 1.0f);
  BackendArray<float> dev(&be, host.size());
  return time_calls(be, repeats, [&] { be.copy_to_backend(dev.data(), host.data(), host.size() * 4); });
}

AllreduceProbe::AllreduceProbe(std::shared_ptr<Communicator> comm, std::shared_ptr<Backend> backend, size_t max_count)
    : comm_(std::move(comm)), be_(std::move(backend)), host_(max_count), buffer_(be_.get(), max_count) {
  MGPU_CHECK(max_count >= 1, ConfigError, "max_count must be >= 1");
  // MPI moves host memory only: a device backend's buffer goes through host staging, as in training.
  if (!be_->host_accessible() && !comm_->accepts_device_memory())
    comm_ = std::make_shared<StagedCommunicator>(comm_, be_);
  comm_->attach(be_);
  be_->zero(buffer_.data(), max_count);
}

std::pair<double, int64_t> AllreduceProbe::run(size_t count, int iters, int warmup) {
  MGPU_CHECK(count >= 1 && count <= host_.size(), ConfigError, "count must be in [1, ", host_.size(), "]");
  MGPU_CHECK(iters >= 1 && warmup >= 0, ConfigError, "iters must be >= 1 and warmup >= 0");
  const int n = comm_->size(), r = comm_->rank();
  for (size_t i = 0; i < count; ++i) host_[i] = float((r + 1) * (i % 13 + 1));
  be_->copy_to_backend(buffer_.data(), host_.data(), count * sizeof(float));
  comm_->allreduce_sum(buffer_.data(), count);
  be_->copy_to_host(host_.data(), buffer_.data(), count * sizeof(float));
  const float ranks_sum = float(n) * (n + 1) / 2;
  int64_t wrong = 0;
  for (size_t i = 0; i < count; ++i) wrong += host_[i] != ranks_sum * float(i % 13 + 1);
  be_->zero(buffer_.data(), count);  // zeros stay zeros: timing never meets Inf/NaN
  for (int i = 0; i < warmup; ++i) comm_->allreduce_sum(buffer_.data(), count);
  be_->synchronize();
  comm_->barrier();
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) comm_->allreduce_sum(buffer_.data(), count);
  be_->synchronize();
  return {std::chrono::duration<double>(Clock::now() - t0).count() / iters, wrong};
}

}  // namespace mgpu
