"""Single-process multi-GPU (`train --gpus N`, mgpu.run_on_gpus): NCCL
communicators from one ncclCommInitAll, one thread per GPU. With one GPU, two
threads share it where NCCL >= 2.30 allows (NCCL_MULTI_RANK_GPU_ENABLE=1),
and must train as one rank with the same global batch does."""

import json

import numpy as np
import pytest

from conftest import mpi_env, run_cli  # tests/conftest.py helpers
from mgpu import _core, gpus_emulated

HAS_NCCL = hasattr(_core, "NcclCommunicator")
NCCL_CODE = _core.build_info()["cuda"].get("nccl_loaded_code", 0)
needs_nccl = pytest.mark.skipif(not HAS_NCCL, reason="mgpu was built without NCCL")


@needs_nccl
def test_init_all_on_one_gpu(gpu):
    comms = _core.nccl_init_all([gpu])
    assert len(comms) == 1
    comm = comms[0]
    assert (comm.rank, comm.size, comm.device) == (0, 1, gpu)
    x = np.arange(257, dtype=np.float32)
    comm.allreduce_sum(x)
    np.testing.assert_array_equal(x, np.arange(257, dtype=np.float32))
    with pytest.raises(_core.DeviceError, match="out of range"):
        _core.nccl_init_all([gpu, 99])


@needs_nccl
@pytest.mark.parametrize("end", ["close", "abort"])
def test_a_closed_or_aborted_communicator_refuses_further_work(gpu, end):
    comm = _core.nccl_init_all([gpu])[0]
    comm.timeout = 10
    x = np.ones(33, dtype=np.float32)
    comm.allreduce_sum(x)
    if end == "close":
        comm.close()
        comm.close()  # idempotent
        said = "was closed"
    else:
        comm.abort("a test ended it")
        said = r"was aborted \(a test ended it\)"
    for call in (lambda: comm.allreduce_sum(x), lambda: comm.broadcast(x, 0), comm.barrier):
        with pytest.raises(_core.CommError, match=said):
            call()
    np.testing.assert_array_equal(x, 1.0)  # untouched after the end


def train(tmp_path, name, extra, env, steps=40):
    out = tmp_path / f"{name}.json"
    r = run_cli(
        [
            "train",
            "--device",
            "cuda",
            "--dataset",
            "digits",
            "--model",
            "medium",
            "--optimizer",
            "adamw",
            "--batch-size",
            "128",
            "--steps",
            steps,
            "--no-progress",
            "--json",
            out,
            *extra,
        ],
        timeout=600,
        env=mpi_env(**env),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


@needs_nccl
def test_two_threads_on_one_gpu_are_refused_clearly_before_nccl_2_30(gpu, tmp_path):
    # NCCL 2.28's ncclCommInitAll rejects a repeated device with a bare "invalid usage".
    if NCCL_CODE >= 23000:
        pytest.skip("NCCL >= 2.30 runs two ranks on one GPU: the next test trains so")
    r = run_cli(
        ["train", "--device", "cuda", "--layers", "8,16,2", "--steps", "2", "--no-progress", "--gpus", "2"],
        timeout=120,
        env=mpi_env(NCCL_MULTI_RANK_GPU_ENABLE="1", CUDA_VISIBLE_DEVICES=str(gpu)),
    )
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "share 1 GPU(s)" in lines[0] and "allows one rank per GPU" in lines[0], lines
    said = "2 threads (on EMULATED GPUs) share" if gpus_emulated("cuda") else "2 threads share"
    assert said in lines[0], lines
    assert "Traceback" not in r.stderr


@needs_nccl
def test_two_threads_on_one_gpu_train_like_one_rank(gpu, tmp_path):
    if NCCL_CODE < 23000:
        pytest.skip(f"NCCL {_core.build_info()['cuda']['nccl_loaded']} < 2.30 cannot put two ranks on one GPU")
    env = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "CUDA_VISIBLE_DEVICES": str(gpu)}
    one = train(tmp_path, "one", [], env)
    two = train(tmp_path, "two", ["--gpus", "2"], env)
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert two["steps"] == one["steps"] == 40
    # Exact averaging and dropout keyed by global sample: the same run up to summation order.
    for key in ("train_loss", "val_loss"):
        np.testing.assert_allclose([e[key] for e in two["history"]], [e[key] for e in one["history"]], rtol=1e-3)


@needs_nccl
def test_two_threads_on_two_gpus_train_like_one_rank(gpu, tmp_path):
    # `train --gpus 2`: two threads of one process, one GPU each, NCCL from ncclCommInitAll.
    if _core.cuda_device_count() < 2:
        pytest.skip("needs 2 GPUs (MGPU_EMULATE_GPU=2 on the emulation)")
    one = train(tmp_path, "one", [], {}, steps=12)
    two = train(tmp_path, "two", ["--gpus", "2"], {}, steps=12)
    assert two["world_size"] == 2 and one["world_size"] == 1 and two["steps"] == one["steps"] == 12
    for key in ("train_loss", "val_loss"):
        np.testing.assert_allclose([e[key] for e in two["history"]], [e[key] for e in one["history"]], rtol=1e-4)


@needs_nccl
@pytest.mark.parametrize("extra", [1, 100])  # refused before a thread starts
def test_more_threads_than_gpus_is_a_clear_error(gpu, extra):
    r = run_cli(
        [
            "train",
            "--device",
            "cuda",
            "--gpus",
            str(_core.cuda_device_count() + extra),
            "--steps",
            "2",
            "--no-progress",
        ],
        timeout=300,
        env=mpi_env(NCCL_MULTI_RANK_GPU_ENABLE="0"),
    )
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "GPU(s) visible" in lines[0], r.stderr


def two_gpu_bf16_setup(rows, seed):
    """Skips without 2 GPUs; (x, y) of `rows` rows for a [12, 32, 3] model, and its maker."""
    if _core.cuda_device_count() < 2:
        pytest.skip("needs 2 GPUs (MGPU_EMULATE_GPU=2 on the emulation)")
    import mgpu

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 12)).astype(np.float32)
    y = rng.standard_normal((rows, 3)).astype(np.float32)
    make = lambda pg: mgpu.MLP(
        [12, 32, 3],
        seed=pg.rank,
        device="cuda",
        device_index=pg.local_rank,  # noqa: E731
        precision="bf16",
    )
    return x, y, make


@needs_nccl
def test_broadcast_weights_reach_the_half_precision_gemms(gpu):
    # Rank 1 starts from other weights; the Trainer broadcasts rank 0's. The
    # communicator writes the parameters behind the backend's back, so the
    # backend's persistent bf16 copy must be recast (parameters_changed), or
    # rank 1's GEMMs keep using its own weights and the run departs from one GPU's.
    import mgpu

    x, y, make = two_gpu_bf16_setup(32, seed=4)

    def run(pg):
        model = make(pg)
        model.forward(x[:2])  # the bf16 copy is now made, from this rank's own weights
        trainer = mgpu.Trainer(model, lr=0.05, process_group=pg, graph="off")
        part = slice(16 * pg.rank, 16 * pg.rank + 16) if pg.size == 2 else slice(0, 32)
        losses = [trainer.step(x[part], y[part], global_batch=32, first_sample=part.start) for _ in range(4)]
        return losses, np.concatenate([a.ravel() for a in model.get_parameters()])

    (two_losses, two_params), _ = mgpu.run_on_gpus(run, gpus=2)
    ((one_losses, one_params),) = mgpu.run_on_gpus(run, gpus=1)
    np.testing.assert_allclose(two_losses, one_losses, rtol=1e-5)
    np.testing.assert_allclose(two_params, one_params, rtol=1e-5, atol=1e-6)


@needs_nccl
def test_a_refused_update_leaves_the_half_weights_current(gpu):
    # Rank 1 holds no rows, so it runs no forward: its first touch of the bf16
    # weight copy after the broadcast is the update, which a non-finite step
    # (rank 0's NaN) refuses on the device and which then writes nothing. The
    # copy must have been made current before it, or rank 1's next forward reads
    # a copy that was never written. Both ranks hold the same parameters: their
    # forwards must agree.
    import mgpu

    x, y, make = two_gpu_bf16_setup(16, seed=6)
    bad = x.copy()
    bad[0, 0] = np.nan

    def run(pg):
        model = make(pg)
        trainer = mgpu.Trainer(model, lr=0.05, process_group=pg, graph="off")
        rows = slice(0, 16) if pg.rank == 0 else slice(0, 0)
        trainer.step(bad[rows], y[rows], global_batch=16, first_sample=0)
        return trainer.last_result.applied, model.forward(x)

    (applied0, out0), (applied1, out1) = mgpu.run_on_gpus(run, gpus=2)
    assert not applied0 and not applied1
    assert np.all(np.isfinite(out1))
    np.testing.assert_array_equal(out1, out0)
