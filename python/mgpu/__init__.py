"""mgpu: data-parallel MLP training on one or many GPUs (NCCL) or CPUs (MPI).

The native core (mgpu._core) does the math and the collectives; this package
drives training, benchmarks and the CLI (``python -m mgpu --help``).
"""
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
