"""The strategy selector's Python face: `recommend()` (single device or several, how many,
and why) and its text, and the bucket size the model prefers.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from ..errors import ConfigError
from ..hostinfo import placement_moved
from .memory import MEMORY_MARGIN
from .profiles import (
    NAMED_PROFILES,
    PROFILE_ALIASES,
    P,
    calibrated_kinds,
    named_profile,
    placement_moved_in,
    placement_profile,
    profile_is_emulated,
    resolve_profile,
    second_placement_share,
    to_core,
    unsure_bands,
)
from .workload import build_workload


def _as_dict(rec) -> dict:
    cands = [
        {
            "devices": c.devices,
            "predicted_step_ms": c.step_s * 1e3,
            "predicted_speedup": c.speedup,
            "efficiency": c.efficiency,
            "memory_fits": c.memory_fits,
            "predicted_samples_per_sec": c.samples_per_s,
            "batch_shares": list(c.batch_shares),
            "forward_ms": c.forward_s * 1e3,
            "backward_ms": c.backward_s * 1e3,
            "optimizer_ms": c.optimizer_s * 1e3,
            "overhead_ms": c.overhead_s * 1e3,
            "allreduce_ms": c.comm_s * 1e3,
            "exposed_allreduce_ms": c.exposed_comm_s * 1e3,
            # sharded: allreduce_ms is the reduce-scatters and the all-gathers (the parameters' partly
            # hidden behind the next forward on GPUs)
            "shard_optimizer": c.sharded,
            "all_gather_ms": c.gather_s * 1e3,
            "all_gather_exposed_ms": c.gather_exposed_s * 1e3,
            "optimizer_state_bytes": c.optimizer_state_bytes,
            "timing_spread_ms": c.timing_spread_s * 1e3,
            # central 80 % intervals (the profile's error bands and the timing spread)
            "step_interval_ms": [c.step_low_s * 1e3, c.step_high_s * 1e3],
            "speedup_interval": [c.speedup_low, c.speedup_high],
            "bucket_mb": c.bucket_elems * 4 / 2**20,
            "cuda_graph": c.graphs,
            "memory_bytes": c.memory_bytes,
            "memory_usable_bytes": c.memory_usable_bytes,
            **(
                {"cost_per_million_samples": c.cost_per_million_samples}
                if c.cost_per_million_samples and math.isfinite(c.cost_per_million_samples)
                else {}
            ),
        }
        for c in rec.candidates
    ]
    return {
        "strategy": rec.strategy,
        "devices": rec.devices,
        "candidates": cands,
        "break_even_batch": rec.break_even_batch if rec.break_even_batch > 0 else None,
        "reasons": list(rec.reasons),
        "confidence": rec.confidence,
        "roi": rec.roi or None,
        "fallback": rec.fallback,
        "profile": rec.profile,
        "profile_source": rec.profile_source,
        "params": int(rec.params),
    }


# OpenMPI's allreduce collapses from >= 32 MB buffers on CPUs (docs/journal.md):
# CPU buckets stay below that whatever the model prefers.
CPU_MAX_BUCKET_BYTES = 16 * 2**20


NAMED_CONFIDENCE = 0.6  # the selector's base confidence for a profile it did not measure (perf_model.cpp)
UNSURE_CONFIDENCE = 0.5  # at most, where the profile's bands are wider than 2x (unsure_bands): a coin's


MAX_NODES = 1024  # recommend --nodes: beyond the largest published NCCL runs the model was checked on


MAX_DEVICES = 16 * MAX_NODES  # recommend --devices: as many (a device's profile entry each is built)


def _whole_nodes(prof: dict, count: int) -> dict:
    """A multi-node profile repeated node by node up to `count` devices: more nodes of the
    same kind joined by the same inter-node link, whose model prices the extra nodes."""
    devices, per_node, link = prof.get("devices"), prof.get("gpus_per_node"), prof.get("link")
    inter = link.get("nccl", {}).get("inter") if isinstance(link, dict) and isinstance(link.get("nccl"), dict) else None
    if (
        not isinstance(devices, list)
        or not devices
        or not isinstance(per_node, int)
        or per_node < 1
        or not inter
        or count <= len(devices)
        or len(devices) % per_node
    ):
        return prof
    return {**prof, "devices": [devices[i % len(devices)] for i in range(count)]}


def _candidate_counts(prof: Optional[dict], devices: Optional[Sequence[int]], nodes: Optional[int]) -> list:
    """The device counts to compare: given, or 1 / one node / K nodes from the profile."""
    per_node = int((prof or {}).get("gpus_per_node") or 0)
    if nodes is not None:
        if devices is not None:
            raise ConfigError("--nodes and --devices both choose the candidates: give one of them")
        if not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
            raise ConfigError(f"--nodes must be an integer from 1 to {MAX_NODES}, got {nodes}")
        if not per_node:
            raise ConfigError(
                "--nodes needs a profile that says how many devices a node holds: a named "
                "one (`mgpu recommend --list-profiles`) or a calibration across hosts "
                "(mpirun --hostfile FILE python -m mgpu topo)"
            )
        if nodes > 1 and not (prof.get("link", {}).get("nccl") or {}).get("inter"):
            multi = [n for n, s in NAMED_PROFILES.items() if s["link"] and "2x8" in n]
            raise ConfigError(
                f"profile '{prof['name']}' has no inter-node link; for {nodes} nodes calibrate "
                f"across hosts (mpirun --hostfile FILE python -m mgpu topo) or use one of "
                f"{', '.join(multi)}"
            )
        return sorted({1, per_node, nodes * per_node})
    if devices is None:
        return [1, per_node] if per_node > 1 else [1, 2]
    if any(n > MAX_DEVICES for n in devices):
        raise ConfigError(f"--devices: at most {MAX_DEVICES} devices, got {max(devices)}")
    return sorted({1, *(int(n) for n in devices)})  # 1: every speedup's base, and a pick the table shows


def _cpu_threads_priced(prof: dict) -> Optional[str]:
    """Where a CPU calibration ran several ranks, what its 1-rank candidate is: one rank at
    the calibration's threads, not a run on every core it used (train's default on 1 rank)."""
    env = prof.get("environment") or {}
    threads, ranks = env.get("threads_per_rank"), env.get("world_size")
    if calibrated_kinds(prof) != ["cpu"] or not isinstance(threads, int) or not isinstance(ranks, int) or ranks < 2:
        return None
    return (
        f"CPU ranks are priced at the calibration's {threads} thread(s) each ({ranks} ranks x {threads}): "
        f"the 1-rank candidate is one rank of {threads}, not one on all {ranks * threads} of those cores "
        f"(to price that, calibrate it: `mpirun -np 1 python -m mgpu topo --threads {ranks * threads}`)"
    )


def auto_bucket(prof: dict, w, devices: int, options=None) -> dict:
    """The bucket size the model prefers on `devices` of the profile (capped on CPUs)."""
    hw = to_core(prof, devices)
    cpu = hw.devices[0].kind == "cpu"
    choice = P.choose_bucket(w, hw, devices, options or P.Options(), CPU_MAX_BUCKET_BYTES if cpu else 0.0)
    return {
        "bucket_mb": choice.bucket_elems * 4 / 2**20,
        "exposed_allreduce_ms": choice.exposed_comm_s * 1e3,
        "allreduce_ms": choice.comm_s * 1e3,
        "reason": choice.reason
        + (" (CPU: capped below OpenMPI's >= 32 MB slow path)" if cpu else "")
        + (" (EMULATED GPUs: the CPU running mgpu's CUDA code)" if profile_is_emulated(prof) else ""),
    }


def recommend(
    *,
    model: Optional[str] = None,
    layers: Optional[Sequence[int]] = None,
    params: Optional[int] = None,
    batch_size: int,
    devices: Optional[Sequence[int]] = None,
    profile=None,
    precision: str = "fp32",
    optimizer: str = "adamw",
    bucket_mb="auto",
    memory_margin: float = MEMORY_MARGIN,
    price_per_device_hour: float = 0.0,
    dropout: Optional[float] = None,
    grad_dtype: str = "fp32",
    nodes: Optional[int] = None,
    cuda_graph: str = "auto",
    accumulate: int = 1,
    shard_optimizer: bool = False,
    data_on_device: bool = True,
) -> dict:
    """Single device or several, how many, and why, for a model and global batch.

    profile: None/'auto', 'calibrated', a named profile, a JSON path, or a
    profile dict. devices: candidate counts (default: 1 and the profile's GPUs
    per node, plus nodes x that with `nodes`). cuda_graph: auto | on | off, as
    `train --cuda-graph` (captured steps cost less per kernel and allreduce after
    backward instead of during it). accumulate: micro-batches the global batch is
    split into a step (train's step is --batch-size x --accumulate rows). bucket_mb: MB or
    'auto' (default: each multi-device candidate at the bucket the model prefers for it).
    shard_optimizer: price every multi-device candidate with a sharded optimizer (`train
    --shard-optimizer`); without it a reason says where sharding would change the answer.
    data_on_device: a GPU's inputs gathered from a training set in its memory (train's
    default where it fits), else copied from the host each step.
    Returns a dict: strategy (single_gpu | multi_gpu | benchmark_required | does_not_fit),
    devices, candidates (per count:
    predicted_step_ms, predicted_speedup, efficiency, memory_fits, ...),
    break_even_batch, reasons, confidence, roi, fallback, profile, bucket.
    """
    if devices is not None:
        counts = sorted({int(n) for n in devices})
        if not counts or counts[0] < 1:
            raise ConfigError(f"device counts must be integers >= 1, got {list(devices)}")
    if optimizer not in ("sgd", "adamw"):
        raise ConfigError(f"unknown optimizer '{optimizer}' (expected sgd or adamw)")
    auto = bucket_mb == "auto"
    w = build_workload(
        model,
        layers,
        params,
        batch_size,
        precision,
        optimizer,
        4.0 if auto else bucket_mb,
        dropout,
        grad_dtype,
        cuda_graph,
        accumulate,
        shard_optimizer,
        data_on_device,
    )
    prof = profile if isinstance(profile, dict) else resolve_profile(profile, None)
    counts = _candidate_counts(prof, devices, nodes)
    if counts[0] < 1:
        raise ConfigError(f"device counts must be integers >= 1, got {counts}")
    options = P.Options()
    options.candidates, options.memory_margin = counts, memory_margin
    options.price_per_device_hour = price_per_device_hour
    if prof is None:
        return {**_as_dict(P.recommend_by_thresholds(w, options)), "bucket": None}
    if not isinstance(profile, dict) and (profile in NAMED_PROFILES or profile in PROFILE_ALIASES):
        prof = named_profile(profile, counts[-1])
    described = len(prof.get("devices") or [])
    prof = _whole_nodes(prof, counts[-1])
    extrapolated = len(prof.get("devices") or []) > described
    hw = to_core(prof, counts[-1])
    if len(hw.devices) < counts[-1]:
        raise ConfigError(f"profile '{hw.name}' has {len(hw.devices)} device(s); cannot predict {counts[-1]}")
    if any(d.kind == "cpu" for d in hw.devices) and (precision, grad_dtype) != ("fp32", "fp32"):  # as train refuses
        given = f"--precision {precision}" if precision != "fp32" else f"--grad-dtype {grad_dtype}"
        raise ConfigError(
            f"{given}: profile '{hw.name}' is of CPUs, which compute and allreduce in fp32 (a GPU profile prices it)"
        )
    # auto: every multi-device candidate at its own best bucket, so that e.g. a second
    # node is not judged at a bucket size chosen for one.
    options.choose_buckets = auto
    options.max_bucket_bytes = CPU_MAX_BUCKET_BYTES if hw.devices[0].kind == "cpu" else 0.0
    rec = P.recommend(w, hw, options)
    bucket = None
    multi = [c for c in rec.candidates if c.devices > 1 and c.memory_fits]
    fastest = min(multi, key=lambda c: c.step_s) if multi else None
    if fastest:  # the bucket for the fastest multi-device candidate, with the reason
        bucket = auto_bucket(prof, w, fastest.devices, options)
    result = _as_dict(rec)
    if extrapolated:  # no measurement (named table or calibration) of that many nodes
        per_node = prof["gpus_per_node"]
        result["reasons"].append(
            f"{counts[-1] // per_node} nodes extrapolated from the profile's "
            f"{described // per_node}: more nodes of the same kind over the same inter-node "
            "link, priced by its model"
        )
        result["confidence"] = min(result["confidence"], NAMED_CONFIDENCE)
    if multi and placement_moved_in(prof):
        readings = prof["placement"]["readings_ns"]
        seen = (
            f"the calibration saw the ranks' cores change cache domains (a cache line's round "
            f"trip {min(readings):.0f}-{max(readings):.0f} ns)"
            if placement_moved(readings)
            else "runs since the calibration met the ranks' cores in another cache domain than `topo` did"
        )
        result["reasons"].append(
            f"{seen}, as a VM's vCPUs do when its hypervisor moves them: a multi-rank wait after "
            "backward may be off by its own size, and the error band widens by it"
        )
        second = placement_profile(prof, "second")
        if second is not None:  # the same candidate (its bucket) with the cores held in either placement
            at_its_bucket = build_workload(
                model,
                layers,
                params,
                batch_size,
                precision,
                optimizer,
                fastest.bucket_elems * 4 / 2**20,
                dropout,
                grad_dtype,
                cuda_graph,
                accumulate,
                shard_optimizer,
                data_on_device,
            )
            options.choose_buckets = False
            here, there = (
                P.predict(at_its_bucket, to_core(p, counts[-1]), fastest.devices, options).speedup
                for p in (placement_profile(prof, "first"), second)
            )
            here_ns, there_ns = prof["placement"]["wait_probe_ns"], second["placement"]["wait_probe_ns"]
            result["reasons"].append(
                f"{fastest.devices} ranks: {here:.2f}x with the cores as the wait was first probed "
                f"({min(here_ns):.0f}-{max(here_ns):.0f} ns), {there:.2f}x as it was probed again "
                f"({min(there_ns):.0f}-{max(there_ns):.0f} ns); priced at {fastest.speedup:.2f}x, as "
                f"{second_placement_share(prof):.0%} of topo's readings found them in the second placement"
            )
    result["bucket"] = bucket
    result["bucket_mb_used"] = (fastest.bucket_elems if fastest else w.bucket_elems) * 4 / 2**20
    result["sources"] = prof.get("sources", [])
    if prof.get("record", {}).get("judged"):  # the calibration's record of this machine's runs (history.py)
        rec = prof["record"]
        result["record"] = rec
        result["reasons"].append(
            f"this machine's record since the calibration: {rec['inside']} of {rec['judged']} priced steps "
            f"({rec['inside'] / rec['judged']:.0%}) fell in their 80% interval; the bands now hold them too"
        )
    threads = _cpu_threads_priced(prof)
    if threads:
        result["reasons"].append(threads)
    unsure = unsure_bands(hw.error)
    if unsure:
        result["reasons"].append(unsure)
        result["confidence"] = min(result["confidence"], UNSURE_CONFIDENCE)
    result["error_model"] = {
        "compute": [hw.error.compute.low, hw.error.compute.high],
        "compute_together": [hw.error.compute_together.low, hw.error.compute_together.high],
        "comm": [hw.error.comm.low, hw.error.comm.high],
        "compute_shared": hw.error.compute_shared,
        "source": hw.error.source,
    }
    result["gpu_emulation"] = profile_is_emulated(prof)
    if result["gpu_emulation"]:  # never mistakable for a real GPU's answer
        result["reasons"].insert(
            0,
            "GPU EMULATION: this profile is of mgpu's emulated GPUs (the CPU running its "
            "CUDA code), not of real ones; its times are not a GPU's, and neither is this "
            "answer",
        )
    return result


def format_recommendation(r: dict) -> str:
    lines = [
        f"strategy: {r['strategy']}  (devices: {r['devices']}, confidence {r['confidence']:.0%}, "
        f"profile: {r['profile']} [{r['profile_source']}])"
    ]
    if r["candidates"]:
        lines.append(
            f"{'devices':>7} {'step ms':>9} {'80% interval':>15} {'samples/s':>11} {'speedup':>8} {'80% interval':>13} "
            f"{'effic.':>7} "
            f"{'allreduce ms':>13} {'exposed':>8} {'bucket MiB':>10} {'memory/dev':>11} {'fits':>5}"
        )
        for c in r["candidates"]:
            # 6 digits: 1024 MiB prints as such, not as 1.02e+03
            bucket = f"{c['bucket_mb']:>10.6g}" if c["devices"] > 1 and c.get("bucket_mb") else f"{'-':>10}"
            step_low, step_high = c["step_interval_ms"]
            speedup = f"{c['speedup_interval'][0]:.2f}-{c['speedup_interval'][1]:.2f}x" if c["devices"] > 1 else "-"
            lines.append(
                f"{c['devices']:>7} {c['predicted_step_ms']:>9.3f} {f'{step_low:.3g}-{step_high:.3g}':>15} "
                f"{c['predicted_samples_per_sec']:>11,.0f} {c['predicted_speedup']:>7.2f}x {speedup:>13} "
                f"{c['efficiency']:>6.0%} {c['allreduce_ms']:>13.3f} "
                f"{c['exposed_allreduce_ms']:>8.3f} {bucket} {c['memory_bytes'] / 1e9:>9.2f}GB "
                f"{'yes' if c['memory_fits'] else 'NO':>5}"
            )
    if any(c.get("shard_optimizer") for c in r["candidates"]):
        lines.append(
            "optimizer sharded on several devices: their allreduce ms is the gradients' reduce-scatter and the "
            "all-gathers after the update, exposed ms includes the all-gathers"
        )
    if r.get("error_model"):
        lines.append(f"80% intervals from {r['error_model']['source']}")
    if r["break_even_batch"]:
        lines.append(f"break-even global batch: {r['break_even_batch']}")
    lines += [f"- {reason}" for reason in r["reasons"]]
    if r.get("roi"):
        lines.append(f"ROI: {r['roi']}")
    if r.get("bucket"):
        b = r["bucket"]
        lines.append(
            f"bucket: {b['bucket_mb']:g} MiB minimises the exposed allreduce ({b['reason']}); "
            f"`train --bucket-mb auto` uses it"
        )
    return "\n".join(lines)
