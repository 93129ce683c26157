"""Telemetry: per-device temperature, power, utilisation, clocks and memory,
sampled in a background thread, saved as a time series (CSV, JSON) and plotted.

`train --telemetry` (monitor/training.py) adds each rank's training samples/s to its samples.
Sources, in order: NVML through pynvml when importable, `nvidia-smi
--query-gpu` otherwise (GPUs); /proc/stat (busy share since the last sample),
/proc/meminfo and /sys/class/thermal (the CPU). A reading a source cannot give is None.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import shutil
import subprocess
import threading
import time
from typing import Callable, Optional

from .._runtime import gpus_emulated
from ..errors import ConfigError
from ..hostinfo import host_meminfo

METRICS = (
    "temperature_c",
    "power_w",
    "power_limit_w",
    "utilization_pct",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "memory_used_pct",
)


_last_cpu_times: list = []


def _cpu_busy_pct() -> Optional[float]:
    """Busy share of all CPUs since the previous call (from /proc/stat), None on the first."""
    try:
        fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle, total = fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields[:8])
    previous = _last_cpu_times[:]
    _last_cpu_times[:] = [idle, total]
    if not previous or total <= previous[1]:
        return None
    return 100.0 * (1.0 - (idle - previous[0]) / (total - previous[1]))


def cpu_reading() -> dict:
    r = {m: None for m in METRICS}
    r["utilization_pct"] = _cpu_busy_pct()
    try:
        info = host_meminfo()
        r["memory_used_pct"] = 100.0 * (1 - info["MemAvailable"] / info["MemTotal"])
    except (OSError, ValueError, KeyError):
        pass
    temps = []
    for path in glob.glob("/sys/class/thermal/thermal_zone*/temp"):
        try:
            temps.append(int(open(path).read().strip()) / 1000.0)
        except (OSError, ValueError):
            pass
    r["temperature_c"] = max(temps) if temps else None
    return r


def _nvml_reader(index: int) -> Optional[Callable[[], dict]]:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001 - absent library, driver or device
        return None

    def read() -> dict:
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        return {
            "temperature_c": float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
            "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
            "utilization_pct": float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu),
            "sm_clock_mhz": float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
            "mem_clock_mhz": float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)),
            "memory_used_pct": 100.0 * mem.used / mem.total,
        }

    return read


def _smi_reader(index: int) -> Optional[Callable[[], dict]]:
    if shutil.which("nvidia-smi") is None:
        return None
    fields = "temperature.gpu,power.draw,power.limit,utilization.gpu,clocks.sm,clocks.mem,memory.used,memory.total"

    def read() -> dict:
        out = (
            subprocess.run(
                ["nvidia-smi", f"--id={index}", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            .stdout.strip()
            .split(",")
        )

        def num(i):
            try:
                return float(out[i])
            except (IndexError, ValueError):
                return None

        used, total = num(6), num(7)
        return {
            "temperature_c": num(0),
            "power_w": num(1),
            "power_limit_w": num(2),
            "utilization_pct": num(3),
            "sm_clock_mhz": num(4),
            "mem_clock_mhz": num(5),
            "memory_used_pct": 100.0 * used / total if used is not None and total else None,
        }

    return read


def reader_for(device: str, index: int = 0) -> tuple:
    """(source name, function returning one reading) for a device."""
    if gpus_emulated(device):
        # The emulated GPU is this CPU: its readings, under a name that says so.
        return "emulated GPU: host CPU readings (/proc)", cpu_reading
    if device == "cuda":
        for name, make in (("nvml", _nvml_reader), ("nvidia-smi", _smi_reader)):
            fn = make(index)
            if fn is not None:
                return name, fn
        return "none", lambda: {m: None for m in METRICS}
    return "proc", cpu_reading


MAX_WAIT_S = 7 * 86400.0  # sampling intervals and hang timeouts: a thread's wait beyond it overflows its timer


def check_monitor_options(
    interval: float,
    max_temp: float,
    max_memory_percent: float,
    power_limit: Optional[float],
    interval_option: str = "--interval",
) -> None:
    """ConfigError for a sampling interval or safety threshold the monitor cannot use."""
    if not 0 < interval <= MAX_WAIT_S:
        raise ConfigError(f"{interval_option} must be > 0 and at most {MAX_WAIT_S:g} seconds, got {interval!r}")
    if not 0 < max_temp < math.inf:
        raise ConfigError(f"--max-temp must be a finite temperature > 0 C, got {max_temp!r}")
    if not 0 < max_memory_percent <= 100:
        raise ConfigError(f"--max-memory-percent must be in (0, 100], got {max_memory_percent!r}")
    if power_limit is not None and not 0 < power_limit < math.inf:
        raise ConfigError(f"--power-limit must be finite and > 0 W, got {power_limit!r}")


class Sampler:
    """Samples `read()` every `interval` seconds in a daemon thread."""

    def __init__(self, read: Callable[[], dict], interval: float = 1.0):
        if not interval > 0:
            raise ValueError("telemetry interval must be > 0")
        self.read, self.interval = read, interval
        self.samples: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mgpu-telemetry", daemon=True)
        self._t0 = time.monotonic()

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> dict:
        try:
            reading = self.read()
        except Exception as e:  # noqa: BLE001 - a failing sensor must not end the run
            reading = {m: None for m in METRICS}
            reading["error"] = str(e)
        reading["t"] = time.monotonic() - self._t0
        with self._lock:
            self.samples.append(reading)
        return reading

    def latest(self) -> Optional[dict]:
        with self._lock:
            return dict(self.samples[-1]) if self.samples else None

    def start(self, t0: Optional[float] = None) -> "Sampler":
        """t0: the time.monotonic() that times count from (ranks agree on one; default: construction)."""
        if t0 is not None:
            self._t0 = t0
        self._thread.start()
        return self

    def stop(self) -> list:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        return list(self.samples)


def summarize(samples: list) -> dict:
    """min and max of every metric a source gave."""
    out = {}
    for m in METRICS:
        values = [s[m] for s in samples if s.get(m) is not None]
        if values:
            out[m] = {"min": min(values), "max": max(values)}
    return out


# Not a device reading: training throughput, which `train --telemetry` adds to each sample.
THROUGHPUT = "samples_per_s"

# Each plotted metric: its axis label, and the metric drawn dashed on the same axis (the device's own limit).
PLOTTED = {
    "temperature_c": ("temperature (C)", None),
    "power_w": ("power (W)", "power_limit_w"),
    "utilization_pct": ("utilisation (%)", None),
    "sm_clock_mhz": ("SM clock (MHz)", None),
    "mem_clock_mhz": ("memory clock (MHz)", None),
    "memory_used_pct": ("memory used (%)", None),
    THROUGHPUT: ("training samples/s", None),
}


def write_series(
    path_prefix: str, series: dict, title: str = "", limits: Optional[dict] = None, events: Optional[list] = None
) -> list:
    """series: {device label: [samples]} -> PREFIX.csv, PREFIX.json, PREFIX.png; returns the paths.
    The plot draws `limits` ({metric: value}, the monitor's thresholds) as red lines and
    `events` (the monitor's actions: dicts with t and action) as vertical lines."""
    # the throughput column only where a sampler added it (train), so stress files keep their columns
    extra = [THROUGHPUT] if any(THROUGHPUT in s for ss in series.values() for s in ss) else []
    rows = [
        {"device": label, **{k: s.get(k) for k in ("t", *METRICS, *extra)}}
        for label, samples in series.items()
        for s in samples
    ]
    with open(f"{path_prefix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["device", "t", *METRICS, *extra])
        w.writeheader()
        w.writerows(rows)
    with open(f"{path_prefix}.json", "w") as f:
        json.dump(series, f)
    # the title also as the PNG's text metadata: what the picture shows (an emulated GPU, say) stays machine-readable
    figure(series, title, limits or {}, events or []).savefig(
        f"{path_prefix}.png", dpi=100, metadata={"Title": title or "telemetry"}
    )
    import matplotlib.pyplot as plt

    plt.close("all")
    return [f"{path_prefix}.csv", f"{path_prefix}.json", f"{path_prefix}.png"]


def figure(series: dict, title: str, limits: dict, events: list):
    """One panel per metric some source gave, every device a line; percentages on 0-100."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [m for m in PLOTTED if any(s.get(m) is not None for ss in series.values() for s in ss)]
    fig, axes = plt.subplots(
        max(len(shown), 1), 1, figsize=(8, 1.0 + 2.0 * max(len(shown), 1)), sharex=True, squeeze=False
    )
    for ax, metric in zip(axes[:, 0], shown):
        label, beside = PLOTTED[metric]
        for i, (device, samples) in enumerate(series.items()):
            color = f"C{i % 10}"
            pts = [(s["t"], s[metric]) for s in samples if s.get(metric) is not None]
            if pts:  # markers where a short run has too few points for a line to show
                ax.plot(*zip(*pts), color=color, label=device, marker="o" if len(pts) < 10 else None, markersize=3)
            limit = [(s["t"], s[beside]) for s in samples if beside and s.get(beside) is not None]
            if limit:
                ax.plot(*zip(*limit), color=color, linestyle="--", linewidth=1, label=f"{device}: power limit")
        if metric in limits and limits[metric] is not None:
            ax.axhline(
                limits[metric], color="red", linestyle=":", linewidth=1.2, label=f"monitor threshold {limits[metric]:g}"
            )
        ax.margins(y=0.12)
        top = max(ax.get_ylim()[1], 1.1 * (limits.get(metric) or 0))  # the threshold in view, not on the edge
        ax.set_ylim(0, 105 if metric.endswith("_pct") else top)
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for e in events:
        if e.get("t") is not None:
            for ax in axes[:, 0]:
                ax.axvline(e["t"], color="red", alpha=0.4, linewidth=1)
            axes[0, 0].annotate(
                e["action"],
                (e["t"], 1.0),
                xycoords=("data", "axes fraction"),
                fontsize=7,
                color="red",
                rotation=90,
                va="top",
                ha="right",
            )
    if not shown:
        axes[0, 0].text(0.5, 0.5, "no telemetry source gave a reading", ha="center", transform=axes[0, 0].transAxes)
    axes[-1, 0].set_xlabel("seconds since the start")
    fig.suptitle(title or "telemetry", fontsize=9)
    fig.tight_layout()
    return fig
