"""Faults during NCCL collectives (2 ranks, one GPU each): a frozen rank
(SIGSTOP) is named by the other rank's watchdog within --watchdog-timeout, a
killed rank (SIGKILL) ends the job; every checkpoint left behind verifies. On
the GPU emulation the collectives are the NCCL stand-in's, which an abort ends
like ncclCommAbort ends NCCL's kernels; its fault injection (a rank that never
finishes NCCL setup, a kernel launch that fails mid-backward) covers what a
signal cannot time."""

import gc
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import mgpu
from conftest import mpi_env, mpirun  # tests/conftest.py helpers
from mgpu import MLP, DeviceError, Trainer, _core, run_on_gpus
from mgpu.train.checkpoint import list_checkpoints, load_checkpoint
from procs import wait_for  # tests/procs.py
from test_faults import MGPU, Job, first_checkpoint, freeze_a_rank  # tests/test_faults.py: the fault harness

EMULATED = mgpu.gpus_emulated("cuda")


def gpu_named(pattern: str) -> str:
    """An error's regex with its rank's GPU as the errors name it: '(emulated GPU N)' on
    the emulation, never mistakable for a real one."""
    return pattern.replace(r"\(GPU ", r"\(emulated GPU " if EMULATED else r"\(GPU ")


RUN = [
    "train",
    "--device",
    "cuda",
    "--comm",
    "nccl",
    "--layers",
    "20,64,64,3",
    "--batch-size",
    "64",
    "--optimizer",
    "adamw",
    "--no-progress",
    "--seed",
    "5",
]


@pytest.mark.parametrize("frozen", [0, 1])
def test_frozen_rank_in_an_nccl_collective_is_named(two_gpus, tmp_path, frozen):
    timeout = 3
    stderr, elapsed = freeze_a_rank(RUN, tmp_path, frozen, timeout)
    survivor = 1 - frozen
    named = re.search(gpu_named(rf"[^\n]*on rank {survivor} \(GPU \d\): [^\n]*rank {frozen}[^\n]*"), stderr)
    assert named, stderr[-3000:]
    print(f"SIGSTOP of rank {frozen}: ended in {elapsed:.1f} s: {named.group(0)}")
    assert f"did not complete within {timeout} s" in stderr, stderr[-3000:]


def test_killed_rank_ends_an_nccl_job(two_gpus, tmp_path):
    ckpt = tmp_path / "ckpt"
    job = Job(
        2,
        [*MGPU, *RUN, "--steps", 10**6, "--checkpoint-dir", ckpt, "--checkpoint-every", 10, "--watchdog-timeout", 5],
        tmp_path,
    )
    first_checkpoint(ckpt, job)
    os.kill(job.ranks()[1], signal.SIGKILL)
    t0 = time.monotonic()
    rc = job.wait(60)
    assert rc != 0 and time.monotonic() - t0 < 30
    assert re.search(r"rank 1\b", job.stdout + job.stderr), job.stderr[-2000:]
    for path in list_checkpoints(str(ckpt)):
        load_checkpoint(path)


@pytest.fixture
def emulated_faults(two_gpus):
    if not EMULATED:
        pytest.skip("uses the GPU emulation's fault injection (MGPU_EMULATE_GPU=2)")


@pytest.mark.parametrize(
    "fault, said",
    [
        # Rank 1's NCCL setup never completes, or fails: rank 0 must not wait forever.
        ("1:init:hang", r"NCCL setup on rank [01] \(GPU \d\): did not complete within 3 s"),
        ("1:init:error", r"injected failure \(MGPU_EMULATE_NCCL_FAULT\) on rank 1"),
        # Rank 1's 3rd group never completes (every process alive), or fails asynchronously.
        (
            "1:3:hang",
            r"at step \d+ on rank [01] \(GPU \d\): did not complete within 3 s: every rank reached "
            r"this step and is responding, but the collective is stuck",
        ),
        # (reported by the watchdog's async-error query or by the next NCCL call, whichever sees it first)
        ("1:3:error", r"on rank 1 \(GPU \d\): NCCL reported an (asynchronous )?error: .*injected failure"),
    ],
)
def test_an_injected_nccl_fault_ends_the_job_within_the_timeout(emulated_faults, fault, said):
    t0 = time.monotonic()
    r = mpirun(
        2, [*MGPU, *RUN, "--steps", 20, "--watchdog-timeout", 3], timeout=90, env=mpi_env(MGPU_EMULATE_NCCL_FAULT=fault)
    )
    elapsed = time.monotonic() - t0
    assert r.returncode != 0 and elapsed < 60, (r.returncode, elapsed, r.stderr[-2000:])
    assert re.search(gpu_named(said), r.stderr), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    if fault.endswith("error"):  # an error NCCL reported is not a stuck collective
        assert "stuck" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("kind", ["hang", "error"])
def test_an_injected_fault_at_a_reduce_scatter_ends_it_within_the_timeout(emulated_faults, monkeypatch, kind):
    # Threads of one process (ncclCommInitAll): rank 1's first group, its part of
    # a reduce-scatter, never completes or fails. Neither rank waits past its
    # timeout: each gets a CommError naming the collective, the step and itself.
    monkeypatch.setenv("MGPU_EMULATE_NCCL_FAULT", f"1:1:{kind}")
    comms = _core.nccl_init_all([0, 1])

    def run(comm):
        comm.timeout = 2.0
        comm.begin_step(4)
        t0 = time.monotonic()
        try:  # (not pytest.raises: its traceback would keep `comm` alive past the test)
            comm.reduce_scatter_sum(np.ones(12, np.float32), [5, 7])
        except _core.CommError as e:
            return str(e), time.monotonic() - t0
        return "no CommError", 0.0

    with ThreadPoolExecutor(2) as pool:
        said = list(pool.map(run, comms))
    del comms  # destroyed now, not while a later test's collectives run
    gc.collect()
    for rank, (text, elapsed) in enumerate(said):
        assert elapsed < 10, (elapsed, text)
        assert text.startswith(f"reduce-scatter at step 4 on rank {rank} (emulated GPU {rank}): "), text
    if kind == "hang":
        for text, _ in said:
            assert "did not complete within 2 s: every rank reached this step and is responding" in text, text
    else:
        assert re.search(r"NCCL reported an (asynchronous )?error: .*injected failure", said[1][0]), said[1][0]
        assert "did not complete within 2 s" in said[0][0], said[0][0]


@pytest.mark.parametrize("kind", ["hang", "error"])
def test_an_injected_fault_at_a_reduce_scatter_between_processes_ends_it_within_the_timeout(emulated_faults, kind):
    # As between threads, over MPI (mpirun): rank 1's first group, its reduce-scatter, hangs or fails.
    worker = Path(__file__).with_name("nccl_worker.py")
    t0 = time.monotonic()
    r = mpirun(
        2, [sys.executable, worker, "sharded-fault"], timeout=90, env=mpi_env(MGPU_EMULATE_NCCL_FAULT=f"1:1:{kind}")
    )
    elapsed = time.monotonic() - t0
    said = {rank: text for text, rank in re.findall(r"SAID (reduce-scatter at step 7 on rank (\d)[^\n]*)", r.stdout)}
    assert set(said) == {"0", "1"} and elapsed < 60, (elapsed, r.stdout, r.stderr[-2000:])
    if kind == "hang":
        assert all("did not complete within 3 s" in text for text in said.values()), said
    else:
        assert re.search(r"NCCL reported an (asynchronous )?error: .*injected failure", said["1"]), said


@pytest.mark.parametrize(
    "group, said",
    [
        # Rank 1's gather of layer 1 after step 0 (groups: 1 the initial broadcast; a
        # step's 5: its reduce-scatter, the health check's shares, a gather per layer):
        # nothing waits for it on the host until step 1's collectives, whose watchdog
        # names it. The last step's gather of layer 2: the parameters' read names it.
        (5, r"collectives at step 1 on rank {r} \(GPU {r}\): did not complete within 2 s"),
        (21, r"all-gather at step 3 on rank {r} \(GPU {r}\): did not complete within 2 s"),
    ],
)
def test_a_parameter_gather_left_in_flight_that_hangs_is_named_within_the_timeout(
    emulated_faults, monkeypatch, group, said
):
    # A sharded step on NCCL leaves its parameters' gathers in flight for the next forward.
    monkeypatch.setenv("MGPU_EMULATE_NCCL_FAULT", f"1:{group}:hang")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 20)).astype(np.float32)
    y = rng.standard_normal((64, 3)).astype(np.float32)
    errors = {}

    def train(tg):
        model = MLP([20, 64, 64, 3], device="cuda", device_index=tg.rank, seed=1)
        trainer = Trainer(model, process_group=tg, graph="off", shard_optimizer=True, timeout=2)
        rows = slice(32 * tg.rank, 32 * tg.rank + 32)
        t0 = time.monotonic()
        try:
            for _ in range(4):
                trainer.step(x[rows], y[rows], global_batch=64, first_sample=32 * tg.rank)
            model.get_parameters()
        except _core.CommError as e:
            errors[tg.rank] = (str(e), time.monotonic() - t0)

    run_on_gpus(train, gpus=2)
    for rank in (0, 1):
        text, elapsed = errors[rank]
        assert re.search(gpu_named(said.format(r=rank)), text) and elapsed < 10, (text, elapsed)
    errors.clear()
    gc.collect()


def train_two_threads(
    layers, steps, errors_per_thread, before_step=lambda rank, step: None, params=None, **trainer_args
):
    """run_on_gpus on 2 GPUs, each thread training on its half of a 64-row batch
    for `steps` steps; the exceptions of each thread's steps, in order (a thread
    stops at its errors_per_thread-th). params (a dict): per rank, the parameters
    before and after each failed step."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, layers[0])).astype(np.float32)
    y = rng.standard_normal((64, layers[-1])).astype(np.float32)
    errors = {0: [], 1: []}

    def train(tg):
        model = MLP(layers, device="cuda", device_index=tg.rank, seed=1)
        trainer = Trainer(model, process_group=tg, graph="off", **trainer_args)
        rows = slice(32 * tg.rank, 32 * tg.rank + 32)
        for step in range(steps):
            before_step(tg.rank, step)
            before = model.get_parameters() if params is not None else None
            try:
                trainer.step(x[rows], y[rows], global_batch=64, first_sample=32 * tg.rank)
            except Exception as e:  # noqa: BLE001 - recorded and checked by the caller
                errors[tg.rank].append(e)
                if params is not None:
                    params.setdefault(tg.rank, []).append((before, model.get_parameters()))
                if len(errors[tg.rank]) == errors_per_thread:
                    return

    run_on_gpus(train, gpus=2)
    return errors


def test_a_launch_failure_mid_backward_aborts_the_buckets_in_flight(emulated_faults):
    # Thread 1's backward fails after its last layer's buckets were launched.
    # Its step aborts them: its communicator refuses any further step (which
    # would otherwise pair its buckets with thread 0's of another step), the
    # memory they used is free to go, and thread 0, whose collective now never
    # completes, is freed by its watchdog.
    #
    # Backward of layer l: its GEMMs, the ReLU backward of layer l-1, then its
    # buckets launch. Two ReLU backward launches a step: the 4th comes after
    # the last-layer buckets of step 1 (the second; steps count from 0).
    _core.emulation.inject_launch_failure("relu_dropout_backward", device=1, nth=4)
    try:
        errors = train_two_threads([20, 64, 64, 3], 4, 2, bucket_elems=64, timeout=2)
    finally:
        _core.emulation.inject_launch_failure("", nth=0)
    first, then = errors[1][:2]
    assert isinstance(first, DeviceError) and "injected" in str(first), errors
    assert isinstance(then, _core.CommError), errors
    assert re.search(r"aborted \(step 1 failed on this rank: .*injected", str(then)), str(then)
    assert errors[0] and isinstance(errors[0][0], _core.CommError), errors
    assert "did not complete within 2 s" in str(errors[0][0]), errors
    errors.clear()
    gc.collect()
    assert _core.emulation.violations() == []


def test_a_stalled_thread_of_run_on_gpus_is_named_by_the_others_watchdog(two_gpus):
    # Threads of one process watch each other through shared heartbeats (no MPI):
    # thread 1 stops before step 2 for longer than the timeout.
    def stall(rank, step):
        if rank == 1 and step == 2:
            time.sleep(4)

    errors = train_two_threads([20, 16, 3], 3, 1, before_step=stall, timeout=1.5)
    assert errors[0] and isinstance(errors[0][0], _core.CommError), errors
    assert re.search(
        gpu_named(
            r"at step 2 on rank 0 \(GPU \d\): did not complete within 1.5 s: rank 1 has not "
            r"reached this step \(stopped, hung or dead\)"
        ),
        str(errors[0][0]),
    ), errors


def test_a_second_sigint_ends_train_gpus_at_once(two_gpus, tmp_path):
    # `train --gpus 2`: the first SIGINT asks for a stop at the next step, a second one
    # interrupts at once: exit 130 and one line. Its rank threads are still inside the
    # core then; finalizing the interpreter under them ended them mid-call (SIGABRT,
    # "terminate called without an active exception" and a native backtrace).
    out = tmp_path / "out.txt"
    args = [
        "train",
        "--device",
        "cuda",
        "--gpus",
        "2",
        "--layers",
        "64,512,512,10",
        "--batch-size",
        "512",
        "--steps",
        "1000000",
        "--no-progress",
        "--seed",
        "5",
    ]
    for attempt in range(3):  # the first SIGINT's clean stop can, rarely, finish before the second arrives
        with open(out, "w") as f:
            proc = subprocess.Popen(
                [*MGPU, *map(str, args), "--checkpoint-dir", str(tmp_path / f"ck{attempt}")],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=mpi_env(),
                start_new_session=True,
            )
        try:
            wait_for(lambda p=proc: "per rank)" in out.read_text() or p.poll() is not None, 120, "training to start")
            time.sleep(0.5)  # some steps in: the threads are in the core
            proc.send_signal(signal.SIGINT)
            try:  # the stop request's line; a SIGINT before the threads' hooks exist prints none, but counts
                wait_for(
                    lambda p=proc: "stopping at the next step boundary" in out.read_text() or p.poll() is not None,
                    10,
                    "the first SIGINT's stop request",
                    poll=0.002,
                )
            except AssertionError:
                pass
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        text = out.read_text()
        if rc != 0 or "stopped at step" not in text:
            break
    assert rc == 130, text[-3000:]
    assert "mgpu: interrupted" in text.splitlines()[-3:], text[-3000:]  # a rank's epoch line may follow
    assert "terminate called" not in text and "Traceback" not in text, text[-3000:]


def test_a_failed_allreduce_leaves_the_parameters_as_they_were(emulated_faults):
    # NCCL collectives complete on the device, and the step queues its tail
    # (health check, verdict, update) behind them without waiting: when the
    # watchdog aborts a collective that never completed, the compute stream runs
    # on over whatever the gradient buffer holds. The communicator's failure
    # flag, set before the abort, makes the verdict refuse the update: the
    # surviving thread's parameters are those from before the failed step.
    # (Thread 1's 4th ReLU backward launch fails: in step 1, after its last
    # layer's buckets were launched, so thread 0's collective never completes.)
    _core.emulation.inject_launch_failure("relu_dropout_backward", device=1, nth=4)
    params = {}
    try:
        errors = train_two_threads([20, 64, 64, 3], 3, 1, params=params, optimizer="adamw", bucket_elems=64, timeout=2)
    finally:
        _core.emulation.inject_launch_failure("", nth=0)
    (error,), ((before, after),) = errors[0], params[0]
    assert isinstance(error, _core.CommError) and "did not complete within 2 s" in str(error), error
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert isinstance(errors[1][0], DeviceError), errors
    errors.clear()
    gc.collect()
    assert _core.emulation.violations() == []
