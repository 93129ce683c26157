"""N ranks reproduce 1 rank. Written to pass at any world size: each rank trains
the distributed model and, alongside, a single-process reference on the whole
global batch; tests/test_launch.py runs this directory under mpirun -np 1, 2 and 3."""

import os

import numpy as np
import pytest
from mpi4py import MPI

import mgpu
from mgpu.train.data import Dataset, local_slice
from reference import rel_err

WORLD = MPI.COMM_WORLD


def test_world_size_is_what_the_launcher_asked_for():
    expected = os.environ.get("MGPU_EXPECT_WORLD")
    if expected is None:
        assert WORLD.Get_size() >= 1
    else:
        assert WORLD.Get_size() == int(expected)
    pg = mgpu.ProcessGroup()
    assert (pg.rank, pg.size) == (WORLD.Get_rank(), WORLD.Get_size())
    assert 0 <= pg.local_rank < pg.local_size <= pg.size


def run(pg, layers, loss, optimizer, global_batch, steps, dropout, shares=None, **opt):
    rng = np.random.default_rng(123)
    n = global_batch * steps
    x = rng.standard_normal((n, layers[0])).astype(np.float32)
    y = rng.standard_normal((n, layers[-1])).astype(np.float32) if loss == "mse" else rng.integers(0, layers[-1], n)
    model = mgpu.MLP(layers, seed=17, dropout=dropout, threads=1)
    trainer = mgpu.Trainer(
        model, loss=loss, optimizer=optimizer, process_group=pg, bucket_elems=50, batch_shares=shares, **opt
    )
    losses = []
    for t in range(steps):
        gx, gy = x[t * global_batch : (t + 1) * global_batch], y[t * global_batch : (t + 1) * global_batch]
        part = local_slice(global_batch, pg.rank, pg.size, shares)
        losses.append(trainer.step(gx[part], gy[part], global_batch=global_batch, first_sample=part.start))
    return model.get_parameters(), losses


CASES = [
    # layers, loss, optimizer, global batch (not divisible by 2 or 3), dropout, optimizer options
    ([9, 31, 17, 4], "mse", "sgd", 23, 0.0, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    ([9, 31, 17, 4], "mse", "adamw", 23, 0.0, dict(lr=0.01, weight_decay=0.01)),
    ([12, 40, 5], "cross_entropy", "sgd", 25, 0.0, dict(lr=0.1)),
    ([12, 40, 5], "cross_entropy", "adamw", 25, 0.3, dict(lr=0.01)),
    ([9, 64, 64, 2], "mse", "sgd", 7, 0.2, dict(lr=0.02, momentum=0.5)),
]


@pytest.mark.parametrize("layers, loss, optimizer, batch, dropout, opt", CASES)
def test_n_ranks_reproduce_one_rank(layers, loss, optimizer, batch, dropout, opt):
    pg = mgpu.ProcessGroup()
    params, losses = run(pg, layers, loss, optimizer, batch, 6, dropout, **opt)
    ref_params, ref_losses = run(mgpu.ProcessGroup(MPI.COMM_SELF), layers, loss, optimizer, batch, 6, dropout, **opt)
    for p, r in zip(params, ref_params):
        assert rel_err(p, r) < 1e-5
    assert np.allclose(losses, ref_losses, rtol=1e-5)
    # every rank holds bit-identical parameters
    flat = np.concatenate([p.ravel() for p in params])
    root = WORLD.bcast(flat, root=0)
    assert np.array_equal(flat, root)


def test_unequal_batch_shares_are_exact():
    pg = mgpu.ProcessGroup()
    shares = [1.0 + 2 * r for r in range(pg.size)]  # rank r gets (2r+1) parts
    params, _ = run(pg, [6, 20, 3], "mse", "sgd", 31, 4, 0.0, shares=shares, lr=0.05)
    ref, _ = run(mgpu.ProcessGroup(MPI.COMM_SELF), [6, 20, 3], "mse", "sgd", 31, 4, 0.0, lr=0.05)
    for p, r in zip(params, ref):
        assert rel_err(p, r) < 1e-5


def fit(pg, data_on_device, shares=None, accumulate=1):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((103, 8)).astype(np.float32)
    labels = rng.integers(0, 4, 103)
    data = Dataset("labels", x[:90], labels[:90], x[90:], labels[90:], num_classes=4)
    model = mgpu.MLP([8, 24, 4], seed=3, dropout=0.25, threads=1)
    trainer = mgpu.Trainer(
        model,
        loss="cross_entropy",
        optimizer="adamw",
        lr=0.01,
        process_group=pg,
        batch_shares=shares,
        accumulate=accumulate,
        data_on_device=data_on_device,
    )
    history = trainer.fit(data, batch_size=16, epochs=3, progress=False)  # 90 rows: a short last batch
    assert trainer.data_placement["resident"] == (data_on_device == "on")
    return np.concatenate([p.ravel() for p in model.get_parameters()]), [h["train_loss"] for h in history]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_resident_training_set_trains_as_rows_from_the_host(accumulate):
    pg = mgpu.ProcessGroup()
    shares = [1.0 + r for r in range(pg.size)]
    resident, resident_losses = fit(pg, "on", shares, accumulate)
    staged, staged_losses = fit(pg, "off", shares, accumulate)
    assert np.array_equal(resident, staged) and resident_losses == staged_losses
    alone, _ = fit(mgpu.ProcessGroup(MPI.COMM_SELF), "on", accumulate=accumulate)
    assert rel_err(resident, alone) < 1e-5


def test_collectives_of_the_core_communicator():
    pg = mgpu.ProcessGroup()
    comm = pg.communicator()
    assert (comm.rank, comm.size) == (pg.rank, pg.size)
    for n in (1, 1000, 3 * 1024 * 1024 + 7):
        buf = np.full(n, pg.rank + 1, np.float32)
        comm.allreduce_sum(buf)
        assert np.all(buf == pg.size * (pg.size + 1) / 2)
    for bucket in (1, 7, 1 << 20):
        buf = np.arange(1000, dtype=np.float32) + pg.rank
        comm.allreduce_sum_bucketed(buf, bucket)
        assert np.array_equal(buf, pg.size * np.arange(1000, dtype=np.float32) + pg.size * (pg.size - 1) / 2)
    b = np.arange(10, dtype=np.float32) * (pg.rank == 0)
    comm.broadcast(b, 0)
    assert np.array_equal(b, np.arange(10, dtype=np.float32))
    with pytest.raises(mgpu.ConfigError):
        comm.allreduce_sum(np.zeros(3))  # float64: the collective takes float32 element counts
    comm.barrier()


@pytest.mark.parametrize("timeout", [0.0, 60.0])  # MPI_Waitsome, or tests against a deadline
def test_async_allreduces_are_stamped_as_each_completes(timeout):
    # The last rank launches the second sum 0.3 s after the first (progressing the
    # first meanwhile): every rank stamps the first done well before the second.
    import time

    pg = mgpu.ProcessGroup()
    comm = pg.communicator()
    comm.timeout = timeout
    a, b = np.full(1000, pg.rank + 1, np.float32), np.full(5000, 2 * (pg.rank + 1), np.float32)
    pg.barrier()
    comm.start_collective_timing()
    comm.allreduce_sum_async(a)
    if pg.rank == pg.size - 1:
        late = time.monotonic() + 0.3
        while time.monotonic() < late:
            comm.progress()
    comm.allreduce_sum_async(b)
    comm.wait_all()
    times = comm.collective_times()
    total = pg.size * (pg.size + 1) / 2
    assert np.all(a == total) and np.all(b == 2 * total)
    if pg.size == 1:  # no MPI at all: the local communicator's sums are done at once, unstamped
        assert comm.name == "local" and times == []
        return
    assert len(times) == 2 and all(0 <= launch <= done for launch, done in times)
    assert times[1][1] - times[0][1] > 0.2, times
    assert comm.collective_times() == []  # the stamping ended
    comm.timeout = 0.0


def test_distributed_evaluate_matches_local():
    pg = mgpu.ProcessGroup()
    rng = np.random.default_rng(9)
    x = rng.standard_normal((101, 8)).astype(np.float32)
    y = rng.integers(0, 4, 101)
    model = mgpu.MLP([8, 16, 4], seed=1)
    dist = mgpu.Trainer(model, loss="cross_entropy", process_group=pg).evaluate(x, y)
    local = mgpu.Trainer(model, loss="cross_entropy", process_group=mgpu.ProcessGroup(MPI.COMM_SELF)).evaluate(x, y)
    assert dist["accuracy"] == local["accuracy"]
    assert dist["loss"] == pytest.approx(local["loss"], rel=1e-6)
