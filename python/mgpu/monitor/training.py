"""`train --telemetry PREFIX`: the stress command's sampler beside training on every rank,
its safety thresholds applied at each step, and at the end every rank's samples gathered
to rank 0 as PREFIX.csv, PREFIX.json and PREFIX.png (telemetry.write_series).

Each sample holds the device's readings (telemetry.reader_for: NVML on GPUs, /proc on
the CPU; on the GPU emulation the host's readings under a source name that says so)
plus this rank's training throughput since the previous sample: samples of its shard
in steps that finished, per second (0 while it validates or checkpoints). Above a
threshold (safety.SafetyMonitor.breaches) the monitor warns once per crossing, or, for
the metrics named in `stop_on`, asks the trainer to stop: the request travels in the
next step's allreduce, so every rank stops at the same step and a checkpoint is written.
Observer (train/observe.py) drives it: start after its clock barrier, on_step, close.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Iterable

from ..errors import ConfigError
from .safety import SafetyMonitor, Thresholds
from .telemetry import THROUGHPUT, Sampler, reader_for, write_series

# The metrics that can stop training, and the flag that asks for it.
STOP_FLAGS = {"temperature_c": "--stop-above-temp", "memory_used_pct": "--stop-above-memory"}


def output_paths(prefix: str) -> list:
    return [f"{prefix}.{ext}" for ext in ("csv", "json", "png")]


def output_options(prefix: str) -> dict:
    """--telemetry PREFIX's files as output options ('--telemetry (.csv)' -> path), for
    commands.common.check_outputs; ConfigError when the prefix names no file (empty, a directory)."""
    if not prefix or not os.path.basename(prefix):
        raise ConfigError(
            f"--telemetry '{prefix}': give a file name prefix (PREFIX.csv, .json and .png are "
            "written), not an empty path or a directory"
        )
    return {f"--telemetry ({os.path.splitext(p)[1]})": p for p in output_paths(prefix)}


class TrainTelemetry:
    """One rank's sampler and monitor; start/close are collective, on_step is local."""

    def __init__(
        self,
        pg,
        *,
        prefix: str,
        interval: float,
        device: str,
        device_index: int,
        thresholds: Thresholds,
        stop_on: Iterable[str] = (),
        emulated: bool = False,
    ):
        self.pg, self.prefix, self.thresholds, self.emulated = pg, prefix, thresholds, emulated
        self.source, read = reader_for(device, device_index)
        where = f"cuda:{device_index}" if device == "cuda" else "cpu"
        self.label = f"rank {pg.rank} {where} on {socket.gethostname()} ({self.source})"
        self.monitor = SafetyMonitor(thresholds, pg.rank, command="train")
        self.stop_on = set(stop_on)
        self.stopping = False
        self.events: list = []  # rank 0 after close: every rank's monitor events
        self._above: set = set()  # the metrics above their threshold at the last check
        self._done = 0  # this rank's samples in finished steps (the sampler thread reads it)
        self._last = None  # (monotonic time, _done) at the previous sample

        def read_with_throughput() -> dict:
            reading = read()
            now, done = time.monotonic(), self._done
            last, self._last = self._last, (now, done)
            reading[THROUGHPUT] = (done - last[1]) / (now - last[0]) if last and now > last[0] else None
            return reading

        self.sampler = Sampler(read_with_throughput, interval)

    def start(self) -> None:
        """Right after the observer's barrier: times count from the same instant on every rank."""
        self.sampler.start(t0=time.monotonic())

    def on_step(self, trainer, rows: int) -> None:
        """After each step: count its samples, act on the latest reading's breaches."""
        self._done += rows
        reading = self.sampler.latest()
        found = self.monitor.breaches(reading)
        for metric, text in found.items():
            if metric in self.stop_on and not self.stopping:
                self.stopping = True
                reason = f"{text} ({STOP_FLAGS[metric]})"
                trainer.request_stop(reason)
                self.monitor.event("stop", f"{reason}: stopping at the next step boundary", reading)
            elif metric not in self._above and metric not in self.stop_on:  # once per crossing
                hint = f" ({STOP_FLAGS[metric]} would stop it)" if metric in STOP_FLAGS else ""
                self.monitor.event("warning", f"{text}: training goes on{hint}", reading)
        self._above = set(found)

    def close(self) -> list:
        """Collective: stop sampling, gather every rank's samples; rank 0 writes the files
        and returns their paths (other ranks: [])."""
        self.sampler.stop()
        self.sampler.sample()  # one more: the steps since the last sample count too
        samples = self.sampler.stop()
        everyone = self.pg.allgather((self.label, samples, self.monitor.events), what="telemetry gather")
        if not self.pg.is_root:
            return []
        series = {label: s for label, s, _ in everyone}
        self.events = [e for _, _, ev in everyone for e in ev]
        # Short lines: the figure is 8 inches wide and the title is not wrapped for us.
        kind = (
            "EMULATED GPUs (the CPU running mgpu's CUDA code):\nhost CPU readings, not GPU readings"
            if self.emulated
            else "host CPU readings from /proc (one per host, shared by its ranks)"
            if self.source == "proc"
            else f"readings: {self.source}"
        )
        missing = [
            name
            for metric, name in (("temperature_c", "temperature"), ("power_w", "power"))
            if not any(x.get(metric) is not None for ss in series.values() for x in ss)
        ]
        title = "\n".join(
            [
                f"mgpu train on {self.pg.size} rank(s), {kind}",
                *([f"no {' or '.join(missing)} sensor readable"] if missing else []),
                "training samples/s: each rank's shard of the global batch",
            ]
        )
        t = self.thresholds
        limits = {"temperature_c": t.max_temp_c, "memory_used_pct": t.max_memory_pct, "power_w": t.power_limit_w}
        return write_series(self.prefix, series, title, limits, self.events)

    def abandon(self) -> None:
        """After an error (no collective is safe): stop the sampler, write nothing."""
        self.sampler.stop()
