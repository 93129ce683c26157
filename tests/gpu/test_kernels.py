"""Every Backend kernel on the CUDA backend against the CPU backend, through
the backend_ops probe: the dropout mask bit for bit, everything else within
fp32 rounding (GEMMs in IEEE fp32: TF32 is off unless asked for)."""

import numpy as np
import pytest

from mgpu import _core
from mgpu.errors import ConfigError
from reference import COMPRESSION_CASES, compressed_reference  # tests/reference.py

ops = _core.backend_ops


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def close(a, b, tol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)
    assert err <= tol, err


SHAPES = [(1, 1, 1), (7, 5, 3), (64, 128, 10), (257, 300, 33), (1024, 784, 512)]


@pytest.mark.parametrize("B, IN, OUT", SHAPES)
def test_linear_forward_backward(cuda_backend, cpu_backend, B, IN, OUT):
    rng = np.random.default_rng(B + IN + OUT)
    x, w, b = rand(rng, B, IN), rand(rng, OUT, IN), rand(rng, OUT)
    close(ops.linear_forward(cuda_backend, x, w, b), ops.linear_forward(cpu_backend, x, w, b), 1e-6)
    dout, gw0, gb0 = rand(rng, B, OUT), rand(rng, OUT, IN), rand(rng, OUT)
    for accumulate in (False, True):
        got = ops.linear_backward(cuda_backend, dout, x, w, gw0, gb0, accumulate)
        want = ops.linear_backward(cpu_backend, dout, x, w, gw0, gb0, accumulate)
        for g, r in zip(got, want):
            close(g, r, 1e-6)
    got = ops.linear_backward(cuda_backend, dout, x, w, gw0, gb0, False, with_dinp=False)
    assert got[0] is None


def test_linear_with_zero_rows(cuda_backend, cpu_backend):
    rng = np.random.default_rng(0)
    x, w, dout = np.zeros((0, 4), np.float32), rand(rng, 3, 4), np.zeros((0, 3), np.float32)
    gw0, gb0 = rand(rng, 3, 4), rand(rng, 3)
    for accumulate in (False, True):
        _, gw, gb = ops.linear_backward(cuda_backend, dout, x, w, gw0, gb0, accumulate)
        _, rw, rb = ops.linear_backward(cpu_backend, dout, x, w, gw0, gb0, accumulate)
        assert np.array_equal(gw, rw) and np.array_equal(gb, rb)


@pytest.mark.parametrize("precision, tol", [("tf32", 5e-3), ("bf16", 2e-2), ("fp16", 5e-3)])
def test_reduced_precision_gemms(cuda_backend, cpu_backend, precision, tol):
    rng = np.random.default_rng(1)
    cuda_backend.precision = precision
    assert cuda_backend.precision == precision
    B, IN, OUT = 96, 200, 48
    x, w, b = rand(rng, B, IN), rand(rng, OUT, IN, scale=0.1), rand(rng, OUT)
    close(ops.linear_forward(cuda_backend, x, w, b), ops.linear_forward(cpu_backend, x, w, b), tol)
    dout, gw0, gb0 = rand(rng, B, OUT), rand(rng, OUT, IN), rand(rng, OUT)
    got = ops.linear_backward(cuda_backend, dout, x, w, gw0, gb0, True)
    want = ops.linear_backward(cpu_backend, dout, x, w, gw0, gb0, True)
    for g, r in zip(got, want):
        close(g, r, tol)
    cuda_backend.precision = "fp32"
    close(ops.linear_forward(cuda_backend, x, w, b), ops.linear_forward(cpu_backend, x, w, b), 1e-6)


@pytest.mark.parametrize("rows, cols", [(1, 1), (5, 3), (33, 37), (512, 1024), (3, 4097)])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_relu_dropout_bit_exact(cuda_backend, cpu_backend, rows, cols, p):
    rng = np.random.default_rng(rows * cols)
    h = rand(rng, rows, cols)
    key = dict(seed=(5 << 32) + 3, step=2**32 + 17, layer=1, first_sample=1000)
    got = ops.relu_dropout_forward(cuda_backend, h, p, **key)
    want = ops.relu_dropout_forward(cpu_backend, h, p, **key)
    assert np.array_equal(got, want)
    dh = rand(rng, rows, cols)
    assert np.array_equal(
        ops.relu_dropout_backward(cuda_backend, dh, want, p), ops.relu_dropout_backward(cpu_backend, dh, want, p)
    )


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_relu_dropout_on_nan_and_inf_is_the_cpu_backends(cuda_backend, cpu_backend, p):
    h = np.tile(np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1.5, -2.0], np.float32), (9, 5))
    key = dict(seed=7, step=3, layer=2, first_sample=11)
    got = ops.relu_dropout_forward(cuda_backend, h, p, **key)
    want = ops.relu_dropout_forward(cpu_backend, h, p, **key)
    assert np.array_equal(got, want, equal_nan=True) and np.isnan(got).any()
    dh = np.ones(h.shape, np.float32)
    assert np.array_equal(
        ops.relu_dropout_backward(cuda_backend, dh, want, p), ops.relu_dropout_backward(cpu_backend, dh, want, p)
    )


@pytest.mark.parametrize("B, D", [(1, 1), (13, 3), (4096, 7), (100000, 3)])
def test_mse(cuda_backend, cpu_backend, B, D):
    rng = np.random.default_rng(B)
    pred, target = rand(rng, B, D), rand(rng, B, D)
    for with_grad in (True, False):
        got = ops.mse_forward_backward(cuda_backend, pred, target, 1.0 / (B * D), with_grad)
        want = ops.mse_forward_backward(cpu_backend, pred, target, 1.0 / (B * D), with_grad)
        assert got[0] == pytest.approx(want[0], rel=1e-6)
        if with_grad:
            close(got[1], want[1], 1e-7)


@pytest.mark.parametrize("B, C", [(1, 1), (1, 2), (17, 10), (1000, 10), (64, 1000)])
def test_cross_entropy(cuda_backend, cpu_backend, B, C):
    rng = np.random.default_rng(B * C)
    logits = rand(rng, B, C, scale=4.0)
    logits[0, :] = 0.5  # tie: first maximal index
    labels = rng.integers(0, C, B).astype(np.int32)
    got = ops.cross_entropy_forward_backward(cuda_backend, logits, labels, 1.0 / B)
    want = ops.cross_entropy_forward_backward(cpu_backend, logits, labels, 1.0 / B)
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    close(got[1], want[1], 1e-6)
    assert got[2] == want[2]
    got = ops.cross_entropy_forward_backward(cuda_backend, logits, labels, 1.0, False, False)
    assert got[1] is None and got[2] is None


@pytest.mark.parametrize("bad", [[10], [-1, 12], [2**31 - 1, -(2**31)]])
def test_cross_entropy_out_of_range_labels_raise_the_same_error_everywhere(cuda_backend, cpu_backend, bad):
    # Labels come from the caller: one outside [0, C) must not be read through
    # (far out of range it would leave the logits; the emulation reports that),
    # its row is left out, and every backend raises the same clear error.
    B, C = 40, 10
    rng = np.random.default_rng(11)
    logits = rand(rng, B, C)
    labels = rng.integers(0, C, B).astype(np.int32)
    labels[[5, 33][: len(bad)]] = bad
    messages = []
    for be in (cuda_backend, cpu_backend):
        with pytest.raises(ConfigError, match=rf"label {bad[0]} at row 5 is out of range \[0, 10\)") as e:
            ops.cross_entropy_forward_backward(be, logits, labels, 1.0 / B)
        messages.append(str(e.value))
        with pytest.raises(ConfigError, match="at row 5"):  # also when only the loss is read back
            ops.cross_entropy_forward_backward(be, logits, labels, 1.0, False, False)
    assert messages[0] == messages[1]
    assert ("2 rows had such labels" in messages[0]) == (len(bad) == 2)
    labels[[5, 33]] = 0  # reported once: the backend carries on
    got = ops.cross_entropy_forward_backward(cuda_backend, logits, labels, 1.0 / B)
    want = ops.cross_entropy_forward_backward(cpu_backend, logits, labels, 1.0 / B)
    assert got[0] == pytest.approx(want[0], rel=1e-6)


def test_back_to_back_replays_each_use_their_own_step(cuda_backend, cpu_backend):
    # Replays enqueued while the stream is still busy (the host runs ahead, as
    # in a loop of replays): each must drop with its own step, not a later one.
    rng = np.random.default_rng(12)
    h = rand(rng, 64, 96)
    steps = [3, 4, 5]
    busy = 1 << 18 if _core.build_info().get("gpu_emulation", False) else 1 << 26
    want = sum(ops.relu_dropout_forward(cpu_backend, h, 0.5, seed=9, step=s) for s in steps)
    close(ops.replayed_relu_dropout(cpu_backend, h, 0.5, 9, steps), want, 1e-7)
    close(ops.replayed_relu_dropout(cuda_backend, h, 0.5, 9, steps, busy), want, 1e-7)


@pytest.mark.parametrize("momentum, first", [(0.0, True), (0.9, True), (0.9, False)])
def test_sgd(cuda_backend, cpu_backend, momentum, first):
    rng = np.random.default_rng(2)
    args = [rand(rng, 10001) for _ in range(3)]
    kw = dict(lr=0.05, momentum=momentum, weight_decay=0.01, first_step=first)
    for g, r in zip(ops.sgd_update(cuda_backend, *args, **kw), ops.sgd_update(cpu_backend, *args, **kw)):
        close(g, r, 1e-7)


@pytest.mark.parametrize("step", [1, 2, 1000])
def test_adamw(cuda_backend, cpu_backend, step):
    rng = np.random.default_rng(3)
    p, g, m, v = rand(rng, 10001), rand(rng, 10001), rand(rng, 10001), np.abs(rand(rng, 10001))
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=step)
    for a, b in zip(ops.adamw_update(cuda_backend, p, g, m, v, **kw), ops.adamw_update(cpu_backend, p, g, m, v, **kw)):
        close(a, b, 1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "sgd_momentum", "adamw"])
def test_update_with_grad_scale(cuda_backend, cpu_backend, optimizer):
    """The fused unscale/clip factor: the CUDA update equals the CPU one, and bit
    for bit its own scale pass followed by the update (__fmul_rn keeps the product
    out of any FMA)."""
    rng = np.random.default_rng(4)
    n, gs = 10001, 0.37
    p, g, m, v = rand(rng, n), rand(rng, n), rand(rng, n), np.abs(rand(rng, n))
    if optimizer == "adamw":
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=2)
        update = lambda be, grad, **extra: ops.adamw_update(be, p, grad, m, v, **kw, **extra)  # noqa: E731
    else:
        kw = dict(lr=0.05, momentum=0.0 if optimizer == "sgd" else 0.9, weight_decay=0.3, first_step=False)
        update = lambda be, grad, **extra: ops.sgd_update(be, p, grad, m, **kw, **extra)  # noqa: E731
    fused = update(cuda_backend, g, grad_scale=gs)
    two_pass = update(cuda_backend, ops.scale(cuda_backend, g, gs))
    for a, b, c in zip(fused, two_pass, update(cpu_backend, g, grad_scale=gs)):
        assert np.array_equal(a, b)
        close(a, c, 1e-6)
    assert not np.array_equal(fused[0], update(cuda_backend, g)[0]), "grad_scale was ignored"


@pytest.mark.parametrize(
    "n, poison", [(1, None), (4099, None), (1_000_003, None), (4099, "nan"), (4099, "inf"), (1_000_003, "loss")]
)
@pytest.mark.parametrize("loss_scale, max_norm", [(1.0, 0.0), (1.0, 2.0), (4096.0, 2.0), (4096.0, 1e9)])
def test_step_verdict_equals_the_cpu_bit_for_bit(cuda_backend, cpu_backend, n, poison, loss_scale, max_norm):
    # One definition (decide_step) on both sides, and a sum of squares within
    # rounding: the decision and the factor agree, so captured or not, CPU or GPU,
    # the same steps are skipped and clipped.
    rng = np.random.default_rng(n)
    g = rand(rng, n, scale=loss_scale)
    loss_slot = 3.25 * loss_scale
    if poison == "nan":
        g[n // 2] = np.nan
    elif poison == "inf":
        g[-1] = -np.inf
    elif poison == "loss":
        loss_slot = np.nan
    gpu = ops.step_verdict(cuda_backend, g, loss_slot, 1.0, loss_scale, max_norm)
    cpu = ops.step_verdict(cpu_backend, g, loss_slot, 1.0, loss_scale, max_norm)
    assert gpu["apply"] == cpu["apply"] == (poison is None)
    assert gpu["loss"] == cpu["loss"] or (np.isnan(gpu["loss"]) and np.isnan(cpu["loss"]))
    assert gpu["stop"] == cpu["stop"] == 1.0
    if poison is None:
        assert gpu["sum_squares"] == pytest.approx(cpu["sum_squares"], rel=1e-12)
        assert gpu["factor"] == pytest.approx(cpu["factor"], rel=1e-7)
        assert (gpu["factor"] < 1.0 / loss_scale) == (max_norm > 0 and cpu["grad_norm"] > max_norm)


@pytest.mark.parametrize("optimizer", ["sgd", "sgd_momentum", "adamw"])
def test_an_update_runs_as_its_verdict_says(cuda_backend, cpu_backend, optimizer):
    rng = np.random.default_rng(5)
    n = 10001
    p, g, m, v = rand(rng, n), rand(rng, n), rand(rng, n), np.abs(rand(rng, n))
    if optimizer == "adamw":
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=2)
        update = lambda be, **extra: ops.adamw_update(be, p, g, m, v, **kw, **extra)  # noqa: E731
    else:
        kw = dict(lr=0.05, momentum=0.0 if optimizer == "sgd" else 0.9, weight_decay=0.3, first_step=False)
        update = lambda be, **extra: ops.sgd_update(be, p, g, m, **kw, **extra)  # noqa: E731
    for got, before in zip(update(cuda_backend, verdict=(False, 0.37)), (p, m, v)):
        assert np.array_equal(got, before)  # refused: nothing written
    applied = update(cuda_backend, grad_scale=5.0, verdict=(True, 0.37))
    for a, b, c in zip(applied, update(cuda_backend, grad_scale=0.37), update(cpu_backend, verdict=(True, 0.37))):
        assert np.array_equal(a, b)
        close(a, c, 1e-6)


@pytest.mark.parametrize("n", [0, 1, 1000, 3_000_001])
def test_sum_squares_scale_axpy(cuda_backend, cpu_backend, n):
    rng = np.random.default_rng(n)
    x, y = rand(rng, n), rand(rng, n)
    got = ops.sum_squares(cuda_backend, x)
    assert got == pytest.approx(ops.sum_squares(cpu_backend, x), rel=1e-12, abs=1e-30)
    assert ops.sum_squares(cuda_backend, x) == got, "deterministic"
    close(ops.scale(cuda_backend, x, 0.3), ops.scale(cpu_backend, x, 0.3), 1e-7)
    close(ops.axpy(cuda_backend, y, x, -1.5), ops.axpy(cpu_backend, y, x, -1.5), 1e-7)
    assert not ops.zero(cuda_backend, x).any()
    assert np.array_equal(ops.round_trip(cuda_backend, x), x)


@pytest.mark.parametrize("rows, width", [(0, 5), (1, 1), (37, 3), (1024, 784), (3000, 1)])
def test_gather_rows_matches_the_cpu_and_numpy(cuda_backend, cpu_backend, rows, width):
    rng = np.random.default_rng(rows + width)
    src = rand(rng, 257, width)
    index = rng.integers(0, 257, rows)  # repeats and any order, as a permutation's slices are a case of
    got = ops.gather_rows(cuda_backend, src, index)
    assert np.array_equal(got, src[index])
    assert np.array_equal(got, ops.gather_rows(cpu_backend, src, index))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gradient_compression_rounds_like_the_cpu_and_numpy(cuda_backend, cpu_backend, dtype):
    rng = np.random.default_rng(11)
    x = np.concatenate([rand(rng, 5000, scale=1e-3), rand(rng, 300, scale=1e4), COMPRESSION_CASES])
    expect = compressed_reference(x, dtype)
    np.testing.assert_array_equal(ops.narrow_widen(cuda_backend, x, dtype), expect)
    np.testing.assert_array_equal(ops.narrow_widen(cpu_backend, x, dtype), expect)


def test_sum_squares_propagates_nan_and_inf(cuda_backend):
    x = np.ones(100000, np.float32)
    for bad, check in ((np.nan, np.isnan), (np.inf, np.isinf)):
        z = x.copy()
        z[77777] = bad
        assert check(ops.sum_squares(cuda_backend, z))


def exact_sum_squares(x):
    """Float64 reference; squares of floats are exact in float64, so only the sum rounds."""
    return float(np.sum(np.square(x.astype(np.float64))))


# n: empty, the tail alone (n < 4), whole quads, quads + tail, one unrolled round
# per thread and around it, several rounds (the grid is full from 2.16M on).
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 7, 4095, 4096, 4097, 65537, 1_000_003, 2_500_001])
def test_sum_squares_alignment_and_tail(cuda_backend, cpu_backend, n):
    rng = np.random.default_rng(n + 7)
    x = rand(rng, n)
    want = exact_sum_squares(x)
    # (x at an offset of an empty buffer would point past its allocation)
    offsets = (0,) if n == 0 else (0, 1, 2, 3) if n < 100_000 else (0, 3)
    got = [ops.sum_squares(cuda_backend, x, offset=k) for k in offsets]
    assert got[0] == pytest.approx(want, rel=1e-13, abs=0.0)
    assert got[0] == pytest.approx(ops.sum_squares(cpu_backend, x), rel=1e-12, abs=0.0)
    # Alignment picks the load width, never the summation order: the same bits.
    assert got == [got[0]] * len(offsets)
    assert ops.sum_squares(cuda_backend, x, offset=offsets[-1]) == got[0], "deterministic"


@pytest.mark.parametrize("n", [5, 4099, 100_003])
def test_sum_squares_propagates_nan_and_inf_from_every_part(cuda_backend, n):
    # First element, middle, last (the tail when n % 4), at an aligned and a misaligned start.
    x = np.full(n, 0.5, np.float32)
    for where in (0, n // 2, n - 1):
        for bad, check in ((np.nan, np.isnan), (np.inf, np.isinf), (-np.inf, np.isinf)):
            z = x.copy()
            z[where] = bad
            for offset in (0, 1):
                assert check(ops.sum_squares(cuda_backend, z, offset=offset)), (where, bad, offset)
    big = np.full(n, np.finfo(np.float32).max, np.float32)  # squares overflow fp32, not fp64
    assert ops.sum_squares(cuda_backend, big) == pytest.approx(n * float(big[0]) ** 2, rel=1e-12)


# (B, OUT): one row; a column tile and a bit; small OUT with many rows (split
# across blocks, then the second pass); OUT not a multiple of 32; more rows than
# one round per split; a wide layer (splits = 5).
COLUMN_SHAPES = [(1, 1), (1, 37), (3, 5), (64, 3), (4096, 3), (5000, 7), (257, 33), (300, 100), (1024, 4096)]


@pytest.mark.parametrize("B, OUT", COLUMN_SHAPES)
def test_bias_gradient_column_sums(cuda_backend, cpu_backend, B, OUT):
    rng = np.random.default_rng(B * 7 + OUT)
    dout, x, w = rand(rng, B, OUT), rand(rng, B, 1), rand(rng, OUT, 1)
    gw0, gb0 = rand(rng, OUT, 1), rand(rng, OUT, scale=10.0)
    sums = dout.astype(np.float64).sum(0)
    bound = 1e-6 * np.abs(dout.astype(np.float64)).sum(0) + 1e-6 * np.abs(gb0)
    for accumulate in (False, True):
        want = sums + (gb0 if accumulate else 0.0)
        got = ops.linear_backward(cuda_backend, dout, x, w, gw0, gb0, accumulate, with_dinp=False)[2]
        assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
        cpu = ops.linear_backward(cpu_backend, dout, x, w, gw0, gb0, accumulate, with_dinp=False)[2]
        assert np.all(np.abs(got - cpu) <= 2 * bound + 1e-6 * np.abs(cpu))
        again = ops.linear_backward(cuda_backend, dout, x, w, gw0, gb0, accumulate, with_dinp=False)[2]
        assert np.array_equal(got, again), "deterministic"


def test_bias_gradient_overwrites_without_reading_and_propagates_nan(cuda_backend, cpu_backend):
    rng = np.random.default_rng(3)
    B, OUT = 4096, 3
    dout, x, w, gw0 = rand(rng, B, OUT), rand(rng, B, 1), rand(rng, OUT, 1), rand(rng, OUT, 1)
    stale = np.array([np.nan, np.inf, 1.0], np.float32)
    for be in (cuda_backend, cpu_backend):  # accumulate=False ignores the old dbias, NaN or not
        got = ops.linear_backward(be, dout, x, w, gw0, stale, False, with_dinp=False)[2]
        assert np.all(np.isfinite(got)) and got == pytest.approx(dout.astype(np.float64).sum(0), rel=1e-4, abs=1e-3)
    dout[B - 1, 1] = np.nan  # the last row: the last split, the last round
    dout[B // 2, 2] = np.inf
    got = ops.linear_backward(cuda_backend, dout, x, w, gw0, np.zeros(OUT, np.float32), True, with_dinp=False)[2]
    assert np.isfinite(got[0]) and np.isnan(got[1]) and got[2] == np.inf


def test_backend_properties_and_errors(gpu):
    be = _core.make_backend("cuda", gpu)
    assert be.name == "cuda" and be.precision == "fp32"
    with pytest.raises(ConfigError):
        be.precision = "fp8"
    n = _core.cuda_device_count()
    with pytest.raises(_core.DeviceError, match=f"device index {n} out of range: {n} GPU"):
        _core.make_backend("cuda", n)
    info = _core.cuda_device_info(gpu)
    assert info["name"] and info["total_memory"] > 0 and info["multiprocessors"] > 0
    assert info["compute_capability"][0].isdigit() and info["pci_bus_id"]
    free, total = _core.cuda_memory_info(gpu)
    assert 0 < free <= total
    cuda = _core.build_info()["cuda"]
    assert cuda["driver"] and cuda["device_count"] == n


def test_a_larger_second_model_on_one_backend_gets_half_weights_of_its_size(gpu):
    # The half copy of the weights follows the newest model's parameters: sized for a
    # smaller first model, it must grow, or the casts would write past its end.
    x = np.random.default_rng(1).standard_normal((6, 16)).astype(np.float32)
    alone = _core.make_backend("cuda", gpu)
    alone.precision = "bf16"
    expected = _core.MLP(alone, [16, 96, 96, 4], 0.0, 5).forward(x)
    shared = _core.make_backend("cuda", gpu)
    shared.precision = "bf16"
    small = _core.MLP(shared, [16, 8, 4], 0.0, 5)
    small.forward(x)
    large = _core.MLP(shared, [16, 96, 96, 4], 0.0, 5)
    assert np.array_equal(large.forward(x), expected)
