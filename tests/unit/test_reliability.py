"""Training features and reliability in one process: gradient accumulation,
clipping, schedules, loss scaling, checkpoint format and failures, exact resume."""

import errno
import math
import os
import re

import numpy as np
import pytest

import mgpu
from mgpu import _core
from mgpu.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    misnamed_checkpoint,
    save_checkpoint,
)
from mgpu.train.data import Dataset, load_dataset
from mgpu.train.schedule import LRSchedule
from mgpu.train.trainer import CheckpointPolicy
from reference import loss_and_grad, rel_err


def local_group():
    return mgpu.ProcessGroup(comm=__import__("mpi4py.MPI", fromlist=["MPI"]).COMM_SELF)


def regression(n=24, d_in=5, d_out=3, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, d_in)).astype(np.float32), rng.standard_normal((n, d_out)).astype(np.float32))


# --- gradient accumulation ---------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("k, rows", [(2, 24), (4, 24), (4, 10), (3, 2)])
def test_accumulation_equals_one_larger_batch(optimizer, k, rows):
    x, y = regression(rows)
    results = []
    for accumulate in (1, k):
        m = mgpu.MLP([5, 16, 3], seed=3, dropout=0.3, threads=1)  # masks keyed by global sample
        t = mgpu.Trainer(
            m, optimizer=optimizer, lr=0.05, momentum=0.9, process_group=local_group(), accumulate=accumulate
        )
        losses = [t.step(x, y) for _ in range(3)]
        results.append((losses, m.get_parameters()))
    (l1, p1), (lk, pk) = results
    assert np.allclose(l1, lk, rtol=1e-6)
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(p1, pk))


def test_accumulation_in_fit_takes_k_times_the_samples_per_step():
    data = load_dataset("synthetic", samples=600)
    hist = {}
    for batch, k in ((64, 1), (16, 4)):
        m = mgpu.MLP([50, 32, 3], seed=1, threads=1)
        t = mgpu.Trainer(m, lr=0.05, momentum=0.9, process_group=local_group(), accumulate=k)
        hist[k] = (t.fit(data, batch_size=batch, epochs=2, progress=False), m.get_parameters())
    (h1, p1), (h4, p4) = hist[1], hist[4]
    assert [e["steps"] for e in h1] == [e["steps"] for e in h4]
    assert np.allclose([e["train_loss"] for e in h1], [e["train_loss"] for e in h4], rtol=1e-5)
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(p1, p4))


# --- clipping ----------------------------------------------------------------------
@pytest.mark.parametrize("max_norm", [1e-3, 0.1, 1e6])
def test_clipping_scales_to_the_global_norm(max_norm):
    layers = [5, 8, 3]
    x, y = regression(12)
    m = mgpu.MLP(layers, seed=2, threads=1)
    params = [p.astype(np.float64) for p in m.get_parameters()]
    _, grads = loss_and_grad(params, x, y, "mse")
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
    lr = 0.1 / min(max_norm, norm)  # an update of norm 0.1: well above float32 rounding of the params
    t = mgpu.Trainer(m, lr=lr, process_group=local_group(), max_grad_norm=max_norm)
    t.step(x, y)
    assert t.last_result.grad_norm == pytest.approx(norm, rel=1e-5)
    factor = min(1.0, max_norm / (norm + 1e-6))
    for p0, p1, g in zip(params, m.get_parameters(), grads):
        assert rel_err(p0 - p1, lr * factor * g) < 1e-4


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_clipping_above_every_norm_changes_nothing(optimizer):
    # min(1, max_norm / norm): a limit no step reaches leaves a whole run bit-identical
    # to one without clipping (the factor is exactly 1, not max_norm / norm).
    data = load_dataset("synthetic", samples=200)
    runs = []
    for max_norm in (0.0, 1e9):
        m = mgpu.MLP([50, 16, 3], seed=6, threads=1)
        t = mgpu.Trainer(
            m, optimizer=optimizer, lr=0.01, momentum=0.9, process_group=local_group(), max_grad_norm=max_norm
        )
        history = t.fit(data, batch_size=32, steps=8, progress=False)
        assert 0 < t.last_result.grad_norm < 1e9
        runs.append((m.get_parameters(), [e["train_loss"] for e in history]))
    (p0, l0), (p1, l1) = runs
    assert l0 == l1
    assert all(np.array_equal(a, b) for a, b in zip(p0, p1))


def test_bad_step_options_are_rejected():
    m = mgpu.MLP([2, 2])
    for kwargs in (dict(accumulate=0), dict(max_bad_steps=0), dict(timeout=-1), dict(lr=float("nan"))):
        with pytest.raises(mgpu.ConfigError):
            mgpu.Trainer(m, process_group=local_group(), **kwargs)
    with pytest.raises(mgpu.ConfigError, match="max_grad_norm"):
        mgpu.Trainer(m, process_group=local_group(), max_grad_norm=-1.0)


# --- schedules ---------------------------------------------------------------------
def test_schedules_follow_their_definitions():
    const = LRSchedule(0.1)
    assert const.lr_at(0) == const.lr_at(10_000) == 0.1
    step = LRSchedule(0.1, "step", step_size=10, gamma=0.5)
    assert [step.lr_at(s) for s in (0, 9, 10, 25)] == pytest.approx([0.1, 0.1, 0.05, 0.025])
    cos = LRSchedule(0.1, "cosine", total_steps=100, min_lr=0.01)
    assert cos.lr_at(0) == pytest.approx(0.1)
    assert cos.lr_at(50) == pytest.approx(0.01 + 0.5 * 0.09)
    assert cos.lr_at(99) > 0.01 and cos.lr_at(100) == pytest.approx(0.01)
    warm = LRSchedule(0.1, "cosine", warmup_steps=10, total_steps=110)
    assert [warm.lr_at(s) for s in (0, 4, 9)] == pytest.approx([0.01, 0.05, 0.1])
    assert warm.lr_at(10) == pytest.approx(0.1) and warm.lr_at(60) == pytest.approx(0.05)
    lrs = [warm.lr_at(s) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kind="linear"),
        dict(warmup_steps=-1),
        dict(kind="step", step_size=0),
        dict(kind="step", gamma=0.0),
        dict(kind="cosine"),
        dict(kind="cosine", total_steps=10, min_lr=0.5),
    ],
)
def test_bad_schedules_are_rejected(kwargs):
    with pytest.raises(mgpu.ConfigError):
        LRSchedule(0.1, **kwargs)


def test_trainer_uses_the_schedule_per_step():
    x, y = regression(8)
    sched = LRSchedule(0.2, "step", step_size=1, gamma=0.5)
    m = mgpu.MLP([5, 3], seed=0, threads=1)
    t = mgpu.Trainer(m, lr=0.2, process_group=local_group(), schedule=sched)
    for s in range(3):
        before = m.get_parameters()
        params = [p.astype(np.float64) for p in before]
        _, grads = loss_and_grad(params, x, y, "mse")
        t.step(x, y)
        for p0, p1, g in zip(before, m.get_parameters(), grads):
            assert rel_err(p0 - p1, 0.2 * 0.5**s * g) < 1e-4


@pytest.mark.parametrize("kind", ["constant", "cosine"])
def test_trainer_applies_the_warm_up_rate_from_step_0(kind):
    # Linear warm-up from lr/warmup: the update of step s (0-based) is lr * (s + 1) / warmup
    # times the gradient, checked on the parameters the trainer actually changes.
    x, y = regression(8)
    lr, warmup = 0.2, 4
    sched = LRSchedule(lr, kind, warmup_steps=warmup, total_steps=1000 if kind == "cosine" else None)
    m = mgpu.MLP([5, 3], seed=0, threads=1)
    t = mgpu.Trainer(m, lr=lr, process_group=local_group(), schedule=sched)
    for s in range(warmup + 1):
        before = m.get_parameters()
        _, grads = loss_and_grad([p.astype(np.float64) for p in before], x, y, "mse")
        t.step(x, y)
        rate = lr * min(s + 1, warmup) / warmup
        for p0, p1, g in zip(before, m.get_parameters(), grads):
            assert rel_err(p0 - p1, rate * g) < 1e-4, f"step {s}: expected rate {rate}"


# --- loss scaling ------------------------------------------------------------------
def _core_step(model, **options):
    opt = _core.Optimizer(model._core, "sgd")
    return _core.DataParallelStep(model._core, opt, _core.LocalCommunicator(), "mse", _core.StepOptions(**options))


def test_static_loss_scale_gives_the_unscaled_update():
    x, y = regression(16)
    a, b = mgpu.MLP([5, 8, 3], seed=4, threads=1), mgpu.MLP([5, 8, 3], seed=4, threads=1)
    ra = _core_step(a).step([(x, y, 0)], 16, 0, 0.1)
    rb = _core_step(b, loss_scale=1024.0).step([(x, y, 0)], 16, 0, 0.1)
    assert rb.applied and rb.loss_scale == 1024.0
    assert rb.loss == pytest.approx(ra.loss, rel=1e-6) and rb.grad_norm == pytest.approx(ra.grad_norm, rel=1e-5)
    assert all(rel_err(p, q) < 1e-6 for p, q in zip(a.get_parameters(), b.get_parameters()))


def test_dynamic_loss_scale_backs_off_on_overflow_and_grows_after_a_window():
    x, y = regression(16)
    x *= 1e3  # large activations: at a scale of 1e37 the gradients overflow float32
    m = mgpu.MLP([5, 8, 3], seed=4, threads=1)
    step = _core_step(m, loss_scale=1e37, dynamic_loss_scale=True, loss_scale_window=2)
    before = m.get_parameters()
    scales, applied = [], []
    for s in range(40):
        r = step.step([(x, y, 0)], 16, s, 1e-6)
        scales.append(r.loss_scale)
        applied.append(r.applied)
        if not r.applied:
            assert all(np.array_equal(p, q) for p, q in zip(before, m.get_parameters()))
        before = m.get_parameters()
    assert not applied[0] and scales[1] == pytest.approx(scales[0] / 2)
    first_good = applied.index(True)
    assert step.loss_scale < 1e37  # backed off to a scale that fits
    # after two good steps in a row the scale doubles (and may overflow and back off again)
    if applied[first_good + 1]:
        assert scales[first_good + 2] == pytest.approx(2 * scales[first_good])


# --- checkpoint format -------------------------------------------------------------
def _arrays(n=10):
    return {"params": np.arange(n, dtype=np.float32), "opt.exp_avg": np.ones(n, np.float32)}


def test_checkpoint_round_trip_prunes_and_never_pickles(tmp_path):
    for step in (5, 10, 15, 20):
        save_checkpoint(str(tmp_path), step, _arrays(), {"compat": {"layers": [2, 3]}, "step": step}, keep=2)
    names = [os.path.basename(p) for p in list_checkpoints(str(tmp_path))]
    assert names == ["ckpt-000000015.npz", "ckpt-000000020.npz"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]
    arrays, meta = load_checkpoint(latest_checkpoint(str(tmp_path)))
    assert meta["step"] == 20 and meta["format"] == "mgpu-checkpoint" and meta["version"] == 1
    assert np.array_equal(arrays["params"], _arrays()["params"])
    with np.load(latest_checkpoint(str(tmp_path)), allow_pickle=False) as z:  # plain arrays only
        assert sorted(z.files) == ["meta", "opt.exp_avg", "params"]


def test_a_checkpoint_renamed_to_another_steps_name_is_found(tmp_path):
    def meta(step):
        return {"compat": {}, "state": {"global_step": step}}

    for step in (4, 8):
        save_checkpoint(str(tmp_path), step, _arrays(), meta(step), keep=5)
    assert misnamed_checkpoint(str(tmp_path)) is None
    (tmp_path / "not-a-checkpoint.npz").write_bytes(b"x")  # names mgpu did not give are not its checkpoints
    assert misnamed_checkpoint(str(tmp_path)) is None
    (tmp_path / "ckpt-000000004.npz").rename(tmp_path / "ckpt-000000012.npz")
    assert misnamed_checkpoint(str(tmp_path)) == (str(tmp_path / "ckpt-000000012.npz"), 4)
    assert misnamed_checkpoint(str(tmp_path / "absent")) is None


def test_corrupt_truncated_and_foreign_files_are_refused(tmp_path):
    good = save_checkpoint(str(tmp_path), 1, _arrays(1000), {"compat": {}}, keep=5)
    raw = open(good, "rb").read()
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(str(truncated))
    flipped = bytearray(raw)
    # flip a bit inside the params payload (stored uncompressed): the zip's CRC-32 catches it
    # (an archive rewritten whole passes it: the test below)
    i = raw.index(np.arange(1000, dtype=np.float32)[500:502].tobytes())
    flipped[i] ^= 0x10
    bad = tmp_path / "flipped.npz"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(str(bad))
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, params=np.zeros(3, np.float32))
    with pytest.raises(CheckpointError, match="not an mgpu checkpoint"):
        load_checkpoint(str(foreign))
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(str(tmp_path / "missing.npz"))
    assert open(good, "rb").read() == raw  # reading never modifies


@pytest.mark.parametrize("changed", ["params", "opt.exp_avg"])
def test_a_rewritten_archive_with_a_changed_array_fails_its_checksum(tmp_path, changed):
    # A valid zip with one array replaced (the metadata, and its checksums, copied as
    # they were) passes every zip CRC-32: only the per-array SHA-256 can refuse it.
    good = save_checkpoint(str(tmp_path), 1, _arrays(), {"compat": {}}, keep=5)
    with np.load(good, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays[changed] = arrays[changed].copy()
    arrays[changed][3] += 1.0
    forged = tmp_path / "rewritten.npz"
    np.savez(forged, **arrays)
    with pytest.raises(CheckpointError, match=rf"corrupt \(checksum mismatch in '{re.escape(changed)}'\)"):
        load_checkpoint(str(forged))


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    first = save_checkpoint(str(tmp_path), 1, _arrays(), {"compat": {}}, keep=1)
    before = open(first, "rb").read()

    def full_disk(f, **arrays):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", full_disk)
    with pytest.raises(CheckpointError, match="disk full; previous checkpoint ckpt-000000001.npz kept"):
        save_checkpoint(str(tmp_path), 2, _arrays(), {"compat": {}}, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000001.npz"]  # no temporary left, nothing pruned
    assert open(first, "rb").read() == before


# --- resume ------------------------------------------------------------------------
def _trainer(accumulate=2, total=None):
    m = mgpu.MLP([50, 24, 3], seed=7, dropout=0.2, threads=1)
    sched = LRSchedule(0.01, "cosine", warmup_steps=3, total_steps=total or 40, min_lr=1e-4)
    return m, mgpu.Trainer(
        m,
        optimizer="adamw",
        lr=0.01,
        process_group=local_group(),
        accumulate=accumulate,
        schedule=sched,
        max_grad_norm=1.0,
    )


def _strip_times(history):
    return [{k: v for k, v in e.items() if k not in ("seconds", "samples_per_sec")} for e in history]


def test_resume_continues_bit_identically(tmp_path):
    data = load_dataset("synthetic", samples=500)  # 400 train: 12.5 steps of 32 per epoch
    steps = 40
    m_full, t_full = _trainer()
    full = t_full.fit(data, batch_size=16, steps=steps, seed=3, progress=False)

    directory = str(tmp_path / "ckpt")
    m_a, t_a = _trainer()
    t_a.fit(
        data,
        batch_size=16,
        steps=steps,
        seed=3,
        progress=False,
        checkpoint=CheckpointPolicy(directory, every=7, keep=10),
    )
    mid = [p for p in list_checkpoints(directory) if p.endswith("ckpt-000000021.npz")][0]  # mid-epoch 1
    m_b, t_b = _trainer()
    resumed = t_b.fit(data, batch_size=16, steps=steps, seed=3, progress=False, resume=mid)
    assert t_b.global_step == steps
    for a, b in zip(m_full.get_parameters(), m_b.get_parameters()):
        assert np.array_equal(a, b), "resumed run diverged from the uninterrupted one"
    assert _strip_times(resumed) == _strip_times(full)


def test_stop_request_checkpoints_and_resume_finishes_the_run(tmp_path):
    data = load_dataset("synthetic", samples=300)
    m_full, t_full = _trainer(accumulate=1, total=20)
    t_full.fit(data, batch_size=32, steps=20, seed=0, progress=False)
    directory = str(tmp_path)
    m_a, t_a = _trainer(accumulate=1, total=20)
    calls = {"n": 0}
    original = t_a.step

    def step_then_stop(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 9:
            t_a.request_stop("test")
        return original(*args, **kwargs)

    t_a.step = step_then_stop
    t_a.fit(data, batch_size=32, steps=20, seed=0, progress=False, checkpoint=CheckpointPolicy(directory))
    assert t_a.stop_reason == "test" and t_a.global_step == 9
    assert latest_checkpoint(directory).endswith("ckpt-000000009.npz")
    m_b, t_b = _trainer(accumulate=1, total=20)
    t_b.fit(data, batch_size=32, steps=20, seed=0, progress=False, resume=latest_checkpoint(directory))
    assert all(np.array_equal(a, b) for a, b in zip(m_full.get_parameters(), m_b.get_parameters()))


def test_incompatible_checkpoints_are_refused(tmp_path):
    data = load_dataset("synthetic", samples=300)
    _, t = _trainer()
    t.fit(data, batch_size=16, steps=3, seed=0, progress=False, checkpoint=CheckpointPolicy(str(tmp_path)))
    path = latest_checkpoint(str(tmp_path))
    other = mgpu.Trainer(
        mgpu.MLP([50, 32, 3], seed=7, dropout=0.2), optimizer="adamw", process_group=local_group(), accumulate=2
    )
    with pytest.raises(CheckpointError, match="layers"):
        other.fit(data, batch_size=16, steps=5, seed=0, progress=False, resume=path)
    _, t_batch = _trainer()
    with pytest.raises(CheckpointError, match="effective_batch"):
        t_batch.fit(data, batch_size=32, steps=5, seed=0, progress=False, resume=path)
    sgd = mgpu.Trainer(
        mgpu.MLP([50, 24, 3], seed=7, dropout=0.2),
        optimizer="sgd",
        momentum=0.9,
        process_group=local_group(),
        accumulate=2,
    )
    with pytest.raises(CheckpointError, match="optimizer"):
        sgd.fit(data, batch_size=16, steps=5, seed=0, progress=False, resume=path)


def test_a_checkpoints_dataset_is_matched_by_contents_where_it_has_them():
    from mgpu.train.checkpoint import check_compatible

    data = load_dataset("synthetic", samples=300)
    renamed = Dataset("/elsewhere/same.npz", data.x_train, data.y_train, data.x_val, data.y_val)
    changed = Dataset(data.name, data.x_train[::-1].copy(), data.y_train, data.x_val, data.y_val)
    assert renamed.fingerprint() == data.fingerprint() != changed.fingerprint()
    compat = lambda d, fp=True: {
        "dataset": d.name,
        "train_samples": len(d.x_train),  # noqa: E731
        **({"dataset_sha256": d.fingerprint()} if fp else {}),
    }
    saved = {"compat": compat(data)}
    check_compatible(saved, compat(renamed), "c")  # the same samples under another path
    with pytest.raises(CheckpointError, match="its dataset held other samples than"):
        check_compatible(saved, compat(changed), "c")  # other samples under the same path
    old = {"compat": compat(data, fp=False)}  # written before the fingerprint: by name
    check_compatible(old, compat(changed), "c")
    with pytest.raises(CheckpointError, match="dataset is"):
        check_compatible(old, compat(renamed), "c")
    with pytest.raises(CheckpointError, match="compat is None"):
        check_compatible({"compat": None}, compat(data), "c")


def test_non_finite_state_is_never_checkpointed(tmp_path):
    x = np.full((4, 2), 1e30, np.float32)
    data = Dataset("huge", x, np.full((4, 2), 1e30, np.float32), x[:2], np.zeros((2, 2), np.float32))
    m = mgpu.MLP([2, 2], seed=0, threads=1)
    t = mgpu.Trainer(m, lr=1.0, process_group=local_group(), max_bad_steps=2)
    with pytest.raises(mgpu.NumericsError):
        t.fit(data, batch_size=2, steps=10, progress=False, checkpoint=CheckpointPolicy(str(tmp_path), every=1))
    for path in list_checkpoints(str(tmp_path)):
        arrays, _ = load_checkpoint(path)
        assert all(np.isfinite(a).all() for a in arrays.values())


def test_fit_again_trains_more_and_continues_the_sampler():
    data = load_dataset("synthetic", samples=300)  # 240 train: 8 steps of 32 per epoch
    m = mgpu.MLP([50, 16, 3], seed=0, threads=1)
    t = mgpu.Trainer(m, lr=0.05, process_group=local_group())
    first = t.fit(data, batch_size=32, epochs=2, progress=False)
    assert t.global_step == 16 and [e["epoch"] for e in first] == [1, 2]
    history = t.fit(data, batch_size=32, epochs=1, progress=False)
    assert t.global_step == 24 and [e["epoch"] for e in history] == [1, 2, 3]
    t.fit(data, batch_size=32, steps=3, progress=False)
    assert t.global_step == 27


def test_watchdog_errors_name_the_hosts_of_the_ranks_they_name():
    from mgpu.train.group import name_hosts

    hosts = ["h0", "h0", "h1", "h1"]
    cut = (
        "allreduce at step 15 did not complete within 3 s on rank 0: ranks 1, 3 have not reached this step; "
        "rank 2 stopped responding during it (stopped, hung or dead)"
    )
    assert name_hosts(cut, hosts) == (
        "allreduce at step 15 did not complete within 3 s on rank 0 (h0): ranks 1 (h0), 3 (h1) have not reached "
        "this step; rank 2 (h1) stopped responding during it (stopped, hung or dead); every rank on h1 is named: "
        "suspect that host or its link (down, frozen or dead)"
    )
    behind = "barrier did not complete within 3 s on rank 0: rank 3 has not reached this step (stopped, hung or dead)"
    # rank 2 on h1 was not named: h1 may just be slow, so no host is blamed
    assert name_hosts(behind, hosts).endswith("rank 3 (h1) has not reached this step (stopped, hung or dead)")
    assert name_hosts(cut, ["h0"] * 4) == cut  # one host: nothing to add
