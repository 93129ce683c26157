"""Hardware profiles and the strategy selector's Python face: mgpu.recommend().

A profile says how fast each device computes (GEMM rate by size, memory
bandwidth, launch overhead), how much memory it has, and how fast the
allreduce between devices is (alpha-beta). It comes from one of:
  calibrated  `python -m mgpu topo` measured this machine (JSON in the cache dir)
  detected    GPUs visible but not calibrated: estimated from their properties
  named       real systems (`mgpu recommend --list-profiles`): each names its
              sources; the allreduce is NCCL-shaped and fitted to published
              nccl-tests tables (mgpu.allreduce_fit, data/); GEMM and memory
              figures are vendor specs derated, or published measurements
With none of them (no calibration, no GPU) the selector falls back to seed
001's parameter/batch threshold table, and says so. The model itself is C++
(csrc/core/perf_model.cpp); this file builds its inputs and formats its answer.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import socket
from typing import Optional

from .._runtime import _core, gpus_emulated
from ..atomic import atomic_file
from ..errors import ConfigError
from ..hostinfo import placement_moved, round_trips_readable
from . import gemm_fit, history, intervals
from .allreduce_fit import load_fitted, load_published, model_from_dict
from .allreduce_fit import validate as validate_allreduce
from .hardware import (
    GPU_LAUNCH_S,
    GPU_STEP_OVERHEAD_S,
    GPU_TYPES,
    GRAPH_NODE_S,
    NCCL_BUFFER_BYTES,
    PRECISIONS,
    SPECS,
    known_gpu_type,
)
from .workload import build_workload

P = _core.perf
PROFILE_FORMAT = "mgpu-hardware-profile"
PROFILE_VERSION = 1
# topo's step-overhead probe: a training step whose math is next to nothing
PROBE_LAYERS, PROBE_ROWS = [8, 8, 8], 8


def _link_sources(link: str) -> list:
    """The published tables and anchors behind a fitted link (data/nccl_published.json)."""
    doc = load_published()
    names = {link, _fitted_link(link).get("intra_from", link)}  # with the link it builds on
    out = [
        {"url": t["source"], "figure": f"allreduce table ({t['role']}): {t['system']}"}
        for t in doc["tables"]
        if t["profile"] in names
    ]
    out += [{"url": a["source"], "figure": a["what"]} for a in doc["anchors"] if a["profile"] in names]
    return out


# Named profiles of real systems. 'link' names a fitted link in data/allreduce_fit.json.
NAMED_PROFILES = {
    "h100-sxm-8": dict(
        title="8x H100 SXM, NVLink 4 + NVSwitch (one node)",
        devices=["h100-sxm"] * 8,
        link="h100-sxm-8",
        gpus_per_node=8,
        specs=["h100-sxm-azure"],
    ),
    "a100-sxm-8": dict(
        title="8x A100 SXM4 80GB, NVLink 3 + NVSwitch (one node)",
        devices=["a100-80gb"] * 8,
        link="a100-sxm-8",
        gpus_per_node=8,
        specs=["a100-azure"],
    ),
    "h100-pcie-nvlink-2": dict(
        title="2x H100 PCIe with an NVLink bridge",
        devices=["h100-pcie"] * 2,
        link="h100-pcie-nvlink-2",
        gpus_per_node=2,
        specs=["h100-pcie"],
    ),
    "pcie-pair-no-p2p": dict(
        title="2 consumer GPUs on PCIe without peer-to-peer (RTX 4070 Ti SUPER pair)",
        devices=["rtx-4070-ti-super"] * 2,
        link="pcie-pair-no-p2p",
        gpus_per_node=2,
        specs=[],
    ),
    "pcie-pair-p2p": dict(
        title="2 consumer GPUs on PCIe with peer-to-peer (RTX 4070 Ti SUPER pair; busbw from 4x RTX 4090 with P2P)",
        devices=["rtx-4070-ti-super"] * 2,
        link="pcie-pair-p2p",
        gpus_per_node=2,
        specs=[],
    ),
    "rtx5080-rtx4060": dict(
        title="the seeds' mixed pair: RTX 5080 + RTX 4060 on PCIe without peer-to-peer",
        devices=["rtx-5080", "rtx-4060"],
        link="pcie-pair-no-p2p",
        gpus_per_node=2,
        specs=["rtx-5080", "rtx-4060"],
    ),
    "h100-ib-2x8": dict(
        title="2 nodes x 8 H100 SXM, InfiniBand NDR (one 400G NIC per GPU)",
        devices=["h100-sxm"] * 16,
        link="h100-ib-2x8",
        gpus_per_node=8,
        specs=["h100-sxm-azure"],
    ),
    "a100-ib-2x8": dict(
        title="2 nodes x 8 A100 SXM4, InfiniBand HDR (8x 200G per node)",
        devices=["a100-80gb"] * 16,
        link="a100-ib-2x8",
        gpus_per_node=8,
        specs=["a100-azure"],
    ),
    "a100-roce-2x8": dict(
        title="2 nodes x 8 A100 SXM4, RoCE v2 Ethernet (OCI BM.GPU4.8, 16x 100G per node)",
        devices=["a100-40gb"] * 16,
        link="a100-roce-2x8",
        gpus_per_node=8,
        specs=["a100-40gb"],
    ),
    "h100-ethernet-2x8": dict(
        title="2 nodes x 8 H100, Ethernet (GCP A3 Mega, GPUDirect-TCPXO)",
        devices=["h100-sxm"] * 16,
        link="h100-ethernet-2x8",
        gpus_per_node=8,
        specs=["h100-sxm-azure"],
    ),
    "h100-efa-2x8": dict(
        title="2 nodes x 8 H100, AWS Elastic Fabric Adapter (p5.48xlarge, 32x 100G per node)",
        devices=["h100-sxm"] * 16,
        link="h100-efa-2x8",
        gpus_per_node=8,
        specs=["h100-sxm-azure"],
    ),
    "cpu": dict(
        title="CPU ranks, MPI over shared memory (nominal)", devices=None, link=None, gpus_per_node=0, specs=[]
    ),
}
# Names of v1 (round-number profiles) that keep working.
PROFILE_ALIASES = {
    "pcie-host-bridge": "pcie-pair-no-p2p",
    "pcie-p2p": "pcie-pair-p2p",
    "nvlink": "a100-sxm-8",
    "h100-nvswitch": "h100-sxm-8",
}


def list_profiles() -> str:
    lines = []
    for name, spec in NAMED_PROFILES.items():
        lines.append(f"{name:20s} {spec['title']}")
        if spec["link"]:
            for src in profile_sources(spec):
                lines.append(f"{'':22s}- {src['figure']}: {src['url']}")
    lines.append("aliases: " + ", ".join(f"{a} -> {b}" for a, b in PROFILE_ALIASES.items()))
    return "\n".join(lines)


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mgpu")


def default_profile_path() -> str:
    return os.path.join(cache_dir(), "profile.json")


# --- profiles as JSON-able dicts ------------------------------------------------------
def _gemm_dict(peak: float, half: float, measured=None) -> dict:
    return {"peak_flops": float(peak), "half_work_flops": float(half), "measured": measured or []}


def _gemm_rates(gpu: str) -> dict:
    """A GPU type's GEMM rate per precision: fitted to published benchmarks, else from its spec."""
    g, out = GPU_TYPES[gpu], {}
    for p in PRECISIONS:
        fit = gemm_fit.rate(gpu, p)
        if fit:
            out[p] = _gemm_dict(fit["peak_flops"], fit["half_work_flops"])
        elif p in g:
            out[p] = _gemm_dict(g[p], g["half"])
    return out


def device_entry(gpu: str) -> dict:
    """A profile's device entry of a GPU_TYPES kind."""
    g = GPU_TYPES[gpu]
    return {
        "name": g["name"],
        "kind": "cuda",
        "memory_bytes": g["memory"],
        "memory_bandwidth": g["bandwidth"],
        "host_to_device_bandwidth": g["h2d"],
        "launch_overhead_s": GPU_LAUNCH_S,
        "graph_node_s": GRAPH_NODE_S,
        "context_bytes": g["context"],
        **_gemm_rates(gpu),
    }


def profile_sources(spec: dict) -> list:
    """Where a named profile's figures come from: allreduce tables, GEMM tables, specs."""
    gemm = [src for gpu in dict.fromkeys(spec["devices"]) for src in gemm_fit.sources(gpu)]
    return (
        _link_sources(spec["link"])
        + gemm
        + [SPECS[k] for k in spec["specs"]]
        + [SPECS["graph-node"], SPECS["latencies"]]
    )


def _fitted_link(link: str) -> dict:
    links = load_fitted()["links"]
    if link not in links:
        raise ConfigError(
            f"no fitted allreduce parameters for link '{link}': run `python -m mgpu.allreduce_fit --refit`"
        )
    return links[link]


@functools.lru_cache(maxsize=1)
def _published_error_model() -> dict:
    gemm = intervals.residuals(gemm_fit.validate(), "shape")
    return intervals.error_model(gemm, intervals.residuals(validate_allreduce(), "bytes"))


def published_error_model() -> dict:
    """A named GPU profile's "error_model": the bands of every published GEMM and allreduce
    residual (intervals.error_model). A fresh copy each call."""
    return copy.deepcopy(_published_error_model())


def named_profile(name: str, devices: Optional[int] = None) -> dict:
    name = PROFILE_ALIASES.get(name, name)
    if name not in NAMED_PROFILES:
        raise ConfigError(
            f"unknown hardware profile '{name}' (expected one of {', '.join(NAMED_PROFILES)}, an alias "
            f"({', '.join(PROFILE_ALIASES)}), 'calibrated', or a profile JSON path; "
            "`mgpu recommend --list-profiles` lists them)"
        )
    spec = NAMED_PROFILES[name]
    if spec["devices"] is None:
        device = {
            "name": "CPU core (AVX2/FMA, nominal)",
            "kind": "cpu",
            "fp32": _gemm_dict(90e9, 5e6),
            "memory_bytes": 8e9,
            "memory_bandwidth": 15e9,
            "host_to_device_bandwidth": 0.0,
            "launch_overhead_s": 1e-6,
            "context_bytes": 0.1e9,
        }
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "name": name,
            "source": "named",
            "title": spec["title"],
            "sources": [],
            "devices": [dict(device) for _ in range(max(1, devices or 8))],
            "link": {
                "name": "MPI over shared memory (nominal)",
                "alpha_s": 5e-6,
                "bus_bandwidth": 5e9,
                "overlaps_compute": False,
                "buffer_bytes": 0.0,
            },
            "step_overhead_s": 2e-4,
            "model_error": 0.3,
        }
    entries = []
    for key in spec["devices"]:
        entries.append(device_entry(key))
    fit = _fitted_link(spec["link"])
    nccl = {"intra": fit["intra"], "gpus_per_node": spec["gpus_per_node"]}
    if fit.get("inter"):
        nccl["inter"] = fit["inter"]
    ring = fit["intra"].get("ring_busbw") or fit["intra"].get("nvls_busbw")
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "name": name,
        "source": "named",
        "title": spec["title"],
        "gpus_per_node": spec["gpus_per_node"],
        "sources": profile_sources(spec),
        "devices": entries,
        "link": {
            "name": spec["title"],
            "alpha_s": 0.0,
            "bus_bandwidth": ring,
            "overlaps_compute": True,
            "buffer_bytes": NCCL_BUFFER_BYTES,
            "nccl": nccl,
        },
        "step_overhead_s": GPU_STEP_OVERHEAD_S,
        # the bands the published tables' residuals give (docs/selector-validation.md)
        "error_model": published_error_model(),
    }


def detected_profile(devices: Optional[int] = None) -> Optional[dict]:
    """An uncalibrated profile of the visible GPUs, or None without GPUs: a GPU of a named
    profile (H100, H200, A100 SXM, RTX 5080, RTX 4060) at its published GEMM rates, another
    estimated from its properties."""
    info = _core.build_info().get("cuda", {})
    gpus = info.get("devices", [])
    if not gpus:
        return None
    entries = []
    for g in gpus:
        known = known_gpu_type(str(g.get("name", "")))
        if known:  # a GPU of a named profile: its published GEMM rates and bandwidths
            entry = device_entry(known)
            entries.append(
                {
                    **entry,
                    "name": g.get("name", "GPU"),
                    "memory_bytes": float(g.get("total_memory_mib", 0)) * 2**20 or entry["memory_bytes"],
                }
            )
            continue
        sms = float(g.get("multiprocessors", 0) or 0)
        clock = 1.7e9  # typical boost clock of recent data-centre GPUs
        cc = str(g.get("compute_capability", "8.0"))
        lanes = 64 if cc in ("6.0", "7.0", "7.5", "8.0") else 128  # FP32 lanes per SM: P100, V100, T4, A100 have 64
        fp32 = 0.7 * sms * lanes * 2 * clock  # x FMA, derated
        # BF16 tensor rate over FP32 as the fitted GPUs show it (docs/gemm-validation.md):
        # 14-17x on A100 / H100-class parts (cc 8.0, 9.x, 10.x), 3-4x on GeForce (RTX 5080,
        # RTX 4060); TF32 at half of it. Volta and Turing (7.x) have FP16 tensor cores
        # only, about 8x FP32 by spec (V100 125 / 15.7, T4 65 / 8.1 TFLOPS): TF32 and BF16
        # fall back to FP32 there.
        tensor = 16.0 if cc == "8.0" or cc.split(".")[0] in ("9", "10") else 4.0
        rates = (
            {"fp32": fp32, "fp16": fp32 * 8.0}
            if cc.startswith("7.")
            else {"fp32": fp32, "tf32": fp32 * tensor / 2, "bf16": fp32 * tensor, "fp16": fp32 * tensor}
        )
        entries.append(
            {
                "name": g.get("name", "GPU"),
                "kind": "cuda",
                "memory_bytes": float(g.get("total_memory_mib", 0)) * 2**20,
                "memory_bandwidth": 1e12,
                "host_to_device_bandwidth": 20e9,
                "launch_overhead_s": GPU_LAUNCH_S,
                "graph_node_s": GRAPH_NODE_S,
                "context_bytes": 0.6e9,
                # a GEMM's fixed time as the fitted GPUs' small kernels take it
                **{p: _gemm_dict(peak, peak * gemm_fit.TYPICAL_FIXED_S) for p, peak in rates.items()},
            }
        )
    if devices and devices > len(entries):
        entries += [dict(entries[-1]) for _ in range(devices - len(entries))]
    emulated = gpus_emulated()
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "source": "detected",
        "devices": entries,
        "name": f"detected: {socket.gethostname()}"
        + (" (EMULATED GPUs: the CPU running mgpu's CUDA code)" if emulated else ""),
        "gpu_emulation": emulated,
        "link": {
            "name": "assumed PCIe P2P",
            "alpha_s": 10e-6,
            "bus_bandwidth": 20e9,
            "overlaps_compute": True,
            "buffer_bytes": 64e6,
        },
        "step_overhead_s": GPU_STEP_OVERHEAD_S,
        "model_error": 0.35,
    }


def save_profile(profile: dict, path: Optional[str] = None) -> str:
    """Write a profile atomically (default: the cache directory); returns the path."""
    path = path or default_profile_path()
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        with atomic_file(path, prefix=".tmp-profile-") as f:
            json.dump(profile, f, indent=2)
    except OSError as e:
        raise ConfigError(f"cannot write the profile to '{path}': {e.strerror or e}") from None
    return path


def load_profile(path: str) -> dict:
    if os.path.isdir(path):  # a pipe is fine: `recommend --profile <(jq ... p.json)`
        raise ConfigError(f"hardware profile '{path}' is a directory")
    try:
        with open(path) as f:
            profile = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"hardware profile '{path}' does not exist") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read hardware profile '{path}': {e}") from None
    if not isinstance(profile, dict) or profile.get("format") != PROFILE_FORMAT:
        raise ConfigError(f"'{path}' is not an mgpu hardware profile")
    if profile.get("version") != PROFILE_VERSION:
        raise ConfigError(f"hardware profile '{path}' has version {profile.get('version')}; expected {PROFILE_VERSION}")
    per_node = profile.get("gpus_per_node", 1)
    if not isinstance(per_node, int) or isinstance(per_node, bool) or per_node < 0:
        raise ConfigError(
            f"hardware profile '{path}' is malformed: gpus_per_node must be an integer >= 0, got {per_node!r}"
        )
    devices = profile.get("devices")
    if not isinstance(devices, list) or not devices or not all(isinstance(d, dict) for d in devices):
        raise ConfigError(f"hardware profile '{path}' is malformed: devices must be a non-empty list of objects")
    try:
        to_core(profile)  # validates the fields
    except ConfigError as e:  # its messages name no file: this one does
        raise ConfigError(f"hardware profile '{path}': {str(e).removeprefix('hardware profile: ')}") from None
    except (AttributeError, TypeError, ValueError, KeyError, IndexError) as e:  # a field of the wrong shape
        raise ConfigError(f"hardware profile '{path}' is malformed ({type(e).__name__}: {e})") from None
    entries = profile["devices"]
    if profile.get("source") == "calibrated" and all(
        isinstance(e.get("step_overhead_s"), (int, float)) and "probe_step_s" not in e for e in entries
    ):
        # calibrated before topo took the probe's own work out of its step: the model
        # would price that work twice in every step (on a GPU, most of the probe)
        net_step_overheads(profile)
    records = history.read(path, profile.get("created")) if profile.get("held_out_steps") else []
    checked_placement(profile)  # the bands read where the cores sat: a malformed placement says so first
    try:
        # priced by the model that priced them at calibration, or (an mgpu since) anew
        repriced = bool(profile.get("held_out_steps")) and price_held_out_steps(profile)
        if records or repriced:  # this machine's runs since the calibration widen its bands (history.py)
            profile["error_model"] = history.error_model(profile, records)
            if repriced:
                profile["error_model"]["source"] += "; held-out steps re-priced by this mgpu's model"
    except (ConfigError, KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ConfigError(f"hardware profile '{path}' is malformed (held_out_steps: {e})") from None
    if records:
        profile["record"] = history.summary(records)
    return profile


def price_held_out_steps(profile: dict) -> bool:
    """Each held-out check's predictions by this mgpu's model from the profile it calibrated:
    its step alone and (measured with several ranks) on every rank, as history.error_model
    takes the bands. True when a prediction moved (a calibration priced by an older model);
    checks without their workload (history.HELD_OUT_WORKLOAD) are left as they are."""
    hw = to_core({**profile, "error_model": None})
    options = P.Options()
    options.equal_shares = True
    moved = False
    for c in profile["held_out_steps"]:
        if not all(k in c for k in history.HELD_OUT_WORKLOAD):
            continue
        w = build_workload(None, c["layers"], None, c["batch"], "fp32", "sgd", 4.0, c["dropout"])
        priced = {"alone_predicted_s": P.predict(w, hw, 1, options).step_s}
        if "together_s" in c:
            priced["together_predicted_s"] = P.predict(w, hw, len(profile["devices"]), options).step_s
        for key, value in priced.items():
            moved |= not math.isclose(c.get(key, math.nan), value, rel_tol=1e-9)
            c[key] = value
    return moved


def resolve_profile(spec: Optional[str], devices: Optional[int] = None) -> Optional[dict]:
    """'auto' (calibrated, else detected, else None), 'calibrated', a named profile, or a path."""
    if spec is not None and not spec.strip():
        raise ConfigError(
            "--profile is empty: give auto, calibrated, a profile's name (--list-profiles) or a .json path"
        )
    spec = spec or "auto"
    if spec == "auto":
        if os.path.exists(default_profile_path()):
            return load_profile(default_profile_path())
        return detected_profile(devices)
    if spec == "calibrated":
        if not os.path.exists(default_profile_path()):
            raise ConfigError(f"no calibration at {default_profile_path()}: run `python -m mgpu topo` first")
        return load_profile(default_profile_path())
    if spec in NAMED_PROFILES or spec in PROFILE_ALIASES:
        return named_profile(spec, devices)
    if spec.endswith(".json") or os.path.sep in spec or os.path.exists(spec):  # a file (or a directory, said so)
        return load_profile(spec)
    return named_profile(spec, devices)  # raises the "unknown profile" error


def _gemm_to_core(d: dict, what: str):
    try:
        measured = sorted((float(w), float(r)) for w, r in d.get("measured", []))
        g = P.GemmRate(float(d.get("peak_flops", 0.0)), float(d.get("half_work_flops", 0.0)))
    except (TypeError, ValueError, AttributeError):
        raise ConfigError(f"hardware profile: bad GEMM rate for {what}") from None
    if any(w <= 0 or r <= 0 for w, r in measured):
        raise ConfigError(f"hardware profile: GEMM measurements for {what} must be positive")
    g.measured = measured
    return g


def _table_to_core(table, d: dict, what: str, lists: tuple, ints: tuple = ()):
    """A measured table of the C++ model (LayerTimes, StepPhases) from its profile dict,
    whose keys are the table's fields; checked by the table itself."""
    try:
        for key in lists:
            setattr(table, key, [float(v) for v in d[key]])
        for key in ints:
            setattr(table, key, int(d[key]))
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"hardware profile: malformed {what}") from None
    table.check(f"hardware profile: {what}")
    return table


LAYER_COLD_KEYS = ("forward_cold", "backward_cold", "backward_weights_cold")


def _layers_to_core(d: dict, what: str):
    # the cold tables where topo timed them (calibrations from before have the warm ones only)
    cold = LAYER_COLD_KEYS if any(key in d for key in LAYER_COLD_KEYS) else ()
    return _table_to_core(P.LayerTimes(), d, what, ("rows", "widths", "forward", "backward", "backward_weights", *cold))


def _phases_to_core(d: dict, what: str):
    return _table_to_core(P.StepPhases(), d, what, ("params", "update_s", "wait_s", "wait_spread_s"), ("ranks",))


def checked_placement(profile: dict) -> Optional[dict]:
    """profile["placement"]: `topo`'s readings of where the ranks' cores sat (CPU
    calibrations of several ranks on a node since 2026-11-27), checked; None where there
    is none. A malformed field (a hand-edited profile) is a one-line ConfigError."""
    placement = profile.get("placement")
    if placement is None:
        return None

    def malformed(why: str) -> ConfigError:
        return ConfigError(f"hardware profile '{profile.get('name', '?')}' is malformed (placement: {why})")

    def round_trips(key: str, count: Optional[int] = None) -> None:
        if not round_trips_readable(placement.get(key), count):
            raise malformed(f"{key} must be a list of {count or 'one or more'} positive round trips in ns")

    if not isinstance(placement, dict):
        raise malformed("not an object")
    round_trips("readings_ns")
    round_trips("wait_probe_ns", 2)
    if "other_wait_probe_ns" in placement:
        round_trips("other_wait_probe_ns", 2)
        share = placement.get("other_share")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise malformed(f"other_share must be in [0, 1], got {share!r}")
    return placement


def placement_moved_in(profile: dict) -> bool:
    """Whether the ranks' cores were seen to change cache domains: during the calibration
    (`topo`'s readings), or around a step of a run since that the bands left out
    (error_model "placed_elsewhere", history.placed_elsewhere)."""
    placement = checked_placement(profile)
    if placement is None:
        return False
    bands = profile.get("error_model")
    return placement_moved(placement["readings_ns"]) or (
        isinstance(bands, dict) and bool(bands.get("placed_elsewhere"))
    )


def placement_profile(profile: dict, probe: str) -> Optional[dict]:
    """The calibration with the ranks' cores held where `topo`'s `probe` ("first", or
    "second" where the watch found them elsewhere: profile["placement"]
    ["other_wait_probe_ns"]) of the wait after backward found them: that probe's table on
    every device, unweighted. None for "second" where topo probed one placement."""
    placement = checked_placement(profile) or {}
    if "other_wait_probe_ns" not in placement:
        return None if probe == "second" else profile
    devices = list(profile.get("devices") or [])
    if any("step_phases" in d and "step_phases_other_placement" not in d for d in devices):
        raise ConfigError(
            f"hardware profile '{profile.get('name', '?')}' is malformed (placement: a second probe "
            "of the wait without every device's step_phases_other_placement)"
        )
    if probe == "first":
        return {**profile, "placement": {**placement, "other_share": 0.0}}
    return {
        **profile,
        "devices": [
            {**d, "step_phases": d["step_phases_other_placement"], "step_phases_other_placement": d["step_phases"]}
            if "step_phases" in d
            else d
            for d in devices
        ],
        "placement": {
            **placement,
            "wait_probe_ns": placement["other_wait_probe_ns"],
            "other_wait_probe_ns": placement["wait_probe_ns"],
            "other_share": 0.0,
        },
    }


def second_placement_share(profile: dict) -> float:
    """The weight of the second probe's table (the share of topo's samples that found the
    ranks' cores in its placement); 0 where there is none."""
    placement = checked_placement(profile) or {}
    return float(placement["other_share"]) if "other_wait_probe_ns" in placement else 0.0


def _placement_weighted(phases: dict, other: Optional[dict], share: float) -> dict:
    """A device's multi-rank in-step phases where topo probed them in two placements of the
    ranks' cores, which moved between them: each cell the two weighted by the share of
    time the cores spent in each (a step's mean over a run that meets both)."""
    if share == 0.0:
        return phases
    if not isinstance(other, dict) or not isinstance(phases, dict) or list(other["params"]) != list(phases["params"]):
        raise ConfigError(
            "hardware profile is malformed (placement: step_phases_other_placement must be measured "
            "on the step_phases' parameter counts)"
        )
    return {
        **phases,
        **{
            k: [(1 - share) * float(a) + share * float(b) for a, b in zip(phases[k], other[k])]
            for k in ("update_s", "wait_s", "wait_spread_s")
        },
    }


def _wait_spread(phases: dict, moved: bool, measured_bands: bool) -> dict:
    """The in-step phases with the wait's spread that joins the selector's error band: a
    step's jitter (90th percentile less the median) where the bands were not measured on
    timed steps, none where they were (a calibration's held-out steps: their medians'
    wandering is in the bands, and a step's jitter says little of a median). A multi-rank
    wait measured in one placement of the cores may be met in another (on our VMs the 2-rank
    wait after backward doubled across cache domains): where the calibration saw them move,
    the spread is at least the wait itself, measured bands or not."""
    if not isinstance(phases, dict) or not isinstance(phases.get("wait_spread_s"), list):
        return phases  # (a malformed table is _phases_to_core's to refuse)
    try:
        spread = [float(s) for s in phases["wait_spread_s"]]
        if not all(math.isfinite(s) and s >= 0 for s in spread):
            return phases  # a spread that is not a duration: _phases_to_core's to refuse
        if measured_bands:
            spread = [0.0] * len(spread)
        if moved and int(phases.get("ranks", 1)) >= 2:
            spread = [max(s, float(w)) for s, w in zip(spread, phases["wait_s"])]
    except (TypeError, ValueError, KeyError):
        return phases
    return {**phases, "wait_spread_s": spread}


def _band(pair, key: str):
    """The ErrorBand of a profile's [low, high] pair under error_model.key."""
    if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
        raise ConfigError(f"hardware profile is malformed (error_model.{key} must be [low, high])")
    band = P.ErrorBand()
    band.low, band.high = float(pair[0]), float(pair[1])
    return band


# A band of log(measured / predicted) past this factor either way says the model does not
# describe the steps it was checked on (edited rates, a calibration of a busy hour).
UNSURE_FACTOR = 2.0


def unsure_bands(error) -> Optional[str]:
    """Why predictions from a profile's ErrorModel (to_core's hw.error) are too unsure to
    read as more than a guess, or None: a band of compute or communication spanning more
    than UNSURE_FACTOR either way."""
    wide = [
        (name, band)
        for name, band in (
            ("compute", error.compute),
            ("compute on several", error.compute_together),
            ("communication", error.comm),
        )
        if max(-band.low, band.high) > math.log(UNSURE_FACTOR)
    ]
    if not wide:
        return None
    name, band = max(wide, key=lambda nb: max(-nb[1].low, nb[1].high))
    return (
        f"the profile's {name} band spans x{math.exp(band.low):.2g} to x{math.exp(band.high):.2g} of the "
        f"model: the model misses the steps it was checked on by more than {UNSURE_FACTOR:g}x, and its "
        "intervals are that wide (calibrate again: `mgpu topo`)"
    )


def _error_to_core(profile: dict):
    """The profile's ErrorModel: its "error_model" (bands of log(measured / predicted)), or,
    for a profile written before those, its "model_error" e as the band log(1 -+ e) on
    compute and communication alike."""
    e = P.ErrorModel()
    given = profile.get("error_model")
    if given is not None:
        if not isinstance(given, dict):
            raise ConfigError("hardware profile is malformed (error_model must be an object)")
        for key in ("compute", "compute_together", "comm"):
            pair = given.get(key, given.get("compute")) if key == "compute_together" else given.get(key)
            setattr(e, key, _band(pair, key))
        if given.get("speedup") is not None:  # measured on held-out steps (topo)
            e.speedup, e.speedup_measured = _band(given["speedup"], "speedup"), True
        e.compute_shared = bool(given.get("compute_shared", True))
        e.step_bands = bool(given.get("step_bands", False))
        e.source = str(given.get("source", "the profile's error bands"))
        return e
    error = float(profile.get("model_error", 0.25))
    if not 0 <= error < 1:
        raise ConfigError(f"hardware profile: model_error is a relative error in [0, 1), got {error}")
    for key in ("compute", "compute_together", "comm"):
        setattr(e, key, _band([math.log1p(-error), math.log1p(error)], key))
    e.source = f"the profile's model error +-{error:.0%}, not validated"
    return e


def to_core(profile: dict, devices: Optional[int] = None):
    """The C++ HardwareProfile of a profile dict (repeating the last device up to `devices`)."""
    try:
        hw = P.HardwareProfile()
        hw.name, hw.source = str(profile["name"]), str(profile.get("source", "named"))
        entries = list(profile["devices"])
        if not entries:
            raise ConfigError("hardware profile lists no devices")
        if devices and devices > len(entries) and hw.source != "calibrated":
            entries += [entries[-1]] * (devices - len(entries))
        core_devices = []
        moved, share = placement_moved_in(profile), second_placement_share(profile)
        hw.error = _error_to_core(profile)  # before the devices: whether its bands are of timed steps
        measured_bands = hw.error.step_bands
        for i, e in enumerate(entries):
            d = P.DeviceProfile()
            d.name, d.kind = str(e.get("name", f"device {i}")), str(e.get("kind", "cuda"))
            for prec in PRECISIONS:
                if prec in e:
                    setattr(d, prec, _gemm_to_core(e[prec], f"{d.name} {prec}"))
            d.memory_bytes = float(e.get("memory_bytes", 0.0))
            d.memory_bandwidth = float(e["memory_bandwidth"])
            d.host_to_device_bandwidth = float(e.get("host_to_device_bandwidth", 0.0))
            d.launch_overhead_s = float(e.get("launch_overhead_s", 0.0))
            # Calibrations before topo measured it: the published figure on GPUs (a CPU's
            # recorded calls cost what its launches do).
            d.graph_node_s = float(e.get("graph_node_s", GRAPH_NODE_S if d.kind != "cpu" else 0.0))
            d.captures = e.get("captures", True) is not False  # topo found capture failing: training runs uncaptured
            d.context_bytes = float(e.get("context_bytes", 0.0))
            d.dropout_s_per_unit = float(e.get("dropout_s_per_unit", 0.0))
            d.cache_bytes = float(e.get("cache_bytes", 0.0))
            if e.get("layer_times"):
                d.layers = _layers_to_core(e["layer_times"], f"{d.name} layer times")
            if e.get("layer_times_alone"):
                d.layers_alone = _layers_to_core(e["layer_times_alone"], f"{d.name} layer times (alone)")
            d.pass_bandwidth = [(float(b), float(r)) for b, r in e.get("pass_bandwidth", [])]
            d.pass_bandwidth_alone = [(float(b), float(r)) for b, r in e.get("pass_bandwidth_alone", [])]
            if e.get("step_phases"):
                phases = _placement_weighted(e["step_phases"], e.get("step_phases_other_placement"), share)
                d.step_phases = _phases_to_core(_wait_spread(phases, moved, measured_bands), f"{d.name} step phases")
            if e.get("step_phases_alone"):
                alone = _wait_spread(e["step_phases_alone"], False, measured_bands)
                d.step_phases_alone = _phases_to_core(alone, f"{d.name} step phases (alone)")
            core_devices.append(d)
        hw.devices = core_devices
        link = P.LinkProfile()
        l = profile["link"]
        link.name, link.alpha_s, link.bus_bandwidth = (
            str(l.get("name", "")),
            float(l["alpha_s"]),
            float(l["bus_bandwidth"]),
        )
        link.overlaps_compute, link.buffer_bytes = (
            bool(l.get("overlaps_compute", True)),
            float(l.get("buffer_bytes", 0.0)),
        )
        link.step_sync_s = float(l.get("step_sync_s", 0.0))
        link.measured = sorted((float(b), float(t)) for b, t in l.get("measured", []) if b > 0 and t > 0)
        link.measured_devices = int(l.get("fitted_at_ranks", 0)) if link.measured else 0
        if l.get("nccl"):
            link.intra = model_from_dict(l["nccl"]["intra"])
            link.inter = model_from_dict(l["nccl"].get("inter"))
            link.gpus_per_node = int(l["nccl"].get("gpus_per_node", 0))
        hw.link = link
        hw.step_overhead_s = float(profile.get("step_overhead_s", 0.0))
    except ConfigError:
        raise  # already one line that names what is wrong
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            f"hardware profile '{profile.get('name', '?')}' is malformed ({type(e).__name__}: {e})"
        ) from None
    return hw


def net_step_overheads(profile: dict) -> None:
    """Each device's step overhead as the model adds it to a step: topo's probe step
    (PROBE_LAYERS at PROBE_ROWS) less the model's price of the probe's own work, which
    every predicted step prices already (on a CPU 3 of 8 us; on a GPU the probe's
    launches and kernels, most of it). The probe's time stays beside it as probe_step_s
    (and is what a second call starts from)."""
    w = build_workload(None, PROBE_LAYERS, None, PROBE_ROWS, "fp32", "sgd", 4.0, 0.0, "fp32", "auto", 1)
    for e in profile["devices"]:
        e["probe_step_s"] = e.get("probe_step_s", e["step_overhead_s"])
        alone = {**profile, "devices": [{**e, "step_overhead_s": 0.0}], "step_overhead_s": 0.0}
        priced = P.predict(w, to_core(alone, 1), 1, P.Options()).step_s
        e["step_overhead_s"] = max(0.0, e["probe_step_s"] - priced)
    profile["step_overhead_s"] = max(e["step_overhead_s"] for e in profile["devices"])


def calibrated_kinds(profile: dict, ranks: Optional[int] = None) -> list:
    """The kinds of device ("cpu", "cuda") a calibration measured for a job's first `ranks`
    ranks (all: None), sorted (a device without a kind is a GPU, as calibrations before CPUs had)."""
    return sorted({str(d.get("kind", "cuda")) for d in (profile.get("devices") or [])[:ranks]})


def profile_is_emulated(prof: dict) -> bool:
    """Whether a profile describes mgpu's emulated GPUs: its flag, or (profiles from before
    the flag) a device named as the emulation names its GPUs."""
    if "gpu_emulation" in prof:
        return bool(prof["gpu_emulation"])
    return any("mgpu cpu emulation" in str(d.get("name", "")).lower() for d in prof.get("devices") or [])


def emulation_mismatch(prof: dict, device: str) -> Optional[str]:
    """Why a calibration cannot price a job on `device` here as to emulation (measured on
    emulated GPUs for a real one, or the reverse), or None."""
    if device != "cuda":
        return None
    here = gpus_emulated()
    there = profile_is_emulated(prof)
    if here == there:
        return None
    return (
        f"the calibration was measured on {'emulated' if there else 'real'} GPUs and this job runs on "
        f"{'emulated' if here else 'real'} ones (calibrate with `mgpu topo --device cuda` "
        f"{'under MGPU_EMULATE_GPU' if here else 'without MGPU_EMULATE_GPU'})"
    )
