// _core.backend_ops: runs one Backend kernel on NumPy inputs on any backend
// (allocate, copy in, run, copy out), so tests can hold every backend's kernels
// against the CPU backend and a float64 reference, kernel by kernel. Not used
// by training.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../core/backend.h"
#include "../core/errors.h"

namespace py = pybind11;

namespace mgpu {
namespace {

using F32 = py::array_t<float, py::array::c_style | py::array::forcecast>;
using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

template <typename T>
BackendArray<T> upload(Backend& be, const py::array_t<T, py::array::c_style | py::array::forcecast>& a) {
  BackendArray<T> d(&be, static_cast<size_t>(a.size()));
  be.copy_to_backend(d.data(), a.data(), static_cast<size_t>(a.size()) * sizeof(T));
  return d;
}

py::array_t<float> download(Backend& be, const BackendArray<float>& d, std::vector<py::ssize_t> shape) {
  py::array_t<float> out(shape);
  be.copy_to_host(out.mutable_data(), d.data(), d.size() * sizeof(float));
  return out;
}

float scalar(Backend& be, const float* dev) {
  float v = 0.0f;
  be.copy_to_host(&v, dev, sizeof(float));
  return v;
}

std::vector<py::ssize_t> shape_of(const py::array& a) { return {a.shape(), a.shape() + a.ndim()}; }

void expect_2d(const py::array& a, const char* what) {
  MGPU_CHECK(a.ndim() == 2, ConfigError, what, " must be 2-D, got ", a.ndim(), " dimensions");
}

void expect_size(const py::array& a, size_t n, const char* what) {
  MGPU_CHECK(static_cast<size_t>(a.size()) == n, ConfigError, what, " must have ", n, " elements, got ", a.size());
}

}  // namespace

void bind_probe(py::module_& parent) {
  py::module_ m = parent.def_submodule(
      "backend_ops", "Single Backend kernels on NumPy inputs (a test harness for comparing backends).");
  using BE = std::shared_ptr<Backend>;

  m.def(
      "linear_forward",
      [](BE be, F32 inp, F32 w, F32 b) {
        expect_2d(inp, "inp");
        expect_2d(w, "weight");
        const int B = int(inp.shape(0)), IN = int(inp.shape(1)), OUT = int(w.shape(0));
        MGPU_CHECK(w.shape(1) == IN, ConfigError, "weight must be (OUT, IN)");
        expect_size(b, OUT, "bias");
        auto di = upload(*be, inp), dw = upload(*be, w), db = upload(*be, b);
        BackendArray<float> out(be.get(), size_t(B) * OUT);
        be->linear_forward(out.data(), di.data(), dw.data(), db.data(), B, IN, OUT);
        return download(*be, out, {B, OUT});
      },
      py::arg("backend"), py::arg("inp"), py::arg("weight"), py::arg("bias"),
      "inp (B, IN), weight (OUT, IN), bias (OUT) -> out (B, OUT)");

  m.def(
      "linear_backward",
      [](BE be, F32 dout, F32 inp, F32 w, F32 dweight, F32 dbias, bool accumulate, bool with_dinp) {
        expect_2d(dout, "dout");
        expect_2d(inp, "inp");
        expect_2d(w, "weight");
        const int B = int(dout.shape(0)), OUT = int(dout.shape(1)), IN = int(inp.shape(1));
        MGPU_CHECK(inp.shape(0) == B && w.shape(0) == OUT && w.shape(1) == IN, ConfigError,
                   "shapes must be dout (B, OUT), inp (B, IN), weight (OUT, IN)");
        expect_size(dweight, size_t(OUT) * IN, "dweight");
        expect_size(dbias, size_t(OUT), "dbias");
        auto dd = upload(*be, dout), di = upload(*be, inp), dw = upload(*be, w);
        auto gw = upload(*be, dweight), gb = upload(*be, dbias);
        BackendArray<float> dinp(be.get(), with_dinp ? size_t(B) * IN : 0);
        be->linear_backward(with_dinp ? dinp.data() : nullptr, gw.data(), gb.data(), dd.data(), di.data(), dw.data(), B,
                            IN, OUT, accumulate);
        py::object dinp_out = py::none();
        if (with_dinp) dinp_out = download(*be, dinp, {B, IN});
        return py::make_tuple(dinp_out, download(*be, gw, {OUT, IN}), download(*be, gb, {OUT}));
      },
      py::arg("backend"), py::arg("dout"), py::arg("inp"), py::arg("weight"), py::arg("dweight"), py::arg("dbias"),
      py::arg("accumulate") = false, py::arg("with_dinp") = true,
      "-> (dinp (B, IN) or None, dweight (OUT, IN), dbias (OUT)); dweight/dbias are the initial "
      "values (added to when accumulate)");

  m.def(
      "relu_dropout_forward",
      [](BE be, F32 h, float p, uint64_t seed, uint64_t step, uint32_t layer, int64_t first_sample) {
        expect_2d(h, "h");
        auto d = upload(*be, h);
        be->relu_dropout_forward(d.data(), int(h.shape(0)), int(h.shape(1)), p,
                                 DropoutKey{seed, step, layer, first_sample});
        return download(*be, d, shape_of(h));
      },
      py::arg("backend"), py::arg("h"), py::arg("p"), py::arg("seed") = 0, py::arg("step") = 0, py::arg("layer") = 0,
      py::arg("first_sample") = 0);

  m.def(
      "replayed_relu_dropout",
      [](BE be, F32 h, float p, uint64_t seed, const std::vector<uint64_t>& steps, size_t busy) {
        // One captured graph (copy h, relu + dropout, add to out) replayed once per
        // step back to back, behind `busy` elements of other work so the host runs
        // ahead of the stream: each replay must still use its own step.
        expect_2d(h, "h");
        MGPU_CHECK(be->supports_capture(), ConfigError, "the ", be->name(), " backend cannot capture");
        const int B = int(h.shape(0)), C = int(h.shape(1));
        const size_t n = size_t(B) * C;
        auto src = upload(*be, h);
        BackendArray<float> work(be.get(), n), out(be.get(), n), spin(be.get(), busy ? busy : 1);
        be->zero(out.data(), n);
        be->zero(spin.data(), spin.size());
        be->begin_capture();
        try {
          be->zero(work.data(), n);
          be->axpy(work.data(), src.data(), n, 1.0f);
          be->relu_dropout_forward(work.data(), B, C, p, DropoutKey{seed, 0, 0, 0});
          be->axpy(out.data(), work.data(), n, 1.0f);
        } catch (...) {
          be->abort_capture();
          throw;
        }
        const int graph = be->end_capture();
        if (busy) be->scale(spin.data(), busy, 0.5f);
        for (uint64_t step : steps) be->replay(graph, ReplayArgs{step, 0, 1.0f, 1.0f, UpdateScalars{}});
        auto result = download(*be, out, {B, C});
        be->release_captures();
        return result;
      },
      py::arg("backend"), py::arg("h"), py::arg("p"), py::arg("seed"), py::arg("steps"), py::arg("busy") = 0,
      "-> sum over steps of relu_dropout(h, step), each from a replay of one captured graph");

  m.def(
      "relu_dropout_backward",
      [](BE be, F32 dh, F32 h, float p) {
        MGPU_CHECK(dh.size() == h.size(), ConfigError, "dh and h must have the same size");
        auto dd = upload(*be, dh), dhh = upload(*be, h);
        be->relu_dropout_backward(dd.data(), dhh.data(), size_t(dh.size()), p);
        return download(*be, dd, shape_of(dh));
      },
      py::arg("backend"), py::arg("dh"), py::arg("h"), py::arg("p"));

  m.def(
      "mse_forward_backward",
      [](BE be, F32 pred, F32 target, float grad_scale, bool with_grad) {
        expect_2d(pred, "pred");
        MGPU_CHECK(target.size() == pred.size(), ConfigError, "target must match pred");
        const int B = int(pred.shape(0)), D = int(pred.shape(1));
        auto dp = upload(*be, pred), dt = upload(*be, target);
        BackendArray<float> loss(be.get(), 1), grad(be.get(), with_grad ? size_t(B) * D : 0);
        be->mse_forward_backward(loss.data(), with_grad ? grad.data() : nullptr, dp.data(), dt.data(), B, D,
                                 grad_scale);
        py::object g = py::none();
        if (with_grad) g = download(*be, grad, {B, D});
        return py::make_tuple(scalar(*be, loss.data()), g);
      },
      py::arg("backend"), py::arg("pred"), py::arg("target"), py::arg("grad_scale") = 1.0f, py::arg("with_grad") = true,
      "-> (loss, dpred or None)");

  m.def(
      "cross_entropy_forward_backward",
      [](BE be, F32 logits, I32 labels, float grad_scale, bool with_grad, bool with_correct) {
        expect_2d(logits, "logits");
        const int B = int(logits.shape(0)), C = int(logits.shape(1));
        expect_size(labels, size_t(B), "labels");
        // Labels are not checked here: the backends' own checks are under test.
        auto dl = upload(*be, logits);
        auto dy = upload(*be, labels);
        BackendArray<float> out(be.get(), 2), grad(be.get(), with_grad ? size_t(B) * C : 0);
        be->cross_entropy_forward_backward(out.data(), with_grad ? grad.data() : nullptr,
                                           with_correct ? out.data() + 1 : nullptr, dl.data(), dy.data(), B, C,
                                           grad_scale);
        py::object g = py::none(), correct = py::none();
        if (with_grad) g = download(*be, grad, {B, C});
        if (with_correct) correct = py::float_(scalar(*be, out.data() + 1));
        return py::make_tuple(scalar(*be, out.data()), g, correct);
      },
      py::arg("backend"), py::arg("logits"), py::arg("labels"), py::arg("grad_scale") = 1.0f,
      py::arg("with_grad") = true, py::arg("with_correct") = true, "-> (loss, dlogits or None, correct or None)");

  // verdict (apply, factor): the update reads them from a StepVerdict in backend memory instead.
  using Verdict = std::optional<std::pair<bool, float>>;
  auto upload_verdict = [](Backend& be, const Verdict& v) {
    BackendArray<StepVerdict> d(&be, v ? 1 : 0);
    if (v) {
      StepVerdict host;
      host.apply = v->first ? 1 : 0;
      host.factor = v->second;
      be.copy_to_backend(d.data(), &host, sizeof(host));
    }
    return d;
  };

  m.def(
      "sgd_update",
      [upload_verdict](BE be, F32 param, F32 grad, F32 buf, float lr, float momentum, float weight_decay,
                       bool first_step, float grad_scale, Verdict verdict) {
        const size_t n = size_t(param.size());
        expect_size(grad, n, "grad");
        expect_size(buf, n, "momentum_buf");
        auto dp = upload(*be, param), dg = upload(*be, grad), db = upload(*be, buf);
        auto dv = upload_verdict(*be, verdict);
        be->sgd_update(dp.data(), dg.data(), db.data(), n,
                       SgdParams{lr, momentum, weight_decay, first_step, grad_scale, dv.data()});
        return py::make_tuple(download(*be, dp, shape_of(param)), download(*be, db, shape_of(param)));
      },
      py::arg("backend"), py::arg("param"), py::arg("grad"), py::arg("momentum_buf"), py::arg("lr"),
      py::arg("momentum") = 0.0f, py::arg("weight_decay") = 0.0f, py::arg("first_step") = true,
      py::arg("grad_scale") = 1.0f, py::arg("verdict") = py::none(),
      "-> (param, momentum_buf); the update of grad_scale * grad (or of a verdict's factor, if it applies)");

  m.def(
      "adamw_update",
      [upload_verdict](BE be, F32 param, F32 grad, F32 m1, F32 m2, float lr, float beta1, float beta2, float eps,
                       float weight_decay, int64_t step, float grad_scale, Verdict verdict) {
        const size_t n = size_t(param.size());
        expect_size(grad, n, "grad");
        expect_size(m1, n, "exp_avg");
        expect_size(m2, n, "exp_avg_sq");
        auto dp = upload(*be, param), dg = upload(*be, grad), d1 = upload(*be, m1), d2 = upload(*be, m2);
        auto dv = upload_verdict(*be, verdict);
        be->adamw_update(dp.data(), dg.data(), d1.data(), d2.data(), n,
                         AdamWParams{lr, beta1, beta2, eps, weight_decay, step, grad_scale, dv.data()});
        return py::make_tuple(download(*be, dp, shape_of(param)), download(*be, d1, shape_of(param)),
                              download(*be, d2, shape_of(param)));
      },
      py::arg("backend"), py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("lr"),
      py::arg("beta1") = 0.9f, py::arg("beta2") = 0.999f, py::arg("eps") = 1e-8f, py::arg("weight_decay") = 0.01f,
      py::arg("step") = 1, py::arg("grad_scale") = 1.0f, py::arg("verdict") = py::none(),
      "-> (param, exp_avg, exp_avg_sq); the update of grad_scale * grad (or of a verdict's factor, if it applies)");

  m.def(
      "step_verdict",
      [](BE be, F32 grads, float loss_slot, float stop_slot, float loss_scale, float max_norm) {
        // The gradients with the loss and stop slots after them, as in the step's buffer.
        const size_t n = size_t(grads.size());
        BackendArray<float> d(be.get(), n + 2);
        be->copy_to_backend(d.data(), grads.data(), n * sizeof(float));
        const float slots[2] = {loss_slot, stop_slot};
        be->copy_to_backend(d.data() + n, slots, sizeof(slots));
        BackendArray<StepVerdict> dv(be.get(), 1);
        be->step_verdict(dv.data(), d.data(), n, d.data() + n, loss_scale, max_norm, nullptr);
        StepVerdict v;
        be->copy_to_host(&v, dv.data(), sizeof(v));
        py::dict out;
        out["sum_squares"] = v.sum_squares;
        out["grad_norm"] = v.grad_norm;
        out["loss"] = v.loss;
        out["stop"] = v.stop;
        out["factor"] = v.factor;
        out["apply"] = v.apply != 0;
        return out;
      },
      py::arg("backend"), py::arg("grads"), py::arg("loss_slot"), py::arg("stop_slot") = 0.0f,
      py::arg("loss_scale") = 1.0f, py::arg("max_norm") = 0.0f,
      "-> the step's verdict (dict) from gradients, the reduced loss and stop slots, loss scale and clip norm");

  m.def(
      "sum_squares",
      [](BE be, F32 x, size_t offset) {
        // x lands `offset` floats into its buffer: a view that starts off the
        // allocation's alignment, as a slice of a larger buffer would.
        const size_t n = size_t(x.size());
        BackendArray<float> d(be.get(), n + offset);
        be->copy_to_backend(d.data() + offset, x.data(), n * sizeof(float));
        return be->sum_squares(d.data() + offset, n);
      },
      py::arg("backend"), py::arg("x"), py::arg("offset") = 0, "-> sum of x^2 (double), x at `offset` floats");

  m.def(
      "scale",
      [](BE be, F32 x, float alpha) {
        auto d = upload(*be, x);
        be->scale(d.data(), size_t(x.size()), alpha);
        return download(*be, d, shape_of(x));
      },
      py::arg("backend"), py::arg("x"), py::arg("alpha"));

  m.def(
      "axpy",
      [](BE be, F32 y, F32 x, float alpha) {
        expect_size(x, size_t(y.size()), "x");
        auto dy = upload(*be, y), dx = upload(*be, x);
        be->axpy(dy.data(), dx.data(), size_t(y.size()), alpha);
        return download(*be, dy, shape_of(y));
      },
      py::arg("backend"), py::arg("y"), py::arg("x"), py::arg("alpha"), "-> y + alpha x");

  m.def(
      "gather_rows",
      [](BE be, F32 src, const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& index) {
        expect_2d(src, "src");
        MGPU_CHECK(index.ndim() == 1, ConfigError, "index must be 1-D");
        const int rows = static_cast<int>(index.size()), W = static_cast<int>(src.shape(1));
        for (int r = 0; r < rows; ++r)
          MGPU_CHECK(index.data()[r] >= 0 && index.data()[r] < src.shape(0), ConfigError, "index ", index.data()[r],
                     " is outside the ", src.shape(0), " rows");
        auto ds = upload(*be, src);
        auto di = upload(*be, index);
        BackendArray<float> out(be.get(), size_t(rows) * W);
        be->gather_rows(out.data(), ds.data(), di.data(), rows, W);
        return download(*be, out, {rows, W});
      },
      py::arg("backend"), py::arg("src"), py::arg("index"), "-> src[index] (rows gathered on the backend)");

  m.def(
      "zero",
      [](BE be, F32 x) {
        auto d = upload(*be, x);
        be->zero(d.data(), size_t(x.size()));
        return download(*be, d, shape_of(x));
      },
      py::arg("backend"), py::arg("x"));

  m.def(
      "narrow_widen",
      [](BE be, F32 x, const std::string& dtype) {
        const Precision p = parse_precision(dtype);
        const size_t n = size_t(x.size());
        auto d = upload(*be, x);
        BackendArray<uint16_t> half(be.get(), n);
        be->narrow(half.data(), d.data(), n, p);
        be->widen(d.data(), half.data(), n, p);
        return download(*be, d, shape_of(x));
      },
      py::arg("backend"), py::arg("x"), py::arg("dtype"),
      "x rounded to bf16 or fp16 and widened back (gradient compression's kernels)");

  m.def(
      "round_trip",
      [](BE be, F32 x) {
        auto d = upload(*be, x);
        return download(*be, d, shape_of(x));
      },
      py::arg("backend"), py::arg("x"), "copy to the backend and back");
}

}  // namespace mgpu
