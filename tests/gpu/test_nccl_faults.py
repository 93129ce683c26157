"""Faults during NCCL collectives (2 ranks, one GPU each): a frozen rank
(SIGSTOP) is named by the other rank's watchdog within --watchdog-timeout, a
killed rank (SIGKILL) ends the job; every checkpoint left behind verifies. On
the GPU emulation the collectives are the NCCL stand-in's, which an abort ends
like ncclCommAbort ends NCCL's kernels."""
import os
import re
import signal
import time

import pytest

from mgpu import _core
from mgpu.checkpoint import list_checkpoints, load_checkpoint
from test_faults import MGPU, Job, first_checkpoint, freeze_a_rank  # tests/test_faults.py: the fault harness

RUN = ["train", "--device", "cuda", "--comm", "nccl", "--layers", "20,64,64,3", "--batch-size", "64",
       "--optimizer", "adamw", "--no-progress", "--seed", "5"]


@pytest.fixture
def two_gpus(gpu):
    if _core.cuda_device_count() < 2 or not hasattr(_core, "NcclCommunicator"):
        pytest.skip("needs 2 GPUs and NCCL (MGPU_EMULATE_GPU=2 on the emulation)")


@pytest.mark.parametrize("frozen", [0, 1])
def test_frozen_rank_in_an_nccl_collective_is_named(two_gpus, tmp_path, frozen):
    timeout = 3
    job, rc, elapsed, ckpt = freeze_a_rank(RUN, tmp_path, frozen, timeout)
    assert rc != 0 and elapsed < timeout + 30, (rc, elapsed, job.stderr[-2000:])
    survivor = 1 - frozen
    named = re.search(rf"[^\n]*on rank {survivor} \(GPU \d\): [^\n]*rank {frozen}[^\n]*", job.stderr)
    assert named, job.stderr[-3000:]
    print(f"SIGSTOP of rank {frozen}: ended in {elapsed:.1f} s: {named.group(0)}")
    assert f"did not complete within {timeout} s" in job.stderr, job.stderr[-3000:]
    assert "Traceback" not in job.stderr
    for path in list_checkpoints(str(ckpt)):
        load_checkpoint(path)


def test_killed_rank_ends_an_nccl_job(two_gpus, tmp_path):
    ckpt = tmp_path / "ckpt"
    job = Job(2, [*MGPU, *RUN, "--steps", 10 ** 6, "--checkpoint-dir", ckpt, "--checkpoint-every", 10,
                  "--watchdog-timeout", 5], tmp_path)
    first_checkpoint(ckpt, job)
    os.kill(job.ranks()[1], signal.SIGKILL)
    t0 = time.monotonic()
    rc = job.wait(60)
    assert rc != 0 and time.monotonic() - t0 < 30
    assert re.search(r"rank 1\b", job.stdout + job.stderr), job.stderr[-2000:]
    for path in list_checkpoints(str(ckpt)):
        load_checkpoint(path)
