"""A sharded optimizer's collectives (Communicator.reduce_scatter_sum and
all_gather, sync and async) checked against numpy on every rank of a
communicator: uneven parts, an empty part, one part on every rank. Shared by
tests/gpu/test_nccl.py (threads of one process) and its mpirun worker."""

import numpy as np


def layouts(size):
    """Parts (one per rank) that cover the cases: uneven with a part on every
    rank; the first or the last rank owning nothing; everything on one rank."""
    out = [[5 + 3 * r for r in range(size)]]
    if size > 1:
        out.append([0] + [4 + r for r in range(1, size)])
        out.append([6 + 2 * r for r in range(size - 1)] + [0])
        out.append([0] * (size - 1) + [9])
    return out


def inputs(parts, size, seed):
    """Every rank's input (each rank draws all of them: the expected values need them)."""
    return [np.random.default_rng(seed * 100 + r).standard_normal(sum(parts)).astype(np.float32) for r in range(size)]


def check_sharded(comm, form, exact):
    """Runs every layout's reduce-scatter and all-gather on `comm` (form "sync"
    or "async": queued, then wait_all) and asserts what each rank's parts must
    hold; values outside a reduce-scatter's own part are not looked at. exact:
    the sums equal numpy's float32 sums in rank order bit for bit (two ranks,
    where a + b is the only order, or the emulation); else within rounding."""
    rank, size = comm.rank, comm.size
    for seed, parts in enumerate(layouts(size)):
        xs = inputs(parts, size, seed)
        bounds = np.cumsum([0, *parts])
        mine = slice(bounds[rank], bounds[rank + 1])
        expected = xs[0].copy()
        for x in xs[1:]:
            expected += x  # float32, in rank order

        x = xs[rank].copy()
        if form == "sync":
            comm.reduce_scatter_sum(x, parts)
        else:
            comm.reduce_scatter_sum_async(x, parts)
            comm.wait_all()
        if exact:
            np.testing.assert_array_equal(x[mine], expected[mine], err_msg=f"rank {rank} parts {parts}")
        else:
            np.testing.assert_allclose(x[mine], expected[mine], rtol=1e-6, atol=1e-6, err_msg=f"parts {parts}")

        # All-gather: each rank holds only its own part (NaN elsewhere); every part must arrive.
        owned = np.concatenate([xs[r][bounds[r] : bounds[r + 1]] for r in range(size)])
        g = np.full(sum(parts), np.nan, np.float32)
        g[mine] = xs[rank][mine]
        if form == "sync":
            comm.all_gather(g, parts)
        else:
            comm.all_gather_async(g, parts)
            comm.wait_all()
        np.testing.assert_array_equal(g, owned, err_msg=f"rank {rank} parts {parts}")
