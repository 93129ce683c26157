// pybind11 bindings of the native core as mgpu._core: one bind_* function per
// part, each checking and converting Python's arguments (NumPy arrays to HostBatch
// views), releasing the GIL around the math and calling the core; the core's
// typed errors map to Python exceptions. Only csrc/bindings knows Python.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <limits>
#include <map>
#include <vector>

#include "../core/backend.h"
#include "../core/communicator.h"
#include "../core/errors.h"
#include "../core/model.h"
#include "../core/optimizer.h"
#include "../core/philox.h"
#include "../core/resident_data.h"
#include "../core/train_step.h"
#include "../cpu/cpu_backend.h"
#ifdef MGPU_HAVE_MPI
#include "../mpi/mpi_communicator.h"
#endif
#ifdef MGPU_HAVE_CUDA
#include "../cuda/cuda_api.h"
#endif
#ifdef MGPU_HAVE_NCCL
#include "../cuda/nccl_communicator.h"
#endif
#ifdef MGPU_HAVE_OPENBLAS
extern "C" char* openblas_get_config(void);
#endif

namespace py = pybind11;
using namespace mgpu;

namespace mgpu {
void bind_probe(py::module_& m);   // probe.cpp
void bind_perf(py::module_& m);    // perf.cpp
void bind_stress(py::module_& m);  // stress.cpp
}  // namespace mgpu

namespace {

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

// A batch converted for the core; owns the converted arrays while it lives.
struct BatchArgs {
  FloatArray x, targets;
  std::vector<int32_t> labels;
  HostBatch view;
};

BatchArgs make_batch(MLP& model, const py::array& x_in, const py::object& y_in, LossKind loss) {
  BatchArgs a;
  a.x = FloatArray::ensure(x_in);
  if (!a.x) throw ConfigError("x must be a numeric array");
  if (a.x.ndim() != 2 || a.x.shape(1) != model.in_features())
    throw ConfigError(
        detail::concat("x must have shape (rows, ", model.in_features(), "), got ",
                       a.x.ndim() == 2 ? "(" + std::to_string(a.x.shape(0)) + ", " + std::to_string(a.x.shape(1)) + ")"
                                       : std::to_string(a.x.ndim()) + " dimensions"));
  if (a.x.shape(0) > std::numeric_limits<int>::max()) throw ConfigError("too many rows in one batch");
  const int rows = static_cast<int>(a.x.shape(0));
  a.view.x = a.x.data();
  a.view.rows = rows;
  if (y_in.is_none()) return a;
  py::array y = py::array::ensure(y_in);
  if (!y) throw ConfigError("y must be an array");
  if (y.ndim() < 1 || y.shape(0) != rows) throw ConfigError(detail::concat("y must have ", rows, " rows like x"));
  if (loss == LossKind::kMSE) {
    a.targets = FloatArray::ensure(y);
    const int D = model.out_features();
    const bool ok = (a.targets.ndim() == 2 && a.targets.shape(1) == D) || (a.targets.ndim() == 1 && D == 1);
    if (!ok) throw ConfigError(detail::concat("mse targets must have shape (rows, ", D, ")"));
    a.view.targets = a.targets.data();
  } else {
    if (y.ndim() != 1) throw ConfigError("cross_entropy labels must be a 1-D integer array");
    if (y.dtype().kind() != 'i' && y.dtype().kind() != 'u')
      throw ConfigError(
          detail::concat("cross_entropy labels must be integers, got dtype ", std::string(py::str(y.dtype()))));
    auto y64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(y);
    a.labels.resize(rows);
    const int64_t* src = y64.data();
    const int C = model.out_features();
    for (int i = 0; i < rows; ++i) {
      if (src[i] < 0 || src[i] >= C)
        throw ConfigError(detail::concat("label ", src[i], " at row ", i, " is out of range [0, ", C, ")"));
      a.labels[i] = static_cast<int32_t>(src[i]);
    }
    a.view.labels = a.labels.data();
  }
  return a;
}

// Micro-batches [(offset, rows, first_sample), ...] of rows already in the backend's memory:
// rows order[offset, offset + rows) of resident data, or, without it, of the prefetched rows.
std::vector<MicroShard> shards_in_backend(const py::list& micro_batches, const ResidentData* resident) {
  std::vector<MicroShard> shards;
  for (py::handle item : micro_batches) {
    auto t = item.cast<py::tuple>();
    if (t.size() != 3)
      throw ConfigError(resident ? "each micro-batch is a tuple (order_offset, rows, first_sample)"
                                 : "each micro-batch is a tuple (row_offset, rows, first_sample)");
    MicroShard shard;
    shard.resident = resident;
    shard.prefetched = resident == nullptr;
    shard.order_offset = t[0].cast<int64_t>();
    shard.batch.rows = t[1].cast<int>();
    shard.first_sample = t[2].cast<int64_t>();
    shards.push_back(shard);
  }
  return shards;
}

// The next step's rows of a step's prefetch argument ((x, y) or None), converted into args
// (which keeps them alive); null for None.
const HostBatch* prefetch_batch(DataParallelStep& s, const py::object& prefetch, std::vector<BatchArgs>& args) {
  if (prefetch.is_none()) return nullptr;
  auto t = prefetch.cast<py::tuple>();
  if (t.size() != 2 || t[1].is_none()) throw ConfigError("prefetch is a tuple (x, y) of the next step's rows");
  args.push_back(make_batch(s.model(), t[0].cast<py::array>(), t[1], s.loss()));
  return &args.back().view;
}

// fill may wait on the device: the GIL is released meanwhile, so another
// thread (a rank of run_on_gpus) can launch the collective the device waits for.
py::array_t<float> host_copy(size_t n, const std::function<void(float*)>& fill) {
  py::array_t<float> out(static_cast<py::ssize_t>(n));
  float* dst = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    fill(dst);
  }
  return out;
}

FloatArray writable_float_array(const py::array& a, const char* what) {
  if (!py::isinstance<py::array_t<float>>(a) || !(a.flags() & py::array::c_style) || !a.writeable())
    throw ConfigError(std::string(what) + " must be a writable C-contiguous float32 array");
  return py::reinterpret_borrow<FloatArray>(a);
}

py::dict build_info() {
  py::dict info;
  info["version"] = MGPU_VERSION;
  info["compiler"] = MGPU_COMPILER;
  info["build_type"] = MGPU_BUILD_TYPE;
  info["cpu_threads_available"] = available_cpu_threads();
  py::dict blas;
  blas["library"] = MGPU_BLAS_NAME;
#ifdef MGPU_HAVE_OPENBLAS
  blas["config"] = std::string(openblas_get_config());
#endif
  blas["onednn"] = onednn_version();  // "" when this build has none
  // CpuGemm::kAuto's rule: by product size on AVX2 CPUs, by output width on AVX-512 ones
  blas["onednn_max_work"] = kOneDnnMaxWork;
  blas["onednn_min_width_avx512"] = kOneDnnMinWidthAvx512;
  blas["cpu_avx512"] = cpu_has_avx512();
  info["blas"] = blas;
#ifdef _OPENMP
  info["openmp"] = true;
#else
  info["openmp"] = false;
#endif
  py::dict mpi;
#ifdef MGPU_HAVE_MPI
  mpi["enabled"] = true;
  mpi["compiled_with"] = MGPU_MPI_VERSION;
  mpi["library"] = mpi_library_version();
#else
  mpi["enabled"] = false;
#endif
  info["mpi"] = mpi;
  py::dict cuda;
  cuda["toolkit_found"] = std::string(MGPU_CUDA_TOOLKIT_VERSION).size() > 0;
  cuda["toolkit_version"] = MGPU_CUDA_TOOLKIT_VERSION;
  cuda["cublas_found"] = bool(MGPU_CUBLAS_FOUND);
  cuda["curand_found"] = bool(MGPU_CURAND_FOUND);
  cuda["nccl_found"] = std::string(MGPU_NCCL_VERSION).size() > 0;
  cuda["nccl_version"] = MGPU_NCCL_VERSION;
#ifdef MGPU_HAVE_CUDA
  cuda["backend"] = true;
  cuda["compiled"] = true;
  const cuda::Versions v = cuda::versions();
  cuda["runtime_compiled"] = v.runtime_compiled;
  cuda["runtime_loaded"] = v.runtime_loaded;
  cuda["driver"] = v.driver;  // "" without a driver
  cuda["cublas_compiled"] = v.cublas_compiled;
  cuda["cublas_loaded"] = v.cublas_loaded;
  cuda["curand_compiled"] = v.curand_compiled;
  cuda["curand_loaded"] = v.curand_loaded;
  cuda["nccl_compiled"] = v.nccl_compiled;
  cuda["nccl_loaded"] = v.nccl_loaded;
  cuda["nccl_loaded_code"] = v.nccl_loaded_code;
  const int gpus = cuda::device_count();
  cuda["device_count"] = gpus;
  if (gpus == 0) cuda["no_device_reason"] = cuda::no_device_reason();
  py::list gpu_list;  // what `mgpu info` shows of each GPU
  for (int i = 0; i < gpus; ++i) {
    const cuda::DeviceInfo d = cuda::device_info(i);
    py::dict dev;
    dev["index"] = d.index;
    dev["name"] = d.name;
    dev["total_memory_mib"] = d.total_memory >> 20;
    dev["multiprocessors"] = d.multiprocessors;
    dev["compute_capability"] = std::to_string(d.major) + "." + std::to_string(d.minor);
    dev["pci_bus_id"] = d.pci_bus_id;
    gpu_list.append(dev);
  }
  cuda["devices"] = gpu_list;
#else
  cuda["backend"] = false;
  cuda["compiled"] = false;
  cuda["device_count"] = 0;
#endif
#ifdef MGPU_HAVE_NCCL
  cuda["nccl_communicator"] = true;
#else
  cuda["nccl_communicator"] = false;
#endif
  info["cuda"] = cuda;
  py::list devices;
  devices.append("cpu");
#ifdef MGPU_HAVE_CUDA
  devices.append("cuda");
#endif
  info["backends"] = devices;
#ifdef MGPU_GPU_EMULATION
  info["gpu_emulation"] = true;  // every GPU of this module is the CPU emulation (emulation/)
#else
  info["gpu_emulation"] = false;
#endif
  cuda["emulated"] = info["gpu_emulation"];
  return info;
}

// The arrays each communicator's async sums write until wait_all: held here so
// Python cannot free them under MPI (the GIL guards this map).
std::map<const Communicator*, std::vector<py::object>>& in_flight_buffers() {
  static auto* buffers = new std::map<const Communicator*, std::vector<py::object>>();
  return *buffers;
}

// StepOptions::graph as Python names it.
StepOptions::Graph parse_graph_mode(const std::string& graph) {
  if (graph == "off") return StepOptions::Graph::kOff;
  if (graph == "auto") return StepOptions::Graph::kAuto;
  if (graph == "on") return StepOptions::Graph::kOn;
  throw ConfigError("unknown graph mode '" + graph + "' (expected auto, on or off)");
}
const char* graph_mode_name(StepOptions::Graph graph) {
  switch (graph) {
    case StepOptions::Graph::kOff: return "off";
    case StepOptions::Graph::kAuto: return "auto";
    case StepOptions::Graph::kOn: return "on";
  }
  return "off";
}

// The core's typed errors as Python exceptions.
void bind_errors(py::module_& m) {
  auto base = py::register_exception<Error>(m, "MgpuError", PyExc_RuntimeError);
  // A ValueError (bad input) and an MgpuError both: `except mgpu.MgpuError` catches all mgpu raises.
  const py::tuple config_bases = py::make_tuple(py::handle(PyExc_ValueError), base);
  py::register_exception<ConfigError>(m, "ConfigError", config_bases);
  py::register_exception<DeviceError>(m, "DeviceError", base.ptr());
  py::register_exception<CommError>(m, "CommError", base.ptr());
  py::register_exception<NumericsError>(m, "NumericsError", base.ptr());
}

// What this build contains.
void bind_build_info(py::module_& m) {
  m.def("build_info", &build_info, "What this build of the core contains (a dict).");
}

// Backends and the CPU backend's GEMM library choice.
void bind_backends(py::module_& m) {
  py::class_<Backend, std::shared_ptr<Backend>>(m, "Backend")
      .def_property_readonly("name", &Backend::name)
      .def_property("threads", &Backend::threads, &Backend::set_threads)
      .def_property(
          "precision", [](const Backend& b) { return precision_name(b.precision()); },
          [](Backend& b, const std::string& name) { b.set_precision(parse_precision(name)); },
          "GEMM arithmetic: 'fp32' | 'tf32' | 'bf16' | 'fp16' (parameters, gradients and optimizer "
          "state stay fp32); backends that cannot honour one raise ConfigError.")
      .def("synchronize", &Backend::synchronize, py::call_guard<py::gil_scoped_release>());
  m.def("make_backend", &make_backend, py::arg("device") = "cpu", py::arg("device_index") = 0, py::arg("threads") = 0,
        "A backend for 'cpu' or 'cuda'; threads=0 uses every available core.");
  auto cpu_backend = [](Backend& b) -> CpuBackend& {
    auto* cpu = dynamic_cast<CpuBackend*>(&b);
    if (!cpu) throw ConfigError("the GEMM library choice applies to the CPU backend, not '" + b.name() + "'");
    return *cpu;
  };
  m.def(
      "set_cpu_gemm",
      [cpu_backend](Backend& b, const std::string& name) { cpu_backend(b).set_gemm(parse_cpu_gemm(name)); },
      py::arg("backend"), py::arg("library"),
      "Pick the CPU backend's GEMM library: 'auto' (by product shape and the CPU's vector width), "
      "'openblas' or 'onednn' (as MGPU_CPU_GEMM does at creation).");
  m.def(
      "auto_cpu_gemm",
      [](int M, int N, int K, int threads, bool avx512) {
        MGPU_CHECK(threads >= 1, ConfigError, "threads must be >= 1, got ", threads);
        return std::string(cpu_gemm_name(auto_cpu_gemm(M, N, K, threads, avx512, onednn_available())));
      },
      py::arg("M"), py::arg("N"), py::arg("K"), py::arg("threads"), py::arg("avx512"),
      "The library MGPU_CPU_GEMM=auto picks for a row-major (M, N, K) product on that many "
      "threads of a CPU with or without AVX-512 (this build's oneDNN, if any).");
  m.def(
      "cpu_gemm_library",
      [cpu_backend](Backend& b, int M, int N, int K) {
        return std::string(cpu_gemm_name(cpu_backend(b).gemm_library(M, N, K)));
      },
      py::arg("backend"), py::arg("M"), py::arg("N"), py::arg("K"),
      "The library that computes an (M, N, K) product on this CPU backend now.");
}

// A range cut into one part per rank must be the whole array.
void check_parts(const Communicator& c, const FloatArray& buf, const std::vector<size_t>& parts) {
  const size_t total = c.parts_total(parts);
  MGPU_CHECK(total == static_cast<size_t>(buf.size()), ConfigError, "the parts hold ", total, " elements, the array ",
             buf.size());
}

// Communicators: local, MPI and NCCL.
void bind_communicators(py::module_& m) {
  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator")
      .def_property_readonly("name", &Communicator::name)
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property("timeout", &Communicator::timeout, &Communicator::set_timeout,
                    "Seconds a collective may take before it fails with CommError naming the "
                    "missing ranks (0: wait forever).")
      .def("begin_step", &Communicator::begin_step, py::arg("step"),
           "Heartbeat: this rank reached training step `step`.")
      .def_property_readonly("current_step", &Communicator::current_step,
                             "The training step of the last begin_step heartbeat.")
      .def("missing_peers", &Communicator::missing_peers,
           "Watched ranks whose heartbeats have not reached this rank's current step.")
      .def("heartbeat", &Communicator::heartbeat,
           "Call while waiting on peers: tells them this rank is alive and reads their heartbeats.")
      .def("diagnose_stall", &Communicator::diagnose_stall, py::arg("silence"),
           "Which ranks never reached the current step or went silent for `silence` seconds, in words.")
      .def("close", &Communicator::close, py::call_guard<py::gil_scoped_release>(),
           "Collective, the normal end: completes what is in flight and releases the transport (NCCL: "
           "finalize and destroy, under the timeout); later calls raise CommError.")
      .def("abort", &Communicator::abort, py::arg("why"),
           "Ends collectives in flight without the peers (after an error); local, never blocks; later "
           "calls raise CommError.")
      .def_property_readonly("may_write_after_failure", &Communicator::may_write_after_failure,
                             "After a timeout or an abort: whether a collective it could not end may still "
                             "write the buffers it was given (keep them alive).")
      .def(
          "allreduce_sum",
          [](Communicator& c, py::array a) {
            auto buf = writable_float_array(a, "allreduce buffer");
            py::gil_scoped_release nogil;
            c.allreduce_sum(buf.mutable_data(), static_cast<size_t>(buf.size()));
          },
          py::arg("buffer"), "In-place sum across ranks of a float32 array (element count = its size).")
      .def(
          "allreduce_sum_bucketed",
          [](Communicator& c, py::array a, size_t bucket_elems) {
            auto buf = writable_float_array(a, "allreduce buffer");
            if (bucket_elems < 1) throw ConfigError("bucket_elems must be >= 1");
            py::gil_scoped_release nogil;
            const size_t n = static_cast<size_t>(buf.size());
            for (size_t off = 0; off < n; off += bucket_elems) {
              c.allreduce_sum_async(buf.mutable_data() + off, std::min(bucket_elems, n - off));
              c.progress();
            }
            c.wait_all();
          },
          py::arg("buffer"), py::arg("bucket_elems"),
          "In-place sum as asynchronous per-bucket allreduces (the overlapping path), then wait.")
      .def(
          "allreduce_sum_async",
          [](Communicator& c, py::array a) {
            auto buf = writable_float_array(a, "allreduce buffer");
            in_flight_buffers()[&c].push_back(buf);  // MPI writes it until wait_all returns
            py::gil_scoped_release nogil;
            c.allreduce_sum_async(buf.mutable_data(), static_cast<size_t>(buf.size()));
          },
          py::arg("buffer"),
          "Starts an in-place sum across ranks of a float32 array; complete once wait_all() returns "
          "(the communicator holds the array until then).")
      .def_property_readonly("fences_device_work", &Communicator::fences_device_work,
                             "Whether the backend can wait for part of the queued collectives (NCCL): a sharded "
                             "step then gathers the parameters layer by layer into the next forward.")
      .def("progress", &Communicator::progress, py::call_guard<py::gil_scoped_release>(),
           "Lets a host-driven transport (MPI) advance the sums in flight.")
      .def(
          "wait_all",
          [](Communicator& c) {
            {
              py::gil_scoped_release nogil;
              c.wait_all();
            }
            in_flight_buffers().erase(&c);  // not after a failure: a timed-out sum may still write them
          },
          "Completes every sum allreduce_sum_async started.")
      .def("start_collective_timing", &Communicator::start_collective_timing,
           "Stamps the async sums started from now on (see collective_times).")
      .def("collective_times", &Communicator::collective_times,
           "(launch, done) in seconds since start_collective_timing of each async sum since, once "
           "wait_all returned ([] when the transport cannot tell); ends the stamping.")
      .def(
          "broadcast",
          [](Communicator& c, py::array a, int root) {
            auto buf = writable_float_array(a, "broadcast buffer");
            py::gil_scoped_release nogil;
            c.broadcast(buf.mutable_data(), static_cast<size_t>(buf.size()), root);
          },
          py::arg("buffer"), py::arg("root") = 0)
      .def(
          "reduce_scatter_sum",
          [](Communicator& c, py::array a, const std::vector<size_t>& parts) {
            auto buf = writable_float_array(a, "reduce-scatter buffer");
            check_parts(c, buf, parts);
            py::gil_scoped_release nogil;
            c.reduce_scatter_sum(buf.mutable_data(), parts);
          },
          py::arg("buffer"), py::arg("parts"),
          "In place: the float32 array is cut into consecutive parts, parts[r] elements owned by rank r; "
          "each rank's own part ends holding the sum over ranks (the rest is left unspecified).")
      .def(
          "all_gather",
          [](Communicator& c, py::array a, const std::vector<size_t>& parts) {
            auto buf = writable_float_array(a, "all-gather buffer");
            check_parts(c, buf, parts);
            py::gil_scoped_release nogil;
            c.all_gather(buf.mutable_data(), parts);
          },
          py::arg("buffer"), py::arg("parts"),
          "In place: the float32 array is cut into consecutive parts, parts[r] elements owned by rank r; "
          "every part ends holding its owner's values on every rank.")
      .def(
          "reduce_scatter_sum_async",
          [](Communicator& c, py::array a, const std::vector<size_t>& parts) {
            auto buf = writable_float_array(a, "reduce-scatter buffer");
            check_parts(c, buf, parts);
            in_flight_buffers()[&c].push_back(buf);
            py::gil_scoped_release nogil;
            c.reduce_scatter_sum_async(buf.mutable_data(), parts);
          },
          py::arg("buffer"), py::arg("parts"), "reduce_scatter_sum, queued; complete once wait_all() returns.")
      .def(
          "all_gather_async",
          [](Communicator& c, py::array a, const std::vector<size_t>& parts) {
            auto buf = writable_float_array(a, "all-gather buffer");
            check_parts(c, buf, parts);
            in_flight_buffers()[&c].push_back(buf);
            py::gil_scoped_release nogil;
            c.all_gather_async(buf.mutable_data(), parts);
          },
          py::arg("buffer"), py::arg("parts"), "all_gather, queued; complete once wait_all() returns.")
      .def("barrier", [](Communicator& c) {
        py::gil_scoped_release nogil;
        c.barrier();
      });
  py::class_<LocalCommunicator, Communicator, std::shared_ptr<LocalCommunicator>>(m, "LocalCommunicator")
      .def(py::init<>());
#ifdef MGPU_HAVE_MPI
  py::class_<MpiCommunicator, Communicator, std::shared_ptr<MpiCommunicator>>(m, "MpiCommunicator")
      .def(py::init<uintptr_t>(), py::arg("handle"),
           "Wraps (a duplicate of) the MPI communicator whose handle is mpi4py's MPI._handleof(comm).");
#endif
#ifdef MGPU_HAVE_NCCL
  m.def(
      "nccl_unique_id", []() { return py::bytes(cuda::nccl_unique_id()); },
      "A fresh ncclUniqueId (bytes); rank 0 creates it and broadcasts it to the others.");
  py::class_<NcclCommunicator, Communicator, std::shared_ptr<NcclCommunicator>>(m, "NcclCommunicator")
      .def(py::init([](py::bytes unique_id, int rank, int size, int device_index, std::shared_ptr<Communicator> sidecar,
                       double setup_timeout) {
             std::string id = unique_id;
             py::gil_scoped_release nogil;  // setup waits for every rank
             return std::make_shared<NcclCommunicator>(id, rank, size, device_index, std::move(sidecar), setup_timeout);
           }),
           py::arg("unique_id"), py::arg("rank"), py::arg("size"), py::arg("device_index"),
           py::arg("sidecar") = nullptr, py::arg("setup_timeout") = 0.0,
           "NCCL communicator of one rank on GPU device_index; sidecar: the MpiCommunicator whose "
           "heartbeats name missing ranks on a timeout; setup_timeout: seconds the ranks may take to "
           "meet (0: forever), CommError after.")
      .def_property_readonly("device", &NcclCommunicator::device);
  m.def(
      "nccl_init_all",
      [](const std::vector<int>& devices) {
        py::gil_scoped_release nogil;
        return NcclCommunicator::init_all(devices);
      },
      py::arg("devices"),
      "Single-process multi-GPU: one NcclCommunicator per device (ncclCommInitAll); rank i drives "
      "devices[i], each from a thread of its own.");
#endif
}

// CUDA: discovery, properties, versions, test hooks.
void bind_cuda(py::module_& m) {
  m.def(
      "cuda_device_count",
#ifdef MGPU_HAVE_CUDA
      []() { return cuda::device_count(); },
#else
      []() { return 0; },
#endif
      "GPUs visible to this process (0 without a CUDA backend, driver or GPU; never raises).");
  m.def(
      "philox4x32_10",
      [](std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
        const Philox4 r = philox4x32_10(c[0], c[1], c[2], c[3], k[0], k[1]);
        return std::array<uint32_t, 4>{r.v[0], r.v[1], r.v[2], r.v[3]};
      },
      py::arg("counter"), py::arg("key"), "mgpu's Philox4x32-10 (csrc/core/philox.h) on the host.");
#ifdef MGPU_HAVE_CUDA
  m.def(
      "cuda_device_info",
      [](int index) {
        const cuda::DeviceInfo d = cuda::device_info(index);
        py::dict out;
        out["index"] = d.index;
        out["name"] = d.name;
        out["total_memory"] = d.total_memory;
        out["multiprocessors"] = d.multiprocessors;
        out["compute_capability"] = std::to_string(d.major) + "." + std::to_string(d.minor);
        out["pci_bus_id"] = d.pci_bus_id;
        return out;
      },
      py::arg("index") = 0, "Name, memory (bytes), SM count, compute capability and PCI bus id of a GPU.");
  m.def(
      "cuda_memory_info", [](int index) { return cuda::memory_info(index); }, py::arg("index") = 0,
      "(free, total) bytes of device memory (cudaMemGetInfo).");
  m.def("curand_philox4x32_10", &cuda::curand_philox_on_host, py::arg("counter"), py::arg("key"),
        "cuRAND's curand_Philox4x32_10 (the dropout kernel's generator) run on the host.");
  m.def(
      "cuda_dropout_mask_on_host",
      [](int B, int C, float p, uint64_t seed, uint64_t step, uint32_t layer, int64_t first_sample) {
        std::vector<float> mask = cuda::dropout_mask_on_host(B, C, p, DropoutKey{seed, step, layer, first_sample});
        py::array_t<float> out({static_cast<py::ssize_t>(B), static_cast<py::ssize_t>(C)});
        std::copy(mask.begin(), mask.end(), out.mutable_data());
        return out;
      },
      py::arg("rows"), py::arg("cols"), py::arg("p"), py::arg("seed") = 0, py::arg("step") = 0, py::arg("layer") = 0,
      py::arg("first_sample") = 0,
      "The CUDA dropout kernel's per-element mask code run on the host: (rows, cols) of 0 or 1/(1-p).");
#endif
}

// The MLP.
void bind_model(py::module_& m) {
  py::class_<MLP, std::shared_ptr<MLP>> mlp_class(m, "MLP");
  mlp_class.attr("EVAL_CHUNK_ROWS") = MLP::kEvalChunkRows;
  mlp_class
      .def(py::init<std::shared_ptr<Backend>, std::vector<int>, float, uint64_t>(), py::arg("backend"),
           py::arg("sizes"), py::arg("dropout") = 0.0f, py::arg("seed") = 0)
      .def_property_readonly("sizes", &MLP::sizes)
      .def_property_readonly("num_params", &MLP::num_params)
      .def_property_readonly("dropout", &MLP::dropout)
      .def_property_readonly("seed", &MLP::seed)
      .def_property_readonly("backend", &MLP::backend_ptr)
      .def(
          "layer_offsets",
          [](const MLP& mm) {
            std::vector<std::pair<size_t, size_t>> out;
            for (int l = 0; l < mm.num_layers(); ++l) out.emplace_back(mm.weight_offset(l), mm.bias_offset(l));
            return out;
          },
          "(weight offset, bias offset) of each layer in the flat buffers.")
      .def_property_readonly("parameters_deferred", &MLP::parameters_deferred,
                             "Whether a sharded step's parameter gathers are still in flight (the next forward "
                             "waits for each layer; anything else that touches the parameters for all of them).")
      .def("initialize", &MLP::initialize, py::arg("seed"), py::call_guard<py::gil_scoped_release>())
      .def("get_parameters",
           [](MLP& mm) { return host_copy(mm.num_params(), [&](float* d) { mm.get_parameters(d); }); })
      .def("set_parameters",
           [](MLP& mm, py::array a) {
             auto flat = FloatArray::ensure(a);
             if (!flat || static_cast<size_t>(flat.size()) != mm.num_params())
               throw ConfigError(
                   detail::concat("expected ", mm.num_params(), " float32 parameters, got ", flat ? flat.size() : 0));
             py::gil_scoped_release nogil;
             mm.set_parameters(flat.data());
           })
      .def("get_gradients", [](MLP& mm) { return host_copy(mm.num_params(), [&](float* d) { mm.get_gradients(d); }); })
      .def(
          "forward",
          [](MLP& mm, py::array x) {
            BatchArgs b = make_batch(mm, x, py::none(), LossKind::kMSE);
            py::array_t<float> out(
                {static_cast<py::ssize_t>(b.view.rows), static_cast<py::ssize_t>(mm.out_features())});
            float* dst = out.mutable_data();
            {
              py::gil_scoped_release nogil;
              mm.predict(b.view.x, b.view.rows, dst);
            }
            return out;
          },
          py::arg("x"), "Evaluation-mode forward pass (no dropout).")
      .def(
          "loss_and_grad",
          [](MLP& mm, py::array x, py::object y, const std::string& loss, uint64_t step, int64_t first_sample) {
            const LossKind kind = parse_loss(loss);
            BatchArgs b = make_batch(mm, x, y, kind);
            if (y.is_none()) throw ConfigError("loss_and_grad needs targets y");
            py::gil_scoped_release nogil;
            return mm.loss_and_grad(b.view, kind, step, first_sample);
          },
          py::arg("x"), py::arg("y"), py::arg("loss") = "mse", py::arg("step") = 0, py::arg("first_sample") = 0)
      .def(
          "evaluate",
          [](MLP& mm, py::array x, py::object y, const std::string& loss) {
            const LossKind kind = parse_loss(loss);
            if (y.is_none()) throw ConfigError("evaluate needs targets y");
            BatchArgs b = make_batch(mm, x, y, kind);
            py::gil_scoped_release nogil;
            return mm.evaluate(b.view, kind);
          },
          py::arg("x"), py::arg("y"), py::arg("loss") = "mse",
          "(sum of losses, correct predictions) over the rows; MSE sums squared errors of every element.");

  using OrderArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
  py::class_<ResidentData, std::shared_ptr<ResidentData>>(m, "ResidentData")
      .def(py::init([](const std::shared_ptr<MLP>& model, py::array x, py::object y, const std::string& loss) {
             if (!model) throw ConfigError("resident data needs a model");
             if (y.is_none()) throw ConfigError("resident data needs targets y");
             BatchArgs b = make_batch(*model, x, y, parse_loss(loss));
             py::gil_scoped_release nogil;
             return std::make_shared<ResidentData>(model->backend_ptr(), b.view, model->in_features(),
                                                   model->out_features());
           }),
           py::arg("model"), py::arg("x"), py::arg("y"), py::arg("loss") = "mse",
           "The rows (x, y) copied once into the model's backend memory, for DataParallelStep.step_rows.")
      .def(
          "set_order",
          [](ResidentData& d, const OrderArray& order) {
            if (order.ndim() != 1) throw ConfigError("an order is a 1-D array of row numbers");
            const int64_t* src = order.data();
            const int64_t n = order.shape(0);
            py::gil_scoped_release nogil;
            d.set_order(src, n);
          },
          py::arg("order"), "The row numbers steps draw from (an epoch's permutation); copied once.")
      .def_property_readonly("rows", &ResidentData::rows)
      .def_property_readonly("order_size", &ResidentData::order_size)
      .def_property_readonly("bytes", &ResidentData::bytes, "What it holds in the backend's memory.");
}

// The optimizer and its state.
void bind_optimizer(py::module_& m) {
  py::class_<Optimizer, std::shared_ptr<Optimizer>>(m, "Optimizer")
      .def(py::init([](const std::shared_ptr<MLP>& model, const std::string& kind, float momentum, float weight_decay,
                       float beta1, float beta2, float eps) {
             OptimizerConfig c;
             c.kind = parse_optimizer(kind);
             c.momentum = momentum;
             c.weight_decay = weight_decay;
             c.beta1 = beta1;
             c.beta2 = beta2;
             c.eps = eps;
             return std::make_shared<Optimizer>(model->backend_ptr(), model->num_params(), c);
           }),
           py::arg("model"), py::arg("kind") = "sgd", py::arg("momentum") = 0.0f, py::arg("weight_decay") = 0.0f,
           py::arg("beta1") = 0.9f, py::arg("beta2") = 0.999f, py::arg("eps") = 1e-8f)
      .def_property("steps_taken", &Optimizer::steps_taken, &Optimizer::set_steps_taken)
      .def("state_names", &Optimizer::state_names)
      .def_property_readonly("state_size", &Optimizer::state_size,
                             "Values each state holds: the parameters', or a sharded step's shard's.")
      .def_property_readonly("shard_offset", &Optimizer::shard_offset,
                             "The first parameter its state covers (0 unless a sharded step restricted it).")
      .def(
          "get_state",
          [](Optimizer& o, const std::string& name, size_t n) {
            if (n != o.state_size())
              throw ConfigError(detail::concat("optimizer state '", name, "' holds ", o.state_size(), " values",
                                               o.state_size() == o.num_params() ? "" : " (a shard)", ", not ", n));
            return host_copy(n, [&](float* d) { o.get_state(name, d); });
          },
          py::arg("name"), py::arg("num_params"))
      .def("set_state", [](Optimizer& o, const std::string& name, FloatArray a) {
        if (static_cast<size_t>(a.size()) != o.state_size())
          throw ConfigError(detail::concat("optimizer state '", name, "' needs ", o.state_size(), " float32 values",
                                           o.state_size() == o.num_params() ? "" : " (a shard)", ", got ", a.size()));
        py::gil_scoped_release nogil;
        o.set_state(name, a.data());
      });
}

// The data-parallel step: its bucket plan, options, results and trace spans.
void bind_step(py::module_& m) {
  m.def(
      "plan_buckets",
      [](const std::vector<int>& sizes, size_t bucket_elems) {
        std::vector<std::tuple<size_t, size_t, int>> out;
        for (const Bucket& b : plan_buckets(sizes, MLP::kGradExtraSlots, bucket_elems))
          out.emplace_back(b.offset, b.count, b.ready_layer);
        return out;
      },
      py::arg("sizes"), py::arg("bucket_elems"),
      "The gradient bucket plan training uses for layer sizes [in, hidden..., out]: "
      "(offset, count, ready_layer) of each bucket, in launch order.");
  m.def(
      "plan_bucket_runs",
      [](const std::vector<int>& sizes, size_t bucket_elems) {
        std::vector<std::tuple<size_t, size_t, int, size_t>> out;
        for (const BucketRun& r : plan_bucket_runs(sizes, MLP::kGradExtraSlots, bucket_elems))
          out.emplace_back(r.offset, r.count, r.ready_layer, r.repeat);
        return out;
      },
      py::arg("sizes"), py::arg("bucket_elems"),
      "plan_buckets run-length encoded, as the performance model reads it: (offset, count, ready_layer, "
      "repeat) of each run of equal buckets, the run's next bucket `count` below the last.");
  py::class_<StepTimings>(m, "StepTimings")
      .def_readonly("forward", &StepTimings::forward)
      .def_readonly("backward", &StepTimings::backward)
      .def_readonly("comm_wait", &StepTimings::comm_wait)
      .def_readonly("optimizer", &StepTimings::optimizer)
      .def_readonly("total", &StepTimings::total);
  py::class_<BucketTiming>(m, "BucketTiming")
      .def_readonly("index", &BucketTiming::index)
      .def_readonly("offset", &BucketTiming::offset)
      .def_readonly("count", &BucketTiming::count)
      .def_readonly("bytes", &BucketTiming::bytes)
      .def_readonly("launch", &BucketTiming::launch)
      .def_readonly("done", &BucketTiming::done);
  py::class_<TraceSpan>(m, "TraceSpan")
      .def_readonly("name", &TraceSpan::name)
      .def_readonly("category", &TraceSpan::category)
      .def_readonly("step", &TraceSpan::step)
      .def_readonly("micro", &TraceSpan::micro)
      .def_readonly("begin", &TraceSpan::begin)
      .def_readonly("end", &TraceSpan::end)
      .def("__repr__", [](const TraceSpan& t) {
        return detail::concat("TraceSpan(", t.name, ", step ", t.step, ", micro ", t.micro, ", ",
                              (t.end - t.begin) * 1e3, " ms)");
      });
  m.def(
      "steady_seconds",
      [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); },
      "The core's clock (C++ steady_clock), in seconds: what TraceSpan.begin and .end count in.");
  py::class_<StepResult>(m, "StepResult")
      .def_readonly("timings", &StepResult::timings)
      .def_readonly("buckets", &StepResult::buckets)
      .def_readonly("spans", &StepResult::spans)
      .def_readonly("started", &StepResult::started)
      .def_readonly("loss", &StepResult::loss)
      .def_readonly("grad_norm", &StepResult::grad_norm)
      .def_readonly("applied", &StepResult::applied)
      .def_readonly("stop_requested", &StepResult::stop_requested)
      .def_readonly("loss_scale", &StepResult::loss_scale);

  const StepOptions defaults;
  py::class_<StepOptions>(m, "StepOptions",
                          "How a DataParallelStep runs (C++ StepOptions): bucket size, overlap, clipping, loss "
                          "scaling, captured steps (graph: 'off' | 'auto' | 'on'), the gradients' allreduce type "
                          "(grad_dtype: 'fp32' | 'bf16' | 'fp16') and timing.")
      .def(py::init([](size_t bucket_elems, bool overlap, float max_grad_norm, float loss_scale,
                       bool dynamic_loss_scale, int loss_scale_window, const std::string& graph,
                       const std::string& grad_dtype, bool timed, bool shard_optimizer) {
             StepOptions o;
             o.grad_dtype = parse_precision(grad_dtype);
             o.graph = parse_graph_mode(graph);
             o.bucket_elems = bucket_elems;
             o.overlap = overlap;
             o.max_grad_norm = max_grad_norm;
             o.loss_scale = loss_scale;
             o.dynamic_loss_scale = dynamic_loss_scale;
             o.loss_scale_window = loss_scale_window;
             o.timed = timed;
             o.shard_optimizer = shard_optimizer;
             return o;
           }),
           py::kw_only(), py::arg("bucket_elems") = defaults.bucket_elems, py::arg("overlap") = defaults.overlap,
           py::arg("max_grad_norm") = defaults.max_grad_norm, py::arg("loss_scale") = defaults.loss_scale,
           py::arg("dynamic_loss_scale") = defaults.dynamic_loss_scale,
           py::arg("loss_scale_window") = defaults.loss_scale_window,
           py::arg("graph") = graph_mode_name(defaults.graph),
           py::arg("grad_dtype") = precision_name(defaults.grad_dtype), py::arg("timed") = defaults.timed,
           py::arg("shard_optimizer") = defaults.shard_optimizer)
      .def_readwrite("bucket_elems", &StepOptions::bucket_elems)
      .def_readwrite("overlap", &StepOptions::overlap)
      .def_readwrite("max_grad_norm", &StepOptions::max_grad_norm)
      .def_readwrite("loss_scale", &StepOptions::loss_scale)
      .def_readwrite("dynamic_loss_scale", &StepOptions::dynamic_loss_scale)
      .def_readwrite("loss_scale_window", &StepOptions::loss_scale_window,
                     "Good steps in a row after which a dynamic loss scale doubles.")
      .def_property(
          "graph", [](const StepOptions& o) { return graph_mode_name(o.graph); },
          [](StepOptions& o, const std::string& mode) { o.graph = parse_graph_mode(mode); },
          "Captured steps (CUDA graphs): 'off' | 'auto' | 'on'.")
      .def_property(
          "grad_dtype", [](const StepOptions& o) { return precision_name(o.grad_dtype); },
          [](StepOptions& o, const std::string& name) { o.grad_dtype = parse_precision(name); },
          "The type the gradients' allreduce carries: 'fp32' | 'bf16' | 'fp16'.")
      .def_readwrite("timed", &StepOptions::timed)
      .def_readwrite("shard_optimizer", &StepOptions::shard_optimizer,
                     "ZeRO-1: each rank keeps optimizer state for its shard of the parameters only (no effect on "
                     "one rank).")
      .def("__repr__", [](const StepOptions& o) {
        return detail::concat("StepOptions(bucket_elems=", o.bucket_elems, ", overlap=", o.overlap ? "True" : "False",
                              ", max_grad_norm=", o.max_grad_norm, ", loss_scale=", o.loss_scale,
                              ", dynamic_loss_scale=", o.dynamic_loss_scale ? "True" : "False",
                              ", loss_scale_window=", o.loss_scale_window, ", graph='", graph_mode_name(o.graph),
                              "', grad_dtype='", precision_name(o.grad_dtype), "', timed=", o.timed ? "True" : "False",
                              ", shard_optimizer=", o.shard_optimizer ? "True" : "False", ")");
      });
  py::class_<DataParallelStep, std::shared_ptr<DataParallelStep>>(m, "DataParallelStep")
      .def(py::init([](std::shared_ptr<MLP> model, std::shared_ptr<Optimizer> opt, std::shared_ptr<Communicator> comm,
                       const std::string& loss, const StepOptions& options) {
             return std::make_shared<DataParallelStep>(std::move(model), std::move(opt), std::move(comm),
                                                       parse_loss(loss), options);
           }),
           py::arg("model"), py::arg("optimizer"), py::arg("communicator"), py::arg("loss") = "mse",
           py::arg("options") = StepOptions())
      .def(
          "step",
          [](DataParallelStep& s, py::list micro_batches, int64_t global_batch, uint64_t step_index, float lr,
             bool request_stop, bool trace, py::object prefetch) {
            // Keep the converted arrays alive while the core reads them.
            std::vector<BatchArgs> args;
            std::vector<MicroShard> shards;
            args.reserve(micro_batches.size() + 1);
            for (py::handle item : micro_batches) {
              auto t = item.cast<py::tuple>();
              if (t.size() != 3) throw ConfigError("each micro-batch is a tuple (x, y, first_sample)");
              py::object y = t[1];
              if (y.is_none()) throw ConfigError("step needs targets y");
              args.push_back(make_batch(s.model(), t[0].cast<py::array>(), y, s.loss()));
              shards.push_back({args.back().view, t[2].cast<int64_t>()});
            }
            const HostBatch* next = prefetch_batch(s, prefetch, args);
            py::gil_scoped_release nogil;
            return s.step(shards, global_batch, step_index, lr, request_stop, trace, next);
          },
          py::arg("micro_batches"), py::arg("global_batch"), py::arg("step"), py::arg("lr"),
          py::arg("request_stop") = false, py::arg("trace") = false, py::arg("prefetch") = py::none(),
          "One optimizer step over this rank's micro-batches [(x, y, first_sample), ...] of a "
          "global batch of global_batch rows; returns a StepResult. trace: record its spans "
          "(StepResult.spans, now or in a later step's result) and bucket allreduces. prefetch: "
          "(x, y), the next step's rows, copied in while this step computes (step_prefetched).")
      .def(
          "step_prefetched",
          [](DataParallelStep& s, py::list micro_batches, int64_t global_batch, uint64_t step_index, float lr,
             bool request_stop, bool trace, py::object prefetch) {
            std::vector<BatchArgs> args;
            const std::vector<MicroShard> shards = shards_in_backend(micro_batches, nullptr);
            const HostBatch* next = prefetch_batch(s, prefetch, args);
            py::gil_scoped_release nogil;
            return s.step(shards, global_batch, step_index, lr, request_stop, trace, next);
          },
          py::arg("micro_batches"), py::arg("global_batch"), py::arg("step"), py::arg("lr"),
          py::arg("request_stop") = false, py::arg("trace") = false, py::arg("prefetch") = py::none(),
          "step over the rows the step before prefetched: micro-batches [(row_offset, rows, "
          "first_sample), ...] of them; prefetch as for step.")
      .def(
          "step_rows",
          [](DataParallelStep& s, const std::shared_ptr<ResidentData>& data, py::list micro_batches,
             int64_t global_batch, uint64_t step_index, float lr, bool request_stop, bool trace) {
            if (!data) throw ConfigError("step_rows needs resident data");
            const std::vector<MicroShard> shards = shards_in_backend(micro_batches, data.get());
            py::gil_scoped_release nogil;
            return s.step(shards, global_batch, step_index, lr, request_stop, trace);
          },
          py::arg("data"), py::arg("micro_batches"), py::arg("global_batch"), py::arg("step"), py::arg("lr"),
          py::arg("request_stop") = false, py::arg("trace") = false,
          "step over rows of resident data: micro-batches [(order_offset, rows, first_sample), ...], "
          "each the rows order[order_offset, order_offset + rows) of data's current order.")
      .def(
          "drain_trace",
          [](DataParallelStep& s) {
            py::gil_scoped_release nogil;
            return s.drain_trace();
          },
          "The traced spans no step has handed over yet, after waiting for the device.")
      .def_property("loss_scale", &DataParallelStep::loss_scale, &DataParallelStep::set_loss_scale)
      .def_property("good_steps_in_a_row", &DataParallelStep::good_steps_in_a_row,
                    &DataParallelStep::set_good_steps_in_a_row)
      .def(
          "broadcast_parameters",
          [](DataParallelStep& s, int root) {
            py::gil_scoped_release nogil;
            s.broadcast_parameters(root);
          },
          py::arg("root") = 0)
      .def_property_readonly("uses_graphs", &DataParallelStep::uses_graphs,
                             "Whether micro-batches are captured and replayed (CUDA graphs).")
      .def_property_readonly("graph_replays", &DataParallelStep::graph_replays,
                             "Micro-batches run as a replayed graph so far.")
      .def_property_readonly("graph_fallback", &DataParallelStep::graph_fallback,
                             "Why graph='auto' gave captured steps up ('' if it did not).")
      .def_property_readonly("shards_optimizer", &DataParallelStep::shards_optimizer,
                             "Whether each rank keeps optimizer state for its shard only (ZeRO-1 on > 1 rank).")
      .def_property_readonly("shard_sizes", &DataParallelStep::shard_sizes,
                             "Parameters each rank's shard holds, in rank order (empty: not sharded).")
      .def_property_readonly("shard_offset", &DataParallelStep::shard_offset,
                             "Where this rank's shard starts in the flat parameter buffer.")
      .def(
          "optimizer_state",
          [](DataParallelStep& s, const std::string& name) {
            return host_copy(s.model().num_params(), [&](float* d) { s.gather_optimizer_state(name, d); });
          },
          py::arg("name"),
          "The whole optimizer state `name` (num_params float32): collective when sharded (every rank "
          "calls it and gets the shards gathered).")
      .def(
          "set_optimizer_state",
          [](DataParallelStep& s, const std::string& name, FloatArray a) {
            if (static_cast<size_t>(a.size()) != s.model().num_params())
              throw ConfigError(detail::concat("optimizer state '", name, "' needs ", s.model().num_params(),
                                               " float32 values, got ", a.size()));
            py::gil_scoped_release nogil;
            s.set_optimizer_state(name, a.data());
          },
          py::arg("name"), py::arg("values"),
          "Sets optimizer state `name` from the whole state (num_params float32); a sharded rank keeps its shard.")
      .def_property_readonly("overlaps", &DataParallelStep::overlaps,
                             "Whether allreduces overlap backward (needs NCCL or a device backend).")
      .def(
          "buckets",
          [](const DataParallelStep& s) {
            std::vector<std::tuple<size_t, size_t, int>> out;
            for (const Bucket& b : s.buckets()) out.emplace_back(b.offset, b.count, b.ready_layer);
            return out;
          },
          "(offset, count, ready_layer) of each gradient bucket, in launch order.");
}

}  // namespace

#ifdef MGPU_GPU_EMULATION
void bind_emulation(py::module_& m);  // csrc/bindings/emulation.cpp
#endif

PYBIND11_MODULE(MGPU_MODULE_NAME, m) {
  m.doc() = "mgpu native core: backends, communicators, the MLP and the data-parallel step";
  m.attr("__version__") = MGPU_VERSION;
  // In this order: a signature names the Python classes registered before it.
  bind_errors(m);
  bind_build_info(m);
  bind_backends(m);
  bind_communicators(m);
  bind_cuda(m);
  bind_model(m);
  bind_optimizer(m);
  bind_probe(m);
  bind_perf(m);
  bind_stress(m);
  bind_step(m);
#ifdef MGPU_GPU_EMULATION
  bind_emulation(m);
#endif
}
