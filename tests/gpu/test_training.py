"""Whole training on the CUDA backend: the same seed and data give the CPU
backend's parameters (fp32, TF32 off) after 20 SGD-momentum and 20 AdamW
steps, with dropout and gradient accumulation; bf16 and fp16 (dynamic loss
scaling) train digits; 1000 steps allocate no device memory."""
import numpy as np
import pytest

from mgpu import _core
from mgpu.data import load_dataset
from reference import rel_err


def make(device, sizes, dropout=0.0, seed=3, precision="fp32", optimizer="sgd", loss="mse", **step_opts):
    be = _core.make_backend(device, 0, 1)
    be.precision = precision
    model = _core.MLP(be, sizes, dropout, seed)
    opt = (_core.Optimizer(model, "sgd", momentum=0.9, weight_decay=0.01) if optimizer == "sgd"
           else _core.Optimizer(model, "adamw", weight_decay=0.01))
    step = _core.DataParallelStep(model, opt, _core.LocalCommunicator(), loss, bucket_elems=500, **step_opts)
    return model, step


def batches(sizes, loss, steps, batch, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = rng.standard_normal((batch, sizes[0])).astype(np.float32)
        y = (rng.standard_normal((batch, sizes[-1])).astype(np.float32) if loss == "mse"
             else rng.integers(0, sizes[-1], batch))
        yield x, y


@pytest.mark.parametrize("optimizer, lr", [("sgd", 0.05), ("adamw", 0.003)])
@pytest.mark.parametrize("loss, dropout, micro", [("mse", 0.0, 1), ("cross_entropy", 0.2, 1), ("cross_entropy", 0.0, 3)])
def test_cuda_training_matches_cpu(gpu, optimizer, lr, loss, dropout, micro):
    sizes = [20, 64, 48, 5]
    runs = {}
    for device in ("cpu", "cuda"):
        model, step = make(device, sizes, dropout, optimizer=optimizer, loss=loss)
        losses = []
        for t, (x, y) in enumerate(batches(sizes, loss, 20, 60)):
            # micro-batches of one global batch of 60: accumulation on the device too
            cut = np.linspace(0, 60, micro + 1).astype(int)
            shards = [(x[a:b], y[a:b], int(a)) for a, b in zip(cut[:-1], cut[1:])]
            r = step.step(shards, 60, t, lr)
            assert r.applied
            losses.append(r.loss)
        runs[device] = (model.get_parameters(), losses)
    (p_cpu, l_cpu), (p_gpu, l_gpu) = runs["cpu"], runs["cuda"]
    assert rel_err(p_gpu, p_cpu) < 1e-4
    np.testing.assert_allclose(l_gpu, l_cpu, rtol=1e-4)


def test_clipping_and_stop_flag_on_cuda(gpu):
    sizes = [10, 32, 3]
    results = {}
    for device in ("cpu", "cuda"):
        model, step = make(device, sizes, max_grad_norm=0.05)
        x, y = next(batches(sizes, "mse", 1, 16))
        r = step.step([(x, y, 0)], 16, 0, 0.1, request_stop=True)
        assert r.stop_requested and r.applied
        results[device] = (model.get_parameters(), r.grad_norm)
    assert rel_err(results["cuda"][0], results["cpu"][0]) < 1e-5
    assert results["cuda"][1] == pytest.approx(results["cpu"][1], rel=1e-5)


def digits_accuracy(precision, epochs=25, **step_opts):
    data = load_dataset("digits")
    model, step = make("cuda", [64, 128, 10], precision=precision, optimizer="adamw", loss="cross_entropy",
                       seed=0, **step_opts)
    rng = np.random.default_rng(0)
    t, applied = 0, []
    for _ in range(epochs):
        order = rng.permutation(len(data.x_train))
        for i in range(0, len(order) - 63, 64):
            idx = order[i:i + 64]
            r = step.step([(data.x_train[idx], data.y_train[idx], 0)], 64, t, 0.002)
            applied.append(r.applied)
            t += 1
    _, correct = model.evaluate(data.x_val, data.y_val, "cross_entropy")
    return correct / len(data.y_val), applied, step


def test_bf16_trains_digits(gpu):
    accuracy, applied, _ = digits_accuracy("bf16")
    assert all(applied)
    assert accuracy >= 0.95, accuracy


def test_fp16_with_dynamic_loss_scaling_trains_digits(gpu):
    # 2^24 overflows fp16 in the first backward: those steps are skipped and the scale halves.
    accuracy, applied, step = digits_accuracy("fp16", loss_scale=2.0 ** 24, dynamic_loss_scale=True,
                                              loss_scale_window=100)
    assert not applied[0], "the first step at scale 2^24 should overflow and be skipped"
    assert sum(applied) > 0.9 * len(applied)
    assert step.loss_scale < 2.0 ** 24
    assert accuracy >= 0.93, accuracy


def test_no_device_memory_growth_over_1000_steps(gpu):
    sizes = [256, 512, 512, 10]
    model, step = make("cuda", sizes, dropout=0.1, precision="bf16", optimizer="adamw", loss="cross_entropy")
    data = list(batches(sizes, "cross_entropy", 8, 128))

    def run(first, count):
        for t in range(first, first + count):
            x, y = data[t % len(data)]
            step.step([(x[:50], y[:50], 0), (x[50:], y[50:], 50)], 128, t, 1e-3)

    run(0, 10)  # warm-up: activations, half-precision scratch and lazily loaded kernels settle
    model.backend.synchronize()
    free_before, _ = _core.cuda_memory_info(gpu)
    run(10, 1000)
    model.backend.synchronize()
    free_after, _ = _core.cuda_memory_info(gpu)
    assert free_after == free_before, (free_before - free_after) / 2 ** 20
