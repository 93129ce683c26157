"""Training observability: `train --trace`, `--log-json`, `--tensorboard` and the straggler check.

The JSON log and the straggler check use the core's StepResult.timings (forward,
backward, exposed allreduce wait, optimizer) and two host clocks Trainer reads around
the core call, plus the Python work before it (taking the shard). The trace's spans
inside a step come from the core's trace marks instead (StepResult.spans: stage,
forward and backward layer by layer, loss, allreduce wait, health check, optimizer),
on the backend's own clock: the host's for the CPU, CUDA events on the compute stream
for a GPU (their own lane: the GPU runs behind the host), so tracing synchronises
nothing. Every rank keeps its own records; every `every` steps one allgather brings them to
rank 0, which writes the JSON log, keeps the trace events of the traced steps, checks
for a straggler, and at the end writes the trace. TensorBoard scalars need nothing
from other ranks (loss, learning rate, gradient norm, loss scale are agreed values),
so rank 0 buffers them and hands them to the writer every `every` steps. `train
--telemetry` rides along (monitor/training.py: started, told of each step and gathered
here). With every output and the straggler check off, Trainer holds no Observer and
pays nothing.

Timestamps: after one barrier every rank reads its monotonic clock as its origin; then
rank 0 measures each rank's clock against its own by ping-pong (ProcessGroup.
clock_offsets), at the start and again at the end, and the trace moves each rank's
events onto rank 0's clock (the offset interpolated between the two measurements, for
drift). The barrier alone leaves its exit skew: milliseconds on an oversubscribed host.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from typing import Optional

import numpy as np

from .._runtime import _core
from ..atomic import write_json_atomic
from ..errors import ConfigError

# One row per step and rank (float64): what the gather moves and the outputs read.
FIELDS = (
    "step",
    "epoch",
    "t_begin",
    "t_call",
    "t_end",
    "forward",
    "backward",
    "comm_wait",
    "optimizer",
    "total",
    "loss",
    "grad_norm",
    "loss_scale",
    "applied",
    "rows",
)
_COL = {name: i for i, name in enumerate(FIELDS)}
# The phases a step's time is split into, in the order they run, as the trace names them.
PHASES = ("forward", "backward", "comm_wait", "optimizer")
ALLREDUCE_TID = 1  # each rank's second lane: its gradient buckets' allreduces
DEVICE_TID = 2  # a GPU rank's third lane: the core's spans, from CUDA events on its compute stream
DEFAULT_TRACE_STEPS = (0, 200)  # --trace without --trace-steps: a bounded file
STRAGGLER_MIN_STEPS = 5  # fewer steps than this in a window: too few to call anyone slow


def parse_step_range(text: str) -> tuple:
    """argparse type for --trace-steps: A:B, the steps A <= step < B (0-based, as the log
    numbers them); A: for every step from A on."""
    import argparse

    a, sep, b = text.partition(":")
    try:
        if not sep:
            raise ValueError
        start = int(a) if a.strip() else 0
        stop = int(b) if b.strip() else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (steps A <= step < B, e.g. 10:20), got '{text}'") from None
    if start < 0 or (stop is not None and stop <= start):
        raise argparse.ArgumentTypeError(f"'{text}' is an empty or negative step range: need 0 <= A < B")
    return start, stop


def import_summary_writer():
    """tensorboardX's SummaryWriter, or ConfigError saying how to install it (an optional dependency)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError as e:
        raise ConfigError(
            f"--tensorboard needs the tensorboardX package ({e}): pip install tensorboardX tensorboard"
        ) from None
    return SummaryWriter


def find_straggler(rows: np.ndarray, size: int, threshold: float) -> Optional[dict]:
    """The rank whose own work (step time minus the allreduce wait, which is where the
    others wait for it) has a median at least `threshold` (0.2: 20 %) above the median
    rank's over these rows, with the phase where most of the excess lies; None if none."""
    busy_cols = ("forward", "backward", "optimizer")
    per_rank = {}
    for rank in range(size):
        mine = rows[rows[:, -1] == rank]
        if len(mine) < STRAGGLER_MIN_STEPS:
            return None
        phases = {name: float(np.median(mine[:, _COL[name]])) for name in busy_cols}
        phases["data"] = float(np.median(mine[:, _COL["t_call"]] - mine[:, _COL["t_begin"]]))
        busy = mine[:, _COL["total"]] - mine[:, _COL["comm_wait"]] + mine[:, _COL["t_call"]] - mine[:, _COL["t_begin"]]
        per_rank[rank] = (float(np.median(busy)), phases)
    typical = float(np.median([b for b, _ in per_rank.values()]))
    slow = max(per_rank, key=lambda r: per_rank[r][0])
    busy, phases = per_rank[slow]
    if typical <= 0 or busy < typical * (1 + threshold):
        return None
    others = {name: float(np.median([p[name] for r, (_, p) in per_rank.items() if r != slow])) for name in phases}
    phase = max(phases, key=lambda name: phases[name] - others[name])
    steps = rows[:, _COL["step"]]
    return {
        "rank": slow,
        "slower_by": busy / typical - 1,
        "busy_seconds": busy,
        "median_rank_seconds": typical,
        "phase": phase,
        "phase_excess_seconds": phases[phase] - others[phase],
        "steps": [int(steps.min()), int(steps.max())],
    }


class Observer:
    """Collects step records on every rank and writes the outputs on rank 0.

    start/flush/close are collective (every rank calls them at the same steps: the
    schedule depends only on the step number); on_step and span are local."""

    def __init__(
        self,
        pg,
        *,
        trace: Optional[str] = None,
        trace_steps: tuple = (0, None),
        log_json: Optional[str] = None,
        tensorboard: Optional[str] = None,
        every: int = 50,
        straggler_threshold: float = 0.0,
        emulated: bool = False,
        run_info: Optional[dict] = None,
        telemetry=None,
        device_clock: bool = False,
    ):
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"steps between gathers must be an integer >= 1, got {every}")
        self.pg = pg
        self.trace, self.trace_steps, self.log_json, self.tensorboard = trace, trace_steps, log_json, tensorboard
        self.every, self.straggler_threshold, self.emulated = every, straggler_threshold, emulated
        self.device_clock = device_clock  # the core's spans are a device's (CUDA events): a lane of their own
        self.run_info = dict(run_info or {})
        self._rows: list = []  # this rank's step records since the last gather
        self._spans: list = []  # this rank's other spans (validation, checkpoints) since then
        self._buckets: list = []  # this rank's bucket allreduces of traced steps since then
        self._core_spans: list = []  # this rank's core spans (StepResult.spans) of traced steps since then
        self._core_clock = 0.0  # this rank's origin on the core's clock (_core.steady_seconds)
        self.clock_offsets: list = []  # rank 0: [(start, end)] per rank of (offset, uncertainty, when)
        self._offsets_at_start: list = []
        self._trace_events: list = []  # rank 0: every rank's events of the traced steps
        self._log = None
        self._writer = None
        self._scalars: list = []  # rank 0: step scalars not yet handed to the writer
        self.stragglers: list = []  # rank 0: what the straggler check found, window by window
        self.skipped_steps = 0
        self.origin = 0.0
        self.on_straggler = None  # rank 0: called with each window's finding or None (Trainer)
        self.telemetry = telemetry  # a monitor.training.TrainTelemetry (train --telemetry) or None
        self.telemetry_files: list = []  # rank 0: what it wrote at close
        # rank 0 at close: (event, fields) records of the finished run (train's prediction) logged before run_end
        self.before_end = None

    @property
    def gathers(self) -> bool:
        """Whether step records travel to rank 0 at all (the trace window may have ended)."""
        return bool(self.log_json or self.straggler_threshold > 0 or self.trace)

    def _traced(self, step: int) -> bool:
        a, b = self.trace_steps
        return bool(self.trace) and step >= a and (b is None or step < b)

    # --- collective --------------------------------------------------------------
    def start(self, trainer) -> None:
        """Agree on the clock origin and open rank 0's outputs (before the first step)."""
        self.pg.barrier(what="observe start")
        self.origin = time.perf_counter()
        self._core_clock = _core_clock_at(self.origin)
        if self.trace:
            self._offsets_at_start = self._measure_offsets()
        if self.telemetry is not None:
            self.telemetry.start()
        if not self.pg.is_root:
            return
        self.run_info.update(
            origin_unix_time=time.time(),
            world_size=self.pg.size,
            gpu_emulation=self.emulated,
            start_step=trainer.global_step,
        )
        if self.log_json:
            # Appended to, never truncated: a resumed job continues its own log.
            self._log = open(self.log_json, "a", buffering=1)
            self.log("run_start", **self.run_info)
        if self.tensorboard:
            self._writer = import_summary_writer()(self.tensorboard)
            note = "EMULATED GPUs (the CPU running mgpu's CUDA code, not real GPUs). " if self.emulated else ""
            self._writer.add_text("run", note + json.dumps(self.run_info), trainer.global_step)

    def flush(self) -> None:
        """Gather every rank's records since the last flush to rank 0 and use them."""
        if not self.gathers:
            return
        rows = np.array(self._rows, dtype=np.float64).reshape(-1, len(FIELDS))
        mine = (rows, self._spans, self._buckets, self._core_spans)
        self._rows, self._spans, self._buckets, self._core_spans = [], [], [], []
        everyone = self.pg.allgather(mine, what="observe gather")
        if not self.pg.is_root:
            return
        tagged = [np.column_stack([r, np.full(len(r), rank)]) for rank, (r, *_) in enumerate(everyone)]
        table = np.concatenate(tagged) if tagged else np.empty((0, len(FIELDS) + 1))
        if self._log is not None:
            for row in table[np.lexsort((table[:, -1], table[:, 0]))]:
                rec = {name: float(row[i]) for i, name in enumerate(FIELDS)}
                self.log(
                    "step",
                    step=int(rec["step"]),
                    epoch=int(rec["epoch"]),
                    rank=int(row[-1]),
                    loss=rec["loss"],
                    applied=bool(rec["applied"]),
                    rows=int(rec["rows"]),
                    times={
                        "data": rec["t_call"] - rec["t_begin"],
                        **{k: rec[k] for k in PHASES},
                        "step": rec["t_end"] - rec["t_begin"],
                    },
                )
        if self.trace:
            lane = DEVICE_TID if self.device_clock else 0
            for rank, (r, spans, buckets, core) in enumerate(everyone):
                self._trace_events += [e for row in r if self._traced(int(row[0])) for e in _step_events(row, rank)]
                self._trace_events += [_span_event(rank, *s) for s in spans]
                self._trace_events += [_bucket_event(rank, *b) for b in buckets]
                self._trace_events += [_core_span_event(rank, lane, *c) for c in core]
        if self.straggler_threshold > 0 and len(table):
            found = find_straggler(table, self.pg.size, self.straggler_threshold)
            if found is not None:
                self.stragglers.append(found)
                self.log("straggler", **found)
            if self.on_straggler is not None:
                self.on_straggler(found)  # None: no straggler in this window (any earlier one recovered)

    def close(self, trainer=None) -> None:
        """Last gather (with the spans a device's queued work still owed: trainer), then
        rank 0 writes the trace and closes the log and the writer."""
        if trainer is not None and self.trace:
            self.take_spans(trainer.drain_trace())
        self.flush()
        if self.trace:
            at_end = self._measure_offsets()  # collective: every rank measures, rank 0 keeps
            if self.pg.is_root:
                self.clock_offsets = list(zip(self._offsets_at_start, at_end))
        if self.telemetry is not None:
            self.telemetry_files = self.telemetry.close()
        if not self.pg.is_root:
            return
        if self.trace:
            write_json_atomic(self.trace, self.trace_document())
        if self._writer is not None:
            self._publish()
            self._writer.close()
            self._writer = None
        if self._log is not None:
            for event, fields in self.before_end(trainer) if self.before_end and trainer is not None else ():
                self.log(event, **fields)
            self.log("run_end", stragglers=len(self.stragglers), skipped_steps=self.skipped_steps)
            self._log.close()
            self._log = None

    def abandon(self) -> None:
        """After an error (no collective is safe): rank 0 closes what it has open, writes nothing more."""
        if self.telemetry is not None:
            self.telemetry.abandon()
        if self._writer is not None:
            self._publish()
            self._writer.close()
            self._writer = None
        if self._log is not None:
            self.log("run_end", error=True, skipped_steps=self.skipped_steps)
            self._log.close()
            self._log = None

    # --- local -------------------------------------------------------------------
    def log(self, event: str, **fields) -> None:
        """One JSON line (rank 0's log): the event, when, and its fields."""
        if self._log is not None:
            self._log.write(json.dumps({"event": event, "time": time.perf_counter() - self.origin, **fields}) + "\n")

    def wants_trace(self, step: int) -> bool:
        """Whether the core should trace step `step` (Trainer asks before it runs)."""
        return self._traced(step)

    def _measure_offsets(self) -> list:
        """Collective: rank 0's list of each rank's (offset, uncertainty, when) on the trace's clock."""

        def clock() -> float:
            return time.perf_counter() - self.origin

        offsets = self.pg.clock_offsets(clock, what="trace clock offsets")
        now = clock()
        return [(o, u, now) for o, u in offsets]

    def take_spans(self, spans) -> None:
        """Keep the core's spans (TraceSpan, on the core's clock) of traced steps, on the trace's clock."""
        shift = self._core_clock
        self._core_spans += [
            (s.step, s.name, s.category, s.micro, s.begin - shift, s.end - shift) for s in spans if self._traced(s.step)
        ]

    def on_step(self, trainer, result, t_begin: float, rows: int) -> None:
        """After each step (every rank): keep its record; rank 0 writes its scalars."""
        step = trainer.global_step - 1
        t = result.timings
        if result.spans:  # may hold the end of an earlier traced step (a GPU's optimizer)
            self.take_spans(result.spans)
        if self.telemetry is not None:
            self.telemetry.on_step(trainer, rows)
        if self.gathers and (self.log_json or self.straggler_threshold > 0 or self._traced(step)):
            self._rows.append(
                (
                    step,
                    trainer.epoch,
                    t_begin - self.origin,
                    trainer.t_call - self.origin,
                    trainer.t_return - self.origin,
                    t.forward,
                    t.backward,
                    t.comm_wait,
                    t.optimizer,
                    t.total,
                    result.loss,
                    result.grad_norm,
                    result.loss_scale,
                    float(result.applied),
                    rows,
                )
            )
        if self.trace and self._traced(step):
            # The core times buckets from the step's start, which it reads on its own clock.
            core_start = result.started - self._core_clock
            self._buckets += [
                (step, b.index, b.offset, b.count, b.bytes, core_start + b.launch, core_start + b.done)
                for b in result.buckets
            ]
        if not result.applied:
            self.skipped_steps += 1
            self.log(
                "warning",
                step=step,
                rank=self.pg.rank,
                message="non-finite loss or gradients; step skipped",
                loss=float(result.loss),
                grad_norm=float(result.grad_norm),
            )
        if self._writer is not None:
            self._scalars.append(
                (
                    step,
                    result.loss,
                    trainer.schedule.lr_at(step),
                    result.grad_norm,
                    result.loss_scale,
                    self.skipped_steps,
                )
            )
        if trainer.global_step % self.every == 0:
            self._publish()
            if self.gathers:
                self.flush()

    def _publish(self) -> None:
        """Hand the buffered step scalars to the writer. In blocks, not step by step: each
        add_scalar wakes tensorboardX's writer threads, whose fight for the GIL measured
        milliseconds a step on a busy machine."""
        w, rows, self._scalars = self._writer, self._scalars, []
        if w is None:
            return
        for step, loss, lr, norm, scale, skipped in rows:
            w.add_scalar("train/loss", loss, step)
            w.add_scalar("train/learning_rate", lr, step)
            w.add_scalar("train/grad_norm", norm, step)
            w.add_scalar("train/loss_scale", scale, step)
            w.add_scalar("train/skipped_steps", skipped, step)

    def on_epoch(self, entry: dict) -> None:
        self._publish()  # the step scalars first: the writer's file then runs in step order
        step = entry["steps"]
        self.log("epoch", **entry)
        w = self._writer
        if w is not None:
            w.add_scalar("epoch/train_loss", entry["train_loss"], step)
            w.add_scalar("epoch/samples_per_sec", entry["samples_per_sec"], step)
            w.add_scalar("val/loss", entry["val_loss"], step)
            if "val_accuracy" in entry:
                w.add_scalar("val/accuracy", entry["val_accuracy"], step)

    @contextmanager
    def span(self, name: str, step: int, **args):
        """Time a piece of the loop outside the core's step (validation, a checkpoint)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            if self._traced(step):
                self._spans.append((name, t0 - self.origin, t1 - self.origin, {"step": step, **args}))

    # --- the trace document ------------------------------------------------------------
    def trace_document(self) -> dict:
        """Chrome trace-event JSON (Perfetto, chrome://tracing): one process track per rank."""
        tag = " (EMULATED GPU)" if self.emulated else ""
        meta = []
        for rank in range(self.pg.size):
            meta.append(
                {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}{tag}"}}
            )
            meta.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
            meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "step"}})
            meta.append(
                {"name": "thread_name", "ph": "M", "pid": rank, "tid": ALLREDUCE_TID, "args": {"name": "allreduce"}}
            )
            if self.device_clock:
                stream = (
                    "EMULATED GPU compute stream (CUDA events)" if self.emulated else "GPU compute stream (CUDA events)"
                )
                meta.append(
                    {"name": "thread_name", "ph": "M", "pid": rank, "tid": DEVICE_TID, "args": {"name": stream}}
                )
        a, b = self.trace_steps
        events = self._trace_events
        if self.clock_offsets:
            events = [_on_rank0_clock(e, self.clock_offsets[e["pid"]]) for e in events]
        other = {
            **self.run_info,
            "trace_steps": [a, b],
            "clock": "seconds on rank 0's monotonic clock from a barrier all ranks left together; each "
            "rank's events moved by its clock's offset to rank 0's, measured by ping-pong at the "
            "start and the end (clock_offsets: [offset, uncertainty, when] in seconds, per rank)",
            "clock_offsets": [[list(start), list(end)] for start, end in self.clock_offsets],
            "phases": (
                "the core's trace marks: CUDA events on each GPU's compute stream, in lane "
                "'GPU compute stream'; a span ends when the GPU finished its work, so one may "
                "include time the GPU waited for the host"
                if self.device_clock
                else "the core's trace marks (host clock), nested in their step"
            )
            + "; 'allreduce wait' is the allreduce time not hidden behind backward",
            "allreduce": "lane 'allreduce': each gradient bucket's allreduce from its launch to its "
            "completion as observed: MPI: when the blocking per-bucket allreduce returned, "
            "or (queued beside a GPU backend) when a test or wait of the host saw its last "
            "request complete; NCCL: a CUDA event after the bucket's group on the "
            "communication stream (NCCL runs a group as one launch: its buckets end together)",
        }
        if self.emulated:
            other["warning"] = "EMULATED GPUs: the CPU running mgpu's CUDA code; timings are not GPU timings"
        return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": other}


def _us(seconds: float) -> float:
    return seconds * 1e6


def _core_clock_at(perf_time: float) -> float:
    """The core's clock (_core.steady_seconds) at time.perf_counter() == perf_time:
    the two are read back to back a few times, the closest pair wins."""
    best = None
    for _ in range(5):
        a = time.perf_counter()
        core = _core.steady_seconds()
        b = time.perf_counter()
        if best is None or b - a < best[0]:
            best = (b - a, core - (a + b) / 2)
    return perf_time + best[1]


def _on_rank0_clock(event: dict, offsets: tuple) -> dict:
    """The event moved from its rank's trace clock to rank 0's: minus that rank's offset,
    interpolated in time between the start and end measurements."""
    (o0, u0, t0), (o1, u1, t1) = offsets
    if "ts" not in event or (o0 == 0 and o1 == 0):
        return event
    ts = event["ts"] / 1e6
    if abs(o1 - o0) <= u0 + u1 or t1 <= t0:  # no drift shown beyond the error: the sharper measurement
        offset = o0 if u0 <= u1 else o1
    else:
        offset = o0 + (o1 - o0) * min(max((ts - t0) / (t1 - t0), 0.0), 1.0)
    return {**event, "ts": _us(ts - offset)}


def _step_events(row: np.ndarray, rank: int) -> list:
    """A step's span (the Python loop's: taking the shard, the core call) and the data
    span nested in it; the core's spans inside come from its trace marks (_core_span_event)."""
    r = {name: float(row[i]) for i, name in enumerate(FIELDS)}
    step = int(r["step"])
    base = {"pid": rank, "tid": 0, "ph": "X"}
    return [
        {
            **base,
            "name": f"step {step}",
            "cat": "step",
            "ts": _us(r["t_begin"]),
            "dur": _us(r["t_end"] - r["t_begin"]),
            "args": {
                "step": step,
                "epoch": int(r["epoch"]),
                "loss": r["loss"],
                "rows": int(r["rows"]),
                "applied": bool(r["applied"]),
            },
        },
        {
            **base,
            "name": "data",
            "cat": "phase",
            "ts": _us(r["t_begin"]),
            "dur": _us(r["t_call"] - r["t_begin"]),
            "args": {"step": step},
        },
    ]


def _core_span_event(
    rank: int, tid: int, step: int, name: str, category: str, micro: int, t0: float, t1: float
) -> dict:
    args = {"step": step} if micro < 0 else {"step": step, "micro_batch": micro}
    return {
        "pid": rank,
        "tid": tid,
        "ph": "X",
        "name": name,
        "cat": category,
        "ts": _us(t0),
        "dur": _us(t1 - t0),
        "args": args,
    }


def _bucket_event(rank: int, step: int, index: int, offset: int, count: int, nbytes: int, t0: float, t1: float) -> dict:
    return {
        "pid": rank,
        "tid": ALLREDUCE_TID,
        "ph": "X",
        "name": f"bucket {index}",
        "cat": "allreduce",
        "ts": _us(t0),
        "dur": _us(t1 - t0),
        "args": {"step": step, "bucket": index, "offset": offset, "count": count, "bytes": nbytes},
    }


def _span_event(rank: int, name: str, t0: float, t1: float, args: dict) -> dict:
    return {
        "pid": rank,
        "tid": 0,
        "ph": "X",
        "name": name,
        "cat": "loop",
        "ts": _us(t0),
        "dur": _us(t1 - t0),
        "args": args,
    }
