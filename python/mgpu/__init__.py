"""mgpu: data-parallel MLP training on one or many GPUs (NCCL) or CPUs (MPI).

The native core (mgpu._core) does the math and the collectives; this package
drives training, benchmarks and the CLI (``python -m mgpu --help``).
"""
import sys as _sys

# Before the core loads (libgomp reads its environment once, then): see _openmp_env.py.
from ._openmp_env import EMULATED as _EMULATED, OPENMP_ONLY_ENV

if _EMULATED:
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


def gpus_emulated(device: str = "cuda") -> bool:
    """Whether `device`'s GPUs are mgpu's emulation (the CPU running the CUDA code):
    everything that shows a GPU, its speed or a calibration of it says so."""
    return device == "cuda" and bool(build_info().get("gpu_emulation", False))


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
    "__version__", "build_info", "gpus_emulated", "ProcessGroup", "ThreadGroup", "run_on_gpus", "TrainConfig", "PRESETS", "MLP", "Trainer",
    "CheckpointPolicy", "LRSchedule", "Dataset", "load_dataset", "split_counts", "MgpuError",
    "ConfigError", "DataError", "CheckpointError", "DeviceError", "CommError", "NumericsError",
]
