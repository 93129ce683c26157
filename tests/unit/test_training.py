"""Single-process training: optimizers against the reference, the bucket plan,
exact averaging of uneven shards, and convergence on digits."""

import numpy as np
import pytest

import mgpu
from mgpu import _core
from mgpu.train.data import load_dataset
from reference import SGD, AdamW, loss_and_grad, rel_err


def local_group():
    return mgpu.ProcessGroup(comm=__import__("mpi4py.MPI", fromlist=["MPI"]).COMM_SELF)


@pytest.mark.parametrize(
    "opt, kwargs, ref",
    [
        ("sgd", dict(lr=0.05), lambda: SGD(0.05)),
        ("sgd", dict(lr=0.05, momentum=0.9, weight_decay=0.01), lambda: SGD(0.05, 0.9, 0.01)),
        ("adamw", dict(lr=0.01, weight_decay=0.05), lambda: AdamW(0.01, weight_decay=0.05)),
        (
            "adamw",
            dict(lr=0.003, weight_decay=0.0, betas=(0.8, 0.95), eps=1e-6),
            lambda: AdamW(0.003, (0.8, 0.95), 1e-6, 0.0),
        ),
    ],
)
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_optimizer_steps_match_reference(opt, kwargs, ref, loss):
    layers = [6, 10, 4]
    model = mgpu.MLP(layers, seed=5, threads=1)
    trainer = mgpu.Trainer(model, loss=loss, optimizer=opt, process_group=local_group(), **kwargs)
    rng = np.random.default_rng(1)
    params = [p.astype(np.float64) for p in model.get_parameters()]
    reference = ref()
    for _step in range(8):
        x = rng.standard_normal((11, 6)).astype(np.float32)
        y = rng.standard_normal((11, 4)).astype(np.float32) if loss == "mse" else rng.integers(0, 4, 11)
        value = trainer.step(x, y)
        ref_value, grads = loss_and_grad(params, x, y, loss)
        assert value == pytest.approx(ref_value, rel=1e-5)
        params = reference.step(params, grads)
    for p, r in zip(model.get_parameters(), params):
        assert rel_err(p, r) < 1e-5


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_uneven_shards_average_exactly(loss):
    """Two shards of 3 and 8 rows stepped by hand give the same gradient as 11 rows at once."""
    layers = [4, 7, 3]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((11, 4)).astype(np.float32)
    y = rng.standard_normal((11, 3)).astype(np.float32) if loss == "mse" else rng.integers(0, 3, 11).astype(np.int64)
    whole = mgpu.MLP(layers, seed=2)
    whole.loss_and_grad(x, y, loss)
    # sum-then-divide: shard gradients of the mean weighted by shard size
    a, b = mgpu.MLP(layers, seed=2), mgpu.MLP(layers, seed=2)
    a.loss_and_grad(x[:3], y[:3], loss)
    b.loss_and_grad(x[3:], y[3:], loss)
    for g, ga, gb in zip(whole.get_gradients(), a.get_gradients(), b.get_gradients()):
        assert rel_err(g, (3 * ga + 8 * gb) / 11) < 1e-5
    # and the core step uses exactly that: shard of 3 rows of a global batch of 11,
    # with the other 8 rows missing, gives 3/11 of the shard's mean gradient (each
    # loss divides by the global batch, not by the rows this rank holds)
    m = mgpu.MLP(layers, seed=2)
    step = _core.DataParallelStep(m._core, _core.Optimizer(m._core, "sgd"), _core.LocalCommunicator(), loss)
    before = m.get_parameters()
    step.step([(x[:3], y[:3], 0)], 11, 0, 1.0)
    for p0, p1, ga in zip(before, m.get_parameters(), a.get_gradients()):
        assert rel_err(p0 - p1, 3 * ga / 11) < 1e-5


@pytest.mark.parametrize("bucket_elems", [1, 10, 64, 100, 1000, 1 << 20])
@pytest.mark.parametrize("layers", [[3, 2], [8, 16, 4], [5, 9, 7, 3], [50, 256, 128, 64, 3]])
def test_bucket_plan_covers_the_gradient_buffer_once_in_backward_order(layers, bucket_elems):
    m = mgpu.MLP(layers)
    step = _core.DataParallelStep(
        m._core,
        _core.Optimizer(m._core, "sgd"),
        _core.LocalCommunicator(),
        "mse",
        _core.StepOptions(bucket_elems=bucket_elems),
    )
    buckets = step.buckets()
    assert _core.plan_buckets(layers, bucket_elems) == buckets  # what the performance model and traces use
    covered = sorted((off, off + n) for off, n, _ in buckets)
    assert covered[0][0] == 0 and covered[-1][1] == m.num_params + 2  # + the loss and stop slots
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    assert all(0 < n <= max(bucket_elems, 1) for _, n, _ in buckets)
    offsets = [off for off, _, _ in buckets]
    assert offsets == sorted(offsets, reverse=True), "launched from the end of the buffer"
    ready = [r for _, _, r in buckets]
    assert ready == sorted(ready, reverse=True)
    starts = [w for w, _ in m._core.layer_offsets()]
    for off, _n, r in buckets:  # ready once layer r is done: it touches no layer below r
        assert off >= starts[r]
    if bucket_elems >= 4:  # collectives read 16-byte aligned vectors whatever the layer sizes
        assert all(off % 4 == 0 for off in offsets), offsets


def walked_bucket_plan(sizes, extra_slots, bucket_elems):
    """The plan the way the trainer describes it, one bucket at a time: from the
    buffer's end, cut full buckets out of a layer that overflows the open one
    (cuts rounded up to 4 elements for buckets of >= 4), close the open bucket
    at a layer boundary once half full, and at layer 0."""
    start = [0]
    for a, b in zip(sizes, sizes[1:]):
        start.append(start[-1] + a * b + b)
    align = 4 if bucket_elems >= 4 else 1
    up = lambda x: (x + align - 1) // align * align  # noqa: E731
    plan, open_end = [], start[-1] + extra_slots
    for layer in range(len(sizes) - 2, -1, -1):
        begin = start[layer]
        while open_end - begin > bucket_elems:
            cut = up(open_end - bucket_elems)
            plan.append((cut, open_end - cut, layer))
            open_end = cut
        if open_end - begin >= bucket_elems // 2 or layer == 0:
            first = 0 if layer == 0 else up(begin)
            if open_end > first:
                plan.append((first, open_end - first, layer))
            open_end = min(open_end, first)
    return plan


def test_counted_bucket_runs_are_the_walked_plan():
    # The core counts a layer's equal cuts instead of walking them (so the performance
    # model prices huge models in O(layers)); the plan must be the walked one, bucket for bucket.
    rng = np.random.default_rng(13)
    for _ in range(3000):
        layers = [
            int(rng.choice([1, 2, 3, 5, 7, 8, 13, 64, 100, 255, 256, 1000])) for _ in range(int(rng.integers(2, 7)))
        ]
        bucket_elems = int(rng.choice([1, 2, 3, 4, 5, 7, 9, 16, 17, 63, 100, 1023, 4096, rng.integers(1, 30000)]))
        plan = _core.plan_buckets(layers, bucket_elems)
        assert plan == walked_bucket_plan(layers, 2, bucket_elems), (layers, bucket_elems)
        runs = _core.plan_bucket_runs(layers, bucket_elems)
        assert [(off - i * n, n, layer) for off, n, layer, repeat in runs for i in range(repeat)] == plan
        assert len(runs) <= 3 * (len(layers) - 1)  # a first cut, the equal ones, a boundary bucket per layer


def test_bucket_runs_of_a_huge_model_stay_few():
    # 5 layers of 2^30 (2^62 parameters) in 2^16-element buckets: 2^46 buckets, a handful of runs
    layers = [1 << 30] * 5
    runs = _core.plan_bucket_runs(layers, 1 << 16)
    assert len(runs) <= 12
    assert sum(n * repeat for _, n, _, repeat in runs) == 4 * ((1 << 60) + (1 << 30)) + 2
    assert sum(repeat for *_, repeat in runs) > 1 << 45


def test_timed_steps_report_each_buckets_allreduce_and_untimed_steps_nothing():
    m = mgpu.MLP([8, 16, 4], seed=1)
    x = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)
    y = np.zeros((6, 4), np.float32)

    def run(timed):
        step = _core.DataParallelStep(
            m._core,
            _core.Optimizer(m._core, "sgd"),
            _core.LocalCommunicator(),
            "mse",
            _core.StepOptions(bucket_elems=40, timed=timed),
        )
        return step, step.step([(x, y, 0)], 6, 0, 0.1)

    _, untimed = run(False)
    assert untimed.buckets == []  # the untimed path records nothing
    step, r = run(True)
    plan = step.buckets()
    assert len(plan) > 1
    assert [(b.index, b.offset, b.count) for b in r.buckets] == [(i, off, n) for i, (off, n, _) in enumerate(plan)]
    assert all(b.bytes == 4 * b.count for b in r.buckets)  # fp32 on the wire
    for b, nxt in zip(r.buckets, r.buckets[1:] + [None]):
        assert 0 <= b.launch <= b.done <= r.timings.total
        if nxt is not None:  # the CPU backend's blocking allreduces run one after another
            assert b.done <= nxt.launch


def test_cpu_backend_does_not_overlap_host_driven_collectives():
    m = mgpu.MLP([3, 2])
    step = _core.DataParallelStep(
        m._core, _core.Optimizer(m._core, "sgd"), _core.LocalCommunicator(), "mse", _core.StepOptions(overlap=True)
    )
    assert step.overlaps is False  # measured faster: per-bucket blocking allreduce after backward


def test_graph_modes_on_the_cpu_backend():
    m = mgpu.MLP([3, 2])

    def step(graph):
        return _core.DataParallelStep(
            m._core, _core.Optimizer(m._core, "sgd"), _core.LocalCommunicator(), "mse", _core.StepOptions(graph=graph)
        )

    assert step("auto").uses_graphs is False  # auto: device backends only (CUDA graphs)
    assert step("off").uses_graphs is False
    assert step("on").uses_graphs is True  # the CPU reference capture (tests/gpu/test_training.py)
    with pytest.raises(mgpu.ConfigError, match="graph mode"):
        step("sometimes")
    with pytest.raises(mgpu.ConfigError, match="graph mode"):
        mgpu.Trainer(m, process_group=local_group(), graph="always")


def test_trainer_with_captured_steps_trains_the_same_run():
    # A whole fit (ragged last batch, validation between epochs, dropout) through
    # the CPU's reference capture gives the uncaptured run's bits.
    data = load_dataset("digits")
    out = {}
    for graph in ("off", "on"):
        m = mgpu.MLP([64, 48, 10], seed=2, dropout=0.1)
        t = mgpu.Trainer(
            m, loss="cross_entropy", optimizer="adamw", lr=3e-3, process_group=local_group(), accumulate=2, graph=graph
        )
        history = t.fit(data, batch_size=100, epochs=2, progress=False)
        out[graph] = (m.get_parameters(), [e["train_loss"] for e in history], t._step.graph_replays)
    assert out["on"][2] > 0 and out["off"][2] == 0
    assert out["on"][1] == out["off"][1]
    assert all(np.array_equal(a, b) for a, b in zip(out["on"][0], out["off"][0]))


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_setting_does_not_change_results(overlap):
    layers = [5, 9, 3]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 5)).astype(np.float32)
    y = rng.standard_normal((20, 3)).astype(np.float32)
    results = []
    for ov in (overlap, not overlap):
        m = mgpu.MLP(layers, seed=1)
        t = mgpu.Trainer(m, optimizer="adamw", lr=0.01, process_group=local_group(), overlap=ov, bucket_elems=7)
        for _ in range(3):
            t.step(x, y)
        results.append(m.get_parameters())
    assert all(np.array_equal(a, b) for a, b in zip(*results))


def test_non_finite_steps_are_skipped_then_stop_the_run():
    m = mgpu.MLP([2, 2], seed=0)
    t = mgpu.Trainer(m, lr=0.1, process_group=local_group(), max_bad_steps=2)
    before = m.get_parameters()
    x = np.array([[np.inf, 1.0]], np.float32)
    y = np.zeros((1, 2), np.float32)
    t.step(x, y)  # skipped with a warning
    assert t.last_result.applied is False and t.bad_steps == 1
    assert all(np.array_equal(a, b) for a, b in zip(before, m.get_parameters()))
    t.step(np.ones((1, 2), np.float32), y)  # a good step resets the count
    assert t.last_result.applied and t.bad_steps == 0
    after_good = m.get_parameters()
    t.step(x, y)
    with pytest.raises(mgpu.NumericsError, match="2 consecutive steps with non-finite"):
        t.step(x, y)
    assert all(np.array_equal(a, b) for a, b in zip(after_good, m.get_parameters()))


def test_digits_reaches_95_percent():
    data = load_dataset("digits")
    model = mgpu.MLP([64, 128, 10], seed=0, threads=1)
    trainer = mgpu.Trainer(model, loss="cross_entropy", optimizer="adamw", lr=0.002, process_group=local_group())
    history = trainer.fit(data, batch_size=64, epochs=25, progress=False)
    assert history[-1]["val_accuracy"] >= 0.95, history[-1]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
