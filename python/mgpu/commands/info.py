"""`mgpu info`: what this build contains (BLAS, MPI, CUDA, NCCL) and what this process sees."""

from __future__ import annotations

import json
import os

from .._core import build_info
from .._runtime import OPENMP_ONLY_ENV


def emulation_banner() -> str:
    return (
        f"GPU EMULATION (MGPU_EMULATE_GPU={os.environ.get('MGPU_EMULATE_GPU', '')}): the GPUs below are "
        "the CPU running mgpu's CUDA code, not real GPUs"
    )


# The build options openblas_get_config() lists before the kernel's name (driver/others/openblas_get_config.c).
_OPENBLAS_FLAGS = {
    "USE64BITINT",
    "NO_CBLAS",
    "NO_LAPACK",
    "NO_LAPACKE",
    "DYNAMIC_ARCH",
    "DYNAMIC_OLDER",
    "NO_AFFINITY",
    "USE_OPENMP",
    "USE_TLS",
}


def _blas_kernel(config: str) -> str:
    """The kernel OpenBLAS runs, from openblas_get_config(): the word after the build options and
    before MAX_THREADS=N or SINGLE_THREADED (with DYNAMIC_ARCH the one picked for this CPU at load)."""
    words = config.split()[2:]  # "OpenBLAS 0.3.21 ..."
    words = [w for w in words if not w.startswith("MAX_THREADS=") and w != "SINGLE_THREADED"]
    return words[-1] if words and words[-1] not in _OPENBLAS_FLAGS else ""


def format_info(info: dict) -> str:
    """`mgpu info` for people: one line per component (the JSON has every field)."""
    lines = []
    emulated = info.get("gpu_emulation", False)
    if emulated:
        lines.append(emulation_banner())
    lines.append(f"mgpu {info['version']} ({info['build_type']} build, {info['compiler']})")
    blas = info["blas"]
    kernel = _blas_kernel(blas.get("config", ""))
    coretype = os.environ.get("OPENBLAS_CORETYPE")
    kernel = (f", kernel {kernel}" if kernel else "") + (f" (OPENBLAS_CORETYPE={coretype})" if coretype else "")
    lines.append(
        f"BLAS:     {blas['library']}{kernel}; OpenMP {'on' if info['openmp'] else 'off'}, "
        f"{info['cpu_threads_available']} CPU threads available"
    )
    choice = os.environ.get("MGPU_CPU_GEMM") or "auto"
    if blas.get("onednn"):
        by_shape = (
            f"oneDNN {blas['onednn']} for products of >= {blas['onednn_min_width_avx512']} output columns, "
            "OpenBLAS for narrower ones on one thread (an AVX-512 CPU)"
            if blas.get("cpu_avx512")
            else f"oneDNN {blas['onednn']} for products of <= {blas['onednn_max_work'] / 1e6:.1f}M multiply-adds, "
            "OpenBLAS above and for all on several threads (no AVX-512)"
        )
        rule = (
            by_shape
            if choice == "auto"
            else {"openblas": "OpenBLAS", "onednn": f"oneDNN {blas['onednn']}"}.get(
                choice, "invalid: expected auto, openblas or onednn"
            )
        )
        lines.append(f"CPU GEMM: {rule} (MGPU_CPU_GEMM={choice})")
    else:
        lines.append("CPU GEMM: OpenBLAS (this build has no oneDNN)")
    if info["openmp"]:
        spin = os.environ.get("GOMP_SPINCOUNT")
        lines.append(
            f"OpenMP:   idle workers wait {os.environ.get('OMP_WAIT_POLICY', 'as libgomp defaults')}"
            + (f", spinning {spin} rounds first" if spin else "")
            + (
                " (set by mgpu: oneDNN takes every GEMM on several threads, no OpenBLAS thread to yield to)"
                if "GOMP_SPINCOUNT" in OPENMP_ONLY_ENV
                else ""
            )
        )
    mpi = info["mpi"]
    lines.append(
        f"MPI:      {mpi.get('library', '') or 'yes'} (built with {mpi['compiled_with']})"
        if mpi["enabled"]
        else "MPI:      not built in (one rank only)"
    )
    cuda = info["cuda"]
    fake = " [EMULATED: mgpu's own, on the CPU]" if emulated else ""

    def loaded(name):  # the library this process loaded, and what it was built with when that differs
        built, now = cuda.get(f"{name}_compiled", ""), cuda.get(f"{name}_loaded", "")
        return now if built == now else f"{now or 'not loaded'} (built with {built or '-'})"

    if cuda["compiled"]:
        lines.append(
            f"CUDA:     loaded runtime {loaded('runtime')}, cuBLAS {loaded('cublas')}, cuRAND {loaded('curand')}; "
            f"driver {cuda.get('driver') or 'none'}; toolkit {cuda['toolkit_version']} at build{fake}"
        )
    else:
        lines.append(
            f"CUDA:     not built in (toolkit {'found' if cuda['toolkit_found'] else 'not found'} at build time)"
        )
    if cuda["nccl_communicator"]:
        lines.append(f"NCCL:     loaded {loaded('nccl')}{fake}")
    else:
        lines.append(
            f"NCCL:     not built in ({'found ' + cuda['nccl_version'] if cuda['nccl_found'] else 'not found'} "
            "at build time); GPU ranks use MPI through host memory"
        )
    gpus = cuda.get("devices", [])
    if gpus:
        what = "EMULATED GPU(s), the CPU, not real GPUs" if emulated else "GPU(s)"
        lines.append(f"GPUs:     {len(gpus)} {what}")
        lines += [
            f"  {d['index']}: {d['name']}, {d['total_memory_mib'] / 1024:.1f} GiB, {d['multiprocessors']} SMs, "
            f"compute capability {d['compute_capability']}, PCI {d['pci_bus_id']}"
            for d in gpus
        ]
    elif cuda["compiled"]:
        lines.append(f"GPUs:     none visible: {cuda.get('no_device_reason') or 'no CUDA device'}")
    else:
        lines.append("GPUs:     not usable (this build has no CUDA backend)")
    lines.append(f"backends: {', '.join(info['backends'])}")
    p = info["process"]
    lines.append(
        f"process:  rank {p['rank']} of {p['size']} (local {p['local_rank']} of {p['local_size']}); "
        "everything, as JSON: mgpu info --json"
    )
    return "\n".join(lines)


def cmd_info(a, pg) -> int:
    info = build_info()
    info["process"] = {"rank": pg.rank, "size": pg.size, "local_rank": pg.local_rank, "local_size": pg.local_size}
    if pg.is_root:
        print(json.dumps(info, indent=2) if a.json else format_info(info))
    return 0


def add_parser(sub) -> None:
    i = sub.add_parser("info", help="what this build contains and what this process sees")
    i.add_argument("--json", action="store_true", help="everything, as JSON (default: a short summary)")
