"""ThreadGroup, the control plane of single-process multi-GPU training (ranks as
threads): its collectives give what ProcessGroup's give under mpirun, a failing
or silent thread releases the others with an error instead of a hang, and the
CLI refuses --gpus where it cannot work. The NCCL side runs in tests/gpu."""

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import mgpu
from mgpu.train.thread_group import ThreadGroup, _Shared, run_on_gpus


def run_threads(fn, size, timeout=0.0):
    """run_on_gpus without its GPU count check: the control plane needs no GPU."""
    shared = _Shared(size)
    results, errors = [None] * size, [None] * size

    def body(rank):
        pg = ThreadGroup(shared, rank)
        pg.timeout = timeout
        try:
            results[rank] = fn(pg)
        except BaseException as e:  # noqa: BLE001
            errors[rank] = e
            pg.abort(1)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a rank hung"
    return results, errors


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_collectives_match_process_group_semantics(size):
    def work(pg):
        out = {
            "sum": pg.allreduce(pg.rank + 1),
            "max": pg.allreduce(float(pg.rank) * 0.5, op="max"),
            "min": pg.allreduce(np.array([pg.rank, -pg.rank], dtype=np.float32), op="min"),
            "exscan": pg.exscan(10 * (pg.rank + 1)),
            "bcast": pg.bcast({"from": pg.rank, "list": [pg.rank]} if pg.rank == 0 else None),
        }
        if pg.rank == 0:
            out["bcast"]["list"].append("mutated by rank 0 only")
        pg.barrier()
        pg.agree(None)
        return out

    results, errors = run_threads(work, size)
    assert errors == [None] * size
    for rank, r in enumerate(results):
        assert r["sum"] == size * (size + 1) // 2 and isinstance(r["sum"], int)
        assert r["max"] == pytest.approx((size - 1) * 0.5) and isinstance(r["max"], float)
        np.testing.assert_array_equal(r["min"], [0, -(size - 1)])
        assert r["exscan"] == sum(10 * (k + 1) for k in range(rank))
        assert r["bcast"]["from"] == 0
        assert r["bcast"]["list"] == ([0, "mutated by rank 0 only"] if rank == 0 else [0])  # each owns a copy


def test_agree_raises_on_every_rank():
    def work(pg):
        pg.agree(mgpu.ConfigError("bad file") if pg.rank == 1 else None)

    _, errors = run_threads(work, 3)
    assert all(isinstance(e, mgpu.ConfigError) for e in errors)
    assert str(errors[1]) == "bad file"
    assert str(errors[0]) == str(errors[2]) == "rank 1: bad file"


def test_a_failing_rank_releases_the_others():
    def work(pg):
        if pg.rank == 2:
            raise RuntimeError("boom")
        pg.allreduce(1.0)  # never completed by rank 2: must not hang (no timeout set)

    _, errors = run_threads(work, 3)
    assert isinstance(errors[2], RuntimeError)
    assert all(isinstance(errors[r], mgpu.CommError) and "rank 2 failed" in str(errors[r]) for r in (0, 1))


def test_a_silent_rank_times_out_the_others():
    def work(pg):
        if pg.rank == 1:
            time.sleep(1.5)  # stuck past the others' deadline
            return "late"
        return pg.allreduce(1, what="validation")

    t0 = time.monotonic()
    results, errors = run_threads(work, 2, timeout=0.3)
    assert time.monotonic() - t0 < 10
    assert isinstance(errors[0], mgpu.CommError)
    assert "validation" in str(errors[0]) and "within 0.3 s" in str(errors[0])
    assert results[1] == "late"


def test_run_on_gpus_returns_results_and_reraises_the_cause():
    shared_seen = []

    def ok(pg):
        shared_seen.append(threading.current_thread().name)
        return pg.allreduce(pg.rank)

    assert run_on_gpus(ok, gpus=3) == [3, 3, 3]
    assert len(set(shared_seen)) == 3

    def fails(pg):
        if pg.rank == 0:
            raise mgpu.ConfigError("rank 0's own error")
        pg.barrier()

    with pytest.raises(mgpu.ConfigError, match="rank 0's own error"):
        run_on_gpus(fails, gpus=2)
    with pytest.raises(mgpu.ConfigError, match=">= 1"):
        run_on_gpus(ok, gpus=0)


def test_threads_have_no_mpi_communicator_and_no_cpu_mode():
    def work(pg):
        with pytest.raises(mgpu.ConfigError, match="NCCL"):
            pg.communicator("mpi")
        with pytest.raises(mgpu.ConfigError, match="mpirun"):
            pg.resolve_device("cpu")
        return True

    results, errors = run_threads(work, 2)
    assert errors == [None, None] and results == [True, True]

    def single(pg):  # one thread: the ordinary local communicator and any device
        return type(pg.communicator("mpi")).__name__, pg.resolve_device("cpu")

    assert run_on_gpus(single, gpus=1) == [("LocalCommunicator", ("cpu", 0))]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "2", "--device", "cpu"], "--gpus drives GPUs"),
        (["--gpus", "0"], "--gpus must be in 1..1024"),
        (["--gpus", "1025"], "--gpus must be in 1..1024"),
    ],
)
def test_cli_refuses_gpus_where_it_cannot_work(args, message):
    r = subprocess.run(
        [sys.executable, "-m", "mgpu", "train", "--steps", "2", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


@pytest.mark.parametrize("gpus", ["1", "2", "1024"])  # refused before any thread starts
def test_cli_gpus_without_a_gpu_is_one_clear_line(gpus):
    if mgpu.hostinfo.cuda_device_count() > 0:
        pytest.skip("a GPU is visible: tests/gpu runs --gpus for real")
    r = subprocess.run(
        [sys.executable, "-m", "mgpu", "train", "--gpus", gpus, "--steps", "2", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "drives GPUs" in lines[0] and "no GPU is visible" in lines[0], r.stderr


@pytest.mark.parametrize("size", [1, 3])
def test_clock_offsets_of_threads_are_exact(size):
    # each thread's clock starts at its own origin (as the trace's does): rank 0 learns
    # each origin's distance from its own, to within a clock read (one process, one perf_counter)
    def fn(pg):
        time.sleep(0.01 * pg.rank)
        origin = time.perf_counter()
        return origin, pg.clock_offsets(lambda: time.perf_counter() - origin)

    results, errors = run_threads(fn, size)
    assert errors == [None] * size
    origins = [origin for origin, _ in results]
    offsets = results[0][1]
    assert all(r[1] == [] for r in results[1:]) and len(offsets) == size
    for rank, (offset, uncertainty) in enumerate(offsets):
        assert 0 <= uncertainty < 1e-3 and abs(offset - (origins[0] - origins[rank])) <= uncertainty + 1e-9


def test_both_transports_are_groups_with_every_member_of_the_protocol():
    import inspect

    from mpi4py import MPI

    from mgpu.train.group import Group

    members = [n for n in vars(Group) if not n.startswith("_")] + list(Group.__annotations__)
    groups = (mgpu.ProcessGroup(comm=MPI.COMM_SELF), ThreadGroup(_Shared(1), 0))
    for g in groups:
        missing = [n for n in members if not hasattr(g, n)]
        assert not missing, (type(g).__name__, missing)
        for n in members:  # the collectives take what the Protocol says they take
            if callable(getattr(Group, n, None)):
                wanted = list(inspect.signature(getattr(Group, n)).parameters)
                given = list(inspect.signature(getattr(g, n)).parameters)
                assert given[: len(wanted) - 1] == wanted[1:], (type(g).__name__, n, given, wanted)
        assert (g.rank, g.size, g.is_root) == (0, 1, True)
