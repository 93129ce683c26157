"""`mgpu bench`: training throughput by model, batch size and rank count, seed 001's
methodology, with the physical floors beside each figure.

Per (batch size, ranks): warm-up steps excluded, then repeats x measured steps,
each step timed; outliers (modified z-score > 3.5) removed; median, mean and
95% confidence interval of the step time; the step broken down (forward,
backward, exposed allreduce, optimizer) by the core's timers; speedup and
efficiency against 1 rank; peak memory; the compute floor (model FLOPs at the
measured GEMM rate) and the allreduce floor (the calibrated alpha-beta model).
`--ranks 1,2,...` launches mpirun itself; with several rank counts in rounds that
alternate them (1 2, 2 1, 1 2, ...: `--repeats` rounds, one repeat each; not with
`--observe`), so the machine's drift falls on every count and a speedup is the
median of the rounds' paired ratios; under mpirun it measures the running world.
`--threads 1,2` does the same for thread counts per rank (each its own launch), and
its speedup is then against the fewest ranks with the fewest threads. `--compare torch` runs
the same workload in PyTorch (DDP) in the same run, in rounds alternating with
mgpu's (mgpu, torch, mgpu, ...: the machine's drift falls on both), and reports the
ratio per round; `--validate-selector` sets the selector's predictions beside the
measurements.
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

import numpy as np

from . import __version__, _core, gpus_emulated
from .atomic import atomic_file
from .config import GRAD_DTYPES, GRAPH_MODES, PRECISIONS, PRESETS
from .errors import ConfigError

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "torch_ddp.py")


# --- statistics ------------------------------------------------------------------------
def summarize(samples) -> dict:
    """Median, mean and 95% CI of the mean after dropping modified-z-score outliers (> 3.5)."""
    x = np.asarray(samples, float)
    med = float(np.median(x))
    mad = float(np.median(np.abs(x - med)))
    keep = x if mad == 0 else x[np.abs(0.6745 * (x - med) / mad) <= 3.5]
    n = len(keep)
    mean = float(keep.mean())
    sd = float(keep.std(ddof=1)) if n > 1 else 0.0
    try:
        from scipy import stats
        t = float(stats.t.ppf(0.975, n - 1)) if n > 1 else 0.0
    except ImportError:
        t = 1.96
    half = t * sd / np.sqrt(n) if n > 1 else 0.0
    # times are positive: a t-interval of a few skewed samples can reach below zero
    return {"median": float(np.median(keep)), "mean": mean, "ci95": [max(0.0, mean - half), mean + half],
            "n": n, "outliers": int(len(x) - n)}


# --- the workload --------------------------------------------------------------------------
def resolve_layers(model: Optional[str], layers) -> tuple:
    if layers:
        return [int(v) for v in layers], 0.0
    p = PRESETS[model or "large"]
    return [p.in_features or 50, *p.hidden, p.out_features or 3], p.dropout


def step_flops(sizes, batch: int) -> float:
    """FLOPs of one training step's GEMMs on `batch` samples (the first layer needs no input gradient)."""
    total = 0.0
    for l in range(len(sizes) - 1):
        total += 2.0 * batch * sizes[l] * sizes[l + 1] * (2 if l == 0 else 3)
    return total


def measure(pg, sizes, dropout: float, batch: int, *, optimizer: str, warmup: int, steps: int, repeats: int,
            device: str, device_index: int, threads: int, precision: str = "fp32", graph: str = "auto",
            accumulate: int = 1, grad_dtype: str = "fp32", observe: bool = False) -> dict:
    """Collective: time `repeats` x `steps` training steps at global batch `batch` on this world
    (each rank's share in `accumulate` micro-batches; gradients allreduced in `grad_dtype`).
    observe: also time as many steps with every `train` observability output on, in rounds
    interleaved with the plain ones (off, on, on, off, ...: drift falls on both alike)."""
    from .data import local_slice
    from .model import MLP
    from .trainer import Trainer
    model = MLP(sizes, seed=0, dropout=dropout, device=device, device_index=device_index, threads=threads,
                precision=precision)
    trainer = Trainer(model, loss="mse", optimizer=optimizer, lr=1e-3, momentum=0.9, process_group=pg, timed=True,
                      graph=graph, accumulate=accumulate, grad_dtype=grad_dtype)
    part = local_slice(batch, pg.rank, pg.size)
    rng = np.random.default_rng(pg.rank)
    rows = part.stop - part.start
    data = [(rng.standard_normal((rows, sizes[0]), dtype=np.float32),
             rng.standard_normal((rows, sizes[-1]), dtype=np.float32)) for _ in range(4)]
    for i in range(warmup):
        trainer.step(*data[i % 4], global_batch=batch, first_sample=part.start)
    times, phases = [], {"forward": [], "backward": [], "comm_wait": [], "optimizer": []}
    observer, scratch, observed, rounds, own = None, None, [], {"off": [], "on": []}, []
    if observe:
        from .observe import Observer
        scratch = tempfile.mkdtemp(prefix="mgpu-bench-observe-")
        observer = Observer(pg, trace=os.path.join(scratch, "trace.json"), trace_steps=(0, None),
                            log_json=os.path.join(scratch, "log.jsonl"), tensorboard=os.path.join(scratch, "tb"),
                            straggler_threshold=0.25, device_clock=device == "cuda")
        observer.start(trainer)
    for r in range(repeats):
        for on in ((False, True) if r % 2 == 0 else (True, False)) if observe else (False,):
            pg.barrier()
            mine = observed if on else times
            first = len(mine)
            for i in range(steps):
                t0 = time.perf_counter()
                trainer.step(*data[i % 4], global_batch=batch, first_sample=part.start, trace=on)
                if on:  # the observer's own time too: a figure the machine's noise hides less
                    t1 = time.perf_counter()
                    observer.on_step(trainer, trainer.last_result, t0, rows)
                    own.append(time.perf_counter() - t1)
                mine.append(time.perf_counter() - t0)
                if not on:
                    t = trainer.last_result.timings
                    for k in phases:
                        phases[k].append(getattr(t, k))
            rounds["on" if on else "off"].append(float(np.median(mine[first:])))
    overhead = None
    if observe:
        observer.close(trainer)
        shutil.rmtree(scratch, ignore_errors=True)
        off, on = float(np.median(times)), float(np.median(observed))
        paired = [(b / a - 1) * 100 for a, b in zip(rounds["off"], rounds["on"])]  # each repeat's two rounds
        overhead = {"off": summarize(times), "on": summarize(observed), "overhead_pct": (on / off - 1) * 100,
                    "paired_round_pct": paired,
                    "round_medians_ms": {k: [v * 1e3 for v in vs] for k, vs in rounds.items()},
                    "observer_ms_per_step": {"median": float(np.median(own)) * 1e3, "mean": float(np.mean(own)) * 1e3,
                                             "max": float(np.max(own)) * 1e3},
                    "observer_pct_of_step": float(np.mean(own)) / off * 100}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    if device == "cuda":
        free, total = _core.cuda_memory_info(device_index)
        peak = float(total - free)
    peak = pg.allreduce(peak, op="max")
    stats = summarize(times)
    counted = (count_emulated_work(model, trainer, pg, data, batch, part.start)
               if gpus_emulated(device) else None)
    return {"emulation_counters_per_step": counted, "observe_overhead": overhead,
            "batch_size": batch, "ranks": pg.size, "threads": threads, "device": device,
            "step": stats, "samples_per_sec": batch / stats["median"], "step_seconds": times,
            "breakdown_ms": {k: float(np.median(v)) * 1e3 for k, v in phases.items()},
            "peak_memory_bytes": peak, "params": model.num_params, "overlap": trainer._step.overlaps,
            "precision": precision, "accumulate": accumulate, "grad_dtype": grad_dtype,
            "cuda_graph": trainer._step.uses_graphs,
            "graph_fallback": trainer._step.graph_fallback or None}


def count_emulated_work(model, timed_trainer, pg, data, batch: int, first_sample: int, steps: int = 3) -> dict:
    """On the GPU emulation: the CUDA work of one steady-state step (kernel and graph
    launches, host synchronisations, allocations, bytes each way), averaged over `steps`
    steps of an untimed trainer (the timed one adds a synchronisation per phase)."""
    from .trainer import Trainer
    trainer = Trainer(model, loss="mse", optimizer=timed_trainer.optimizer_name, lr=1e-3, momentum=0.9,
                      process_group=pg, graph="on" if timed_trainer._step.uses_graphs else "off",
                      accumulate=timed_trainer.accumulate, grad_dtype=timed_trainer.grad_dtype)
    for i in range(2):  # first appearance and capture of the shape
        trainer.step(*data[i % 4], global_batch=batch, first_sample=first_sample)
    model._backend.synchronize()
    before = _core.emulation.counters()
    for i in range(steps):
        trainer.step(*data[i % 4], global_batch=batch, first_sample=first_sample)
    stepped = _core.emulation.counters()
    model._backend.synchronize()  # the queued work runs (and counts); this sync is ours, not the steps'
    after = dict(_core.emulation.counters(), host_syncs=stepped["host_syncs"])
    return {k: (after[k] - before[k]) / steps for k in after}


def gemm_rate(device: str, device_index: int, threads: int, sizes, local_batch: int, precision: str = "fp32") -> float:
    """FLOP/s of this model's own GEMMs at this local batch and precision: the compute floor's rate.
    A floor is a best case: each layer's fastest of 5 timings after a discarded one (a fresh
    backend's first call starts its threads; on a loaded 2-core machine a 2-thread GEMM
    sometimes waited ~0.5 ms for a worker, and a median of 3 put the floor above the step)."""
    backend = _core.make_backend(device, device_index, threads)
    backend.precision = precision
    work = time_total = 0.0
    for l in range(len(sizes) - 1):
        rows = max(local_batch, 1)
        _core.time_linear(backend, rows, sizes[l], sizes[l + 1], 1)
        t = float(np.min(_core.time_linear(backend, rows, sizes[l], sizes[l + 1], 5)))
        work += 2.0 * rows * sizes[l] * sizes[l + 1]
        time_total += t
    return work / time_total


# --- worker and driver ---------------------------------------------------------------------
def run_worker(pg, a, repeats: Optional[int] = None) -> list:
    """Every batch size at this world size; rows on rank 0."""
    from .perf import check_training_memory
    sizes, dropout = resolve_layers(a.model, a.layers)
    if a.dropout is not None:
        dropout = a.dropout
    device, device_index = pg.resolve_device(a.device)
    threads = a.threads or pg.default_threads()
    error = None
    try:  # every batch size before any is measured; agreed, as a rank's free memory is its own
        for batch in a.batch_sizes:
            if batch < pg.size:
                raise ConfigError(f"batch size {batch} is smaller than the number of ranks ({pg.size})")
            check_training_memory(sizes, max(1, -(-batch // (pg.size * a.accumulate))), optimizer=a.optimizer,
                                  precision=a.precision, dropout=dropout, device=device, device_index=device_index,
                                  local_ranks=pg.local_size, nccl=device == "cuda" and pg.size > 1,
                                  # bench trains at the Trainer's default bucket
                                  mpi_bucket_bytes=4 * 2 ** 20 if device != "cuda" and pg.size > 1 else 0.0)
    except ConfigError as e:
        error = e
    pg.agree(error, what="checking memory")
    rows = []
    bar = None
    if pg.is_root and not a.no_progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(a.batch_sizes), desc=f"bench {pg.size} rank(s)", unit="batch", file=sys.stderr)
    # where the ranks' cores sat, as `topo` records it: a multi-rank wait depends on it
    placement = pg.core_round_trip_ns if device == "cpu" and pg.size > 1 else lambda: None
    for batch in a.batch_sizes:
        before = placement()
        row = measure(pg, sizes, dropout, batch, optimizer=a.optimizer, warmup=a.warmup, steps=a.steps,
                      repeats=repeats or a.repeats, device=device, device_index=device_index, threads=threads,
                      precision=a.precision, graph=a.cuda_graph, accumulate=a.accumulate, grad_dtype=a.grad_dtype,
                      observe=a.observe)
        after = placement()
        if before is not None and after is not None:
            row["core_round_trip_ns"], row["core_round_trip_cpus"] = [before["ns"], after["ns"]], before["cpus"]
        local = -(-batch // pg.size)
        rate = gemm_rate(device, device_index, threads, sizes, local, a.precision)
        row["gemm_flops"] = pg.allreduce(rate, op="min")
        row["compute_floor_ms"] = step_flops(sizes, local) / row["gemm_flops"] * 1e3
        row["layers"] = sizes
        row["dropout"] = dropout
        rows.append(row)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return rows


def _launch(ranks: int, args: list, env: dict, label: str = "") -> list:
    out = tempfile.NamedTemporaryFile(prefix="mgpu-bench-", suffix=".json", delete=False).name
    cmd = ["mpirun", "-np", str(ranks), "--oversubscribe", "--bind-to", "none", sys.executable, "-m", "mgpu",
           "bench", *args, "--worker-out", out]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    try:
        if r.returncode != 0:
            tail = [l for l in r.stderr.splitlines() if l.startswith("mgpu")] or r.stderr.splitlines()[-3:]
            raise ConfigError(f"benchmark at {ranks} rank(s){label} failed: {' '.join(tail)[:500]}")
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def _mpi_env(peer: bool = False) -> dict:
    """The environment of a launch; a peer framework's (peer=True) without the OpenMP
    tuning mgpu sets for its own OpenMP-only steps."""
    from ._openmp_env import for_other_frameworks
    env = for_other_frameworks(dict(os.environ)) if peer else dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    return env


def torch_python() -> Optional[str]:
    for py in (sys.executable, "/usr/bin/python3"):
        if os.path.exists(py) and subprocess.run([py, "-c", "import torch"], capture_output=True).returncode == 0:
            return py
    return None


# Lines of mpirun's (Open MPI 4's and 5's prterun's) own reports around a failed rank.
_MPIRUN_LINE = re.compile(r"^(Primary job|mpirun |prterun |Process name:|Exit code:|a non-zero exit|"
                          r"the job to be terminated|thus causing|Per user-direction|The first process to do so|"
                          r"We reiterate|\[[\w.-]+:\d+\])")


def peer_error(stderr: str) -> str:
    """The line of a failed peer's stderr that says why: its first exception (the rank
    that failed first; the others' follow from it), else its first line that is not
    mpirun's own (banners of dashes, its abort notices)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip().strip("-")]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b.*:", line)]
    if raised:
        return raised[0]
    ours = [line for line in lines if not _MPIRUN_LINE.match(line)]
    return (ours or lines or ["(no error output)"])[0]


def run_torch(py: str, ranks: int, sizes, dropout, batch, a, device: str, threads: int) -> dict:
    """One round of the PyTorch peer (warm-up, then --steps timed steps) at this cell."""
    cmd = ["mpirun", "-np", str(ranks), "--oversubscribe", "--bind-to", "none", py, PEER,
           "--layers", ",".join(map(str, sizes)), "--dropout", str(dropout), "--batch-size", str(batch),
           "--optimizer", a.optimizer, "--warmup", str(a.warmup), "--steps", str(a.steps),
           "--repeats", "1", "--threads", str(threads), "--device", device, "--precision", a.precision,
           "--port", str(29500 + (os.getpid() + ranks + batch) % 400)]
    limit = 120 + 10 * (a.warmup + a.steps)  # generous: a hung peer must not hang the benchmark
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=_mpi_env(peer=True), timeout=limit)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"the PyTorch peer did not finish within {limit} s at {ranks} rank(s)") from None
    if r.returncode != 0:
        raise ConfigError(f"the PyTorch peer failed at {ranks} rank(s): {peer_error(r.stderr)}")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    stats = summarize(result["step_seconds"])
    return {"version": result["version"], "step": stats, "samples_per_sec": batch / stats["median"],
            "step_seconds": result["step_seconds"]}


def merge_rounds(rounds: list) -> list:
    """One row per (batch, ranks) from alternating rounds of both sides: each round's
    rows (mgpu's, with the peer's under "torch") -> all steps' statistics, and the
    per-round throughput ratio (a pair measured back to back, so drift cancels)."""
    merged = []
    for cells in zip(*rounds):
        row = dict(cells[0])
        times = [t for c in cells for t in c["step_seconds"]]
        row["step"] = summarize(times)
        row["samples_per_sec"] = row["batch_size"] / row["step"]["median"]
        row["step_seconds"] = times
        row["breakdown_ms"] = {k: float(np.median([c["breakdown_ms"][k] for c in cells])) for k in row["breakdown_ms"]}
        row["peak_memory_bytes"] = max(c["peak_memory_bytes"] for c in cells)
        row["round_step_medians"] = [float(np.median(c["step_seconds"])) for c in cells]
        if all("core_round_trip_ns" in c and c["core_round_trip_cpus"] == cells[0]["core_round_trip_cpus"]
               for c in cells):
            row["core_round_trip_ns"] = [t for c in cells for t in c["core_round_trip_ns"]]
        else:  # a round without readings (or of other CPUs): the cell's placement is unknown
            row.pop("core_round_trip_ns", None)
            row.pop("core_round_trip_cpus", None)
        if "torch" in row:
            peer = [t for c in cells for t in c["torch"]["step_seconds"]]
            stats = summarize(peer)
            row["torch"] = {"version": row["torch"]["version"], "step": stats, "step_seconds": peer,
                            "samples_per_sec": row["batch_size"] / stats["median"]}
            ratios = [float(np.median(c["torch"]["step_seconds"]) / np.median(c["step_seconds"])) for c in cells]
            row["torch_ratio"] = {"median": float(np.median(ratios)), "min": min(ratios), "max": max(ratios),
                                  "rounds": ratios}
        merged.append(row)
    return merged


def _predict(row: dict, profile: dict):
    """The model's prediction of a row as it ran: its precision, whether its steps replayed
    graphs, the batch split evenly (as the benchmark splits it)."""
    from . import perf
    w = perf._workload(None, row["layers"], None, row["batch_size"], row.get("precision", "fp32"),
                       row.get("optimizer", "sgd"), 4.0, row.get("dropout", 0.0), row.get("grad_dtype", "fp32"),
                       "on" if row.get("cuda_graph") else "off", int(row.get("accumulate", 1)))
    options = perf.P.Options()
    options.equal_shares = True
    return perf.P.predict(w, perf.to_core(profile, row["ranks"]), row["ranks"], options)


def add_derived(rows: list, profile: Optional[dict], thread_scaling: bool = False) -> None:
    """Speedup and efficiency against 1 rank (with `thread_scaling`, several thread counts
    measured: against the fewest ranks with the fewest threads, and efficiency per thread
    too); the allreduce floor and the selector's prediction."""
    by_batch = {}
    for r in rows:  # the base: 1 rank (its fewest threads); comparing threads, the fewest ranks
        if r["ranks"] == 1 or thread_scaling:
            base = by_batch.get(r["batch_size"])
            if base is None or (r["ranks"], r["threads"]) < (base["ranks"], base["threads"]):
                by_batch[r["batch_size"]] = r
    for r in rows:
        base = by_batch.get(r["batch_size"])
        if base:
            r["speedup"] = r["samples_per_sec"] / base["samples_per_sec"]
            if "round_step_medians" in r and "round_step_medians" in base:
                # rounds measured back to back: each round's pair shares the machine's state
                ratios = [b / t for b, t in zip(base["round_step_medians"], r["round_step_medians"])]
                r["speedup"] = float(np.median(ratios))
                r["speedup_rounds"] = ratios
            scale = r["ranks"] / base["ranks"] * (r["threads"] / base["threads"] if thread_scaling else 1)
            r["efficiency"] = r["speedup"] / scale
        if profile is not None:
            try:
                p = _predict(r, profile)
                r["allreduce_floor_ms"] = p.comm_s * 1e3
                r["predicted_step_ms"] = p.step_s * 1e3
                r["predicted_speedup"] = p.speedup
                # the phases as the core's timers split them (the model's exposed allreduce is
                # the wait after backward: allreduce, skew, health check)
                r["predicted_breakdown_ms"] = {"forward": p.forward_s * 1e3, "backward": p.backward_s * 1e3,
                                               "comm_wait": p.exposed_comm_s * 1e3, "optimizer": p.optimizer_s * 1e3}
            except ConfigError as e:
                r["prediction_error"] = str(e)


def format_table(rows: list) -> str:
    head = (f"{'batch':>6} {'ranks':>5} {'thr':>3} {'samples/s':>10} {'95% CI step ms':>17} {'fwd':>6} {'bwd':>6} {'comm':>6} "
            f"{'opt':>5} {'speedup':>7} {'effic':>5} {'mem MB':>7} {'floor ms':>8} {'ar floor':>8} {'torch/s':>9} {'ratio':>5}")
    out = [head]

    def cell(value, spec: str, width: int, suffix: str = "") -> str:
        """A number, or '-' where the row has none (no 1-rank row to compare with, no peer)."""
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return f"{'-':>{width + len(suffix)}}"
        return f"{value:>{width}{spec}}{suffix}"
    for r in rows:
        b = r["breakdown_ms"]
        ci = r["step"]["ci95"]
        torch = r.get("torch", {})
        out.append(
            f"{r['batch_size']:>6} {r['ranks']:>5} {r['threads']:>3} {r['samples_per_sec']:>10,.0f} "
            f"{ci[0] * 1e3:>7.2f}-{ci[1] * 1e3:<8.2f} {b['forward']:>6.2f} {b['backward']:>6.2f} {b['comm_wait']:>6.2f} "
            f"{b['optimizer']:>5.2f} {cell(r.get('speedup'), '.2f', 6, 'x')} {cell(r.get('efficiency'), '.0%', 5)} "
            f"{r['peak_memory_bytes'] / 2**20:>7.0f} {r['compute_floor_ms']:>8.2f} "
            f"{cell(r.get('allreduce_floor_ms'), '.2f', 8)} "
            f"{cell(torch.get('samples_per_sec'), ',.0f', 9)} "
            f"{cell(r['samples_per_sec'] / torch['samples_per_sec'] if torch else None, '.2f', 5)}")
    return "\n".join(out)


def _graph_mode_used(cells: dict, a) -> str:
    """The --cuda-graph mode that prices these rows as they ran (a failed capture under
    auto runs uncaptured): on or off where every row agrees, else the one asked for."""
    used = {bool(c.get("cuda_graph")) for c in cells.values()}
    return ("on" if True in used else "off") if len(used) == 1 else a.cuda_graph


def _placement_against_calibration(cell: dict, profile: dict) -> dict:
    """Where the ranks' cores sat in a multi-rank cell's rounds (read before and after
    each) against where `topo` probed the wait: whether every round ran in the placement
    of its first probe (placement_as_calibrated) or of its second, and per placement it
    probed, the rounds that ran wholly there, their measured speedup (the median) and the
    prediction from that probe's wait alone. Nothing where either side is unknown or the
    two read other CPUs (one rank per node, GPUs, a profile from before)."""
    from . import perf
    from .process_group import placement_moved
    placement = perf.checked_placement(profile) or {}
    measured = cell.get("core_round_trip_ns")
    if not measured or not placement or cell.get("core_round_trip_cpus") != placement.get("cpus"):
        return {"placement_as_calibrated": None}
    first, second = placement["wait_probe_ns"], placement.get("other_wait_probe_ns")
    out = {"core_round_trip_ns": measured, "calibrated_round_trip_ns": first,
           "placement_as_calibrated": not placement_moved(measured + first),
           "placement_as_second_probe": bool(second) and not placement_moved(measured + second),
           "by_placement": []}
    pairs = [measured[i:i + 2] for i in range(0, len(measured), 2)]
    rounds = cell.get("speedup_rounds") or []
    for name, probed in (("first", first), ("second", second)):
        here = [s for s, pair in zip(rounds, pairs) if probed and not placement_moved(pair + probed)]
        if here:
            measured_speedup = float(np.median(here))
            predicted = _predict(cell, perf.placement_profile(profile, name)).speedup
            out["by_placement"].append({"probe": name, "calibrated_round_trip_ns": probed, "rounds": len(here),
                                        "measured_speedup": measured_speedup, "predicted_speedup": predicted,
                                        "relative_error": (predicted - measured_speedup) / measured_speedup})
    return out


def validate_selector(rows: list, profile: dict, a) -> list:
    """Per batch: measured vs predicted speedup per rank count, and whether the selector's pick was the faster."""
    from . import perf
    out = []
    ranks = sorted({r["ranks"] for r in rows})
    for batch in sorted({r["batch_size"] for r in rows}):
        cells = {r["ranks"]: r for r in rows if r["batch_size"] == batch}
        rec = perf.recommend(layers=cells[ranks[0]]["layers"], batch_size=batch, devices=ranks, profile=profile,
                             optimizer=a.optimizer, dropout=cells[ranks[0]].get("dropout", 0.0),
                             bucket_mb=4.0,  # the bucket bench trains with (Trainer's default)
                             precision=a.precision, grad_dtype=a.grad_dtype, cuda_graph=_graph_mode_used(cells, a),
                             accumulate=a.accumulate)
        # by the same measure as the speedup printed (paired rounds when alternated)
        measure = "speedup" if all("speedup" in c for c in cells.values()) else "samples_per_sec"
        fastest = max(cells.values(), key=lambda r: r[measure])["ranks"]
        for n in ranks:
            c = cells[n]
            if n == 1 or "speedup" not in c:
                continue
            err = (c["predicted_speedup"] - c["speedup"]) / c["speedup"] if "predicted_speedup" in c else None
            out.append({"batch_size": batch, "ranks": n, "measured_speedup": c["speedup"],
                        "measured_speedup_rounds": c.get("speedup_rounds"),
                        "predicted_speedup": c.get("predicted_speedup"), "relative_error": err,
                        "measured_step_ms": c["step"]["median"] * 1e3, "predicted_step_ms": c.get("predicted_step_ms"),
                        "measured_step_1_ms": cells[1]["step"]["median"] * 1e3,
                        "predicted_step_1_ms": cells[1].get("predicted_step_ms"),
                        "measured_wait_ms": c["breakdown_ms"]["comm_wait"],
                        "predicted_wait_ms": (c.get("predicted_breakdown_ms") or {}).get("comm_wait"),
                        **_placement_against_calibration(c, profile),
                        "selector_strategy": rec["strategy"], "selector_devices": rec["devices"],
                        "measured_fastest": fastest,
                        "picked_faster": None if rec["strategy"] == "benchmark_required" else rec["devices"] == fastest})
    return out


# The CPU selector's bound on a predicted speedup against the measured one (issue 13, item 6).
VALIDATION_BOUND = 0.10


def format_validation(rows: list) -> str:
    out = [f"{'batch':>6} {'ranks':>5} {'measured':>9} {'predicted':>9} {'error':>7}  selector -> fastest measured"]
    for v in rows:
        pred = f"{v['predicted_speedup']:.2f}x" if v["predicted_speedup"] is not None else "n/a"
        err = f"{v['relative_error']:+.0%}" if v["relative_error"] is not None else "n/a"
        verdict = {True: "right", False: "WRONG", None: "asks for a benchmark"}[v["picked_faster"]]
        rounds = v.get("measured_speedup_rounds")
        spread = (f"; rounds {min(rounds):.2f}-{max(rounds):.2f}x" if rounds and len(rounds) > 1 else "")
        if None not in (v.get("predicted_step_ms"), v.get("predicted_step_1_ms"), v.get("predicted_wait_ms")):
            # where a miss lies: either step (the machine's state may have moved since `topo`),
            # or the wait after backward, which swings with the machine's memory traffic
            spread += (f"; ms measured (predicted): step on 1 rank {v['measured_step_1_ms']:.3g} "
                       f"({v['predicted_step_1_ms']:.3g}), on {v['ranks']} {v['measured_step_ms']:.3g} "
                       f"({v['predicted_step_ms']:.3g}), wait after backward {v['measured_wait_ms']:.3g} "
                       f"({v['predicted_wait_ms']:.3g})")
        if v.get("placement_as_calibrated") is not None:
            seen, cal = v["core_round_trip_ns"], v["calibrated_round_trip_ns"]
            where = ("as calibrated" if v["placement_as_calibrated"] else
                     "as topo's second probe" if v.get("placement_as_second_probe") else
                     "in turn where topo's two probes ran" if v.get("by_placement") and
                     sum(b["rounds"] for b in v["by_placement"]) == len(seen) // 2 else
                     "ANOTHER PLACEMENT than topo's")
            spread += (f"; the cores' round trip {min(seen):.0f}-{max(seen):.0f} ns (topo's "
                       f"{min(cal):.0f}-{max(cal):.0f}): {where}")
            spread += "".join(
                f"; {b['rounds']} round(s) where topo's {b['probe']} probe of the wait ran "
                f"({min(b['calibrated_round_trip_ns']):.0f}-{max(b['calibrated_round_trip_ns']):.0f} ns): "
                f"{b['measured_speedup']:.2f}x, predicted {b['predicted_speedup']:.2f}x {b['relative_error']:+.0%}"
                for b in v.get("by_placement", []))
        out.append(f"{v['batch_size']:>6} {v['ranks']:>5} {v['measured_speedup']:>8.2f}x {pred:>9} {err:>7}  "
                   f"{v['selector_strategy']} ({v['selector_devices']}) vs {v['measured_fastest']}: {verdict}{spread}")
    errors = [v["relative_error"] for v in rows if v["relative_error"] is not None]
    if errors:  # what issue 13 asks of a run: every cell within VALIDATION_BOUND, every pick right
        picks = [v["picked_faster"] for v in rows]
        out.append(f"within +-{VALIDATION_BOUND:.0%}: {sum(abs(e) <= VALIDATION_BOUND for e in errors)} of "
                   f"{len(errors)} cells (worst {max(errors, key=abs):+.0%}); picks: {picks.count(True)} right, "
                   f"{picks.count(False)} wrong, {picks.count(None)} asked for a benchmark")
    return "\n".join(out)


def write_csv(path: str, rows: list) -> None:
    fields = ["batch_size", "ranks", "threads", "device", "samples_per_sec", "step_median_ms", "step_mean_ms",
              "ci95_low_ms", "ci95_high_ms", "forward_ms", "backward_ms", "comm_wait_ms", "optimizer_ms", "speedup",
              "efficiency", "peak_memory_bytes", "compute_floor_ms", "allreduce_floor_ms", "predicted_step_ms",
              "torch_samples_per_sec", "torch_ratio_median", "torch_ratio_min", "torch_ratio_max"]
    with atomic_file(path, private=False) as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            s = r["step"]
            w.writerow({"batch_size": r["batch_size"], "ranks": r["ranks"], "threads": r["threads"], "device": r["device"],
                        "samples_per_sec": r["samples_per_sec"], "step_median_ms": s["median"] * 1e3,
                        "step_mean_ms": s["mean"] * 1e3, "ci95_low_ms": s["ci95"][0] * 1e3,
                        "ci95_high_ms": s["ci95"][1] * 1e3,
                        **{f"{k}_ms": v for k, v in r["breakdown_ms"].items()},
                        "speedup": r.get("speedup"), "efficiency": r.get("efficiency"),
                        "peak_memory_bytes": r["peak_memory_bytes"], "compute_floor_ms": r["compute_floor_ms"],
                        "allreduce_floor_ms": r.get("allreduce_floor_ms"), "predicted_step_ms": r.get("predicted_step_ms"),
                        "torch_samples_per_sec": r.get("torch", {}).get("samples_per_sec"),
                        **{f"torch_ratio_{k}": r.get("torch_ratio", {}).get(k) for k in ("median", "min", "max")}})


def _plot_subtitle(rows: list, meta: dict) -> str:
    """Model, batch split and machine of a benchmark, for every plot's title."""
    r = rows[0]
    model = f"{meta['model']} " if meta.get("model") else ""
    threads = {x["ranks"]: x["threads"] for x in rows}  # each rank count splits the cores its own way
    threads = (f"{r['threads']} thread(s) per rank" if len(set(threads.values())) == 1 else
               ", ".join(f"{t} thread(s) per rank at {n} rank(s)" for n, t in sorted(threads.items())))
    where = f"{r['device']}, {threads}" + (f" on {meta['host']}" if meta.get("host") else "")
    if meta.get("gpu_emulation"):
        where = f"EMULATED GPUs (the CPU; not GPU speeds), {where}"
    return (f"model {model}{'-'.join(map(str, r['layers']))} ({r['params']:,} params), "
            f"{meta.get('optimizer', r.get('optimizer', 'sgd'))}, {r.get('precision', 'fp32')}\n{where}")


def _rate_interval(batch: int, step: dict) -> tuple:
    """samples/s at the median step and the error bar of the step's 95% interval, (below, above)."""
    rate = batch / step["median"]
    low_s, high_s = step["ci95"]
    slowest = batch / high_s if high_s > 0 else rate
    fastest = batch / low_s if low_s > 0 else rate
    return rate, (max(rate - slowest, 0.0), max(fastest - rate, 0.0))


def throughput_figure(rows: list, meta: dict):
    """samples/s against the global batch, one line per rank count with 95% bars; the PyTorch peer dashed."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, n in enumerate(sorted({r["ranks"] for r in rows})):
        cells = sorted((r for r in rows if r["ranks"] == n), key=lambda r: r["batch_size"])
        for who, key, style in (("mgpu", None, dict(marker="o", linestyle="-")),
                                ("PyTorch DDP", "torch", dict(marker="s", linestyle="--", mfc="white"))):
            pts = [(r["batch_size"], *_rate_interval(r["batch_size"], (r[key] if key else r)["step"]))
                   for r in cells if key is None or key in r]
            if not pts:
                continue
            batches, rates, bars = zip(*pts)
            ax.errorbar(batches, rates, yerr=np.array(bars).T, capsize=4, color=colors[i % len(colors)],
                        label=f"{who}, {n} rank{'s' if n > 1 else ''}", **style)
    batches = sorted({r["batch_size"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(batches))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(b) for b in batches])
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:,.0f}")
    ax.set(xlabel="global batch size (samples per step)", ylabel="samples/s (median step)")
    ax.set_title(f"Throughput; bars: 95% interval of the mean step time\n{_plot_subtitle(rows, meta)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def speedup_figure(rows: list, meta: dict):
    """Measured speedup against 1 rank per batch, the selector's predicted speedup dotted, and the ideal line."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ranks = sorted({r["ranks"] for r in rows})
    ax.plot(ranks, ranks, color="0.5", linestyle="--", label="ideal (linear)")
    predicted_any = False
    for i, b in enumerate(sorted({r["batch_size"] for r in rows})):
        cells = sorted((r for r in rows if r["batch_size"] == b and "speedup" in r), key=lambda r: r["ranks"])
        base = next((r for r in rows if r["batch_size"] == b and r["ranks"] == 1), None)
        if not cells or base is None:
            continue
        color = colors[i % len(colors)]
        _, (b_lo, b_hi) = _rate_interval(b, base["step"])
        base_rate = b / base["step"]["median"]
        bars = []
        for r in cells:  # the speedup's interval from both ends' intervals
            rate, (lo, hi) = _rate_interval(b, r["step"])
            bars.append((max(r["speedup"] - (rate - lo) / (base_rate + b_hi), 0.0),
                         max((rate + hi) / max(base_rate - b_lo, 1e-30) - r["speedup"], 0.0)))
        ax.errorbar([r["ranks"] for r in cells], [r["speedup"] for r in cells], yerr=np.array(bars).T, capsize=4,
                    marker="o", color=color, label=f"measured, batch {b}")
        pred = [(r["ranks"], r["predicted_speedup"]) for r in cells if r.get("predicted_speedup") is not None]
        if pred:
            predicted_any = True
            ax.plot(*zip(*pred), marker="x", linestyle=":", color=color, label=f"selector's prediction, batch {b}")
    if not predicted_any:
        ax.text(0.02, 0.97, "no prediction: give --profile or --validate-selector", transform=ax.transAxes,
                va="top", fontsize=8, color="0.4")
    ax.set_xticks(ranks)
    ax.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: (0, 0) if labels[i].startswith("ideal") else
                   (int(labels[i].rsplit(" ", 1)[-1]), "prediction" in labels[i]))  # per batch: measured, predicted
    ax.set(xlabel="ranks", ylabel="speedup over 1 rank (same global batch)")
    ax.set_title(f"Speedup over 1 rank; bars: 95% interval\n{_plot_subtitle(rows, meta)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=8)
    fig.tight_layout()
    return fig


def breakdown_figure(rows: list, meta: dict):
    """Each cell's median step split into forward, backward, exposed allreduce and optimizer, beside
    the measured step and the compute floor."""
    import matplotlib.pyplot as plt
    cells = sorted(rows, key=lambda r: (r["batch_size"], r["ranks"]))
    fig, ax = plt.subplots(figsize=(max(7.5, 2.0 + len(cells) * 1.25), 5.4))
    x = np.arange(len(cells))
    bottom = np.zeros(len(cells))
    for k, name in (("forward", "forward"), ("backward", "backward"), ("comm_wait", "allreduce (exposed)"),
                    ("optimizer", "optimizer")):
        vals = np.array([r["breakdown_ms"][k] for r in cells])
        ax.bar(x, vals, bottom=bottom, width=0.6, label=name)
        bottom += vals
    ax.hlines([r["step"]["median"] * 1e3 for r in cells], x - 0.4, x + 0.4, color="black", linewidth=2, zorder=3,
              label="measured step (median)")
    ax.hlines([r["compute_floor_ms"] for r in cells], x - 0.4, x + 0.4, color="red", linewidth=1.5,
              linestyles="--", zorder=3, label="compute floor (GEMMs at the measured rate)")
    ax.set_xticks(x, [f"batch {r['batch_size']}\n{r['ranks']} rank{'s' if r['ranks'] > 1 else ''}" for r in cells])
    ax.set(ylabel="ms per step (median of each phase)")
    ax.set_title(f"Step breakdown\n{_plot_subtitle(rows, meta)}", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
    fig.tight_layout()
    return fig


def write_plots(directory: str, rows: list, meta: Optional[dict] = None) -> list:
    """throughput_vs_batch.png, speedup_vs_ranks.png and breakdown.png; `meta` (the result
    dict: model, host, optimizer, emulation) labels them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, make in (("throughput_vs_batch", throughput_figure), ("speedup_vs_ranks", speedup_figure),
                       ("breakdown", breakdown_figure)):
        fig = make(rows, meta or {})
        paths.append(os.path.join(directory, f"{name}.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


MAX_RANKS_PER_CORE = 16  # --ranks launched on this machine: oversubscribed beyond what measures anything


def cmd_bench(a, pg) -> int:
    from .cliutil import check_output_dir, check_outputs, write_json_atomic
    from . import perf
    for name in ("warmup", "steps", "repeats"):
        if getattr(a, name) < (0 if name == "warmup" else 1):
            raise ConfigError(f"--{name} must be >= {0 if name == 'warmup' else 1}, got {getattr(a, name)}")
    if any(b < 1 for b in a.batch_sizes):
        raise ConfigError(f"batch sizes must be >= 1, got {a.batch_sizes}")
    # Several thread counts are several launches, as several rank counts are; one is this run's.
    a.thread_counts = a.threads or [None]
    a.threads = a.thread_counts[0]
    several_threads = len(a.thread_counts) > 1
    if a.ranks and pg.size > 1 and a.ranks != [pg.size]:  # this world is measured as it is
        raise ConfigError(f"--ranks launches mpirun once per rank count: run bench from one process, not under "
                          f"mpirun (this world has {pg.size} ranks; --ranks {','.join(map(str, a.ranks))})")
    if several_threads:
        if pg.size > 1:
            raise ConfigError("several --threads values are launched one process group each: run bench from one "
                              "process (with --ranks N for N ranks), not under mpirun")
        if pg.resolve_device(a.device)[0] != "cpu":
            raise ConfigError("several --threads values compare CPU thread counts; this run's device is a GPU "
                              "(use --device cpu)")
        for given, what in ((a.validate_selector, "--validate-selector"), (a.plots, "--plots"),
                            (a.observe, "--observe"), (a.explain, "--explain")):
            if given:
                raise ConfigError(f"{what} takes one thread count per rank; several were given "
                                  f"(--threads {','.join(map(str, a.thread_counts))})")
    if a.precision != "fp32" and a.device == "cpu":
        raise ConfigError(f"--precision {a.precision} needs a GPU; the CPU backend computes in fp32")
    if a.accumulate < 1:
        raise ConfigError(f"--accumulate must be >= 1, got {a.accumulate}")
    if a.compare == "torch" and (a.accumulate != 1 or a.grad_dtype != "fp32"):
        raise ConfigError("--compare torch runs the peer without accumulation and with fp32 gradients: "
                          "leave --accumulate and --grad-dtype at their defaults")
    if a.layers is not None and (len(a.layers) < 2 or min(a.layers) < 1):
        raise ConfigError(f"layers must be at least two positive sizes, got {a.layers}")
    if a.ranks:
        limit = MAX_RANKS_PER_CORE * (os.cpu_count() or 1)
        if not a.explain and max(a.ranks) > limit:  # launched here, each rank a process of this machine
            raise ConfigError(f"--ranks {max(a.ranks)}: bench launches every rank on this machine, at most "
                              f"{limit} ({MAX_RANKS_PER_CORE} per core of {os.cpu_count() or 1}); more ranks "
                              "take more machines: mpirun --hostfile FILE python -m mgpu bench")
        if max(a.ranks) > min(a.batch_sizes):  # launched or priced (--explain)
            raise ConfigError(f"batch {min(a.batch_sizes)} is smaller than {max(a.ranks)} ranks: every rank "
                              "needs a sample")
    check_outputs({"--json": a.json, "--csv": a.csv}, {"--profile": a.profile})
    if a.explain:
        return explain_step(a, pg)
    if a.observe:
        from .observe import import_summary_writer
        import_summary_writer()  # --observe times the TensorBoard writer too
    if a.plots is not None:
        check_output_dir(a.plots, "--plots")
    if a.worker_out:  # launched by a driver: measure this world, hand the rows back
        rows = run_worker(pg, a)
        if pg.is_root:
            write_json_atomic(a.worker_out, rows)
        return 0
    # the device this run measures, where a check needs it (resolving it may refuse the run)
    device = pg.resolve_device(a.device)[0] if a.validate_selector or a.compare == "torch" else None
    profile = None
    if a.validate_selector or a.profile:
        profile = perf.resolve_profile(a.profile or "calibrated", max(a.ranks or [pg.size]))
        if profile is None:
            raise ConfigError("--validate-selector needs a calibration: run `python -m mgpu topo` under mpirun first")
        mismatch = perf.emulation_mismatch(profile, device) if a.validate_selector else None
        if mismatch:
            raise ConfigError(f"--validate-selector: {mismatch}")
    if a.compare == "torch" and pg.size > 1:
        raise ConfigError("--compare torch alternates launches of mgpu and PyTorch: run it from one process "
                          "with --ranks N instead of under mpirun")
    py = None
    if a.compare == "torch":
        if gpus_emulated(device):
            raise ConfigError("--compare torch: PyTorch cannot run on the GPU emulation's GPUs (the CPU running "
                              "mgpu's CUDA code); compare on real GPUs, or on the CPU with --device cpu")
        py = torch_python()
        if py is None:
            raise ConfigError("--compare torch: no interpreter here can import torch "
                              "(pip install torch, or apt-get install python3-torch)")
    # With the peer, or several rank counts to compare: one repeat per round, the sides
    # alternating, in reverse order every other round (1 2, 2 1, ...) so neither side
    # always runs first. --observe interleaves its own off/on rounds inside a launch.
    alternate = py is not None or (pg.size == 1 and not a.observe and (
        (a.ranks is not None and len(a.ranks) > 1) or several_threads))
    rounds = []
    for i in range(a.repeats if alternate else 1):
        rows = measure_world(pg, a, repeats=1 if alternate else a.repeats, reverse=alternate and i % 2 == 1)
        if alternate:  # merged cell by cell: the same order in every round
            rows.sort(key=lambda r: (r["batch_size"], r["ranks"], r["threads"]))
        if pg.is_root and py:
            for r in rows:
                r["torch"] = run_torch(py, r["ranks"], r["layers"], r["dropout"], r["batch_size"], a,
                                       r["device"], r["threads"])
        rounds.append(rows)
    if not pg.is_root:
        return 0
    rows = merge_rounds(rounds) if alternate else rounds[0]
    for r in rows:
        r["optimizer"] = a.optimizer
    add_derived(rows, profile, thread_scaling=several_threads)
    print(format_table(rows))
    for r in rows:
        t = r.get("torch_ratio")
        if t:
            print(f"mgpu / PyTorch {r['torch']['version']}, batch {r['batch_size']} x {r['ranks']} rank(s)"
                  + (f" x {r['threads']} thread(s)" if several_threads else "") + ": "
                  f"{t['median']:.2f}x median of {len(t['rounds'])} alternating rounds "
                  f"(range {t['min']:.2f}-{t['max']:.2f}x)")
    return report(a, pg, rows, profile)


def measure_world(pg, a, repeats: int, reverse: bool = False) -> list:
    """mgpu's rows: this world in-process, or one mpirun launch per --ranks count and
    --threads count (in reverse order with `reverse`)."""
    if pg.size > 1 or (not a.ranks and len(a.thread_counts) == 1):
        return run_worker(pg, a, repeats)
    if shutil.which("mpirun") is None:
        raise ConfigError("--ranks and several --threads are launched with mpirun: it is not on PATH")
    passthrough = [f"--batch-sizes={','.join(map(str, a.batch_sizes))}", f"--warmup={a.warmup}",
                   f"--steps={a.steps}", f"--repeats={repeats}", f"--optimizer={a.optimizer}",
                   f"--device={a.device}", f"--precision={a.precision}", f"--cuda-graph={a.cuda_graph}",
                   f"--accumulate={a.accumulate}", f"--grad-dtype={a.grad_dtype}", "--no-progress"]
    passthrough += ["--observe"] if a.observe else []
    passthrough += [f"--layers={','.join(map(str, a.layers))}"] if a.layers else [f"--model={a.model or 'large'}"]
    if a.dropout is not None:
        passthrough.append(f"--dropout={a.dropout}")
    cells = [(n, t) for n in (a.ranks or [1]) for t in a.thread_counts]
    rows = []
    for n, t in (list(reversed(cells)) if reverse else cells):
        threads = f" x {t} thread(s)" if t else ""
        if not a.no_progress:
            print(f"bench: {n} rank(s){threads}...", file=sys.stderr, flush=True)
        rows += _launch(n, passthrough + ([f"--threads={t}"] if t else []), _mpi_env(), threads)
    return rows


def report(a, pg, rows: list, profile) -> int:
    """Rank 0: the counters, the observability overhead, validation, JSON, CSV and plots."""
    from .cliutil import write_json_atomic
    for r in rows:
        c = r.get("emulation_counters_per_step")
        if c:
            print(f"emulated GPU, batch {r['batch_size']} x {r['ranks']} rank(s), per step: "
                  f"{c['kernel_launches']:g} kernel launches, {c['graph_launches']:g} graph launches, "
                  f"{c['kernels_executed']:g} kernels run, {c['host_syncs']:g} host syncs, "
                  f"{c['allocations']:g} allocations, {c['h2d_bytes']:,.0f} B to and {c['d2h_bytes']:,.0f} B "
                  f"from the device ({c.get('pageable_h2d_copies', 0):g} from pageable memory), "
                  f"{c['collectives']:g} collectives")
    for r in rows:
        o = r.get("observe_overhead")
        if o:
            spread = {k: f"{min(v):.2f}-{max(v):.2f}" for k, v in o["round_medians_ms"].items()}
            print(f"observe overhead, batch {r['batch_size']} x {r['ranks']} rank(s): {o['overhead_pct']:+.2f} % "
                  f"(median step {o['off']['median'] * 1e3:.2f} ms off, {o['on']['median'] * 1e3:.2f} ms with "
                  f"--trace, --log-json, --tensorboard and the straggler check; round medians {spread['off']} ms "
                  f"off, {spread['on']} ms on, {len(o['round_medians_ms']['off'])} interleaved rounds each; "
                  f"paired rounds median {np.median(o['paired_round_pct']):+.2f} %, "
                  f"{min(o['paired_round_pct']):+.2f} to {max(o['paired_round_pct']):+.2f} %); the observer's own "
                  f"time {o['observer_ms_per_step']['mean']:.3f} ms/step on average "
                  f"({o['observer_pct_of_step']:.3f} % of the step; max {o['observer_ms_per_step']['max']:.2f} ms)")
    result = {"version": __version__, "host": socket.gethostname(), "model": a.model, "layers": rows[0]["layers"],
              "optimizer": a.optimizer, "precision": a.precision, "warmup": a.warmup, "steps": a.steps, "repeats": a.repeats,
              "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
              "gpu_emulation": gpus_emulated(rows[0]["device"]),
              "rows": rows}
    if a.validate_selector:
        result["validation"] = validate_selector(rows, profile, a)
        print(format_validation(result["validation"]))
    if a.json:
        write_json_atomic(a.json, result)
    if a.csv:
        write_csv(a.csv, rows)
    if a.plots:
        for path in write_plots(a.plots, rows, result):
            print(f"plot written to {path}")
    return 0


def explain_step(a, pg) -> int:
    """--explain: the analytic cost sheet of the CUDA step (costsheet.py) for each batch
    size and rank count; prints and writes it, runs nothing."""
    from .cliutil import write_json_atomic
    from . import costsheet
    if a.device == "cpu":
        raise ConfigError("--explain prices the CUDA step on a GPU's published figures: use --device cuda")
    if a.compare or a.validate_selector or a.plots or a.csv or a.observe:
        raise ConfigError("--explain runs nothing: --compare, --validate-selector, --observe, --plots and --csv "
                          "do not apply")
    if a.grad_dtype != "fp32":
        raise ConfigError("--explain prices one GPU's step; --grad-dtype changes only the allreduce "
                          "(see `mgpu recommend --grad-dtype`)")
    sizes, dropout = resolve_layers(a.model, a.layers)
    sheets = []
    for ranks in a.ranks or [1]:
        for batch in a.batch_sizes:  # cmd_bench saw that every rank has a sample
            w = costsheet.Workload(sizes=list(sizes), batch=batch, precision=a.precision, optimizer=a.optimizer,
                                   dropout=a.dropout if a.dropout is not None else dropout,
                                   accumulate=a.accumulate, ranks=ranks)
            w.graph = costsheet.uses_graph(a.cuda_graph, w.params)
            sheets.append(costsheet.explain(w, costsheet.GPUS[a.gpu]))
    # What a GPU holds, as the selector prices it (the sheet prices time only).
    from .perf import gpu_step_memory
    memory = [gpu_step_memory(a.gpu, s.workload.sizes, s.workload.batch, s.workload.ranks,
                              optimizer=s.workload.optimizer, precision=s.workload.precision,
                              dropout=s.workload.dropout, accumulate=s.workload.accumulate) for s in sheets]
    if pg.is_root:
        for sheet, mem in zip(sheets, memory):
            print(costsheet.format_sheet(sheet))
            print(f"  memory: {mem['bytes'] / 1e9:.2f} GB a GPU of {mem['usable_bytes'] / 1e9:.0f} GB usable"
                  + ("" if mem["fits"] else ": DOES NOT FIT (fewer rows a GPU, bf16, or SGD instead of AdamW)"))
            if sheet.workload.ranks > 1:
                print("  (per GPU, without the gradient allreduce: `mgpu recommend` models it)")
        print("sources: " + "; ".join(costsheet.GPUS[a.gpu].sources))
        if a.json:
            write_json_atomic(a.json, {"version": __version__,
                                       "cost_sheets": [{**s.as_dict(), "memory": m} for s, m in zip(sheets, memory)]})
    return 0


def add_parser(sub) -> None:
    from .cliutil import MAX_THREADS, int_list
    b = sub.add_parser("bench", help="training throughput by batch and ranks, with floors and the PyTorch peer",
                       description=__doc__.splitlines()[0])
    m = b.add_mutually_exclusive_group()
    m.add_argument("--model", choices=sorted(PRESETS), default=None, help="model preset (default: large)")
    m.add_argument("--layers", type=int_list("layer sizes"), help="in,h1,...,out")
    b.add_argument("--batch-sizes", type=int_list("batch sizes", distinct=True), default=[1024],
                   help="global batch sizes, each once (default 1024)")
    b.add_argument("--ranks", type=int_list("rank counts", distinct=True), default=None,
                   help="rank counts to launch with mpirun, several in alternating rounds (default: this world)")
    b.add_argument("--warmup", type=int, default=10)
    b.add_argument("--steps", type=int, default=100)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    b.add_argument("--dropout", type=float, default=None, help="default: the preset's")
    b.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    b.add_argument("--threads", type=int_list("thread counts", distinct=True, maximum=MAX_THREADS), default=None,
                   help="CPU threads per rank; several (e.g. 1,2) are launched in alternating rounds like --ranks")
    b.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="GEMM precision (GPUs): fp32, tf32, bf16, fp16; the PyTorch peer uses the same")
    b.add_argument("--cuda-graph", choices=GRAPH_MODES, default="auto",
                   help="replay steps as CUDA graphs: auto (small models on GPUs), on, off")
    b.add_argument("--accumulate", type=int, default=1,
                   help="micro-batches per step: each rank's share of the batch in K parts (default 1)")
    b.add_argument("--grad-dtype", choices=GRAD_DTYPES, default="fp32",
                   help="type the gradients are allreduced in (bf16/fp16: NCCL between GPUs)")
    b.add_argument("--compare", choices=("torch",), default=None, help="run the same workload in PyTorch (DDP)")
    b.add_argument("--validate-selector", action="store_true",
                   help="predicted vs measured speedup per cell (needs `mgpu topo` first)")
    b.add_argument("--profile", default=None, help="hardware profile for the floors and predictions")
    b.add_argument("--explain", action="store_true",
                   help="print the analytic cost sheet of the CUDA step (FLOPs, bytes, launches priced on "
                        "--gpu's published figures) and the floor 6 x params x rows a GPU / GEMM rate; runs nothing")
    b.add_argument("--gpu", choices=("h100-sxm",), default="h100-sxm", help="the GPU --explain prices on")
    b.add_argument("--observe", action="store_true",
                   help="also time steps with train's --trace, --log-json, --tensorboard and straggler check on, "
                        "in rounds interleaved with plain ones, and report the overhead")
    b.add_argument("--json", metavar="PATH")
    b.add_argument("--csv", metavar="PATH")
    b.add_argument("--plots", metavar="DIR", help="write PNG plots here")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--worker-out", help=argparse_suppress())


def argparse_suppress():
    import argparse
    return argparse.SUPPRESS
