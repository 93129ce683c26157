"""bench's measuring harness: a cell's steps timed on this world (warm-up excluded,
outliers dropped, median and 95% confidence interval, the core's phase timers), the
compute floor, launches of other rank and thread counts and of the PyTorch peer under
mpirun, rounds merged, and the selector's predictions set beside the measurements.
`mgpu bench` (commands/bench.py) drives it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

import numpy as np

from .._runtime import _core, for_other_frameworks, gpus_emulated
from ..errors import ConfigError, DeviceError
from ..hostinfo import placement_moved
from ..selector import history, profiles
from ..selector.memory import check_training_memory
from ..selector.recommend import recommend
from ..selector.run_check import PHASES, check_run, priced_fields
from ..selector.workload import build_workload
from ..train.config import PRESETS, TrainerConfig
from ..train.data import local_slice, resident_bytes
from ..train.model import MLP
from ..train.observe import Observer
from ..train.trainer import Trainer

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
    return {
        "median": float(np.median(keep)),
        "mean": mean,
        "ci95": [max(0.0, mean - half), mean + half],
        "n": n,
        "outliers": int(len(x) - n),
    }


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


def measure(
    pg,
    sizes,
    dropout: float,
    batch: int,
    *,
    optimizer: str,
    warmup: int,
    steps: int,
    repeats: int,
    device: str,
    device_index: int,
    threads: int,
    precision: str = "fp32",
    graph: str = "auto",
    accumulate: int = 1,
    grad_dtype: str = "fp32",
    shard_optimizer: bool = False,
    observe: bool = False,
    data_on_device: str = "auto",
) -> dict:
    """Collective: time `repeats` x `steps` training steps at global batch `batch` on this world
    (each rank's share in `accumulate` micro-batches; gradients allreduced in `grad_dtype`;
    shard_optimizer: ZeRO-1, each rank updating its shard of the parameters; data_on_device:
    the steps' rows resident on the device and gathered there, as `train` places a training
    set: auto on GPUs, where the PyTorch peer keeps its inputs too).
    observe: also time as many steps with every `train` observability output on, in rounds
    interleaved with the plain ones (off, on, on, off, ...: drift falls on both alike)."""
    model = MLP(
        sizes, seed=0, dropout=dropout, device=device, device_index=device_index, threads=threads, precision=precision
    )
    settings = TrainerConfig(
        loss="mse",
        optimizer=optimizer,
        lr=1e-3,
        momentum=0.9,
        timed=True,
        graph=graph,
        accumulate=accumulate,
        grad_dtype=grad_dtype,
        shard_optimizer=shard_optimizer,
    )
    trainer = Trainer(model, settings, pg)
    part = local_slice(batch, pg.rank, pg.size)
    rng = np.random.default_rng(pg.rank)
    rows = part.stop - part.start
    data = [
        (
            rng.standard_normal((rows, sizes[0]), dtype=np.float32),
            rng.standard_normal((rows, sizes[-1]), dtype=np.float32),
        )
        for _ in range(4)
    ]
    error, feed = None, None
    try:  # a rank's device memory is its own: agreed before the steps' collectives
        feed = _feeder(trainer, data, batch, part.start, resident=holds_batches(data_on_device, device))
    except (ConfigError, DeviceError, MemoryError) as e:
        error = e
    pg.agree(error, what="holding the batches on the device")
    for i in range(warmup):
        feed(i)
    times, phases = [], {"forward": [], "backward": [], "comm_wait": [], "optimizer": []}
    observer, scratch, observed, rounds, own = None, None, [], {"off": [], "on": []}, []
    if observe:
        scratch = tempfile.mkdtemp(prefix="mgpu-bench-observe-")
        observer = Observer(
            pg,
            trace=os.path.join(scratch, "trace.json"),
            trace_steps=(0, None),
            log_json=os.path.join(scratch, "log.jsonl"),
            tensorboard=os.path.join(scratch, "tb"),
            straggler_threshold=0.25,
            device_clock=device == "cuda",
        )
        observer.start(trainer)
    for r in range(repeats):
        for on in ((False, True) if r % 2 == 0 else (True, False)) if observe else (False,):
            pg.barrier()
            mine = observed if on else times
            first = len(mine)
            for i in range(steps):
                t0 = time.perf_counter()
                feed(i, trace=on)
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
        overhead = {
            "off": summarize(times),
            "on": summarize(observed),
            "overhead_pct": (on / off - 1) * 100,
            "paired_round_pct": paired,
            "round_medians_ms": {k: [v * 1e3 for v in vs] for k, vs in rounds.items()},
            "observer_ms_per_step": {
                "median": float(np.median(own)) * 1e3,
                "mean": float(np.mean(own)) * 1e3,
                "max": float(np.max(own)) * 1e3,
            },
            "observer_pct_of_step": float(np.mean(own)) / off * 100,
        }
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    if device == "cuda":
        free, total = _core.cuda_memory_info(device_index)
        peak = float(total - free)
    peak = pg.allreduce(peak, op="max")
    stats = summarize(times)
    counted = (
        count_emulated_work(model, trainer, pg, data, batch, part.start, feed.resident)
        if gpus_emulated(device)
        else None
    )
    return {
        "emulation_counters_per_step": counted,
        "observe_overhead": overhead,
        "batch_size": batch,
        "ranks": pg.size,
        "threads": threads,
        "device": device,
        "step": stats,
        "samples_per_sec": batch / stats["median"],
        "step_seconds": times,
        "breakdown_ms": {k: float(np.median(v)) * 1e3 for k, v in phases.items()},
        "peak_memory_bytes": peak,
        "params": model.num_params,
        "overlap": trainer._step.overlaps,
        "precision": precision,
        "accumulate": accumulate,
        "grad_dtype": grad_dtype,
        "shard_optimizer": trainer.shards_optimizer,
        # the most any rank holds (the optimizer's states times the values each holds)
        "optimizer_state_bytes": pg.allreduce(
            4.0 * trainer.optimizer_state_elements * len(trainer.optimizer_state_names), op="max"
        ),
        "cuda_graph": trainer._step.uses_graphs,
        "graph_fallback": trainer._step.graph_fallback or None,
        "data_on_device": feed.resident,
    }


def holds_batches(data_on_device: str, device: str) -> bool:
    """Whether bench holds its batches in the device's memory, as train places a training set."""
    return data_on_device == "on" or (data_on_device == "auto" and device == "cuda")


def _feeder(trainer, data: list, batch: int, first_sample: int, resident: bool):
    """feed(i, trace=False): step i on this rank's batch i % len(data), as Trainer.fit feeds
    steps: gathered from the batches held on the device (resident, copied there once); on a
    GPU otherwise copied in while the step before computes (its prefetch); on a CPU, read
    where they lie."""
    if not resident and trainer.model.device == "cuda":
        rows, ready = len(data[0][0]), [False]

        def feed(i: int, trace: bool = False) -> float:
            shard = dict(global_batch=batch, first_sample=first_sample, trace=trace, prefetch=data[(i + 1) % len(data)])
            loss = trainer.step_prefetched(rows, **shard) if ready[0] else trainer.step(*data[i % len(data)], **shard)
            ready[0] = True
            return loss

    elif resident:
        held = trainer.resident_data(np.concatenate([x for x, _ in data]), np.concatenate([y for _, y in data]))
        held.set_order(np.arange(held.rows))
        rows = len(data[0][0])

        def feed(i: int, trace: bool = False) -> float:
            return trainer.step_rows(
                held, (i % len(data)) * rows, rows, global_batch=batch, first_sample=first_sample, trace=trace
            )

    else:

        def feed(i: int, trace: bool = False) -> float:
            return trainer.step(*data[i % len(data)], global_batch=batch, first_sample=first_sample, trace=trace)

    feed.resident = resident
    return feed


def count_emulated_work(
    model, timed_trainer, pg, data, batch: int, first_sample: int, resident: bool, steps: int = 3
) -> dict:
    """On the GPU emulation: the CUDA work of one steady-state step (kernel and graph
    launches, host synchronisations, allocations, bytes each way), averaged over `steps`
    steps of an untimed trainer (the timed one adds a synchronisation per phase)."""
    graph = "on" if timed_trainer._step.uses_graphs else "off"
    trainer = Trainer(model, dataclasses.replace(timed_trainer.config, timed=False, graph=graph), pg)
    feed = _feeder(trainer, data, batch, first_sample, resident)
    for i in range(2):  # first appearance and capture of the shape
        feed(i)
    model._backend.synchronize()
    before = _core.emulation.counters()
    for i in range(steps):
        feed(i)
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
            local = -(-batch // pg.size)
            held = (
                resident_bytes(4 * local, sizes[0], sizes[-1], False) if holds_batches(a.data_on_device, device) else 0
            )
            check_training_memory(
                sizes,
                max(1, -(-batch // (pg.size * a.accumulate))),
                resident_bytes=held,  # the four batches a rank steps through
                optimizer=a.optimizer,
                precision=a.precision,
                dropout=dropout,
                device=device,
                device_index=device_index,
                local_ranks=pg.local_size,
                nccl=device == "cuda" and pg.size > 1,
                # bench trains at the Trainer's default bucket
                mpi_bucket_bytes=4 * 2**20 if device != "cuda" and pg.size > 1 else 0.0,
                optimizer_shards=pg.size if a.shard_optimizer else 1,
                world_ranks=pg.size,
            )
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
        row = measure(
            pg,
            sizes,
            dropout,
            batch,
            optimizer=a.optimizer,
            warmup=a.warmup,
            steps=a.steps,
            repeats=repeats or a.repeats,
            device=device,
            device_index=device_index,
            threads=threads,
            precision=a.precision,
            graph=a.cuda_graph,
            accumulate=a.accumulate,
            grad_dtype=a.grad_dtype,
            shard_optimizer=a.shard_optimizer,
            observe=a.observe,
            data_on_device=a.data_on_device,
        )
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
    cmd = [
        "mpirun",
        "-np",
        str(ranks),
        "--oversubscribe",
        "--bind-to",
        "none",
        sys.executable,
        "-m",
        "mgpu",
        "bench",
        *args,
        "--worker-out",
        out,
    ]
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
_MPIRUN_LINE = re.compile(
    r"^(Primary job|mpirun |prterun |Process name:|Exit code:|a non-zero exit|"
    r"the job to be terminated|thus causing|Per user-direction|The first process to do so|"
    r"We reiterate|\[[\w.-]+:\d+\])"
)


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
    cmd = [
        "mpirun",
        "-np",
        str(ranks),
        "--oversubscribe",
        "--bind-to",
        "none",
        py,
        PEER,
        "--layers",
        ",".join(map(str, sizes)),
        "--dropout",
        str(dropout),
        "--batch-size",
        str(batch),
        "--optimizer",
        a.optimizer,
        "--warmup",
        str(a.warmup),
        "--steps",
        str(a.steps),
        "--repeats",
        "1",
        "--threads",
        str(threads),
        "--device",
        device,
        "--precision",
        a.precision,
        "--port",
        str(29500 + (os.getpid() + ranks + batch) % 400),
    ] + (["--shard-optimizer"] if a.shard_optimizer else [])
    limit = 120 + 10 * (a.warmup + a.steps)  # generous: a hung peer must not hang the benchmark
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=_mpi_env(peer=True), timeout=limit)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"the PyTorch peer did not finish within {limit} s at {ranks} rank(s)") from None
    if r.returncode != 0:
        raise ConfigError(f"the PyTorch peer failed at {ranks} rank(s): {peer_error(r.stderr)}")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    # A fair ratio needs the same workload on both sides (a peer without the preset's
    # dropout runs 1.6x faster on medium b64 here: docs/benchmarks.md).
    asked = {
        "layers": list(sizes),
        "dropout": float(dropout),
        "batch_size": batch,
        "optimizer": a.optimizer,
        "threads": threads,
        "shard_optimizer": bool(a.shard_optimizer) and ranks > 1,
    }
    ran = result.get("workload", {})
    if any(ran.get(k) != v for k, v in asked.items()):
        raise ConfigError(f"the PyTorch peer ran another workload than mgpu: asked {asked}, ran {ran}")
    stats = summarize(result["step_seconds"])
    return {
        "version": result["version"],
        "workload": result["workload"],
        "step": stats,
        "samples_per_sec": batch / stats["median"],
        "step_seconds": result["step_seconds"],
    }


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
        if all(
            "core_round_trip_ns" in c and c["core_round_trip_cpus"] == cells[0]["core_round_trip_cpus"] for c in cells
        ):
            row["core_round_trip_ns"] = [t for c in cells for t in c["core_round_trip_ns"]]
        else:  # a round without readings (or of other CPUs): the cell's placement is unknown
            row.pop("core_round_trip_ns", None)
            row.pop("core_round_trip_cpus", None)
        if "torch" in row:
            peer = [t for c in cells for t in c["torch"]["step_seconds"]]
            stats = summarize(peer)
            row["torch"] = {
                "version": row["torch"]["version"],
                "workload": row["torch"]["workload"],
                "step": stats,
                "step_seconds": peer,
                "samples_per_sec": row["batch_size"] / stats["median"],
            }
            ratios = [float(np.median(c["torch"]["step_seconds"]) / np.median(c["step_seconds"])) for c in cells]
            row["torch_ratio"] = {
                "median": float(np.median(ratios)),
                "min": min(ratios),
                "max": max(ratios),
                "rounds": ratios,
            }
        merged.append(row)
    return merged


def _predict(row: dict, profile: dict):
    """The model's prediction of a row as it ran: its precision, whether its steps replayed
    graphs, the batch split evenly (as the benchmark splits it)."""
    w = build_workload(
        None,
        row["layers"],
        None,
        row["batch_size"],
        row.get("precision", "fp32"),
        row.get("optimizer", "sgd"),
        4.0,
        row.get("dropout", 0.0),
        row.get("grad_dtype", "fp32"),
        "on" if row.get("cuda_graph") else "off",
        int(row.get("accumulate", 1)),
        shard_optimizer=bool(row.get("shard_optimizer")),
        data_on_device=bool(row.get("data_on_device")),  # rows from before the option were copied in
    )
    options = profiles.P.Options()
    options.equal_shares = True
    return profiles.P.predict(w, profiles.to_core(profile, row["ranks"]), row["ranks"], options)


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
            differs = _cannot_price(r, profile)
            if differs:
                r["prediction_error"] = differs
                r["prediction"] = {"available": False, "reason": differs}
                continue
            try:
                p = _predict(r, profile)
                r["allreduce_floor_ms"] = p.comm_s * 1e3
                r["predicted_step_ms"] = p.step_s * 1e3
                r["predicted_speedup"] = p.speedup
                # central 80 % intervals, and whether the measured median fell in the step's
                r["predicted_step_interval_ms"] = [p.step_low_s * 1e3, p.step_high_s * 1e3]
                r["predicted_speedup_interval"] = [p.speedup_low, p.speedup_high]
                r["inside_interval"] = p.step_low_s <= r["step"]["median"] <= p.step_high_s
                # the phases as the core's timers split them (the model's exposed allreduce is
                # the wait after backward: allreduce, skew, health check)
                r["predicted_breakdown_ms"] = {
                    "forward": p.forward_s * 1e3,
                    "backward": p.backward_s * 1e3,
                    "comm_wait": p.exposed_comm_s * 1e3,
                    "optimizer": p.optimizer_s * 1e3,
                }
                r["prediction"] = _cell_check(r, profile, p)
            except ConfigError as e:
                r["prediction_error"] = str(e)
                r["prediction"] = {"available": False, "reason": str(e)}


def _cell_check(row: dict, profile: dict, p) -> dict:
    """A priced cell's prediction held against its measured step, as train holds its own
    (run_check.check_run: the same fields, and the warning naming the phase that differs
    most); bench times every phase."""
    prediction = {
        "available": True,
        "ranks": row["ranks"],
        "profile": profile.get("name", "?"),
        "profile_source": profile.get("source", "named"),
        "gpu_emulation": gpus_emulated(row["device"]),
        **priced_fields(p),
    }
    measured = {"step": row["step"]["median"], "steps": len(row.get("step_seconds") or [])}
    measured |= {name: row["breakdown_ms"][name] / 1e3 for name, _ in PHASES}
    check = check_run(prediction, measured, phases_timed=True)
    seen = {"round_trip_ns": row.get("core_round_trip_ns"), "round_trip_cpus": row.get("core_round_trip_cpus")}
    placement = profiles.checked_placement(profile)
    if check.get("warning") and history.placed_elsewhere(seen, placement):  # the likeliest cause on a VM
        probed = placement["wait_probe_ns"]
        check["warning"] += (
            f"; the ranks' cores sat elsewhere than where `topo` probed the wait (a cache line's round trip "
            f"{min(seen['round_trip_ns']):.0f}-{max(seen['round_trip_ns']):.0f} ns, topo's "
            f"{min(probed):.0f}-{max(probed):.0f}): a VM's hypervisor moves them, and the wait with them"
        )
    return check


def _cannot_price(row: dict, profile: dict) -> Optional[str]:
    """Why a row cannot be priced from `profile`, or None: its devices of another kind (a
    GPU profile says nothing of CPU ranks, nor the reverse), or a CPU calibration of
    another thread count."""
    kinds = profiles.calibrated_kinds(profile, row["ranks"])
    if kinds and kinds != [row.get("device", "cpu")]:
        return f"the profile describes {'/'.join(kinds)} devices, this cell ran on {row.get('device', 'cpu')}"
    calibrated = (profile.get("environment") or {}).get("threads_per_rank")
    if row.get("device") != "cpu" or not calibrated or row["threads"] == calibrated:
        return None
    return f"calibrated at {calibrated} thread(s) per rank, measured at {row['threads']} (bench --threads {calibrated})"


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
    placement = profiles.checked_placement(profile) or {}
    measured = cell.get("core_round_trip_ns")
    if not measured or not placement or cell.get("core_round_trip_cpus") != placement.get("cpus"):
        return {"placement_as_calibrated": None}
    first, second = placement["wait_probe_ns"], placement.get("other_wait_probe_ns")
    out = {
        "core_round_trip_ns": measured,
        "calibrated_round_trip_ns": first,
        "placement_as_calibrated": not placement_moved(measured + first),
        "placement_as_second_probe": bool(second) and not placement_moved(measured + second),
        "by_placement": [],
    }
    pairs = [measured[i : i + 2] for i in range(0, len(measured), 2)]
    rounds = cell.get("speedup_rounds") or []
    for name, probed in (("first", first), ("second", second)):
        here = [s for s, pair in zip(rounds, pairs) if probed and not placement_moved(pair + probed)]
        if here:
            measured_speedup = float(np.median(here))
            predicted = _predict(cell, profiles.placement_profile(profile, name)).speedup
            out["by_placement"].append(
                {
                    "probe": name,
                    "calibrated_round_trip_ns": probed,
                    "rounds": len(here),
                    "measured_speedup": measured_speedup,
                    "predicted_speedup": predicted,
                    "relative_error": (predicted - measured_speedup) / measured_speedup,
                }
            )
    return out


def validate_selector(rows: list, profile: dict, a) -> list:
    """Per batch: measured vs predicted speedup per rank count, and whether the selector's pick was the faster."""
    out = []
    ranks = sorted({r["ranks"] for r in rows})
    for batch in sorted({r["batch_size"] for r in rows}):
        cells = {r["ranks"]: r for r in rows if r["batch_size"] == batch}
        rec = recommend(
            layers=cells[ranks[0]]["layers"],
            batch_size=batch,
            devices=ranks,
            profile=profile,
            optimizer=a.optimizer,
            dropout=cells[ranks[0]].get("dropout", 0.0),
            bucket_mb=4.0,  # the bucket bench trains with (Trainer's default)
            precision=a.precision,
            grad_dtype=a.grad_dtype,
            cuda_graph=_graph_mode_used(cells, a),
            accumulate=a.accumulate,
            shard_optimizer=a.shard_optimizer,
            data_on_device=bool(cells[ranks[0]].get("data_on_device")),  # as the cells ran
        )
        # by the same measure as the speedup printed (paired rounds when alternated)
        measure = "speedup" if all("speedup" in c for c in cells.values()) else "samples_per_sec"
        fastest = max(cells.values(), key=lambda r: r[measure])["ranks"]
        # a speedup is priced only where the cell and its base were: none is scored against the other
        unpriced = next((c["prediction_error"] for c in cells.values() if c.get("prediction_error")), None)
        for n in ranks:
            c = cells[n]
            if n == 1 or "speedup" not in c:
                continue
            priced = "predicted_speedup" in c and unpriced is None
            err = (c["predicted_speedup"] - c["speedup"]) / c["speedup"] if priced else None
            out.append(
                {
                    "layers": c["layers"],
                    "batch_size": batch,
                    "ranks": n,
                    "measured_speedup": c["speedup"],
                    "measured_speedup_rounds": c.get("speedup_rounds"),
                    "predicted_speedup": c["predicted_speedup"] if priced else None,
                    "relative_error": err,
                    "measured_step_ms": c["step"]["median"] * 1e3,
                    "predicted_step_ms": c.get("predicted_step_ms"),
                    "measured_step_1_ms": cells[1]["step"]["median"] * 1e3,
                    "predicted_step_1_ms": cells[1].get("predicted_step_ms"),
                    "measured_wait_ms": c["breakdown_ms"]["comm_wait"],
                    "predicted_wait_ms": (c.get("predicted_breakdown_ms") or {}).get("comm_wait"),
                    **_placement_against_calibration(c, profile),
                    "selector_strategy": rec["strategy"],
                    "selector_devices": rec["devices"],
                    "measured_fastest": fastest,
                    "picked_faster": None
                    if unpriced or rec["strategy"] == "benchmark_required"
                    else rec["devices"] == fastest,
                    "not_priced": unpriced,
                }
            )
    return out


# The CPU selector's bound on a predicted speedup against the measured one (issue 13, item 6).
VALIDATION_BOUND = 0.10
# A pick is right where its measured throughput reaches this share of the best cell's; a
# "benchmark required" where every candidate measured within it of the others.
DECISION_TOLERANCE = 0.95


def score_validation(rows: list, validation: list) -> dict:
    """The selector's scores over a --validate-selector grid: the point prediction's error
    of the step (predicted / measured - 1) over every priced cell, its median and 90th
    percentile; the share of cells whose measured step fell inside the 80 % interval
    (coverage); and per batch, whether the decision was right (module constants)."""
    priced = [r for r in rows if r.get("predicted_step_ms") is not None]
    errors = [r["predicted_step_ms"] / (r["step"]["median"] * 1e3) - 1 for r in priced]
    out = {
        "cells": len(priced),
        "unpriced": [
            {"batch_size": r["batch_size"], "ranks": r["ranks"], "why": r["prediction_error"]}
            for r in rows
            if r.get("prediction_error")
        ],
    }
    if errors:
        out.update(
            median_abs_error=float(np.median(np.abs(errors))),
            p90_abs_error=float(np.percentile(np.abs(errors), 90)),
            coverage=sum(bool(r["inside_interval"]) for r in priced) / len(priced),
        )
    decisions = []
    cell = lambda r: (tuple(r.get("layers", ())), r["batch_size"])  # grids of several models pool
    unpriced = {cell(r) for r in rows if r.get("prediction_error")}
    for layers, batch in sorted({cell(v) for v in validation} - unpriced):
        cells = [v for v in validation if cell(v) == (layers, batch)]
        throughput = {1: 1.0, **{v["ranks"]: v["measured_speedup"] for v in cells}}  # against 1 rank
        best = max(throughput.values())
        required = cells[0]["selector_strategy"] == "benchmark_required"
        right = (
            min(throughput.values()) >= DECISION_TOLERANCE * best
            if required
            else throughput.get(cells[0]["selector_devices"], 0.0) >= DECISION_TOLERANCE * best
        )
        decisions.append({"layers": list(layers), "batch_size": batch, "benchmark_required": required, "right": right})
    if decisions:
        out.update(
            decisions=decisions,
            decision_accuracy=sum(d["right"] for d in decisions) / len(decisions),
            benchmark_required_share=sum(d["benchmark_required"] for d in decisions) / len(decisions),
        )
    return out


def measure_world(pg, a, repeats: int, reverse: bool = False) -> list:
    """mgpu's rows: this world in-process, or one mpirun launch per --ranks count and
    --threads count (in reverse order with `reverse`)."""
    if pg.size > 1 or (not a.ranks and len(a.thread_counts) == 1):
        return run_worker(pg, a, repeats)
    if shutil.which("mpirun") is None:
        raise ConfigError("--ranks and several --threads are launched with mpirun: it is not on PATH")
    passthrough = [
        f"--batch-sizes={','.join(map(str, a.batch_sizes))}",
        f"--warmup={a.warmup}",
        f"--steps={a.steps}",
        f"--repeats={repeats}",
        f"--optimizer={a.optimizer}",
        f"--device={a.device}",
        f"--precision={a.precision}",
        f"--cuda-graph={a.cuda_graph}",
        f"--accumulate={a.accumulate}",
        f"--grad-dtype={a.grad_dtype}",
        "--no-progress",
    ]
    passthrough += ["--shard-optimizer"] if a.shard_optimizer else []
    passthrough += ["--observe"] if a.observe else []
    passthrough += [f"--data-on-device={a.data_on_device}"]
    passthrough += [f"--layers={','.join(map(str, a.layers))}"] if a.layers else [f"--model={a.model or 'large'}"]
    if a.dropout is not None:
        passthrough.append(f"--dropout={a.dropout}")
    cells = [(n, t) for n in (a.ranks or [1]) for t in a.thread_counts]
    rows = []
    for n, t in list(reversed(cells)) if reverse else cells:
        threads = f" x {t} thread(s)" if t else ""
        if not a.no_progress:
            print(f"bench: {n} rank(s){threads}...", file=sys.stderr, flush=True)
        rows += _launch(n, passthrough + ([f"--threads={t}"] if t else []), _mpi_env(), threads)
    return rows
