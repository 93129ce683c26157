// Bindings of the performance model (csrc/core/perf_model.h) and the
// micro-benchmarks that calibrate it (GEMM rate, memory bandwidth, launch
// overhead of a backend), used by `mgpu topo`, `mgpu bench` and `mgpu recommend`.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "../core/async_signals.h"
#include "../core/backend.h"
#include "../core/communicator.h"
#include "../core/errors.h"
#include "../core/perf_model.h"
#include "../core/staged_communicator.h"

namespace py = pybind11;

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
  MGPU_CHECK(sweep_bytes == 0 || be.host_accessible(), ConfigError,
             "a cold timing sweeps host caches: the ", be.name(), " backend's memory is not the host's");
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

// inp (B, IN), weight (OUT, IN) -> out (B, OUT): the forward GEMM of a Linear layer.
// sweep_bytes > 0: each timed call after sweeping that much host memory (a cold layer).
std::vector<double> time_linear(Backend& be, int B, int IN, int OUT, int repeats, size_t sweep_bytes) {
  MGPU_CHECK(B >= 1 && IN >= 1 && OUT >= 1, ConfigError, "GEMM sizes must be >= 1");
  BackendArray<float> inp(&be, size_t(B) * IN), w(&be, size_t(OUT) * IN), bias(&be, OUT), out(&be, size_t(B) * OUT);
  be.zero(inp.data(), inp.size());
  be.zero(w.data(), w.size());
  be.zero(bias.data(), bias.size());
  return time_calls(
      be, repeats, [&] { be.linear_forward(out.data(), inp.data(), w.data(), bias.data(), B, IN, OUT); }, sweep_bytes);
}

// linear_backward: dinp and dweight GEMMs (and the bias column sums), as training calls it.
std::vector<double> time_linear_backward(Backend& be, int B, int IN, int OUT, int repeats, bool input_gradient,
                                         size_t sweep_bytes) {
  MGPU_CHECK(B >= 1 && IN >= 1 && OUT >= 1, ConfigError, "GEMM sizes must be >= 1");
  BackendArray<float> inp(&be, size_t(B) * IN), w(&be, size_t(OUT) * IN), dout(&be, size_t(B) * OUT),
      dinp(&be, size_t(B) * IN), dw(&be, size_t(OUT) * IN), db(&be, OUT);
  be.zero(inp.data(), inp.size());
  be.zero(w.data(), w.size());
  be.zero(dout.data(), dout.size());
  return time_calls(be, repeats, [&] {
    be.linear_backward(input_gradient ? dinp.data() : nullptr, dw.data(), db.data(), dout.data(), inp.data(), w.data(),
                       B, IN, OUT, false);
  }, sweep_bytes);
}

// y += a x over n floats: 12 bytes of traffic per element.
std::vector<double> time_axpy(Backend& be, size_t n, int repeats) {
  MGPU_CHECK(n >= 1, ConfigError, "n must be >= 1");
  BackendArray<float> x(&be, n), y(&be, n);
  be.zero(x.data(), n);
  be.zero(y.data(), n);
  return time_calls(be, repeats, [&] { be.axpy(y.data(), x.data(), n, 0.5f); });
}

// One captured graph of `nodes` dependent 1-element axpys, replayed as training
// replays a step (argument update + launch): the replay's fixed cost plus nodes x
// the per-node cost, which two node counts separate. Releases the backend's graphs.
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

// h (B, C) -> h: the ReLU that follows each hidden layer's GEMM, with dropout p
// (p = 0: the plain ReLU, whose cost the layer's pass already prices). Zeros stay
// zeros, so every call does the same work on the same values.
std::vector<double> time_relu_dropout(Backend& be, int B, int C, float p, int repeats) {
  MGPU_CHECK(B >= 1 && C >= 1, ConfigError, "rows and columns must be >= 1");
  MGPU_CHECK(p >= 0.0f && p < 1.0f, ConfigError, "dropout probability must be in [0, 1), got ", p);
  BackendArray<float> h(&be, size_t(B) * C);
  be.zero(h.data(), h.size());
  const DropoutKey key{1, 0, 0, 0};
  return time_calls(be, repeats, [&] { be.relu_dropout_forward(h.data(), B, C, p, key); });
}

// host -> backend copies of `bytes` (staging bandwidth; a memcpy on the CPU).
std::vector<double> time_copy_to_backend(Backend& be, size_t bytes, int repeats) {
  MGPU_CHECK(bytes >= 1, ConfigError, "bytes must be >= 1");
  std::vector<float> host((bytes + 3) / 4, 1.0f);
  BackendArray<float> dev(&be, host.size());
  return time_calls(be, repeats, [&] { be.copy_to_backend(dev.data(), host.data(), host.size() * 4); });
}

// The allreduce of nccl-tests, on a communicator and a backend's memory: one
// buffer of max_count floats allocated (and touched) once and reused for every
// size, so no size pays for fresh pages. run() first checks one allreduce bit
// for bit (rank r contributes (r + 1) * (i % 13 + 1): sums are exact in float32),
// then times `iters` allreduces.
class AllreduceProbe {
 public:
  AllreduceProbe(std::shared_ptr<Communicator> comm, std::shared_ptr<Backend> backend, size_t max_count)
      : comm_(std::move(comm)), be_(std::move(backend)), host_(max_count), buffer_(be_.get(), max_count) {
    MGPU_CHECK(max_count >= 1, ConfigError, "max_count must be >= 1");
    // MPI moves host memory only: a device backend's buffer goes through host staging, as in training.
    if (!be_->host_accessible() && !comm_->accepts_device_memory())
      comm_ = std::make_shared<StagedCommunicator>(comm_, be_);
    comm_->attach(be_);
    be_->zero(buffer_.data(), max_count);
  }
  // (seconds per allreduce on this rank, elements that were not bit-exact)
  std::pair<double, int64_t> run(size_t count, int iters, int warmup) {
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

 private:
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Backend> be_;
  std::vector<float> host_;
  BackendArray<float> buffer_;
};

// Nanoseconds for a cache line to go from CPU a to CPU b and back, the median of
// `batches` batches of 64 round trips: about 50 ns between cores that share a
// last-level cache on the machines we measured, several times that across cache
// domains (chiplets, sockets). Two ranks' allreduce goes through that path, so on
// a VM whose hypervisor moves the vCPUs between domains it tells which placement
// a multi-rank timing ran in. Two threads, each pinned to its CPU; the caller's
// affinity is left alone. A CPU that cannot be used throws; a partner that never
// answers (its CPU taken away) ends the probe at the deadline instead of hanging.
double core_round_trip_ns(int cpu_a, int cpu_b, int batches, double timeout_s) {
  MGPU_CHECK(cpu_a >= 0 && cpu_b >= 0 && cpu_a != cpu_b && cpu_a < CPU_SETSIZE && cpu_b < CPU_SETSIZE,
             ConfigError, "the round trip needs two different CPUs in [0, ", CPU_SETSIZE, "), got ", cpu_a,
             " and ", cpu_b);
  MGPU_CHECK(batches >= 1 && timeout_s > 0 && timeout_s <= 3600, ConfigError,
             "batches must be >= 1 and timeout_s in (0, 3600], got ", batches, " and ", timeout_s);
  constexpr int kPerBatch = 64;
  struct alignas(64) Shared {
    std::atomic<int> ball{0};  // 1: the initiator's serve is in flight; 0: returned
    char pad[60];
    std::atomic<bool> give_up{false};
    std::atomic<int> pin_errors[2] = {0, 0};
  } shared;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  auto pin = [&](int cpu, int who) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    const int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    if (rc != 0) {
      shared.pin_errors[who] = rc;
      shared.give_up = true;
    }
    return rc == 0;
  };
  // Spins until `ball` reads `want`; false when the other side gave up or time ran out.
  auto await = [&](int want) {
    for (unsigned spins = 1;; ++spins) {
      if (shared.ball.load(std::memory_order_acquire) == want) return true;
      if ((spins & 4095) == 0 && (shared.give_up.load() || Clock::now() > deadline)) {
        shared.give_up = true;
        return false;
      }
    }
  };
  std::vector<double> ns(static_cast<size_t>(batches));
  auto respond = [&] {
    if (!pin(cpu_b, 1)) return;
    for (int i = 0; i < batches * kPerBatch; ++i) {
      if (!await(1)) return;
      shared.ball.store(0, std::memory_order_release);
    }
  };
  std::thread responder;
  try {
    responder = std::thread(respond);
  } catch (const std::system_error& e) {
    throw DeviceError(std::string("the cache-line round trip could not start a thread: ") + e.what());
  }
  std::thread initiator;
  try {
    initiator = std::thread([&] {
      if (!pin(cpu_a, 0)) return;
      for (int b = 0; b < batches; ++b) {
        const auto t0 = Clock::now();
        for (int i = 0; i < kPerBatch; ++i) {
          shared.ball.store(1, std::memory_order_release);
          if (!await(0)) return;
        }
        const auto t1 = Clock::now();
        ns[static_cast<size_t>(b)] = std::chrono::duration<double, std::nano>(t1 - t0).count() / kPerBatch;
        if (t1 > deadline) {  // round trips too quick for await's own check: the deadline holds anyway
          shared.give_up = true;
          return;
        }
      }
    });
  } catch (const std::system_error& e) {  // no second thread: release the first, never terminate
    shared.give_up = true;
    responder.join();
    throw DeviceError(std::string("the cache-line round trip could not start a thread: ") + e.what());
  }
  initiator.join();
  responder.join();
  for (int who = 0; who < 2; ++who)
    MGPU_CHECK(shared.pin_errors[who] == 0, ConfigError, "cannot run a thread on CPU ", who == 0 ? cpu_a : cpu_b,
               ": ", std::strerror(shared.pin_errors[who]));
  MGPU_CHECK(!shared.give_up, DeviceError, "the cache-line round trip between CPUs ", cpu_a, " and ", cpu_b,
             " did not finish within ", timeout_s, " s (a CPU busy with a higher-priority task?)");
  std::nth_element(ns.begin(), ns.begin() + ns.size() / 2, ns.end());
  return ns[ns.size() / 2];
}

}  // namespace

void bind_perf(py::module_& m) {
  m.def("time_copy_to_backend", &time_copy_to_backend, py::arg("backend"), py::arg("bytes"), py::arg("repeats") = 5,
        py::call_guard<py::gil_scoped_release>(), "Seconds of each timed host-to-backend copy of `bytes`.");
  py::class_<AllreduceProbe>(m, "AllreduceProbe")
      .def(py::init<std::shared_ptr<Communicator>, std::shared_ptr<Backend>, size_t>(), py::arg("communicator"),
           py::arg("backend"), py::arg("max_count"))
      .def("run", &AllreduceProbe::run, py::arg("count"), py::arg("iters"), py::arg("warmup") = 2,
           py::call_guard<py::gil_scoped_release>(),
           "(seconds per allreduce of `count` floats on this rank, elements not bit-exact).");
  m.def("time_linear_backward", &time_linear_backward, py::arg("backend"), py::arg("batch"),
        py::arg("in_features"), py::arg("out_features"), py::arg("repeats") = 5, py::arg("input_gradient") = true,
        py::arg("sweep_bytes") = 0, py::call_guard<py::gil_scoped_release>(),
        "Seconds of each timed linear_backward (input gradient unless input_gradient=False, weight gradients, "
        "bias sums) of this shape; sweep_bytes > 0: each after sweeping that much host memory (cold caches).");
  m.def("time_linear", &time_linear, py::arg("backend"), py::arg("batch"), py::arg("in_features"),
        py::arg("out_features"), py::arg("repeats") = 5, py::arg("sweep_bytes") = 0,
        py::call_guard<py::gil_scoped_release>(),
        "Seconds of each timed Linear forward GEMM (work 2 x batch x in x out FLOP) on the backend; "
        "sweep_bytes > 0: each after sweeping that much host memory (cold caches).");
  m.def("time_relu_dropout", &time_relu_dropout, py::arg("backend"), py::arg("batch"), py::arg("features"),
        py::arg("p"), py::arg("repeats") = 5, py::call_guard<py::gil_scoped_release>(),
        "Seconds of each timed in-place ReLU with dropout p (p = 0: plain ReLU) over a (batch, features) "
        "activation, the mask drawn as training draws it.");
  m.def("time_graph_replay", &time_graph_replay, py::arg("backend"), py::arg("nodes"), py::arg("repeats") = 5,
        py::call_guard<py::gil_scoped_release>(),
        "Seconds of each timed replay of one captured graph of `nodes` tiny kernels (as time_calls times "
        "them: on a device, back to back between two waits): the difference between two node counts is the "
        "per-node cost of a replayed step.");
  m.def("core_round_trip_ns", &core_round_trip_ns, py::arg("cpu_a"), py::arg("cpu_b"), py::arg("batches") = 32,
        py::arg("timeout_s") = 2.0, py::call_guard<py::gil_scoped_release>(),
        "Nanoseconds for a cache line to go from CPU cpu_a to cpu_b and back (median of batches of 64): "
        "which cache domains two ranks' cores share.");
  m.def("time_axpy", &time_axpy, py::arg("backend"), py::arg("n"), py::arg("repeats") = 5,
        py::call_guard<py::gil_scoped_release>(),
        "Seconds of each timed y += a x over n floats (12 bytes per element): bandwidth and, for tiny n, "
        "the per-kernel overhead.");

  using namespace perf;
  auto pm = m.def_submodule("perf", "The performance model and strategy selector.");
  py::class_<GemmRate>(pm, "GemmRate")
      .def(py::init([](double peak, double half) { return GemmRate{peak, half, {}}; }), py::arg("peak_flops") = 0.0,
           py::arg("half_work_flops") = 0.0)
      .def_readwrite("peak_flops", &GemmRate::peak_flops)
      .def_readwrite("half_work_flops", &GemmRate::half_work_flops)
      .def_readwrite("measured", &GemmRate::measured)
      .def("at", &GemmRate::at, py::arg("work_flops"));
  py::class_<LayerTimes>(pm, "LayerTimes")
      .def(py::init<>())
      .def_readwrite("rows", &LayerTimes::rows)
      .def_readwrite("widths", &LayerTimes::widths)
      .def_readwrite("forward", &LayerTimes::forward)
      .def_readwrite("backward", &LayerTimes::backward)
      .def_readwrite("backward_weights", &LayerTimes::backward_weights)
      .def_readwrite("forward_cold", &LayerTimes::forward_cold)
      .def_readwrite("backward_cold", &LayerTimes::backward_cold)
      .def_readwrite("backward_weights_cold", &LayerTimes::backward_weights_cold)
      .def("enabled", &LayerTimes::enabled)
      .def("check", &LayerTimes::check, py::arg("what") = "layer times")
      .def("forward_s", [](const LayerTimes& t, double r, double i, double o) { return t.at(t.forward, r, i, o); },
           py::arg("rows"), py::arg("in_features"), py::arg("out_features"))
      .def("backward_s", [](const LayerTimes& t, double r, double i, double o, bool input_gradient) {
        return t.at(input_gradient ? t.backward : t.backward_weights, r, i, o);
      }, py::arg("rows"), py::arg("in_features"), py::arg("out_features"), py::arg("input_gradient") = true);
  py::class_<StepPhases>(pm, "StepPhases")
      .def(py::init<>())
      .def_readwrite("params", &StepPhases::params)
      .def_readwrite("update_s", &StepPhases::update_s)
      .def_readwrite("wait_s", &StepPhases::wait_s)
      .def_readwrite("wait_spread_s", &StepPhases::wait_spread_s)
      .def_readwrite("ranks", &StepPhases::ranks)
      .def("enabled", &StepPhases::enabled)
      .def("check", &StepPhases::check, py::arg("what") = "step phases")
      .def("update_at", &StepPhases::update_at, py::arg("params"))
      .def("wait_at", &StepPhases::wait_at, py::arg("params"))
      .def("wait_spread_at", &StepPhases::wait_spread_at, py::arg("params"));
  py::class_<DeviceProfile>(pm, "DeviceProfile")
      .def(py::init<>())
      .def_readwrite("name", &DeviceProfile::name)
      .def_readwrite("kind", &DeviceProfile::kind)
      .def_readwrite("fp32", &DeviceProfile::fp32)
      .def_readwrite("tf32", &DeviceProfile::tf32)
      .def_readwrite("bf16", &DeviceProfile::bf16)
      .def_readwrite("fp16", &DeviceProfile::fp16)
      .def_readwrite("memory_bytes", &DeviceProfile::memory_bytes)
      .def_readwrite("memory_bandwidth", &DeviceProfile::memory_bandwidth)
      .def_readwrite("host_to_device_bandwidth", &DeviceProfile::host_to_device_bandwidth)
      .def_readwrite("launch_overhead_s", &DeviceProfile::launch_overhead_s)
      .def_readwrite("graph_node_s", &DeviceProfile::graph_node_s)
      .def_readwrite("captures", &DeviceProfile::captures)
      .def_readwrite("context_bytes", &DeviceProfile::context_bytes)
      .def_readwrite("dropout_s_per_unit", &DeviceProfile::dropout_s_per_unit)
      .def_readwrite("cache_bytes", &DeviceProfile::cache_bytes)
      .def_readwrite("layers", &DeviceProfile::layers)
      .def_readwrite("layers_alone", &DeviceProfile::layers_alone)
      .def_readwrite("pass_bandwidth", &DeviceProfile::pass_bandwidth)
      .def_readwrite("pass_bandwidth_alone", &DeviceProfile::pass_bandwidth_alone)
      .def("bandwidth_at", &DeviceProfile::bandwidth_at, py::arg("bytes"), py::arg("alone") = false)
      .def_readwrite("step_phases", &DeviceProfile::step_phases)
      .def_readwrite("step_phases_alone", &DeviceProfile::step_phases_alone);
  py::class_<CollectiveModel>(pm, "CollectiveModel")
      .def(py::init<>())
      .def_readwrite("latency_s", &CollectiveModel::latency_s)
      .def_readwrite("hop_s", &CollectiveModel::hop_s)
      .def_readwrite("bw_fraction", &CollectiveModel::bw_fraction)
      .def_readwrite("bw_scale_beyond_two", &CollectiveModel::bw_scale_beyond_two)
      .def_readwrite("ring_busbw", &CollectiveModel::ring_busbw)
      .def_readwrite("tree_busbw", &CollectiveModel::tree_busbw)
      .def_readwrite("nvls_busbw", &CollectiveModel::nvls_busbw)
      .def("enabled", &CollectiveModel::enabled)
      .def("seconds", &CollectiveModel::seconds, py::arg("ranks"), py::arg("bytes"))
      .def("choice", &CollectiveModel::choice, py::arg("ranks"), py::arg("bytes"));
  py::class_<LinkProfile>(pm, "LinkProfile")
      .def(py::init<>())
      .def_readwrite("name", &LinkProfile::name)
      .def_readwrite("alpha_s", &LinkProfile::alpha_s)
      .def_readwrite("bus_bandwidth", &LinkProfile::bus_bandwidth)
      .def_readwrite("overlaps_compute", &LinkProfile::overlaps_compute)
      .def_readwrite("buffer_bytes", &LinkProfile::buffer_bytes)
      .def_readwrite("step_sync_s", &LinkProfile::step_sync_s)
      .def_readwrite("measured", &LinkProfile::measured)
      .def_readwrite("measured_devices", &LinkProfile::measured_devices)
      .def_readwrite("intra", &LinkProfile::intra)
      .def_readwrite("inter", &LinkProfile::inter)
      .def_readwrite("gpus_per_node", &LinkProfile::gpus_per_node)
      .def("allreduce_seconds", &LinkProfile::allreduce_seconds, py::arg("devices"), py::arg("bytes"))
      .def("allreduce_choice", &LinkProfile::allreduce_choice, py::arg("devices"), py::arg("bytes"));
  py::class_<HardwareProfile>(pm, "HardwareProfile")
      .def(py::init<>())
      .def_readwrite("name", &HardwareProfile::name)
      .def_readwrite("source", &HardwareProfile::source)
      .def_readwrite("devices", &HardwareProfile::devices)
      .def_readwrite("link", &HardwareProfile::link)
      .def_readwrite("step_overhead_s", &HardwareProfile::step_overhead_s)
      .def_readwrite("model_error", &HardwareProfile::model_error);
  py::class_<Workload>(pm, "Workload")
      .def(py::init<>())
      .def_readwrite("layers", &Workload::layers)
      .def_readwrite("params", &Workload::params)
      .def_readwrite("global_batch", &Workload::global_batch)
      .def_readwrite("precision", &Workload::precision)
      .def_readwrite("optimizer", &Workload::optimizer)
      .def_readwrite("dropout", &Workload::dropout)
      .def_readwrite("bucket_elems", &Workload::bucket_elems)
      .def_readwrite("grad_dtype", &Workload::grad_dtype)
      .def_readwrite("cuda_graph", &Workload::cuda_graph)
      .def_readwrite("accumulate", &Workload::accumulate)
      .def("resolved_layers", &Workload::resolved_layers);
  py::class_<Options>(pm, "Options")
      .def(py::init<>())
      .def_readwrite("candidates", &Options::candidates)
      .def_readwrite("memory_margin", &Options::memory_margin)
      .def_readwrite("price_per_device_hour", &Options::price_per_device_hour)
      .def_readwrite("equal_shares", &Options::equal_shares)
      .def_readwrite("choose_buckets", &Options::choose_buckets)
      .def_readwrite("max_bucket_bytes", &Options::max_bucket_bytes);
  py::class_<Prediction>(pm, "Prediction")
      .def_readonly("devices", &Prediction::devices)
      .def_readonly("batch_shares", &Prediction::batch_shares)
      .def_readonly("forward_s", &Prediction::forward_s)
      .def_readonly("backward_s", &Prediction::backward_s)
      .def_readonly("optimizer_s", &Prediction::optimizer_s)
      .def_readonly("overhead_s", &Prediction::overhead_s)
      .def_readonly("bucket_elems", &Prediction::bucket_elems)
      .def_readonly("graphs", &Prediction::graphs)
      .def_readonly("comm_s", &Prediction::comm_s)
      .def_readonly("exposed_comm_s", &Prediction::exposed_comm_s)
      .def_readonly("step_s", &Prediction::step_s)
      .def_readonly("samples_per_s", &Prediction::samples_per_s)
      .def_readonly("speedup", &Prediction::speedup)
      .def_readonly("efficiency", &Prediction::efficiency)
      .def_readonly("timing_spread_s", &Prediction::timing_spread_s)
      .def_readonly("memory_bytes", &Prediction::memory_bytes)
      .def_readonly("memory_usable_bytes", &Prediction::memory_usable_bytes)
      .def_readonly("memory_fits", &Prediction::memory_fits)
      .def_readonly("cost_per_million_samples", &Prediction::cost_per_million_samples);
  py::class_<Recommendation>(pm, "Recommendation")
      .def_readonly("strategy", &Recommendation::strategy)
      .def_readonly("devices", &Recommendation::devices)
      .def_readonly("candidates", &Recommendation::candidates)
      .def_readonly("break_even_batch", &Recommendation::break_even_batch)
      .def_readonly("reasons", &Recommendation::reasons)
      .def_readonly("confidence", &Recommendation::confidence)
      .def_readonly("roi", &Recommendation::roi)
      .def_readonly("fallback", &Recommendation::fallback)
      .def_readonly("profile", &Recommendation::profile)
      .def_readonly("profile_source", &Recommendation::profile_source)
      .def_readonly("params", &Recommendation::params);
  py::class_<BucketChoice>(pm, "BucketChoice")
      .def_readonly("bucket_elems", &BucketChoice::bucket_elems)
      .def_readonly("exposed_comm_s", &BucketChoice::exposed_comm_s)
      .def_readonly("comm_s", &BucketChoice::comm_s)
      .def_readonly("step_s", &BucketChoice::step_s)
      .def_readonly("tried", &BucketChoice::tried)
      .def_readonly("reason", &BucketChoice::reason);
  pm.def("choose_bucket", &choose_bucket, py::arg("workload"), py::arg("hardware"), py::arg("devices"),
         py::arg("options"), py::arg("max_bucket_bytes") = 0.0);
  pm.def("training_memory_bytes", &training_memory_bytes, py::arg("workload"), py::arg("rows"));
  pm.def("predict", &predict, py::arg("workload"), py::arg("hardware"), py::arg("devices"), py::arg("options"));
  pm.def("recommend", &recommend, py::arg("workload"), py::arg("hardware"), py::arg("options"));
  pm.def("recommend_by_thresholds", &recommend_by_thresholds, py::arg("workload"), py::arg("options"));
}

}  // namespace mgpu
