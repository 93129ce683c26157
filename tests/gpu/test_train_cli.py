"""`mgpu train --device cuda` end to end under mpirun with 2 ranks, one GPU each,
over NCCL: the run equals a 1-rank run, and a run stopped at a checkpoint and
resumed (--resume) ends bit-identical to the run that never stopped. On the
GPU emulation (MGPU_EMULATE_GPU=2) this is CI's NCCL training run."""
import json
import sys

import numpy as np
import pytest

from mgpu import _core
from conftest import mpi_env, mpirun  # tests/conftest.py helpers

ARGS = ["--device", "cuda", "--dataset", "digits", "--layers", "64,32,10", "--batch-size", "64",
        "--optimizer", "adamw", "--lr", "0.003", "--dropout", "0.1", "--no-progress", "--watchdog-timeout", "60"]


@pytest.fixture
def two_gpus(gpu):
    if _core.cuda_device_count() < 2:
        pytest.skip("needs 2 GPUs (MGPU_EMULATE_GPU=2 on the emulation)")
    if not hasattr(_core, "NcclCommunicator"):
        pytest.skip("mgpu was built without NCCL")


def train(tmp_path, name, ranks, *extra):
    out = tmp_path / f"{name}.json"
    params = tmp_path / f"{name}.npz"
    r = mpirun(ranks, [sys.executable, "-m", "mgpu", "train", *ARGS, "--json", out, "--save", params, *extra],
               timeout=600, env=mpi_env())
    assert r.returncode == 0, r.stdout + r.stderr
    with np.load(params) as z:
        flat = np.concatenate([z[k].ravel() for k in sorted(z.files)])
    return json.loads(out.read_text()), flat


def test_nccl_training_equals_one_rank_and_resumes_bit_identical(two_gpus, tmp_path):
    _, one = train(tmp_path, "one", 1, "--steps", "12")
    result, two = train(tmp_path, "two", 2, "--steps", "12", "--comm", "nccl")
    assert np.allclose(two, one, rtol=1e-4, atol=1e-6), np.max(np.abs(two - one))
    ckpt = tmp_path / "ckpt"
    train(tmp_path, "first", 2, "--steps", "7", "--comm", "nccl", "--checkpoint-dir", ckpt)
    _, resumed = train(tmp_path, "resumed", 2, "--steps", "12", "--comm", "nccl", "--checkpoint-dir", ckpt,
                       "--resume")
    assert np.array_equal(resumed, two)
