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
