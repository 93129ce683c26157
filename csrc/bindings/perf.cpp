// Bindings of the performance model (csrc/core/perf_model.h), the
// micro-benchmarks that calibrate it (csrc/core/microbench.h) and the cache-line
// round trip between two CPUs (csrc/probes/core_round_trip.h), used by
// `mgpu topo`, `mgpu bench` and `mgpu recommend`.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "../core/backend.h"
#include "../core/communicator.h"
#include "../core/microbench.h"
#include "../core/perf_model.h"
#include "../probes/core_round_trip.h"

namespace py = pybind11;

namespace mgpu {

void bind_perf(py::module_& m) {
  m.def("time_copy_to_backend", &time_copy_to_backend, py::arg("backend"), py::arg("bytes"), py::arg("repeats") = 5,
        py::call_guard<py::gil_scoped_release>(), "Seconds of each timed host-to-backend copy of `bytes`.");
  py::class_<AllreduceProbe>(m, "AllreduceProbe")
      .def(py::init<std::shared_ptr<Communicator>, std::shared_ptr<Backend>, size_t>(), py::arg("communicator"),
           py::arg("backend"), py::arg("max_count"))
      .def("run", &AllreduceProbe::run, py::arg("count"), py::arg("iters"), py::arg("warmup") = 2,
           py::call_guard<py::gil_scoped_release>(),
           "(seconds per allreduce of `count` floats on this rank, elements not bit-exact).");
  m.def("time_linear_backward", &time_linear_backward, py::arg("backend"), py::arg("batch"), py::arg("in_features"),
        py::arg("out_features"), py::arg("repeats") = 5, py::arg("input_gradient") = true, py::arg("sweep_bytes") = 0,
        py::call_guard<py::gil_scoped_release>(),
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
      .def(py::init([](double peak, double half) {
             return GemmRate{peak, half, {}};
           }),
           py::arg("peak_flops") = 0.0, py::arg("half_work_flops") = 0.0)
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
      .def(
          "forward_s", [](const LayerTimes& t, double r, double i, double o) { return t.at(t.forward, r, i, o); },
          py::arg("rows"), py::arg("in_features"), py::arg("out_features"))
      .def(
          "backward_s",
          [](const LayerTimes& t, double r, double i, double o, bool input_gradient) {
            return t.at(input_gradient ? t.backward : t.backward_weights, r, i, o);
          },
          py::arg("rows"), py::arg("in_features"), py::arg("out_features"), py::arg("input_gradient") = true);
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
      .def("allreduce_choice", &LinkProfile::allreduce_choice, py::arg("devices"), py::arg("bytes"))
      .def("reduce_scatter_seconds", &LinkProfile::reduce_scatter_seconds, py::arg("devices"), py::arg("bytes"))
      .def("all_gather_seconds", &LinkProfile::all_gather_seconds, py::arg("devices"), py::arg("bytes"))
      .def("reduce_scatter_choice", &LinkProfile::reduce_scatter_choice, py::arg("devices"), py::arg("bytes"));
  py::class_<ErrorBand>(pm, "ErrorBand")
      .def(py::init<>())
      .def_readwrite("low", &ErrorBand::low)
      .def_readwrite("high", &ErrorBand::high)
      .def("center", &ErrorBand::center)
      .def("half_width", &ErrorBand::half_width);
  py::class_<ErrorModel>(pm, "ErrorModel")
      .def(py::init<>())
      .def_readwrite("compute", &ErrorModel::compute)
      .def_readwrite("compute_together", &ErrorModel::compute_together)
      .def_readwrite("comm", &ErrorModel::comm)
      .def_readwrite("speedup", &ErrorModel::speedup)
      .def_readwrite("speedup_measured", &ErrorModel::speedup_measured)
      .def_readwrite("compute_shared", &ErrorModel::compute_shared)
      .def_readwrite("step_bands", &ErrorModel::step_bands)
      .def_readwrite("source", &ErrorModel::source);
  py::class_<HardwareProfile>(pm, "HardwareProfile")
      .def(py::init<>())
      .def_readwrite("name", &HardwareProfile::name)
      .def_readwrite("source", &HardwareProfile::source)
      .def_readwrite("devices", &HardwareProfile::devices)
      .def_readwrite("link", &HardwareProfile::link)
      .def_readwrite("step_overhead_s", &HardwareProfile::step_overhead_s)
      .def_readwrite("error", &HardwareProfile::error);
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
      .def_readwrite("shard_optimizer", &Workload::shard_optimizer)
      .def_readwrite("data_on_device", &Workload::data_on_device)
      .def("resolved_layers", &Workload::resolved_layers);
  py::class_<Options>(pm, "Options")
      .def(py::init<>())
      .def_readwrite("candidates", &Options::candidates)
      .def_readwrite("memory_margin", &Options::memory_margin)
      .def_readwrite("price_per_device_hour", &Options::price_per_device_hour)
      .def_readwrite("equal_shares", &Options::equal_shares)
      .def_readwrite("share_weights", &Options::share_weights)
      .def_readwrite("overlap", &Options::overlap)
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
      .def_readonly("sharded", &Prediction::sharded)
      .def_readonly("comm_s", &Prediction::comm_s)
      .def_readonly("exposed_comm_s", &Prediction::exposed_comm_s)
      .def_readonly("gather_s", &Prediction::gather_s)
      .def_readonly("gather_exposed_s", &Prediction::gather_exposed_s)
      .def_readonly("optimizer_state_bytes", &Prediction::optimizer_state_bytes)
      .def_readonly("step_s", &Prediction::step_s)
      .def_readonly("samples_per_s", &Prediction::samples_per_s)
      .def_readonly("speedup", &Prediction::speedup)
      .def_readonly("efficiency", &Prediction::efficiency)
      .def_readonly("timing_spread_s", &Prediction::timing_spread_s)
      .def_readonly("step_low_s", &Prediction::step_low_s)
      .def_readonly("step_high_s", &Prediction::step_high_s)
      .def_readonly("speedup_low", &Prediction::speedup_low)
      .def_readonly("speedup_high", &Prediction::speedup_high)
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
  pm.def("training_memory_bytes", &training_memory_bytes, py::arg("workload"), py::arg("rows"), py::arg("devices") = 1,
         "Bytes one of `devices` holds to train the workload on `rows` samples a step (weights, gradients, "
         "optimizer state (its shard where workload.shard_optimizer), activations).");
  pm.def("optimizer_state_bytes", &optimizer_state_bytes, py::arg("workload"), py::arg("devices") = 1,
         "Optimizer state one of `devices` holds (SGD 4 B, AdamW 8 B a parameter; 1/devices of it sharded).");
  pm.def("predict", &predict, py::arg("workload"), py::arg("hardware"), py::arg("devices"), py::arg("options"));
  pm.def("recommend", &recommend, py::arg("workload"), py::arg("hardware"), py::arg("options"));
  pm.def("recommend_by_thresholds", &recommend_by_thresholds, py::arg("workload"), py::arg("options"));
}

}  // namespace mgpu
