"""Whole training on the CUDA backend: the same seed and data give the CPU
backend's parameters (fp32, TF32 off) after 20 SGD-momentum and 20 AdamW
steps, with dropout and gradient accumulation; bf16 and fp16 (dynamic loss
scaling) train digits; 1000 steps allocate no device memory; a step replayed
from a CUDA graph gives the bits of the uncaptured step (and so does the CPU's
reference capture, tested everywhere)."""

import gc
import math

import numpy as np
import pytest

from mgpu import _core
from mgpu.train.data import load_dataset
from reference import rel_err

EMULATED = _core.build_info().get("gpu_emulation", False)  # the CPU emulation runs ~1000x slower


def make(device, sizes, dropout=0.0, seed=3, precision="fp32", optimizer="sgd", loss="mse", **step_opts):
    be = _core.make_backend(device, 0, 1)
    be.precision = precision
    model = _core.MLP(be, sizes, dropout, seed)
    opt = (
        _core.Optimizer(model, "sgd", momentum=0.9, weight_decay=0.01)
        if optimizer == "sgd"
        else _core.Optimizer(model, "adamw", weight_decay=0.01)
    )
    step = _core.DataParallelStep(
        model, opt, _core.LocalCommunicator(), loss, _core.StepOptions(bucket_elems=500, **step_opts)
    )
    return model, step


def batches(sizes, loss, steps, batch, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = rng.standard_normal((batch, sizes[0])).astype(np.float32)
        y = (
            rng.standard_normal((batch, sizes[-1])).astype(np.float32)
            if loss == "mse"
            else rng.integers(0, sizes[-1], batch)
        )
        yield x, y


@pytest.mark.parametrize("optimizer, lr", [("sgd", 0.05), ("adamw", 0.003)])
@pytest.mark.parametrize(
    "loss, dropout, micro", [("mse", 0.0, 1), ("cross_entropy", 0.2, 1), ("cross_entropy", 0.0, 3)]
)
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
    model, step = make(
        "cuda", [64, 128, 10], precision=precision, optimizer="adamw", loss="cross_entropy", seed=0, **step_opts
    )
    rng = np.random.default_rng(0)
    t, applied = 0, []
    for _ in range(epochs):
        order = rng.permutation(len(data.x_train))
        for i in range(0, len(order) - 63, 64):
            idx = order[i : i + 64]
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
    accuracy, applied, step = digits_accuracy(
        "fp16", loss_scale=2.0**24, dynamic_loss_scale=True, loss_scale_window=100
    )
    assert not applied[0], "the first step at scale 2^24 should overflow and be skipped"
    assert sum(applied) > 0.9 * len(applied)
    assert step.loss_scale < 2.0**24
    assert accuracy >= 0.93, accuracy


def fp16_trainer(**kwargs):
    from mgpu import MLP, Trainer

    model = MLP([10, 32, 1], seed=0, device="cuda", precision="fp16")
    return Trainer(model, lr=1e-5, **kwargs)


def test_fp16_overflows_while_the_scale_comes_down_are_not_bad_steps(gpu, capfd):
    # Targets near 1000: at the starting scale 2^16 the gradients overflow fp16 for the
    # first steps. Dynamic loss scaling skips them and halves the scale; they used to
    # count as non-finite steps, and the default 3 of them stopped the run.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 10)).astype(np.float32)
    y = (1000 + rng.standard_normal((64, 1))).astype(np.float32)
    trainer = fp16_trainer()
    assert trainer.dynamic_loss_scale and trainer.max_bad_steps == 3
    applied = []
    for _ in range(20):
        trainer.step(x, y)
        applied.append(trainer.last_result.applied)
    assert applied[:3] == [False] * 3 and all(applied[-5:]), applied
    assert trainer.bad_steps == 0 and trainer.last_result.loss_scale < 2.0**16
    err = capfd.readouterr().err
    assert err.count("scaled gradients overflowed at loss scale 65536") == 1 and "non-finite" not in err
    # a non-finite loss is a bad step whatever the scale
    trainer.step(x, np.full_like(y, np.inf))
    assert not math.isfinite(trainer.last_result.loss) and trainer.bad_steps == 1


def test_fp16_training_refuses_inputs_beyond_fp16s_range(gpu, tmp_path):
    # cast to fp16 they become inf: every step's gradients NaN, which no loss scale helps
    import subprocess
    import sys

    from conftest import mpi_env  # tests/conftest.py

    data = tmp_path / "big.npz"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 10)).astype(np.float32)
    x[7, 3] = 1e6
    np.savez(data, x=x, y=rng.standard_normal((256, 1)).astype(np.float32))
    args = [
        sys.executable,
        "-m",
        "mgpu",
        "train",
        "--device",
        "cuda",
        "--dataset",
        str(data),
        "--layers",
        "10,8,1",
        "--batch-size",
        "32",
        "--steps",
        "2",
        "--no-progress",
    ]
    r = subprocess.run([*args, "--precision", "fp16"], capture_output=True, text=True, timeout=300, env=mpi_env())
    assert r.returncode == 2 and "the inputs reach 1e+06, beyond fp16's largest value 65504" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = subprocess.run([*args, "--precision", "bf16"], capture_output=True, text=True, timeout=300, env=mpi_env())
    assert r.returncode == 0, r.stderr  # bf16 holds them


def test_resuming_keeps_the_loss_scale_only_between_dynamically_scaled_runs(gpu, tmp_path):
    from mgpu import MLP, Trainer
    from mgpu.train.checkpoint import save_checkpoint

    compat = {"layers": [10, 32, 1]}
    fp32 = Trainer(MLP([10, 32, 1], seed=0), lr=1e-3)
    arrays, meta = fp32.state(compat)
    assert meta["state"]["loss_scale"] == 1.0 and meta["state"]["dynamic_loss_scale"] is False
    path = save_checkpoint(str(tmp_path), 0, arrays, meta, 2)
    fp16 = fp16_trainer()
    fp16.load_checkpoint(path, compat)
    assert fp16._step.loss_scale == 2.0**16  # not fp32's 1.0: fp16 gradients would underflow
    # a dynamically scaled checkpoint continues at its scale (older ones, without the flag, too)
    for flag in (True, None):
        fp16._step.loss_scale = 512.0
        arrays, meta = fp16.state(compat)
        if flag is None:
            del meta["state"]["dynamic_loss_scale"]
        path = save_checkpoint(str(tmp_path), 1, arrays, meta, 2)
        again = fp16_trainer()
        again.load_checkpoint(path, compat)
        assert again._step.loss_scale == 512.0
        fp32.load_checkpoint(path, compat)
        assert fp32._step.loss_scale == 1.0  # an fp32 run keeps its own


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
    gc.collect()  # earlier tests' backends go now, not while this one runs
    free_before, _ = _core.cuda_memory_info(gpu)
    allocations_before = _core.emulation.counters()["allocations"] if EMULATED else 0
    run(10, 40 if EMULATED else 1000)
    model.backend.synchronize()
    free_after, _ = _core.cuda_memory_info(gpu)
    # The device's free memory (all processes'): it may grow as a pool hands memory back, never shrink.
    assert free_after >= free_before, f"{(free_before - free_after) / 2**20:.1f} MiB less free"
    if EMULATED:  # stronger there: not one allocation, even one freed again
        assert _core.emulation.counters()["allocations"] == allocations_before


def run_steps(step, sizes, loss, shapes, lr=1e-3, seed=0):
    """One step per entry of shapes (each a list of micro-batch row counts); the losses."""
    rng = np.random.default_rng(seed)
    losses = []
    for t, micro in enumerate(shapes):
        batch = sum(micro)
        x, y = next(batches(sizes, loss, 1, batch, seed=int(rng.integers(1 << 30))))
        cut = np.concatenate([[0], np.cumsum(micro)])
        r = step.step([(x[a:b], y[a:b], int(a)) for a, b in zip(cut[:-1], cut[1:])], batch, t, lr)
        assert r.applied
        losses.append(r.loss)
    return losses


@pytest.fixture(params=["cpu", "cuda"])
def capture_device(request):
    """The CUDA graphs, and their CPU reference (recorded calls) that runs everywhere."""
    if request.param == "cuda":
        request.getfixturevalue("gpu")
    return request.param


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("micro", [[64], [20, 44]])
def test_graph_step_equals_uncaptured_step(capture_device, precision, micro):
    # Same kernels in the same order, dropout keyed by the step from device memory: same bits.
    if capture_device == "cpu" and precision != "fp32":
        pytest.skip("the CPU backend computes in fp32 only")
    sizes = [32, 256, 128, 64, 10]  # the medium preset's hidden layers
    out = {}
    for graph in ("off", "on"):
        model, step = make(
            capture_device,
            sizes,
            dropout=0.2,
            precision=precision,
            optimizer="adamw",
            loss="cross_entropy",
            graph=graph,
        )
        assert step.uses_graphs == (graph == "on")
        losses = run_steps(step, sizes, "cross_entropy", [micro] * 12)
        out[graph] = (model.get_parameters(), losses, step.graph_replays, step.graph_fallback)
    params_off, losses_off, _, _ = out["off"]
    params_on, losses_on, replays, fallback = out["on"]
    assert fallback == ""
    assert replays == 11 * len(micro)  # every step but the first (uncaptured) replays each micro-batch
    assert losses_on == losses_off
    assert np.array_equal(params_on, params_off)


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_one_graph_serves_every_micro_batch_step_and_loss_scale(capture_device, loss):
    # The step, the rows' first sample (dropout masks) and grad_scale (loss scale /
    # global batch) are the replay's arguments, read from device memory: 20
    # micro-batches of a step and a loss scale that doubles every other step still
    # replay the two graphs of the shape (first micro-batch, and those adding to
    # it). Before, each (first sample, loss scale) was a graph of its own, and
    # more than 16 of them were released and recaptured over and over.
    sizes = [16, 64, 48, 4]
    micro, steps = [4] * 20, 6
    out = {}
    for graph in ("off", "on"):
        model, step = make(
            capture_device,
            sizes,
            dropout=0.2,
            optimizer="sgd",
            loss=loss,
            graph=graph,
            loss_scale=8.0,
            dynamic_loss_scale=True,
            loss_scale_window=2,
        )
        losses = run_steps(step, sizes, loss, [micro] * steps, lr=0.01)
        out[graph] = (model.get_parameters(), losses, step.graph_replays, step.loss_scale)
    params_off, losses_off, _, scale_off = out["off"]
    params_on, losses_on, replays, scale_on = out["on"]
    assert scale_on == scale_off == 8.0 * 2 ** (steps // 2)  # the scale changed under the graphs
    # One rank: the last micro-batch's graph also holds the step's tail (verdict and
    # update), a key of its own. Step 0: the first (4, fresh), (4, adding) and
    # (4, adding, tail) are uncaptured, the second (4, adding) is captured and replayed;
    # step 1 captures (4, fresh) and (4, adding, tail). Everything else replays.
    assert replays == steps * len(micro) - 3, replays
    assert losses_on == losses_off
    assert np.array_equal(params_on, params_off)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("micro", [[32], [12, 20]])
def test_a_whole_step_graph_skips_clips_and_scales_like_the_uncaptured_step(capture_device, optimizer, micro):
    """One rank, nothing to reduce: a step is one replay (with accumulation, the last
    micro-batch's) that holds the health check, the verdict and the update, with
    their per-step values (learning rate, first step, AdamW's bias corrections, loss
    scale) read from device memory. Clipping active, a dynamic loss scale, a learning
    rate that changes every step and two non-finite steps that the verdict skips on
    the device: the same results, step count, parameters and optimizer state, bit
    for bit, as the uncaptured step."""
    sizes = [16, 64, 48, 4]
    batch, bad = sum(micro), {1: np.nan, 6: np.inf}  # step 1: before the graph is captured
    out = {}
    for graph in ("off", "on"):
        be = _core.make_backend(capture_device, 0, 1)
        model = _core.MLP(be, sizes, 0.1, 3)
        opt = (
            _core.Optimizer(model, "sgd", momentum=0.9, weight_decay=0.01)
            if optimizer == "sgd"
            else _core.Optimizer(model, "adamw", weight_decay=0.01)
        )
        step = _core.DataParallelStep(
            model,
            opt,
            _core.LocalCommunicator(),
            "mse",
            _core.StepOptions(
                graph=graph, max_grad_norm=0.5, loss_scale=64.0, dynamic_loss_scale=True, loss_scale_window=2
            ),
        )
        results = []
        for t, (x, y) in enumerate(batches(sizes, "mse", 12, batch, seed=4)):
            if t in bad:
                x = x.copy()
                x[3, 2] = bad[t]
            cut = np.concatenate([[0], np.cumsum(micro)])
            r = step.step([(x[a:b], y[a:b], int(a)) for a, b in zip(cut[:-1], cut[1:])], batch, t, 0.05 / (1 + t))
            results.append((r.loss, r.applied, r.grad_norm, r.loss_scale))
        state = [opt.get_state(k, model.num_params) for k in opt.state_names()]
        out[graph] = (model.get_parameters(), results, opt.steps_taken, state, step.graph_replays)
    (p_off, r_off, n_off, s_off, _), (p_on, r_on, n_on, s_on, replays) = out["off"], out["on"]
    assert [r[1] for r in r_on] == [t not in bad for t in range(12)]
    assert any(r[2] > 0.5 for r in r_on if r[1]), "clipping was active"
    assert len({r[3] for r in r_on}) > 2, "the loss scale moved under the graph"
    assert replays >= 9 * len(micro)
    assert r_on == r_off or np.array_equal(np.array(r_on, float), np.array(r_off, float), equal_nan=True)
    assert n_on == n_off == 10
    assert np.array_equal(p_on, p_off)
    for a, b in zip(s_on, s_off):
        assert np.array_equal(a, b)


def test_graphs_follow_changing_shapes_and_growing_buffers(capture_device):
    # A larger batch regrows the activations (every graph is released and
    # recaptured); a ragged last batch is a shape of its own.
    sizes = [16, 64, 64, 4]
    shapes = [[32]] * 4 + [[96]] * 3 + [[32]] * 3 + [[7]] * 3 + [[32]] * 2
    out = {}
    for graph in ("off", "on"):
        model, step = make(capture_device, sizes, dropout=0.1, optimizer="sgd", loss="mse", graph=graph)
        losses = run_steps(step, sizes, "mse", shapes, lr=0.01)
        out[graph] = (model.get_parameters(), losses, step.graph_replays)
    assert out["on"][1] == out["off"][1]
    assert np.array_equal(out["on"][0], out["off"][0])
    assert out["on"][2] >= 6, out["on"][2]


def test_auto_graphs_only_for_small_models_on_gpus(gpu):
    _, cpu_step = make("cpu", [32, 256, 128, 64, 10], graph="auto")
    assert not cpu_step.uses_graphs  # recorded calls gain nothing on a CPU
    _, small = make("cuda", [32, 256, 128, 64, 10], graph="auto")
    assert small.uses_graphs
    be = _core.make_backend("cuda", gpu, 1)
    big = _core.MLP(be, [4096, 4096, 1024], 0.0, 0)  # 21M parameters: GEMM-bound, no graphs
    step = _core.DataParallelStep(
        big, _core.Optimizer(big, "sgd"), _core.LocalCommunicator(), "mse", _core.StepOptions(graph="auto")
    )
    assert not step.uses_graphs


def test_the_selector_prices_graphs_where_the_training_step_captures(gpu):
    from mgpu.selector import profiles as perf
    from mgpu.selector import workload

    be = _core.make_backend("cuda", gpu, 1)
    profile = perf.named_profile("h100-sxm-8")
    for sizes in ([4095, 4096], [4096, 4096]):  # 2^24 parameters exactly, and 4096 more
        model = _core.MLP(be, sizes, 0.0, 0)
        for mode in ("auto", "on", "off"):
            step = _core.DataParallelStep(
                model, _core.Optimizer(model, "sgd"), _core.LocalCommunicator(), "mse", _core.StepOptions(graph=mode)
            )
            w = workload.build_workload(None, sizes, None, 64, "fp32", "sgd", 4.0, cuda_graph=mode)
            assert perf.P.predict(w, perf.to_core(profile), 1, perf.P.Options()).graphs == step.uses_graphs, (
                sizes,
                mode,
            )
            del step
        del model


def test_precision_change_recaptures_after_an_uncaptured_run(gpu):
    # A shape first seen in fp32 must run uncaptured again after a switch to
    # bf16 (which needs half-precision scratch that a capture may not allocate).
    sizes = [16, 64, 4]
    out = {}
    for graph in ("off", "on"):
        model, step = make("cuda", sizes, optimizer="sgd", loss="mse", graph=graph)
        losses = run_steps(step, sizes, "mse", [[32]], lr=0.01)  # seen once, not captured yet
        model.backend.precision = "bf16"
        losses += run_steps(step, sizes, "mse", [[32]] * 3, lr=0.01, seed=1)
        out[graph] = (model.get_parameters(), losses, step.graph_fallback)
    assert out["on"][2] == ""
    assert out["on"][1] == out["off"][1]
    assert np.array_equal(out["on"][0], out["off"][0])


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_unscale_and_clip_fused_into_the_update_equal_a_scale_pass_then_the_update(request, device, optimizer):
    """Loss scale and clipping both active: each step's parameters and optimizer
    state are, bit for bit, the backend's scale pass over the reduced gradients
    followed by the update (the step before the two were fused). The step leaves
    the gradient buffer as reduced (loss-scaled, unclipped): that is what gets scaled."""
    if device == "cuda":
        request.getfixturevalue("gpu")
    sizes = [10, 32, 3]
    be = _core.make_backend(device, 0, 1)
    model = _core.MLP(be, sizes, 0.0, 3)
    opt = (
        _core.Optimizer(model, "sgd", momentum=0.9, weight_decay=0.01)
        if optimizer == "sgd"
        else _core.Optimizer(model, "adamw", weight_decay=0.01)
    )
    step = _core.DataParallelStep(
        model,
        opt,
        _core.LocalCommunicator(),
        "mse",
        _core.StepOptions(bucket_elems=500, max_grad_norm=0.05, loss_scale=1000.0),
    )
    names = opt.state_names()
    for t, (x, y) in enumerate(batches(sizes, "mse", 3, 16)):
        params = model.get_parameters()
        state = {k: opt.get_state(k, model.num_params) for k in names}
        r = step.step([(x, y, 0)], 16, t, 0.1)
        assert r.applied and r.grad_norm > 0.05, "clipping is active"
        # the step's own arithmetic: double, with max_grad_norm the float32 it stores
        factor = np.float32(1.0 / 1000.0 * (float(np.float32(0.05)) / (r.grad_norm + 1e-6)))
        scaled = _core.backend_ops.scale(be, model.get_gradients(), factor)
        if optimizer == "sgd":
            buf = state["momentum_buffer"]
            want = _core.backend_ops.sgd_update(
                be, params, scaled, buf, lr=0.1, momentum=0.9, weight_decay=0.01, first_step=t == 0
            )
        else:
            want = _core.backend_ops.adamw_update(
                be,
                params,
                scaled,
                state["exp_avg"],
                state["exp_avg_sq"],
                lr=0.1,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.01,
                step=t + 1,
            )
        assert np.array_equal(model.get_parameters(), want[0]), f"step {t}"
        for k, w in zip(names, want[1:]):
            assert np.array_equal(opt.get_state(k, model.num_params), w), (t, k)


def test_clipping_and_loss_scaling_launch_no_kernel_of_their_own(gpu):
    """Unscale and clip ride in the optimizer's kernel: a step with both active
    executes as many kernels as one with neither (the emulation counts them)."""
    if not EMULATED:
        pytest.skip("kernel counters exist only on the GPU emulation")
    sizes = [10, 32, 3]
    data = list(batches(sizes, "mse", 3, 16))
    per_step = {}
    for name, opts in (
        ("plain", {}),
        ("clip", dict(max_grad_norm=0.05)),
        ("scale", dict(loss_scale=1000.0)),
        ("both", dict(max_grad_norm=0.05, loss_scale=1000.0)),
    ):
        model, step = make("cuda", sizes, optimizer="adamw", graph="off", **opts)
        x, y = data[0]
        step.step([(x, y, 0)], 16, 0, 0.1)  # warm-up
        model.backend.synchronize()
        before = _core.emulation.counters()["kernels_executed"]
        for t, (x, y) in enumerate(data[1:], 1):
            r = step.step([(x, y, 0)], 16, t, 0.1)
            assert r.applied and (r.grad_norm > 0.05 or "max_grad_norm" not in opts)
        model.backend.synchronize()
        per_step[name] = (_core.emulation.counters()["kernels_executed"] - before) / (len(data) - 1)
    assert per_step["plain"] > 0
    assert per_step["clip"] == per_step["scale"] == per_step["both"] == per_step["plain"], per_step


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_persistent_half_weights_equal_a_cast_at_every_use(gpu, precision):
    # The optimizer writes the GEMMs' half copy of each parameter as it updates
    # it; nothing else casts the weights. A run whose copy is made stale after
    # every step (set_parameters with the same values: recast from fp32) must
    # give the same bits, and new values must reach the very next forward.
    sizes = [24, 64, 48, 6]
    data = list(batches(sizes, "mse", 8, 32, seed=5))
    runs = []
    for restale in (False, True):
        model, step = make("cuda", sizes, dropout=0.1, precision=precision, optimizer="adamw", graph="on")
        losses = []
        for t, (x, y) in enumerate(data):
            losses.append(step.step([(x, y, 0)], 32, t, 1e-3).loss)
            if restale:
                model.set_parameters(model.get_parameters())
        runs.append((model.get_parameters(), losses))
    assert runs[0][1] == runs[1][1]
    assert np.array_equal(runs[0][0], runs[1][0])
    # New parameters: the next step's loss is that of a fresh model holding them.
    model, step = make("cuda", sizes, precision=precision, optimizer="sgd", graph="on")
    for t, (x, y) in enumerate(data[:3]):
        step.step([(x, y, 0)], 32, t, 1e-2)
    other = np.random.default_rng(9).standard_normal(model.num_params).astype(np.float32) * 0.1
    model.set_parameters(other)
    x, y = data[3]
    loss = step.step([(x, y, 0)], 32, 3, 1e-2).loss
    fresh, fresh_step = make("cuda", sizes, precision=precision, optimizer="sgd")
    fresh.set_parameters(other)
    assert loss == fresh_step.step([(x, y, 0)], 32, 0, 1e-2).loss


@pytest.mark.parametrize(
    "precision, graph, micro",
    [("bf16", "off", [32]), ("bf16", "on", [12, 20]), ("fp16", "off", [12, 20]), ("fp16", "on", [32])],
)
def test_half_operands_equal_a_cast_at_every_use(gpu, monkeypatch, precision, graph, micro):
    # The ReLU kernels write the half copy of each activation and gradient they
    # produce, the input and loss gradient are cast once; each is read by every
    # GEMM until its fp32 values change. With dropout, accumulation (the input
    # restaged between micro-batches) and graphs, the run equals bit for bit the
    # one casting every operand at every use (MGPU_CUDA_HALF_OPERANDS=0).
    sizes = [24, 64, 48, 6]
    data = list(batches(sizes, "mse", 6, sum(micro), seed=8))
    runs = []
    for reuse in ("1", "0"):
        monkeypatch.setenv("MGPU_CUDA_HALF_OPERANDS", reuse)
        model, step = make("cuda", sizes, dropout=0.2, precision=precision, optimizer="adamw", graph=graph)
        cut = np.concatenate([[0], np.cumsum(micro)])
        kernels = _core.emulation.counters()["kernels_executed"] if EMULATED else 0
        losses = [
            step.step([(x[a:b], y[a:b], int(a)) for a, b in zip(cut[:-1], cut[1:])], sum(micro), t, 1e-3).loss
            for t, (x, y) in enumerate(data)
        ]
        kernels = _core.emulation.counters()["kernels_executed"] - kernels if EMULATED else 0
        # a forward outside the step (evaluation) reads copies made by the step's graph or kernels
        runs.append((model.get_parameters(), losses, model.forward(data[0][0]), kernels))
    if EMULATED:  # 3 layers: 2 casts a micro-batch instead of 9
        assert runs[1][3] - runs[0][3] == 7 * len(micro) * len(data), (runs[0][3], runs[1][3])
    assert runs[0][1] == runs[1][1]
    assert np.array_equal(runs[0][0], runs[1][0])
    assert np.array_equal(runs[0][2], runs[1][2])


def test_a_failed_capture_falls_back_to_the_uncaptured_step_exactly(gpu):
    # Under --cuda-graph auto a capture that fails (here: a launch inside it,
    # injected on the emulation) is given up and the micro-batch runs uncaptured.
    # What the failed capture recorded never ran, so nothing it marked current may
    # be used: the input's half copy above all (it would hold the previous
    # micro-batch's values). bf16, two micro-batches: the run equals graph off.
    if not EMULATED:
        pytest.skip("injects a launch failure on the GPU emulation")
    sizes = [24, 64, 48, 6]
    data = list(batches(sizes, "mse", 4, 32, seed=3))
    runs = []
    for graph in ("auto", "off"):
        model, step = make("cuda", sizes, precision="bf16", optimizer="adamw", graph=graph)
        # 2 ReLU backward launches a micro-batch; step 0 runs both shapes uncaptured
        # (launches 1-4), step 1 captures the first: its 1st ReLU backward fails.
        _core.emulation.inject_launch_failure("relu_dropout_backward", device=0, nth=5 if graph == "auto" else 0)
        try:
            losses = [
                step.step([(x[:12], y[:12], 0), (x[12:], y[12:], 12)], 32, t, 1e-3).loss
                for t, (x, y) in enumerate(data)
            ]
        finally:
            _core.emulation.inject_launch_failure("", nth=0)
        runs.append((model.get_parameters(), losses, step.uses_graphs, step.graph_fallback))
    (p_auto, l_auto, graphs_after, fallback), (p_off, l_off, _, _) = runs
    assert not graphs_after and "injected" in fallback, fallback
    assert l_auto == l_off
    assert np.array_equal(p_auto, p_off)


def test_half_operands_save_the_weight_and_activation_casts(gpu):
    # On the emulation's counters: a bf16 step casts the input and the loss
    # gradient once each, nothing else (casting the weights at every use would
    # add one per layer in forward and one per layer passing a gradient on; the
    # activations and their gradients, one per layer each way: the ReLU kernels
    # write their half copies), as the cost sheet (bench --explain) counts.
    if not EMULATED:
        pytest.skip("counts kernels on the GPU emulation")
    sizes = [24, 64, 48, 6]
    model, step = make("cuda", sizes, precision="bf16", optimizer="sgd")
    x, y = next(batches(sizes, "mse", 1, 32))
    for t in range(2):
        step.step([(x, y, 0)], 32, t, 1e-2)
    model.backend.synchronize()
    before = _core.emulation.counters()["kernels_executed"]
    step.step([(x, y, 0)], 32, 2, 1e-2)
    model.backend.synchronize()
    per_step = _core.emulation.counters()["kernels_executed"] - before
    from mgpu.selector import costsheet

    sheet = costsheet.counts(
        costsheet.step_ops(
            costsheet.Workload(sizes=sizes, batch=32, precision="bf16", momentum=False, data_on_device=False)
        )
    )
    assert per_step == sheet["kernels_executed"]
    layers = len(sizes) - 1
    casts = 2  # the input (forward; backward reads the same copy) and the loss gradient (backward)
    assert layers > 2
    assert (
        per_step
        == costsheet.counts(costsheet.step_ops(costsheet.Workload(sizes=sizes, batch=32, data_on_device=False)))[
            "kernels_executed"
        ]
        + casts
    )


def test_a_second_model_on_one_backend_leaves_the_first_ones_graphs_its_own(gpu):
    # The half copy of the weights follows the newest model's parameters (a review feared
    # the first model's replays would read the second's): the first model's steps stay
    # bit for bit those of a backend of its own.
    sizes = [24, 64, 48, 6]
    data = list(batches(sizes, "mse", 6, 32, seed=7))

    def first_model(be):
        be.precision = "bf16"
        model = _core.MLP(be, sizes, 0.0, 3)
        opt = _core.Optimizer(model, "sgd", momentum=0.9, weight_decay=0.01)
        step = _core.DataParallelStep(
            model, opt, _core.LocalCommunicator(), "mse", _core.StepOptions(bucket_elems=500, graph="on")
        )
        return model, step

    runs = []
    for second in (False, True):
        be = _core.make_backend("cuda", gpu, 1)
        model, step = first_model(be)
        losses = [step.step([(x, y, 0)], 32, t, 1e-2).loss for t, (x, y) in enumerate(data[:3])]
        if second:
            other = _core.MLP(be, sizes, 0.0, 99)  # the same size: the half copy is kept, its contents not
            other.forward(data[0][0])
        losses += [step.step([(x, y, 0)], 32, t + 3, 1e-2).loss for t, (x, y) in enumerate(data[3:])]
        runs.append((losses, model.get_parameters()))
    assert runs[0][0] == runs[1][0] and np.array_equal(runs[0][1], runs[1][1])
