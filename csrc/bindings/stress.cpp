// Bindings of the stress devices (csrc/core/stress_device.h) used by `mgpu stress`.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "../core/errors.h"
#include "../core/stress_device.h"
#include "../core/stress_math.h"

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
      .def(
          "gemm_verify",
          [](StressDevice& dev, const py::array_t<float, py::array::c_style | py::array::forcecast>& a,
             const py::array_t<float, py::array::c_style | py::array::forcecast>& b,
             const py::array_t<float, py::array::c_style | py::array::forcecast>& c, const std::string& precision,
             size_t samples) {
            MGPU_CHECK(a.ndim() == 2 && a.shape(0) == a.shape(1) && a.shape(0) >= 1, ConfigError,
                       "a must be a square (n, n) matrix");
            const py::ssize_t n = a.shape(0);
            for (const auto* m : {&b, &c})
              MGPU_CHECK(m->ndim() == 2 && m->shape(0) == n && m->shape(1) == n, ConfigError,
                         "b and c must have a's shape (", n, ", ", n, ")");
            py::gil_scoped_release nogil;
            return dev.gemm_verify(int(n), a.data(), b.data(), c.data(), precision, samples);
          },
          py::arg("a"), py::arg("b"), py::arg("c"), py::arg("precision") = "fp32",
          py::arg("samples") = kStressGemmChecks,
          "The GEMM burn's independent check of c = a b alone: `samples` elements of c recomputed as fp64 dot "
          "products; mismatches count those beyond the precision's bound.")
      .def("copy_bandwidth", &StressDevice::copy_bandwidth, py::arg("bytes"), py::call_guard<py::gil_scoped_release>(),
           "Bytes/s (read + written) of a plain device-to-device copy: the memory pass's reference.")
      .def("resize_buffer", &StressDevice::resize_buffer, py::arg("bytes"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("buffer_bytes", &StressDevice::buffer_bytes)
      .def("memory", &StressDevice::memory, py::arg("pattern"), py::arg("seed") = 0, py::arg("pass_index") = 0,
           py::arg("inject_fault") = false, py::call_guard<py::gil_scoped_release>(),
           "Write a pattern over the buffer, read it back, count differing words.");
  m.def("stress_sample_index", &stress_sample_index, py::arg("k"), py::arg("n"), py::arg("checks"),
        "Index of the element that sample k of `checks` over n values verifies (stress_math.h).");
  m.def(
      "stress_word",
      [](const std::string& pattern, uint64_t seed, int pass, uint64_t i) {
        return stress_word(parse_stress_pattern(pattern), seed, pass, i);
      },
      py::arg("pattern"), py::arg("seed"), py::arg("pass_index"), py::arg("i"),
      "Word i of a memory pattern, as every device writes and checks it (stress_math.h).");
  m.def("stress_gemm_bound", &stress_gemm_bound, py::arg("abs_sum"), py::arg("k"), py::arg("input_error"),
        "Largest accepted |C - fp64 reference| of a GEMM element (stress_math.h).");
  m.def("stress_gemm_input_error", &stress_gemm_input_error, py::arg("precision"));
  m.def("make_stress_device", &make_stress_device, py::arg("device") = "cpu", py::arg("device_index") = 0,
        py::arg("threads") = 0);
}

}  // namespace mgpu
