"""`mgpu train`: train an MLP data-parallel across the ranks of this job (or, with --gpus N,
threads of this process, one GPU each); one-line errors on every rank, signals that stop
at a step boundary with a checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

from .._core import __version__
from .._runtime import gpus_emulated
from ..atomic import write_json_atomic
from ..console import write_line
from ..errors import ConfigError, DataError, DeviceError
from ..hostinfo import cuda_device_count, no_gpu_reason
from ..monitor.safety import Thresholds
from ..monitor.telemetry import check_monitor_options
from ..monitor.training import TrainTelemetry, output_options
from ..selector import profiles
from ..selector.memory import check_training_memory
from ..selector.run_check import check_run, format_check, predict_run, record_run
from ..selector.tuning import auto_batch_shares, auto_bucket_mb, run_communicator
from ..train.checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    checkpoint_name,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    misnamed_checkpoint,
    step_of,
)
from ..train.config import (
    COMMS,
    DATA_PLACEMENTS,
    DEVICES,
    GRAD_DTYPES,
    GRAPH_MODES,
    LOSSES,
    OPTIMIZERS,
    PRECISIONS,
    PRESETS,
    TrainConfig,
    check_comm_for_device,
)
from ..train.data import Dataset, load_dataset, resident_bytes, split_counts
from ..train.model import MLP, check_parameter_format
from ..train.observe import DEFAULT_TRACE_STEPS, Observer, import_summary_writer, parse_step_range
from ..train.schedule import SCHEDULES
from ..train.thread_group import rank_threads_alive, run_on_gpus
from ..train.trainer import CheckpointPolicy, Trainer
from .common import (
    MAX_THREADS,
    bounded_int,
    check_output_dir,
    check_outputs,
    check_outputs_outside_dirs,
    float_list,
    int_list,
)
from .recommend import bucket_mb

_SHARES = float_list("batch shares")


RESUME_LATEST = "latest"  # bare --resume (or this word): the newest in --checkpoint-dir; ./latest is a file


# train's telemetry options, filled in when --telemetry is given (None until then: given
# without it, they are refused rather than ignored)
TELEMETRY_DEFAULTS = {
    "telemetry_interval": 1.0,
    "max_temp": 85.0,
    "max_memory_percent": 95.0,
    "power_limit": None,
    "stop_above_temp": False,
    "stop_above_memory": False,
}


def _shares(text: str):
    return "auto" if text.strip() == "auto" else _SHARES(text)


def _config_from_args(a) -> TrainConfig:
    lr = a.lr if a.lr is not None else (0.001 if a.optimizer == "adamw" else 0.01)
    return TrainConfig(
        model=a.model or ("medium" if a.layers is None else None),
        layers=a.layers,
        dataset=a.dataset,
        batch_size=a.batch_size,
        epochs=None if a.steps is not None else (a.epochs if a.epochs is not None else 5),
        steps=a.steps,
        lr=lr,
        optimizer=a.optimizer,
        momentum=a.momentum,
        weight_decay=a.weight_decay,
        loss=a.loss,
        dropout=a.dropout,
        seed=a.seed,
        device=a.device,
        threads=a.threads,
        bucket_mb=a.bucket_mb if isinstance(a.bucket_mb, float) else 4.0,
        overlap=not a.no_overlap,
        accumulate=a.accumulate,
        max_grad_norm=a.max_grad_norm,
        lr_schedule=a.lr_schedule,
        warmup_steps=a.warmup_steps,
        lr_step_size=a.lr_step_size,
        lr_gamma=a.lr_gamma,
        min_lr=a.min_lr,
        checkpoint_dir=a.checkpoint_dir,
        checkpoint_every=a.checkpoint_every if a.checkpoint_every is not None else 0,
        keep_checkpoints=a.keep_checkpoints if a.keep_checkpoints is not None else 3,
        watchdog_timeout=a.watchdog_timeout,
        max_bad_steps=a.max_bad_steps,
        precision=a.precision,
        comm=a.comm,
        cuda_graph=a.cuda_graph,
        grad_dtype=a.grad_dtype,
        shard_optimizer=a.shard_optimizer,
        data_on_device=a.data_on_device,
    )


def _refuse_another_runs_checkpoints(directory: str) -> None:
    """A new run (no --resume) writes ckpt-<step> files: in a directory that holds an
    earlier run's it would replace some of them and prune the rest (a mix of two runs)."""
    found = list_checkpoints(directory)
    if found:
        raise CheckpointError(
            f"--checkpoint-dir '{directory}' holds {len(found)} checkpoint(s) of an earlier run "
            f"(newest {os.path.basename(found[-1])}): continue it with --resume, or give an "
            "empty directory"
        )


def _resolve_resume(a, cfg):
    """The checkpoint --resume names: a path, or the newest in --checkpoint-dir (None
    when it holds none yet: the same command line starts a job and restarts it)."""
    if a.resume == RESUME_LATEST and not cfg.checkpoint_dir:
        raise CheckpointError("--resume without a PATH needs --checkpoint-dir to look in")
    misnamed = misnamed_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    if misnamed is not None:
        path, held = misnamed
        raise CheckpointError(
            f"checkpoint '{path}' holds step {held}, not the step its name says: the newest is "
            f"picked and the oldest pruned by name, so rename it {checkpoint_name(held)} or move it away"
        )
    if a.resume == RESUME_LATEST:
        path = latest_checkpoint(cfg.checkpoint_dir)
        if path is None:
            print(f"mgpu: note: no checkpoint in '{cfg.checkpoint_dir}' yet: starting a new run", flush=True)
        return path
    newest = latest_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    # (a PATH that is no file, or none: the load says what it is)
    if newest is not None and os.path.isfile(a.resume) and not _same_file(newest, a.resume):
        # The resumed run writes ckpt-<step> files there and prunes the oldest: beside
        # another run's, or a rewound run's among the newer ones it would replace.
        step = checkpoint_step(a.resume)
        step = step if step is not None else step_of(a.resume)
        if step is not None and step < step_of(newest):
            raise CheckpointError(
                f"--checkpoint-dir '{cfg.checkpoint_dir}' holds checkpoints newer than the one "
                f"resumed (step {step}), newest {os.path.basename(newest)}: resume that one, move "
                "them away, or give another directory"
            )
        raise CheckpointError(
            f"--checkpoint-dir '{cfg.checkpoint_dir}' holds checkpoints other than the one resumed "
            f"(newest {os.path.basename(newest)}): give an empty directory, or move them away"
        )
    return a.resume


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


class _StopOnSignals:
    """SIGTERM, SIGINT and SIGUSR1 ask the trainer to checkpoint and stop at the
    next step boundary (all ranks agree on which); a second SIGINT interrupts at once."""

    SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")

    def __init__(self, trainer, pg):
        self.trainer, self.pg, self.previous = trainer, pg, {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.trainer._stop_request is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.trainer.request_stop(name)
        write_line(f"mgpu: {name} on rank {self.pg.rank}: stopping at the next step boundary")

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            # A rank of run_on_gpus: its main thread takes the signals and calls us.
            on_stop = getattr(self.pg, "on_stop_request", None)
            if on_stop is not None:
                on_stop(lambda name: self._handle(getattr(signal, name), None))
            return self
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        return False


def _check_outputs(a, telemetry: Optional[TelemetrySettings]) -> None:
    """The output options: writable, distinct, consistent (before any training)."""
    outputs = {"--json": a.json, "--save": a.save, "--trace": a.trace, "--log-json": a.log_json}
    if telemetry is not None:
        outputs.update(output_options(telemetry.prefix))
    check_outputs(outputs, {"--dataset": a.dataset, "--resume": a.resume if a.resume != RESUME_LATEST else None})
    check_outputs_outside_dirs(
        outputs,
        {"--checkpoint-dir": a.checkpoint_dir, "--tensorboard": a.tensorboard},
        {"--checkpoint-dir": CHECKPOINT_NAME},
    )
    if a.save:
        check_parameter_format(a.save)  # a missing writer: said before training, not after it
    if a.trace_steps is not None and not a.trace:
        raise ConfigError("--trace-steps chooses the steps of --trace: give --trace PATH too")
    for option, value in (("--checkpoint-every", a.checkpoint_every), ("--keep-checkpoints", a.keep_checkpoints)):
        if value is not None and not a.checkpoint_dir:
            raise ConfigError(f"{option} applies to the checkpoints of --checkpoint-dir: give --checkpoint-dir DIR too")
    if a.tensorboard is not None:
        check_output_dir(a.tensorboard, "--tensorboard")
        import_summary_writer()  # optional: say so before training, not after it
    if not 0 <= a.straggler_threshold < 1e6:
        raise ConfigError(f"--straggler-threshold must be a percentage in [0, 1e6), got {a.straggler_threshold}")
    if a.observe_every < 1:
        raise ConfigError(f"--observe-every must be >= 1, got {a.observe_every}")


@dataclass(frozen=True)
class TelemetrySettings:
    """--telemetry PREFIX with its options, their defaults filled in and checked."""

    prefix: str
    interval: float
    max_temp: float
    max_memory_percent: float
    power_limit: Optional[float]
    stop_on: tuple  # the metrics above whose threshold the run stops instead of warning


def _telemetry_settings(a) -> Optional[TelemetrySettings]:
    """--telemetry's options: only with it, then their defaults; a finite interval > 0."""
    given = [f"--{k.replace('_', '-')}" for k, v in TELEMETRY_DEFAULTS.items() if getattr(a, k) not in (None, False)]
    if not a.telemetry:
        if given:
            raise ConfigError(f"{given[0]} belongs to the training telemetry: give --telemetry PREFIX too")
        return None
    value = {k: default if getattr(a, k) is None else getattr(a, k) for k, default in TELEMETRY_DEFAULTS.items()}
    check_monitor_options(
        value["telemetry_interval"],
        value["max_temp"],
        value["max_memory_percent"],
        value["power_limit"],
        interval_option="--telemetry-interval",
    )
    stop_on = tuple(
        m
        for m, flag in (("temperature_c", value["stop_above_temp"]), ("memory_used_pct", value["stop_above_memory"]))
        if flag
    )
    return TelemetrySettings(
        a.telemetry,
        value["telemetry_interval"],
        value["max_temp"],
        value["max_memory_percent"],
        value["power_limit"],
        stop_on,
    )


@dataclass(frozen=True)
class RunPlan:
    """Everything `train` resolved before it builds anything, alike on every rank (rank 0's
    readings of the calibration and of the checkpoints are broadcast). The parsed options
    stay as they were given; what was 'auto' or left out is resolved here."""

    args: argparse.Namespace
    config: TrainConfig  # validated; bucket_mb resolved
    device: str
    device_index: int
    threads: int
    data: Dataset
    loss: str
    sizes: tuple  # the layers as built for the dataset
    batch_shares: Optional[list]  # per rank, or None for equal shares
    bucket_note: Optional[str]  # why --bucket-mb auto chose its bucket (said once the model is built)
    resume: Optional[str]  # the checkpoint resumed, or None
    telemetry: Optional[TelemetrySettings]
    emulated: bool  # the device is mgpu's GPU emulation: every figure says so
    prediction: dict  # the selector's step for this run (run_check.predict_run), rank 0's reading

    @property
    def total_steps(self) -> int:
        cfg = self.config
        steps_per_epoch = -(-len(self.data.x_train) // (cfg.batch_size * cfg.accumulate))
        return cfg.steps if cfg.steps is not None else cfg.epochs * steps_per_epoch


def plan_run(a, pg) -> RunPlan:
    """Collective: check the options, load the data and resolve every automatic value. An
    error on any rank (a missing file, a full disk) is raised on every rank."""
    cfg = _config_from_args(a).validate(pg.size)
    if a.batch_shares is not None and a.batch_shares != "auto":
        try:
            split_counts(cfg.batch_size, pg.size, a.batch_shares)
        except ConfigError:
            raise ConfigError(
                f"--batch-shares needs {pg.size} non-negative numbers (one per rank) "
                f"with a positive sum, got {a.batch_shares}"
            ) from None
    device, device_index = pg.resolve_device(cfg.device)
    threads = cfg.threads or pg.default_threads()
    error, resume, bucket_note, telemetry, prediction = None, None, None, None, None
    batch_shares, bucket = a.batch_shares, a.bucket_mb
    try:  # work that can fail on some ranks only: agree before any collective
        fixed_in, fixed_out = cfg.fixed_io()
        data = load_dataset(
            cfg.dataset, in_features=fixed_in, out_features=fixed_out, seed=42, val_fraction=cfg.val_fraction
        )
        loss = cfg.loss or data.default_loss
        if loss == "cross_entropy" and data.num_classes is None:
            raise DataError(
                f"loss cross_entropy needs integer class labels, but dataset '{cfg.dataset}' has float targets"
            )
        if loss == "mse" and data.num_classes is not None:
            raise DataError(f"loss mse needs float targets, but dataset '{cfg.dataset}' has class labels")
        if cfg.precision == "fp16" and device == "cuda":
            _check_fp16_inputs(data)
        sizes = cfg.layer_sizes(data.in_features, data.out_features)
        if batch_shares == "auto":  # the model as built for this dataset
            batch_shares = auto_batch_shares(cfg, pg, sizes, device)
        if bucket is None:  # auto where this machine is calibrated, else the safe 4 MB
            bucket = "auto" if os.path.exists(profiles.default_profile_path()) else 4.0
        if bucket == "auto":
            bucket, bucket_note = auto_bucket_mb(cfg, pg, sizes, device)
        if pg.is_root and _samples_per_step(cfg, data) < cfg.batch_size * cfg.accumulate:
            prediction = {"available": False, "reason": "a step takes the whole dataset, fewer samples than its batch"}
        elif pg.is_root:  # made once, before the first step: nothing per step
            at_bucket = dataclasses.replace(cfg, bucket_mb=float(bucket))
            prediction = predict_run(at_bucket, pg.size, sizes, device, threads, batch_shares)
        if len(data.x_train) < pg.size:
            raise DataError(f"dataset has {len(data.x_train)} training samples, fewer than the {pg.size} ranks")
        telemetry = _telemetry_settings(a)
        _check_outputs(a, telemetry)
        if a.resume is not None and pg.is_root:
            resume = _resolve_resume(a, cfg)
        elif cfg.checkpoint_dir and pg.is_root:
            _refuse_another_runs_checkpoints(cfg.checkpoint_dir)
    except ConfigError as e:
        error = e
    pg.agree(error)
    # rank 0's readings (of the checkpoints, and of the calibration for 'auto') on every rank
    resume = pg.bcast(resume)
    shares = pg.bcast(batch_shares)
    bucket = float(pg.bcast(bucket))
    if cfg.precision != "fp32" and device != "cuda":
        raise ConfigError(f"--precision {cfg.precision} needs a GPU; the CPU backend computes in fp32")
    check_comm_for_device(cfg.comm, device)
    return RunPlan(
        args=a,
        config=dataclasses.replace(cfg, bucket_mb=bucket),
        device=device,
        device_index=device_index,
        threads=threads,
        data=data,
        loss=loss,
        sizes=tuple(sizes),
        batch_shares=shares,
        bucket_note=bucket_note,
        resume=resume,
        telemetry=telemetry,
        emulated=gpus_emulated(device),
        prediction=pg.bcast(prediction),
    )


def build_run(plan: RunPlan, pg) -> tuple:
    """Collective: check the memory, build the model and the trainer, and what watches
    them; returns (model, trainer, checkpoint policy, telemetry, observer)."""
    cfg, a, data = plan.config, plan.args, plan.data
    nccl = run_communicator(cfg, pg.size, plan.device) == "nccl"
    # this rank's rows of a micro-batch (a step takes no more rows than the dataset holds)
    rows = max(1, split_counts(min(cfg.batch_size, len(data.x_train)), pg.size, plan.batch_shares)[pg.rank])
    model, error = None, None
    data_on_device, placement_reason = cfg.data_on_device, None
    # per rank: its environment (MGPU_CPU_GEMM, ...) and its device's memory; agree before the Trainer's collectives
    try:
        memory = dict(
            optimizer=cfg.optimizer,
            precision=cfg.precision,
            dropout=cfg.effective_dropout(),
            device=plan.device,
            device_index=plan.device_index,
            local_ranks=pg.local_size,
            eval_rows=split_counts(len(data.x_val), pg.size)[pg.rank],
            nccl=nccl,
            mpi_bucket_bytes=4.0 * cfg.bucket_elems() if pg.size > 1 and not nccl else 0.0,
            optimizer_shards=pg.size if cfg.shard_optimizer else 1,
            world_ranks=pg.size,
        )
        if data_on_device == "on" or (plan.device == "cuda" and data_on_device != "off"):
            # the training set on the GPU where it fits beside the step (on: or refused here)
            held = resident_bytes(len(data.x_train), data.in_features, plan.sizes[-1], data.task == "classification")
            try:
                check_training_memory(list(plan.sizes), rows, resident_bytes=held, **memory)
                if data_on_device == "auto":
                    placement_reason = f"auto: {held / 1e6:.3g} MB, which fit beside the step in the GPU's memory"
                data_on_device = "on"
            except ConfigError:
                if data_on_device == "on":
                    raise
                data_on_device = "off"
                placement_reason = f"auto: {held / 1e6:.3g} MB, which do not fit beside the step in the GPU's memory"
        check_training_memory(list(plan.sizes), rows, **memory)
        model = MLP(
            list(plan.sizes),
            seed=cfg.seed,
            dropout=cfg.effective_dropout(),
            device=plan.device,
            device_index=plan.device_index,
            threads=plan.threads,
            precision=cfg.precision,
        )
    except (ConfigError, DeviceError) as e:
        error = e
    pg.agree(error, what="building the model")
    if pg.is_root and plan.bucket_note:
        print(plan.bucket_note, flush=True)
    # timed: a device backend's phases are synchronised apart for the JSON log's phase times
    # (the trace needs no such thing: its spans are CUDA events)
    settings = cfg.trainer_config(
        loss=plan.loss,
        total_steps=plan.total_steps,
        batch_shares=plan.batch_shares,
        timed=plan.device == "cuda" and bool(a.log_json),
        data_on_device=data_on_device,
    )
    trainer = Trainer(model, settings, pg)
    trainer.data_placement_reason = placement_reason  # where auto was decided here, fit reports why
    policy = (
        CheckpointPolicy(cfg.checkpoint_dir, cfg.checkpoint_every, cfg.keep_checkpoints) if cfg.checkpoint_dir else None
    )
    telemetry = None
    if plan.telemetry is not None:
        t = plan.telemetry
        telemetry = TrainTelemetry(
            pg,
            prefix=t.prefix,
            interval=t.interval,
            device=plan.device,
            device_index=plan.device_index,
            stop_on=list(t.stop_on),
            emulated=plan.emulated,
            thresholds=Thresholds(t.max_temp, t.max_memory_percent, t.power_limit),
        )
    observer = None
    if a.trace or a.log_json or a.tensorboard or a.straggler_threshold > 0 or telemetry is not None:
        run_info = {
            "version": __version__,
            "device": plan.device,
            "threads_per_rank": plan.threads,
            "layers": list(plan.sizes),
            "params": model.num_params,
            "dataset": cfg.dataset,
            "batch_size": cfg.batch_size,
            "accumulate": cfg.accumulate,
            "resumed_from": plan.resume,
            "prediction": plan.prediction,
        }
        observer = Observer(
            pg,
            trace=a.trace,
            trace_steps=a.trace_steps or DEFAULT_TRACE_STEPS,
            log_json=a.log_json,
            tensorboard=a.tensorboard,
            every=a.observe_every,
            straggler_threshold=a.straggler_threshold / 100,
            emulated=plan.emulated,
            run_info=run_info,
            telemetry=telemetry,
            device_clock=plan.device == "cuda",
        )
        observer.before_end = lambda t: [("prediction", checked_prediction(plan, t))]
    return model, trainer, policy, telemetry, observer


def checked_prediction(plan: RunPlan, trainer) -> dict:
    """The plan's prediction held against this rank's steady-state steps (run_check); on
    rank 0 priced anew where the training set went elsewhere than the plan priced it (auto
    on a GPU is priced resident, and stays on the host where it does not fit)."""
    prediction = plan.prediction
    placed = trainer.data_placement
    if (
        trainer.pg.is_root
        and plan.device == "cuda"
        and prediction.get("available")
        and placed is not None
        and bool(placed["resident"]) != prediction.get("data_on_device")
    ):
        cfg = dataclasses.replace(plan.config, data_on_device="on" if placed["resident"] else "off")
        prediction = predict_run(cfg, trainer.pg.size, list(plan.sizes), plan.device, plan.threads, plan.batch_shares)
    timed = plan.device == "cpu" or trainer.config.timed
    return check_run(prediction, trainer.step_times.medians(), phases_timed=timed)


def header(plan: RunPlan, model, trainer) -> str:
    """train's first line: ranks, device, model, data and how the batch splits."""
    cfg, data = plan.config, plan.data
    # a batch larger than the dataset: a step takes every sample, split among the ranks
    whole = _samples_per_step(cfg, data) < cfg.batch_size * cfg.accumulate
    per_rank = ", ".join(
        str(c) for c in split_counts(len(data.x_train) if whole else cfg.batch_size, trainer.pg.size, plan.batch_shares)
    ) + (" per rank a step" if whole else " per rank")
    accum = f" x {cfg.accumulate} accumulated" if cfg.accumulate > 1 else ""
    on = (
        f"{plan.device}, {cfg.precision}, {trainer.communicator_kind} allreduce"
        if plan.device == "cuda"
        else plan.device
    )
    if cfg.grad_dtype != "fp32":
        on += f" of {cfg.grad_dtype} gradients"
    if trainer.shards_optimizer:
        on += f", optimizer sharded {trainer.pg.size} ways"
    if plan.emulated:  # on the GPU emulation every line that shows a GPU or its speed says so
        on = f"EMULATED GPUs (CPU emulation, not real GPUs; speeds are not GPU speeds): {on}"
    return (
        f"mgpu {__version__}: {trainer.pg.size} rank(s) x {plan.threads} thread(s) on {on}; "
        f"model {'-'.join(map(str, plan.sizes))} ({model.num_params:,} params, {plan.loss}, {cfg.optimizer}); "
        f"{cfg.dataset}: {len(data.x_train)} train / {len(data.x_val)} val; "
        f"global batch {cfg.batch_size} ({per_rank}){accum}{_whole_dataset_note(cfg, data)}"
    )


def _epoch_line(e: dict) -> None:
    from tqdm.auto import tqdm  # where an epoch is printed, as the trainer's bar imports it: not at every start-up

    acc = f"  val_acc {e['val_accuracy']:.4f}" if "val_accuracy" in e else ""
    on_emulation = " on EMULATED GPUs" if e.get("gpu_emulation") else ""
    tqdm.write(
        f"epoch {e['epoch']:3d}  train_loss {e['train_loss']:.5f}  val_loss {e['val_loss']:.5f}"
        f"{acc}  {e['samples_per_sec']:,.0f} samples/s{on_emulation}"
    )


def run(plan: RunPlan, trainer, policy, observer, pg) -> tuple:
    """Collective: train until the plan's end or an agreed stop; returns (history, wall seconds)."""
    cfg = plan.config
    t0 = time.perf_counter()
    with _StopOnSignals(trainer, pg):
        history = trainer.fit(
            plan.data,
            batch_size=cfg.batch_size,
            epochs=cfg.epochs,
            steps=cfg.steps,
            seed=cfg.seed,
            progress=not plan.args.no_progress,
            on_epoch=_epoch_line if pg.is_root else None,
            checkpoint=policy,
            resume=plan.resume,
            observer=observer,
        )
    return history, time.perf_counter() - t0


def report(plan: RunPlan, model, trainer, telemetry, observer, history: list, wall: float, pg) -> int:
    """The run's last lines, its JSON, the saved parameters; then the collective end."""
    cfg, a, data = plan.config, plan.args, plan.data
    say = print if pg.is_root else (lambda *x, **k: None)
    # a resumed run's figures hold its earlier epochs' too: emulated where any of them was
    emulated_figures = plan.emulated or any(e.get("gpu_emulation") for e in history)
    train_seconds = sum(e["seconds"] for e in history)
    samples = sum(e["samples"] for e in history)
    result = {
        "version": __version__,
        "world_size": pg.size,
        "device": plan.device,
        "threads_per_rank": plan.threads,
        "grad_dtype": cfg.grad_dtype,
        "config": {
            **cfg.to_dict(),
            "loss": plan.loss,
            "layers": list(plan.sizes),
            "dropout": cfg.effective_dropout(),
            "batch_shares": plan.batch_shares,
            "effective_batch": cfg.batch_size * cfg.accumulate,
            "samples_per_step": _samples_per_step(cfg, data),
        },
        "model": {"layers": list(plan.sizes), "params": model.num_params},
        "dataset": {"name": cfg.dataset, "train": len(data.x_train), "val": len(data.x_val), "task": data.task},
        "history": history,
        "steps": trainer.global_step,
        "samples_per_sec": samples / train_seconds if train_seconds > 0 else 0.0,
        "wall_seconds": wall,
        "resumed_from": plan.resume,
        "stopped": trainer.stop_reason,
        "checkpoint": trainer.last_checkpoint,
        "gpu_emulation": emulated_figures,
        "stragglers": trainer.stragglers,
        "prediction": checked_prediction(plan, trainer),
        "data_placement": trainer.data_placement,
    }
    if telemetry is not None:
        result["telemetry"] = {
            "files": observer.telemetry_files,
            "source": telemetry.source,
            "events": telemetry.events,
        }
    if trainer.stop_reason and trainer.global_step < trainer.run_end:  # (on the last step: done all the same)
        where = f"; checkpoint {trainer.last_checkpoint} (continue with --resume)" if trainer.last_checkpoint else ""
        say(f"stopped at step {trainer.global_step} ({trainer.stop_reason}){where}")
    elif history:
        final = history[-1]
        acc = f", val accuracy {final['val_accuracy']:.4f}" if "val_accuracy" in final else ""
        say(
            f"done: {trainer.global_step} steps in {wall:.1f}s, {result['samples_per_sec']:,.0f} samples/s"
            f"{_emulation_words(plan.emulated, emulated_figures)}; final train loss {final['train_loss']:.5f}, "
            f"val loss {final['val_loss']:.5f}{acc}"
        )
    placement = trainer.data_placement
    if placement and (plan.device == "cuda" or placement["resident"]):
        say(
            f"training set: on the device ({placement['why']}); each step's rows gathered there"
            if placement["resident"]
            else f"training set: each step's rows copied from the host ({placement['why']})"
        )
    say(format_check(result["prediction"]))
    if pg.is_root:
        for key in ("warning", "unsure"):
            if result["prediction"].get(key):
                print(f"mgpu: warning: {result['prediction'][key]}", file=sys.stderr, flush=True)
        if plan.device == "cpu" or not trainer.config.timed:  # (timed GPU phases give up overlap)
            record_run(result["prediction"], pg.size)
    if pg.is_root:
        if a.json:
            write_json_atomic(a.json, result)
            say(f"results written to {a.json}")
        if a.save:
            model.save(a.save)
            say(f"parameters written to {a.save}")
        for path, what in (
            (a.trace, "trace"),
            (a.log_json, "JSON log"),
            (a.tensorboard, "TensorBoard scalars"),
            *((p, "telemetry") for p in (observer.telemetry_files if telemetry else [])),
        ):
            if path:
                say(f"{what} written to {path}")
    pg.barrier()
    pg.close()  # the collective end of the communicator (NCCL: finalize, destroy)
    return 0


def cmd_train(a, pg) -> int:
    plan = plan_run(a, pg)
    model, trainer, policy, telemetry, observer = build_run(plan, pg)
    if pg.is_root:
        print(header(plan, model, trainer), flush=True)
        if plan.resume:
            print(f"resuming from {plan.resume}", flush=True)
    history, wall = run(plan, trainer, policy, observer, pg)
    return report(plan, model, trainer, telemetry, observer, history, wall, pg)


FP16_MAX = 65504.0  # the largest finite fp16 value


def _check_fp16_inputs(data) -> None:
    """fp16 GEMMs take the inputs cast to fp16: a feature beyond its range becomes inf,
    and every step's gradients NaN, which loss scaling cannot help (refused up front)."""
    peak = max(float(abs(x).max(initial=0.0)) for x in (data.x_train, data.x_val))
    if peak > FP16_MAX:
        raise DataError(
            f"--precision fp16: the inputs reach {peak:g}, beyond fp16's largest value {FP16_MAX:g} "
            "(they would become inf): scale them, or use --precision bf16"
        )


def _emulation_words(emulated: bool, emulated_figures: bool) -> str:
    """What train's last line says of emulated GPUs: this run's, or earlier epochs' in its figures."""
    if emulated:
        return " on the GPU emulation"
    return " (with epochs run on EMULATED GPUs before the resume)" if emulated_figures else ""


def _samples_per_step(cfg, data) -> int:
    """The samples a step takes: the batch x the micro-batches, or the whole training set
    where that is smaller."""
    return min(cfg.batch_size * cfg.accumulate, len(data.x_train))


def _whole_dataset_note(cfg, data) -> str:
    """The header's word that a step takes every training sample, where the batch (x the
    micro-batches) is larger than the dataset: the step is the dataset, not the batch."""
    n = len(data.x_train)
    if _samples_per_step(cfg, data) == cfg.batch_size * cfg.accumulate:
        return ""
    per_micro = f", micro-batches of about {max(1, n // cfg.accumulate)}" if cfg.accumulate > 1 else ""
    return f" (larger than the {n} training samples: every step takes all {n}{per_micro})"


def train_in_one_process(a, pg) -> int:
    """`train --gpus N`: N ranks as threads of this process, one GPU each (see thread_group.py)."""
    if pg.size > 1:
        raise ConfigError(
            f"--gpus runs every GPU from one process; under mpirun ({pg.size} ranks) each rank "
            f"already drives one GPU: leave --gpus out"
        )
    if not 1 <= a.gpus <= MAX_THREADS:  # a thread each, even where NCCL lets threads share a GPU
        raise ConfigError(f"--gpus must be in 1..{MAX_THREADS}, got {a.gpus}")
    if a.device == "cpu":
        raise ConfigError("--gpus drives GPUs; CPU ranks run under mpirun (mpirun -np N python -m mgpu train)")
    # Before any rank thread starts: a thread per GPU asked for, whatever is there.
    visible = cuda_device_count()
    if visible == 0:
        raise ConfigError(
            f"--gpus drives GPUs, and no GPU is visible ({no_gpu_reason()}); CPU ranks run under "
            "mpirun (mpirun -np N python -m mgpu train --device cpu)"
        )
    if a.gpus > visible and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        raise ConfigError(
            f"--gpus {a.gpus} asked for, but {visible} GPU(s) visible: one thread drives one GPU "
            "(NCCL >= 2.30 shares a GPU with NCCL_MULTI_RANK_GPU_ENABLE=1)"
        )
    try:
        codes = run_on_gpus(lambda tg: cmd_train(a, tg), gpus=a.gpus)
    except KeyboardInterrupt:
        if rank_threads_alive():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a third one must not interrupt the exit
            # A second SIGINT while rank threads are inside the core: finalizing the
            # interpreter would end them mid-call (pthread_exit through C++ frames:
            # std::terminate, a native backtrace). End the process at once instead,
            # as the second SIGINT asks; checkpoints are written by rename, whole or not at all.
            write_line("mgpu: interrupted")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        raise
    return max(codes)


def add_parser(sub) -> None:
    t = sub.add_parser(
        "train",
        help="train an MLP (run under mpirun -np N for N ranks)",
        description="Train an MLP data-parallel across the ranks of this MPI job.",
    )
    m = t.add_mutually_exclusive_group()
    m.add_argument("--model", choices=sorted(PRESETS), default=None, help="model preset (default: medium)")
    m.add_argument("--layers", type=int_list("layer sizes"), help="layer sizes in,h1,...,out (e.g. 50,256,3)")
    t.add_argument("--dataset", default="synthetic", help="synthetic | digits | PATH.npz (arrays x, y)")
    t.add_argument("--batch-size", type=int, default=256, help="global batch size across all ranks")
    n = t.add_mutually_exclusive_group()
    n.add_argument("--epochs", type=int, default=None, help="epochs (default: 5)")
    n.add_argument("--steps", type=int, default=None, help="total steps instead of epochs")
    t.add_argument("--lr", type=float, default=None, help="learning rate (default: 0.01 sgd, 0.001 adamw)")
    t.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    t.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--loss", choices=LOSSES, default=None, help="default: mse for regression, cross_entropy for labels")
    t.add_argument("--dropout", type=float, default=None, help="dropout after hidden layers (default: the preset's)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", choices=DEVICES, default="auto")
    t.add_argument(
        "--gpus",
        type=int,
        default=None,
        metavar="N",
        help="single-process multi-GPU: drive N GPUs from threads of this process, no mpirun "
        "(NCCL between them; default: one rank per process)",
    )
    t.add_argument(
        "--threads",
        type=bounded_int("threads per rank", MAX_THREADS),
        default=None,
        help="CPU threads per rank (default: cores / ranks per node)",
    )
    t.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="GEMM precision on GPUs: fp32 (default), tf32, bf16, fp16 (dynamic loss scaling)",
    )
    t.add_argument(
        "--grad-dtype",
        choices=GRAD_DTYPES,
        default="fp32",
        help="type the gradients are allreduced in: bf16 or fp16 halve the bytes (NCCL between GPUs; default fp32)",
    )
    t.add_argument(
        "--shard-optimizer",
        action="store_true",
        help="ZeRO-1: each rank keeps optimizer state for, and updates, its own shard of the parameters "
        "(gradients reduce-scattered, parameters all-gathered); the same results, 1/ranks of the state",
    )
    t.add_argument(
        "--comm",
        choices=COMMS,
        default="auto",
        help="gradient allreduce: auto (NCCL between GPUs, else MPI), nccl, mpi (host-staged)",
    )
    t.add_argument(
        "--cuda-graph",
        choices=GRAPH_MODES,
        default="auto",
        help="replay each step's forward and backward as a CUDA graph: auto (GPUs, models up to "
        "16M parameters, where kernel launches dominate), on, off",
    )
    t.add_argument(
        "--data-on-device",
        choices=DATA_PLACEMENTS,
        default="auto",
        help="copy the training set to the device once and gather each step's rows there: auto (GPUs, "
        "where it fits beside the step), on (also on CPUs), off (each step's rows copied from the host)",
    )
    t.add_argument(
        "--bucket-mb",
        type=bucket_mb,
        default=None,
        help="gradient allreduce bucket size in MB, or 'auto': the size the performance model prefers "
        "for this model on the calibration (`mgpu topo`; CPUs stay below 32 MB). Default: auto "
        "when a calibration exists, else 4",
    )
    t.add_argument("--no-overlap", action="store_true", help="allreduce after backward instead of during it")
    t.add_argument(
        "--batch-shares",
        type=_shares,
        default=None,
        help="per-rank shares of the global batch, e.g. 0.7,0.3, or 'auto': by each rank's device "
        "speed in the calibration (`mgpu topo`) (default: equal)",
    )
    t.add_argument(
        "--accumulate",
        type=int,
        default=1,
        metavar="K",
        help="gradient accumulation: K micro-batches of --batch-size per step, one allreduce",
    )
    t.add_argument(
        "--max-grad-norm",
        type=float,
        default=0.0,
        metavar="X",
        help="clip gradients to global L2 norm X (default 0: off)",
    )
    t.add_argument("--lr-schedule", choices=SCHEDULES, default="constant")
    t.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up steps")
    t.add_argument("--lr-step-size", type=int, default=1000, help="step schedule: steps between decays")
    t.add_argument("--lr-gamma", type=float, default=0.1, help="step schedule: decay factor")
    t.add_argument("--min-lr", type=float, default=0.0, help="cosine schedule: final learning rate")
    c = t.add_argument_group("checkpoints and faults")
    c.add_argument("--checkpoint-dir", metavar="DIR", help="write checkpoints here (rank 0, atomically)")
    c.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="N",
        help="checkpoint every N steps (default 0: at the end and when stopped by a signal)",
    )
    c.add_argument("--keep-checkpoints", type=int, metavar="K", help="newest checkpoints kept (default 3)")
    c.add_argument(
        "--resume",
        nargs="?",
        const=RESUME_LATEST,
        metavar="PATH",
        help="continue from a checkpoint: PATH, or the newest in --checkpoint-dir (none there yet: "
        "start a new run, so one command line starts a job and restarts it; a file named "
        "'latest': ./latest)",
    )
    c.add_argument(
        "--watchdog-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="end the job when a peer has not joined a collective for S seconds (0: wait forever)",
    )
    c.add_argument(
        "--max-bad-steps",
        type=int,
        default=3,
        metavar="N",
        help="stop after N consecutive steps with non-finite loss or gradients (each is skipped)",
    )
    t.add_argument("--json", metavar="PATH", help="write results (config, history, samples/s) as JSON")
    o = t.add_argument_group("observability (observe.py)")
    o.add_argument(
        "--trace",
        metavar="PATH",
        help="write a timeline of the traced steps, one track per rank, as Chrome trace-event JSON "
        "(open in ui.perfetto.dev or chrome://tracing); on GPUs the phases are synchronized "
        "to separate them, which costs the overlap",
    )
    o.add_argument(
        "--trace-steps",
        type=parse_step_range,
        default=None,
        metavar="A:B",
        help=f"trace the steps A <= step < B (0-based; 'A:' to the end; default "
        f"{DEFAULT_TRACE_STEPS[0]}:{DEFAULT_TRACE_STEPS[1]}), bounding the trace's size",
    )
    o.add_argument(
        "--log-json",
        metavar="PATH",
        help="append one JSON object per line and event (run, step x rank with phase times, epoch, "
        "warning, checkpoint, straggler) to PATH",
    )
    o.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="write loss, validation metrics, learning rate, samples/s, gradient norm, loss scale "
        "and skipped steps as TensorBoard scalars to DIR (rank 0; needs tensorboardX)",
    )
    o.add_argument(
        "--straggler-threshold",
        type=float,
        default=25.0,
        metavar="PCT",
        help="name a rank whose median step work is PCT%% above the median rank's, with the phase "
        "(progress bar, --json history, --log-json); 0: off (default 25)",
    )
    o.add_argument(
        "--observe-every",
        type=int,
        default=50,
        metavar="N",
        help="steps between gathers of every rank's step times to rank 0 (the straggler check's "
        "window and --log-json's delay; default 50)",
    )
    w = t.add_argument_group("telemetry and safety (monitor/training.py; the thresholds of `mgpu stress`)")
    w.add_argument(
        "--telemetry",
        metavar="PREFIX",
        help="sample every rank's device (NVML on GPUs, /proc on CPUs) and its training samples/s "
        "while training; rank 0 writes PREFIX.csv, PREFIX.json and PREFIX.png at the end",
    )
    w.add_argument(
        "--telemetry-interval",
        type=float,
        default=None,
        metavar="S",
        help=f"seconds between samples (default {TELEMETRY_DEFAULTS['telemetry_interval']:g})",
    )
    w.add_argument(
        "--max-temp",
        type=float,
        default=None,
        metavar="C",
        help=f"warn above this device temperature (default {TELEMETRY_DEFAULTS['max_temp']:g})",
    )
    w.add_argument(
        "--max-memory-percent",
        type=float,
        default=None,
        metavar="PCT",
        help=f"warn above this share of device memory used (default {TELEMETRY_DEFAULTS['max_memory_percent']:g})",
    )
    w.add_argument(
        "--power-limit",
        type=float,
        default=None,
        metavar="W",
        help="warn above this power draw (default: the device's enforced limit)",
    )
    w.add_argument(
        "--stop-above-temp",
        action="store_true",
        help="above --max-temp, stop at the next step with a checkpoint instead of warning",
    )
    w.add_argument(
        "--stop-above-memory",
        action="store_true",
        help="above --max-memory-percent, stop at the next step with a checkpoint instead of warning",
    )
    t.add_argument(
        "--save",
        metavar="PATH",
        help="write final parameters as .npz, or safetensors for a PATH ending in .safetensors "
        "(layers.{i}.weight/bias, nn.Linear's layout)",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
