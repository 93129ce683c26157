"""Gradient compression (`train --grad-dtype bf16|fp16`): 2 ranks over NCCL
allreduce their gradients in half precision. One SGD step differs from the
fp32 step by the rounding of the gradients only (and does differ); training
follows fp32 training; transports that reduce fp32 only refuse it on every rank."""

import sys

import numpy as np
import pytest

from conftest import mpi_env, mpirun  # tests/conftest.py helpers
from mgpu import MLP

LAYERS = [64, 32, 10]
ARGS = [
    "--dataset",
    "digits",
    "--layers",
    ",".join(map(str, LAYERS)),
    "--batch-size",
    "64",
    "--optimizer",
    "sgd",
    "--momentum",
    "0",
    "--lr",
    "0.1",
    "--seed",
    "3",
    "--no-progress",
]


def train(tmp_path, name, ranks, *extra):
    params = tmp_path / f"{name}.npz"
    r = mpirun(
        ranks, [sys.executable, "-m", "mgpu", "train", *ARGS, "--save", params, *extra], timeout=600, env=mpi_env()
    )
    assert r.returncode == 0, r.stdout + r.stderr
    with np.load(params) as z:
        return r, np.concatenate([z[k].ravel() for k in sorted(z.files)])


# Relative error of a sum of 2 rounded contributions, rounded again: <= 3 units
# of 2^-(mantissa bits + 1), with room for fp16's subnormal gradients.
@pytest.mark.parametrize("dtype, bound", [("bf16", 3 * 2.0**-9), ("fp16", 3 * 2.0**-12)])
def test_one_compressed_step_differs_from_fp32_by_the_rounding_of_the_gradients(two_gpus, tmp_path, dtype, bound):
    model = MLP(LAYERS, seed=3)
    start = np.concatenate([a.ravel() for a in model.get_parameters()])
    _, fp32 = train(tmp_path, "fp32", 2, "--steps", "1", "--comm", "nccl", "--device", "cuda")
    r, half = train(tmp_path, dtype, 2, "--steps", "1", "--comm", "nccl", "--device", "cuda", "--grad-dtype", dtype)
    assert f"of {dtype} gradients" in r.stdout
    update = start - fp32  # lr x the fp32 gradient
    error = np.linalg.norm(half - fp32) / np.linalg.norm(update)
    assert 0 < error <= bound, error  # compressed (not exact), within rounding


def test_compressed_training_follows_fp32_training(two_gpus, tmp_path):
    _, fp32 = train(tmp_path, "fp32", 2, "--steps", "30", "--comm", "nccl", "--device", "cuda")
    _, bf16 = train(tmp_path, "bf16", 2, "--steps", "30", "--comm", "nccl", "--device", "cuda", "--grad-dtype", "bf16")
    assert np.linalg.norm(bf16 - fp32) <= 1e-2 * np.linalg.norm(fp32)


@pytest.mark.parametrize("device, comm", [("cpu", "mpi"), ("cuda", "mpi")])
def test_transports_that_reduce_fp32_only_refuse_compression_on_every_rank(device, comm, request, tmp_path):
    if device == "cuda":
        request.getfixturevalue("gpu")
    r = mpirun(
        2,
        [
            sys.executable,
            "-m",
            "mgpu",
            "train",
            *ARGS,
            "--steps",
            "2",
            "--device",
            device,
            "--comm",
            comm,
            "--grad-dtype",
            "bf16",
        ],
        timeout=300,
        env=mpi_env(),
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("gradient compression (bf16 allreduce) needs NCCL between GPUs") == 2, r.stderr
    assert "Traceback" not in r.stderr
