"""The MLP's layers, losses and gradients against the float64 reference and
finite differences; initialisation; dropout; input checks."""

import numpy as np
import pytest

import mgpu
from reference import cross_entropy, forward, loss_and_grad, mse, rel_err

SHAPES = [[5, 3], [7, 16, 4], [13, 32, 17, 9, 2], [64, 128, 10]]


def make(layers, seed=3, dropout=0.0, threads=1):
    return mgpu.MLP(layers, seed=seed, dropout=dropout, threads=threads)


def batch(layers, rows, loss, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, layers[0])).astype(np.float32)
    if loss == "mse":
        y = rng.standard_normal((rows, layers[-1])).astype(np.float32)
    else:
        y = rng.integers(0, layers[-1], rows)
    return x, y


@pytest.mark.parametrize("layers", SHAPES)
@pytest.mark.parametrize("rows", [1, 6, 33])
def test_forward_matches_reference(layers, rows):
    m = make(layers)
    x, _ = batch(layers, rows, "mse")
    ref = forward(m.get_parameters(), x)[-1]
    out = m.forward(x)
    assert out.shape == (rows, layers[-1]) and out.dtype == np.float32
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("layers", SHAPES)
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
@pytest.mark.parametrize("threads", [1, 2])
def test_loss_and_grad_match_reference(layers, loss, threads):
    m = make(layers, threads=threads)
    x, y = batch(layers, 29, loss)
    value = m.loss_and_grad(x, y, loss)
    ref_value, ref_grads = loss_and_grad(m.get_parameters(), x, y, loss)
    assert abs(value - ref_value) <= 1e-5 * max(1.0, abs(ref_value))
    for g, r in zip(m.get_gradients(), ref_grads):
        assert g.shape == r.shape
        assert rel_err(g, r) < 1e-4


def test_loss_definitions_are_pytorchs():
    # MSELoss(mean) averages over every element; CrossEntropyLoss over samples.
    pred = np.array([[1.0, 2.0], [3.0, 5.0]])
    y = np.array([[0.0, 2.0], [3.0, 3.0]])
    assert mse(pred, y)[0] == pytest.approx((1 + 0 + 0 + 4) / 4)
    logits = np.array([[2.0, 1.0, 0.1], [0.0, 0.0, 3.0]])
    labels = np.array([0, 1])
    expected = np.mean([-np.log(np.exp(2) / np.exp([2, 1, 0.1]).sum()), -np.log(1 / (2 + np.exp(3)))])
    assert cross_entropy(logits, labels)[0] == pytest.approx(expected)
    # and the core agrees on a one-layer model whose output is set exactly
    m = make([2, 2])
    m.set_parameters([np.eye(2, dtype=np.float32), np.zeros(2, np.float32)])
    assert m.loss_and_grad(pred.astype(np.float32), y.astype(np.float32), "mse") == pytest.approx(1.25)
    m3 = make([3, 3])
    m3.set_parameters([np.eye(3, dtype=np.float32), np.zeros(3, np.float32)])
    assert m3.loss_and_grad(logits.astype(np.float32), labels, "cross_entropy") == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_gradients_match_finite_differences(loss):
    layers = [4, 6, 5, 3]
    m = make(layers, seed=11)
    x, y = batch(layers, 8, loss, seed=5)
    m.loss_and_grad(x, y, loss)
    grads = m.get_gradients()
    params = m.get_parameters()
    rng = np.random.default_rng(0)
    eps = 1e-2
    for t in range(len(params)):
        for _ in range(4):
            idx = tuple(rng.integers(0, s) for s in params[t].shape)
            orig = params[t][idx]
            vals = []
            for sign in (1, -1):
                p = [q.copy() for q in params]
                p[t][idx] = orig + sign * eps
                m.set_parameters(p)
                vals.append(m.loss_and_grad(x, y, loss))
            fd = (vals[0] - vals[1]) / (2 * eps)
            assert fd == pytest.approx(grads[t][idx], abs=2e-3, rel=2e-2), (t, idx)
        m.set_parameters(params)


def test_initialisation_is_nn_linear_default_and_seeded():
    layers = [100, 400, 30]
    a, b, c = make(layers, seed=1), make(layers, seed=1), make(layers, seed=2)
    pa, pb, pc = a.get_parameters(), b.get_parameters(), c.get_parameters()
    assert all(np.array_equal(u, v) for u, v in zip(pa, pb))
    assert not np.array_equal(pa[0], pc[0])
    for l in range(len(layers) - 1):
        bound = 1 / np.sqrt(layers[l])
        for p in (pa[2 * l], pa[2 * l + 1]):
            assert np.abs(p).max() <= bound
        w = pa[2 * l]
        # U(-b, b): mean 0, variance b^2 / 3
        assert abs(w.mean()) < 0.05 * bound
        assert w.var() == pytest.approx(bound**2 / 3, rel=0.05)
    # layer streams are independent: layer 1 is not a copy of a slice of layer 0
    assert not np.allclose(pa[2][:, :30].ravel()[:50] * np.sqrt(400), pa[0].ravel()[:50] * np.sqrt(100))


def test_dropout_masks_are_keyed_scaled_and_differentiable():
    layers = [8, 256, 1]
    p = 0.25
    m = make(layers, dropout=p, seed=4)
    x, y = batch(layers, 64, "mse")
    m.loss_and_grad(x, y, "mse", step=0)
    g0 = m.get_gradients()
    m.loss_and_grad(x, y, "mse", step=0)
    assert all(np.array_equal(u, v) for u, v in zip(g0, m.get_gradients())), "same step, same mask"
    m.loss_and_grad(x, y, "mse", step=1)
    assert not np.array_equal(g0[0], m.get_gradients()[0]), "another step, another mask"
    # For one sample and one output, dW1 = dout * h_dropped and db1 = dout, so the
    # dropped hidden activation is dW1 / db1: each unit is 0 or relu(z) / (1 - p).
    params = m.get_parameters()
    dropped = []
    for row in range(32):
        m.loss_and_grad(x[row : row + 1], y[row : row + 1], "mse", step=100 + row)
        g = m.get_gradients()
        h = g[2][0] / g[3][0]
        plain = forward(params, x[row : row + 1])[0][0]
        active = plain > 1e-3
        ratio = h[active] / plain[active]
        is_zero = np.isclose(ratio, 0, atol=1e-4)
        assert np.all(is_zero | np.isclose(ratio, 1 / (1 - p), rtol=1e-4)), ratio
        dropped.append(is_zero.mean())
    assert np.mean(dropped) == pytest.approx(p, abs=0.03)


def test_dropout_gradient_matches_finite_differences_for_fixed_mask():
    layers = [5, 12, 3]
    m = make(layers, dropout=0.4, seed=9)
    x, y = batch(layers, 6, "mse")
    m.loss_and_grad(x, y, "mse", step=3)
    grads = m.get_gradients()
    params = m.get_parameters()
    eps = 1e-2
    for idx in [(0, 0), (3, 2), (11, 4)]:
        vals = []
        for sign in (1, -1):
            p = [q.copy() for q in params]
            p[0][idx] += sign * eps
            m.set_parameters(p)
            vals.append(m.loss_and_grad(x, y, "mse", step=3))
        assert (vals[0] - vals[1]) / (2 * eps) == pytest.approx(grads[0][idx], abs=2e-3, rel=2e-2)


def test_evaluate_sums_losses_and_counts_hits():
    layers = [6, 9, 4]
    m = make(layers)
    x, y = batch(layers, 2500, "cross_entropy")  # several internal chunks
    loss_sum, correct = m._core.evaluate(x, y, "cross_entropy")
    logits = forward(m.get_parameters(), x)[-1]
    assert loss_sum / len(x) == pytest.approx(cross_entropy(logits, y)[0], rel=1e-5)
    assert correct == int((logits.argmax(1) == y).sum())


def test_parameters_round_trip_and_save_load(tmp_path):
    m = make([3, 4, 2])
    params = [np.full_like(p, i) for i, p in enumerate(m.get_parameters())]
    m.set_parameters(params)
    assert all(np.array_equal(a, b) for a, b in zip(m.get_parameters(), params))
    path = tmp_path / "p.npz"
    m.save(str(path))
    with np.load(path, allow_pickle=False) as f:
        assert sorted(f.files) == ["layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight"]
        assert f["layers.1.weight"].shape == (2, 4)
    other = make([3, 4, 2], seed=99)
    other.load(str(path))
    assert all(np.array_equal(a, b) for a, b in zip(other.get_parameters(), params))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.forward(np.zeros((2, 4), np.float32)), r"shape \(rows, 3\)"),
        (lambda m: m.forward(np.zeros(3, np.float32)), "shape"),
        (lambda m: m.loss_and_grad(np.zeros((2, 3)), np.zeros((3, 2)), "mse"), "rows"),
        (lambda m: m.loss_and_grad(np.zeros((2, 3)), np.array([0, 2]), "cross_entropy"), "out of range"),
        (lambda m: m.loss_and_grad(np.zeros((2, 3)), np.array([0.0, 1.0]), "cross_entropy"), "integers"),
        (lambda m: m.loss_and_grad(np.zeros((2, 3)), np.zeros((2, 2)), "hinge"), "unknown loss"),
        (lambda m: m.set_parameters([np.zeros((2, 3))]), "expected 4 arrays"),
        (lambda m: m.set_parameters([np.zeros((3, 3)), np.zeros(2), np.zeros((2, 2)), np.zeros(2)]), "shape"),
    ],
)
def test_bad_input_raises_config_error(call, match):
    m = make([3, 2, 2])
    with pytest.raises(mgpu.ConfigError, match=match):
        call(m)


@pytest.mark.parametrize("layers, dropout", [([3], 0.0), ([3, 0, 2], 0.0), ([3, 2], 1.0), ([3, 2], -0.1)])
def test_bad_model_config(layers, dropout):
    with pytest.raises(mgpu.ConfigError):
        mgpu.MLP(layers, dropout=dropout)


def test_cuda_without_backend_is_a_clear_error():
    if "cuda" in mgpu.build_info()["backends"]:
        pytest.skip("this build has a CUDA backend; tests/gpu covers it")
    with pytest.raises(mgpu.DeviceError, match="no CUDA backend"):
        mgpu.MLP([2, 2], device="cuda")
