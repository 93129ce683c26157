"""A/B of a bare MPI_Allreduce (mpi4py) on 4 KiB pages and on 2 MiB pages (madvise
MADV_HUGEPAGE, as mgpu's CPU buffers), by message size, rounds alternated: the
measurement behind MpiCommunicator's 8 MiB allreduce chunks and the huge pages of mgpu's
CPU buffers (docs/journal.md, 2026-11-24).

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \\
        mpirun -np 2 .venv/bin/python scripts/experiments/allreduce_pages.py [--sizes-mb 4,8,16,32,64]
"""

import argparse
import mmap
import time

import numpy as np
from mpi4py import MPI


def huge_page_buffer(count: int):
    """count float32 zeros on 2 MiB-aligned memory advised to use huge pages (and its mapping)."""
    region = mmap.mmap(-1, count * 4 + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(region, np.float32)
    start = (-whole.ctypes.data % (2 << 20)) // 4
    buf = whole[start : start + count]
    buf[:] = 0
    return buf, region


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", default="4,8,16,32,64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=6)
    a = p.parse_args()
    world = MPI.COMM_WORLD
    for mb in (int(v) for v in a.sizes_mb.split(",")):
        count = mb << 18
        small = np.zeros(count, np.float32)
        small[:] = 0  # touched: faulted in before timing
        big, _region = huge_page_buffer(count)
        times = {"4 KiB pages": [], "2 MiB pages": []}
        for _ in range(a.rounds):
            for name, buf in (("4 KiB pages", small), ("2 MiB pages", big)):
                world.Barrier()
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                times[name].append((time.perf_counter() - t0) / a.iters * 1e3)
        if world.Get_rank() == 0:
            print(
                f"{mb:>4} MB  " + "  ".join(f"{k}: {', '.join(f'{t:.2f}' for t in v)} ms" for k, v in times.items()),
                flush=True,
            )


if __name__ == "__main__":
    main()
