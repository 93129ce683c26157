"""mgpu: data-parallel MLP training on one or many GPUs (NCCL) or CPUs (MPI).

The native core (mgpu._core) does the math and the collectives; this package drives
training, benchmarks and the CLI (``python -m mgpu --help``). Its layers, each importing
only those below it:

    commands/    the command line: one module per command
    calibrate/   measurements: topo's tables, bench's harness
    selector/    the performance model's Python side: hardware, profiles, fits, memory, recommend
    train/       process groups, config, data, model, schedule, checkpoints, the trainer, observe
    monitor/     device telemetry and the safety rules shared by stress and train
    _runtime, errors, atomic, console, hostinfo   the bottom
"""

# The runtime first: it sets the OpenMP environment before the core loads and picks the core.
# mgpu._core is the core it chose (the emulation's under MGPU_EMULATE_GPU); mgpu.OPENMP_ONLY_ENV
# what mgpu set for its own OpenMP-only steps.
from ._runtime import OPENMP_ONLY_ENV, _core, gpus_emulated  # noqa: F401
from ._core import __version__, build_info
from .errors import CommError, ConfigError, DataError, DeviceError, MgpuError, NumericsError
from .train.process_group import ProcessGroup
from .train.thread_group import ThreadGroup, run_on_gpus
from .train.config import PRESETS, TrainConfig, TrainerConfig
from .train.model import MLP
from .train.data import Dataset, load_dataset, split_counts
from .train.schedule import LRSchedule
from .train.checkpoint import CheckpointError
from .train.trainer import CheckpointPolicy, Trainer

__all__ = [
    "__version__",
    "build_info",
    "gpus_emulated",
    "ProcessGroup",
    "ThreadGroup",
    "run_on_gpus",
    "TrainConfig",
    "TrainerConfig",
    "PRESETS",
    "MLP",
    "Trainer",
    "CheckpointPolicy",
    "LRSchedule",
    "Dataset",
    "load_dataset",
    "split_counts",
    "MgpuError",
    "ConfigError",
    "DataError",
    "CheckpointError",
    "DeviceError",
    "CommError",
    "NumericsError",
]
