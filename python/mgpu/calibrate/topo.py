"""What `mgpu topo` measures: what this machine is, how fast it computes and
communicates, and the calibration profile the strategy selector predicts from.

Runs as one process or under mpirun (each rank measures its own device; rank 0
reports). Measures, on the backend and communicator training would use:
  - devices: CPU model, cores and ISA; GPUs (name, memory, SMs, capability);
  - GEMM rate by size (the Linear forward GEMM), per precision the device offers;
  - CPU: fp32 Linear layer times (forward, backward) on a grid of rows x in x out,
    elementwise pass bandwidth by size, and real training steps' update and wait
    after backward by parameter count, once with every rank computing and once with
    rank 0 alone (ranks share caches and memory bandwidth);
  - memory bandwidth (y += a x), per-kernel overhead, host-to-device bandwidth;
  - an allreduce sweep, 4 B to 256 MB, nccl-tests style: time, algbw, busbw =
    algbw x 2(n-1)/n, every result checked bit for bit;
  - the host overhead of a training step (a tiny model);
  - held-out steps: real training steps of models on none of those tables, alone and
    on every rank, whose spread about the model's prediction is the profile's error
    model (the 80 % intervals of every prediction made from it);
then fits the alpha-beta allreduce model and writes the profile (JSON).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from typing import Optional

import numpy as np

from .._core import __version__
from .._runtime import _core, gpus_emulated
from ..errors import ConfigError, DeviceError
from ..hostinfo import cpu_description, last_level_cache_bytes, placement_moved
from ..selector import history, profiles
from ..selector.hardware import PRECISIONS
from ..selector.profiles import (
    LAYER_COLD_KEYS,
    PROBE_LAYERS,
    PROBE_ROWS,
    PROFILE_FORMAT,
    PROFILE_VERSION,
    net_step_overheads,
)
from ..train.config import TrainerConfig
from ..train.data import local_slice
from ..train.model import MLP
from ..train.process_group import ProcessGroup
from ..train.trainer import Trainer

GEMM_SIZES = (32, 64, 128, 256, 512, 1024, 2048)
# The layer-time grid (perf_model.h LayerTimes): rows are the local batch, widths
# in and out features. The lookup is trilinear, exact for a multilinear time: a
# GEMM's time is close to affine in its rows, so a factor of 4 serves there, but
# the BLAS's blocking bends it in the widths (a factor of 4 put a 256 x 128 layer's
# backward 15 % high), so a factor of 2 there. Beyond 1024 rows or 2048 features
# the edge's rate holds.
LAYER_ROWS, LAYER_WIDTHS = (1, 4, 16, 64, 256, 1024), (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
LAYER_ROWS_QUICK, LAYER_WIDTHS_QUICK = (1, 16, 256), (8, 128, 1024)
# Elementwise passes (y += a x) of 2^15..2^25 floats: 0.4 MB to 400 MB moved, from
# inside the caches to well beyond them.
PASS_FLOATS, PASS_FLOATS_QUICK = tuple(1 << k for k in range(15, 26, 2)), (1 << 17, 1 << 21, 1 << 24)
# In-step phases: MLPs [h, h, h] of 33K to 17M parameters (2 h^2), 8 rows per rank;
# a factor of 2 in parameters between them, as the caches' edges make steep steps.
STEP_WIDTHS = (128, 181, 256, 362, 512, 724, 1024, 1448, 2048, 2896)
STEP_WIDTHS_QUICK, STEP_ROWS = (128, 724), 8
# Tries at a probe of the wait that starts and ends in one placement of the ranks' cores (a
# VM's hypervisor may move its vCPUs every few seconds: docs/journal.md).
PLACEMENT_TRIES = 3
# Then how long topo watches for the cores in a second placement, to probe the wait there too.
PLACEMENT_WATCH_S, PLACEMENT_WATCH_QUICK_S = 10.0, 1.0
MiB = 1 << 20


def _median(values) -> float:
    return float(np.median(np.asarray(values)))


def measure_gemm(backend, precision: str, quick: bool) -> list:
    """[(work FLOP, FLOP/s)] of Linear GEMMs at one precision: square ones, and the
    skinny (batch x width x width) ones of MLP layers at small per-rank batches."""
    shapes = [(n, n, n) for n in (GEMM_SIZES[:-1] if quick else GEMM_SIZES)]
    shapes += [(b, w, w) for w in (256, 1024) for b in (16, 64, 256) if not quick or b == 64]
    points = []
    for b, i, o in shapes:
        work = 2.0 * b * i * o
        repeats = max(3, min(50, int(2e9 / work)))
        t = _median(_core.time_linear(backend, b, i, o, repeats))
        points.append((work, work / t))
    # one rate per work: the model looks rates up by work
    merged = {}
    for w, r in sorted(points):
        merged.setdefault(w, []).append(r)
    return [(w, float(np.median(rs))) for w, rs in sorted(merged.items())]


# Cold layer times: only where a layer's weights are large enough for the caches to
# matter and its GEMMs short enough for their loads to (elsewhere the warm time serves).
COLD_MIN_WEIGHT_BYTES, COLD_MAX_ROWS = 256 * 1024, 256


def measure_layer_times(backend, quick: bool, before_each=None, cache_bytes: float = 0.0) -> dict:
    """fp32 seconds of a Linear layer on the grid rows x in x out, as training calls it:
    forward (GEMM and bias), backward (input and weight gradients, bias sums) and
    backward without the input gradient (the first layer). before_each(), when given,
    runs before each shape: ranks measuring together stay in step, shape by shape.
    cache_bytes > 0: also the same shapes cold (`*_cold`), each call after sweeping
    twice that much memory, as a step meets its layers when its arrays outgrow the cache."""
    rows, widths = (LAYER_ROWS_QUICK, LAYER_WIDTHS_QUICK) if quick else (LAYER_ROWS, LAYER_WIDTHS)
    kinds = {
        "forward": lambda r, i, o, n, sweep: _core.time_linear(backend, r, i, o, n, sweep_bytes=sweep),
        "backward": lambda r, i, o, n, sweep: _core.time_linear_backward(backend, r, i, o, n, sweep_bytes=sweep),
        "backward_weights": lambda r, i, o, n, sweep: _core.time_linear_backward(
            backend, r, i, o, n, input_gradient=False, sweep_bytes=sweep
        ),
    }
    cold = cache_bytes > 0
    tables = {name: [] for name in kinds}
    tables.update({f"{name}_cold": [] for name in kinds} if cold else {})
    for r in rows:
        for i in widths:
            for o in widths:
                if before_each is not None:
                    before_each()
                repeats = max(3, min(25, int(3e8 / (6.0 * r * i * o))))
                timed_cold = cold and 4.0 * i * o >= COLD_MIN_WEIGHT_BYTES and r <= COLD_MAX_ROWS
                for name, timed in kinds.items():
                    warm = _median(timed(r, i, o, repeats, 0))
                    tables[name].append(warm)
                    if cold:
                        tables[f"{name}_cold"].append(
                            _median(timed(r, i, o, 3, int(2 * cache_bytes))) if timed_cold else warm
                        )
    return {"rows": list(rows), "widths": list(widths), **tables}


def measure_pass_bandwidth(backend, quick: bool, before_each=None) -> list:
    """[(bytes moved, bytes/s)] of y += a x at sizes from inside the caches to beyond
    them (12 bytes per float moved); before_each() as for measure_layer_times."""
    points = []
    for n in PASS_FLOATS_QUICK if quick else PASS_FLOATS:
        if before_each is not None:
            before_each()
        repeats = max(5, min(100, int(4e8 / (12.0 * n))))
        points.append([12.0 * n, 12.0 * n / _median(_core.time_axpy(backend, n, repeats))])
    return points


@contextlib.contextmanager
def _timeouts_kept(pg):
    """Trainers set their watchdog's timeout on the process group and its communicator:
    a probe that trains must leave both as it found them, or the measurements after it
    (the allreduce sweep) time the deadline path (the MPI communicator's blocking
    allreduce handed to a worker thread) as if it were the plain call. The communicator
    in use: on GPUs the sweep's NCCL one, which asking for MPI's would refuse."""
    comm = pg.communicator_in_use or pg.communicator()
    kept = pg.timeout, comm.timeout
    try:
        yield
    finally:
        pg.timeout, comm.timeout = kept


def measure_step_phases(pg, backend_kind: str, threads: int, quick: bool) -> dict:
    """Collective: medians of the update and of the wait after backward (allreduce,
    skew, health check), and the wait's spread (90th percentile less the median), in
    real training steps of [h, h, h] MLPs on this process group, as the perf model's
    StepPhases holds them (SGD with momentum, default buckets)."""
    table = {"params": [], "update_s": [], "wait_s": [], "wait_spread_s": [], "ranks": pg.size}
    with _timeouts_kept(pg):
        for h in STEP_WIDTHS_QUICK if quick else STEP_WIDTHS:
            model = MLP([h, h, h], seed=0, device=backend_kind, threads=threads)
            trainer = Trainer(model, TrainerConfig(loss="mse", optimizer="sgd", lr=1e-3, momentum=0.9), pg)
            x, y = np.zeros((STEP_ROWS, h), np.float32), np.zeros((STEP_ROWS, h), np.float32)
            update, wait = [], []
            for i in range(5 + (10 if quick else 30)):
                trainer.step(x, y, global_batch=STEP_ROWS * pg.size, first_sample=STEP_ROWS * pg.rank)
                if i >= 5:  # after the first steps' page faults and cache fills
                    update.append(trainer.last_result.timings.optimizer)
                    wait.append(trainer.last_result.timings.comm_wait)
            table["params"].append(model.num_params)
            table["update_s"].append(_median(update))
            table["wait_s"].append(_median(wait))
            table["wait_spread_s"].append(max(0.0, float(np.percentile(wait, 90)) - _median(wait)))
    return table


class PlacementLog:
    """Rank 0's readings of where the ranks' cores sit (ProcessGroup.core_round_trip_ns)
    during a calibration: every reading, and apart the samples, the readings taken at
    times that the placement did not choose (not a probe's, which follow a move), from
    which the share of time in each placement is estimated."""

    def __init__(self, pg):
        self.pg, self.cpus, self.readings, self.samples = pg, None, [], []

    def read(self, sample: bool = False) -> Optional[float]:
        """Collective: one reading in ns on rank 0 (None elsewhere, or where it failed)."""
        reading = self.pg.core_round_trip_ns()
        if reading is None:
            return None
        self.cpus = reading["cpus"]
        self.readings.append(reading["ns"])
        if sample:
            self.samples.append(reading["ns"])
        return reading["ns"]


def step_phases_in_one_placement(pg, threads: int, quick: bool, log: PlacementLog) -> tuple:
    """Collective: (measure_step_phases between two readings of where the ranks' cores sit,
    those readings or None), measured again, up to PLACEMENT_TRIES times, while the two
    differ: a wait timed partly in one placement and partly in another is neither's. The
    last try is kept; its readings say whether it moved too."""
    for _ in range(PLACEMENT_TRIES):
        before = log.read()
        table = measure_step_phases(pg, "cpu", threads, quick)
        after = log.read()
        pair = [before, after] if before is not None and after is not None else None
        if not pg.bcast(pair is not None and placement_moved(pair), what="placement"):
            return table, pair
    return table, pair


def step_phases_by_placement(pg, threads: int, quick: bool, log: PlacementLog) -> dict:
    """Collective: the wait's tables by placement of the ranks' cores: {"first": as
    step_phases_in_one_placement measures it, "home": its readings, "second": the table
    in another placement or None, "other": its readings or None}. After the first, the
    cores are read every half second for PLACEMENT_WATCH_S (samples of how long they stay
    where: the selector weighs the two tables by them), and where they are first found
    elsewhere the wait is probed there too (kept if they stayed for the probe). Rank 0
    reads; every rank gets its decisions and its own tables."""
    first, home = step_phases_in_one_placement(pg, threads, quick, log)
    out = {"first": first, "home": home, "second": None, "other": None}
    deadline = time.monotonic() + (PLACEMENT_WATCH_QUICK_S if quick else PLACEMENT_WATCH_S)
    # (a first probe the cores left in every try has no placement to tell another from)
    while not pg.bcast(home is None or placement_moved(home) or time.monotonic() > deadline, what="placement"):
        now = log.read(sample=True)
        if not pg.bcast(
            pg.is_root and now is not None and out["second"] is None and placement_moved(home + [now]), what="placement"
        ):
            time.sleep(0.5)
            continue
        table = measure_step_phases(pg, "cpu", threads, quick)
        after = log.read()
        if pg.bcast(pg.is_root and after is not None and not placement_moved([now, after]), what="placement"):
            out["second"], out["other"] = table, [now, after] if pg.is_root else None
    return out


def other_share(samples_ns: list, home: list, other: list) -> float:
    """Of the samples of where the cores sat, the share found in the second placement
    (among those in either)."""
    there = sum(not placement_moved(other + [t]) for t in samples_ns)
    here = sum(not placement_moved(home + [t]) for t in samples_ns)
    return there / (here + there) if here + there else 0.0


def measure_cpu_tables(pg, backend, threads: int, quick: bool) -> dict:
    """Collective: the layer times (warm and cold), pass bandwidths and in-step phases of
    this rank with every rank computing at once (a multi-rank step's view of the
    machine: the ranks share caches and memory bandwidth), and rank 0's while every
    other rank sleeps (a 1-rank step's); the last-level cache they share."""
    cache = last_level_cache_bytes()

    def measure(group, before_each, step_phases=None) -> dict:
        return {
            "layer_times": measure_layer_times(backend, quick, before_each, cache),
            "pass_bandwidth": measure_pass_bandwidth(backend, quick, before_each),
            "step_phases": (step_phases or (lambda: measure_step_phases(group, "cpu", threads, quick)))(),
        }

    if pg.size == 1 or pg.comm is None:
        return {**measure(pg, None), "cache_bytes": cache}
    log = PlacementLog(pg)
    log.read(sample=True)
    probes = {}

    def step_phases():
        probes.update(step_phases_by_placement(pg, threads, quick, log))
        return probes["first"]

    tables = {**measure(pg, pg.barrier, step_phases), "cache_bytes": cache}
    if probes["second"] is not None:  # every rank's own timings of it, as of step_phases
        tables["step_phases_other_placement"] = probes["second"]
    if pg.is_root:
        tables.update({f"{key}_alone": table for key, table in measure(_self_group(), None).items()})
        if probes["home"] is not None:  # (unknown where the probe's readings failed)
            tables["placement"] = {
                "cpus": log.cpus,
                "readings_ns": log.readings,
                "samples_ns": log.samples,
                "wait_probe_ns": probes["home"],
            }
            if probes["other"] is not None:  # (its share of the samples: run_topo's, with the last one)
                tables["placement"]["other_wait_probe_ns"] = probes["other"]
    pg.sleeping_barrier()
    return tables


def homogenize(entries: list) -> None:
    """Ranks with the same device (name and kind) get the median of their measurements:
    identical hardware measured under noise must not look unequal to the selector."""
    groups = {}
    for e in entries:
        groups.setdefault((e["name"], e["kind"]), []).append(e)
    for same in groups.values():
        if len(same) < 2:
            continue
        for e in same:  # what `topo` prints for each is theirs together, not its own
            e["pooled_ranks"] = [x["rank"] for x in same]
        for key in (
            "memory_bandwidth",
            "launch_overhead_s",
            "graph_node_s",
            "host_to_device_bandwidth",
            "step_overhead_s",
            "probe_step_s",
            "dropout_s_per_unit",
            "memory_bytes",
            "cache_bytes",
        ):
            if all(key in e for e in same):
                value = float(np.median([e[key] for e in same]))
                for e in same:
                    e[key] = value
        for prec in PRECISIONS:
            if all(prec in e for e in same):
                table = {}
                for e in same:
                    for w, r in e[prec]["measured"]:
                        table.setdefault(w, []).append(r)
                fitted = fit_gemm([(w, float(np.median(rs))) for w, rs in sorted(table.items())])
                for e in same:
                    e[prec] = fitted
        # measured tables: the median cell by cell, on the first rank's axes
        for key, measured in (
            ("layer_times", ("forward", "backward", "backward_weights", *LAYER_COLD_KEYS)),
            ("step_phases", ("update_s", "wait_s", "wait_spread_s")),
            ("step_phases_other_placement", ("update_s", "wait_s", "wait_spread_s")),
        ):
            if all(key in e for e in same):
                table = {
                    **same[0][key],
                    **{
                        k: np.median([e[key][k] for e in same], axis=0).tolist()
                        for k in measured
                        if all(k in e[key] for e in same)
                    },
                }
                for e in same:
                    e[key] = table
        if all("pass_bandwidth" in e for e in same):
            points = [p for p, _ in same[0]["pass_bandwidth"]]
            rates = np.median([[r for _, r in e["pass_bandwidth"]] for e in same], axis=0)
            for e in same:
                e["pass_bandwidth"] = [[p, float(r)] for p, r in zip(points, rates)]
        for key in ("layer_times_alone", "pass_bandwidth_alone", "step_phases_alone"):
            alone = next((e[key] for e in same if key in e), None)
            if alone is not None:  # measured by one rank: it stands for its identical peers
                for e in same:
                    e[key] = alone


def fit_gemm(points: list) -> dict:
    """Peak (the best measured rate) and the half-peak work of rate = peak w / (w + h)."""
    peak = max(r for _, r in points)
    # h from each point: h = w (peak / r - 1); the median resists noise
    halves = [w * (peak / r - 1.0) for w, r in points if r < peak]
    return {
        "peak_flops": peak,
        "half_work_flops": float(np.median(halves)) if halves else 0.0,
        "measured": [[w, r] for w, r in points],
    }


def measure_device(pg, device: str, device_index: int, threads: int, quick: bool) -> dict:
    backend = _core.make_backend(device, device_index, threads)
    entry = {"kind": device, "threads": threads if device == "cpu" else None}
    if device == "cpu":
        cpu = cpu_description()
        entry.update(
            name=f"{cpu['model']} ({threads} thread{'s' if threads > 1 else ''})",
            memory_bytes=cpu["memory_bytes"] / max(pg.local_size, 1),
            cpu=cpu,
        )
        precisions = ["fp32"]
    else:
        info = _core.cuda_device_info(device_index)
        entry.update(name=info["name"], memory_bytes=float(info["total_memory"]), gpu=info)
        precisions = list(PRECISIONS)
    for precision in precisions:
        try:
            backend.precision = precision
        except (ConfigError, AttributeError):
            continue
        entry[precision] = fit_gemm(measure_gemm(backend, precision, quick))
    if hasattr(backend, "precision"):
        backend.precision = "fp32"
    n = (16 if quick else 64) * MiB // 4
    entry["memory_bandwidth"] = 12.0 * n / _median(_core.time_axpy(backend, n, 5))
    entry["launch_overhead_s"] = _median(_core.time_axpy(backend, 1, 200))
    node = measure_graph_node(backend, quick)
    entry.update({"graph_node_s": node} if node is not None else {"graph_node_s": 0.0, "captures": False})
    if device == "cpu":
        entry["host_to_device_bandwidth"] = 0.0
        entry["context_bytes"] = 0.1e9
    else:
        entry["host_to_device_bandwidth"] = 64 * MiB / _median(_core.time_copy_to_backend(backend, 64 * MiB, 5))
        entry["context_bytes"] = 0.6e9
    return entry, backend


GRAPH_NODES = (8, 136)  # the two graph sizes whose replays' difference is the per-node cost


def measure_graph_node(backend, quick: bool) -> Optional[float]:
    """Seconds a kernel costs beyond its work as a node of a replayed graph (a captured
    step): the difference between replays of two graph sizes over their node counts,
    the two timed in alternating rounds. On CPUs a replay runs the recorded calls.
    None where the device cannot capture (training under auto runs uncaptured there)."""
    few, many = GRAPH_NODES
    times = {few: [], many: []}
    try:
        for r in range(3 if quick else 7):
            for n in (few, many) if r % 2 == 0 else (many, few):
                times[n].append(_median(_core.time_graph_replay(backend, n, 10 if quick else 30)))
    except (ConfigError, DeviceError) as e:
        print(f"mgpu: warning: topo: capturing a graph failed ({e}): steps are priced uncaptured", file=sys.stderr)
        return None
    return max(0.0, (_median(times[many]) - _median(times[few])) / (many - few))


def _bandwidths(size: int, seconds: float, n: int) -> tuple:
    """(algbw, busbw) in GB/s of an allreduce of `size` bytes on n ranks, nccl-tests style:
    busbw = algbw x 2(n-1)/n, what each rank's link carries."""
    algbw = size / seconds / 1e9
    return algbw, algbw * 2 * (n - 1) / n


def allreduce_sweep(pg, comm, backend, max_bytes: int, quick: bool) -> list:
    """nccl-tests style: rows of bytes, time_us, algbw and busbw (GB/s), wrong elements.
    On MPI, from 1 MiB, also a bare MPI_Allreduce and mgpu's call with a training
    deadline, in rounds that alternate the three (the order rotated each round; the
    machine's noise drifts on a scale of seconds): each time is its rounds' median."""
    n = pg.size
    max_count = max(1, max_bytes // 4)
    probe = _core.AllreduceProbe(comm, backend, max_count)
    raw = _RawMpiAllreduce(pg, max_count) if comm.name == "mpi" else None
    rows, count = [], 1
    while count <= max_count:
        size = count * 4
        iters = max(2, min(200 if not quick else 50, int(2e8 / max(size, 1)) + 2))
        if raw is None or size < MiB:
            seconds, wrong = probe.run(count, iters, 2)
            seconds = pg.allreduce(seconds, op="max")  # the slowest rank is the collective's time
            wrong = pg.allreduce(int(wrong))
            compared = None
        else:
            seconds, wrong, compared = _alternated_rounds(pg, comm, probe, raw, count, iters, 2 if quick else 3)
        algbw, busbw = _bandwidths(size, seconds, n)
        row = {
            "bytes": size,
            "count": count,
            "time_us": seconds * 1e6,
            "algbw_GBps": algbw,
            "busbw_GBps": busbw,
            "wrong": wrong,
        }
        if compared is not None:  # the reference: a bare MPI_Allreduce from mpi4py
            raw_seconds, watched = compared
            row.update(
                raw_mpi_busbw_GBps=_bandwidths(size, raw_seconds, n)[1],
                vs_raw_mpi=raw_seconds / seconds,
                deadline_busbw_GBps=_bandwidths(size, watched, n)[1],
                deadline_vs_raw_mpi=raw_seconds / watched,
            )
        rows.append(row)
        count *= 4 if quick else 2
    return rows


def _alternated_rounds(pg, comm, probe, raw, count: int, iters: int, rounds: int):
    """Collective: (mgpu's call, wrong elements, (bare MPI_Allreduce, mgpu's call with a
    training deadline)) in seconds, each the median over rounds of the slowest rank.
    With a deadline (as training calls it) the MPI communicator's blocking call runs on
    a worker thread, which the caller waits for with heartbeats: a handoff each way
    per call, on the cores the allreduce uses."""
    times = {"plain": [], "raw": [], "deadline": []}
    wrong = 0  # the most wrong elements any measured call of mgpu's left
    order = list(times)
    for r in range(rounds):
        for path in order[r % 3 :] + order[: r % 3]:
            if path == "raw":
                seconds = raw.run(count, iters)
            elif path == "plain":
                seconds, bad = probe.run(count, iters, 2)
                wrong = max(wrong, int(bad))
            else:
                previous, comm.timeout = comm.timeout, TRAINING_DEADLINE_S
                try:
                    seconds, bad = probe.run(count, iters, 2)
                finally:
                    comm.timeout = previous
                wrong = max(wrong, int(bad))
            times[path].append(pg.allreduce(seconds, op="max"))
    return _median(times["plain"]), pg.allreduce(wrong), (_median(times["raw"]), _median(times["deadline"]))


TRAINING_DEADLINE_S = 300.0  # train's default --watchdog-timeout: any deadline takes the watched path


class _RawMpiAllreduce:
    """mpi4py's Allreduce on one reused NumPy buffer: what mgpu's allreduce is held against."""

    def __init__(self, pg, max_count: int):
        self.pg = pg
        self.buffer = np.zeros(max_count, np.float32)
        self.MPI = __import__("mpi4py.MPI", fromlist=["MPI"])

    def run(self, count: int, iters: int) -> float:
        view = self.buffer[:count]
        for _ in range(2):
            self.pg.comm.Allreduce(self.MPI.IN_PLACE, view, op=self.MPI.SUM)
        self.pg.comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            self.pg.comm.Allreduce(self.MPI.IN_PLACE, view, op=self.MPI.SUM)
        return (time.perf_counter() - t0) / iters


FIT_RANGE = (1 << 10, 16 << 20)  # the message sizes training sends: gradient buckets of up to 4 MiB


def fit_link(rows: list, n: int) -> dict:
    """alpha (per ring step) and bus bandwidth of t = 2(n-1) alpha + 2(n-1)/n bytes / busbw,
    from a least-squares fit of t = a + b bytes weighted to relative error, over
    the sizes training sends (FIT_RANGE; all sizes when the sweep has too few)."""
    used = [r for r in rows if FIT_RANGE[0] <= r["bytes"] <= FIT_RANGE[1]]
    used = used if len(used) >= 3 else rows
    sizes = np.array([r["bytes"] for r in used], float)
    times = np.array([r["time_us"] * 1e-6 for r in used], float)
    A = np.stack([np.ones_like(sizes), sizes], axis=1) / times[:, None]
    (a, b), *_ = np.linalg.lstsq(A, np.ones_like(times), rcond=None)
    a, b = max(a, 0.0), max(b, 1e-15)
    predicted = a + b * sizes
    error = float(np.median(np.abs(predicted - times) / times))
    steps = 2.0 * (n - 1)
    return {
        "alpha_s": a / steps,
        "bus_bandwidth": steps / n / b,
        "fit_median_rel_error": error,
        "fitted_at_ranks": n,
        "fit_bytes": [int(sizes.min()), int(sizes.max())],
        # the model interpolates these (it is only extrapolated beyond them)
        "measured": [[r["bytes"], r["time_us"] * 1e-6] for r in rows],
    }


def ring_model(fit: dict) -> dict:
    """An alpha-beta fit (fit_link) as the selector's NCCL-shaped CollectiveModel
    (perf_model.h): one algorithm, the ring, with one protocol."""
    return {
        "latency_s": [0.0, 0.0, 0.0],
        "hop_s": [0.0, 0.0, fit["alpha_s"]],
        "bw_fraction": [0.0, 0.0, 1.0],
        "ring_busbw": fit["bus_bandwidth"],
    }


def hierarchical_link(intra: dict, inter: dict, per_node: int) -> dict:
    """The selector's two-level link (perf_model.h LinkProfile: intra and inter) from the
    fits of the within-node and between-node sweeps."""
    return {"intra": ring_model(intra), "inter": ring_model(inter), "gpus_per_node": per_node}


def node_sweeps(pg, backend, max_bytes: int, quick: bool) -> Optional[dict]:
    """Collective. On several nodes: the allreduce within each node (every node at once; the
    slowest counts) and between the nodes (one rank each), swept and fitted apart, since
    they are different links; None on one node. Ranks left out of the between-node
    sweep wait sleeping, so they do not take the cores of the ranks that measure."""
    MPI = pg._mpi
    nodes = len(dict.fromkeys(pg.hosts))
    if nodes < 2 or MPI is None:
        return None
    sizes = pg.comm.allgather(pg.local_size)
    if len(set(sizes)) != 1:
        raise ConfigError(
            f"topo across nodes needs the same number of ranks on every node, got {sizes} "
            "(by rank): use --map-by ppr:N:node or a hostfile with equal slots"
        )
    node_pg = ProcessGroup(comm=pg.comm.Split_type(MPI.COMM_TYPE_SHARED, key=pg.rank))
    intra_rows = allreduce_sweep(node_pg, node_pg.communicator(), backend, max_bytes, quick) if node_pg.size > 1 else []
    n = node_pg.size
    for r in intra_rows:  # the slowest node's time (and any node's wrong elements) count
        r["time_us"] = pg.allreduce(r["time_us"], op="max")
        r["wrong"] = pg.allreduce(r["wrong"], op="max")
        r["algbw_GBps"], r["busbw_GBps"] = _bandwidths(r["bytes"], r["time_us"] * 1e-6, n)
    leaders = pg.comm.Split(0 if pg.local_rank == 0 else MPI.UNDEFINED, key=pg.rank)
    inter_rows = []
    if leaders != MPI.COMM_NULL:
        lead_pg = ProcessGroup(comm=leaders)
        inter_rows = allreduce_sweep(lead_pg, lead_pg.communicator(), backend, max_bytes, quick)
        lead_pg.close()
    pg.sleeping_barrier()
    inter_rows = pg.bcast(inter_rows)
    node_pg.close()
    node_pg.comm.Free()
    if leaders != MPI.COMM_NULL:
        leaders.Free()
    per_node = sizes[0]
    intra = fit_link(intra_rows, per_node) if intra_rows else None
    inter = fit_link(inter_rows, nodes)
    return {
        "nodes": nodes,
        "ranks_per_node": per_node,
        "intra": intra,
        "inter": inter,
        "intra_allreduce": intra_rows,
        "inter_allreduce": inter_rows,
    }


def _step_times(pg, sizes, dropout, batch, device, device_index, threads, steps, communicator="auto") -> list:
    """Wall times of `steps` training steps of an MLP on this process group after a warm-up
    (communicator: the kind the group already uses, where it uses one)."""
    model = MLP(sizes, seed=0, dropout=dropout, device=device, device_index=device_index, threads=threads)
    trainer = Trainer(model, TrainerConfig(lr=1e-3, communicator=communicator), pg)
    part = local_slice(batch, pg.rank, pg.size)
    x = np.zeros((part.stop - part.start, sizes[0]), np.float32)
    y = np.zeros((part.stop - part.start, sizes[-1]), np.float32)
    for _ in range(max(3, steps // 10)):
        trainer.step(x, y, global_batch=batch, first_sample=part.start)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.step(x, y, global_batch=batch, first_sample=part.start)
        times.append(time.perf_counter() - t0)
    return times


def _step_seconds(pg, sizes, dropout, batch, device, device_index, threads, steps, communicator="auto") -> float:
    """Median wall time of a training step (see _step_times)."""
    return _median(_step_times(pg, sizes, dropout, batch, device, device_index, threads, steps, communicator))


# Held-out steps: MLPs whose widths lie between the layer grid's and whose parameter counts
# between the step-phase probes', each at a small and a large global batch: (layers, batch).
HELD_OUT_CHECKS = (
    ([64, 384, 192, 96, 4], 96),
    ([64, 384, 192, 96, 4], 1536),
    ([96, 768, 768, 10], 192),
    ([96, 768, 768, 10], 768),
    ([384, 1536, 1536, 1536, 48], 80),
    ([384, 1536, 1536, 1536, 48], 320),
)
HELD_OUT_QUICK = (0, 1, 2)  # the checks --quick runs: the smaller models
HELD_OUT_DROPOUT = 0.1
HELD_OUT_STEPS, HELD_OUT_STEPS_QUICK = 15, 6


def measure_held_out_steps(pg, device: str, device_index: int, threads: int, quick: bool, communicator: str) -> list:
    """Collective: each held-out check's median step seconds on rank 0 alone with the whole
    batch (every other rank sleeping) and, with several ranks, on every rank at once
    (rank 0's reading): a measured step and speedup the model never saw. CPU ranks: where
    their cores sat before and after the step on several ranks (together_round_trip_ns),
    since a step in another placement than the wait's probe is not the step priced
    (history.placed_elsewhere)."""
    steps = HELD_OUT_STEPS_QUICK if quick else HELD_OUT_STEPS
    chosen = [HELD_OUT_CHECKS[i] for i in HELD_OUT_QUICK] if quick else HELD_OUT_CHECKS
    placement = pg.core_round_trip_ns if device == "cpu" and pg.size > 1 else lambda: None
    checks = []
    for layers, batch in chosen:
        check = {"layers": list(layers), "batch": batch, "dropout": HELD_OUT_DROPOUT}
        if pg.is_root:
            check["alone_s"] = _step_seconds(
                _self_group(), layers, HELD_OUT_DROPOUT, batch, device, device_index, threads, steps
            )
        if pg.size > 1:
            pg.sleeping_barrier()
            before = placement()
            with _timeouts_kept(pg):
                check["together_s"] = _step_seconds(
                    pg, layers, HELD_OUT_DROPOUT, batch, device, device_index, threads, steps, communicator
                )
            after = placement()
            if before is not None and after is not None and before["cpus"] == after["cpus"]:
                check["together_round_trip_cpus"] = before["cpus"]
                check["together_round_trip_ns"] = [before["ns"], after["ns"]]
        checks.append(check)
    return checks


def _self_group():
    if _mpi_available():
        return ProcessGroup(comm=__import__("mpi4py.MPI", fromlist=["MPI"]).COMM_SELF)
    return ProcessGroup()


EMULATED_NAME = ", EMULATED: the CPU running mgpu's CUDA code"  # a profile of the GPU emulation says so in its name


def measure_step_overhead(device: str, device_index: int, threads: int) -> float:
    """Wall time of a training step whose math is next to nothing: Python, bindings,
    bookkeeping, and the probe's own GEMMs, kernels and update (net_step_overheads
    takes those out)."""
    return _step_seconds(_self_group(), PROBE_LAYERS, 0.0, PROBE_ROWS, device, device_index, threads, 200)


DROPOUT_WIDTHS = (64, 256, 1024)  # hidden widths the dropout cost is taken at (it varies ~25 % across them)
DROPOUT_ROWS = 256


def measure_dropout_cost(backend, quick: bool) -> float:
    """Seconds per hidden unit and sample that dropout adds to a step: the forward's ReLU
    with a dropout mask less the plain ReLU, on the backend's own kernel, the two timed
    in alternating rounds (the backward's ReLU costs the same with or without a mask).
    The median over DROPOUT_WIDTHS. Not the difference of two whole steps: dropout is a
    few percent of a step, inside the machine's noise."""
    rounds = 3 if quick else 7
    costs = []
    for width in DROPOUT_WIDTHS:
        units = DROPOUT_ROWS * width
        repeats = max(5, min(200, int(2e7 / units)))
        times = {0.3: [], 0.0: []}
        for r in range(rounds):
            for p in (0.3, 0.0) if r % 2 == 0 else (0.0, 0.3):
                times[p].append(_median(_core.time_relu_dropout(backend, DROPOUT_ROWS, width, p, repeats)))
        costs.append(max(0.0, (_median(times[0.3]) - _median(times[0.0])) / units))
    return _median(costs)


def measure_step_sync(pg, device: str, device_index: int, threads: int, communicator: str = "auto") -> float:
    """Collective: what a step on this world costs beyond the same step alone (tiny model):
    the collective's latency and the ranks' skew."""
    alone = measure_step_overhead(device, device_index, threads)
    with _timeouts_kept(pg):
        together = _step_seconds(pg, [8, 8, 8], 0.0, 8 * pg.size, device, device_index, threads, 200, communicator)
    return pg.allreduce(max(0.0, together - alone), op="max")


def _mpi_available() -> bool:
    try:
        import mpi4py.MPI  # noqa: F401

        return os.environ.get("MGPU_NO_MPI") != "1"
    except ImportError:
        return False


def run_topo(
    pg, *, device: str = "auto", threads=None, max_bytes: int = 256 * MiB, quick: bool = False, comm_kind: str = "auto"
) -> dict:
    """Collective: measure every rank's device and the communicator; returns the profile (rank 0) or None."""
    device, device_index = pg.resolve_device(device)
    threads = threads or pg.default_threads()
    entry, backend = measure_device(pg, device, device_index, threads, quick)
    # The held-out steps at the start and again at the end: a VM's speed drifts over a
    # minute, and a later run meets the drift the calibration saw as well as the model's
    # error. (GPUs: at the end only, on the communicator the sweep chose.)
    started = time.perf_counter()
    held_out_first = measure_held_out_steps(pg, device, device_index, threads, quick, "mpi") if device == "cpu" else []
    if device == "cpu":
        entry.update(measure_cpu_tables(pg, backend, threads, quick))
    entry["host"] = socket.gethostname()
    entry["rank"] = pg.rank
    entry["step_overhead_s"] = measure_step_overhead(device, device_index, threads)
    entry["dropout_s_per_unit"] = measure_dropout_cost(backend, quick)
    kind = comm_kind if comm_kind != "auto" else ("nccl" if device == "cuda" and pg.size > 1 else "mpi")
    held_out = None  # (measured on the communicator the sweep used)
    rows, link, levels = [], None, None
    if pg.size > 1:
        comm = pg.communicator(kind, device_index) if kind == "nccl" else pg.communicator()
        rows = allreduce_sweep(pg, comm, backend, max_bytes, quick)
        link = fit_link(rows, pg.size)
        link.update(
            name=f"{comm.name} ({pg.size} ranks)",
            overlaps_compute=(kind == "nccl"),
            buffer_bytes=64e6 if kind == "nccl" else 0.0,
            step_sync_s=measure_step_sync(pg, device, device_index, threads, kind),
        )
        held_out = held_out_first + measure_held_out_steps(pg, device, device_index, threads, quick, kind)
        if kind == "mpi":  # (NCCL between nodes: not measurable here, and not modelled from a sweep)
            levels = node_sweeps(pg, backend, max_bytes, quick)
        if device == "cpu":
            last = pg.core_round_trip_ns()
            placement = entry.get("placement")
            if placement is not None and last is not None:
                placement["readings_ns"].append(last["ns"])
                placement["samples_ns"].append(last["ns"])
            if placement is not None:  # the held-out steps' readings are readings of the calibration too
                for c in held_out:
                    if c.get("together_round_trip_cpus") == placement["cpus"]:
                        placement["readings_ns"] += c["together_round_trip_ns"]
                        placement["samples_ns"] += c["together_round_trip_ns"]
            if placement is not None and "other_wait_probe_ns" in placement:
                placement["other_share"] = other_share(
                    placement["samples_ns"], placement["wait_probe_ns"], placement["other_wait_probe_ns"]
                )
        if levels is not None and levels["intra"] is not None:
            link["nccl"] = hierarchical_link(levels["intra"], levels["inter"], levels["ranks_per_node"])
        pg.close()
    else:
        held_out = held_out_first + measure_held_out_steps(pg, device, device_index, threads, quick, kind)
    entries = pg.comm.gather(entry, root=0) if pg.comm is not None else [entry]
    if not pg.is_root:
        return None
    homogenize(entries)
    if link is None:  # one rank: nothing to measure; the named CPU link stands in
        link = {
            "name": "not measured (1 rank): run `mpirun -np N python -m mgpu topo`",
            "alpha_s": 5e-6,
            "bus_bandwidth": 5e9,
            "overlaps_compute": device == "cuda",
            "buffer_bytes": 0.0,
        }
    emulated = gpus_emulated(device)
    profile = {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "source": "calibrated",
        "name": f"calibrated: {socket.gethostname()} ({pg.size} x {device}{EMULATED_NAME if emulated else ''})",
        "gpu_emulation": emulated,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "mgpu_version": __version__,
        "devices": entries,
        "link": link,
        "allreduce": rows,
        "nodes": levels,
        "gpus_per_node": levels["ranks_per_node"] if levels else 0,
        "step_overhead_s": max(e["step_overhead_s"] for e in entries),
        "placement": entries[0].pop("placement", None),
        "environment": {
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
            "world_size": pg.size,
            "threads_per_rank": threads,
            "communicator": kind if pg.size > 1 else None,
        },
    }
    net_step_overheads(profile)
    if held_out_first:
        profile["held_out_minutes_apart"] = (time.perf_counter() - started) / 60
    profile["held_out_steps"] = held_out
    profiles.price_held_out_steps(profile)
    profile["error_model"] = history.error_model(profile)
    return profile
