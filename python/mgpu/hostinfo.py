"""Facts about this host that every layer reads: memory, the CPU and its caches, the GPUs
the core sees, and where two ranks' cores sit (a cache line's round trip between them).
"""

from __future__ import annotations

import glob
import math
import os
import platform
import re

from ._runtime import _core
from .errors import ConfigError


def host_meminfo() -> dict:
    """/proc/meminfo in bytes ('MemTotal', 'MemAvailable', ...); OSError/ValueError where unreadable."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            fields = value.split()
            info[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return info


def cpu_description() -> dict:
    """The CPU as calibrations and benchmarks record it: model, cores, ISA flags, memory."""
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    isa = [f for f in ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile") if f in flags]
    try:
        memory = host_meminfo()["MemTotal"]
    except (OSError, ValueError, KeyError):
        memory = 0
    return {
        "model": model,
        "cores": len(os.sched_getaffinity(0)),
        "isa": isa,
        "memory_bytes": memory,
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
    }


def last_level_cache_bytes() -> float:
    """The largest CPU cache of this host as sysfs lists it (cpu0's), bytes; 0 if unknown."""
    largest = 0.0
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(index, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        m = re.fullmatch(r"(\d+)([KMG]?)", text)
        if m:
            largest = max(largest, float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)])
    return largest


# Round trips between the same two CPUs this many times apart come from two placements of
# the cores (sharing a last-level cache or not; docs/journal.md has the readings), not from
# one placement's noise.
PLACEMENT_RATIO = 2.0


def round_trips_readable(readings_ns, count=None) -> bool:
    """Whether readings_ns is a list of `count` (default: one or more) positive, finite
    round trips in ns, as core_round_trip_ns reads them."""
    return (
        isinstance(readings_ns, list)
        and bool(readings_ns)
        and (count is None or len(readings_ns) == count)
        and all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0 for t in readings_ns
        )
    )


def placement_moved(readings_ns) -> bool:
    """Whether core_round_trip_ns readings come from more than one placement of the cores."""
    return bool(readings_ns) and max(readings_ns) > PLACEMENT_RATIO * min(readings_ns)


def cuda_device_count() -> int:
    """GPUs visible to this process (0 without a CUDA backend)."""
    count = getattr(_core, "cuda_device_count", None)
    return int(count()) if count is not None else 0


def available_memory(device: str, index: int, local_size: int) -> float:
    """Bytes one rank may use: its GPU's free memory, or its share of the host's
    available memory (MemAvailable over the ranks on this host)."""
    if device == "cuda":
        free, _ = _core.cuda_memory_info(index)
        return float(free)
    try:
        return host_meminfo()["MemAvailable"] / max(local_size, 1)
    except (OSError, ValueError, KeyError):
        raise ConfigError("cannot read the available memory from /proc/meminfo") from None


def no_gpu_reason() -> str:
    """Why no GPU is visible, in the CUDA runtime's words (with the GPU emulation's
    reason where MGPU_EMULATE_GPU is unreadable), for the errors that need one."""
    cuda = _core.build_info()["cuda"]
    return cuda.get("no_device_reason") or "check nvidia-smi and CUDA_VISIBLE_DEVICES"
