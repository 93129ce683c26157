// Bindings of the GPU emulation's own instruments (only in mgpu._core_emu):
// per-process counters of the CUDA work issued (launches, host syncs,
// allocations, bytes copied, graph replays), the rule violations it found
// (races, out-of-bounds, divergence, mismatched collectives), and the live
// allocations (leak checks).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "mgpu_emu/runtime.h"

namespace py = pybind11;

namespace mgpu_selftest {
std::string run_scenario(const std::string& name);  // emulation/selftest.cu
}

void bind_emulation(py::module_& m) {
  py::module_ e =
      m.def_submodule("emulation", "The CPU emulation of CUDA, cuBLAS and NCCL this module runs on (not a real GPU).");
  e.def("device_count", &mgpu_emu::emulated_device_count, "Emulated GPUs (MGPU_EMULATE_GPU).");
  e.def(
      "counters",
      [] {
        const mgpu_emu::Counters& c = mgpu_emu::counters();
        py::dict d;
        d["kernel_launches"] = c.kernel_launches.load();
        d["kernels_executed"] = c.kernels_executed.load();
        d["graph_launches"] = c.graph_launches.load();
        d["host_syncs"] = c.host_syncs.load();
        d["allocations"] = c.allocations.load();
        d["frees"] = c.frees.load();
        d["h2d_bytes"] = c.h2d_bytes.load();
        d["d2h_bytes"] = c.d2h_bytes.load();
        d["d2d_bytes"] = c.d2d_bytes.load();
        d["blas_calls"] = c.blas_calls.load();
        d["collectives"] = c.collectives.load();
        d["pageable_h2d_copies"] = c.pageable_h2d_copies.load();
        return d;
      },
      "Totals since the process started of the CUDA work issued (see emulation/README.md).");
  e.def("violations", &mgpu_emu::violations, "Rule violations found so far, one line each.");
  e.def("clear_violations", &mgpu_emu::clear_violations,
        "Forget the violations and clear the devices' sticky errors (a fresh context, as cudaDeviceReset).");
  e.def(
      "selftest",
      [](const std::string& name) {
        py::gil_scoped_release nogil;
        return mgpu_selftest::run_scenario(name);
      },
      py::arg("name"), "Runs a scenario of emulation/selftest.cu; returns what the emulation said.");
  e.def("live_allocations", &mgpu_emu::live_allocations, "Device and pinned allocations not yet freed.");
  e.def("inject_launch_failure", &mgpu_emu::inject_launch_failure, py::arg("kernel"), py::arg("device") = -1,
        py::arg("nth") = 1,
        "Makes the nth launch from now of a kernel whose name contains `kernel` (on GPU `device`, -1: any) "
        "fail with cudaErrorLaunchOutOfResources; nth=0 disarms. For tests of error paths.");
}
