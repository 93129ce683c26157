// Bindings of the stress devices (csrc/core/stress.h) used by `mgpu stress`.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "../core/stress.h"

namespace py = pybind11;

namespace mgpu {

void bind_stress(py::module_& m) {
  py::class_<StressCheck>(m, "StressCheck")
      .def_readonly("checked", &StressCheck::checked)
      .def_readonly("mismatches", &StressCheck::mismatches)
      .def_readonly("nonfinite", &StressCheck::nonfinite)
      .def_readonly("seconds", &StressCheck::seconds)
      .def_readonly("work", &StressCheck::work);
  py::class_<StressDevice, std::shared_ptr<StressDevice>>(m, "StressDevice")
      .def_property_readonly("name", &StressDevice::name)
      .def("compute", &StressDevice::compute, py::arg("n"), py::arg("iterations"), py::arg("seed") = 0,
           py::arg("sample") = 1024, py::arg("inject_fault") = false, py::call_guard<py::gil_scoped_release>(),
           "Transcendental burn over n values; `sample` recomputed by the reference.")
      .def("gemm", &StressDevice::gemm, py::arg("n"), py::arg("repeats"), py::arg("seed") = 0, py::arg("tol") = 0.0,
           py::arg("inject_fault") = false, py::arg("precision") = "fp32", py::call_guard<py::gil_scoped_release>(),
           "Repeated GEMMs on fixed random inputs (fp32, tf32 or bf16), each result checked against the first.")
      .def("copy_bandwidth", &StressDevice::copy_bandwidth, py::arg("bytes"), py::call_guard<py::gil_scoped_release>(),
           "Bytes/s (read + written) of a plain device-to-device copy: the memory pass's reference.")
      .def("resize_buffer", &StressDevice::resize_buffer, py::arg("bytes"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("buffer_bytes", &StressDevice::buffer_bytes)
      .def("memory", &StressDevice::memory, py::arg("pattern"), py::arg("seed") = 0, py::arg("pass_index") = 0,
           py::arg("inject_fault") = false, py::call_guard<py::gil_scoped_release>(),
           "Write a pattern over the buffer, read it back, count differing words.");
  m.def("make_stress_device", &make_stress_device, py::arg("device") = "cpu", py::arg("device_index") = 0,
        py::arg("threads") = 0);
}

}  // namespace mgpu
