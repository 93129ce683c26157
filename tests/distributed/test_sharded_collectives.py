"""A sharded optimizer's collectives on the MPI communicator (reduce_scatter_sum,
all_gather, their async forms) against numpy, exactly, at any world size: blocking,
under a timeout (the worker thread with MPI_THREAD_MULTIPLE, non-blocking calls
without it), queued (to the worker thread, or non-blocking calls), and stamped for
collective timing. Run under mpirun with the rest of
tests/distributed (tests/test_launch.py), and on its own it launches itself at 1, 2
and 3 ranks, at 2 and 3 ranks without MPI_THREAD_MULTIPLE
(MGPU_TEST_THREAD_LEVEL=serialized), and at 3 ranks where only rank 1 lacks it (mixed).
Parts larger than one MPI chunk are not tested: the chunk sizes have no test hook, and such parts are too slow here."""

import os
import time

import mpi4py
import numpy as np
import pytest


def _thread_level() -> str:
    """The level this rank asks for: MGPU_TEST_THREAD_LEVEL, where "mixed" gives rank 1
    MPI_THREAD_SERIALIZED and the others MPI_THREAD_MULTIPLE (the ranks must agree on how
    queued collectives run)."""
    asked = os.environ.get("MGPU_TEST_THREAD_LEVEL", "multiple")
    if asked == "mixed":
        return "serialized" if os.environ.get("OMPI_COMM_WORLD_RANK") == "1" else "multiple"
    return asked


if os.environ.get("MGPU_TEST_THREAD_LEVEL"):  # before MPI is initialised (only when this file runs alone)
    mpi4py.rc.thread_level = _thread_level()
from mpi4py import MPI  # noqa: E402

import mgpu  # noqa: E402
from mgpu import _core  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
UNDER_MPIRUN = "OMPI_COMM_WORLD_SIZE" in os.environ
# Queued collectives run on the worker thread where every rank has MPI_THREAD_MULTIPLE.
ON_WORKER = WORLD.allreduce(MPI.Query_thread(), op=MPI.MIN) == MPI.THREAD_MULTIPLE


def communicator(timeout=0.0):
    # MpiCommunicator itself, at any world size (ProcessGroup gives a world of one the local communicator).
    comm = _core.MpiCommunicator(MPI._handleof(WORLD))
    comm.timeout = timeout
    return comm


def cases():
    """Parts of ranges cut one part per rank: even, uneven, with zero parts, all in one part, empty."""
    return [
        [5] * SIZE,
        [3 + 7 * r for r in range(SIZE)],
        [0] + [4 + r for r in range(1, SIZE)],
        [6 + r for r in range(SIZE - 1)] + [0],
        [0] * (SIZE - 1) + [1000],
        [0] * SIZE,
    ]


def inputs(parts):
    """Each rank's input (small integers: every order of summation is exact) and their sum."""
    n = sum(parts)
    base = np.arange(n, dtype=np.float32) % 97
    mine = base * (RANK + 1) - RANK
    total = base * (SIZE * (SIZE + 1) / 2) - SIZE * (SIZE - 1) / 2
    return mine, total.astype(np.float32)


def own(parts, rank=RANK):
    lo = sum(parts[:rank])
    return slice(lo, lo + parts[rank])


def check_collectives(comm, parts, queued):
    # reduce-scatter: the own part holds the sum (the rest is unspecified)
    data, total = inputs(parts)
    if queued:
        comm.reduce_scatter_sum_async(data, parts)
        comm.wait_all()
    else:
        comm.reduce_scatter_sum(data, parts)
    assert np.array_equal(data[own(parts)], total[own(parts)]), (parts, data, total)
    # all-gather: every part its owner's values; others' parts start as NaN here
    gathered = np.full(sum(parts), np.nan, np.float32)
    expect = np.repeat(10 * np.arange(SIZE, dtype=np.float32) + 1, parts)
    gathered[own(parts)] = 10 * RANK + 1
    if queued:
        comm.all_gather_async(gathered, parts)
        comm.wait_all()
    else:
        comm.all_gather(gathered, parts)
    assert np.array_equal(gathered, expect), (parts, gathered)


@pytest.mark.parametrize("queued", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("timeout", [0.0, 30.0])  # blocking MPI calls; worker thread or non-blocking calls
def test_reduce_scatter_and_all_gather_match_numpy(timeout, queued):
    comm = communicator(timeout)
    for parts in cases():
        check_collectives(comm, parts, queued)
    comm.barrier()


@pytest.mark.parametrize("timeout", [0.0, 30.0])
def test_queued_collectives_of_every_kind_complete_in_one_wait(timeout):
    # allreduce, reduce-scatter and all-gather queued together on separate arrays, progressed, waited once
    comm = communicator(timeout)
    parts = [3 + 7 * r for r in range(SIZE)]
    a = np.full(11, RANK + 1, np.float32)
    rs, total = inputs(parts)
    ag = np.full(sum(parts), np.nan, np.float32)
    ag[own(parts)] = RANK
    comm.allreduce_sum_async(a)
    comm.reduce_scatter_sum_async(rs, parts)
    comm.progress()
    comm.all_gather_async(ag, parts)
    comm.wait_all()
    assert np.all(a == SIZE * (SIZE + 1) / 2)
    assert np.array_equal(rs[own(parts)], total[own(parts)])
    assert np.array_equal(ag, np.repeat(np.arange(SIZE, dtype=np.float32), parts))


@pytest.mark.parametrize("timeout", [0.0, 30.0])
def test_blocking_collectives_wait_for_the_queued_ones(timeout):
    # With MPI_THREAD_MULTIPLE the queued collectives run on the worker thread; a blocking
    # one issued meanwhile on this thread must not overtake them (every rank must see one order).
    comm = communicator(timeout)
    parts = [3 + 7 * r for r in range(SIZE)]
    rs, total = inputs(parts)
    a = np.full(1000, RANK + 1, np.float32)
    b = np.full(500, RANK, np.float32)
    ag = np.full(sum(parts), np.nan, np.float32)
    ag[own(parts)] = RANK
    WORLD.Barrier()
    comm.start_collective_timing()
    comm.reduce_scatter_sum_async(rs, parts)
    comm.allreduce_sum_async(a)
    comm.broadcast(b, SIZE - 1)
    if ON_WORKER:  # the worker's: both finished when the broadcast began
        times = comm.collective_times()
        assert len(times) == 2 and all(0 <= launch <= done for launch, done in times), times
    comm.barrier()
    comm.all_gather_async(ag, parts)
    comm.allreduce_sum(np.zeros(10, np.float32))
    comm.wait_all()
    assert np.array_equal(rs[own(parts)], total[own(parts)])
    assert np.all(a == SIZE * (SIZE + 1) / 2) and np.all(b == SIZE - 1)
    assert np.array_equal(ag, np.repeat(np.arange(SIZE, dtype=np.float32), parts))


@pytest.mark.parametrize("timeout", [0.0, 30.0])  # the worker's finish, MPI_Waitsome, or tests against a deadline
def test_async_sharded_collectives_are_stamped_as_each_completes(timeout):
    # The last rank starts the all-gather 0.3 s after the reduce-scatter (progressing it
    # meanwhile): every rank stamps the reduce-scatter done well before the all-gather.
    comm = communicator(timeout)
    parts = [1000 + r for r in range(SIZE)]
    rs, total = inputs(parts)
    ag = np.full(sum(parts), np.nan, np.float32)
    ag[own(parts)] = RANK
    WORLD.Barrier()
    comm.start_collective_timing()
    comm.reduce_scatter_sum_async(rs, parts)
    if RANK == SIZE - 1:
        late = time.monotonic() + 0.3
        while time.monotonic() < late:
            comm.progress()
    comm.all_gather_async(ag, parts)
    comm.all_gather_async(np.zeros(0, np.float32), [0] * SIZE)  # nothing to move: done when launched
    comm.wait_all()
    times = comm.collective_times()
    assert np.array_equal(rs[own(parts)], total[own(parts)])
    assert np.array_equal(ag, np.repeat(np.arange(SIZE, dtype=np.float32), parts))
    assert len(times) == 3 and all(0 <= launch <= done for launch, done in times), times
    assert times[2][0] == times[2][1]
    if SIZE > 1:  # alone, nothing waits for the late launch
        assert times[1][1] - times[0][1] > 0.2, times
    assert comm.collective_times() == []  # the stamping ended


def test_parts_must_be_one_per_rank():
    comm = communicator()
    for parts in ([4] * (SIZE + 1), [4] * (SIZE - 1)):
        with pytest.raises(mgpu.ConfigError):
            comm.reduce_scatter_sum(np.zeros(4 * len(parts), np.float32), parts)
        with pytest.raises(mgpu.ConfigError):
            comm.all_gather_async(np.zeros(4 * len(parts), np.float32), parts)
    comm.wait_all()
    comm.barrier()


@pytest.mark.parametrize("timeout", [0.0, 30.0])
@pytest.mark.parametrize("call", ["allreduce_sum", "reduce_scatter_sum", "all_gather", "broadcast", "barrier"])
def test_every_blocking_call_lets_the_queue_finish_first(timeout, call):
    # A call of this thread on the communicator while the worker has collectives queued
    # waits for them (one order on every rank): the queued allreduce is stamped done by
    # the time the call returns, and both results are exact.
    comm = communicator(timeout)
    parts = [3 + r for r in range(SIZE)]
    queued = np.full(700, RANK + 1, np.float32)
    data, total = inputs(parts)
    WORLD.Barrier()
    comm.start_collective_timing()
    comm.allreduce_sum_async(queued)
    if call == "broadcast":
        comm.broadcast(data, 0)
    elif call == "barrier":
        comm.barrier()
    elif call == "allreduce_sum":
        comm.allreduce_sum(data)
    else:
        getattr(comm, call)(data, parts)
    if ON_WORKER:  # the worker's queue (else requests only a wait completes)
        times = comm.collective_times()
        assert len(times) == 1 and 0 <= times[0][0] <= times[0][1], times
    comm.wait_all()
    assert np.all(queued == SIZE * (SIZE + 1) / 2)
    if call == "allreduce_sum":
        assert np.array_equal(data, total)
    elif call == "reduce_scatter_sum":
        assert np.array_equal(data[own(parts)], total[own(parts)])


@pytest.mark.parametrize("queued", [False, True])
def test_an_abort_makes_later_calls_fail_naming_it(queued):
    # After an error unwound a step, the peers may wait in collectives of that step: this
    # rank's next call must not meet them, whether or not anything of it was still queued.
    comm = communicator(30.0)
    if queued:  # completed before the abort: the peers are not left waiting
        comm.allreduce_sum_async(np.ones(10, np.float32))
        comm.wait_all()
    WORLD.Barrier()
    comm.abort("step 3 failed on this rank: testing")
    for call in (comm.barrier, lambda: comm.allreduce_sum_async(np.ones(4, np.float32))):
        with pytest.raises(mgpu.CommError, match=r"unusable: aborted \(step 3 failed on this rank: testing\)"):
            call()


def test_close_completes_what_is_queued_and_ends_the_communicator():
    comm = communicator(30.0)
    parts = [5 + r for r in range(SIZE)]
    data, total = inputs(parts)
    comm.reduce_scatter_sum_async(data, parts)
    comm.close()
    assert np.array_equal(data[own(parts)], total[own(parts)])
    with pytest.raises(mgpu.CommError, match="unusable: it was closed"):
        comm.allreduce_sum(np.ones(4, np.float32))
    comm.close()  # again: nothing
    comm.abort("after the end")  # nothing either: the message stays the close's
    with pytest.raises(mgpu.CommError, match="it was closed"):
        comm.barrier()


def test_the_thread_level_is_the_one_asked_for():
    asked = _thread_level()
    if os.environ.get("MGPU_TEST_THREAD_LEVEL", "multiple") != "multiple" and not UNDER_MPIRUN:
        pytest.skip("the thread level is only set when this file runs under mpirun")
    levels = {"multiple": MPI.THREAD_MULTIPLE, "serialized": MPI.THREAD_SERIALIZED}
    assert MPI.Query_thread() == levels[asked]


@pytest.mark.skipif(UNDER_MPIRUN, reason="launches mpirun itself; never from inside a rank")
@pytest.mark.parametrize(
    "ranks, level",
    [(1, "multiple"), (2, "multiple"), (3, "multiple"), (2, "serialized"), (3, "serialized"), (3, "mixed")],
)
def test_under_mpirun(ranks, level):
    from conftest import PYTHON, mpi_env, mpirun

    r = mpirun(
        ranks,
        [PYTHON, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-x"],
        env=mpi_env(MGPU_TEST_THREAD_LEVEL=level),
        timeout=180,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count(" passed") == ranks and "failed" not in r.stdout, r.stdout[-2000:]
