"""The training set resident in the device's memory (--data-on-device): a step gathers
its rows there and trains exactly as one whose rows came from the host, with CUDA
graphs, accumulation, dropout and 2 GPUs; a steady resident step copies nothing to the
device; bad resident data and out-of-range rows fail with one clear error."""

import numpy as np
import pytest

import mgpu
from mgpu import _core
from mgpu.errors import ConfigError
from mgpu.train.data import Dataset
from mgpu.train.trainer import CheckpointPolicy

EMULATED = _core.build_info().get("gpu_emulation", False)


def dataset(classification: bool, n=150, features=10, outputs=3, seed=8) -> Dataset:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = rng.integers(0, outputs, n) if classification else rng.standard_normal((n, outputs)).astype(np.float32)
    cut = n * 4 // 5
    return Dataset("test", x[:cut], y[:cut], x[cut:], y[cut:], num_classes=outputs if classification else None)


def fit(device, data_on_device, data, graph="off", accumulate=1, precision="fp32", pg=None, steps=None):
    model = mgpu.MLP(
        [data.in_features, 32, 16, data.out_features],
        seed=4,
        dropout=0.2,
        device=device,
        device_index=pg.local_rank if pg else 0,
        precision=precision,
    )
    trainer = mgpu.Trainer(
        model,
        loss=data.default_loss,
        optimizer="adamw",
        lr=1e-2,
        graph=graph,
        accumulate=accumulate,
        data_on_device=data_on_device,
        process_group=pg,
    )
    trainer.fit(data, batch_size=32, epochs=None if steps else 2, steps=steps, progress=False)  # a short last batch
    params = np.concatenate([a.ravel() for a in model.get_parameters()])
    return params, trainer


@pytest.mark.parametrize("classification", [False, True])
@pytest.mark.parametrize("graph, accumulate, precision", [("off", 1, "fp32"), ("on", 2, "fp32"), ("on", 1, "bf16")])
def test_a_gpu_trains_from_resident_rows_as_from_the_host(gpu, classification, graph, accumulate, precision):
    data = dataset(classification)
    resident, trainer = fit("cuda", "auto", data, graph, accumulate, precision)
    staged, _ = fit("cuda", "off", data, graph, accumulate, precision)
    assert trainer.data_placement["resident"] and trainer.data_placement["bytes"] > 0
    assert np.array_equal(resident, staged)


@pytest.mark.parametrize("classification", [False, True])
def test_the_cpu_backend_trains_from_resident_rows_as_from_numpy(classification):
    data = dataset(classification)
    resident, trainer = fit("cpu", "on", data, accumulate=2)
    staged, auto = fit("cpu", "auto", data, accumulate=2)
    assert trainer.data_placement["resident"] and not auto.data_placement["resident"]
    assert "CPU backend" in auto.data_placement["why"]
    assert np.array_equal(resident, staged)


def test_two_gpus_train_from_resident_rows_as_from_the_host(gpu):
    if _core.cuda_device_count() < 2:
        pytest.skip("needs 2 GPUs (MGPU_EMULATE_GPU=2 on the emulation)")
    data = dataset(True)
    for mode in ("on", "off"):
        results = mgpu.run_on_gpus(lambda pg, mode=mode: fit("cuda", mode, data, "on", pg=pg)[0], gpus=2)
        assert np.array_equal(results[0], results[1])
        if mode == "on":
            resident = results[0]
    assert np.array_equal(resident, results[0])


def test_a_steady_resident_step_copies_nothing_to_the_device(gpu):
    if not EMULATED:
        pytest.skip("counts the emulation's copies (MGPU_EMULATE_GPU)")
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((256, 10)).astype(np.float32), rng.standard_normal((256, 3)).astype(np.float32)
    for graph in ("off", "on"):
        model = mgpu.MLP([10, 32, 3], seed=1, dropout=0.1, device="cuda")
        trainer = mgpu.Trainer(model, lr=1e-2, graph=graph)
        data = trainer.resident_data(x, y)
        data.set_order(rng.permutation(256))
        counted = []
        for host in (False, True):
            for i in range(6):
                if i == 3:  # warm: shapes seen, graphs captured
                    model._backend.synchronize()
                    before = _core.emulation.counters()["h2d_bytes"]
                if host:
                    trainer.step(x[32 * i : 32 * i + 32], y[32 * i : 32 * i + 32])
                else:
                    trainer.step_rows(data, 32 * i, 32)
            model._backend.synchronize()
            counted.append(_core.emulation.counters()["h2d_bytes"] - before)
        assert counted == [0, 3 * 32 * (10 + 3) * 4], graph  # resident: none; staged: each step's rows


def test_bad_resident_data_and_rows_outside_it_fail_clearly():
    model = mgpu.MLP([4, 8, 3], seed=1)
    trainer = mgpu.Trainer(model, loss="cross_entropy", lr=1e-2)
    x = np.ones((10, 4), np.float32)
    with pytest.raises(ConfigError, match="label 3 at row 9 is out of range"):
        trainer.resident_data(x, np.r_[np.zeros(9, int), 3])
    with pytest.raises(ConfigError, match=r"x must have shape \(rows, 4\)"):
        trainer.resident_data(np.ones((10, 5), np.float32), np.zeros(10, int))
    data = trainer.resident_data(x, np.zeros(10, int))
    with pytest.raises(ConfigError, match="order entry 1 is row 10, outside the 10 resident rows"):
        data.set_order(np.array([0, 10]))
    data.set_order(np.arange(10))
    with pytest.raises(ConfigError, match=r"rows \[8, 12\) are outside the resident order of 10"):
        trainer.step_rows(data, 8, 4)
    other = mgpu.MLP([4, 8, 3], seed=1)
    regression = mgpu.Trainer(other, loss="mse", lr=1e-2)
    with pytest.raises(ConfigError, match="resident data lives in another backend than the model's"):
        regression.step_rows(data, 0, 4)
    labels = _core.ResidentData(other._core, x, np.zeros(10, int), "cross_entropy")
    labels.set_order(np.arange(10))
    with pytest.raises(ConfigError, match="holds class labels, not what the mse loss needs"):
        regression.step_rows(labels, 0, 4)
    with pytest.raises(ConfigError, match="unknown data placement 'gpu'"):
        mgpu.Trainer(model, data_on_device="gpu")


def test_on_refuses_a_training_set_the_gpu_cannot_hold(gpu, monkeypatch):
    from mgpu.train import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "available_memory", lambda *a: 1000.0)  # bytes free
    data = dataset(False)
    with pytest.raises(ConfigError, match="does not fit the GPU's 0.001 MB of free memory"):
        fit("cuda", "on", data, steps=1)
    _, trainer = fit("cuda", "auto", data, steps=1)
    assert not trainer.data_placement["resident"] and "would take more than 50%" in trainer.data_placement["why"]


def steps_with(device, feed, graph="off", accumulate=2, steps=6):
    """Parameters after `steps` steps of 24 rows each, fed by feed(trainer, batches, t)."""
    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((24, 10)).astype(np.float32), rng.integers(0, 3, 24)) for _ in range(steps)]
    model = mgpu.MLP([10, 32, 3], seed=2, dropout=0.3, device=device)
    trainer = mgpu.Trainer(model, loss="cross_entropy", lr=1e-2, graph=graph, accumulate=accumulate)
    for t in range(steps):
        feed(trainer, batches, t)
    return np.concatenate([a.ravel() for a in model.get_parameters()]), model


def from_the_host(trainer, batches, t):
    trainer.step(*batches[t])


def prefetching(trainer, batches, t):
    nxt = batches[t + 1] if t + 1 < len(batches) else None
    if t == 0:
        trainer.step(*batches[t], prefetch=nxt)
    else:
        trainer.step_prefetched(24, prefetch=nxt)


@pytest.mark.parametrize("graph", ["off", "on"])
def test_a_gpu_trains_from_prefetched_rows_as_from_the_host(gpu, graph):
    staged, _ = steps_with("cuda", from_the_host, graph)
    prefetched, _ = steps_with("cuda", prefetching, graph)
    assert np.array_equal(staged, prefetched)


def test_the_cpu_backend_takes_prefetched_rows_as_the_reference():
    staged, _ = steps_with("cpu", from_the_host)
    prefetched, _ = steps_with("cpu", prefetching)
    assert np.array_equal(staged, prefetched)


def test_a_prefetched_step_copied_its_rows_during_the_step_before(gpu):
    if not EMULATED:
        pytest.skip("counts the emulation's copies (MGPU_EMULATE_GPU)")
    seen = []

    def counted(trainer, batches, t):
        trainer.model._backend.synchronize()
        before = _core.emulation.counters()
        prefetching(trainer, batches, t)
        trainer.model._backend.synchronize()
        after = _core.emulation.counters()
        seen.append({k: after[k] - before[k] for k in ("h2d_bytes", "d2d_bytes")})

    steps_with("cuda", counted, steps=4)
    rows = 24 * (10 * 4 + 4)  # x and int32 labels
    assert seen[0]["h2d_bytes"] == 2 * rows  # its own rows, and the next step's
    assert [s["h2d_bytes"] for s in seen[1:]] == [rows, rows, 0]  # the next step's only; the last none
    assert all(s["d2d_bytes"] == rows for s in seen[1:])  # its rows, from the prefetch into the step's buffers


def test_prefetched_rows_serve_the_next_step_only():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 10)).astype(np.float32), rng.standard_normal((8, 3)).astype(np.float32)
    trainer = mgpu.Trainer(mgpu.MLP([10, 16, 3], seed=1), lr=1e-2)
    with pytest.raises(ConfigError, match=r"rows \[0, 8\) were not prefetched \(0 rows are"):
        trainer.step_prefetched(8)
    trainer.step(x, y, prefetch=(x[:4], y[:4]))
    with pytest.raises(ConfigError, match=r"rows \[0, 8\) were not prefetched \(4 rows are"):
        trainer.step_prefetched(8)
    trainer.step(x, y, prefetch=(x, y))
    trainer.step(x, y)  # not taken: gone
    with pytest.raises(ConfigError, match="were not prefetched"):
        trainer.step_prefetched(8)
    with pytest.raises(ConfigError, match=r"prefetch is a tuple \(x, y\)"):
        trainer.step(x, y, prefetch=(x,))


@pytest.mark.parametrize("device, placement", [("cpu", "on"), ("cuda", "on"), ("cuda", "off")])
def test_a_run_resumed_mid_epoch_from_the_device_continues_bit_identical(device, placement, tmp_path, request):
    if device == "cuda":
        request.getfixturevalue("gpu")
    data = dataset(True)  # 120 training rows: 4 steps of 32 an epoch, the last short
    whole, _ = fit(device, placement, data, steps=7)
    model = mgpu.MLP([data.in_features, 32, 16, data.out_features], seed=4, dropout=0.2, device=device)
    settings = dict(loss=data.default_loss, optimizer="adamw", lr=1e-2, graph="off", data_on_device=placement)
    first = mgpu.Trainer(model, **settings)
    first.fit(data, batch_size=32, steps=5, progress=False, checkpoint=CheckpointPolicy(str(tmp_path), every=5))
    resumed_model = mgpu.MLP([data.in_features, 32, 16, data.out_features], seed=4, dropout=0.2, device=device)
    resumed = mgpu.Trainer(resumed_model, **settings)
    resumed.fit(data, batch_size=32, steps=7, progress=False, resume=first.last_checkpoint)
    assert np.array_equal(np.concatenate([a.ravel() for a in resumed_model.get_parameters()]), whole)


def test_a_larger_order_replaces_a_smaller_one():
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((40, 10)).astype(np.float32), rng.standard_normal((40, 3)).astype(np.float32)
    trainer = mgpu.Trainer(mgpu.MLP([10, 16, 3], seed=1), lr=1e-2)
    data = trainer.resident_data(x, y)
    data.set_order(np.arange(4))
    data.set_order(np.arange(40)[::-1].copy())  # a larger order: the buffer grows
    assert data.order_size == 40 and data.rows == 40
    trainer.step_rows(data, 30, 10)
    reference = mgpu.Trainer(mgpu.MLP([10, 16, 3], seed=1), lr=1e-2)
    reference.step(x[9::-1], y[9::-1])
    params = [np.concatenate([a.ravel() for a in t.model.get_parameters()]) for t in (trainer, reference)]
    assert np.array_equal(*params)


def test_train_on_cpus_holds_the_training_set_where_asked_and_says_so(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import mpi_env  # tests/conftest.py

    base = [sys.executable, "-m", "mgpu", "train", "--device", "cpu", "--model", "medium", "--steps", "3"]
    base += ["--batch-size", "32", "--no-progress", "--json"]
    runs = {}
    for mode in ("auto", "on"):
        out = tmp_path / f"{mode}.json"
        r = subprocess.run([*base, str(out), "--data-on-device", mode], capture_output=True, text=True, env=mpi_env())
        assert r.returncode == 0, r.stdout + r.stderr
        runs[mode] = (json.loads(out.read_text()), r.stdout)
    assert not runs["auto"][0]["data_placement"]["resident"] and "training set:" not in runs["auto"][1]
    placement = runs["on"][0]["data_placement"]
    assert placement["resident"] and placement["bytes"] == 8000 * (50 * 4 + 3 * 4 + 8)  # synthetic's training rows
    assert "training set: on the device (--data-on-device on: 1.76 MB in the CPU backend's memory)" in runs["on"][1]
    assert runs["on"][0]["history"][-1]["train_loss"] == runs["auto"][0]["history"][-1]["train_loss"]
