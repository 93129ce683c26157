"""`mgpu stress`: burn in every device, verify every result, watch it, stay safe.

Each rank drives its own device (one rank per GPU under mpirun, or the CPU)
through the core's StressDevice (csrc/core/stress_device.h): a transcendental compute
burn, repeated GEMMs on fixed random inputs, and memory patterns (walking ones,
address-in-address, random) over a buffer grown to --memory-fraction of free
memory. Every result is checked (sampled compute values against the reference,
every GEMM element against the first result, every memory word); mismatches and
NaN/Inf turn a device's verdict to FAULTY. A telemetry thread samples the device;
a safety monitor throttles above --max-temp, stops growing memory above
--max-memory-percent, warns above the power limit, and a watchdog ends the run
when a device or a peer hangs. Every action is logged in `events`.

On the GPU emulation (MGPU_EMULATE_GPU) the CUDA code runs on the CPU, orders of
magnitude slower: the size and duration options not given are scaled down
(EMULATION_DEFAULTS), and the run says so.
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import socket
import sys
import threading
import time
from typing import Optional

from .._runtime import _core, gpus_emulated
from ..atomic import write_json_atomic
from ..console import write_line
from ..errors import ConfigError
from ..hostinfo import available_memory
from ..monitor.safety import SafetyMonitor, Thresholds
from ..monitor.telemetry import (
    MAX_WAIT_S,
    Sampler,
    check_monitor_options,
    reader_for,
    summarize,
    write_series,
)
from ..monitor.training import output_options
from .common import INT32_MAX, MAX_THREADS, bounded_int, check_outputs

KERNELS = ("compute", "gemm", "memory")
# Exit codes: 0 every device OK, 1 one FAULTY, 3 a device hang (the watchdog), 4 none faulty
# but one UNVERIFIED (a kernel that never ran, a fault asked for and not injected or not caught).
EXIT_FAULTY, EXIT_HANG, EXIT_UNVERIFIED = 1, 3, 4
PATTERNS = ("walking_ones", "address", "random")
MiB = 1 << 20

# Options whose defaults depend on the device: a GPU's, and the GPU emulation's,
# where a GPU-sized run (0.8 of free memory, 1024^3 GEMMs, a minute) would take hours.
DEFAULTS = {"duration": 60.0, "compute_size": 1 << 18, "gemm_size": 1024, "memory_fraction": 0.8}
EMULATION_DEFAULTS = {"duration": 10.0, "compute_size": 1 << 14, "gemm_size": 64, "memory_mb": 8.0}


def resolve_defaults(a, device: str) -> list:
    """Fill the options left unset (None); returns those given emulation defaults."""
    emulated = gpus_emulated(device)
    memory_given = a.memory_mb is not None or a.memory_fraction is not None
    scaled = []
    for name in ("duration", "compute_size", "gemm_size"):
        if getattr(a, name) is None:
            setattr(a, name, EMULATION_DEFAULTS[name] if emulated else DEFAULTS[name])
            scaled += [name] if emulated else []
    if a.memory_fraction is None:
        a.memory_fraction = DEFAULTS["memory_fraction"]
    if emulated and not memory_given:
        a.memory_mb = EMULATION_DEFAULTS["memory_mb"]
        scaled.append("memory_mb")
    return scaled


def kernel_bytes(a, device: str, kernels) -> dict:
    """{option: bytes} the compute and GEMM kernels hold at their peak: the values (4 B each);
    the GEMM's inputs, result and first result (16 B an element), on a GPU also its bf16
    inputs and the independent check's own copies (32 B)."""
    need = {}
    if "compute" in kernels:
        need["--compute-size"] = 4.0 * a.compute_size
    if "gemm" in kernels:
        need["--gemm-size"] = (32.0 if device == "cuda" else 16.0) * a.gemm_size**2
    return need


def _buffer_bytes(a, pg, device: str, index: int, kernels) -> float:
    """The memory pass's buffer: --memory-mb, or --memory-fraction of what the other kernels
    leave free. Sizes that cannot fit are refused before any kernel runs; ranks of unequal
    devices may disagree, so every rank raises where one does (the others would burn on,
    then wait at the report)."""
    need = kernel_bytes(a, device, kernels)
    try:
        available = available_memory(device, index, pg.local_size)
    except ConfigError:
        if a.memory_mb is None:
            raise
        available = None  # cannot be read: the sizes given stand
    where = "free on the GPU" if device == "cuda" else "of host memory available to this rank"
    too_big = None
    if available is not None:
        for option, size in need.items():
            if size > available:
                value = a.compute_size if option == "--compute-size" else a.gemm_size
                too_big = ConfigError(
                    f"{option} {value} needs {size / MiB:,.0f} MiB, more than the {available / MiB:,.0f} MiB {where}"
                )
        together = sum(need.values())
        if too_big is None and len(need) > 1 and together > available:
            too_big = ConfigError(
                f"--compute-size {a.compute_size} and --gemm-size {a.gemm_size} together need "
                f"{together / MiB:,.0f} MiB, more than the {available / MiB:,.0f} MiB {where}"
            )
        if too_big is None and "memory" in kernels and a.memory_mb and a.memory_mb * MiB + together > available:
            beside = f" beside the {together / MiB:,.0f} MiB of the other kernels" if need else ""
            too_big = ConfigError(
                f"--memory-mb {a.memory_mb:g}{beside} is more than the {available / MiB:,.0f} MiB {where}"
            )
    pg.agree(too_big, "the stress sizes")
    if a.memory_mb:
        return a.memory_mb * MiB
    return a.memory_fraction * max(0.0, available - sum(need.values()))


def run_device(
    pg,
    *,
    device: str,
    device_index: int,
    threads: int,
    duration: float,
    kernels,
    memory_bytes: float,
    compute_size: int,
    iterations: int,
    gemm_size: int,
    gemm_repeats: int,
    gemm_tol: float,
    gemm_precision: str,
    thresholds: Thresholds,
    interval: float,
    inject: Optional[str],
    hang_timeout: float,
    progress: bool,
    stop: threading.Event,
    notice,
) -> tuple:
    """Stress this rank's device for `duration` seconds, or until `stop` (a signal here) or
    `notice` (one on another rank); returns (result, telemetry samples)."""
    dev = _core.make_stress_device(device, device_index, threads)
    source, read = reader_for(device, device_index)
    sampler = Sampler(read, interval).start()
    monitor = SafetyMonitor(thresholds, pg.rank)
    backend = _core.make_backend(device, device_index, threads)
    backend.precision = gemm_precision  # ConfigError where the device has no such GEMMs
    ref = sorted(_core.time_linear(backend, gemm_size, gemm_size, gemm_size, 5))[2]
    reference_flops = 2.0 * gemm_size**3 / ref  # the plain GEMM rate at this precision, measured in this run
    copy_bytes = int(min(max(memory_bytes, MiB), 256 * MiB))
    reference_copy = dev.copy_bandwidth(copy_bytes)  # bytes/s of a plain device-to-device copy
    totals = {
        k: {"checked": 0, "mismatches": 0, "nonfinite": 0, "seconds": 0.0, "work": 0.0, "runs": 0} for k in kernels
    }
    injected, skipped = set(), set()
    last_progress = [time.monotonic()]

    def watchdog():  # a kernel that never returns cannot raise: end the job from here
        while not stop.wait(1.0):
            if time.monotonic() - last_progress[0] > hang_timeout:
                write_line(
                    f"mgpu: error: rank {pg.rank}: no stress kernel finished in {hang_timeout:g} s: a device hang, "
                    "or launches longer than --hang-timeout (fewer --iterations, smaller sizes)"
                )
                if pg.size > 1:
                    pg.abort(EXIT_HANG)
                os._exit(EXIT_HANG)

    guard = threading.Thread(target=watchdog, name="mgpu-stress-watchdog", daemon=True)
    guard.start()

    bar = None
    if progress and pg.is_root:
        from tqdm.auto import tqdm

        bar = tqdm(total=round(duration), unit="s", desc="stress", dynamic_ncols=True, file=sys.stderr)
    t0 = time.monotonic()
    patterns = itertools.cycle(PATTERNS)
    try:
        for i, kernel in enumerate(itertools.cycle(kernels)):
            if not stop.is_set() and notice.heard():
                write_line(f"mgpu stress (rank {pg.rank}): another rank stopped: stopping")
                stop.set()
            if stop.is_set():
                notice.tell()  # once, and not back to whoever told this rank
                break
            if time.monotonic() - t0 >= duration:
                break
            fault = inject == kernel and kernel not in injected
            if kernel == "compute":
                c = dev.compute(compute_size, iterations, i, 1024, fault)
            elif kernel == "gemm":
                c = dev.gemm(gemm_size, gemm_repeats, 7, gemm_tol, fault, gemm_precision)
            else:
                target = memory_bytes
                if dev.buffer_bytes < target and monitor.grow_memory:  # grow in quarters
                    dev.resize_buffer(int(min(target, dev.buffer_bytes + target / 4)))
                if not dev.buffer_bytes:  # the monitor stopped the buffer before it had any
                    if kernel not in skipped:
                        skipped.add(kernel)
                        monitor.event("skip_memory", "no buffer to test: the memory pass does not run", {})
                    if skipped.issuperset(kernels):
                        break
                    continue
                c = dev.memory(next(patterns), 11, i, fault)
            if fault:
                injected.add(kernel)
            t = totals[kernel]
            for key in ("checked", "mismatches", "nonfinite", "seconds", "work"):
                t[key] += getattr(c, key)
            t["runs"] += 1
            last_progress[0] = time.monotonic()
            iterations = monitor.check(sampler.latest(), iterations)
            if bar is not None:
                bar.n = min(round(time.monotonic() - t0), round(duration))
                r = sampler.latest() or {}
                bar.set_postfix(
                    {
                        k: f"{r[k]:.0f}"
                        for k in ("temperature_c", "utilization_pct", "memory_used_pct")
                        if r.get(k) is not None
                    },
                    refresh=True,
                )
    finally:
        stop.set()
        samples = sampler.stop()
        if bar is not None:
            bar.close()
    errors = {k: int(v["mismatches"]) for k, v in totals.items()}
    nonfinite = sum(int(v["nonfinite"]) for v in totals.values())
    rates = {}
    if "compute" in totals and totals["compute"]["seconds"] > 0:
        rates["compute_ops_per_s"] = totals["compute"]["work"] / totals["compute"]["seconds"]
        clock = summarize(samples).get("sm_clock_mhz", {}).get("max")
        if device == "cuda" and clock:  # special-function units: 16 per SM and clock
            sms = _core.cuda_device_info(device_index)["multiprocessors"]
            rates["sfu_limit_ops_per_s"] = sms * 16 * clock * 1e6
            rates["compute_vs_sfu_limit"] = rates["compute_ops_per_s"] / rates["sfu_limit_ops_per_s"]
    if "gemm" in totals and totals["gemm"]["seconds"] > 0:
        rates["gemm_flops"] = totals["gemm"]["work"] / totals["gemm"]["seconds"]
        rates["gemm_reference_flops"] = reference_flops
        rates["gemm_vs_reference"] = rates["gemm_flops"] / reference_flops
    if "memory" in totals and totals["memory"]["seconds"] > 0:
        rates["memory_GBps"] = totals["memory"]["work"] / totals["memory"]["seconds"] / 1e9
        rates["copy_reference_GBps"] = reference_copy / 1e9
        rates["memory_vs_copy"] = rates["memory_GBps"] / rates["copy_reference_GBps"]
    checked = {k: int(v["checked"]) for k, v in totals.items()}
    unverified = [f"{k} not tested" for k in kernels if not checked[k]]
    if inject is not None and inject not in injected:
        unverified.append(f"the {inject} fault asked for was never injected")
    elif inject is not None and not errors[inject] and not nonfinite:
        unverified.append(f"the injected {inject} fault was not caught")
    verdict = "FAULTY" if sum(errors.values()) or nonfinite else "UNVERIFIED" if unverified else "OK"
    result = {
        "rank": pg.rank,
        "host": socket.gethostname(),
        "device": device,
        "device_index": device_index,
        "name": dev.name,
        "verdict": verdict,
        "unverified": unverified,  # why an UNVERIFIED device cannot be vouched for
        "errors": errors,
        "nonfinite": nonfinite,
        "checked": checked,
        "runs": {k: v["runs"] for k, v in totals.items()},
        "rates": rates,
        "buffer_bytes": dev.buffer_bytes,
        "iterations_per_launch": iterations,
        "telemetry_source": source,
        # no sensor read (a VM's CPU has no thermal zone): --max-temp could not be kept
        "temperature_watched": any(r.get("temperature_c") is not None for r in samples),
        "telemetry": summarize(samples),
        "events": monitor.events,
        "seconds": time.monotonic() - t0,
        "injected_fault": sorted(injected) or None,
    }
    return result, samples


def cmd_stress(a, pg) -> int:
    device, index = pg.resolve_device(a.device)
    if a.memory_mb is not None and a.memory_fraction is not None:
        raise ConfigError("give the buffer as --memory-mb or as --memory-fraction, not both")
    scaled = resolve_defaults(a, device)
    if scaled and pg.is_root:
        print(
            "mgpu stress: GPU EMULATION (the CPU running mgpu's CUDA code, not a real GPU): defaults scaled down to "
            + ", ".join(f"--{n.replace('_', '-')} {getattr(a, n):g}" for n in scaled)
            + " (give them to override)",
            flush=True,
        )
    if not 0 < a.duration < math.inf:
        raise ConfigError(f"--duration must be finite and > 0 seconds, got {a.duration!r}")
    if not 0 < a.memory_fraction <= 1:
        raise ConfigError(f"--memory-fraction must be in (0, 1], got {a.memory_fraction}")
    if a.memory_mb is not None and not a.memory_mb > 0:
        raise ConfigError(f"--memory-mb must be > 0, got {a.memory_mb}")
    for name in ("iterations", "compute_size", "gemm_size", "gemm_repeats"):
        if getattr(a, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    check_monitor_options(a.interval, a.max_temp, a.max_memory_percent, a.power_limit)
    if not 0 < a.hang_timeout <= MAX_WAIT_S:
        raise ConfigError(f"--hang-timeout must be > 0 and at most {MAX_WAIT_S:g} seconds, got {a.hang_timeout!r}")
    if not 0 <= a.gemm_tol < 1:  # NaN fails too
        raise ConfigError(f"--gemm-tol must be a relative tolerance in [0, 1), got {a.gemm_tol!r}")
    if a.threads is not None and a.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {a.threads}")
    check_outputs({"--json": a.json, **(output_options(a.telemetry) if a.telemetry is not None else {})})
    kernels = KERNELS if a.kernel == "all" else (a.kernel,)
    if a.inject_fault is not None and a.inject_fault not in kernels:
        raise ConfigError(
            f"--inject-fault {a.inject_fault} needs the {a.inject_fault} kernel to run "
            f"(--kernel {a.inject_fault} or all); with --kernel {a.kernel} nothing would catch it"
        )
    if a.gemm_precision != "fp32" and device != "cuda":
        raise ConfigError(f"--gemm-precision {a.gemm_precision} needs a GPU; the CPU GEMM burn runs in fp32")
    threads = a.threads or pg.default_threads()
    memory = _buffer_bytes(a, pg, device, index, kernels)
    pg.timeout = a.hang_timeout
    stop = threading.Event()
    previous = {}

    def on_signal(signum, frame):
        write_line(f"mgpu: {signal.Signals(signum).name} on rank {pg.rank}: stopping the stress run")
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):  # SIGUSR1: mpirun forwards it to every rank
        previous[sig] = signal.signal(sig, on_signal)
    notice = pg.stop_notice()
    try:
        result, samples = run_device(
            pg,
            device=device,
            device_index=index,
            threads=threads,
            duration=a.duration,
            kernels=kernels,
            memory_bytes=memory,
            compute_size=a.compute_size,
            iterations=a.iterations,
            gemm_size=a.gemm_size,
            gemm_repeats=a.gemm_repeats,
            gemm_tol=a.gemm_tol,
            gemm_precision=a.gemm_precision,
            thresholds=Thresholds(a.max_temp, a.max_memory_percent, a.power_limit),
            interval=a.interval,
            inject=a.inject_fault,
            hang_timeout=a.hang_timeout,
            progress=not a.no_progress,
            stop=stop,
            notice=notice,
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    pg.barrier(what="stress report")  # against the hang timeout: a lost peer ends the job
    notice.close()
    results = pg.comm.gather((result, samples), root=0) if pg.comm is not None else [(result, samples)]
    if not pg.is_root:
        return _exit_code([result])
    devices = [r for r, _ in results]
    report = {
        "gpu_emulation": gpus_emulated(device),
        "devices": devices,
        "duration_s": a.duration,
        "kernels": list(kernels),
        "thresholds": {
            "max_temp_c": a.max_temp,
            "max_memory_percent": a.max_memory_percent,
            "power_limit_w": a.power_limit,
        },
        "events": [e for d in devices for e in d["events"]],
        "stopped_early": stop.is_set() and any(d["seconds"] < a.duration for d in devices),
    }
    unwatched = [str(d["rank"]) for d in devices if not d["temperature_watched"]]
    if unwatched:
        print(f"no temperature read on rank(s) {', '.join(unwatched)}: --max-temp was not watched there")
    for d in devices:
        rates = ", ".join(f"{k} {v:.3g}" for k, v in d["rates"].items())
        why = f" ({'; '.join(d['unverified'])})" if d["verdict"] == "UNVERIFIED" else ""
        print(
            f"rank {d['rank']} {d['name']} on {d['host']}: {d['verdict']}{why}; errors {d['errors']}, "
            f"non-finite {d['nonfinite']}; {rates}"
        )
    if a.json:
        write_json_atomic(a.json, report)
    if a.telemetry:
        series = {f"rank {r['rank']}: {r['name']}": s for r, s in results}
        verdicts = ", ".join(sorted({d["verdict"] for d in devices}))
        title = (
            f"mgpu stress, {a.duration:g} s of {', '.join(kernels)} on {len(devices)} device(s) "
            f"({', '.join(sorted({d['host'] for d in devices}))}): {verdicts}"
        )
        limits = {"temperature_c": a.max_temp, "memory_used_pct": a.max_memory_percent, "power_w": a.power_limit}
        for path in write_series(a.telemetry, series, title, limits, report["events"]):
            print(f"telemetry written to {path}")
    return _exit_code(devices)


def _exit_code(devices: list) -> int:
    verdicts = {d["verdict"] for d in devices}
    return EXIT_FAULTY if "FAULTY" in verdicts else EXIT_UNVERIFIED if "UNVERIFIED" in verdicts else 0


def add_parser(sub) -> None:
    s = sub.add_parser(
        "stress",
        help="burn in every device, verify every result, watch temperature and memory",
        description=__doc__.splitlines()[0],
    )
    s.add_argument("--duration", type=float, default=None, help="seconds (default 60; 10 on the GPU emulation)")
    s.add_argument("--kernel", choices=("all", *KERNELS), default="all")
    s.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    s.add_argument(
        "--threads", type=bounded_int("threads per rank", MAX_THREADS), default=None, help="CPU threads per rank"
    )
    s.add_argument(
        "--memory-fraction",
        type=float,
        default=None,
        help="fraction of free device memory for the pattern buffer (per device; default 0.8)",
    )
    s.add_argument(
        "--memory-mb",
        type=float,
        default=None,
        help="buffer size instead of a fraction (8 on the GPU emulation unless a size is given)",
    )
    s.add_argument(
        "--iterations",
        type=bounded_int("iterations", INT32_MAX),
        default=20,
        help="transcendental chain steps per launch (default %(default)s)",
    )
    s.add_argument(
        "--compute-size",
        type=bounded_int("compute size", INT32_MAX),
        default=None,
        help="values per compute launch (default 262144; 16384 on the GPU emulation)",
    )
    # the n x n elements of each matrix must fit the core's int: 46340^2 < 2^31
    s.add_argument(
        "--gemm-size",
        type=bounded_int("GEMM size", 46340),
        default=None,
        help="GEMM size n (n x n; default 1024, 64 on the emulation)",
    )
    s.add_argument(
        "--gemm-repeats",
        type=bounded_int("GEMM repeats", INT32_MAX),
        default=4,
        help="GEMMs per launch (default %(default)s)",
    )
    s.add_argument(
        "--gemm-tol",
        type=float,
        default=0.0,
        help="relative tolerance of GEMM verification, in [0, 1) (default 0: exact)",
    )
    s.add_argument(
        "--gemm-precision",
        choices=("fp32", "tf32", "bf16"),
        default="fp32",
        help="GEMM burn precision (tf32 and bf16 on GPUs)",
    )
    s.add_argument("--max-temp", type=float, default=85.0, help="C: above it, throttle (default %(default)g)")
    s.add_argument(
        "--max-memory-percent",
        type=float,
        default=95.0,
        help="percent of memory used: above it, stop growing the buffer (default %(default)g)",
    )
    s.add_argument("--power-limit", type=float, default=None, help="W: above it, warn (default: the device's)")
    s.add_argument(
        "--interval", type=float, default=1.0, help="telemetry sampling interval, seconds (default %(default)g)"
    )
    s.add_argument(
        "--hang-timeout",
        type=float,
        default=120.0,
        help="seconds without progress that end the run (exit 3; default %(default)g)",
    )
    s.add_argument("--json", metavar="PATH")
    s.add_argument("--telemetry", metavar="PREFIX", help="write PREFIX.csv, PREFIX.json and PREFIX.png")
    s.add_argument(
        "--inject-fault",
        choices=KERNELS,
        default=None,
        help="test hook: flip one bit of one result of this kernel (the verdict must turn FAULTY)",
    )
    s.add_argument("--no-progress", action="store_true")
