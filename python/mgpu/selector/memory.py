"""The memory model `train`, `bench` and `recommend` check against: what a rank holds for
a step (weights, gradients, optimizer state (its shard with a sharded optimizer),
activations, as the selector prices them), the runtime's buffers and margin, and the
check that refuses a run before it starts.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .._runtime import _core, gpus_emulated
from ..errors import ConfigError
from ..hostinfo import available_memory
from .hardware import GPU_STEP_OVERHEAD_S, NCCL_BUFFER_BYTES
from .profiles import PROFILE_FORMAT, PROFILE_VERSION, P, device_entry, to_core
from .workload import build_workload

MEMORY_MARGIN = 0.8  # the fraction of a device's memory a recommendation plans to use


def _check_shards(optimizer_shards) -> int:
    if isinstance(optimizer_shards, bool) or not isinstance(optimizer_shards, int) or optimizer_shards < 1:
        raise ConfigError(f"optimizer_shards must be an integer >= 1, got {optimizer_shards!r}")
    return optimizer_shards


def _workload(layers: Sequence[int], rows: int, optimizer: str, precision: str, dropout: float, shards: int):
    return build_workload(None, layers, None, rows, precision, optimizer, 4.0, dropout, shard_optimizer=shards > 1)


def training_memory_bytes(
    layers: Sequence[int],
    rows: int,
    *,
    optimizer: str = "adamw",
    precision: str = "fp32",
    dropout: float = 0.0,
    optimizer_shards: int = 1,
) -> float:
    """Bytes one rank holds to train `layers` on `rows` samples a step: weights, gradients,
    optimizer state (1/optimizer_shards of it: a sharded optimizer over that many ranks)
    and activations, as the selector prices them."""
    shards = _check_shards(optimizer_shards)
    return P.training_memory_bytes(_workload(layers, rows, optimizer, precision, dropout, shards), rows, shards)


def optimizer_state_bytes(layers: Sequence[int], *, optimizer: str = "adamw", optimizer_shards: int = 1) -> float:
    """Optimizer state one rank holds, as the selector prices it (SGD's momentum 4 B a
    parameter, AdamW's moments 8 B), 1/optimizer_shards of it with a sharded optimizer."""
    shards = _check_shards(optimizer_shards)
    return P.optimizer_state_bytes(_workload(layers, 1, optimizer, "fp32", 0.0, shards), shards)


def gpu_step_memory(
    gpu: str,
    layers: Sequence[int],
    batch: int,
    ranks: int,
    *,
    optimizer: str,
    precision: str,
    dropout: float,
    accumulate: int = 1,
    shard_optimizer: bool = False,
) -> dict:
    """What each of `ranks` GPUs of a named type (GPU_TYPES) holds for a step, as the
    selector prices it (the largest share's micro-batch, weights, gradients, optimizer
    state (its shard with shard_optimizer on several), the CUDA context, NCCL's buffers on
    several): bytes, usable_bytes, fits, optimizer_state_bytes."""
    prof = {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "name": f"{ranks} x {gpu}",
        "source": "named",
        "devices": [device_entry(gpu) for _ in range(ranks)],
        "step_overhead_s": GPU_STEP_OVERHEAD_S,
        "model_error": 0.3,
        "link": {
            "name": "NCCL",
            "alpha_s": 0.0,
            "bus_bandwidth": 1e11,
            "overlaps_compute": True,
            "buffer_bytes": NCCL_BUFFER_BYTES,
        },
    }
    options = P.Options()
    options.memory_margin = MEMORY_MARGIN
    w = build_workload(
        None,
        layers,
        None,
        batch,
        precision,
        optimizer,
        4.0,
        dropout,
        accumulate=accumulate,
        shard_optimizer=shard_optimizer,
    )
    p = P.predict(w, to_core(prof, ranks), ranks, options)
    return {
        "bytes": p.memory_bytes,
        "usable_bytes": p.memory_usable_bytes,
        "fits": bool(p.memory_fits),
        "optimizer_state_bytes": p.optimizer_state_bytes,
    }


# What a rank allocates beyond what training_memory_bytes prices: a fixed part (the BLAS
# threads' and MPI's buffers) and a share that grows with the rows (numpy batches, the
# allocator), both measured as peak RSS growth by tests/unit/test_memory_check.py (figures
# in docs/journal.md). On GPUs they stand for cuBLAS's and cuRAND's buffers, unmeasured there.
RUNTIME_OVERHEAD_BYTES = 64 * 2**20
RUNTIME_OVERHEAD_FRACTION = 0.10
# OpenMPI's allreduce of a bucket allocates temporaries of about its size (a larger bucket
# grew rank 0's peak RSS by about that much: docs/journal.md); priced as this many buckets
# on every multi-rank MPI run.
MPI_TEMPORARY_BUCKETS = 2


def _buffer_rows(rows: int, eval_rows: int) -> tuple:
    """(rows of one validation chunk, rows the activation buffers end up holding). The
    buffers grow to max(rows, 1.5x what they held) (MLP::ensure_capacity): a chunk after
    the steps' rows may leave half as many again (on GPUs all of it allocated)."""
    chunk = min(int(eval_rows), _core.MLP.EVAL_CHUNK_ROWS)
    return chunk, rows if chunk <= rows else max(chunk, rows + rows // 2)


def _parameter_count(layers: Sequence[int]) -> int:
    return sum(fan_out * (fan_in + 1) for fan_in, fan_out in zip(layers, layers[1:]))


def rank_memory_bytes(
    layers: Sequence[int],
    rows: int,
    *,
    optimizer: str,
    precision: str,
    dropout: float,
    eval_rows: int = 0,
    nccl: bool = False,
    mpi_bucket_bytes: float = 0.0,
    optimizer_shards: int = 1,
    resident_bytes: float = 0.0,
) -> float:
    """Bytes a training rank allocates: training_memory_bytes at the most rows its buffers
    hold (eval_rows: the validation rows it evaluates, in chunks of EVAL_CHUNK_ROWS), with
    the runtime's buffers and margin, NCCL's buffers where it allreduces over NCCL, and
    MPI's temporaries for a bucket of mpi_bucket_bytes where it allreduces over MPI.
    optimizer_shards: the ranks a sharded optimizer splits its state over (1: unsharded).
    resident_bytes: a training set held in the device's memory (data.resident_bytes)."""
    _, activation_rows = _buffer_rows(rows, eval_rows)
    model = training_memory_bytes(
        layers,
        activation_rows,
        optimizer=optimizer,
        precision=precision,
        dropout=dropout,
        optimizer_shards=optimizer_shards,
    )
    gradient_bytes = 4.0 * _parameter_count(layers)
    return (
        model * (1 + RUNTIME_OVERHEAD_FRACTION)
        + RUNTIME_OVERHEAD_BYTES
        + (NCCL_BUFFER_BYTES if nccl else 0.0)
        + MPI_TEMPORARY_BUCKETS * min(max(mpi_bucket_bytes, 0.0), gradient_bytes)
        + resident_bytes
    )


def check_training_memory(
    layers: Sequence[int],
    rows: int,
    *,
    optimizer: str,
    precision: str,
    dropout: float,
    device: str,
    device_index: int,
    local_ranks: int,
    eval_rows: int = 0,
    nccl: bool = False,
    mpi_bucket_bytes: float = 0.0,
    optimizer_shards: int = 1,
    world_ranks: Optional[int] = None,
    resident_bytes: float = 0.0,
) -> None:
    """ConfigError when training `layers` on `rows` samples a rank cannot fit the memory a
    rank may use (its GPU's free memory, or the host's available memory over its ranks),
    instead of an allocation failing inside the run or the kernel's OOM killer ending a rank.
    optimizer_shards: the ranks a sharded optimizer splits its state over (1: unsharded).
    world_ranks: the run's ranks (default local_ranks): an unsharded run the check refuses
    is told what --shard-optimizer over them would need, where that would fit.
    resident_bytes: the training set held in the device's memory (--data-on-device)."""
    kw = dict(
        optimizer=optimizer,
        precision=precision,
        dropout=dropout,
        eval_rows=eval_rows,
        nccl=nccl,
        mpi_bucket_bytes=mpi_bucket_bytes,
        resident_bytes=resident_bytes,
    )
    need = rank_memory_bytes(layers, rows, optimizer_shards=optimizer_shards, **kw)
    usable = available_memory(device, device_index, local_ranks)
    if need > usable:
        params = _parameter_count(layers)
        where = (
            f"its {'EMULATED ' if gpus_emulated(device) else ''}GPU's free memory"
            if device == "cuda"
            else f"this host's available memory over its {local_ranks} rank(s)"
        )
        evaluated, buffers = _buffer_rows(rows, eval_rows)
        rows_said = f"{rows} rows" + (
            f" ({evaluated} when it evaluates" + (f"; buffers for {buffers})" if buffers > evaluated else ")")
            if evaluated > rows
            else ""
        )
        ranks = local_ranks if world_ranks is None else world_ranks
        hint = ""
        if optimizer_shards == 1 and ranks > 1:  # what sharding the optimizer over the run's ranks would need
            sharded = rank_memory_bytes(layers, rows, optimizer_shards=ranks, **kw)
            if sharded <= usable:
                hint = f"; --shard-optimizer would need about {sharded / 1e9:.3g} GB a rank"
        state = f"{optimizer} state" + (f" (1/{optimizer_shards} of it)" if optimizer_shards > 1 else "")
        data = f", the training set ({resident_bytes / 1e9:.3g} GB, --data-on-device)" if resident_bytes else ""
        raise ConfigError(
            f"training {params:,} parameters on {rows_said} a rank needs about {need / 1e9:.3g} GB a "
            f"rank (weights, gradients, {state}, activations, runtime buffers{data}), more than the "
            f"{usable / 1e9:.3g} GB of {where}: a smaller model or batch, or more machines{hint}"
        )
