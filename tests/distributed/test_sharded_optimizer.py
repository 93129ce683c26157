"""The sharded optimizer (ZeRO-1, TrainerConfig(shard_optimizer=True)) equals the
unsharded one at this world size, and 1 rank; each rank keeps 1/N of the state;
checkpoints of either kind resume as the other, at this world size and on one
rank. Written to pass at any world size (tests/test_launch.py runs this directory
under mpirun -np 1, 2 and 3)."""

import numpy as np
import pytest
from mpi4py import MPI

import mgpu
from mgpu.train.data import local_slice
from mgpu.train.schedule import LRSchedule
from mgpu.train.trainer import CheckpointPolicy
from reference import rel_err

WORLD = MPI.COMM_WORLD
STEPS = 50


def data(layers, loss, n, seed=5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, layers[0])).astype(np.float32)
    y = rng.standard_normal((n, layers[-1])).astype(np.float32) if loss == "mse" else rng.integers(0, layers[-1], n)
    return x, y


def make(pg, layers, loss, optimizer, dropout=0.0, **opt):
    model = mgpu.MLP(layers, seed=17, dropout=dropout, threads=1)
    return model, mgpu.Trainer(model, loss=loss, optimizer=optimizer, process_group=pg, bucket_elems=64, **opt)


def steps(trainer, x, y, batch, first, last, shares=None):
    pg = trainer.pg
    losses = []
    for t in range(first, last):
        gx, gy = x[t * batch : (t + 1) * batch], y[t * batch : (t + 1) * batch]
        part = local_slice(batch, pg.rank, pg.size, shares)
        losses.append(trainer.step(gx[part], gy[part], global_batch=batch, first_sample=part.start))
    return losses


def run(pg, layers, loss, optimizer, batch, dropout=0.0, shares=None, **opt):
    x, y = data(layers, loss, batch * STEPS)
    model, trainer = make(pg, layers, loss, optimizer, dropout, batch_shares=shares, **opt)
    losses = steps(trainer, x, y, batch, 0, STEPS, shares)
    return np.concatenate([p.ravel() for p in model.get_parameters()]), losses, trainer


CASES = [
    # layers, loss, optimizer, global batch (not divisible by 2 or 3), dropout, options
    ([9, 31, 17, 4], "mse", "sgd", 23, 0.0, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    ([9, 31, 17, 4], "mse", "adamw", 23, 0.0, dict(lr=0.01, weight_decay=0.01, max_grad_norm=0.05)),
    ([12, 40, 5], "cross_entropy", "sgd", 25, 0.3, dict(lr=0.1, accumulate=2)),
    ([12, 40, 5], "cross_entropy", "adamw", 25, 0.0, dict(lr=0.01, schedule=LRSchedule(0.01, "cosine", 5, 1, 1, 50))),
    ([3, 2], "mse", "adamw", 7, 0.0, dict(lr=0.01)),  # 8 parameters: fewer than 4 a rank at 3 ranks
]


@pytest.mark.parametrize("layers, loss, optimizer, batch, dropout, opt", CASES)
def test_sharded_equals_unsharded_and_one_rank(layers, loss, optimizer, batch, dropout, opt):
    pg = mgpu.ProcessGroup()
    sharded, sharded_losses, trainer = run(pg, layers, loss, optimizer, batch, dropout, shard_optimizer=True, **opt)
    plain, plain_losses, _ = run(pg, layers, loss, optimizer, batch, dropout, **opt)
    one, one_losses, _ = run(mgpu.ProcessGroup(MPI.COMM_SELF), layers, loss, optimizer, batch, dropout, **opt)
    assert trainer.shards_optimizer == (pg.size > 1)
    assert rel_err(sharded, plain) < 1e-6
    assert np.allclose(sharded_losses, plain_losses, rtol=1e-6)
    assert rel_err(sharded, one) < 1e-5
    assert np.allclose(sharded_losses, one_losses, rtol=1e-5)
    assert np.array_equal(sharded, WORLD.bcast(sharded, root=0))  # every rank holds the same parameters


def test_uneven_batch_shares_shard_exactly():
    pg = mgpu.ProcessGroup()
    shares = [1.0 + 2 * r for r in range(pg.size)]
    sharded, _, _ = run(pg, [6, 20, 3], "mse", "adamw", 31, shares=shares, lr=0.01, shard_optimizer=True)
    plain, _, _ = run(pg, [6, 20, 3], "mse", "adamw", 31, shares=shares, lr=0.01)
    assert rel_err(sharded, plain) < 1e-6


def test_each_rank_keeps_its_share_of_the_optimizer_state():
    pg = mgpu.ProcessGroup()
    layers = [30, 64, 64, 5]
    model, trainer = make(pg, layers, "mse", "adamw", shard_optimizer=True)
    x, y = data(layers, "mse", 16)
    steps(trainer, x, y, 16, 0, 1)
    params = model.num_params
    held = WORLD.allgather(trainer.optimizer_state_elements)
    assert sum(held) == params  # the shards cover the parameters once
    assert max(held) <= -(-params // pg.size) + 4  # balanced by elements (starts aligned to 16 bytes)
    whole = trainer.optimizer_state()
    assert set(whole) == {"opt.exp_avg", "opt.exp_avg_sq"}
    assert all(a.shape == (params,) for a in whole.values())
    assert np.array_equal(whole["opt.exp_avg"], WORLD.bcast(whole["opt.exp_avg"], root=0))
    if pg.size > 1:  # rank 0's state() cannot gather the shards alone: it says so instead of hanging
        with pytest.raises(mgpu.ConfigError, match="collectively"):
            trainer.state({})


def shared_dir(tmp_path):
    return WORLD.bcast(str(tmp_path) if WORLD.Get_rank() == 0 else None, root=0)


@pytest.mark.parametrize("save_sharded, resume_sharded", [(True, False), (False, True), (True, True)])
def test_checkpoints_resume_sharded_or_not(tmp_path, save_sharded, resume_sharded):
    pg = mgpu.ProcessGroup()
    layers, batch = [9, 31, 17, 4], 23
    x, y = data(layers, "mse", batch * 12)
    opt = dict(lr=0.01, weight_decay=0.01)
    directory = shared_dir(tmp_path)
    model, trainer = make(pg, layers, "mse", "adamw", shard_optimizer=save_sharded, **opt)
    steps(trainer, x, y, batch, 0, 6)
    compat = trainer._compat(None, None, None)
    path = trainer.save_checkpoint(CheckpointPolicy(directory), compat)
    steps(trainer, x, y, batch, 6, 12)
    uninterrupted = np.concatenate([p.ravel() for p in model.get_parameters()])

    resumed_model, resumed = make(pg, layers, "mse", "adamw", shard_optimizer=resume_sharded, **opt)
    resumed.load_checkpoint(path, compat)
    steps(resumed, x, y, batch, 6, 12)
    again = np.concatenate([p.ravel() for p in resumed_model.get_parameters()])
    assert rel_err(again, uninterrupted) < 1e-6
    if save_sharded == resume_sharded:  # the same run continued: bit for bit
        assert np.array_equal(again, uninterrupted)

    # The checkpoint is an ordinary one: one rank alone continues it.
    if pg.rank == 0:
        solo_model, solo = make(mgpu.ProcessGroup(MPI.COMM_SELF), layers, "mse", "adamw", **opt)
        solo.load_checkpoint(path, compat)
        steps(solo, x, y, batch, 6, 12)
        assert rel_err(np.concatenate([p.ravel() for p in solo_model.get_parameters()]), uninterrupted) < 1e-5
    WORLD.Barrier()


def test_a_traced_sharded_step_names_its_collectives():
    # The tail's spans tile it: the reduce-scatter's wait, the health check (with its
    # all-gather of the shares), the shard's update, the parameters' all-gather.
    pg = mgpu.ProcessGroup()
    layers = [9, 31, 17, 4]
    x, y = data(layers, "mse", 23)
    _, trainer = make(pg, layers, "mse", "adamw", shard_optimizer=True)
    part = local_slice(23, pg.rank, pg.size)
    trainer.step(x[part], y[part], global_batch=23, first_sample=part.start, trace=True)
    result = trainer.last_result
    spans = [s for s in result.spans + trainer.drain_trace() if s.micro == -1 and s.name != "stage"]
    tail = [s.name for s in spans if not s.name.startswith(("forward", "backward", "loss"))]
    if pg.size == 1:  # nothing to shard
        assert tail == ["allreduce wait", "health check", "optimizer"]
        return
    assert tail == ["reduce-scatter wait", "health check", "optimizer", "all-gather"]
    ends = [s.end for s in spans]
    assert ends == sorted(ends)
    t = result.timings
    assert min(t.forward, t.backward, t.comm_wait, t.optimizer) >= 0
    assert t.forward + t.backward + t.comm_wait + t.optimizer <= t.total * 1.001
