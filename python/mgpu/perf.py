"""Hardware profiles and the strategy selector's Python face: mgpu.recommend().

A profile says how fast each device computes (GEMM rate by size, memory
bandwidth, launch overhead), how much memory it has, and how fast the
allreduce between devices is (alpha-beta). It comes from one of:
  calibrated  `python -m mgpu topo` measured this machine (JSON in the cache dir)
  detected    GPUs visible but not calibrated: estimated from their properties
  named       pcie-host-bridge, pcie-p2p, nvlink, h100-nvswitch, cpu: nominal
              figures of typical machines (assumptions, not measurements)
With none of them (no calibration, no GPU) the selector falls back to seed
001's parameter/batch threshold table, and says so. The model itself is C++
(csrc/core/perf_model.cpp); this file builds its inputs and formats its answer.
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from typing import Optional, Sequence

from . import _core
from .config import GRAD_DTYPES, PRESETS
from .errors import ConfigError

P = _core.perf
PROFILE_FORMAT = "mgpu-hardware-profile"
PROFILE_VERSION = 1
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")

# Nominal figures (vendor specs, derated to what GEMMs and NCCL typically reach).
# They are assumptions for machines we have not measured: calibrate with `mgpu topo`.
_GPU_TYPES = {
    "rtx-4070-ti-super": dict(name="RTX 4070 Ti SUPER (nominal)", fp32=30e12, tf32=40e12, bf16=80e12, fp16=80e12,
                              half=3e8, memory=16e9, bandwidth=600e9, h2d=12e9, launch=5e-6, context=0.5e9),
    "a100-40gb": dict(name="A100 40GB (nominal)", fp32=18e12, tf32=100e12, bf16=220e12, fp16=220e12, half=1e9,
                      memory=40e9, bandwidth=1.4e12, h2d=24e9, launch=5e-6, context=0.6e9),
    "h100-sxm": dict(name="H100 SXM 80GB (nominal)", fp32=50e12, tf32=300e12, bf16=650e12, fp16=650e12, half=2e9,
                     memory=80e9, bandwidth=2.8e12, h2d=50e9, launch=4e-6, context=0.6e9),
}
NAMED_PROFILES = {
    # seed 001's machine: two PCIe GPUs whose traffic crosses the host bridge (no P2P)
    "pcie-host-bridge": dict(gpu="rtx-4070-ti-super", link="PCIe through the host bridge", alpha=20e-6, busbw=5e9),
    "pcie-p2p": dict(gpu="rtx-4070-ti-super", link="PCIe peer-to-peer", alpha=10e-6, busbw=20e9),
    "nvlink": dict(gpu="a100-40gb", link="NVLink", alpha=8e-6, busbw=150e9),
    "h100-nvswitch": dict(gpu="h100-sxm", link="NVLink 4 + NVSwitch", alpha=10e-6, busbw=380e9),
    "cpu": dict(gpu=None, link="MPI over shared memory", alpha=5e-6, busbw=5e9),
}


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mgpu")


def default_profile_path() -> str:
    return os.path.join(cache_dir(), "profile.json")


# --- profiles as JSON-able dicts ------------------------------------------------------
def _gemm_dict(peak: float, half: float, measured=None) -> dict:
    return {"peak_flops": float(peak), "half_work_flops": float(half), "measured": measured or []}


def named_profile(name: str, devices: int = 8) -> dict:
    if name not in NAMED_PROFILES:
        raise ConfigError(f"unknown hardware profile '{name}' (expected one of {', '.join(NAMED_PROFILES)}, "
                          "'calibrated', or a profile JSON path)")
    spec = NAMED_PROFILES[name]
    if spec["gpu"] is None:
        device = {"name": "CPU core (AVX2/FMA, nominal)", "kind": "cpu", "fp32": _gemm_dict(90e9, 5e6),
                  "memory_bytes": 8e9, "memory_bandwidth": 15e9, "host_to_device_bandwidth": 0.0,
                  "launch_overhead_s": 1e-6, "context_bytes": 0.1e9}
        overlap, buffers, overhead = False, 0.0, 2e-4
    else:
        g = _GPU_TYPES[spec["gpu"]]
        device = {"name": g["name"], "kind": "cuda", "memory_bytes": g["memory"], "memory_bandwidth": g["bandwidth"],
                  "host_to_device_bandwidth": g["h2d"], "launch_overhead_s": g["launch"], "context_bytes": g["context"],
                  **{p: _gemm_dict(g[p], g["half"]) for p in PRECISIONS}}
        overlap, buffers, overhead = True, 64e6, 1e-4
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": name, "source": "named",
            "devices": [dict(device) for _ in range(max(1, devices))],
            "link": {"name": spec["link"], "alpha_s": spec["alpha"], "bus_bandwidth": spec["busbw"],
                     "overlaps_compute": overlap, "buffer_bytes": buffers},
            "step_overhead_s": overhead, "model_error": 0.3}


def detected_profile(devices: Optional[int] = None) -> Optional[dict]:
    """An uncalibrated profile of the visible GPUs from their properties, or None without GPUs."""
    info = _core.build_info().get("cuda", {})
    gpus = info.get("devices", [])
    if not gpus:
        return None
    entries = []
    for g in gpus:
        sms = float(g.get("multiprocessors", 0) or 0)
        clock = 1.7e9  # typical boost clock of recent data-centre GPUs
        major = int(str(g.get("compute_capability", "8.0")).split(".")[0])
        fp32 = 0.7 * sms * 128 * 2 * clock      # FP32 lanes per SM x FMA, derated
        tensor = {8: 8.0, 9: 12.0}.get(major, 4.0)  # dense tensor-core multiple over FP32
        entries.append({"name": g.get("name", "GPU"), "kind": "cuda", "memory_bytes": float(g.get("total_memory_mib", 0)) * 2 ** 20,
                        "memory_bandwidth": 1e12, "host_to_device_bandwidth": 20e9, "launch_overhead_s": 5e-6,
                        "context_bytes": 0.6e9, "fp32": _gemm_dict(fp32, 1e9),
                        "tf32": _gemm_dict(fp32 * tensor / 2, 1e9), "bf16": _gemm_dict(fp32 * tensor, 1e9),
                        "fp16": _gemm_dict(fp32 * tensor, 1e9)})
    if devices and devices > len(entries):
        entries += [dict(entries[-1]) for _ in range(devices - len(entries))]
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": f"detected: {socket.gethostname()}",
            "source": "detected", "devices": entries,
            "link": {"name": "assumed PCIe P2P", "alpha_s": 10e-6, "bus_bandwidth": 20e9, "overlaps_compute": True,
                     "buffer_bytes": 64e6},
            "step_overhead_s": 1e-4, "model_error": 0.35}


def save_profile(profile: dict, path: Optional[str] = None) -> str:
    """Write a profile atomically (default: the cache directory); returns the path."""
    path = path or default_profile_path()
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-profile-", suffix=".json", dir=directory)
        with os.fdopen(fd, "w") as f:
            json.dump(profile, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise ConfigError(f"cannot write the profile to '{path}': {e.strerror or e}") from None
    return path


def load_profile(path: str) -> dict:
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
    to_core(profile)  # validates the fields
    return profile


def resolve_profile(spec: Optional[str], devices: int = 8) -> Optional[dict]:
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
    if spec in NAMED_PROFILES:
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
            d.context_bytes = float(e.get("context_bytes", 0.0))
            d.dropout_s_per_unit = float(e.get("dropout_s_per_unit", 0.0))
            core_devices.append(d)
        hw.devices = core_devices
        link = P.LinkProfile()
        l = profile["link"]
        link.name, link.alpha_s, link.bus_bandwidth = str(l.get("name", "")), float(l["alpha_s"]), float(l["bus_bandwidth"])
        link.overlaps_compute, link.buffer_bytes = bool(l.get("overlaps_compute", True)), float(l.get("buffer_bytes", 0.0))
        link.step_sync_s = float(l.get("step_sync_s", 0.0))
        link.measured = sorted((float(b), float(t)) for b, t in l.get("measured", []) if b > 0 and t > 0)
        link.measured_devices = int(l.get("fitted_at_ranks", 0)) if link.measured else 0
        hw.link = link
        hw.step_overhead_s = float(profile.get("step_overhead_s", 0.0))
        hw.model_error = float(profile.get("model_error", 0.25))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"hardware profile '{profile.get('name', '?')}' is malformed ({type(e).__name__}: {e})") from None
    return hw


# --- the selector --------------------------------------------------------------------
def _workload(model: Optional[str], layers: Optional[Sequence[int]], params: Optional[int], batch_size: int,
              precision: str, optimizer: str, bucket_mb: float, dropout: Optional[float] = None,
              grad_dtype: str = "fp32"):
    w = P.Workload()
    if grad_dtype not in GRAD_DTYPES:
        raise ConfigError(f"unknown gradient dtype '{grad_dtype}' (expected {', '.join(GRAD_DTYPES)})")
    w.grad_dtype = grad_dtype
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


def _as_dict(rec) -> dict:
    cands = [{"devices": c.devices, "predicted_step_ms": c.step_s * 1e3, "predicted_speedup": c.speedup,
              "efficiency": c.efficiency, "memory_fits": c.memory_fits,
              "predicted_samples_per_sec": c.samples_per_s, "batch_shares": list(c.batch_shares),
              "forward_ms": c.forward_s * 1e3, "backward_ms": c.backward_s * 1e3, "optimizer_ms": c.optimizer_s * 1e3,
              "overhead_ms": c.overhead_s * 1e3, "allreduce_ms": c.comm_s * 1e3,
              "exposed_allreduce_ms": c.exposed_comm_s * 1e3, "memory_bytes": c.memory_bytes,
              "memory_usable_bytes": c.memory_usable_bytes,
              **({"cost_per_million_samples": c.cost_per_million_samples} if c.cost_per_million_samples else {})}
             for c in rec.candidates]
    return {"strategy": rec.strategy, "devices": rec.devices, "candidates": cands,
            "break_even_batch": rec.break_even_batch if rec.break_even_batch > 0 else None,
            "reasons": list(rec.reasons), "confidence": rec.confidence, "roi": rec.roi or None,
            "fallback": rec.fallback, "profile": rec.profile, "profile_source": rec.profile_source,
            "params": int(rec.params)}


def recommend(*, model: Optional[str] = None, layers: Optional[Sequence[int]] = None, params: Optional[int] = None,
              batch_size: int, devices: Sequence[int] = (1, 2), profile=None, precision: str = "fp32",
              optimizer: str = "adamw", bucket_mb: float = 4.0, memory_margin: float = 0.8,
              price_per_device_hour: float = 0.0, dropout: Optional[float] = None, grad_dtype: str = "fp32") -> dict:
    """Single device or several, how many, and why, for a model and global batch.

    profile: None/'auto', 'calibrated', a named profile, a JSON path, or a
    profile dict. Returns a dict: strategy (single_gpu | multi_gpu |
    benchmark_required | does_not_fit), devices, candidates (per count:
    predicted_step_ms, predicted_speedup, efficiency, memory_fits, ...),
    break_even_batch, reasons, confidence, roi, fallback, profile.
    """
    counts = sorted({int(n) for n in devices})
    if not counts or counts[0] < 1:
        raise ConfigError(f"device counts must be integers >= 1, got {list(devices)}")
    if optimizer not in ("sgd", "adamw"):
        raise ConfigError(f"unknown optimizer '{optimizer}' (expected sgd or adamw)")
    w = _workload(model, layers, params, batch_size, precision, optimizer, bucket_mb, dropout, grad_dtype)
    options = P.Options()
    options.candidates, options.memory_margin = counts, memory_margin
    options.price_per_device_hour = price_per_device_hour
    prof = profile if isinstance(profile, dict) else resolve_profile(profile, counts[-1])
    if prof is None:
        return _as_dict(P.recommend_by_thresholds(w, options))
    hw = to_core(prof, counts[-1])
    if len(hw.devices) < counts[-1]:
        raise ConfigError(f"profile '{hw.name}' has {len(hw.devices)} device(s); cannot predict {counts[-1]}")
    return _as_dict(P.recommend(w, hw, options))


def format_recommendation(r: dict) -> str:
    lines = [f"strategy: {r['strategy']}  (devices: {r['devices']}, confidence {r['confidence']:.0%}, "
             f"profile: {r['profile']} [{r['profile_source']}])"]
    if r["candidates"]:
        lines.append(f"{'devices':>7} {'step ms':>9} {'samples/s':>11} {'speedup':>8} {'effic.':>7} "
                     f"{'allreduce ms':>13} {'exposed':>8} {'memory/dev':>11} {'fits':>5}")
        for c in r["candidates"]:
            lines.append(f"{c['devices']:>7} {c['predicted_step_ms']:>9.3f} {c['predicted_samples_per_sec']:>11,.0f} "
                         f"{c['predicted_speedup']:>7.2f}x {c['efficiency']:>6.0%} {c['allreduce_ms']:>13.3f} "
                         f"{c['exposed_allreduce_ms']:>8.3f} {c['memory_bytes'] / 1e9:>9.2f}GB "
                         f"{'yes' if c['memory_fits'] else 'NO':>5}")
    if r["break_even_batch"]:
        lines.append(f"break-even global batch: {r['break_even_batch']}")
    lines += [f"- {reason}" for reason in r["reasons"]]
    if r.get("roi"):
        lines.append(f"ROI: {r['roi']}")
    return "\n".join(lines)


# --- CLI: python -m mgpu recommend ----------------------------------------------------
def add_parser(sub) -> None:
    from .cliutil import int_list
    r = sub.add_parser("recommend", help="single or multi-GPU? how many, and why (the performance model)",
                       description="Predict step time on 1..N devices from a hardware profile and recommend a "
                                   "strategy, with reasons.")
    m = r.add_mutually_exclusive_group(required=True)
    m.add_argument("--model", choices=sorted(PRESETS))
    m.add_argument("--layers", type=int_list("layer sizes"), help="in,h1,...,out")
    m.add_argument("--params", type=float, help="only a parameter count (e.g. 7e6)")
    r.add_argument("--batch-size", type=int, required=True, help="global batch size")
    r.add_argument("--devices", type=int_list("device counts", distinct=True), default=[1, 2],
                   help="candidate device counts, each once (default 1,2)")
    r.add_argument("--profile", default="auto",
                   help=f"auto | calibrated | {' | '.join(NAMED_PROFILES)} | PATH.json (default auto: the calibration "
                        "from `mgpu topo`, else the visible GPUs, else seed 001's thresholds)")
    r.add_argument("--precision", choices=PRECISIONS, default="fp32")
    r.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw")
    r.add_argument("--grad-dtype", choices=GRAD_DTYPES, default="fp32",
                   help="type the gradients travel in: bf16/fp16 halve the allreduce (NCCL; default fp32)")
    r.add_argument("--bucket-mb", type=float, default=4.0)
    r.add_argument("--dropout", type=float, default=None, help="default: the preset's, 0 otherwise")
    r.add_argument("--memory-margin", type=float, default=0.8, help="usable fraction of device memory")
    r.add_argument("--price", type=float, default=0.0, metavar="PER_DEVICE_HOUR",
                   help="price of one device-hour: adds cost per million samples and an ROI line")
    r.add_argument("--json", metavar="PATH", help="write the recommendation as JSON")


def cmd_recommend(a, pg) -> int:
    from .cliutil import check_output_path, write_json_atomic
    if a.json:
        check_output_path(a.json, "--json")
    if not (0 < a.memory_margin <= 1):
        raise ConfigError(f"--memory-margin must be in (0, 1], got {a.memory_margin}")
    if a.price < 0:
        raise ConfigError(f"--price must be >= 0, got {a.price}")
    params = None
    if a.params is not None:
        if not a.params >= 1:
            raise ConfigError(f"--params must be >= 1, got {a.params}")
        params = int(a.params)
    result = recommend(model=a.model, layers=a.layers, params=params, batch_size=a.batch_size, devices=a.devices,
                       profile=a.profile, precision=a.precision, optimizer=a.optimizer, bucket_mb=a.bucket_mb,
                       memory_margin=a.memory_margin, price_per_device_hour=a.price, dropout=a.dropout,
                       grad_dtype=a.grad_dtype)
    if pg.is_root:
        print(format_recommendation(result))
        if a.json:
            write_json_atomic(a.json, {"request": {k: v for k, v in vars(a).items() if k != "command"}, **result})
    return 0
