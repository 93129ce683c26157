"""The training loop's bookkeeping, the guards around its checkpoints, schedules and
atomic writes, and the exception types: each test here fails on a mutation of the code
that the other unit tests let through (a figure off by a factor, a bound off by one, a
check or an fsync dropped)."""

import json
import os
import stat
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

import mgpu
from mgpu.atomic import atomic_file
from mgpu.train.checkpoint import (
    CheckpointError,
    check_compatible,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prepare_directory,
    save_checkpoint,
)
from mgpu.train.data import load_dataset
from mgpu.train.schedule import LRSchedule
from mgpu.train.trainer import CheckpointPolicy, Trainer

DATA = load_dataset("synthetic", samples=300)  # 240 training samples: 8 steps of 32 an epoch, the last 16


def one_rank():
    return mgpu.ProcessGroup(comm=MPI.COMM_SELF)


def trainer(**kw):
    return mgpu.Trainer(mgpu.MLP([50, 8, 3], seed=0, threads=1), lr=kw.pop("lr", 0.01), process_group=one_rank(), **kw)


def checkpoint_of(tmp_path, **kw):
    t = trainer(**kw)
    t.fit(DATA, batch_size=32, steps=3, progress=False, checkpoint=CheckpointPolicy(str(tmp_path)))
    return latest_checkpoint(str(tmp_path))


def rewritten(path, out, state=None, meta_change=None, extra=None):
    """A copy of checkpoint `path` with its metadata edited (outside the checksums)."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["meta"].tobytes().decode())
    for key, value in (state or {}).items():
        if value is None:
            meta["state"].pop(key)
        else:
            meta["state"][key] = value
    if meta_change:
        meta_change(meta)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    arrays.update(extra or {})
    np.savez(out, **arrays)
    return str(out)


def without(history, *keys):
    return [{k: v for k, v in e.items() if k not in keys} for e in history]


# --- the history's figures -------------------------------------------------------
def test_an_epochs_record_holds_its_own_samples_loss_and_rate():
    t = trainer(lr=0.1, schedule=LRSchedule(0.1, "step", step_size=8, gamma=0.1))
    losses, step = [], t.step
    t.step = lambda *a, **k: losses.append(step(*a, **k)) or losses[-1]
    history = t.fit(DATA, batch_size=32, epochs=2, progress=False)
    assert [e["lr"] for e in history] == pytest.approx([0.1, 0.01])  # the rate of the epoch's last step
    assert [e["samples"] for e in history] == [240, 240]
    rows = [32] * 7 + [16]
    for e, epoch in zip(history, (losses[:8], losses[8:])):  # the mean over samples, not over steps
        assert e["train_loss"] == pytest.approx(sum(l * r for l, r in zip(epoch, rows)) / 240, rel=1e-6)


def test_the_validation_loss_is_the_mean_over_every_output():
    t = trainer()
    expected = float(np.mean((t.model.forward(DATA.x_val).astype(np.float64) - DATA.y_val) ** 2))
    assert t.evaluate(DATA.x_val, DATA.y_val)["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("stop_on_call", [11, 20])
def test_a_run_stopped_and_resumed_has_the_history_of_one_never_stopped(tmp_path, stop_on_call):
    # 20 steps: 2.5 epochs. A stop asked on the last step still closes the last,
    # partial epoch (the resumed run has nothing left to train).
    full = trainer().fit(DATA, batch_size=32, steps=20, progress=False)
    a, calls = trainer(), [0]
    step = a.step

    def stepping(*args, **kw):
        calls[0] += 1
        if calls[0] == stop_on_call:
            a.request_stop("test")
        return step(*args, **kw)

    a.step = stepping
    a.fit(DATA, batch_size=32, steps=20, progress=False, checkpoint=CheckpointPolicy(str(tmp_path)))
    assert a.global_step == stop_on_call and a.stop_reason
    resumed = trainer().fit(DATA, batch_size=32, steps=20, progress=False, resume=latest_checkpoint(str(tmp_path)))
    assert without(resumed, "seconds", "samples_per_sec") == without(full, "seconds", "samples_per_sec")


def test_an_epoch_begun_on_emulated_gpus_says_so_where_it_ends(tmp_path):
    # a checkpoint taken mid-epoch on the emulation (state.epoch_emulated), resumed here:
    # the epoch's time holds the emulated steps, so its record says so; the next does not
    # (the first record is the checkpointed run's own, closed at its end)
    path = rewritten(checkpoint_of(tmp_path), tmp_path / "emulated.npz", state={"epoch_emulated": True})
    history = trainer().fit(DATA, batch_size=32, steps=12, progress=False, resume=path)
    assert [(e["steps"], e.get("gpu_emulation", False)) for e in history] == [(8, True), (12, False)]


def test_a_finished_run_continued_has_the_history_of_one_never_stopped(tmp_path):
    """A run that ended at --steps mid-epoch closed that epoch's first part; going on from
    its checkpoint closes the rest into the same record (samples-weighted loss)."""
    full = trainer().fit(DATA, batch_size=32, steps=12, progress=False)
    trainer().fit(DATA, batch_size=32, steps=3, progress=False, checkpoint=CheckpointPolicy(str(tmp_path)))
    resumed = trainer().fit(DATA, batch_size=32, steps=12, progress=False, resume=latest_checkpoint(str(tmp_path)))
    assert [(e["epoch"], e["steps"], e["samples"]) for e in resumed] == [(1, 8, 240), (2, 12, 128)]
    for got, want in zip(resumed, full):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-6)
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6) and got["lr"] == want["lr"]
    # a part run on emulated GPUs makes the whole epoch's record say so
    first = {"samples": 96, "seconds": 1.0, "train_loss": 1.0, "gpu_emulation": True}
    joined = Trainer._joined(first, {"samples": 144, "seconds": 2.0, "train_loss": 2.0})
    assert joined["gpu_emulation"] is True and joined["train_loss"] == pytest.approx(1.6)


def test_an_epoch_an_older_run_left_open_at_its_end_is_closed_on_resume(tmp_path):
    # mgpu before this check left the last, partial epoch open when a stop came on the
    # run's last step: resuming that run closes it (nothing is left to train)
    full = trainer().fit(DATA, batch_size=32, steps=3, progress=False)
    open_epoch = rewritten(
        checkpoint_of(tmp_path),
        tmp_path / "open.npz",
        meta_change=lambda m: (
            m["state"].update(epoch_samples=96, epoch_loss_sum=float(full[0]["train_loss"] * 96), epoch_seconds=0.01),
            m.update(history=[]),
        ),
    )
    resumed = trainer().fit(DATA, batch_size=32, steps=3, progress=False, resume=open_epoch)
    assert without(resumed, "seconds", "samples_per_sec") == without(full, "seconds", "samples_per_sec")


# --- what a resume restores -----------------------------------------------------
def test_a_run_without_dynamic_scaling_keeps_its_scale_over_a_dynamic_checkpoint(tmp_path):
    path = checkpoint_of(tmp_path, dynamic_loss_scale=True, loss_scale=1024.0)
    t = trainer()
    t.load_checkpoint(path, t._compat(DATA, 32, 0))
    assert t._step.loss_scale == 1.0


def test_a_checkpoint_from_before_the_dynamic_flag_continues_its_scale(tmp_path):
    path = rewritten(
        checkpoint_of(tmp_path, dynamic_loss_scale=True, loss_scale=1024.0),
        tmp_path / "old.npz",
        state={"dynamic_loss_scale": None},
    )
    t = trainer(dynamic_loss_scale=True, loss_scale=4096.0)
    t.load_checkpoint(path, t._compat(DATA, 32, 0))
    assert t._step.loss_scale == 1024.0


def test_a_resume_restores_the_bad_step_count(tmp_path):
    path = checkpoint_of(tmp_path)
    t = trainer()
    x = np.zeros((1, 50), np.float32)
    x[0, 0] = np.inf
    t.step(x, np.zeros((1, 3), np.float32))
    assert t.bad_steps == 1
    t.load_checkpoint(path, t._compat(DATA, 32, 0))
    assert t.bad_steps == 0


@pytest.mark.parametrize(
    "key, value", [("epoch", -1), ("batch_in_epoch", -3), ("loss_scale", 0.0), ("epoch_emulated", 1)]
)
def test_impossible_loop_state_is_refused(tmp_path, key, value):
    path = rewritten(checkpoint_of(tmp_path), tmp_path / "edited.npz", state={key: value})
    with pytest.raises(CheckpointError, match=f"state.{key}"):
        trainer().fit(DATA, batch_size=32, steps=5, progress=False, resume=path)


def test_the_effective_batch_a_checkpoint_must_match_counts_the_micro_batches(tmp_path):
    path = checkpoint_of(tmp_path, accumulate=2)
    with pytest.raises(CheckpointError, match="effective_batch"):
        trainer(accumulate=4).fit(DATA, batch_size=32, steps=5, progress=False, resume=path)


def test_a_checkpoint_lacking_a_key_of_the_run_is_refused():
    with pytest.raises(CheckpointError, match="dropout is None there but 0.2 here"):
        check_compatible({"compat": {"layers": [2, 3]}}, {"layers": [2, 3], "dropout": 0.2}, "p")


# --- the loss scale and bad steps ------------------------------------------------
def test_an_overflow_at_scale_one_is_a_bad_step_not_absorbed():
    m = mgpu.MLP([2, 2, 3], seed=0, threads=1)
    w2 = np.full((3, 2), 1e20, np.float32)
    w2[1] *= -1
    m.set_parameters([np.full((2, 2), 1e-20, np.float32), np.zeros(2, np.float32), w2, np.zeros(3, np.float32)])
    t = mgpu.Trainer(
        m,
        loss="cross_entropy",
        lr=1e-3,
        process_group=one_rank(),
        dynamic_loss_scale=True,
        loss_scale=2.0,
        max_bad_steps=5,
    )
    x, y = np.full((4, 2), 1e19, np.float32), np.array([1, 1, 1, 1])
    t.step(x, y)
    assert t.bad_steps == 0 and t.last_result.loss_scale == 2.0  # absorbed: the scale halves
    t.step(x, y)
    assert t.last_result.loss_scale == 1.0 and t.bad_steps == 1  # nothing left to halve: a bad step


def test_a_skipped_steps_state_is_never_checkpointed(tmp_path):
    t = mgpu.Trainer(mgpu.MLP([2, 2], seed=0, threads=1), lr=0.1, process_group=one_rank(), max_bad_steps=3)
    t.step(np.array([[np.inf, 1.0]], np.float32), np.zeros((1, 2), np.float32))
    assert t.bad_steps == 1
    with pytest.raises(CheckpointError, match="skipped"):
        t.save_checkpoint(CheckpointPolicy(str(tmp_path)), {})
    assert list_checkpoints(str(tmp_path)) == []


# --- the options' bounds ---------------------------------------------------------
def test_bounds_that_are_allowed():
    mgpu.Trainer(mgpu.MLP([2, 2]), process_group=one_rank(), timeout=0)  # 0: no watchdog
    t = trainer()
    t.fit(DATA, batch_size=1, steps=2, progress=False)  # a batch of one sample a rank
    assert t.global_step == 2
    assert LRSchedule(0.1, "step", step_size=5, gamma=1.0).lr_at(50) == 0.1


def test_keeping_no_checkpoint_is_refused():
    with pytest.raises(mgpu.ConfigError, match="keep"):
        CheckpointPolicy("d", keep=0)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=0.0),
        dict(lr=0.1, warmup_steps=2.5),
        dict(lr=0.1, kind="cosine", total_steps=0),
        dict(lr=0.1, kind="cosine", total_steps=10, min_lr=-0.1),
        dict(lr=0.1, kind="cosine", total_steps=10, min_lr=0.1),
    ],
)
def test_schedules_that_cannot_train_are_refused(kwargs):
    with pytest.raises(mgpu.ConfigError):
        LRSchedule(**kwargs)


def test_cosine_stays_at_its_floor_after_its_last_step():
    cosine = LRSchedule(0.1, "cosine", warmup_steps=10, total_steps=110, min_lr=0.01)
    assert [cosine.lr_at(s) for s in (110, 160, 210, 10_000)] == pytest.approx([0.01] * 4)


# --- files: what reaches the disk, and what is refused ------------------------------
def arrays(n=10):
    return {"params": np.arange(n, dtype=np.float32), "opt.exp_avg": np.ones(n, np.float32)}


def test_a_checkpoint_and_its_rename_are_synced(tmp_path, monkeypatch):
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)), fsync(fd)))
    save_checkpoint(str(tmp_path), 1, arrays(), {"compat": {}}, keep=1)
    assert synced == [False, True]  # the file, then the directory that holds the rename


def test_an_atomic_file_is_synced_whole_before_its_rename(tmp_path, monkeypatch):
    target, sizes, fsync = tmp_path / "out.bin", [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (sizes.append(os.fstat(fd).st_size), fsync(fd)))
    with atomic_file(str(target), binary=True) as f:
        f.write(b"x" * 1000)
        assert not target.exists()
    assert sizes == [1000] and target.read_bytes() == b"x" * 1000


def test_an_atomic_files_temporary_lives_beside_its_target(tmp_path, monkeypatch):
    # elsewhere (TMPDIR on another file system) the rename would fail across devices
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "elsewhere"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    target = tmp_path / "d" / "out.json"
    target.parent.mkdir()
    with atomic_file(str(target), prefix=".tmp-x-") as f:
        f.write("{}")
        assert [n for n in os.listdir(target.parent) if n.startswith(".tmp-x-")]
    assert os.listdir(target.parent) == ["out.json"]


def test_a_rewound_run_keeps_the_checkpoint_it_just_wrote(tmp_path):
    for step in (30, 40):
        save_checkpoint(str(tmp_path), step, arrays(), {"compat": {}}, keep=2)
    path = save_checkpoint(str(tmp_path), 25, arrays(), {"compat": {}}, keep=2)
    load_checkpoint(path)


def test_an_unwritable_checkpoint_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # root passes every real access check
    with pytest.raises(CheckpointError, match="not writable"):
        prepare_directory(str(tmp_path))


@pytest.mark.parametrize("load", ["mgpu.train.checkpoint.load_checkpoint", "mgpu.train.data.load_dataset"])
def test_a_fifo_given_as_a_file_is_refused_not_waited_on(tmp_path, load):
    fifo = tmp_path / "file.npz"
    os.mkfifo(fifo)
    module, name = load.rsplit(".", 1)
    code = (
        f"import sys, mgpu; from {module} import {name}\n"
        f"try: {name}(sys.argv[1])\nexcept (mgpu.ConfigError, mgpu.DataError) as e: print(e)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True, text=True, timeout=60)
    assert "not a regular file" in out.stdout


def test_a_newer_format_or_other_arrays_are_refused(tmp_path):
    good = save_checkpoint(str(tmp_path), 1, arrays(), {"compat": {}}, keep=5)
    with pytest.raises(CheckpointError, match="format version 2"):
        load_checkpoint(rewritten(good, tmp_path / "v2.npz", meta_change=lambda m: m.update(version=2)))
    extra = rewritten(good, tmp_path / "extra.npz", extra={"opt.momentum_buffer": np.zeros(10, np.float32)})
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(extra)
    missing = rewritten(
        good, tmp_path / "missing.npz", meta_change=lambda m: m["checksums"].update({"opt.exp_avg_sq": "0" * 64})
    )
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(missing)


def test_everything_mgpu_raises_is_an_mgpu_error_and_bad_input_a_value_error():
    from mgpu.train.checkpoint import CheckpointError as checkpoint_error

    for error in (
        mgpu.ConfigError,
        mgpu.DataError,
        checkpoint_error,
        mgpu.DeviceError,
        mgpu.CommError,
        mgpu.NumericsError,
    ):
        assert issubclass(error, mgpu.MgpuError), error
    assert all(issubclass(e, ValueError) for e in (mgpu.ConfigError, mgpu.DataError, checkpoint_error))
    with pytest.raises(mgpu.MgpuError, match="layers"):  # raised in the core, caught by the common base
        mgpu.MLP([0])


def test_a_trainer_config_gives_the_same_trainer_as_its_keywords():
    settings = dict(optimizer="adamw", lr=1e-3, accumulate=2, max_grad_norm=0.5, weight_decay=0.01)
    by_keywords = mgpu.Trainer(mgpu.MLP([50, 8, 3], seed=0, threads=1), process_group=one_rank(), **settings)
    by_config = mgpu.Trainer(mgpu.MLP([50, 8, 3], seed=0, threads=1), mgpu.TrainerConfig(**settings), one_rank())
    for t in (by_keywords, by_config):
        t.fit(DATA, batch_size=32, steps=5, progress=False)
    for a, b in zip(by_keywords.model.get_parameters(), by_config.model.get_parameters()):
        assert np.array_equal(a, b)
    assert by_config.config == by_keywords.config == mgpu.TrainerConfig(**settings)
    model = mgpu.MLP([2, 2], threads=1)
    with pytest.raises(TypeError, match="not both"):
        mgpu.Trainer(model, mgpu.TrainerConfig(), one_rank(), lr=0.1)
    with pytest.raises(TypeError, match="must be a TrainerConfig"):
        mgpu.Trainer(model, "mse")
    with pytest.raises(TypeError, match="give the group once"):
        mgpu.Trainer(model, None, one_rank(), process_group=one_rank())
    for bad, match in (
        (dict(lr=0.0), "learning rate"),
        (dict(accumulate=0), "accumulation steps"),
        (dict(timeout=-1.0), "watchdog timeout"),
        (dict(communicator="gloo"), "communicator"),
        (dict(graph="maybe"), "CUDA graph mode"),
        (dict(grad_dtype="int8"), "gradient dtype"),
        (dict(max_bad_steps=0), "max bad steps"),
    ):
        with pytest.raises(mgpu.ConfigError, match=match):
            mgpu.TrainerConfig(**bad)


def test_a_runs_config_hands_its_trainer_every_setting():
    cfg = mgpu.TrainConfig(
        layers=[50, 8, 3],
        optimizer="adamw",
        lr=0.002,
        momentum=0.5,
        weight_decay=0.1,
        bucket_mb=1.0,
        overlap=False,
        accumulate=3,
        max_grad_norm=2.0,
        lr_schedule="cosine",
        warmup_steps=4,
        min_lr=0.001,
        watchdog_timeout=7.0,
        max_bad_steps=5,
        comm="mpi",
        cuda_graph="off",
        grad_dtype="bf16",
    )
    t = cfg.trainer_config(loss="cross_entropy", total_steps=40, batch_shares=[1.0], timed=True)
    assert (t.loss, t.optimizer, t.lr, t.momentum, t.weight_decay) == ("cross_entropy", "adamw", 0.002, 0.5, 0.1)
    assert (t.bucket_elems, t.overlap, t.accumulate, t.max_grad_norm) == (cfg.bucket_elems(), False, 3, 2.0)
    assert (t.timeout, t.max_bad_steps, t.communicator, t.graph, t.grad_dtype) == (7.0, 5, "mpi", "off", "bf16")
    assert t.batch_shares == [1.0] and t.timed
    assert [t.schedule.lr_at(s) for s in (0, 4, 39)] == [cfg.schedule(40).lr_at(s) for s in (0, 4, 39)]
