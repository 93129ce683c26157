"""The sharded optimizer (ZeRO-1) on GPUs: 2 GPUs driven by threads (NCCL from
ncclCommInitAll) and by 2 processes (NCCL, and MPI staged through the host)
train as the unsharded step does, with CUDA graphs, half-precision GEMMs, fp16
loss scaling and bf16/fp16 gradient compression; each GPU holds half the
optimizer state; a steady step still synchronises the host once."""

import sys

import numpy as np
import pytest

import mgpu
from conftest import mpi_env, mpirun  # tests/conftest.py helpers
from mgpu import _core
from reference import rel_err

EMULATED = _core.build_info().get("gpu_emulation", False)
LAYERS = [12, 48, 32, 3]
BATCH = 32


def needs_two_gpus():
    if _core.cuda_device_count() < 2:
        pytest.skip("needs 2 GPUs (MGPU_EMULATE_GPU=2 on the emulation)")


def batches(steps, layers, seed=4):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.standard_normal((BATCH, layers[0])).astype(np.float32),
            rng.standard_normal((BATCH, layers[-1])).astype(np.float32),
        )
        for _ in range(steps)
    ]


def train_on_two_gpus(shard, steps=8, precision="fp32", graph="off", layers=LAYERS, **opt):
    """Per rank: (parameters, losses, optimizer state elements, device bytes in use, host syncs of the last steps)."""
    data = batches(steps, layers)

    def run(pg):
        model = mgpu.MLP(layers, seed=2, device="cuda", device_index=pg.local_rank, precision=precision)
        trainer = mgpu.Trainer(
            model, optimizer="adamw", lr=1e-2, process_group=pg, graph=graph, shard_optimizer=shard, **opt
        )
        half = BATCH // pg.size
        part = slice(half * pg.rank, half * (pg.rank + 1))
        losses, syncs = [], 0
        for t, (x, y) in enumerate(data):
            if t == steps - 3 and EMULATED:  # the process's count, read while no rank steps
                pg.barrier()
                before = _core.emulation.counters()["host_syncs"]
                pg.barrier()
            losses.append(trainer.step(x[part], y[part], global_batch=BATCH, first_sample=part.start))
        if EMULATED:
            pg.barrier()
            syncs = _core.emulation.counters()["host_syncs"] - before
            pg.barrier()  # reading the memory in use below synchronises too
        free, total = _core.cuda_memory_info(pg.local_rank)
        params = np.concatenate([a.ravel() for a in model.get_parameters()])
        return params, losses, trainer.optimizer_state_elements, total - free, syncs

    return mgpu.run_on_gpus(run, gpus=2)


@pytest.mark.parametrize(
    "precision, graph, opt",
    [
        ("fp32", "off", {}),
        ("fp32", "on", {"max_grad_norm": 0.05}),
        ("bf16", "on", {}),  # the all-gathered shards must reach the bf16 weight copy
        ("fp16", "off", {}),  # dynamic loss scaling: overflowing steps skipped on every rank alike
    ],
)
def test_two_gpus_sharded_train_as_unsharded(gpu, precision, graph, opt):
    needs_two_gpus()
    sharded = train_on_two_gpus(True, precision=precision, graph=graph, **opt)
    plain = train_on_two_gpus(False, precision=precision, graph=graph, **opt)
    for (p, losses, *_), (q, plain_losses, *_) in zip(sharded, plain):
        assert rel_err(p, q) < 1e-6
        np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    assert np.array_equal(sharded[0][0], sharded[1][0])


def test_each_gpu_holds_half_the_optimizer_state(gpu):
    needs_two_gpus()
    layers = [64, 512, 512, 8]  # 300k parameters: AdamW's state is 2.4 MB
    sharded = train_on_two_gpus(True, steps=3, layers=layers)
    plain = train_on_two_gpus(False, steps=3, layers=layers)
    params = sum(a * b + b for a, b in zip(layers, layers[1:]))
    assert [r[2] for r in plain] == [params, params]
    assert sum(r[2] for r in sharded) == params and max(r[2] for r in sharded) <= params // 2 + 4
    for s, p in zip(sharded, plain):  # device memory: two states of the other half are not held
        saved = p[3] - s[3]
        assert saved >= 0.9 * 2 * 4 * (params - s[2]), (saved, params)


def test_a_sharded_steady_step_synchronises_the_host_once(gpu):
    if not EMULATED:
        pytest.skip("counts host synchronisations on the emulation")
    needs_two_gpus()
    sharded = train_on_two_gpus(True, steps=6)
    plain = train_on_two_gpus(False, steps=6)
    # both threads count in this process: 2 GPUs x 3 steps, one read-back each
    assert sharded[0][4] == plain[0][4] == 6


ARGS = ["--dataset", "digits", "--layers", "64,32,10", "--batch-size", "64", "--optimizer", "adamw", "--lr", "0.01"]


def train_processes(tmp_path, name, *extra, steps=10):
    params = tmp_path / f"{name}.npz"
    r = mpirun(
        2,
        [sys.executable, "-m", "mgpu", "train", *ARGS, "--steps", str(steps), "--device", "cuda", "--no-progress"]
        + ["--save", params, *extra],
        timeout=600,
        env=mpi_env(),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    with np.load(params) as z:
        return r, np.concatenate([z[k].ravel() for k in sorted(z.files)])


# (ids without "mpi": pytest-mpi would skip a test with that keyword unless --with-mpi)
@pytest.mark.parametrize("comm", ["nccl", "mpi"], ids=["nccl", "staged"])
def test_two_processes_sharded_train_as_unsharded(two_gpus, tmp_path, comm):
    r, sharded = train_processes(tmp_path, "sharded", "--comm", comm, "--shard-optimizer")
    assert "optimizer sharded 2 ways" in r.stdout
    _, plain = train_processes(tmp_path, "plain", "--comm", comm)
    assert rel_err(sharded, plain) < 1e-6


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_compressed_gradients_reduce_scatter_as_they_allreduce(two_gpus, tmp_path, dtype):
    # The emulation sums the half values of every rank in rank order either way: the same bits.
    extra = ("--comm", "nccl", "--grad-dtype", dtype)
    _, sharded = train_processes(tmp_path, "sharded", *extra, "--shard-optimizer", steps=6)
    _, plain = train_processes(tmp_path, "plain", *extra, steps=6)
    assert rel_err(sharded, plain) < 1e-6


def test_a_traced_sharded_step_on_two_gpus_stamps_its_reduce_scatters(gpu):
    # Each bucket's reduce-scatter is one stamped collective, the tail's all-gathers after them.
    needs_two_gpus()
    x, y = batches(1, LAYERS)[0]

    def run(pg):
        model = mgpu.MLP(LAYERS, seed=2, device="cuda", device_index=pg.local_rank)
        trainer = mgpu.Trainer(model, lr=1e-2, process_group=pg, graph="off", shard_optimizer=True, bucket_elems=300)
        part = slice(16 * pg.rank, 16 * (pg.rank + 1))
        for t in range(3):
            trainer.step(x[part], y[part], global_batch=BATCH, first_sample=part.start, trace=t == 2)
        r = trainer.last_result
        names = [s.name for s in r.spans + trainer.drain_trace() if s.step == 2]
        return [(b.launch, b.done) for b in r.buckets], names, len(trainer._step.buckets())

    for stamps, names, buckets in mgpu.run_on_gpus(run, gpus=2):
        assert buckets > 1 and len(stamps) == buckets
        assert all(0 <= launch <= done for launch, done in stamps), stamps
        assert names.index("reduce-scatter wait") < names.index("optimizer") < names.index("all-gather")


def train_with_reads_between_steps(shard, graph="off", steps=6, precision="fp32"):
    """Per rank: (whether the parameters were still being gathered after each step,
    the model's outputs read between steps, the final parameters). Between steps
    the run reads the model (an evaluation-mode forward, the parameters, written
    back) and traces one step."""
    data = batches(steps, LAYERS)

    def run(pg):
        model = mgpu.MLP(LAYERS, seed=2, device="cuda", device_index=pg.local_rank, precision=precision)
        trainer = mgpu.Trainer(model, optimizer="adamw", lr=1e-2, process_group=pg, graph=graph, shard_optimizer=shard)
        part = slice(16 * pg.rank, 16 * (pg.rank + 1))
        deferred, outputs = [], []
        for t, (x, y) in enumerate(data):
            trainer.step(x[part], y[part], global_batch=BATCH, first_sample=part.start, trace=t == 4)
            deferred.append(model._core.parameters_deferred)
            if t == 1:
                outputs.append(model.forward(x))
            if t == 3:
                model.set_parameters(model.get_parameters())
            assert t in (1, 3) or deferred[-1] == model._core.parameters_deferred
        return deferred, outputs, np.concatenate([a.ravel() for a in model.get_parameters()])

    return mgpu.run_on_gpus(run, gpus=2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_parameters_are_gathered_into_the_next_forward_layer_by_layer(gpu, precision):
    # With NCCL a sharded step leaves its parameters' all-gathers in flight, one per layer,
    # and the next forward waits for each layer just before it (bf16: each layer's half
    # copy cast once it arrived); anything else that reads or writes the parameters, and
    # a traced step, waits for all of them. The emulation's happens-before checker fails
    # the test on any access that does not wait; the results are the unsharded run's.
    needs_two_gpus()
    sharded = train_with_reads_between_steps(True, precision=precision)
    plain = train_with_reads_between_steps(False, precision=precision)
    captured = train_with_reads_between_steps(True, graph="on", precision=precision)
    for (deferred, outputs, p), (plain_deferred, plain_outputs, q), (graph_deferred, *_) in zip(
        sharded, plain, captured
    ):
        assert deferred == [True, True, True, True, False, True]  # the traced step gathers at once
        assert not any(plain_deferred) and not any(graph_deferred)  # graphs replay whole: gathered at once
        assert rel_err(p, q) < 1e-6
        np.testing.assert_allclose(outputs[0], plain_outputs[0], rtol=1e-5, atol=1e-6)
    assert np.array_equal(sharded[0][2], sharded[1][2])


def test_ranks_that_trace_different_steps_issue_the_same_gathers(gpu):
    # Tracing is a rank's own business: a traced step waits for its gathers where an
    # untraced one leaves them in flight, but both issue the same NCCL groups (the
    # emulation fails a group whose ranks' calls differ).
    needs_two_gpus()
    data = batches(4, LAYERS)

    def run(pg, shard):
        model = mgpu.MLP(LAYERS, seed=2, device="cuda", device_index=pg.local_rank)
        trainer = mgpu.Trainer(model, lr=1e-2, process_group=pg, graph="off", shard_optimizer=shard)
        part = slice(16 * pg.rank, 16 * (pg.rank + 1))
        for t, (x, y) in enumerate(data):
            trainer.step(x[part], y[part], global_batch=BATCH, first_sample=part.start, trace=t == 1 + pg.rank)
        return np.concatenate([a.ravel() for a in model.get_parameters()])

    sharded = mgpu.run_on_gpus(lambda pg: run(pg, True), gpus=2)
    plain = mgpu.run_on_gpus(lambda pg: run(pg, False), gpus=2)
    for p, q in zip(sharded, plain):
        assert rel_err(p, q) < 1e-6
