"""The memory model `train`, `bench` and `recommend` check against: what a rank holds for
a step (weights, gradients, optimizer state, activations, as the selector prices them),
the runtime's buffers and margin, and the check that refuses a run before it starts.
"""

from __future__ import annotations

from typing import Sequence

from .._runtime import _core, gpus_emulated
from ..errors import ConfigError
from ..hostinfo import available_memory
from .hardware import GPU_STEP_OVERHEAD_S, NCCL_BUFFER_BYTES
from .profiles import PROFILE_FORMAT, PROFILE_VERSION, P, device_entry, to_core
from .workload import build_workload

MEMORY_MARGIN = 0.8  # the fraction of a device's memory a recommendation plans to use


def training_memory_bytes(
    layers: Sequence[int], rows: int, *, optimizer: str = "adamw", precision: str = "fp32", dropout: float = 0.0
) -> float:
    """Bytes one rank holds to train `layers` on `rows` samples a step: weights, gradients,
    optimizer state and activations, as the selector prices them."""
    return P.training_memory_bytes(build_workload(None, layers, None, rows, precision, optimizer, 4.0, dropout), rows)


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
) -> dict:
    """What each of `ranks` GPUs of a named type (GPU_TYPES) holds for a step, as the
    selector prices it (the largest share's micro-batch, weights, gradients, optimizer
    state, the CUDA context, NCCL's buffers on several): bytes, usable_bytes, fits."""
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
    w = build_workload(None, layers, None, batch, precision, optimizer, 4.0, dropout, accumulate=accumulate)
    p = P.predict(w, to_core(prof, ranks), ranks, options)
    return {"bytes": p.memory_bytes, "usable_bytes": p.memory_usable_bytes, "fits": bool(p.memory_fits)}


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
) -> float:
    """Bytes a training rank allocates: training_memory_bytes at the most rows its buffers
    hold (eval_rows: the validation rows it evaluates, in chunks of EVAL_CHUNK_ROWS), with
    the runtime's buffers and margin, NCCL's buffers where it allreduces over NCCL, and
    MPI's temporaries for a bucket of mpi_bucket_bytes where it allreduces over MPI."""
    _, activation_rows = _buffer_rows(rows, eval_rows)
    model = training_memory_bytes(layers, activation_rows, optimizer=optimizer, precision=precision, dropout=dropout)
    gradient_bytes = 4.0 * _parameter_count(layers)
    return (
        model * (1 + RUNTIME_OVERHEAD_FRACTION)
        + RUNTIME_OVERHEAD_BYTES
        + (NCCL_BUFFER_BYTES if nccl else 0.0)
        + MPI_TEMPORARY_BUCKETS * min(max(mpi_bucket_bytes, 0.0), gradient_bytes)
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
) -> None:
    """ConfigError when training `layers` on `rows` samples a rank cannot fit the memory a
    rank may use (its GPU's free memory, or the host's available memory over its ranks),
    instead of an allocation failing inside the run or the kernel's OOM killer ending a rank."""
    need = rank_memory_bytes(
        layers,
        rows,
        optimizer=optimizer,
        precision=precision,
        dropout=dropout,
        eval_rows=eval_rows,
        nccl=nccl,
        mpi_bucket_bytes=mpi_bucket_bytes,
    )
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
        raise ConfigError(
            f"training {params:,} parameters on {rows_said} a rank needs about {need / 1e9:.3g} GB a "
            f"rank (weights, gradients, {optimizer} state, activations, runtime buffers), more than the "
            f"{usable / 1e9:.3g} GB of {where}: a smaller model or batch, or more machines"
        )
