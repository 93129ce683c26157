"""mgpu: data-parallel MLP training on one or many GPUs (NCCL) or CPUs (MPI).

The native core (mgpu._core) does the math and the collectives; this package
drives training, benchmarks and the CLI (``python -m mgpu --help``).
"""
import os as _os
import sys as _sys

# libgomp reads its wait policy once, when it loads (with the core, below). Its default
# spins idle OpenMP workers for milliseconds, on the very cores OpenBLAS's own threads
# then compute on: a 2-thread step ran at 1.2x one thread instead of 1.9x
# (docs/benchmarks.md). So mgpu makes idle workers sleep (OMP_WAIT_POLICY=passive) unless
# the user chose a policy. The PyTorch peer inherits it (it mixes OpenMP and OpenBLAS
# too: its 2-thread steps ran 2.2-3.3x faster with it than with libgomp's default).
#
# Where no OpenBLAS thread computes in a step (AVX-512 CPUs, where oneDNN takes every
# GEMM on several threads: CpuGemm), a short spin first (GOMP_SPINCOUNT) keeps the team
# awake between a step's many parallel regions: each passive wake-up cost more than
# `medium`'s small GEMMs themselves (2 threads ran 1.7-2.4x faster with it; with OpenBLAS
# in the step the same spin made them 0.54-0.87x). Only where mgpu chose the policy and
# the user set no spin, and only for mgpu's own steps: launches of other frameworks (the
# PyTorch peer) go without it (OPENMP_ONLY_ENV).
#
# What mgpu sets is listed in MGPU_SET_OPENMP_ENV, so that a child process importing mgpu
# decides afresh (its MGPU_CPU_GEMM may differ) instead of taking it for the user's.
_SET_MARKER = "MGPU_SET_OPENMP_ENV"


def _forget_what_an_mgpu_parent_set() -> None:
    marked = _os.environ.pop(_SET_MARKER, "")
    for key, value in (kv.split("=", 1) for kv in marked.split(",") if "=" in kv):
        if _os.environ.get(key) == value:
            del _os.environ[key]


def _openmp_computes_alone() -> bool:
    """Will this process's multi-threaded steps run OpenMP only (no OpenBLAS threads)?
    Decided before the core loads, from what the CpuGemm rule reads: the CPU's AVX-512,
    MGPU_CPU_GEMM, and whether the core links oneDNN (its dynamic section names it)."""
    choice = _os.environ.get("MGPU_CPU_GEMM", "").strip() or "auto"
    if choice not in ("auto", "onednn"):
        return False
    try:
        if choice == "auto":  # oneDNN for every GEMM on several threads only where AVX-512 is
            with open("/proc/cpuinfo") as f:
                flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
            if "avx512f" not in flags:
                return False
        from importlib.util import find_spec
        emulated = _os.environ.get("MGPU_EMULATE_GPU", "").strip() not in ("", "0")
        spec = find_spec(__name__ + ("._core_emu" if emulated else "._core"))
        with open(spec.origin, "rb") as f:
            return b"libdnnl.so" in f.read()
    except (OSError, AttributeError, ImportError, ValueError):
        return False


_forget_what_an_mgpu_parent_set()
_set_by_mgpu = {}
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = _set_by_mgpu["OMP_WAIT_POLICY"] = "passive"
OPENMP_ONLY_ENV = {}
if "OMP_WAIT_POLICY" in _set_by_mgpu and "GOMP_SPINCOUNT" not in _os.environ and _openmp_computes_alone():
    _os.environ["GOMP_SPINCOUNT"] = OPENMP_ONLY_ENV["GOMP_SPINCOUNT"] = _set_by_mgpu["GOMP_SPINCOUNT"] = "10000"
if _set_by_mgpu:
    _os.environ[_SET_MARKER] = ",".join(f"{k}={v}" for k, v in _set_by_mgpu.items())

if _os.environ.get("MGPU_EMULATE_GPU", "").strip() not in ("", "0"):
    # MGPU_EMULATE_GPU=N: the CUDA code runs on N emulated GPUs on the CPU
    # (emulation/README.md). The emulation build of the core replaces _core for
    # this process, so every module below and every `from mgpu import _core` sees it.
    try:
        from . import _core_emu as _core
    except ImportError as _e:  # built without the emulation (no CUDA headers, Boost.Context or MPI)
        raise ImportError(f"MGPU_EMULATE_GPU is set but this mgpu has no GPU emulation build ({_e}); "
                          "unset MGPU_EMULATE_GPU or rebuild with the CUDA toolkit headers, "
                          "libboost-context-dev and MPI") from None
    _sys.modules[__name__ + "._core"] = _core
from ._core import __version__, build_info
from .errors import CommError, ConfigError, DataError, DeviceError, MgpuError, NumericsError
from .process_group import ProcessGroup
from .thread_group import ThreadGroup, run_on_gpus
from .config import PRESETS, TrainConfig
from .model import MLP
from .data import Dataset, load_dataset, split_counts
from .schedule import LRSchedule
from .checkpoint import CheckpointError
from .trainer import CheckpointPolicy, Trainer

__all__ = [
    "__version__", "build_info", "ProcessGroup", "ThreadGroup", "run_on_gpus", "TrainConfig", "PRESETS", "MLP", "Trainer",
    "CheckpointPolicy", "LRSchedule", "Dataset", "load_dataset", "split_counts", "MgpuError",
    "ConfigError", "DataError", "CheckpointError", "DeviceError", "CommError", "NumericsError",
]
