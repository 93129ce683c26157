"""Model presets, the validated training configuration (TrainConfig: a whole run, as
`mgpu train` takes it) and the trainer's (TrainerConfig: how a Trainer steps).

Every check happens at construction, identically on every rank, so bad
values fail fast with one clear message and never inside a collective. A rule both
configurations share is written once (_check_step_options).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from ..errors import ConfigError
from .schedule import SCHEDULES, LRSchedule


@dataclass(frozen=True)
class ModelPreset:
    hidden: tuple
    dropout: float
    in_features: Optional[int] = None  # None: taken from the dataset
    out_features: Optional[int] = None


# Seeds 000/001: medium (~258K params with their inputs), large, and the
# ~120M-parameter "xl" network of the stress design (4096 -> ... -> 512).
PRESETS = {
    "medium": ModelPreset(hidden=(256, 128, 64), dropout=0.2),
    "large": ModelPreset(hidden=(1024, 1024, 512, 512, 256), dropout=0.3),
    "xl": ModelPreset(hidden=(8192, 6144, 4096, 2048, 1024), dropout=0.0, in_features=4096, out_features=512),
}

OPTIMIZERS = ("sgd", "adamw")
LOSSES = ("mse", "cross_entropy")
DEVICES = ("cpu", "cuda", "auto")
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
COMMS = ("auto", "nccl", "mpi")
GRAPH_MODES = ("auto", "on", "off")
GRAD_DTYPES = ("fp32", "bf16", "fp16")  # the type gradients travel in (gradient compression)
DATA_PLACEMENTS = ("auto", "on", "off")  # the training set in the device's memory (gathered there) or not
BUILTIN_DATASETS = ("synthetic", "digits")


def check_comm_for_device(comm: str, device: str) -> None:
    """ConfigError where the communicator cannot serve the resolved device (NCCL joins GPUs only)."""
    if comm == "nccl" and device != "cuda":
        raise ConfigError("--comm nccl needs GPUs (--device cuda); CPU ranks use MPI")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_step_options(
    *, lr, accumulate, max_bad_steps, timeout, communicator, graph, grad_dtype, data_on_device
) -> None:
    """The rules TrainConfig and TrainerConfig share: ConfigError at the first value broken."""
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ConfigError(f"learning rate must be a finite number > 0, got {lr}")
    if not _is_int(accumulate) or accumulate < 1:
        raise ConfigError(f"accumulation steps must be an integer >= 1, got {accumulate}")
    if not _is_int(max_bad_steps) or max_bad_steps < 1:
        raise ConfigError(f"max bad steps must be an integer >= 1, got {max_bad_steps}")
    if not (timeout >= 0 and math.isfinite(timeout)):
        raise ConfigError(f"watchdog timeout must be >= 0 seconds (0: wait forever), got {timeout}")
    if communicator not in COMMS:
        raise ConfigError(f"unknown communicator '{communicator}' (expected {', '.join(COMMS)})")
    if graph not in GRAPH_MODES:
        raise ConfigError(f"unknown CUDA graph mode '{graph}' (expected {', '.join(GRAPH_MODES)})")
    if grad_dtype not in GRAD_DTYPES:
        raise ConfigError(f"unknown gradient dtype '{grad_dtype}' (expected {', '.join(GRAD_DTYPES)})")
    if data_on_device not in DATA_PLACEMENTS:
        raise ConfigError(f"unknown data placement '{data_on_device}' (expected {', '.join(DATA_PLACEMENTS)})")


@dataclass(frozen=True)
class TrainerConfig:
    """How a Trainer steps: the loss, the optimizer and its hyperparameters, gradient
    buckets, batch shares, accumulation, clipping, the learning-rate schedule, loss
    scaling, the watchdog, the communicator, CUDA graphs and the gradients' dtype.
    Checked here, once; the optimizer's name and hyperparameters by the core's Optimizer."""

    loss: str = "mse"
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    bucket_elems: int = 1 << 20
    overlap: bool = True
    batch_shares: Optional[Sequence[float]] = None  # per rank (the group checks their count); None: equal
    accumulate: int = 1
    max_grad_norm: float = 0.0
    schedule: Optional[LRSchedule] = None  # None: constant at lr
    loss_scale: Optional[float] = None  # None: 2^16 where fp16 is in play, else 1
    dynamic_loss_scale: Optional[bool] = None  # None: where fp16 is and no scale is given
    max_bad_steps: int = 3
    timeout: float = 300.0  # seconds a collective may wait for a peer; 0: forever
    communicator: str = "auto"  # auto (NCCL between GPUs where built, else MPI) | nccl | mpi
    timed: bool = False  # separate a step's phases on device backends too (benchmarks; costs overlap)
    graph: str = "auto"  # capture each step's forward/backward in a CUDA graph (auto: small models on GPUs)
    grad_dtype: str = "fp32"  # the type gradients travel in (bf16/fp16 halve the allreduce; NCCL only)
    shard_optimizer: bool = False  # ZeRO-1: optimizer state and update for each rank's shard only
    # fit()'s training set in the device's memory, each step's rows gathered there (auto: on
    # GPUs where it takes at most half the free memory; on: also on CPUs, the same path)
    data_on_device: str = "auto"

    def __post_init__(self):
        if not isinstance(self.shard_optimizer, bool):
            raise ConfigError(f"shard_optimizer must be True or False, got {self.shard_optimizer!r}")
        _check_step_options(
            lr=self.lr,
            accumulate=self.accumulate,
            max_bad_steps=self.max_bad_steps,
            timeout=self.timeout,
            communicator=self.communicator,
            graph=self.graph,
            grad_dtype=self.grad_dtype,
            data_on_device=self.data_on_device,
        )


@dataclass
class TrainConfig:
    """Everything a training run needs. `model` (a preset) or `layers` picks the network."""

    model: Optional[str] = "medium"
    layers: Optional[list] = None  # [in, hidden..., out]; overrides model
    dataset: str = "synthetic"  # synthetic | digits | PATH.npz
    batch_size: int = 256  # global, across all ranks
    epochs: Optional[int] = 5
    steps: Optional[int] = None  # total steps; overrides epochs
    lr: float = 0.01
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    loss: Optional[str] = None  # default: mse (regression) / cross_entropy (classification)
    dropout: Optional[float] = None  # default: the preset's, 0 with --layers
    seed: int = 0
    device: str = "auto"
    threads: Optional[int] = None  # per rank; default: node cores / ranks on the node
    bucket_mb: float = 4.0
    overlap: bool = True
    val_fraction: float = 0.2
    accumulate: int = 1  # micro-batches per step (gradient accumulation)
    max_grad_norm: float = 0.0  # global-norm clipping; 0: off
    lr_schedule: str = "constant"  # constant | step | cosine
    warmup_steps: int = 0
    lr_step_size: int = 1000  # step schedule
    lr_gamma: float = 0.1  # step schedule
    min_lr: float = 0.0  # cosine schedule
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0  # steps; 0: at the end and on stop requests only
    keep_checkpoints: int = 3
    watchdog_timeout: float = 300.0  # seconds a collective may wait for a peer; 0: forever
    max_bad_steps: int = 3  # consecutive non-finite steps before stopping
    precision: str = "fp32"  # fp32 | tf32 | bf16 | fp16 (GPU; fp16 with dynamic loss scaling)
    grad_dtype: str = "fp32"  # fp32 | bf16 | fp16: gradients allreduced in half (NCCL)
    comm: str = "auto"  # auto (NCCL between GPUs, else MPI) | nccl | mpi (host-staged)
    cuda_graph: str = "auto"  # auto (small models on GPUs) | on | off: replay steps as CUDA graphs
    shard_optimizer: bool = False  # ZeRO-1: each rank keeps optimizer state for its shard of the parameters
    data_on_device: str = "auto"  # auto (GPUs, where it fits) | on | off: the training set copied to the device once

    def __post_init__(self):
        self.validate()

    def validate(self, world_size: int = 1) -> "TrainConfig":
        def fail(msg):
            raise ConfigError(msg)

        if self.layers is not None:
            layers = list(self.layers)
            if len(layers) < 2:
                fail(f"layers must list at least an input and an output size, got {layers}")
            if not all(_is_int(s) and s >= 1 for s in layers):
                fail(f"every layer size must be a positive integer, got {layers}")
            self.layers = layers
        elif self.model is None:
            fail("give a model preset or layers")
        elif self.model not in PRESETS:
            fail(f"unknown model preset '{self.model}' (expected one of {', '.join(PRESETS)})")
        if not isinstance(self.dataset, str) or not self.dataset:
            fail("dataset must be 'synthetic', 'digits' or a path to a .npz file")
        if self.dataset not in BUILTIN_DATASETS and not self.dataset.endswith(".npz"):
            fail(f"unknown dataset '{self.dataset}' (expected synthetic, digits or a .npz path)")
        if not _is_int(self.batch_size) or self.batch_size < 1:
            fail(f"batch size must be an integer >= 1, got {self.batch_size}")
        if self.batch_size < world_size:
            fail(
                f"global batch size {self.batch_size} is smaller than the number of ranks "
                f"({world_size}): every rank needs at least one sample"
            )
        if self.steps is not None:
            if not _is_int(self.steps) or self.steps < 1:
                fail(f"steps must be an integer >= 1, got {self.steps}")
        elif self.epochs is None or not _is_int(self.epochs) or self.epochs < 1:
            fail(f"epochs must be an integer >= 1, got {self.epochs}")
        _check_step_options(
            lr=self.lr,
            accumulate=self.accumulate,
            max_bad_steps=self.max_bad_steps,
            timeout=self.watchdog_timeout,
            communicator=self.comm,
            graph=self.cuda_graph,
            grad_dtype=self.grad_dtype,
            data_on_device=self.data_on_device,
        )
        if self.optimizer not in OPTIMIZERS:
            fail(f"unknown optimizer '{self.optimizer}' (expected {' or '.join(OPTIMIZERS)})")
        if not (0 <= self.momentum < 1):
            fail(f"momentum must be in [0, 1), got {self.momentum}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            fail(f"weight decay must be >= 0, got {self.weight_decay}")
        if self.loss is not None and self.loss not in LOSSES:
            fail(f"unknown loss '{self.loss}' (expected mse or cross_entropy)")
        if self.dropout is not None and not (0 <= self.dropout < 1):
            fail(f"dropout must be in [0, 1), got {self.dropout}")
        if self.device not in DEVICES:
            fail(f"unknown device '{self.device}' (expected cpu, cuda or auto)")
        if self.threads is not None and (not _is_int(self.threads) or self.threads < 1):
            fail(f"threads must be an integer >= 1, got {self.threads}")
        if not (self.bucket_mb > 0 and math.isfinite(self.bucket_mb)):
            fail(f"bucket size must be > 0 MB, got {self.bucket_mb}")
        if not (0 < self.val_fraction < 1):
            fail(f"validation fraction must be in (0, 1), got {self.val_fraction}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**64:  # the core's seed is a uint64
            fail(f"seed must be an integer in 0..2^64-1, got {self.seed}")
        if not (self.max_grad_norm >= 0 and math.isfinite(self.max_grad_norm)):
            fail(f"max gradient norm must be >= 0 (0: no clipping), got {self.max_grad_norm}")
        if self.lr_schedule not in SCHEDULES:
            fail(f"unknown lr schedule '{self.lr_schedule}' (expected {', '.join(SCHEDULES)})")
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            fail(f"warm-up steps must be an integer >= 0, got {self.warmup_steps}")
        if not _is_int(self.lr_step_size) or self.lr_step_size < 1:
            fail(f"lr step size must be an integer >= 1, got {self.lr_step_size}")
        if not (0 < self.lr_gamma <= 1):
            fail(f"lr gamma must be in (0, 1], got {self.lr_gamma}")
        if not (0 <= self.min_lr < self.lr):
            fail(f"min lr must be in [0, lr), got {self.min_lr}")
        if self.checkpoint_dir is not None and not str(self.checkpoint_dir).strip():
            fail("checkpoint directory must not be empty")
        if not _is_int(self.checkpoint_every) or self.checkpoint_every < 0:
            fail(f"checkpoint interval must be an integer >= 0 steps, got {self.checkpoint_every}")
        if not _is_int(self.keep_checkpoints) or self.keep_checkpoints < 1:
            fail(f"checkpoints to keep must be an integer >= 1, got {self.keep_checkpoints}")
        if self.precision not in PRECISIONS:
            fail(f"unknown precision '{self.precision}' (expected {', '.join(PRECISIONS)})")
        if not isinstance(self.shard_optimizer, bool):
            fail(f"shard_optimizer must be True or False, got {self.shard_optimizer!r}")
        return self

    # --- derived values -----------------------------------------------------
    @property
    def preset(self) -> Optional[ModelPreset]:
        return None if self.layers is not None else PRESETS[self.model]

    def effective_dropout(self) -> float:
        if self.dropout is not None:
            return float(self.dropout)
        return self.preset.dropout if self.preset else 0.0

    def fixed_io(self) -> tuple:
        """(in, out) sizes the network fixes, or None for sizes taken from the data."""
        if self.layers is not None:
            return self.layers[0], self.layers[-1]
        return self.preset.in_features, self.preset.out_features

    def layer_sizes(self, in_features: int, out_features: int) -> list:
        """The network for a dataset of in_features inputs and out_features outputs."""
        if self.layers is not None:
            sizes = list(self.layers)
            if sizes[0] != in_features:
                raise ConfigError(f"layers start with {sizes[0]} inputs but the dataset has {in_features} features")
            if sizes[-1] != out_features:
                raise ConfigError(f"layers end with {sizes[-1]} outputs but the dataset needs {out_features}")
            return sizes
        p = self.preset
        for fixed, actual, what in ((p.in_features, in_features, "inputs"), (p.out_features, out_features, "outputs")):
            if fixed is not None and fixed != actual:
                raise ConfigError(f"preset '{self.model}' has {fixed} {what} but the dataset needs {actual}")
        return [in_features, *p.hidden, out_features]

    def schedule(self, total_steps: int) -> LRSchedule:
        return LRSchedule(
            self.lr, self.lr_schedule, self.warmup_steps, self.lr_step_size, self.lr_gamma, total_steps, self.min_lr
        )

    def bucket_elems(self) -> int:
        return max(1, int(self.bucket_mb * (1 << 20) / 4))

    def trainer_config(
        self,
        *,
        loss: str,
        total_steps: int,
        batch_shares: Optional[Sequence[float]] = None,
        timed: bool = False,
        data_on_device: Optional[str] = None,
    ) -> TrainerConfig:
        """How the run's Trainer steps: this configuration's settings, with what the run
        resolved (the loss the data asks for, the steps its schedule spans, the shares, the
        data's placement where the run decided 'auto')."""
        return TrainerConfig(
            loss=loss,
            optimizer=self.optimizer,
            lr=self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            bucket_elems=self.bucket_elems(),
            overlap=self.overlap,
            batch_shares=batch_shares,
            accumulate=self.accumulate,
            max_grad_norm=self.max_grad_norm,
            schedule=self.schedule(total_steps),
            max_bad_steps=self.max_bad_steps,
            timeout=self.watchdog_timeout,
            communicator=self.comm,
            timed=timed,
            graph=self.cuda_graph,
            grad_dtype=self.grad_dtype,
            shard_optimizer=self.shard_optimizer,
            data_on_device=data_on_device or self.data_on_device,
        )

    def to_dict(self) -> dict:
        return asdict(self)
