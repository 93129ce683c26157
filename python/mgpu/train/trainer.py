"""Trainer: the Python side of data-parallel training.

One call per step into the core (DataParallelStep.step: forward, loss,
backward with bucketed allreduce, health check, clipping, update; with
gradient accumulation, K micro-batches per call). This file owns the loop
around it: which samples each rank takes, the learning-rate schedule, epochs,
validation, skipped steps, checkpoints, stop requests, progress and history.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .._core import __version__
from .._runtime import _core, gpus_emulated
from ..errors import ConfigError, DeviceError, NumericsError
from ..hostinfo import available_memory
from .checkpoint import (
    CheckpointError,
    check_compatible,
    load_checkpoint,
    prepare_directory,
    save_checkpoint,
)
from .config import TrainerConfig
from .data import (
    Dataset,
    GlobalBatches,
    check_dataset_fits,
    local_slice,
    place_training_set,
    resident_bytes,
    split_counts,
)
from .group import Group
from .model import MLP
from .process_group import ProcessGroup
from .schedule import LRSchedule
from .step_times import StepTimes


@dataclass
class CheckpointPolicy:
    """Where and how often fit() writes checkpoints (rank 0 writes; all ranks agree on success)."""

    directory: str
    every: int = 0  # steps between checkpoints; 0: only at the end and on a stop request
    keep: int = 3  # newest checkpoints kept

    def __post_init__(self):
        if not isinstance(self.every, int) or self.every < 0:
            raise ConfigError(f"checkpoint interval must be an integer >= 0 steps, got {self.every}")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(f"checkpoints to keep must be an integer >= 1, got {self.keep}")


_STATE_INTS = ("optimizer_steps", "good_steps", "global_step", "epoch", "batch_in_epoch", "epoch_samples", "bad_steps")
_STATE_FLOATS = ("loss_scale", "epoch_loss_sum", "epoch_seconds")
_HISTORY_COUNTS = ("epoch", "steps", "samples")
_HISTORY_NUMBERS = _HISTORY_COUNTS + ("train_loss", "val_loss", "seconds", "samples_per_sec", "val_accuracy")
# Dynamic loss scaling: the scale doubles after this many good steps in a row (StepOptions.loss_scale_window).
_LOSS_SCALE_GROWTH_INTERVAL = 2000


def _resume_state(meta: dict, path: str) -> dict:
    """The loop state a checkpoint's metadata holds, checked: counters are integers >= 0,
    the rest numbers (the loss scale finite and > 0), the history a list of records
    (else CheckpointError)."""
    s, history = meta.get("state"), meta.get("history", [])
    if not isinstance(s, dict) or not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
        raise CheckpointError(f"checkpoint '{path}' has malformed metadata (state or history)")
    for i, record in enumerate(history):  # what the loop, the CLI and its JSON read of each epoch
        for key in _HISTORY_NUMBERS:
            value = record.get(key)
            if key == "val_accuracy" and key not in record:  # regression runs have none
                continue
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or (key in _HISTORY_COUNTS and (not isinstance(value, int) or value < 0))
            ):
                raise CheckpointError(f"checkpoint '{path}' has malformed metadata: history[{i}].{key} is {value!r}")
    out = {}
    for key in _STATE_INTS + _STATE_FLOATS:
        value = s.get(key)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        limit = 2**31 - 1 if key == "good_steps" else 2**62  # what the core's counters hold
        ok = (
            isinstance(value, int) and number and 0 <= value <= limit
            if key in _STATE_INTS
            else number and (key != "loss_scale" or (math.isfinite(value) and value > 0))
        )
        if not ok:
            raise CheckpointError(f"checkpoint '{path}' has malformed metadata: state.{key} is {value!r}")
        out[key] = value
    dynamic = s.get("dynamic_loss_scale", out["loss_scale"] != 1.0)  # before the flag: a scale other than 1 was
    if not isinstance(dynamic, bool):
        raise CheckpointError(f"checkpoint '{path}' has malformed metadata: state.dynamic_loss_scale is {dynamic!r}")
    out["dynamic_loss_scale"] = dynamic
    out["epoch_emulated"] = s.get("epoch_emulated", False)
    if not isinstance(out["epoch_emulated"], bool):
        raise CheckpointError(
            f"checkpoint '{path}' has malformed metadata: state.epoch_emulated is {out['epoch_emulated']!r}"
        )
    return out


class Trainer:
    """Data-parallel training of an MLP across the ranks of a Group (ProcessGroup or ThreadGroup).

    Every rank must construct it (parameters are broadcast from rank 0) and call
    step/fit/evaluate collectively.
    """

    def __init__(
        self,
        model: MLP,
        config: Optional[TrainerConfig] = None,
        group: Optional[Group] = None,
        *,
        process_group: Optional[Group] = None,
        **settings,
    ):
        """Trainer(model, TrainerConfig(...), group); or, as before, the config's fields as
        keywords (Trainer(model, lr=1e-3, process_group=pg)). The group defaults to
        ProcessGroup() (mpi4py's world, or a world of one)."""
        if config is None:
            config = TrainerConfig(**settings)  # an unknown keyword: TypeError, as a signature gives
        elif not isinstance(config, TrainerConfig):
            raise TypeError(f"Trainer's config must be a TrainerConfig, got {type(config).__name__}")
        elif settings:
            raise TypeError(
                f"give the trainer's settings in its TrainerConfig or as keywords, not both "
                f"(got {', '.join(sorted(settings))} beside a TrainerConfig)"
            )
        if group is not None and process_group is not None and group is not process_group:
            raise TypeError("give the group once: as the third argument or as process_group")
        c = self.config = config
        self.model = model
        self.loss = c.loss
        self.optimizer_name = c.optimizer
        self.pg = group or process_group or ProcessGroup()
        if c.batch_shares is not None:
            split_counts(self.pg.size, self.pg.size, c.batch_shares)  # one share per rank of this group
        self.batch_shares = c.batch_shares
        self.accumulate = c.accumulate
        self.grad_dtype = c.grad_dtype
        self.schedule = c.schedule or LRSchedule(float(c.lr))
        self.max_bad_steps = c.max_bad_steps
        self.pg.timeout = c.timeout
        communicator = c.communicator
        if communicator == "auto":  # NCCL between GPUs when this build has it; MPI otherwise
            communicator = (
                "nccl" if model.device == "cuda" and self.pg.size > 1 and hasattr(_core, "NcclCommunicator") else "mpi"
            )
        self.communicator_kind = communicator
        comm = self.pg.communicator("nccl", model.device_index) if communicator == "nccl" else self.pg.communicator()
        comm.timeout = c.timeout
        self._comm = comm  # the one this trainer's collectives use (MPI or NCCL), resume included
        # fp16 needs loss scaling (dynamic unless a scale is given), in the GEMMs or in the
        # gradients' allreduce alike (small gradients underflow fp16); other precisions none
        fp16 = getattr(model._backend, "precision", "fp32") == "fp16" or c.grad_dtype == "fp16"
        dynamic_loss_scale = c.dynamic_loss_scale
        if dynamic_loss_scale is None:
            dynamic_loss_scale = fp16 and c.loss_scale is None
        loss_scale = c.loss_scale
        if loss_scale is None:
            loss_scale = 2.0**16 if fp16 else 1.0
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self._scale_note_shown = False  # the overflow note: once per run of skipped steps
        self._optimizer = _core.Optimizer(
            model._core, c.optimizer, c.momentum, c.weight_decay, c.betas[0], c.betas[1], c.eps
        )
        options = _core.StepOptions(
            bucket_elems=c.bucket_elems,
            overlap=c.overlap,
            max_grad_norm=c.max_grad_norm,
            loss_scale=loss_scale,
            dynamic_loss_scale=dynamic_loss_scale,
            loss_scale_window=_LOSS_SCALE_GROWTH_INTERVAL,
            timed=c.timed,
            graph=c.graph,
            grad_dtype=c.grad_dtype,
            shard_optimizer=c.shard_optimizer,
        )
        self._step = _core.DataParallelStep(model._core, self._optimizer, comm, c.loss, options)
        self._graph_fallback_reported = False
        self._step.broadcast_parameters(0)
        # Loop state: everything a checkpoint must hold to continue exactly.
        self.global_step = 0  # steps taken (including skipped ones)
        self.epoch = 0  # 0-based epoch in progress
        self.batch_in_epoch = 0  # sampler position within it
        self._epoch_loss_sum, self._epoch_samples, self._epoch_seconds = 0.0, 0, 0.0
        self.bad_steps = 0  # consecutive steps with non-finite loss or gradients
        # mgpu's emulated GPUs: every figure of their steps says so (an epoch begun on them
        # and resumed elsewhere too: its time holds theirs)
        self.emulated = gpus_emulated(model.device)
        self._epoch_emulated = self.emulated
        self.history: list = []
        self.stragglers: list = []  # rank 0: slow ranks found by the observer's check
        self._epoch_stragglers: list = []
        self._straggler_note = ""
        self.last_result = None
        self.stop_reason: Optional[str] = None  # set once every rank agreed to stop early
        self.run_end = 0  # the step fit's run ends at (stopped early: global_step is short of it)
        self._stop_request: Optional[str] = None
        self._last_checkpoint_step = -1
        self.last_checkpoint: Optional[str] = None
        self.t_call = self.t_return = 0.0
        self.observer = None  # an observe.Observer during fit(observer=...)
        self.step_times = StepTimes()  # the steady-state step, which train holds its prediction against
        # where fit()'s training set lives: {"resident": bool, "bytes": int, "why": str} (None before fit)
        self.data_placement: Optional[dict] = None
        self.data_placement_reason: Optional[str] = None  # a caller's why, where it decided 'auto' (train)

    @property
    def shards_optimizer(self) -> bool:
        """Whether each rank keeps optimizer state for its shard of the parameters only (ZeRO-1)."""
        return self._step.shards_optimizer

    @property
    def optimizer_state_elements(self) -> int:
        """Values each optimizer state holds on this rank: every parameter's, or its shard's."""
        return self._optimizer.state_size

    @property
    def optimizer_state_names(self) -> list:
        """The optimizer's states ('exp_avg', ...; none for plain SGD)."""
        return list(self._optimizer.state_names())

    @property
    def lr(self) -> float:
        return self.schedule.lr_at(self.global_step)

    # --- one step ------------------------------------------------------------
    def request_stop(self, reason: str = "stop requested") -> None:
        """Ask to end the run at the next step boundary (safe to call from a signal handler).
        The request travels in the gradient allreduce, so all ranks stop at the same step."""
        self._stop_request = reason

    def step(
        self,
        x_local: np.ndarray,
        y_local: np.ndarray,
        *,
        global_batch: Optional[int] = None,
        first_sample: Optional[int] = None,
        trace: bool = False,
        prefetch: Optional[tuple] = None,
    ) -> float:
        """One data-parallel step on this rank's shard; returns the global mean loss.

        With accumulate=K the shard is processed as K consecutive micro-batches
        and gradients are allreduced once: the same update as one step on the
        whole batch. global_batch and first_sample (this shard's offset in the
        global batch) are computed with a collective when not given. A step with
        a non-finite loss or gradient leaves the parameters untouched (see
        last_result.applied); max_bad_steps of them in a row raise NumericsError.
        trace: the core records the step's spans and bucket allreduces
        (last_result.spans, .buckets; drain_trace() returns any not handed over).
        prefetch: (x, y), this rank's rows of the next step, copied to the device while this
        step computes (a copy stream on GPUs); take that step with step_prefetched.
        """
        t_start = time.perf_counter()
        global_batch, first_sample, bounds = self._micro_bounds(len(x_local), global_batch, first_sample)
        micro = [(x_local[a:b], y_local[a:b], first_sample + a) for a, b in zip(bounds, bounds[1:])]
        return self._take_step(
            t_start,
            lambda request: self._step.step(micro, global_batch, self.global_step, self.lr, request, trace, prefetch),
        )

    def step_prefetched(
        self,
        rows: int,
        *,
        global_batch: Optional[int] = None,
        first_sample: Optional[int] = None,
        trace: bool = False,
        prefetch: Optional[tuple] = None,
    ) -> float:
        """step() on the `rows` rows the step before prefetched (its `prefetch`), already on
        the device; prefetch: the next step's rows, as for step(). The same step, bit for bit."""
        t_start = time.perf_counter()
        global_batch, first_sample, bounds = self._micro_bounds(rows, global_batch, first_sample)
        micro = [(a, b - a, first_sample + a) for a, b in zip(bounds, bounds[1:])]
        return self._take_step(
            t_start,
            lambda request: self._step.step_prefetched(
                micro, global_batch, self.global_step, self.lr, request, trace, prefetch
            ),
        )

    def resident_data(self, x: np.ndarray, y: np.ndarray):
        """Rows (x, y) copied once into this rank's device memory (a _core.ResidentData), for
        step_rows; set its order (set_order: row numbers, an epoch's permutation) before stepping."""
        return _core.ResidentData(self.model._core, x, y, self.loss)

    def step_rows(
        self,
        data,
        start: int,
        rows: int,
        *,
        global_batch: Optional[int] = None,
        first_sample: Optional[int] = None,
        trace: bool = False,
    ) -> float:
        """step() on this rank's shard taken from resident data (resident_data()): the rows
        order[start, start + rows) of its current order, gathered on the device, so no
        row crosses from the host. The same step as step() on those rows, bit for bit."""
        t_start = time.perf_counter()
        global_batch, first_sample, bounds = self._micro_bounds(rows, global_batch, first_sample)
        micro = [(start + a, b - a, first_sample + a) for a, b in zip(bounds, bounds[1:])]
        return self._take_step(
            t_start,
            lambda request: self._step.step_rows(data, micro, global_batch, self.global_step, self.lr, request, trace),
        )

    def _micro_bounds(self, rows: int, global_batch: Optional[int], first_sample: Optional[int]) -> tuple:
        """(global batch, this shard's first sample, the micro-batches' row bounds): the
        first two with a collective each where not given."""
        if global_batch is None:
            global_batch = int(self.pg.allreduce(rows))
        if first_sample is None:
            first_sample = int(self.pg.exscan(rows))
        k = min(self.accumulate, max(rows, 1))
        return global_batch, first_sample, [rows * i // k for i in range(k + 1)]

    def _take_step(self, t_start: float, run_core_step) -> float:
        """Runs the core's step (run_core_step(request_stop) -> StepResult), then what every
        step does after it: timings, the agreed stop, skipped steps and the loss scale."""
        request = self._stop_request is not None
        self.t_call = time.perf_counter()  # where the core's step sits on a trace (observe.py)
        result = run_core_step(request)
        self.t_return = time.perf_counter()
        self.last_result = result
        self.step_times.add(self.t_return - t_start, result.timings)
        if not self._graph_fallback_reported and self._step.graph_fallback:
            self._graph_fallback_reported = True
            if self.pg.is_root:
                print(
                    f"mgpu: warning: CUDA graph capture failed, steps run uncaptured from here on: "
                    f"{self._step.graph_fallback}",
                    file=sys.stderr,
                    flush=True,
                )
        if result.stop_requested and self.stop_reason is None:
            # Every rank sees the agreed stop at this same step: the reasons can be gathered.
            reasons = self.pg.allgather(self._stop_request, what="stop reasons")
            asked = [(r, why) for r, why in enumerate(reasons) if why]
            self.stop_reason = self._stop_request or (
                f"{asked[0][1]} (on rank {asked[0][0]})" if asked else "a stop requested on another rank"
            )
        self.global_step += 1
        if result.applied:
            self.bad_steps = 0
            self._scale_note_shown = False
        elif self._scaler_absorbs(result):
            # Dynamic loss scaling skips a step whose scaled gradients overflowed and halves
            # the scale (fp16 starts at 2^16, which most models' gradients overflow for a
            # few steps): its own business, not a numerical failure, so not a bad step.
            if self.pg.is_root and not self._scale_note_shown:
                print(
                    f"mgpu: note: step {self.global_step - 1}: the scaled gradients overflowed at loss scale "
                    f"{result.loss_scale:g}; dynamic loss scaling skips such steps and halves the scale "
                    f"until they fit",
                    file=sys.stderr,
                    flush=True,
                )
            self._scale_note_shown = True
        else:
            self.bad_steps += 1
            if self.pg.is_root:
                print(
                    f"mgpu: warning: step {self.global_step - 1}: non-finite loss or gradients "
                    f"(loss {result.loss}, gradient norm {result.grad_norm}); step skipped, parameters "
                    f"unchanged ({self.bad_steps} of at most {self.max_bad_steps} in a row)",
                    file=sys.stderr,
                    flush=True,
                )
            if self.bad_steps >= self.max_bad_steps:
                raise NumericsError(
                    f"{self.bad_steps} consecutive steps with non-finite loss or gradients (the last at step "
                    f"{self.global_step - 1}); stopping. Parameters are those of the last good step; "
                    f"lower the learning rate or set a gradient-norm limit"
                )
        return result.loss

    def _scaler_absorbs(self, result) -> bool:
        """Whether a skipped step is dynamic loss scaling's to absorb: a finite loss whose
        gradients overflowed at a scale above 1. At 1 or below they overflow unscaled,
        and that is a bad step, as is one refused with finite gradients (labels out of
        range, an aborted allreduce). A true blow-up so counts after the scale's halvings
        down to 1 (16 steps from fp16's 2^16): the price of never stopping on overflows
        the scale exists to absorb."""
        return (
            self.dynamic_loss_scale
            and math.isfinite(result.loss)
            and not math.isfinite(result.grad_norm)
            and result.loss_scale > 1.0
        )

    def drain_trace(self) -> list:
        """The traced spans (TraceSpan) no step has handed over yet, after waiting for the device."""
        return self._step.drain_trace()

    # --- evaluation ------------------------------------------------------------
    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict:
        """Global mean loss (and accuracy for cross-entropy) over a dataset every
        rank holds in full; each rank evaluates a contiguous share."""
        part = local_slice(len(x), self.pg.rank, self.pg.size)
        loss_sum, correct = self.model._core.evaluate(x[part], y[part], self.loss)
        loss_sum, correct = self.pg.allreduce(np.array([loss_sum, float(correct)]), what="validation")
        denom = len(x) * (self.model.layers[-1] if self.loss == "mse" else 1)
        out = {"loss": float(loss_sum) / max(denom, 1)}
        if self.loss == "cross_entropy":
            out["accuracy"] = float(correct) / max(len(x), 1)
        return out

    # --- checkpoints -----------------------------------------------------------
    def _compat(
        self, data: Optional[Dataset], batch_size: Optional[int], seed: Optional[int], fingerprint: bool = True
    ) -> dict:
        """What a checkpoint of this run must match to be continued by it (fingerprint:
        the dataset's contents too, a pass over them: only where checkpoints are involved)."""
        compat = {
            "layers": list(self.model.layers),
            "loss": self.loss,
            "optimizer": self.optimizer_name,
            "optimizer_state": list(self._optimizer.state_names()),
            "dropout": self.model.dropout,
            "model_seed": self.model.seed,
        }
        if data is not None:
            compat.update(dataset=data.name, train_samples=len(data.x_train))
            if fingerprint:
                compat["dataset_sha256"] = data.fingerprint()
        if batch_size is not None:
            compat["effective_batch"] = batch_size * self.accumulate
        if seed is not None:
            compat["data_seed"] = seed
        return compat

    def optimizer_state(self) -> dict:
        """The optimizer's whole state by checkpoint key ('opt.NAME': num_params float32).
        Collective with a sharded optimizer (every rank calls it; each gets the shards gathered)."""
        return {f"opt.{name}": self._step.optimizer_state(name) for name in self._optimizer.state_names()}

    def state(self, compat: dict, optimizer_state: Optional[dict] = None) -> tuple:
        """(arrays, meta) describing this run exactly (what a checkpoint holds). With a
        sharded optimizer, every rank calls optimizer_state() first and passes it here."""
        if optimizer_state is None:
            if self._step.shards_optimizer:
                raise ConfigError(
                    "a sharded optimizer's state is gathered collectively: call optimizer_state() on every "
                    "rank and pass it to state()"
                )
            optimizer_state = self.optimizer_state()
        arrays = {"params": self.model._core.get_parameters(), **optimizer_state}
        meta = {
            "mgpu_version": __version__,
            "world_size": self.pg.size,
            "compat": compat,
            "state": {
                "global_step": self.global_step,
                "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch,
                "epoch_loss_sum": self._epoch_loss_sum,
                "epoch_samples": self._epoch_samples,
                "epoch_seconds": self._epoch_seconds,
                "optimizer_steps": self._optimizer.steps_taken,
                "loss_scale": self._step.loss_scale,
                "good_steps": self._step.good_steps_in_a_row,
                "dynamic_loss_scale": self.dynamic_loss_scale,
                "bad_steps": self.bad_steps,
                "accumulate": self.accumulate,
                "epoch_emulated": self._epoch_emulated and self._epoch_samples > 0,
            },
            "schedule": self.schedule.to_dict(),
            "history": self.history,
        }
        return arrays, meta

    def save_checkpoint(self, policy: CheckpointPolicy, compat: dict) -> str:
        """Collective: rank 0 writes a checkpoint of the current state; every rank
        raises CheckpointError if that failed. Never writes a non-finite state."""
        error, path = None, None
        # collective when sharded (every rank, before rank 0 alone writes); else rank 0's own
        optimizer_state = self.optimizer_state() if self._step.shards_optimizer or self.pg.is_root else None
        if self.pg.is_root:
            try:
                arrays, meta = self.state(compat, optimizer_state)
                if self.bad_steps or not all(np.isfinite(a).all() for a in arrays.values()):
                    raise CheckpointError(
                        f"refusing to checkpoint step {self.global_step}: the state is not "
                        f"finite or the last step was skipped"
                    )
                path = save_checkpoint(policy.directory, self.global_step, arrays, meta, policy.keep)
            except CheckpointError as e:
                error = e
        self.pg.agree(error, what="checkpoint")
        self._last_checkpoint_step = self.global_step
        self.last_checkpoint = self.pg.bcast(path)
        return self.last_checkpoint

    def load_checkpoint(self, path: str, compat: dict, steps_per_epoch: Optional[int] = None) -> dict:
        """Collective: restore the state saved in `path`. Rank 0 reads and verifies
        it and broadcasts it (no shared file system needed); a bad file fails on
        every rank with the same one-line error. Returns the checkpoint's meta.
        steps_per_epoch: the run's, which the saved sampler position cannot pass."""
        error, arrays, meta = None, None, None
        n = self.model.num_params
        names = ["params", *(f"opt.{s}" for s in self._optimizer.state_names())]
        if self.pg.is_root:
            try:
                arrays, meta = load_checkpoint(path)
                check_compatible(meta, compat, path)
                for key in names:
                    if key not in arrays or arrays[key].shape != (n,) or arrays[key].dtype != np.float32:
                        raise CheckpointError(f"checkpoint '{path}' does not hold '{key}' for {n:,} parameters")
                s = _resume_state(meta, path)  # the checksums cover the arrays, not the metadata
                if steps_per_epoch is not None and s["batch_in_epoch"] > steps_per_epoch:
                    raise CheckpointError(
                        f"checkpoint '{path}' has malformed metadata: state.batch_in_epoch is "
                        f"{s['batch_in_epoch']}, beyond the {steps_per_epoch} steps of an epoch"
                    )
            except CheckpointError as e:
                error = e
        self.pg.agree(error, what="checkpoint")
        meta = self.pg.bcast(meta)
        comm = self._comm
        for key in names:
            buf = arrays[key] if self.pg.is_root else np.empty(n, dtype=np.float32)
            comm.broadcast(buf, 0)
            if key == "params":
                self.model._core.set_parameters(buf)
            else:
                self._step.set_optimizer_state(key[len("opt.") :], buf)
        s = _resume_state(meta, path)
        self._optimizer.steps_taken = s["optimizer_steps"]
        # The saved scale continues a dynamically scaled run; a run of another kind (fp32,
        # a fixed --loss-scale) keeps its own.
        if self.dynamic_loss_scale and s["dynamic_loss_scale"]:
            self._step.loss_scale = s["loss_scale"]
            self._step.good_steps_in_a_row = s["good_steps"]
        self.global_step, self.epoch, self.batch_in_epoch = s["global_step"], s["epoch"], s["batch_in_epoch"]
        self._epoch_loss_sum, self._epoch_samples = s["epoch_loss_sum"], s["epoch_samples"]
        self._epoch_seconds = s["epoch_seconds"]
        self.bad_steps = s["bad_steps"]
        self._epoch_emulated = self.emulated or s["epoch_emulated"]
        self.history = list(meta.get("history", []))
        self._last_checkpoint_step = self.global_step
        self.last_checkpoint = path
        if self.pg.is_root and meta.get("world_size") != self.pg.size:
            print(
                f"mgpu: note: checkpoint written by {meta.get('world_size')} rank(s), resumed on {self.pg.size}: "
                f"same samples and global batch, results match an uninterrupted run within float rounding",
                file=sys.stderr,
                flush=True,
            )
        return meta

    # --- the loop --------------------------------------------------------------
    def _place_training_set(self, data: Dataset):
        """The training set resident in this rank's device memory (a _core.ResidentData), or
        None where its rows are copied from the host each step (TrainerConfig.data_on_device;
        place_training_set's rule). data_placement says which and why. Every rank agrees that
        each could place it (its choice may differ: the steps are the same either way)."""
        error, resident = None, None
        device, index = self.model.device, self.model.device_index
        try:
            size = resident_bytes(
                len(data.x_train), data.in_features, self.model.layers[-1], data.task == "classification"
            )
            free = available_memory(device, index, 1) if device == "cuda" else float("inf")
            mode = self.config.data_on_device
            on, why = place_training_set(mode, device=device, data_bytes=size, free_bytes=free)
            why = self.data_placement_reason or why
            if on:
                try:
                    resident = self.resident_data(data.x_train, data.y_train)
                except (DeviceError, MemoryError) as e:
                    if mode == "on" and not self.data_placement_reason:
                        raise
                    on, why = False, f"auto: placing its {size / 1e6:.3g} MB on the GPU failed ({e})"
            self.data_placement = {"resident": on, "bytes": size if on else 0, "why": why}
        except (ConfigError, DeviceError, MemoryError) as e:
            error = e
        self.pg.agree(error, what="the training set's placement")
        return resident

    def fit(
        self,
        data: Dataset,
        *,
        batch_size: int,
        epochs: Optional[int] = None,
        steps: Optional[int] = None,
        seed: int = 0,
        progress: bool = True,
        on_epoch: Optional[Callable[[dict], None]] = None,
        checkpoint: Optional[CheckpointPolicy] = None,
        resume: Optional[str] = None,
        observer=None,
    ) -> list:
        """Train for `epochs` epochs (or `steps` steps) with global batch `batch_size`
        (per micro-batch; each step takes batch_size x accumulate samples).

        resume: a checkpoint path to continue from (the same run continues
        bit-identically at the same world size; epochs/steps then count from the
        start of that run). Without it, each call trains that many more. Returns the history: one dict
        per epoch with epoch, train_loss, val_loss (and val_accuracy for
        classification), steps (cumulative), samples, seconds (training only)
        and samples_per_sec. Ends early, with a checkpoint when a policy is
        given, once every rank agreed on a stop request (see stop_reason).
        observer: an observe.Observer (trace, JSON log, TensorBoard, straggler check).
        """
        if batch_size < self.pg.size:
            raise ConfigError(f"global batch size {batch_size} is smaller than the number of ranks ({self.pg.size})")
        if (epochs is None) == (steps is None):
            raise ConfigError("give exactly one of epochs or steps")
        check_dataset_fits(data, self.model.layers)
        effective = batch_size * self.accumulate
        # the dataset's hash where rank 0 writes or checks a checkpoint (only it reads compat)
        compat = self._compat(
            data, batch_size, seed, fingerprint=(checkpoint is not None or resume is not None) and self.pg.is_root
        )
        if checkpoint is not None:
            error = None
            try:
                prepare_directory(checkpoint.directory)
            except CheckpointError as e:
                error = e
            self.pg.agree(error, what="checkpoint")
        batches = GlobalBatches(len(data.x_train), effective, seed)
        if resume is not None:
            self.load_checkpoint(resume, compat, batches.steps_per_epoch)
        length = steps if steps is not None else epochs * batches.steps_per_epoch
        # A resumed run ends where the interrupted one would have; otherwise each
        # call trains `length` more steps (so fit can be called again to go on).
        total = self.run_end = length if resume is not None else self.global_step + length
        if resume is not None and self.global_step >= total:
            if self.pg.is_root:
                print(
                    f"mgpu: note: the checkpoint is at step {self.global_step}, at or past this run's end (step "
                    f"{total}): nothing to train (the steps or epochs count from the start of the run)",
                    file=sys.stderr,
                    flush=True,
                )
            if self._epoch_samples > 0:  # an epoch left open (stopped on its last step, by an older mgpu)
                self._close_epoch(data, on_epoch)
        # every rank is at the same step here (a checkpoint resumes all alike): none places a set it would not use
        resident = self._place_training_set(data) if self.global_step < total else None
        # on a GPU, rows not resident are prefetched: copied in while the step before computes
        prefetching = resident is None and self.model.device == "cuda"
        bar = None
        if progress and self.pg.is_root:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=total,
                initial=min(self.global_step, total),
                unit="step",
                dynamic_ncols=True,
                desc="train on EMULATED GPUs" if self.emulated else "train",
            )
        obs = self.observer = observer
        if obs is not None:
            obs.start(self)
            obs.on_straggler = lambda found: self._report_straggler(found, bar)
        finished = False
        try:
            while self.global_step < total and self.stop_reason is None:
                t0 = time.perf_counter()
                order = batches.order(self.epoch)
                if resident is not None:
                    resident.set_order(order)  # once an epoch; steps gather their rows on the device
                starts = list(batches.starts())
                prefetched = False  # this step's rows were copied in during the step before
                for i, start in enumerate(starts):
                    if i < self.batch_in_epoch:
                        continue  # resumed mid-epoch: these batches were done before
                    t_begin = time.perf_counter()
                    idx = order[start : start + batches.batch_size]
                    part = local_slice(len(idx), self.pg.rank, self.pg.size, self.batch_shares)
                    traced = obs is not None and obs.wants_trace(self.global_step)
                    if prefetching:
                        # the next step's rows (in this epoch, before the run's end) cross while this one computes
                        nxt = None
                        if i + 1 < len(starts) and self.global_step + 1 < total:
                            nidx = order[starts[i + 1] : starts[i + 1] + batches.batch_size]
                            nmine = nidx[local_slice(len(nidx), self.pg.rank, self.pg.size, self.batch_shares)]
                            nxt = (data.x_train[nmine], data.y_train[nmine])
                        rows = part.stop - part.start
                        shard = dict(global_batch=len(idx), first_sample=part.start, trace=traced, prefetch=nxt)
                        if prefetched:
                            loss = self.step_prefetched(rows, **shard)
                        else:
                            mine = idx[part]
                            loss = self.step(data.x_train[mine], data.y_train[mine], **shard)
                        prefetched = nxt is not None
                    elif resident is not None:
                        rows = part.stop - part.start
                        loss = self.step_rows(
                            resident,
                            start + part.start,
                            rows,
                            global_batch=len(idx),
                            first_sample=part.start,
                            trace=traced,
                        )
                    else:
                        mine = idx[part]
                        rows = len(mine)
                        loss = self.step(
                            data.x_train[mine],
                            data.y_train[mine],
                            global_batch=len(idx),
                            first_sample=part.start,
                            trace=traced,
                        )
                    if obs is not None:
                        obs.on_step(self, self.last_result, t_begin, rows)
                    self.batch_in_epoch += 1
                    self._epoch_loss_sum += loss * len(idx)
                    self._epoch_samples += len(idx)
                    if bar is not None:
                        bar.update(1)
                        slow = {"straggler": self._straggler_note} if self._straggler_note else {}
                        bar.set_postfix(epoch=self.epoch + 1, loss=f"{loss:.4f}", **slow, refresh=False)
                    if self.global_step >= total or self.stop_reason is not None:
                        break
                    if (
                        checkpoint is not None
                        and checkpoint.every
                        and self.global_step % checkpoint.every == 0
                        and self.bad_steps == 0
                    ):
                        self._epoch_seconds += time.perf_counter() - t0
                        t0 = time.perf_counter()
                        self._checkpoint(checkpoint, compat)
                self._epoch_seconds += time.perf_counter() - t0
                epoch_done = self.batch_in_epoch >= batches.steps_per_epoch
                # a partial epoch closes where the run ends (a stop asked on its last step too);
                # a run stopped before its end resumes within that epoch
                if epoch_done or self.global_step >= total:
                    self._close_epoch(data, on_epoch)
                    if epoch_done:
                        self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            if checkpoint is not None and self._last_checkpoint_step != self.global_step:
                if self.bad_steps == 0:
                    self._checkpoint(checkpoint, compat)
                elif self.pg.is_root:  # a skipped step's state is not checkpointed: say what is kept
                    kept = (
                        f"the newest is {self.last_checkpoint} (step {self._last_checkpoint_step})"
                        if self.last_checkpoint
                        else "none was written"
                    )
                    print(
                        f"mgpu: warning: no checkpoint of step {self.global_step}: the last {self.bad_steps} "
                        f"step(s) were skipped (non-finite loss or gradients); {kept}",
                        file=sys.stderr,
                        flush=True,
                    )
            if obs is not None:
                obs.close(self)
            finished = True
        finally:
            if bar is not None:
                bar.close()
            if obs is not None and not finished:
                obs.abandon()  # an error: no collective is safe here, rank 0 closes its files
            self.observer = None
        return self.history

    def _checkpoint(self, policy: CheckpointPolicy, compat: dict) -> None:
        if self.observer is None:
            self.save_checkpoint(policy, compat)
            return
        with self.observer.span("checkpoint", self.global_step - 1):
            path = self.save_checkpoint(policy, compat)
        self.observer.log("checkpoint", step=self.global_step - 1, path=path)  # after that step

    def _report_straggler(self, found: dict, bar) -> None:
        """Rank 0: say which rank is slow, by how much and where (progress bar, history)."""
        if found is None:
            self._straggler_note = ""
            return
        self.stragglers.append(found)
        self._epoch_stragglers.append(found)
        text = (
            f"rank {found['rank']} {found['slower_by']:.0%} slower ({found['phase']} "
            f"+{found['phase_excess_seconds'] * 1e3:.1f} ms/step{' on EMULATED GPUs' if self.emulated else ''})"
        )
        if bar is not None:
            self._straggler_note = (
                f"rank {found['rank']} +{found['slower_by']:.0%} {found['phase']}"  # stays on the bar
            )
            bar.write(f"straggler: {text} over steps {found['steps'][0]}-{found['steps'][1]}")
        else:
            print(
                f"mgpu: straggler: {text} over steps {found['steps'][0]}-{found['steps'][1]}",
                file=sys.stderr,
                flush=True,
            )

    @staticmethod
    def _joined(first: dict, then: dict) -> dict:
        """One epoch's record from its two parts' (samples-weighted loss, summed samples and time)."""
        samples, seconds = first["samples"] + then["samples"], first["seconds"] + then["seconds"]
        joined = {
            **then,
            "train_loss": (first["train_loss"] * first["samples"] + then["train_loss"] * then["samples"])
            / max(samples, 1),
            "samples": samples,
            "seconds": seconds,
            "samples_per_sec": samples / seconds if seconds > 0 else 0.0,
        }
        if first.get("stragglers") or then.get("stragglers"):
            joined["stragglers"] = first.get("stragglers", []) + then.get("stragglers", [])
        if first.get("gpu_emulation") or then.get("gpu_emulation"):
            joined["gpu_emulation"] = True
        return joined

    def _close_epoch(self, data: Dataset, on_epoch) -> None:
        seconds, samples = self._epoch_seconds, self._epoch_samples
        entry = {
            "epoch": self.epoch + 1,
            "train_loss": self._epoch_loss_sum / max(samples, 1),
            "steps": self.global_step,
            "samples": samples,
            "seconds": seconds,
            "samples_per_sec": samples / seconds if seconds > 0 else 0.0,
            "lr": self.schedule.lr_at(max(self.global_step - 1, 0)),
        }
        if self.observer is not None:
            with self.observer.span("validation", self.global_step - 1):
                val = self.evaluate(data.x_val, data.y_val)
        else:
            val = self.evaluate(data.x_val, data.y_val)
        entry["val_loss"] = val["loss"]
        if "accuracy" in val:
            entry["val_accuracy"] = val["accuracy"]
        if self._epoch_stragglers:
            entry["stragglers"], self._epoch_stragglers = self._epoch_stragglers, []
        if self._epoch_emulated:
            entry["gpu_emulation"] = True
        self._epoch_emulated = self.emulated
        last = self.history[-1] if self.history else None
        if last is not None and last["epoch"] == entry["epoch"]:
            # the epoch's first part closed where an earlier run ended (--steps), and this one
            # went on from there: one record, as a run never stopped has
            entry = self._joined(last, entry)
            self.history[-1] = entry
        else:
            self.history.append(entry)
        if self.observer is not None:
            self.observer.on_epoch(entry)
        self._epoch_loss_sum, self._epoch_samples, self._epoch_seconds = 0.0, 0, 0.0
        if on_epoch is not None:
            on_epoch(entry)
