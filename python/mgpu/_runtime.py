"""The runtime under every mgpu module: the OpenMP environment, set before the native
core loads (libgomp reads it once, then), and which core this process runs: `_core`, or
the GPU emulation's `_core_emu` where MGPU_EMULATE_GPU is set. Imported first by
mgpu/__init__.py; every module of mgpu takes the core from here (`from .._runtime import
_core`), and users' `from mgpu import _core` finds the same one.

libgomp's default spins idle OpenMP workers for milliseconds, on the very cores OpenBLAS's
own threads then compute on, which cost a 2-thread step most of its second thread. So mgpu
makes idle workers sleep (OMP_WAIT_POLICY=passive) unless the user chose a policy; the
PyTorch peer, which mixes OpenMP and OpenBLAS too, inherits it.

Where no OpenBLAS thread computes in a step (AVX-512 CPUs, where oneDNN takes every GEMM on
several threads: CpuGemm), a short spin first (GOMP_SPINCOUNT) keeps the team awake between
a step's many parallel regions, whose passive wake-ups cost more than small GEMMs; with
OpenBLAS in the step the same spin slows it (docs/journal.md has both A/B runs). Only where
mgpu chose the policy and the user set no spin, and only for mgpu's own steps: launches of
other frameworks (the PyTorch peer) go without it (for_other_frameworks).

What mgpu sets is listed in MGPU_SET_OPENMP_ENV, so that a child process importing mgpu
decides afresh (its MGPU_CPU_GEMM may differ) instead of taking it for the user's.
"""

import importlib
import os
import sys

SET_MARKER = "MGPU_SET_OPENMP_ENV"
EMULATED = os.environ.get("MGPU_EMULATE_GPU", "").strip() not in ("", "0")


def _forget_what_an_mgpu_parent_set() -> None:
    marked = os.environ.pop(SET_MARKER, "")
    for key, value in (kv.split("=", 1) for kv in marked.split(",") if "=" in kv):
        if os.environ.get(key) == value:
            del os.environ[key]


def _openmp_computes_alone() -> bool:
    """Will this process's multi-threaded steps run OpenMP only (no OpenBLAS threads)?
    Decided before the core loads, from what the CpuGemm rule reads: the CPU's AVX-512,
    MGPU_CPU_GEMM, and whether the core links oneDNN (its dynamic section names it)."""
    choice = os.environ.get("MGPU_CPU_GEMM", "").strip() or "auto"
    if choice not in ("auto", "onednn"):
        return False
    try:
        if choice == "auto":  # oneDNN for every GEMM on several threads only where AVX-512 is
            with open("/proc/cpuinfo") as f:
                flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
            if "avx512f" not in flags:
                return False
        from importlib.util import find_spec

        spec = find_spec(__package__ + ("._core_emu" if EMULATED else "._core"))
        with open(spec.origin, "rb") as f:
            return b"libdnnl.so" in f.read()
    except (OSError, AttributeError, ImportError, ValueError):
        return False


def for_other_frameworks(env: dict) -> dict:
    """`env` (a copy of this process's) without what mgpu set only for its own
    OpenMP-only steps, for a launch of another framework (the PyTorch peer)."""
    env = {k: v for k, v in env.items() if k != SET_MARKER}
    for key, value in OPENMP_ONLY_ENV.items():
        if env.get(key) == value:
            del env[key]
    return env


_forget_what_an_mgpu_parent_set()
_set_by_mgpu = {}
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = _set_by_mgpu["OMP_WAIT_POLICY"] = "passive"
OPENMP_ONLY_ENV = {}  # what mgpu set for its own OpenMP-only steps
if "OMP_WAIT_POLICY" in _set_by_mgpu and "GOMP_SPINCOUNT" not in os.environ and _openmp_computes_alone():
    os.environ["GOMP_SPINCOUNT"] = OPENMP_ONLY_ENV["GOMP_SPINCOUNT"] = _set_by_mgpu["GOMP_SPINCOUNT"] = "10000"
if _set_by_mgpu:
    os.environ[SET_MARKER] = ",".join(f"{k}={v}" for k, v in _set_by_mgpu.items())


# MGPU_EMULATE_GPU=N: the CUDA code runs on N emulated GPUs on the CPU (emulation/README.md).
# The emulation build of the core replaces _core for this process, so every module and every
# `from mgpu import _core` sees it.
if EMULATED:
    try:
        _core = importlib.import_module(__package__ + "._core_emu")
    except ImportError as _e:  # built without the emulation (no CUDA headers, Boost.Context or MPI)
        raise ImportError(
            f"MGPU_EMULATE_GPU is set but this mgpu has no GPU emulation build ({_e}); "
            "unset MGPU_EMULATE_GPU or rebuild with the CUDA toolkit headers, "
            "libboost-context-dev and MPI"
        ) from None
    sys.modules[__package__ + "._core"] = _core
else:
    _core = importlib.import_module(__package__ + "._core")


def gpus_emulated(device: str = "cuda") -> bool:
    """Whether `device`'s GPUs are mgpu's emulation (the CPU running the CUDA code):
    everything that shows a GPU, its speed or a calibration of it says so."""
    return device == "cuda" and bool(_core.build_info().get("gpu_emulation", False))
