"""Queued (async) against blocking collectives of MpiCommunicator, the way the CUDA + MPI
staged step issues them: N buckets of M floats each queued, then one wait_all(), against
the same buckets as blocking calls; reduce-scatter (two even parts on 2 ranks), all-gather
and allreduce, the kinds in turn for 7 rounds, medians and ranges on rank 0. Answer: with
MPI_THREAD_MULTIPLE the queued collectives run on the communicator's worker thread at the
blocking calls' speed; OpenMPI's non-blocking calls (libnbc) ran 2.9-4.3x slower
(docs/journal.md, 2026-11-29).

    source scripts/mpi_env.sh; OMP_NUM_THREADS=1 \\
        mpirun -np 2 .venv/bin/python scripts/experiments/mpi_queued_collectives.py [M] [N]

MPI4PY_RC_THREAD_LEVEL=serialized (and mpirun -x MPI4PY_RC_THREAD_LEVEL) runs it without
the worker thread, on the non-blocking calls.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

from mgpu import _core

WORLD = MPI.COMM_WORLD
comm = _core.MpiCommunicator(MPI._handleof(WORLD))
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
buckets = int(sys.argv[2]) if len(sys.argv) > 2 else 4
bufs = [np.ones(n, np.float32) for _ in range(buckets)]
parts = [n // WORLD.size] * (WORLD.size - 1) + [n - n // WORLD.size * (WORLD.size - 1)]


def queued(issue):
    def run():
        for b in bufs:
            issue(b)
        comm.wait_all()

    return run


def blocking(issue):
    def run():
        for b in bufs:
            issue(b)

    return run


KINDS = {
    "reduce-scatter queued": queued(lambda b: comm.reduce_scatter_sum_async(b, parts)),
    "reduce-scatter blocking": blocking(lambda b: comm.reduce_scatter_sum(b, parts)),
    "all-gather queued": queued(lambda b: comm.all_gather_async(b, parts)),
    "all-gather blocking": blocking(lambda b: comm.all_gather(b, parts)),
    "allreduce queued": queued(comm.allreduce_sum_async),
    "allreduce blocking": blocking(comm.allreduce_sum),
}
times = {kind: [] for kind in KINDS}
for _ in range(7):
    for kind, run in KINDS.items():
        WORLD.Barrier()
        t = time.perf_counter()
        run()
        times[kind].append(time.perf_counter() - t)
if WORLD.rank == 0:
    print(f"{WORLD.size} ranks, {buckets} buckets x {n} floats, MPI thread level {MPI.Query_thread()}")
    for kind, v in times.items():
        print(f"  {kind:24s} {np.median(v) * 1e3:7.2f} ms  ({min(v) * 1e3:.2f}-{max(v) * 1e3:.2f})")
