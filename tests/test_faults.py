"""Faults under mpirun, injected for real: signals that stop a run (checkpoint,
then an exact resume), a rank killed (SIGKILL) or frozen (SIGSTOP) mid-run, a
diverging run, a full disk, and bad input files. Each must end every rank
promptly with a clear message, and leave the last good checkpoint intact."""

import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from conftest import PYTHON, ROOT, mpi_env, mpirun
from mgpu.train.checkpoint import checkpoint_name, list_checkpoints, load_checkpoint, save_checkpoint
from procs import mpi_ranks, wait_for  # tests/procs.py

MGPU = [PYTHON, "-m", "mgpu"]
# ~2-3 ms a step at 2 ranks here: long enough to be signalled mid-run
RUN = [
    "train",
    "--layers",
    "50,512,512,3",
    "--batch-size",
    "128",
    "--optimizer",
    "adamw",
    "--dropout",
    "0.1",
    "--lr-schedule",
    "cosine",
    "--warmup-steps",
    "10",
    "--no-progress",
    "--seed",
    "5",
]


class Job:
    """An mpirun job in the background, with its ranks' pids and output files."""

    def __init__(self, n, args, tmp_path, name="job"):
        self.out, self.err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        cmd = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none", *map(str, args)]
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.proc = subprocess.Popen(cmd, stdout=o, stderr=e, env=mpi_env(), cwd=ROOT, start_new_session=True)

    def ranks(self) -> dict:
        """rank -> pid of the mpirun's rank processes."""
        children = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return mpi_ranks(map(int, children.split()))

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill()

    def kill(self):
        if self.proc.poll() is None:
            for pid in self.ranks().values():
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    @property
    def stdout(self):
        return self.out.read_text()

    @property
    def stderr(self):
        return self.err.read_text()


def first_checkpoint(directory, job):
    wait_for(
        lambda: list_checkpoints(str(directory)) or job.proc.poll() is not None, 120, "a first checkpoint", poll=0.05
    )
    assert job.proc.poll() is None, job.stderr[-2000:]


def params_of(path):
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.parametrize("how", ["SIGTERM to rank 1 only", "SIGUSR1 to mpirun"])
def test_signal_checkpoints_and_resume_is_bit_identical(tmp_path, how):
    steps = 1500
    ref = mpirun(2, [*MGPU, *RUN, "--steps", steps, "--save", tmp_path / "ref.npz"])
    assert ref.returncode == 0, ref.stderr[-2000:]

    ckpt = tmp_path / "ckpt"
    args = [*MGPU, *RUN, "--steps", steps, "--checkpoint-dir", ckpt, "--checkpoint-every", 5]
    job = Job(2, [*args, "--json", tmp_path / "stopped.json"], tmp_path)
    first_checkpoint(ckpt, job)
    if how.startswith("SIGTERM"):
        os.kill(job.ranks()[1], signal.SIGTERM)
    else:
        job.proc.send_signal(signal.SIGUSR1)  # mpirun forwards SIGUSR1 to every rank
    assert job.wait(60) == 0, job.stderr[-3000:]
    stopped = json.loads((tmp_path / "stopped.json").read_text())
    # rank 0 (which writes --json) names the signal, its own or the rank's that got it
    expected = "SIGTERM (on rank 1)" if how.startswith("SIGTERM") else "SIGUSR1"
    assert stopped["stopped"] == expected, stopped["stopped"]
    assert 5 <= stopped["steps"] < steps, "stopped mid-run"
    assert stopped["checkpoint"].endswith(f"ckpt-{stopped['steps']:09d}.npz")
    assert "stopped at step" in job.stdout and "Traceback" not in job.stderr
    load_checkpoint(stopped["checkpoint"])  # intact

    resumed = mpirun(2, [*args, "--resume", "--save", tmp_path / "resumed.npz", "--json", tmp_path / "r.json"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((tmp_path / "r.json").read_text())["steps"] == steps
    a, b = params_of(tmp_path / "ref.npz"), params_of(tmp_path / "resumed.npz")
    assert all(np.array_equal(a[k], b[k]) for k in a), "resume is not bit-identical"


def test_resume_at_another_world_size(tmp_path):
    steps = 40
    args = [*MGPU, *RUN, "--steps", steps, "--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", 20]
    ref = mpirun(2, [*args, "--save", tmp_path / "ref.npz"])
    assert ref.returncode == 0, ref.stderr[-2000:]
    mid = str(tmp_path / "ckpt" / "ckpt-000000020.npz")
    r = mpirun(3, [*args, "--resume", mid, "--save", tmp_path / "three.npz", "--checkpoint-dir", tmp_path / "c3"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "written by 2 rank(s), resumed on 3" in r.stderr
    a, b = params_of(tmp_path / "ref.npz"), params_of(tmp_path / "three.npz")
    for k in a:  # same samples, same global batch: equal within float rounding
        assert np.linalg.norm(a[k] - b[k]) <= 1e-4 * np.linalg.norm(a[k]), k


@pytest.mark.parametrize("shard", [[], ["--shard-optimizer"]], ids=["allreduce", "sharded"])
def test_killed_rank_ends_the_job_and_keeps_the_checkpoint(tmp_path, shard):
    ckpt = tmp_path / "ckpt"
    args = [*MGPU, *RUN, *shard, "--steps", 10**6, "--checkpoint-dir", ckpt, "--checkpoint-every", 10]
    job = Job(2, args, tmp_path)
    first_checkpoint(ckpt, job)
    os.kill(job.ranks()[1], signal.SIGKILL)
    t0 = time.monotonic()
    rc = job.wait(60)
    elapsed = time.monotonic() - t0
    assert rc != 0 and elapsed < 30, (rc, elapsed)
    assert re.search(r"rank 1\b", job.stdout + job.stderr), job.stderr[-2000:]
    for path in list_checkpoints(str(ckpt)):
        load_checkpoint(path)  # every checkpoint left behind verifies
    print(f"SIGKILL of rank 1: job ended in {elapsed:.2f} s")


def freeze_a_rank(run, tmp_path, frozen, timeout):
    """A 2-rank `run` checkpointing every 10 steps; rank `frozen` SIGSTOPped after the
    first checkpoint. Checks what every such job must do: fail within timeout + 30 s,
    without a traceback, leaving only checkpoints that verify. Returns (stderr,
    seconds from the freeze to the end) for the caller's checks of the message."""
    ckpt = tmp_path / "ckpt"
    job = Job(
        2,
        [
            *MGPU,
            *run,
            "--steps",
            10**6,
            "--checkpoint-dir",
            ckpt,
            "--checkpoint-every",
            10,
            "--watchdog-timeout",
            timeout,
        ],
        tmp_path,
    )
    first_checkpoint(ckpt, job)
    os.kill(job.ranks()[frozen], signal.SIGSTOP)
    t0 = time.monotonic()
    rc = job.wait(timeout + 30)
    elapsed = time.monotonic() - t0
    assert rc != 0 and elapsed < timeout + 30, (rc, elapsed, job.stderr[-2000:])
    assert "Traceback" not in job.stderr
    for path in list_checkpoints(str(ckpt)):
        load_checkpoint(path)
    return job.stderr, elapsed


# sharded: the step's collectives are reduce-scatters and all-gathers instead of allreduces
@pytest.mark.parametrize("shard", [[], ["--shard-optimizer"]], ids=["allreduce", "sharded"])
@pytest.mark.parametrize("frozen", [0, 1])
def test_frozen_rank_is_named_by_the_watchdog(tmp_path, frozen, shard):
    timeout = 3
    stderr, elapsed = freeze_a_rank([*RUN, *shard], tmp_path, frozen, timeout)
    survivor = 1 - frozen
    message = re.search(
        rf"on rank {survivor}: rank {frozen} (has not reached this step|stopped responding during it) "
        r"\(stopped, hung or dead\)",
        stderr,
    )
    assert message, stderr[-3000:]
    assert re.search(r"at step \d+ did not complete within 3 s", stderr)
    print(f"SIGSTOP of rank {frozen}: job ended in {elapsed:.2f} s (watchdog {timeout} s)")


# Rank 1 skips a step (alive, not in any collective): rank 0's step must fail within the
# 1 s deadline, naming rank 1. Rank 1 gives up after GRACE s, so a watchdog that never
# fires fails this test in seconds, not at a subprocess timeout.
SKIPPED_STEP = """
import sys, time
from mpi4py import MPI
import numpy as np
import mgpu
GRACE = float(sys.argv[1])
comm = MPI.COMM_WORLD
model = mgpu.MLP([4, 8, 2], seed=0, threads=1)
trainer = mgpu.Trainer(model, process_group=mgpu.ProcessGroup(), timeout=1.0)
comm.Barrier()
if comm.rank == 1:
    time.sleep(GRACE)
    print(f"rank 1: rank 0 was not stopped within {GRACE} s", flush=True)
    comm.Abort(7)
x, y = np.ones((2, 4), np.float32), np.zeros((2, 2), np.float32)
t0 = time.monotonic()
try:
    trainer.step(x, y, global_batch=4, first_sample=0)
    print("rank 0: the step completed without rank 1", flush=True)
except mgpu.CommError as e:
    print(f"rank 0: CommError after {time.monotonic() - t0:.2f} s: {e}", flush=True)
comm.Abort(3)
"""


def test_a_rank_that_skips_a_step_is_named_within_the_watchdog_timeout(tmp_path):
    grace = 20
    script = tmp_path / "skip.py"
    script.write_text(SKIPPED_STEP)
    r = mpirun(2, [PYTHON, script, grace], timeout=120)
    named = re.search(
        r"rank 0: CommError after [\d.]+ s: allreduce at step 0 did not complete within 1 s "
        r"on rank 0: rank 1 has not reached this step \(stopped, hung or dead\)",
        r.stdout,
    )
    assert named, r.stdout[-2000:] + r.stderr[-2000:]


# A sharded step's collectives under a 1 s timeout on MpiCommunicator itself, blocking (the
# worker thread) or queued (waited on against the deadline). "skip": rank 1 never reaches
# step 0 (it gives up after GRACE s, so a timeout that never fires fails in seconds);
# "stop": every rank loops over steps until the test SIGSTOPs rank 1 mid-run. Rank 0's
# CommError must name the collective and rank 1.
SHARDED_FAULT = """
import os, sys, time
from mpi4py import MPI
import numpy as np
from mgpu import _core
COLLECTIVE, QUEUED, MODE, GRACE = sys.argv[1], sys.argv[2] == "async", sys.argv[3], float(sys.argv[4])
world = MPI.COMM_WORLD
comm = _core.MpiCommunicator(MPI._handleof(world))
comm.timeout = 1.0
parts = [1 << 14] * world.size
buf = np.ones(sum(parts), np.float32)

def collective():
    if QUEUED:
        getattr(comm, COLLECTIVE + "_async")(buf, parts)
        comm.wait_all()
    else:
        getattr(comm, COLLECTIVE)(buf, parts)

world.Barrier()
if MODE == "skip" and world.rank == 1:
    time.sleep(GRACE)
    print(f"rank 1: rank 0 was not stopped within {GRACE} s", flush=True)
    os._exit(7)
step, t0 = 0, time.monotonic()
try:
    while MODE == "stop" or step == 0:
        comm.begin_step(step)
        t0 = time.monotonic()
        collective()
        step += 1
        if step == 50 and world.rank == 1:
            print("rank 1: READY", flush=True)
    print(f"rank {world.rank}: the collective completed without rank 1", flush=True)
except _core.CommError as e:
    print(f"rank {world.rank}: CommError after {time.monotonic() - t0:.2f} s: {e}", flush=True)
os._exit(3)
"""
SHARDED_NAMED = (
    r"rank 0: CommError after ([\d.]+) s: {what} at step \d+ did not complete within 1 s on rank 0: "
    r"rank 1 (has not reached this step|stopped responding during it) \(stopped, hung or dead\)"
)
WHAT = {"reduce_scatter_sum": "reduce-scatter", "all_gather": "all-gather"}


@pytest.mark.parametrize("queued", ["blocking", "async"])
@pytest.mark.parametrize("collective", ["reduce_scatter_sum", "all_gather"])
def test_a_rank_that_skips_a_sharded_collective_is_named_within_the_timeout(tmp_path, collective, queued):
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED_FAULT)
    r = mpirun(2, [PYTHON, script, collective, queued, "skip", 20], timeout=120)
    named = re.search(SHARDED_NAMED.format(what=WHAT[collective]), r.stdout)
    assert named and "has not reached this step" in named.group(0), r.stdout[-2000:] + r.stderr[-2000:]
    assert float(named.group(1)) < 5, named.group(0)


@pytest.mark.parametrize("collective, queued", [("reduce_scatter_sum", "blocking"), ("all_gather", "async")])
def test_a_rank_frozen_in_sharded_collectives_is_named_within_the_timeout(tmp_path, collective, queued):
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED_FAULT)
    job = Job(2, [PYTHON, script, collective, queued, "stop", 0], tmp_path)
    try:
        wait_for(lambda: "READY" in job.stdout or job.proc.poll() is not None, 60, "rank 1 at step 50")
        assert job.proc.poll() is None, job.stdout[-2000:] + job.stderr[-2000:]
        os.kill(job.ranks()[1], signal.SIGSTOP)
        t0 = time.monotonic()
        wait_for(lambda: "rank 0: " in job.stdout or job.proc.poll() is not None, 30, "rank 0's CommError")
        elapsed = time.monotonic() - t0
    finally:
        job.kill()
    named = re.search(SHARDED_NAMED.format(what=WHAT[collective]), job.stdout)
    assert named, job.stdout[-2000:] + job.stderr[-2000:]
    assert elapsed < 10, elapsed
    print(f"SIGSTOP of rank 1 in {WHAT[collective]}s ({queued}): rank 0 named it after {elapsed:.2f} s")


QUEUE_AFTER_TIMEOUT = """
import os, sys, time
import mpi4py
mpi4py.rc.thread_level = "multiple"  # the worker's queue
from mpi4py import MPI
import numpy as np
from mgpu import _core
world = MPI.COMM_WORLD
comm = _core.MpiCommunicator(MPI._handleof(world))
comm.timeout = float(sys.argv[1])
parts = [1 << 10] * world.size
bufs = [np.ones(sum(parts), np.float32) for _ in range(3)]
world.Barrier()
if world.rank == 0:
    t0 = time.monotonic()
    try:
        for b in bufs:
            comm.reduce_scatter_sum_async(b, parts)
        comm.wait_all()
    except _core.CommError as e:
        print(f"rank 0: CommError after {time.monotonic() - t0:.2f} s: {e}", flush=True)
    print(f"rank 0: may still write {comm.may_write_after_failure}", flush=True)  # the first, running
    time.sleep(5)  # rank 1 offers its three collectives meanwhile
    print(f"rank 0: changed {[int(not np.all(b == 1)) for b in bufs]}", flush=True)
    print(f"rank 0: then may still write {comm.may_write_after_failure}", flush=True)
    try:
        comm.barrier()
    except _core.CommError as e:
        print(f"rank 0: then {e}", flush=True)
else:
    time.sleep(2)
    comm.timeout = 1.5
    done = 0
    try:
        for b in bufs:
            comm.reduce_scatter_sum(b, parts)
            done += 1
    except _core.CommError:
        pass
    print(f"rank 1: completed {done}", flush=True)
    time.sleep(4)  # rank 0 reports first (a rank's exit ends the job)
os._exit(0)
"""


def test_collectives_queued_behind_a_timed_out_one_never_start(tmp_path):
    # Rank 0 queues three reduce-scatters and times out in the first (rank 1 is 2 s late).
    # The first cannot be stopped and completes once rank 1 arrives; the two behind it
    # must never start, so rank 1's second finds no partner, and rank 0's buffers for
    # them stay as they were (the caller may have freed them).
    script = tmp_path / "queue.py"
    script.write_text(QUEUE_AFTER_TIMEOUT)
    r = mpirun(2, [PYTHON, script, 1.0], timeout=120)
    out = r.stdout + r.stderr
    named = re.search(r"rank 0: CommError after ([\d.]+) s: reduce-scatter at step 0 did not complete within 1 s", out)
    assert named and float(named.group(1)) < 1.9, out[-2000:]
    assert "rank 0: changed [1, 0, 0]" in out, out[-2000:]
    # until the peer completed it, the first could still write its buffer (keep it alive)
    assert "rank 0: may still write True" in out and "rank 0: then may still write False" in out, out[-2000:]
    assert "rank 1: completed 1" in out, out[-2000:]
    assert re.search(r"rank 0: then the MPI communicator is unusable: an earlier reduce-scatter .* \(a timeout\)", out)


BLOCKING_TIMEOUT_SERIALIZED = """
import os, time
import mpi4py
mpi4py.rc.thread_level = "serialized"  # no worker: the blocking call's non-blocking requests, waited for here
from mpi4py import MPI
import numpy as np
from mgpu import _core
world = MPI.COMM_WORLD
comm = _core.MpiCommunicator(MPI._handleof(world))
comm.timeout = 1.0
buf = np.ones(1 << 12, np.float32)
world.Barrier()
if world.rank == 0:
    try:
        comm.allreduce_sum(buf)
    except _core.CommError as e:
        print(f"rank 0: CommError: {e}", flush=True)
    print(f"rank 0: may still write {comm.may_write_after_failure}", flush=True)
else:
    time.sleep(3)
os._exit(0)
"""


def test_a_timed_out_blocking_call_says_its_buffer_may_still_be_written(tmp_path):
    # Without MPI_THREAD_MULTIPLE a blocking call under a deadline is a non-blocking one
    # waited for; timed out, its request is left to a peer that may still come: the
    # communicator must say so, or the step would free the gradients under it.
    script = tmp_path / "blocking.py"
    script.write_text(BLOCKING_TIMEOUT_SERIALIZED)
    r = mpirun(2, [PYTHON, script], timeout=120)
    out = r.stdout + r.stderr
    assert "rank 0: CommError: allreduce at step 0 did not complete within 1 s" in out, out[-2000:]
    assert "rank 0: may still write True" in out, out[-2000:]


def test_diverging_run_stops_on_every_rank_without_a_bad_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    r = mpirun(
        2,
        [
            *MGPU,
            "train",
            "--layers",
            "50,64,3",
            "--steps",
            "50",
            "--lr",
            "1e30",
            "--momentum",
            "0",
            "--no-progress",
            "--checkpoint-dir",
            ckpt,
            "--checkpoint-every",
            "1",
            "--max-bad-steps",
            "2",
        ],
        timeout=120,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.stderr.count("2 consecutive steps with non-finite loss or gradients") == 2, r.stderr
    assert "step skipped" in r.stderr and "Traceback" not in r.stderr
    for path in list_checkpoints(str(ckpt)):
        arrays, _ = load_checkpoint(path)
        assert all(np.isfinite(a).all() for a in arrays.values())


@pytest.fixture
def small_disk(tmp_path):
    """A 160 KiB file system: room for a few small checkpoints, then full."""
    mount = tmp_path / "disk"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mount)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)])


def test_full_disk_at_checkpoint_time_keeps_the_previous_one(tmp_path, small_disk):
    # 50-64-3 with AdamW: ~40 KB a checkpoint
    r = mpirun(
        2,
        [
            *MGPU,
            "train",
            "--layers",
            "50,64,3",
            "--steps",
            "40",
            "--optimizer",
            "adamw",
            "--no-progress",
            "--checkpoint-dir",
            small_disk,
            "--checkpoint-every",
            "1",
            "--keep-checkpoints",
            "10",
        ],
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("disk full; previous checkpoint") == 2, r.stderr  # one line on every rank
    kept = list_checkpoints(str(small_disk))
    assert kept and not [n for n in os.listdir(small_disk) if n.startswith(".tmp")]
    for path in kept:
        load_checkpoint(path)


# --- bad input: one line on every rank, exit 2, nothing overwritten ----------------
def _npz(path, **arrays):
    np.savez(path, **arrays)
    return path


@pytest.fixture
def inputs(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 4)).astype(np.float32)
    nan = x.copy()
    nan[3, 2] = np.nan
    files = {
        "nan": _npz(tmp_path / "nan.npz", x=nan, y=rng.standard_normal((40, 2))),
        "features": _npz(tmp_path / "features.npz", x=rng.standard_normal((40, 7)), y=rng.standard_normal((40, 2))),
        "labels_range": _npz(tmp_path / "labels.npz", x=x, y=np.arange(40) % 6),
        "labels_float": _npz(tmp_path / "labels_float.npz", x=x, y=rng.standard_normal(40)),
        "empty": _npz(tmp_path / "empty.npz", x=np.zeros((0, 4)), y=np.zeros((0, 2))),
        "tiny": _npz(tmp_path / "tiny.npz", x=x[:1], y=np.zeros((1, 2)), x_val=x[:2], y_val=np.zeros((2, 2))),
        "garbage": tmp_path / "garbage.npz",
        "truncated_ckpt": tmp_path / "truncated.npz",
        "other_ckpt": tmp_path / "other" / "ckpt-000000003.npz",
        "out": tmp_path / "out.json",
    }
    files["garbage"].write_bytes(b"\x00not a zip file" * 10)
    good = _npz(tmp_path / "good.npz", x=x, y=rng.standard_normal((40, 2)))
    files["good"] = good
    r = mpirun(
        1,
        [
            *MGPU,
            "train",
            "--layers",
            "4,8,2",
            "--dataset",
            good,
            "--steps",
            "3",
            "--batch-size",
            "8",
            "--no-progress",
            "--checkpoint-dir",
            tmp_path / "other",
        ],
    )
    assert r.returncode == 0, r.stderr
    raw = files["other_ckpt"].read_bytes()
    files["truncated_ckpt"].write_bytes(raw[: len(raw) // 3])
    files["out"].write_text("precious")
    # A checkpoint whose arrays verify but whose metadata (outside the checksums) is wrong.
    arrays, meta = load_checkpoint(str(files["other_ckpt"]))
    meta["state"]["global_step"] = "abc"
    (tmp_path / "badmeta").mkdir()
    save_checkpoint(str(tmp_path / "badmeta"), 3, arrays, meta, keep=1)
    files["badmeta_ckpt"] = tmp_path / "badmeta" / "ckpt-000000003.npz"
    np.save(tmp_path / "array.npy", x)
    files["npy_as_npz"] = (tmp_path / "array.npy").rename(tmp_path / "npy_as.npz")
    files["huge_labels"] = _npz(tmp_path / "huge_labels.npz", x=x, y=np.full(40, 2**40, np.int64))
    raw = good.read_bytes()
    files["truncated_npz"] = tmp_path / "truncated_data.npz"
    files["truncated_npz"].write_bytes(raw[: len(raw) // 2])
    for name, bad in (
        ("nullcompat", {"compat": None}),
        ("emptyhistory", {"history": [{}]}),
        ("farbatch", {"state": {**meta["state"], "global_step": 3, "batch_in_epoch": 10**9}}),
    ):
        (tmp_path / name).mkdir()
        save_checkpoint(str(tmp_path / name), 3, arrays, {**meta, **bad}, keep=1)
        files[name] = tmp_path / name / "ckpt-000000003.npz"
    for name, step in (("newer", 9), ("lower", 1)):  # the same run's checkpoints at other steps
        (tmp_path / name).mkdir()
        save_checkpoint(
            str(tmp_path / name), step, arrays, {**meta, "state": {**meta["state"], "global_step": step}}, 1
        )
        files[f"{name}_ckpt"] = tmp_path / name / checkpoint_name(step)
    files["renamed_ckpt"] = tmp_path / "step3.npz"  # a name mgpu did not give: its step is in its metadata
    files["renamed_ckpt"].write_bytes(files["other_ckpt"].read_bytes())
    (tmp_path / "misnamed").mkdir()  # step 3's checkpoint renamed by hand to step 9's name
    (tmp_path / "misnamed" / "ckpt-000000009.npz").write_bytes(files["other_ckpt"].read_bytes())
    files["fifo"] = tmp_path / "fifo.npz"
    os.mkfifo(files["fifo"])  # opening it would wait for a writer (or reader) forever
    return files


def _resuming(f, *args) -> list:
    """The small run's command line with --resume, then `args`."""
    return ["--layers", "4,8,2", "--dataset", f["good"], "--batch-size", "8", "--resume", *args]


BAD_INPUT = [
    (lambda f: ["--layers", "4,8,2", "--dataset", f["nan"]], "NaN or Inf"),
    (lambda f: ["--layers", "4,8,2", "--dataset", f["features"]], "4 inputs but the dataset has 7"),
    (lambda f: ["--layers", "4,8,3", "--dataset", f["labels_range"]], "3 outputs but the dataset needs 6"),
    (
        lambda f: ["--layers", "4,8,3", "--dataset", f["labels_float"], "--loss", "cross_entropy"],
        "cross_entropy needs integer class labels",
    ),
    (lambda f: ["--layers", "4,8,2", "--dataset", f["empty"]], "empty"),
    (lambda f: ["--layers", "4,8,2", "--dataset", f["tiny"]], "fewer than the 2 ranks"),
    (lambda f: ["--layers", "4,8,2", "--dataset", f["garbage"]], "cannot read dataset"),
    (lambda f: ["--model", "giant"], "invalid choice"),
    (
        lambda f: _resuming(f, f["truncated_ckpt"]),
        "corrupt or truncated",
    ),
    (
        lambda f: ["--layers", "4,16,2", "--dataset", f["good"], "--batch-size", "8", "--resume", f["other_ckpt"]],
        "does not fit this run: layers",
    ),
    (
        lambda f: ["--layers", "4,8,2", "--dataset", f["good"], "--batch-size", "16", "--resume", f["other_ckpt"]],
        "does not fit this run: effective_batch",
    ),
    (lambda f: ["--layers", "4,8,2", "--dataset", f["good"], "--resume"], "needs --checkpoint-dir"),
    (
        lambda f: _resuming(f, f["other_ckpt"], "--checkpoint-dir", f["newer_ckpt"].parent),
        "holds checkpoints newer than the one resumed",
    ),
    (
        lambda f: _resuming(f, f["renamed_ckpt"], "--checkpoint-dir", f["newer_ckpt"].parent),
        r"newer than the one resumed \(step 3\), newest ckpt-0+9",
    ),
    (
        lambda f: _resuming(f, f["other_ckpt"], "--checkpoint-dir", f["lower_ckpt"].parent),
        "holds checkpoints other than the one resumed",
    ),
    (
        lambda f: _resuming(f, "--checkpoint-dir", f["renamed_ckpt"].parent / "misnamed"),
        r"ckpt-0+9.npz' holds step 3, not the step its name says",
    ),
    (
        lambda f: ["--layers", "4,8,2", "--dataset", f["good"], "--checkpoint-every", "2"],
        "--checkpoint-every applies to the checkpoints of --checkpoint-dir",
    ),
    (
        lambda f: ["--layers", "4,8,2", "--dataset", f["good"], "--keep-checkpoints", "2"],
        "--keep-checkpoints applies to the checkpoints of --checkpoint-dir",
    ),
    (
        lambda f: ["--layers", "4,8,2", "--dataset", f["good"], "--batch-size", "8", "--resume", f["nullcompat"]],
        "malformed metadata: compat is None",
    ),
    (
        lambda f: ["--layers", "4,8,2", "--dataset", f["good"], "--batch-size", "8", "--resume", f["emptyhistory"]],
        r"malformed metadata: history\[0\]\.epoch is None",
    ),
    (
        lambda f: ["--layers", "4,8,2", "--dataset", f["good"], "--batch-size", "8", "--resume", f["farbatch"]],
        r"malformed metadata: state.batch_in_epoch is 1000000000, beyond the \d+ steps of an epoch",
    ),
    (lambda f: ["--layers", "4,8,2", "--dataset", f["good"], "--checkpoint-dir", f["good"]], "checkpoint directory"),
    (lambda f: ["--layers", "4,8,2", "--dataset", f["npy_as_npz"]], "not an .npz archive"),
    (lambda f: ["--layers", "4,8,2", "--dataset", f["truncated_npz"]], "cannot read dataset .*corrupt or truncated"),
    (lambda f: ["--layers", "4,8,2", "--dataset", f["fifo"]], "dataset .* is not a regular file"),
    (lambda f: ["--layers", "4,8,2", "--dataset", f["huge_labels"]], "class labels must be < 2,147,483,647"),
    (
        lambda f: ["--layers", "4,8,2", "--dataset", f["good"], "--batch-size", "8", "--resume", f["badmeta_ckpt"]],
        "malformed metadata: state.global_step",
    ),
    (lambda f: ["--layers", "4,8,2", "--dataset", f["good"], "--resume", f["fifo"]], "is not a regular file"),
    (
        lambda f: ["--layers", "4,8,2", "--dataset", f["good"], "--log-json", f["fifo"]],
        "--log-json .* is not a regular file",
    ),
    (
        lambda f: ["--layers", "4,8,2", "--dataset", f["good"], "--save", f["good"]],
        "--save .* is the --dataset this run reads",
    ),
    (
        lambda f: _resuming(f, f["other_ckpt"], "--json", f["other_ckpt"]),
        "--json .* is the --resume this run reads",
    ),
    (
        lambda f: ["--layers", "4,8,2", "--dataset", f["good"], "--checkpoint-dir", f["other_ckpt"].parent],
        "holds 1 checkpoint\\(s\\) of an earlier run",
    ),
    (lambda f: ["--layers", "4,8,2", "--dataset", f["good"], "--trace", ""], "--trace: the path is empty"),
    (lambda f: ["--layers", "20,100000,100000,3"], "10,002,500,003 parameters on .* needs about .* GB a rank"),
    (lambda f: ["--accumulate", "0"], "accumulation steps"),
    (lambda f: ["--max-grad-norm", "-1"], "max gradient norm"),
    (lambda f: ["--lr-schedule", "linear"], "invalid choice"),
    (lambda f: ["--checkpoint-every", "-5"], "checkpoint interval"),
    (lambda f: ["--watchdog-timeout", "-1"], "watchdog timeout"),
]


@pytest.mark.parametrize("make_args, message", BAD_INPUT, ids=[m for _, m in BAD_INPUT])
def test_bad_input_one_line_on_every_rank_nothing_overwritten(inputs, make_args, message):
    before = {p: p.read_bytes() for p in inputs.values() if isinstance(p, os.PathLike) and p.is_file()}
    t0 = time.monotonic()
    r = mpirun(
        2,
        [
            *MGPU,
            "train",
            "--no-progress",
            "--steps",
            "3",
            "--json",
            inputs["out"],
            "--save",
            inputs["out"].with_suffix(".npz"),
            *make_args(inputs),
        ],
        timeout=120,
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    errors = [
        part.splitlines()[0] for part in re.split(r"(?=mgpu(?: train)?: error)", r.stderr) if part.startswith("mgpu")
    ]
    assert len(errors) == 2 and all(re.search(message, e) for e in errors), r.stderr
    assert "Traceback" not in r.stderr and time.monotonic() - t0 < 60
    assert all(p.read_bytes() == data for p, data in before.items()), "an input or output file changed"
    assert not inputs["out"].with_suffix(".npz").exists()


def test_a_setting_bad_on_one_rank_only_ends_every_rank(tmp_path):
    # The ranks agree on their inputs before any collective; an environment variable bad
    # on rank 0 only (read when the model is built) must not leave rank 1 waiting in the
    # Trainer's first collective: one line on each rank, exit 2, promptly.
    run = [PYTHON, "-m", "mgpu", "train", "--steps", "2", "--no-progress", "--layers", "20,16,3"]
    cmd = [
        "mpirun",
        "--oversubscribe",
        "--bind-to",
        "none",
        "-np",
        "1",
        "-x",
        "MGPU_CPU_GEMM=bogus",
        *run,
        ":",
        "-np",
        "1",
        *run,
    ]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert (
        "mgpu: error (rank 0): MGPU_CPU_GEMM" in r.stderr and "mgpu: error (rank 1): rank 0: MGPU_CPU_GEMM" in r.stderr
    )
    assert "Traceback" not in r.stderr and time.monotonic() - t0 < 60


def test_a_resumed_dataset_is_known_by_its_contents_not_its_path(tmp_path):
    # The same samples under another path (a requeued job started elsewhere) continue the
    # run; other samples under the same path are refused, and nothing saved is touched.
    rng = np.random.default_rng(1)
    data = tmp_path / "d.npz"
    _npz(data, x=rng.standard_normal((40, 4)), y=rng.standard_normal((40, 2)))
    ckpt = tmp_path / "ckpt"
    line = [*MGPU, "train", "--layers", "4,8,2", "--batch-size", "8", "--no-progress", "--checkpoint-dir", ckpt]
    assert mpirun(2, [*line, "--dataset", data, "--steps", "2"]).returncode == 0
    copy = tmp_path / "elsewhere" / "same.npz"
    copy.parent.mkdir()
    copy.write_bytes(data.read_bytes())
    moved = mpirun(2, [*line, "--dataset", copy, "--steps", "4", "--resume"])
    assert moved.returncode == 0 and "resuming from" in moved.stdout, moved.stderr[-2000:]
    before = {p: open(p, "rb").read() for p in list_checkpoints(str(ckpt))}
    _npz(data, x=rng.standard_normal((40, 4)), y=rng.standard_normal((40, 2)))  # same path and size, new samples
    other = mpirun(2, [*line, "--dataset", data, "--steps", "6", "--resume"])
    assert other.returncode == 2 and other.stderr.count("its dataset held other samples") == 2, other.stderr[-2000:]
    assert {p: open(p, "rb").read() for p in list_checkpoints(str(ckpt))} == before


def test_a_run_that_ends_on_a_skipped_step_says_no_checkpoint_holds_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    r = mpirun(
        2,
        [
            *MGPU,
            "train",
            "--layers",
            "50,16,3",
            "--steps",
            "2",
            "--lr",
            "1e30",
            "--momentum",
            "0",
            "--no-progress",
            "--checkpoint-dir",
            ckpt,
        ],
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(re.findall(r"no checkpoint of step 2: the last \d step\(s\) were skipped", r.stderr)) == 1, r.stderr
    assert "none was written" in r.stderr and list_checkpoints(str(ckpt)) == []


def test_one_command_line_starts_a_job_and_restarts_it(tmp_path):
    # `--resume` with an empty --checkpoint-dir starts a new run (a requeued job's first
    # launch); the same line then continues it, and without --resume the directory of an
    # earlier run is refused rather than mixed into.
    ckpt = tmp_path / "ckpt"
    line = [*MGPU, "train", "--layers", "20,16,3", "--steps", "4", "--no-progress", "--checkpoint-dir", ckpt]
    first = mpirun(2, [*line, "--resume"])
    assert first.returncode == 0 and "starting a new run" in first.stdout, first.stderr[-2000:]
    assert [os.path.basename(p) for p in list_checkpoints(str(ckpt))] == ["ckpt-000000004.npz"]
    again = mpirun(2, [*line, "--resume"])
    assert again.returncode == 0 and "resuming from" in again.stdout, again.stderr[-2000:]
    assert "nothing to train" in again.stderr  # 4 steps done of the 4 asked: said, not silently "done"
    before = {p: open(p, "rb").read() for p in list_checkpoints(str(ckpt))}
    fresh = mpirun(2, line)
    assert fresh.returncode == 2 and fresh.stderr.count("of an earlier run") == 2, fresh.stderr[-2000:]
    assert {p: open(p, "rb").read() for p in list_checkpoints(str(ckpt))} == before
