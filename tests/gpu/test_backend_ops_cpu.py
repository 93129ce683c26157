"""Runs without a GPU (CI): the backend_ops probe on the CPU backend against
float64 NumPy for every Backend kernel, and the CUDA build's host-runnable
pieces: cuRAND's Philox equals mgpu's, the dropout kernel's mask code (run on
the host) equals the CPU backend's mask, and the no-GPU paths fail cleanly."""

import numpy as np
import pytest

from mgpu import _core
from mgpu.errors import ConfigError

ops = _core.backend_ops
RNG = np.random.default_rng(7)
DROPOUT_TAG = (0xD7A0 * 0x9E3779B9) & 0xFFFFFFFF


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def close(a, b, tol=1e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    assert np.linalg.norm(a - b) <= tol * max(np.linalg.norm(b), 1e-12), np.abs(a - b).max()


def reference_mask(rows, cols, p, seed, step, layer, first_sample):
    """The DropoutKey definition of backend.h, spelled out with mgpu's Philox."""
    groups = (cols + 3) // 4
    key = [seed & 0xFFFFFFFF, ((seed >> 32) ^ DROPOUT_TAG) & 0xFFFFFFFF]
    keep = np.float32(1.0) / (np.float32(1.0) - np.float32(p))
    mask = np.zeros((rows, cols), np.float32)
    for b in range(rows):
        for g in range(groups):
            words = _core.philox4x32_10([g, (first_sample + b) & 0xFFFFFFFF, layer, step & 0xFFFFFFFF], key)
            for k in range(4):
                j = k * groups + g
                if j < cols:
                    u = np.float32(words[k] >> 8) * np.float32(1.0 / 16777216.0)
                    mask[b, j] = keep if u >= np.float32(p) else 0.0
    return mask


@pytest.mark.parametrize("B, IN, OUT", [(1, 1, 1), (7, 5, 3), (33, 64, 17)])
def test_linear(cpu_backend, B, IN, OUT):
    x, w, b = rand(B, IN), rand(OUT, IN), rand(OUT)
    close(ops.linear_forward(cpu_backend, x, w, b), x.astype(np.float64) @ w.T + b)
    dout, gw0, gb0 = rand(B, OUT), rand(OUT, IN), rand(OUT)
    for accumulate in (False, True):
        dinp, gw, gb = ops.linear_backward(cpu_backend, dout, x, w, gw0, gb0, accumulate)
        close(dinp, dout.astype(np.float64) @ w)
        close(gw, dout.T.astype(np.float64) @ x + (gw0 if accumulate else 0))
        close(gb, dout.astype(np.float64).sum(0) + (gb0 if accumulate else 0))
    dinp, _, _ = ops.linear_backward(cpu_backend, dout, x, w, gw0, gb0, False, with_dinp=False)
    assert dinp is None


@pytest.mark.parametrize("rows, cols", [(5, 1), (4, 37), (9, 256)])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5])
def test_relu_dropout(cpu_backend, rows, cols, p):
    h = rand(rows, cols)
    out = ops.relu_dropout_forward(cpu_backend, h, p, seed=(3 << 32) + 11, step=5, layer=2, first_sample=40)
    mask = reference_mask(rows, cols, p, (3 << 32) + 11, 5, 2, 40) if p > 0 else np.ones((rows, cols), np.float32)
    assert np.array_equal(out, np.maximum(h, 0) * mask)
    dh = rand(rows, cols)
    keep = np.float32(1) / (np.float32(1) - np.float32(p))
    assert np.array_equal(ops.relu_dropout_backward(cpu_backend, dh, out, p), np.where(out > 0, dh * keep, 0))


SPECIAL = np.array([[np.nan, np.inf, -np.inf, -0.0, 0.0, 1.5, -2.0, np.nan]], np.float32)


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_relu_keeps_nan_as_pytorch_does(cpu_backend, p):
    # torch.relu(nan) is nan and its backward passes the gradient there: a diverging
    # step shows in its loss; -inf and -0 become 0, inf stays
    h = np.repeat(SPECIAL, 3, axis=0)
    out = ops.relu_dropout_forward(cpu_backend, h, p, seed=1, step=0, layer=0, first_sample=0)
    mask = reference_mask(*h.shape, p, 1, 0, 0, 0) if p > 0 else np.ones(h.shape, np.float32)
    with np.errstate(invalid="ignore"):  # a dropped inf is inf x 0 = nan, in PyTorch's dropout too
        want = np.where(h <= 0, np.float32(0), h) * mask
    assert np.array_equal(out, want, equal_nan=True) and np.isnan(out[:, 0]).all()
    dh = np.full(h.shape, 0.25, np.float32)
    keep = np.float32(1) / (np.float32(1) - np.float32(p))
    got = ops.relu_dropout_backward(cpu_backend, dh, out, p)
    assert np.array_equal(got, np.where(out <= 0, np.float32(0), dh * keep))
    assert (got[:, 0] == 0.25 * keep).all()  # the NaN unit passes its gradient


def test_dropout_mask_is_independent_of_the_split(cpu_backend):
    h = np.abs(rand(10, 21)) + 0.1
    whole = ops.relu_dropout_forward(cpu_backend, h, 0.3, seed=9, step=1, layer=0, first_sample=0)
    top = ops.relu_dropout_forward(cpu_backend, h[:4], 0.3, seed=9, step=1, layer=0, first_sample=0)
    bottom = ops.relu_dropout_forward(cpu_backend, h[4:], 0.3, seed=9, step=1, layer=0, first_sample=4)
    assert np.array_equal(whole, np.vstack([top, bottom]))


@pytest.mark.parametrize("B, D", [(1, 1), (13, 3), (300, 7)])
def test_mse(cpu_backend, B, D):
    pred, target = rand(B, D), rand(B, D)
    loss, grad = ops.mse_forward_backward(cpu_backend, pred, target, 0.25)
    diff = pred.astype(np.float64) - target
    assert loss == pytest.approx(0.25 * (diff**2).sum(), rel=1e-6)
    close(grad, 0.5 * diff)
    loss2, none = ops.mse_forward_backward(cpu_backend, pred, target, 1.0, with_grad=False)
    assert none is None and loss2 == pytest.approx((diff**2).sum(), rel=1e-6)


@pytest.mark.parametrize("B, C", [(1, 2), (17, 10), (64, 100)])
def test_cross_entropy(cpu_backend, B, C):
    logits = rand(B, C) * 3
    labels = RNG.integers(0, C, B).astype(np.int32)
    logits[0, :] = 1.5  # a tie: the first maximal index is the prediction
    loss, grad, correct = ops.cross_entropy_forward_backward(cpu_backend, logits, labels, 0.5)
    z = logits.astype(np.float64) - logits.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    assert loss == pytest.approx(-0.5 * logp[np.arange(B), labels].sum(), rel=1e-6)
    onehot = np.eye(C)[labels]
    close(grad, 0.5 * (np.exp(logp) - onehot))
    assert correct == float((logits.argmax(1) == labels).sum())


def test_cross_entropy_out_of_range_labels_raise(cpu_backend):
    # The CPU reference of the CUDA kernel's label check: rows outside [0, C)
    # are never read through, the error names the first, the backend carries on.
    logits, labels = rand(8, 4), np.array([0, 1, 2, 3, 4, -1, 0, 1], np.int32)
    with pytest.raises(ConfigError, match=r"label 4 at row 4 is out of range \[0, 4\) \(2 rows had such labels\)"):
        ops.cross_entropy_forward_backward(cpu_backend, logits, labels, 1.0)
    labels[[4, 5]] = 0
    loss, _, _ = ops.cross_entropy_forward_backward(cpu_backend, logits, labels, 1.0)
    assert np.isfinite(loss)


@pytest.mark.parametrize("momentum, first", [(0.0, True), (0.9, True), (0.9, False)])
def test_sgd(cpu_backend, momentum, first):
    p, g, buf = rand(100), rand(100), rand(100)
    new_p, new_buf = ops.sgd_update(
        cpu_backend, p, g, buf, lr=0.1, momentum=momentum, weight_decay=0.01, first_step=first
    )
    d = g.astype(np.float64) + 0.01 * p
    if momentum > 0:
        d = d if first else momentum * buf + d
        close(new_buf, d)
    close(new_p, p - 0.1 * d)


@pytest.mark.parametrize("step", [1, 7])
def test_adamw(cpu_backend, step):
    p, g, m, v = rand(200), rand(200), rand(200), np.abs(rand(200))
    new_p, new_m, new_v = ops.adamw_update(
        cpu_backend, p, g, m, v, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=step
    )
    rm = 0.9 * m + 0.1 * g.astype(np.float64)
    rv = 0.99 * v + 0.01 * g.astype(np.float64) ** 2
    denom = np.sqrt(rv) / np.sqrt(1 - 0.99**step) + 1e-8
    close(new_m, rm)
    close(new_v, rv)
    close(new_p, p * (1 - 0.01 * 0.1) - 0.01 / (1 - 0.9**step) * rm / denom)


@pytest.mark.parametrize("grad_scale", [0.37, 1.0 / 1024.0, 3.0])
@pytest.mark.parametrize("optimizer", ["sgd", "sgd_momentum", "sgd_momentum_first", "adamw"])
def test_update_with_grad_scale_is_the_update_of_the_scaled_gradient(cpu_backend, optimizer, grad_scale):
    """The step's unscale/clip factor fused into the update: the float64 update of
    grad_scale * grad, and bit for bit the separate scale pass followed by the update."""
    n = 10_007  # above the OpenMP threshold, with a vector tail
    p, g, s0, s1 = rand(n), rand(n), rand(n), np.abs(rand(n))
    scaled = ops.scale(cpu_backend, g, grad_scale)
    if optimizer == "adamw":
        kw = dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=3)
        fused = ops.adamw_update(cpu_backend, p, g, s0, s1, grad_scale=grad_scale, **kw)
        two_pass = ops.adamw_update(cpu_backend, p, scaled, s0, s1, **kw)
        g64 = grad_scale * g.astype(np.float64)
        rm, rv = 0.9 * s0 + 0.1 * g64, 0.99 * s1 + 0.01 * g64**2
        ref = (p * (1 - 0.01 * 0.1) - 0.01 / (1 - 0.9**3) * rm / (np.sqrt(rv) / np.sqrt(1 - 0.99**3) + 1e-8), rm, rv)
    else:
        momentum = 0.0 if optimizer == "sgd" else 0.9
        kw = dict(lr=0.1, momentum=momentum, weight_decay=0.3, first_step=optimizer == "sgd_momentum_first")
        fused = ops.sgd_update(cpu_backend, p, g, s0, grad_scale=grad_scale, **kw)
        two_pass = ops.sgd_update(cpu_backend, p, scaled, s0, **kw)
        d = grad_scale * g.astype(np.float64) + 0.3 * p
        if momentum > 0 and optimizer != "sgd_momentum_first":
            d = momentum * s0 + d
        ref = (p - 0.1 * d, d if momentum > 0 else s0)
    for got, exact, r in zip(fused, two_pass, ref):
        assert np.array_equal(got, exact), f"{np.count_nonzero(got != exact)} of {n} differ from scale-then-update"
        close(got, r)


def verdict_reference(g, loss_slot, stop_slot, loss_scale, max_norm):
    """The step's decision as float64 NumPy spells it (step_verdict.h): the unscaled
    norm, finiteness, and the unscale/clip factor the update applies."""
    sum_squares = float(np.sum(g.astype(np.float64) ** 2))
    loss = float(np.float32(loss_slot) / np.float32(loss_scale))
    norm = np.sqrt(sum_squares) / float(np.float32(loss_scale))
    apply = bool(np.isfinite(loss) and np.isfinite(norm))
    factor = 1.0 / float(np.float32(loss_scale))
    if max_norm > 0 and norm > float(np.float32(max_norm)):
        factor *= float(np.float32(max_norm)) / (norm + 1e-6)
    return dict(
        sum_squares=sum_squares,
        grad_norm=norm,
        loss=loss,
        stop=stop_slot,
        apply=apply,
        factor=float(np.float32(factor)) if apply else 0.0,
    )


@pytest.mark.parametrize(
    "case",
    [
        "plain",
        "clipped",
        "under the clip",
        "loss scaled and clipped",
        "nan gradient",
        "inf gradient",
        "inf loss",
        "stop asked",
    ],
)
def test_step_verdict_decides_like_the_step_did_on_the_host(cpu_backend, case):
    """The health check's decision, now made where the gradients are: skip on a non-finite
    loss or norm, otherwise unscale and clip as PyTorch's clip_grad_norm_ (max / (norm + 1e-6))."""
    g = rand(5003)
    loss_slot, stop_slot, loss_scale, max_norm = 2.5, 0.0, 1.0, 0.0
    if case == "clipped":
        max_norm = 1.0
    elif case == "under the clip":
        max_norm = 1e6
    elif case == "loss scaled and clipped":
        g, loss_slot, loss_scale, max_norm = g * 1024, 2.5 * 1024, 1024.0, 3.0
    elif case == "nan gradient":
        g[4000] = np.nan
    elif case == "inf gradient":
        g[7] = np.inf
    elif case == "inf loss":
        loss_slot = np.inf
    elif case == "stop asked":
        stop_slot = 2.0
    got = ops.step_verdict(cpu_backend, g, loss_slot, stop_slot, loss_scale, max_norm)
    want = verdict_reference(g, loss_slot, stop_slot, loss_scale, max_norm)
    assert got["apply"] == want["apply"] == (case not in ("nan gradient", "inf gradient", "inf loss"))
    assert got["stop"] == want["stop"] and got["loss"] == pytest.approx(want["loss"], rel=1e-7)
    if want["apply"]:
        assert got["sum_squares"] == pytest.approx(want["sum_squares"], rel=1e-12)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-12)
        assert got["factor"] == pytest.approx(want["factor"], rel=1e-6)
        clipping = case in ("clipped", "loss scaled and clipped")
        assert (got["factor"] < 1.0 / loss_scale) == clipping
    else:
        assert not np.isfinite(got["grad_norm"]) or not np.isfinite(got["loss"])


@pytest.mark.parametrize("optimizer", ["sgd", "sgd_momentum", "adamw"])
def test_an_update_runs_as_its_verdict_says(cpu_backend, optimizer):
    """A verdict in backend memory: refused, nothing changes (parameters, momentum or
    moments); applied, the update is that of its factor, bit for bit grad_scale's."""
    n = 10_007
    p, g, s0, s1 = rand(n), rand(n), rand(n), np.abs(rand(n))
    if optimizer == "adamw":
        kw = dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=3)
        update = lambda **extra: ops.adamw_update(cpu_backend, p, g, s0, s1, **kw, **extra)  # noqa: E731
    else:
        kw = dict(lr=0.1, momentum=0.0 if optimizer == "sgd" else 0.9, weight_decay=0.3, first_step=False)
        update = lambda **extra: ops.sgd_update(cpu_backend, p, g, s0, **kw, **extra)  # noqa: E731
    refused = update(grad_scale=0.37, verdict=(False, 0.37))
    for got, before in zip(refused, (p, s0, s1)):
        assert np.array_equal(got, before)
    applied = update(grad_scale=5.0, verdict=(True, 0.37))  # the verdict's factor wins
    for got, want in zip(applied, update(grad_scale=0.37)):
        assert np.array_equal(got, want)
    assert not np.array_equal(applied[0], p)


def test_gather_rows_copies_the_indexed_rows_and_refuses_an_index_outside(cpu_backend):
    src = rand(20, 3)
    index = np.array([19, 0, 0, 7], np.int64)
    assert np.array_equal(ops.gather_rows(cpu_backend, src, index), src[index])
    assert ops.gather_rows(cpu_backend, src, np.zeros(0, np.int64)).shape == (0, 3)
    with pytest.raises(ConfigError, match="outside the 20 rows"):
        ops.gather_rows(cpu_backend, src, np.array([20]))


def test_sum_squares_scale_axpy_zero(cpu_backend):
    x, y = rand(1000), rand(1000)
    assert ops.sum_squares(cpu_backend, x) == pytest.approx((x.astype(np.float64) ** 2).sum(), rel=1e-12)
    assert ops.sum_squares(cpu_backend, np.zeros(0, np.float32)) == 0.0
    for bad, expect in ((np.nan, np.isnan), (np.inf, np.isinf), (-np.inf, np.isinf)):
        z = x.copy()
        z[500] = bad
        assert expect(ops.sum_squares(cpu_backend, z))
    close(ops.scale(cpu_backend, x, -0.5), -0.5 * x.astype(np.float64))
    close(ops.axpy(cpu_backend, y, x, 2.0), y + 2.0 * x.astype(np.float64))
    assert not ops.zero(cpu_backend, x).any()
    assert np.array_equal(ops.round_trip(cpu_backend, x), x)


def test_cpu_precision_is_fp32_only(cpu_backend):
    assert cpu_backend.precision == "fp32"
    cpu_backend.precision = "fp32"
    with pytest.raises(ConfigError, match="fp32 only"):
        cpu_backend.precision = "bf16"
    with pytest.raises(ConfigError, match="unknown precision"):
        cpu_backend.precision = "fp8"


# --- pieces of the CUDA build that run on the host --------------------------

needs_cuda_build = pytest.mark.skipif(
    not hasattr(_core, "curand_philox4x32_10"), reason="mgpu was built without the CUDA backend"
)


@needs_cuda_build
def test_curand_philox_equals_mgpu_philox():
    rng = np.random.default_rng(0)
    cases = [([0, 0, 0, 0], [0, 0]), ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2), ([1, 2, 3, 4], [5, 6])]
    cases += [
        (list(map(int, rng.integers(0, 2**32, 4))), list(map(int, rng.integers(0, 2**32, 2)))) for _ in range(200)
    ]
    for counter, key in cases:
        assert _core.curand_philox4x32_10(counter, key) == _core.philox4x32_10(counter, key), (counter, key)
    # Known-answer vector of the Random123 reference (philox4x32_10, all-zero counter and key).
    assert _core.philox4x32_10([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@needs_cuda_build
@pytest.mark.parametrize("rows, cols, p, first_sample", [(3, 1, 0.5, 0), (6, 37, 0.2, 11), (4, 1000, 0.9, 2**31)])
def test_cuda_dropout_kernel_mask_equals_cpu_backend(cpu_backend, rows, cols, p, first_sample):
    seed, step, layer = (7 << 32) + 99, 2**33 + 5, 3
    mask = _core.cuda_dropout_mask_on_host(rows, cols, p, seed, step, layer, first_sample)
    ones = np.ones((rows, cols), np.float32)
    cpu = ops.relu_dropout_forward(cpu_backend, ones, p, seed=seed, step=step, layer=layer, first_sample=first_sample)
    assert np.array_equal(mask, cpu)


def test_no_gpu_paths_fail_cleanly():
    if _core.cuda_device_count() > 0:
        pytest.skip("a GPU is visible")
    info = _core.build_info()["cuda"]
    assert info["device_count"] == 0
    assert _core.cuda_device_count() == 0
    with pytest.raises(_core.DeviceError, match="no CUDA GPU is visible|without the CUDA toolkit"):
        _core.make_backend("cuda", 0)
    from mgpu import ProcessGroup

    pg = ProcessGroup(comm=__import__("mpi4py.MPI", fromlist=["MPI"]).COMM_SELF)
    assert pg.resolve_device("auto") == ("cpu", 0)
    with pytest.raises(ConfigError, match="no GPU is visible|no CUDA backend"):
        pg.resolve_device("cuda")
    with pytest.raises(ConfigError):
        pg.communicator("nccl")


def test_build_info_reports_cuda_versions():
    info = _core.build_info()["cuda"]
    assert isinstance(info["compiled"], bool)
    if info["compiled"]:
        for key in (
            "runtime_compiled",
            "runtime_loaded",
            "cublas_compiled",
            "cublas_loaded",
            "curand_compiled",
            "curand_loaded",
        ):
            assert info[key], key
        assert "driver" in info
        if info["nccl_communicator"]:
            assert info["nccl_compiled"] and info["nccl_loaded"] and info["nccl_loaded_code"] > 0


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gradient_compression_on_the_cpu_rounds_to_nearest_even(cpu_backend, dtype):
    # The CPU reference of the CUDA narrow/widen kernels (tests/gpu/test_kernels.py holds the two together).
    from reference import COMPRESSION_CASES, compressed_reference  # tests/reference.py

    x = np.concatenate([rand(4000) * np.float32(1e-3), rand(300) * np.float32(1e4), COMPRESSION_CASES])
    np.testing.assert_array_equal(ops.narrow_widen(cpu_backend, x, dtype), compressed_reference(x, dtype))
    with pytest.raises(ConfigError, match="bf16 or fp16"):
        ops.narrow_widen(cpu_backend, x, "tf32")
