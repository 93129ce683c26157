"""Worker for tests/gpu/test_nccl.py, run under mpirun: trains on the CUDA
backend with the NCCL (or MPI) communicator and checks the result against a
single-process run of the whole global batch; prints OK on success. A mode
ending in "+graph" captures the steps (CUDA graphs): several ranks replay the
micro-batch's graph, allreduce, then replay the tail's (verdict and update);
the single-process reference replays one graph for the whole step. Mode
"sharded": reduce-scatter and all-gather (tests/sharded.py) instead of training;
"sharded-fault": one reduce-scatter at step 7 that must end in a CommError
(MGPU_EMULATE_NCCL_FAULT), printed as "SAID <message>"."""

import os
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mgpu  # noqa: E402
from mgpu import _core  # noqa: E402
from mgpu.errors import ConfigError  # noqa: E402
from mgpu.train.data import local_slice  # noqa: E402
from reference import rel_err  # noqa: E402
from sharded import check_sharded  # noqa: E402

SIZES, BATCH, STEPS = [12, 48, 48, 5], 30, 15


def train(comm, first, rows, gpu, graph="off"):
    model = _core.MLP(_core.make_backend("cuda", gpu), SIZES, 0.2, 11)
    step = _core.DataParallelStep(
        model,
        _core.Optimizer(model, "sgd", momentum=0.9),
        comm,
        "cross_entropy",
        _core.StepOptions(bucket_elems=600, graph=graph, max_grad_norm=0.5),
    )
    step.broadcast_parameters(0)
    rng = np.random.default_rng(5)
    losses = []
    for t in range(STEPS):
        x = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32)
        y = rng.integers(0, SIZES[-1], BATCH)
        r = step.step([(x[first : first + rows], y[first : first + rows], first)], BATCH, t, 0.05)
        losses.append(r.loss)
    assert step.uses_graphs == (graph == "on") and step.graph_fallback == ""
    return model.get_parameters(), losses


def host_syncs_per_step(comm, gpu, steps=4):
    """On the emulation: host synchronisations per steady-state step, and the buckets."""
    model = _core.MLP(_core.make_backend("cuda", gpu), SIZES, 0.0, 11)
    step = _core.DataParallelStep(
        model, _core.Optimizer(model, "sgd"), comm, "cross_entropy", _core.StepOptions(bucket_elems=600)
    )
    x = np.random.default_rng(1).standard_normal((BATCH, SIZES[0])).astype(np.float32)
    y = np.arange(BATCH) % SIZES[-1]
    for t in range(2 + steps):
        if t == 2:
            before = _core.emulation.counters()["host_syncs"]
        step.step([(x, y, 0)], BATCH * comm.size, t, 0.05)
    return (_core.emulation.counters()["host_syncs"] - before) / steps, len(step.buckets())


def main(mode):
    mode, _, extra = mode.partition("+")
    graph = "on" if extra == "graph" else "off"
    pg = mgpu.ProcessGroup()
    if mode == "nccl-expect-config-error":
        try:
            pg.communicator("nccl")
        except ConfigError as e:
            assert "share" in str(e) and "--comm mpi" in str(e), e
            print("OK", flush=True)
            return
        raise SystemExit("expected a ConfigError for ranks sharing a GPU")
    comm = pg.communicator("mpi" if mode == "mpi" else "nccl")
    comm.timeout = 60.0
    if mode == "sharded-fault":
        comm.timeout = 3.0
        comm.begin_step(7)
        try:
            comm.reduce_scatter_sum(np.ones(12, np.float32), [5, 7] if pg.size == 2 else [12] + [0] * (pg.size - 1))
        except _core.CommError as e:
            sys.stdout.write(f"SAID {e}\n")
            sys.stdout.flush()
        MPI.COMM_WORLD.Barrier()  # each rank says its own error before any exits (mpirun then ends the job)
        # No MPI_Finalize: the peer's half of the aborted collective may still be pending in MPI.
        os._exit(0)
    if mode == "sharded":
        exact = pg.size <= 2 or _core.build_info().get("gpu_emulation", False)
        for form in ("sync", "async"):
            check_sharded(comm, form, exact)
        MPI.COMM_WORLD.Barrier()
        print("OK", flush=True)
        return
    part = local_slice(BATCH, pg.rank, pg.size)
    first, rows = part.start, part.stop - part.start
    if mode == "nccl-zero-rows":  # the last rank gets no rows: its buckets must group like the others'
        first, rows = (BATCH, 0) if pg.rank == pg.size - 1 else (0, BATCH) if pg.rank == 0 else (BATCH, 0)
    _, gpu = pg.resolve_device("cuda")
    params, losses = train(comm, first, rows, gpu, graph)
    ref_params, ref_losses = train(_core.LocalCommunicator(), 0, BATCH, gpu, graph)
    assert rel_err(params, ref_params) < 1e-5, rel_err(params, ref_params)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    if mode == "mpi" and _core.build_info().get("gpu_emulation", False):
        syncs, buckets = host_syncs_per_step(comm, gpu)
        # One write with its newline: under PYTHONUNBUFFERED print() writes the text and
        # the newline apart, and the two ranks' lines then glue together.
        sys.stdout.write(f"SYNCS {syncs} BUCKETS {buckets}\n")
        sys.stdout.flush()
    x = np.full(10, pg.rank + 1, np.float32)
    comm.allreduce_sum(x)
    assert np.all(x == pg.size * (pg.size + 1) / 2)
    MPI.COMM_WORLD.Barrier()
    print("OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
