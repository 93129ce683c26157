"""A sharded step's collectives against a replicated step's, rounds alternated: the
measurement behind MpiCommunicator's reduce-scatter algorithm (an in-place MPI_Reduce per
part to its owner, or MPI_Reduce_scatter into scratch), and what a ZeRO-1 step pays for
its collectives against per-bucket allreduces. The gradients of a model of --params
floats go in buckets of --bucket-mb, cut where the contiguous shards (one per rank, as
even as can be) meet, so most buckets belong to one owner; a sharded step reduce-scatters
every bucket, then all-gathers the whole parameter buffer once. Answer: the report of the
ZeRO-1 MPI collectives (branch zero-mpi).

    source scripts/mpi_env.sh; OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \\
        mpirun -np 2 --bind-to none .venv/bin/python scripts/experiments/reduce_scatter_choice.py \\
        [--params 10e6,40e6] [--via mpi4py|mgpu]

--via mpi4py times the bare MPI calls of each algorithm; --via mgpu times mgpu's
MpiCommunicator (reduce_scatter_sum and all_gather against allreduce_sum, blocking and async).
"""

import argparse
import time

import numpy as np
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
CHUNK = 8 << 20 >> 2  # MpiCommunicator's 8 MiB chunks, in floats


def shards(n: int, size: int) -> list:
    """Contiguous shard boundaries of n elements over size ranks, the first n % size one longer."""
    base, extra = divmod(n, size)
    bounds = [0]
    for r in range(size):
        bounds.append(bounds[-1] + base + (r < extra))
    return bounds


def buckets(n: int, bucket: int, bounds: list) -> list:
    """(start, parts) of each bucket: at most `bucket` elements, cut where shards meet."""
    out, start = [], 0
    while start < n:
        owner = next(r for r in range(len(bounds) - 1) if bounds[r] <= start < bounds[r + 1])
        end = min(start + bucket, bounds[owner + 1])
        parts = [0] * (len(bounds) - 1)
        parts[owner] = end - start
        out.append((start, parts))
        start = end
    return out


def straddling(n: int, bucket: int, bounds: list) -> list:
    """(start, parts) of buckets laid every `bucket` elements regardless of shards (a bucket may have two owners)."""
    out = []
    for start in range(0, n, bucket):
        end = min(start + bucket, n)
        parts = [max(0, min(end, bounds[r + 1]) - max(start, bounds[r])) for r in range(len(bounds) - 1)]
        out.append((start, parts))
    return out


def reduce_per_part(buf, parts, chunk=CHUNK):
    offset = 0
    for owner, p in enumerate(parts):
        for c in range(offset, offset + p, chunk):
            piece = buf[c : min(c + chunk, offset + p)]
            if owner == WORLD.rank:
                WORLD.Reduce(MPI.IN_PLACE, piece, op=MPI.SUM, root=owner)
            else:
                WORLD.Reduce(piece, None, op=MPI.SUM, root=owner)
        offset += p


def reduce_scatter_scratch(buf, parts, scratch):
    # windows of at most CHUNK elements, each cut into its intersections with the parts
    n, rank = sum(parts), WORLD.rank
    bounds = np.concatenate([[0], np.cumsum(parts)])
    for w in range(0, n, CHUNK):
        e = min(w + CHUNK, n)
        counts = [int(max(0, min(e, bounds[r + 1]) - max(w, bounds[r]))) for r in range(len(parts))]
        mine = counts[rank]
        WORLD.Reduce_scatter(buf[w:e], scratch[:mine], counts, op=MPI.SUM)
        if mine:
            lo = max(w, bounds[rank])
            buf[lo : lo + mine] = scratch[:mine]


def all_gather(buf, parts, chunk):
    n = sum(parts)
    bounds = np.concatenate([[0], np.cumsum(parts)])
    for w in range(0, n, chunk):
        e = min(w + chunk, n)
        counts = [int(max(0, min(e, bounds[r + 1]) - max(w, bounds[r]))) for r in range(len(parts))]
        displs = [int(max(w, min(e, bounds[r])) - w) for r in range(len(parts))]
        WORLD.Allgatherv(MPI.IN_PLACE, [buf[w:e], counts, displs, MPI.FLOAT])


def queued(start, calls) -> None:
    """Each call started as the step does (async, progressed between), then waited on once."""
    for args in calls:
        start(*args)
        start.__self__.progress()
    start.__self__.wait_all()


def measure(a, comm, n: int) -> None:
    """Times each side on a model of n floats, rounds alternated; rank 0 prints medians and spread."""
    rank, size = WORLD.rank, WORLD.size
    bucket = int(a.bucket_mb * (1 << 18))
    bounds = shards(n, size)
    plan = (buckets if a.layout == "cut" else straddling)(n, bucket, bounds)
    grads = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
    params = np.zeros(n, np.float32)
    params[bounds[rank] : bounds[rank + 1]] = 1.0
    scratch = np.zeros(bucket, np.float32)
    whole = [bounds[r + 1] - bounds[r] for r in range(size)]
    if a.via == "mpi4py":
        sides = {
            "allreduce": lambda: [WORLD.Allreduce(MPI.IN_PLACE, grads[s : s + sum(q)]) for s, q in plan],
            "reduce+gather": lambda: (
                [reduce_per_part(grads[s : s + sum(q)], q) for s, q in plan],
                all_gather(params, whole, CHUNK),
            ),
            "reduce_scatter+gather": lambda: (
                [reduce_scatter_scratch(grads[s : s + sum(q)], q, scratch) for s, q in plan],
                all_gather(params, whole, CHUNK),
            ),
            "gather (8 MiB)": lambda: all_gather(params, whole, CHUNK),
            "gather (whole)": lambda: all_gather(params, whole, (1 << 31) - 1),
            "reduce shards (8 MiB)": lambda: reduce_per_part(grads, whole, CHUNK),
            "reduce shards (whole)": lambda: reduce_per_part(grads, whole, (1 << 31) - 1),
        }
    else:
        sides = {
            "allreduce": lambda: [comm.allreduce_sum(grads[s : s + sum(q)]) for s, q in plan],
            "reduce_scatter+gather": lambda: (
                [comm.reduce_scatter_sum(grads[s : s + sum(q)], q) for s, q in plan],
                comm.all_gather(params, whole),
            ),
            "reduce_scatter": lambda: [comm.reduce_scatter_sum(grads[s : s + sum(q)], q) for s, q in plan],
            "gather": lambda: comm.all_gather(params, whole),
            "allreduce (async)": lambda: queued(comm.allreduce_sum_async, [(grads[s : s + sum(q)],) for s, q in plan]),
            "reduce_scatter (async)": lambda: queued(
                comm.reduce_scatter_sum_async, [(grads[s : s + sum(q)], q) for s, q in plan]
            ),
            "gather (async)": lambda: queued(comm.all_gather_async, [(params, whole)]),
        }
    times = {k: [] for k in sides}
    for fn in sides.values():  # warm-up: first touches, connection set-up
        fn()
    for _ in range(a.rounds):
        for name, fn in sides.items():
            WORLD.Barrier()
            t0 = time.perf_counter()
            fn()
            WORLD.Barrier()
            times[name].append((time.perf_counter() - t0) * 1e3)
    if rank == 0:
        print(f"{n / 1e6:g} M floats, {len(plan)} buckets ({a.layout}), {size} ranks, via {a.via}, {a.rounds} rounds:")
        base = np.median(times["allreduce"])
        for name, t in times.items():
            print(
                f"  {name:<24} median {np.median(t):8.2f} ms  (min {min(t):.2f}, max {max(t):.2f})"
                f"  {np.median(t) / base:5.2f}x allreduce",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="10e6,40e6", help="model sizes in floats, comma-separated")
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--via", choices=["mpi4py", "mgpu"], default="mpi4py")
    p.add_argument("--layout", choices=["cut", "straddle"], default="cut", help="buckets cut at shard bounds or not")
    a = p.parse_args()
    comm = None
    if a.via == "mgpu":
        import mgpu

        comm = mgpu.ProcessGroup().communicator()
    for n in (int(float(v)) for v in a.params.split(",")):
        measure(a, comm, n)


if __name__ == "__main__":
    main()
