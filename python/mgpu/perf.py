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

import json
import math
import operator
import os
import socket
import time
from typing import Optional, Sequence

from . import _core, gemm_fit, gpus_emulated
from .atomic import atomic_file
from .costsheet import GRAPH_NODE_S, GRAPH_NODE_SOURCE, H100_SXM, HOST_LOOP_S
from .config import GRAD_DTYPES, GRAPH_MODES, PRESETS
from .errors import ConfigError

P = _core.perf
PROFILE_FORMAT = "mgpu-hardware-profile"
PROFILE_VERSION = 1
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
NCCL_BUFFER_BYTES = 64e6  # NCCL's communication buffers per GPU (a profile's buffer_bytes)
# A GPU's per-step latencies, from the cost sheet's published figures (costsheet.py; one
# consumer GPU measured, used for every GPU until topo measures one): a short kernel in a
# stream of them, and the step's overhead, the host loop and the verdict's
# synchronisation that ends each step. So `recommend` and `bench --explain` price a
# step alike.
GPU_LAUNCH_S = H100_SXM.stream_kernel_s
GPU_STEP_OVERHEAD_S = HOST_LOOP_S + H100_SXM.sync_s
# topo's step-overhead probe: a training step whose math is next to nothing
PROBE_LAYERS, PROBE_ROWS = [8, 8, 8], 8

# Device figures. GEMM rates: fitted to published GEMM benchmarks per GPU and
# precision (gemm_fit, data/gemm_published.json) where a table has them; else the
# vendor's dense peak derated to about 0.7 with a guessed half-peak work (half), and
# a half precision absent from both falls back to fp32 (conservative). Memory
# bandwidth: about 0.85 of the spec unless a published measurement is named.
_GPU_TYPES = {
    "rtx-4070-ti-super": dict(name="RTX 4070 Ti SUPER", fp32=30e12, tf32=40e12, bf16=80e12, fp16=80e12,
                              half=3e8, memory=16e9, bandwidth=600e9, h2d=12e9, context=0.5e9),
    # NVIDIA RTX 5080 spec: 960 GB/s GDDR7, 16 GB
    "rtx-5080": dict(name="RTX 5080", memory=16e9, bandwidth=816e9, h2d=24e9, context=0.5e9),
    # NVIDIA RTX 4060 spec: 272 GB/s GDDR6, 8 GB (PCIe 4.0 x8)
    "rtx-4060": dict(name="RTX 4060", memory=8e9, bandwidth=230e9, h2d=12e9, context=0.5e9),
    # A100 SXM4 80GB: HBM copy 1.61 TB/s (Azure ND A100 v4 measurements)
    "a100-80gb": dict(name="A100 SXM4 80GB", memory=80e9, bandwidth=1.61e12, h2d=24e9, context=0.6e9),
    # A100 SXM4 40GB: the 80GB part's SMs and clocks (its GEMM tables), 1.56 TB/s HBM2 spec
    "a100-40gb": dict(name="A100 SXM4 40GB", memory=40e9, bandwidth=1.33e12, h2d=24e9, context=0.6e9),
    # H100 SXM 80GB: HBM copy 2.90 TB/s, host<->device 51 GB/s (Azure ND H100 v5)
    "h100-sxm": dict(name="H100 SXM 80GB", memory=80e9, bandwidth=H100_SXM.hbm_bytes_per_s,
                     h2d=H100_SXM.h2d_bytes_per_s, context=0.6e9),
    # H100 PCIe 80GB spec: 2.0 TB/s
    "h100-pcie": dict(name="H100 PCIe 80GB", memory=80e9, bandwidth=1.7e12, h2d=25e9, context=0.6e9),
}
_AZURE = "https://github.com/Azure/AI-benchmarking-guide/blob/main/Azure_Results/"
_SPEC = {
    "h100-sxm-azure": {"url": _AZURE + "ND_H100_v5_results.md", "figure": "H100 HBM bandwidth 2.90 TB/s, host-device 51 GB/s"},
    "a100-azure": {"url": _AZURE + "ND_A100_v4_results.md", "figure": "A100 HBM 1.61 TB/s"},
    "h100-pcie": {"url": "https://www.nvidia.com/en-us/data-center/h100/", "figure": "H100 PCIe memory bandwidth 2.0 TB/s"},
    "a100-40gb": {"url": "https://www.nvidia.com/en-us/data-center/a100/", "figure": "A100 40GB SXM: 1,555 GB/s HBM2"},
    "rtx-5080": {"url": "https://www.nvidia.com/en-us/geforce/graphics-cards/50-series/rtx-5080/",
                 "figure": "RTX 5080: 960 GB/s, 16 GB"},
    "rtx-4060": {"url": "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4060-4060ti/",
                 "figure": "RTX 4060: 272 GB/s, 8 GB"},
    "graph-node": {"url": GRAPH_NODE_SOURCE,
                   "figure": f"a replayed CUDA graph costs {GRAPH_NODE_S * 1e6:.2f} us per node beyond its kernels' "
                             "work (RTX 5070 Ti, CUDA 13; the one published figure found, used for every GPU)"},
    "latencies": {"url": GRAPH_NODE_SOURCE,
                  "figure": f"a short kernel in a stream {GPU_LAUNCH_S * 1e6:.1f} us (the larger of a "
                            f"{H100_SXM.launch_s * 1e6:.1f} us enqueue, measured there, and an assumed 2 us kernel + "
                            f"1 us gap; the same source timed 6.3-7.5 us a kernel launched one by one, on a WSL2 "
                            f"laptop, which this assumes a Linux server's GPU does not pay: topo measures it); "
                            f"a step's overhead {GPU_STEP_OVERHEAD_S * 1e6:.0f} us: the "
                            f"{H100_SXM.sync_s * 1e6:.0f} us synchronisation measured there and mgpu's "
                            f"{HOST_LOOP_S * 1e6:.0f} us host loop, measured on its CPU backend (as bench --explain)"},
}


def _link_sources(link: str) -> list:
    """The published tables and anchors behind a fitted link (data/nccl_published.json)."""
    from .allreduce_fit import load_published
    doc = load_published()
    names = {link, _fitted_link(link).get("intra_from", link)}  # with the link it builds on
    out = [{"url": t["source"], "figure": f"allreduce table ({t['role']}): {t['system']}"}
           for t in doc["tables"] if t["profile"] in names]
    out += [{"url": a["source"], "figure": a["what"]} for a in doc["anchors"] if a["profile"] in names]
    return out


# Named profiles of real systems. 'link' names a fitted link in data/allreduce_fit.json.
NAMED_PROFILES = {
    "h100-sxm-8": dict(title="8x H100 SXM, NVLink 4 + NVSwitch (one node)", devices=["h100-sxm"] * 8,
                       link="h100-sxm-8", gpus_per_node=8, specs=["h100-sxm-azure"]),
    "a100-sxm-8": dict(title="8x A100 SXM4 80GB, NVLink 3 + NVSwitch (one node)", devices=["a100-80gb"] * 8,
                       link="a100-sxm-8", gpus_per_node=8, specs=["a100-azure"]),
    "h100-pcie-nvlink-2": dict(title="2x H100 PCIe with an NVLink bridge", devices=["h100-pcie"] * 2,
                               link="h100-pcie-nvlink-2", gpus_per_node=2, specs=["h100-pcie"]),
    "pcie-pair-no-p2p": dict(title="2 consumer GPUs on PCIe without peer-to-peer (RTX 4070 Ti SUPER pair)",
                             devices=["rtx-4070-ti-super"] * 2, link="pcie-pair-no-p2p", gpus_per_node=2, specs=[]),
    "pcie-pair-p2p": dict(title="2 consumer GPUs on PCIe with peer-to-peer (RTX 4070 Ti SUPER pair; "
                                "busbw from 4x RTX 4090 with P2P)",
                          devices=["rtx-4070-ti-super"] * 2, link="pcie-pair-p2p", gpus_per_node=2, specs=[]),
    "rtx5080-rtx4060": dict(title="the seeds' mixed pair: RTX 5080 + RTX 4060 on PCIe without peer-to-peer",
                            devices=["rtx-5080", "rtx-4060"], link="pcie-pair-no-p2p", gpus_per_node=2,
                            specs=["rtx-5080", "rtx-4060"]),
    "h100-ib-2x8": dict(title="2 nodes x 8 H100 SXM, InfiniBand NDR (one 400G NIC per GPU)", devices=["h100-sxm"] * 16,
                        link="h100-ib-2x8", gpus_per_node=8, specs=["h100-sxm-azure"]),
    "a100-ib-2x8": dict(title="2 nodes x 8 A100 SXM4, InfiniBand HDR (8x 200G per node)", devices=["a100-80gb"] * 16,
                        link="a100-ib-2x8", gpus_per_node=8, specs=["a100-azure"]),
    "a100-roce-2x8": dict(title="2 nodes x 8 A100 SXM4, RoCE v2 Ethernet (OCI BM.GPU4.8, 16x 100G per node)",
                          devices=["a100-40gb"] * 16, link="a100-roce-2x8", gpus_per_node=8, specs=["a100-40gb"]),
    "h100-ethernet-2x8": dict(title="2 nodes x 8 H100, Ethernet (GCP A3 Mega, GPUDirect-TCPXO)",
                              devices=["h100-sxm"] * 16, link="h100-ethernet-2x8", gpus_per_node=8,
                              specs=["h100-sxm-azure"]),
    "h100-efa-2x8": dict(title="2 nodes x 8 H100, AWS Elastic Fabric Adapter (p5.48xlarge, 32x 100G per node)",
                         devices=["h100-sxm"] * 16, link="h100-efa-2x8", gpus_per_node=8,
                         specs=["h100-sxm-azure"]),
    "cpu": dict(title="CPU ranks, MPI over shared memory (nominal)", devices=None, link=None, gpus_per_node=0, specs=[]),
}
# Names of v1 (round-number profiles) that keep working.
PROFILE_ALIASES = {"pcie-host-bridge": "pcie-pair-no-p2p", "pcie-p2p": "pcie-pair-p2p", "nvlink": "a100-sxm-8",
                   "h100-nvswitch": "h100-sxm-8"}


def list_profiles() -> str:
    lines = []
    for name, spec in NAMED_PROFILES.items():
        lines.append(f"{name:20s} {spec['title']}")
        if spec["link"]:
            for src in _profile_sources(spec):
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
    g, out = _GPU_TYPES[gpu], {}
    for p in PRECISIONS:
        fit = gemm_fit.rate(gpu, p)
        if fit:
            out[p] = _gemm_dict(fit["peak_flops"], fit["half_work_flops"])
        elif p in g:
            out[p] = _gemm_dict(g[p], g["half"])
    return out


def _device_entry(gpu: str) -> dict:
    """A profile's device entry of a _GPU_TYPES kind."""
    g = _GPU_TYPES[gpu]
    return {"name": g["name"], "kind": "cuda", "memory_bytes": g["memory"], "memory_bandwidth": g["bandwidth"],
            "host_to_device_bandwidth": g["h2d"], "launch_overhead_s": GPU_LAUNCH_S, "graph_node_s": GRAPH_NODE_S,
            "context_bytes": g["context"], **_gemm_rates(gpu)}


def _profile_sources(spec: dict) -> list:
    """Where a named profile's figures come from: allreduce tables, GEMM tables, specs."""
    gemm = [src for gpu in dict.fromkeys(spec["devices"]) for src in gemm_fit.sources(gpu)]
    return (_link_sources(spec["link"]) + gemm + [_SPEC[k] for k in spec["specs"]]
            + [_SPEC["graph-node"], _SPEC["latencies"]])


def _fitted_link(link: str) -> dict:
    from .allreduce_fit import load_fitted
    links = load_fitted()["links"]
    if link not in links:
        raise ConfigError(f"no fitted allreduce parameters for link '{link}': run `python -m mgpu.allreduce_fit --refit`")
    return links[link]


def named_profile(name: str, devices: Optional[int] = None) -> dict:
    name = PROFILE_ALIASES.get(name, name)
    if name not in NAMED_PROFILES:
        raise ConfigError(f"unknown hardware profile '{name}' (expected one of {', '.join(NAMED_PROFILES)}, an alias "
                          f"({', '.join(PROFILE_ALIASES)}), 'calibrated', or a profile JSON path; "
                          "`mgpu recommend --list-profiles` lists them)")
    spec = NAMED_PROFILES[name]
    if spec["devices"] is None:
        device = {"name": "CPU core (AVX2/FMA, nominal)", "kind": "cpu", "fp32": _gemm_dict(90e9, 5e6),
                  "memory_bytes": 8e9, "memory_bandwidth": 15e9, "host_to_device_bandwidth": 0.0,
                  "launch_overhead_s": 1e-6, "context_bytes": 0.1e9}
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": name, "source": "named",
                "title": spec["title"], "sources": [],
                "devices": [dict(device) for _ in range(max(1, devices or 8))],
                "link": {"name": "MPI over shared memory (nominal)", "alpha_s": 5e-6, "bus_bandwidth": 5e9,
                         "overlaps_compute": False, "buffer_bytes": 0.0},
                "step_overhead_s": 2e-4, "model_error": 0.3}
    entries = []
    for key in spec["devices"]:
        entries.append(_device_entry(key))
    fit = _fitted_link(spec["link"])
    nccl = {"intra": fit["intra"], "gpus_per_node": spec["gpus_per_node"]}
    if fit.get("inter"):
        nccl["inter"] = fit["inter"]
    ring = fit["intra"].get("ring_busbw") or fit["intra"].get("nvls_busbw")
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": name, "source": "named",
            "title": spec["title"], "gpus_per_node": spec["gpus_per_node"],
            "sources": _profile_sources(spec),
            "devices": entries,
            "link": {"name": spec["title"], "alpha_s": 0.0, "bus_bandwidth": ring, "overlaps_compute": True,
                     "buffer_bytes": NCCL_BUFFER_BYTES, "nccl": nccl},
            "step_overhead_s": GPU_STEP_OVERHEAD_S, "model_error": 0.3}


def _known_gpu_type(name: str) -> Optional[str]:
    """The _GPU_TYPES entry a visible GPU's name is, or None."""
    n = name.upper()
    if "MIG" in n or "LAPTOP" in n or "NVL" in n:  # a slice, a mobile part, a 94 GB card of its own clocks
        return None
    if "H100" in n:  # "NVIDIA H100 80GB HBM3" is the SXM part
        return "h100-pcie" if "PCIE" in n else "h100-sxm"
    if "A100" in n and "SXM" in n:  # PCIe A100s run lower clocks
        return "a100-40gb" if "40GB" in n else "a100-80gb"
    if "RTX 5080" in n:
        return "rtx-5080"
    if "RTX 4060" in n and "TI" not in n.split("RTX 4060", 1)[1]:
        return "rtx-4060"
    return None


def detected_profile(devices: Optional[int] = None) -> Optional[dict]:
    """An uncalibrated profile of the visible GPUs, or None without GPUs: a GPU of a named
    profile (H100, A100 SXM, RTX 5080, RTX 4060) at its published GEMM rates, another
    estimated from its properties."""
    info = _core.build_info().get("cuda", {})
    gpus = info.get("devices", [])
    if not gpus:
        return None
    entries = []
    for g in gpus:
        known = _known_gpu_type(str(g.get("name", "")))
        if known:  # a GPU of a named profile: its published GEMM rates and bandwidths
            entry = _device_entry(known)
            entries.append({**entry, "name": g.get("name", "GPU"),
                            "memory_bytes": float(g.get("total_memory_mib", 0)) * 2 ** 20 or entry["memory_bytes"]})
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
        rates = {"fp32": fp32, "fp16": fp32 * 8.0} if cc.startswith("7.") else {
            "fp32": fp32, "tf32": fp32 * tensor / 2, "bf16": fp32 * tensor, "fp16": fp32 * tensor}
        entries.append({"name": g.get("name", "GPU"), "kind": "cuda", "memory_bytes": float(g.get("total_memory_mib", 0)) * 2 ** 20,
                        "memory_bandwidth": 1e12, "host_to_device_bandwidth": 20e9, "launch_overhead_s": GPU_LAUNCH_S,
                        "graph_node_s": GRAPH_NODE_S, "context_bytes": 0.6e9,
                        # a GEMM's fixed time as the fitted GPUs' small kernels take it
                        **{p: _gemm_dict(peak, peak * gemm_fit.TYPICAL_FIXED_S) for p, peak in rates.items()}})
    if devices and devices > len(entries):
        entries += [dict(entries[-1]) for _ in range(devices - len(entries))]
    emulated = gpus_emulated()
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "source": "detected", "devices": entries,
            "name": f"detected: {socket.gethostname()}" + (" (EMULATED GPUs: the CPU running mgpu's CUDA code)"
                                                           if emulated else ""),
            "gpu_emulation": emulated,
            "link": {"name": "assumed PCIe P2P", "alpha_s": 10e-6, "bus_bandwidth": 20e9, "overlaps_compute": True,
                     "buffer_bytes": 64e6},
            "step_overhead_s": GPU_STEP_OVERHEAD_S, "model_error": 0.35}


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
        raise ConfigError(f"hardware profile '{path}' is malformed: gpus_per_node must be an integer >= 0, "
                          f"got {per_node!r}")
    try:
        to_core(profile)  # validates the fields
    except ConfigError:
        raise
    except (AttributeError, TypeError, ValueError, KeyError, IndexError) as e:  # a field of the wrong shape
        raise ConfigError(f"hardware profile '{path}' is malformed ({type(e).__name__}: {e})") from None
    entries = profile["devices"]
    if profile.get("source") == "calibrated" and all(isinstance(e.get("step_overhead_s"), (int, float)) and
                                                     "probe_step_s" not in e for e in entries):
        # calibrated before topo took the probe's own work out of its step: the model
        # would price that work twice in every step (on a GPU, most of the probe)
        net_step_overheads(profile)
    return profile


def resolve_profile(spec: Optional[str], devices: Optional[int] = None) -> Optional[dict]:
    """'auto' (calibrated, else detected, else None), 'calibrated', a named profile, or a path."""
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
    if spec.endswith(".json") or os.path.sep in spec:
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
        v = placement.get(key)
        if (not isinstance(v, list) or not v or (count is not None and len(v) != count) or
                not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0
                        for t in v)):
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
    """Whether `topo` saw the ranks' cores change cache domains during the calibration."""
    from .process_group import placement_moved
    placement = checked_placement(profile)
    return placement is not None and placement_moved(placement["readings_ns"])


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
        raise ConfigError(f"hardware profile '{profile.get('name', '?')}' is malformed (placement: a second probe "
                          "of the wait without every device's step_phases_other_placement)")
    if probe == "first":
        return {**profile, "placement": {**placement, "other_share": 0.0}}
    return {**profile, "devices": [{**d, "step_phases": d["step_phases_other_placement"],
                                    "step_phases_other_placement": d["step_phases"]}
                                   if "step_phases" in d else d for d in devices],
            "placement": {**placement, "wait_probe_ns": placement["other_wait_probe_ns"],
                          "other_wait_probe_ns": placement["wait_probe_ns"], "other_share": 0.0}}


def _other_share(profile: dict) -> float:
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
        raise ConfigError("hardware profile is malformed (placement: step_phases_other_placement must be measured "
                          "on the step_phases' parameter counts)")
    return {**phases, **{k: [(1 - share) * float(a) + share * float(b) for a, b in zip(phases[k], other[k])]
                         for k in ("update_s", "wait_s", "wait_spread_s")}}


def _placement_widened(phases: dict, moved: bool) -> dict:
    """A multi-rank wait measured in one placement of the cores may be met in another
    (on our VMs the 2-rank wait after backward doubled across cache domains): where the
    calibration saw them move, its spread, which widens the selector's error band, is at
    least the wait itself."""
    if not moved or not isinstance(phases, dict) or int(phases.get("ranks", 1)) < 2:
        return phases  # (a malformed table is _phases_to_core's to refuse)
    return {**phases, "wait_spread_s": [max(float(s), float(w)) for s, w in zip(phases["wait_spread_s"],
                                                                               phases["wait_s"])]}


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
        moved, share = placement_moved_in(profile), _other_share(profile)
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
                d.step_phases = _phases_to_core(_placement_widened(phases, moved), f"{d.name} step phases")
            if e.get("step_phases_alone"):
                d.step_phases_alone = _phases_to_core(e["step_phases_alone"], f"{d.name} step phases (alone)")
            core_devices.append(d)
        hw.devices = core_devices
        link = P.LinkProfile()
        l = profile["link"]
        link.name, link.alpha_s, link.bus_bandwidth = str(l.get("name", "")), float(l["alpha_s"]), float(l["bus_bandwidth"])
        link.overlaps_compute, link.buffer_bytes = bool(l.get("overlaps_compute", True)), float(l.get("buffer_bytes", 0.0))
        link.step_sync_s = float(l.get("step_sync_s", 0.0))
        link.measured = sorted((float(b), float(t)) for b, t in l.get("measured", []) if b > 0 and t > 0)
        link.measured_devices = int(l.get("fitted_at_ranks", 0)) if link.measured else 0
        if l.get("nccl"):
            from .allreduce_fit import model_from_dict
            link.intra = model_from_dict(l["nccl"]["intra"])
            link.inter = model_from_dict(l["nccl"].get("inter"))
            link.gpus_per_node = int(l["nccl"].get("gpus_per_node", 0))
        hw.link = link
        hw.step_overhead_s = float(profile.get("step_overhead_s", 0.0))
        hw.model_error = float(profile.get("model_error", 0.25))
    except ConfigError:
        raise  # already one line that names what is wrong
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"hardware profile '{profile.get('name', '?')}' is malformed ({type(e).__name__}: {e})") from None
    return hw


# --- the selector --------------------------------------------------------------------
def _workload(model: Optional[str], layers: Optional[Sequence[int]], params: Optional[int], batch_size: int,
              precision: str, optimizer: str, bucket_mb: float, dropout: Optional[float] = None,
              grad_dtype: str = "fp32", cuda_graph: str = "auto", accumulate: int = 1):
    w = P.Workload()
    try:
        k = operator.index(accumulate) if not isinstance(accumulate, bool) else None
    except TypeError:
        k = None
    if k is None or not 1 <= k <= 2 ** 62:
        raise ConfigError(f"micro-batches per step (accumulate) must be an integer in 1..2^62, got {accumulate!r}")
    w.accumulate = k
    if grad_dtype not in GRAD_DTYPES:
        raise ConfigError(f"unknown gradient dtype '{grad_dtype}' (expected {', '.join(GRAD_DTYPES)})")
    w.grad_dtype = grad_dtype
    if cuda_graph not in GRAPH_MODES:
        raise ConfigError(f"unknown CUDA graph mode '{cuda_graph}' (expected {', '.join(GRAPH_MODES)})")
    w.cuda_graph = cuda_graph
    if dropout is not None:
        if not 0 <= dropout < 1:
            raise ConfigError(f"dropout must be in [0, 1), got {dropout}")
        w.dropout = float(dropout)
    elif model is not None and model in PRESETS:
        w.dropout = PRESETS[model].dropout
    if sum(v is not None for v in (model, layers, params)) != 1:
        raise ConfigError("give exactly one of a model preset, layer sizes or a parameter count")
    if model is not None:
        if model not in PRESETS:
            raise ConfigError(f"unknown model preset '{model}' (expected one of {', '.join(PRESETS)})")
        p = PRESETS[model]
        w.layers = [p.in_features or 50, *p.hidden, p.out_features or 3]
    elif layers is not None:
        w.layers = [int(v) for v in layers]
    else:
        if int(params) < 1:
            raise ConfigError(f"parameter count must be >= 1, got {params}")
        w.params = int(params)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch size must be an integer >= 1, got {batch_size}")
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision '{precision}' (expected {', '.join(PRECISIONS)})")
    if not bucket_mb > 0:
        raise ConfigError(f"bucket size must be > 0 MB, got {bucket_mb}")
    w.global_batch, w.precision, w.optimizer = batch_size, precision, optimizer
    w.bucket_elems = max(1, int(bucket_mb * (1 << 20) / 4))
    return w


MEMORY_MARGIN = 0.8  # the fraction of a device's memory a recommendation plans to use


def net_step_overheads(profile: dict) -> None:
    """Each device's step overhead as the model adds it to a step: topo's probe step
    (PROBE_LAYERS at PROBE_ROWS) less the model's price of the probe's own work, which
    every predicted step prices already (on a CPU 3 of 8 us; on a GPU the probe's
    launches and kernels, most of it). The probe's time stays beside it as probe_step_s
    (and is what a second call starts from)."""
    w = _workload(None, PROBE_LAYERS, None, PROBE_ROWS, "fp32", "sgd", 4.0, 0.0, "fp32", "auto", 1)
    for e in profile["devices"]:
        e["probe_step_s"] = e.get("probe_step_s", e["step_overhead_s"])
        alone = {**profile, "devices": [{**e, "step_overhead_s": 0.0}], "step_overhead_s": 0.0}
        priced = P.predict(w, to_core(alone, 1), 1, P.Options()).step_s
        e["step_overhead_s"] = max(0.0, e["probe_step_s"] - priced)
    profile["step_overhead_s"] = max(e["step_overhead_s"] for e in profile["devices"])


def training_memory_bytes(layers: Sequence[int], rows: int, *, optimizer: str = "adamw", precision: str = "fp32",
                          dropout: float = 0.0) -> float:
    """Bytes one rank holds to train `layers` on `rows` samples a step: weights, gradients,
    optimizer state and activations, as the selector prices them."""
    return P.training_memory_bytes(_workload(None, layers, None, rows, precision, optimizer, 4.0, dropout), rows)


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
    return (f"the calibration was measured on {'emulated' if there else 'real'} GPUs and this job runs on "
            f"{'emulated' if here else 'real'} ones (calibrate with `mgpu topo --device cuda` "
            f"{'under MGPU_EMULATE_GPU' if here else 'without MGPU_EMULATE_GPU'})")


def gpu_step_memory(gpu: str, layers: Sequence[int], batch: int, ranks: int, *, optimizer: str, precision: str,
                    dropout: float, accumulate: int = 1) -> dict:
    """What each of `ranks` GPUs of a named type (_GPU_TYPES) holds for a step, as the
    selector prices it (the largest share's micro-batch, weights, gradients, optimizer
    state, the CUDA context, NCCL's buffers on several): bytes, usable_bytes, fits."""
    prof = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": f"{ranks} x {gpu}", "source": "named",
            "devices": [_device_entry(gpu) for _ in range(ranks)], "step_overhead_s": GPU_STEP_OVERHEAD_S,
            "model_error": 0.3, "link": {"name": "NCCL", "alpha_s": 0.0, "bus_bandwidth": 1e11,
                                         "overlaps_compute": True, "buffer_bytes": NCCL_BUFFER_BYTES}}
    options = P.Options()
    options.memory_margin = MEMORY_MARGIN
    w = _workload(None, layers, None, batch, precision, optimizer, 4.0, dropout, accumulate=accumulate)
    p = P.predict(w, to_core(prof, ranks), ranks, options)
    return {"bytes": p.memory_bytes, "usable_bytes": p.memory_usable_bytes, "fits": bool(p.memory_fits)}


# What a rank allocates beyond what training_memory_bytes prices, measured with train on
# Zen 4 (peak RSS growth from the check to the end of a run, 0.07-1.2 GB models, 8-8000
# rows, 1-2 ranks; tests/unit/test_memory_check.py): a fixed 29-62 MB (the BLAS threads'
# and MPI's buffers) and up to 5 % more with the rows (numpy batches, the allocator). On
# GPUs the same figures stand for cuBLAS's and cuRAND's buffers, not measured there.
RUNTIME_OVERHEAD_BYTES = 64 * 2 ** 20
RUNTIME_OVERHEAD_FRACTION = 0.10
# OpenMPI's allreduce of a bucket allocates temporaries of about its size: 2 ranks'
# train at 16 MiB buckets grew rank 0's peak RSS 21-40 MB more than at 4 MiB (Zen 4,
# 9.5M parameters); priced as this many buckets on every multi-rank MPI run.
MPI_TEMPORARY_BUCKETS = 2


def _buffer_rows(rows: int, eval_rows: int) -> tuple:
    """(rows of one validation chunk, rows the activation buffers end up holding). The
    buffers grow to max(rows, 1.5x what they held) (MLP::ensure_capacity): a chunk after
    the steps' rows may leave half as many again (on GPUs all of it allocated)."""
    chunk = min(int(eval_rows), _core.MLP.EVAL_CHUNK_ROWS)
    return chunk, rows if chunk <= rows else max(chunk, rows + rows // 2)


def _parameter_count(layers: Sequence[int]) -> int:
    return sum(fan_out * (fan_in + 1) for fan_in, fan_out in zip(layers, layers[1:]))


def rank_memory_bytes(layers: Sequence[int], rows: int, *, optimizer: str, precision: str, dropout: float,
                      eval_rows: int = 0, nccl: bool = False, mpi_bucket_bytes: float = 0.0) -> float:
    """Bytes a training rank allocates: training_memory_bytes at the most rows its buffers
    hold (eval_rows: the validation rows it evaluates, in chunks of EVAL_CHUNK_ROWS), with
    the runtime's buffers and margin, NCCL's buffers where it allreduces over NCCL, and
    MPI's temporaries for a bucket of mpi_bucket_bytes where it allreduces over MPI."""
    _, activation_rows = _buffer_rows(rows, eval_rows)
    model = training_memory_bytes(layers, activation_rows, optimizer=optimizer, precision=precision, dropout=dropout)
    gradient_bytes = 4.0 * _parameter_count(layers)
    return (model * (1 + RUNTIME_OVERHEAD_FRACTION) + RUNTIME_OVERHEAD_BYTES + (NCCL_BUFFER_BYTES if nccl else 0.0) +
            MPI_TEMPORARY_BUCKETS * min(max(mpi_bucket_bytes, 0.0), gradient_bytes))


def check_training_memory(layers: Sequence[int], rows: int, *, optimizer: str, precision: str, dropout: float,
                          device: str, device_index: int, local_ranks: int, eval_rows: int = 0,
                          nccl: bool = False, mpi_bucket_bytes: float = 0.0) -> None:
    """ConfigError when training `layers` on `rows` samples a rank cannot fit the memory a
    rank may use (its GPU's free memory, or the host's available memory over its ranks),
    instead of an allocation failing inside the run or the kernel's OOM killer ending a rank."""
    from .process_group import available_memory
    need = rank_memory_bytes(layers, rows, optimizer=optimizer, precision=precision, dropout=dropout,
                             eval_rows=eval_rows, nccl=nccl, mpi_bucket_bytes=mpi_bucket_bytes)
    usable = available_memory(device, device_index, local_ranks)
    if need > usable:
        params = _parameter_count(layers)
        where = (f"its {'EMULATED ' if gpus_emulated(device) else ''}GPU's free memory" if device == "cuda" else
                 f"this host's available memory over its {local_ranks} rank(s)")
        evaluated, buffers = _buffer_rows(rows, eval_rows)
        rows_said = f"{rows} rows" + (f" ({evaluated} when it evaluates" + (
            f"; buffers for {buffers})" if buffers > evaluated else ")") if evaluated > rows else "")
        raise ConfigError(f"training {params:,} parameters on {rows_said} a rank needs about {need / 1e9:.3g} GB a "
                          f"rank (weights, gradients, {optimizer} state, activations, runtime buffers), more than the "
                          f"{usable / 1e9:.3g} GB of {where}: a smaller model or batch, or more machines")


def _as_dict(rec) -> dict:
    cands = [{"devices": c.devices, "predicted_step_ms": c.step_s * 1e3, "predicted_speedup": c.speedup,
              "efficiency": c.efficiency, "memory_fits": c.memory_fits,
              "predicted_samples_per_sec": c.samples_per_s, "batch_shares": list(c.batch_shares),
              "forward_ms": c.forward_s * 1e3, "backward_ms": c.backward_s * 1e3, "optimizer_ms": c.optimizer_s * 1e3,
              "overhead_ms": c.overhead_s * 1e3, "allreduce_ms": c.comm_s * 1e3,
              "exposed_allreduce_ms": c.exposed_comm_s * 1e3, "timing_spread_ms": c.timing_spread_s * 1e3,
              "bucket_mb": c.bucket_elems * 4 / 2 ** 20, "cuda_graph": c.graphs,
              "memory_bytes": c.memory_bytes,
              "memory_usable_bytes": c.memory_usable_bytes,
              **({"cost_per_million_samples": c.cost_per_million_samples} if c.cost_per_million_samples else {})}
             for c in rec.candidates]
    return {"strategy": rec.strategy, "devices": rec.devices, "candidates": cands,
            "break_even_batch": rec.break_even_batch if rec.break_even_batch > 0 else None,
            "reasons": list(rec.reasons), "confidence": rec.confidence, "roi": rec.roi or None,
            "fallback": rec.fallback, "profile": rec.profile, "profile_source": rec.profile_source,
            "params": int(rec.params)}


# OpenMPI's allreduce collapses from >= 32 MB buffers on our CPU VMs (docs/benchmarks.md):
# CPU buckets stay below that whatever the model prefers.
CPU_MAX_BUCKET_BYTES = 16 * 2 ** 20


NAMED_CONFIDENCE = 0.6  # the selector's base confidence for a profile it did not measure (perf_model.cpp)
MAX_NODES = 1024  # recommend --nodes: beyond the largest published NCCL runs the model was checked on
MAX_DEVICES = 16 * MAX_NODES  # recommend --devices: as many (a device's profile entry each is built)


def _whole_nodes(prof: dict, count: int) -> dict:
    """A multi-node profile repeated node by node up to `count` devices: more nodes of the
    same kind joined by the same inter-node link, whose model prices the extra nodes."""
    devices, per_node, link = prof.get("devices"), prof.get("gpus_per_node"), prof.get("link")
    inter = link.get("nccl", {}).get("inter") if isinstance(link, dict) and isinstance(link.get("nccl"), dict) else None
    if (not isinstance(devices, list) or not devices or not isinstance(per_node, int) or per_node < 1 or not inter
            or count <= len(devices) or len(devices) % per_node):
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
            raise ConfigError("--nodes needs a profile that says how many devices a node holds: a named "
                              "one (`mgpu recommend --list-profiles`) or a calibration across hosts "
                              "(mpirun --hostfile FILE python -m mgpu topo)")
        if nodes > 1 and not (prof.get("link", {}).get("nccl") or {}).get("inter"):
            multi = [n for n, s in NAMED_PROFILES.items() if s["link"] and "2x8" in n]
            raise ConfigError(f"profile '{prof['name']}' has no inter-node link; for {nodes} nodes calibrate "
                              f"across hosts (mpirun --hostfile FILE python -m mgpu topo) or use one of "
                              f"{', '.join(multi)}")
        return sorted({1, per_node, nodes * per_node})
    if devices is None:
        return [1, per_node] if per_node > 1 else [1, 2]
    if any(n > MAX_DEVICES for n in devices):
        raise ConfigError(f"--devices: at most {MAX_DEVICES} devices, got {max(devices)}")
    return sorted({int(n) for n in devices})


def auto_bucket(prof: dict, w, devices: int, options=None) -> dict:
    """The bucket size the model prefers on `devices` of the profile (capped on CPUs)."""
    hw = to_core(prof, devices)
    cpu = hw.devices[0].kind == "cpu"
    choice = P.choose_bucket(w, hw, devices, options or P.Options(), CPU_MAX_BUCKET_BYTES if cpu else 0.0)
    return {"bucket_mb": choice.bucket_elems * 4 / 2 ** 20, "exposed_allreduce_ms": choice.exposed_comm_s * 1e3,
            "allreduce_ms": choice.comm_s * 1e3, "reason": choice.reason + (
                f" (CPU: capped below OpenMPI's >= 32 MB slow path)" if cpu else "")}


def recommend(*, model: Optional[str] = None, layers: Optional[Sequence[int]] = None, params: Optional[int] = None,
              batch_size: int, devices: Optional[Sequence[int]] = None, profile=None, precision: str = "fp32",
              optimizer: str = "adamw", bucket_mb="auto", memory_margin: float = MEMORY_MARGIN,
              price_per_device_hour: float = 0.0, dropout: Optional[float] = None, grad_dtype: str = "fp32",
              nodes: Optional[int] = None, cuda_graph: str = "auto", accumulate: int = 1) -> dict:
    """Single device or several, how many, and why, for a model and global batch.

    profile: None/'auto', 'calibrated', a named profile, a JSON path, or a
    profile dict. devices: candidate counts (default: 1 and the profile's GPUs
    per node, plus nodes x that with `nodes`). cuda_graph: auto | on | off, as
    `train --cuda-graph` (captured steps cost less per kernel and allreduce after
    backward instead of during it). accumulate: micro-batches the global batch is
    split into a step (train's step is --batch-size x --accumulate rows). bucket_mb: MB or 'auto' (default:
    each multi-device candidate at the bucket the model prefers for it). Returns a dict: strategy (single_gpu | multi_gpu |
    benchmark_required | does_not_fit), devices, candidates (per count:
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
    w = _workload(model, layers, params, batch_size, precision, optimizer, 4.0 if auto else bucket_mb, dropout,
                  grad_dtype, cuda_graph, accumulate)
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
        raise ConfigError(f"{given}: profile '{hw.name}' is of CPUs, which compute and allreduce in fp32 "
                          "(a GPU profile prices it)")
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
        result["reasons"].append(f"{counts[-1] // per_node} nodes extrapolated from the profile's "
                                 f"{described // per_node}: more nodes of the same kind over the same inter-node "
                                 "link, priced by its model")
        result["confidence"] = min(result["confidence"], NAMED_CONFIDENCE)
    if multi and placement_moved_in(prof):
        readings = prof["placement"]["readings_ns"]
        result["reasons"].append(f"the calibration saw the ranks' cores change cache domains (a cache line's round "
                                 f"trip {min(readings):.0f}-{max(readings):.0f} ns), as a VM's vCPUs do when its "
                                 "hypervisor moves them: a multi-rank wait after backward may be off by its own "
                                 "size, and the error band widens by it")
        second = placement_profile(prof, "second")
        if second is not None:  # the same candidate (its bucket) with the cores held in either placement
            at_its_bucket = _workload(model, layers, params, batch_size, precision, optimizer,
                                      fastest.bucket_elems * 4 / 2 ** 20, dropout, grad_dtype, cuda_graph, accumulate)
            options.choose_buckets = False
            here, there = (P.predict(at_its_bucket, to_core(p, counts[-1]), fastest.devices, options).speedup
                           for p in (placement_profile(prof, "first"), second))
            here_ns, there_ns = prof["placement"]["wait_probe_ns"], second["placement"]["wait_probe_ns"]
            result["reasons"].append(
                f"{fastest.devices} ranks: {here:.2f}x with the cores as the wait was first probed "
                f"({min(here_ns):.0f}-{max(here_ns):.0f} ns), {there:.2f}x as it was probed again "
                f"({min(there_ns):.0f}-{max(there_ns):.0f} ns); priced at {fastest.speedup:.2f}x, as "
                f"{_other_share(prof):.0%} of topo's readings found them in the second placement")
    result["bucket"] = bucket
    result["bucket_mb_used"] = (fastest.bucket_elems if fastest else w.bucket_elems) * 4 / 2 ** 20
    result["sources"] = prof.get("sources", [])
    result["gpu_emulation"] = profile_is_emulated(prof)
    if result["gpu_emulation"]:  # never mistakable for a real GPU's answer
        result["reasons"].insert(0, "GPU EMULATION: this profile is of mgpu's emulated GPUs (the CPU running its "
                                    "CUDA code), not of real ones; its times are not a GPU's, and neither is this "
                                    "answer")
    return result


def format_recommendation(r: dict) -> str:
    lines = [f"strategy: {r['strategy']}  (devices: {r['devices']}, confidence {r['confidence']:.0%}, "
             f"profile: {r['profile']} [{r['profile_source']}])"]
    if r["candidates"]:
        lines.append(f"{'devices':>7} {'step ms':>9} {'samples/s':>11} {'speedup':>8} {'effic.':>7} "
                     f"{'allreduce ms':>13} {'exposed':>8} {'bucket MiB':>10} {'memory/dev':>11} {'fits':>5}")
        for c in r["candidates"]:
            # 6 digits: 1024 MiB prints as such, not as 1.02e+03
            bucket = f"{c['bucket_mb']:>10.6g}" if c["devices"] > 1 and c.get("bucket_mb") else f"{'-':>10}"
            lines.append(f"{c['devices']:>7} {c['predicted_step_ms']:>9.3f} {c['predicted_samples_per_sec']:>11,.0f} "
                         f"{c['predicted_speedup']:>7.2f}x {c['efficiency']:>6.0%} {c['allreduce_ms']:>13.3f} "
                         f"{c['exposed_allreduce_ms']:>8.3f} {bucket} {c['memory_bytes'] / 1e9:>9.2f}GB "
                         f"{'yes' if c['memory_fits'] else 'NO':>5}")
    if r["break_even_batch"]:
        lines.append(f"break-even global batch: {r['break_even_batch']}")
    lines += [f"- {reason}" for reason in r["reasons"]]
    if r.get("roi"):
        lines.append(f"ROI: {r['roi']}")
    if r.get("bucket"):
        b = r["bucket"]
        lines.append(f"bucket: {b['bucket_mb']:g} MiB minimises the exposed allreduce ({b['reason']}); "
                     f"`train --bucket-mb auto` uses it")
    return "\n".join(lines)


# --- CLI: python -m mgpu recommend ----------------------------------------------------
def add_parser(sub) -> None:
    from .cliutil import bounded_int, int_list
    r = sub.add_parser("recommend", help="single or multi-GPU? how many, and why (the performance model)",
                       description="Predict step time on 1..N devices from a hardware profile and recommend a "
                                   "strategy, with reasons.")
    m = r.add_mutually_exclusive_group(required=True)
    m.add_argument("--list-profiles", action="store_true", help="list the named profiles with their sources")
    m.add_argument("--model", choices=sorted(PRESETS))
    m.add_argument("--layers", type=int_list("layer sizes"), help="in,h1,...,out")
    m.add_argument("--params", type=float, help="only a parameter count (e.g. 7e6)")
    r.add_argument("--batch-size", type=int, default=None, help="global batch size (required with a model)")
    r.add_argument("--devices", type=int_list("device counts", distinct=True), default=None,
                   help="candidate device counts, each once (default: 1 and the profile's GPUs per node, else 1,2)")
    r.add_argument("--nodes", type=bounded_int("--nodes", MAX_NODES), default=None,
                   help="also predict this many nodes of the profile's GPUs per node (candidates 1 GPU, 1 node, "
                        "K nodes)")
    r.add_argument("--profile", default="auto",
                   help=f"auto | calibrated | NAME (--list-profiles) | PATH.json (default auto: the calibration "
                        "from `mgpu topo`, else the visible GPUs, else seed 001's thresholds)")
    r.add_argument("--precision", choices=PRECISIONS, default="fp32")
    r.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw")
    r.add_argument("--grad-dtype", choices=GRAD_DTYPES, default="fp32",
                   help="type the gradients travel in: bf16/fp16 halve the allreduce (NCCL; default fp32)")
    r.add_argument("--cuda-graph", choices=GRAPH_MODES, default="auto",
                   help="as `train --cuda-graph`: auto (GPUs, models up to 2^24 parameters), on, off; captured "
                        "steps pay less per kernel and allreduce after backward")
    r.add_argument("--accumulate", type=bounded_int("--accumulate", 2 ** 62), default=1,
                   help="micro-batches the global batch is split into a step (default 1); train's step of "
                        "`--batch-size B --accumulate K` is --batch-size B*K --accumulate K here")
    r.add_argument("--bucket-mb", type=_bucket_mb, default="auto",
                   help="gradient bucket size in MB, or 'auto' (default: each multi-device candidate at the "
                        "bucket the model prefers for it)")
    r.add_argument("--dropout", type=float, default=None, help="default: the preset's, 0 otherwise")
    r.add_argument("--memory-margin", type=float, default=MEMORY_MARGIN, help="usable fraction of device memory")
    r.add_argument("--price", type=float, default=0.0, metavar="PER_DEVICE_HOUR",
                   help="price of one device-hour: adds cost per million samples and an ROI line")
    r.add_argument("--json", metavar="PATH", help="write the recommendation as JSON")


def _bucket_mb(text: str):
    """--bucket-mb: 'auto' or a positive number of MB."""
    import argparse
    if text == "auto":
        return "auto"
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MB or 'auto', got '{text}'") from None
    if not (v > 0 and v < float("inf")):
        raise argparse.ArgumentTypeError(f"bucket size must be > 0 MB, got {text}")
    if v * 1e6 / 4 > 2 ** 62:  # elements of fp32 gradients: the core counts them in 64 bits
        raise argparse.ArgumentTypeError(f"bucket size must be at most {2 ** 62 * 4 / 1e6:.3g} MB, got {text}")
    return v


def cmd_recommend(a, pg) -> int:
    from .cliutil import check_outputs, write_json_atomic
    if a.list_profiles:
        check_outputs({"--json": a.json})
        if pg.is_root:
            print(list_profiles())
            if a.json:  # the same list, machine-readable
                write_json_atomic(a.json, {
                    "profiles": {name: {"title": spec["title"], "gpus_per_node": spec["gpus_per_node"],
                                        "sources": _profile_sources(spec) if spec["link"] else []}
                                 for name, spec in NAMED_PROFILES.items()},
                    "aliases": dict(PROFILE_ALIASES)})
        return 0
    if a.batch_size is None:
        raise ConfigError("recommend needs --batch-size (the global batch)")
    if a.batch_size > 2 ** 62:  # the core counts samples in 64 bits (below 1: the workload's own check)
        raise ConfigError(f"--batch-size must be at most 2^62, got {a.batch_size}")
    check_outputs({"--json": a.json}, {"--profile": a.profile})
    if not (0 < a.memory_margin <= 1):
        raise ConfigError(f"--memory-margin must be in (0, 1], got {a.memory_margin}")
    if not 0 <= a.price < math.inf:  # NaN too
        raise ConfigError(f"--price must be a finite number >= 0, got {a.price}")
    params = None
    if a.params is not None:
        if not 1 <= a.params <= 2 ** 62:  # NaN and inf too; the core counts parameters in 64 bits
            raise ConfigError(f"--params must be in 1..2^62, got {a.params}")
        if a.params != int(a.params):
            raise ConfigError(f"--params must be a whole number of parameters, got {a.params}")
        params = int(a.params)
    result = recommend(model=a.model, layers=a.layers, params=params, batch_size=a.batch_size, devices=a.devices,
                       profile=a.profile, precision=a.precision, optimizer=a.optimizer, bucket_mb=a.bucket_mb,
                       memory_margin=a.memory_margin, price_per_device_hour=a.price, dropout=a.dropout,
                       grad_dtype=a.grad_dtype, nodes=a.nodes, cuda_graph=a.cuda_graph, accumulate=a.accumulate)
    if pg.is_root:
        print(format_recommendation(result))
        if a.json:
            write_json_atomic(a.json, {"request": {k: v for k, v in vars(a).items() if k != "command"}, **result})
    return 0
