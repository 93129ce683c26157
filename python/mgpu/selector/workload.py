"""The selector's description of a training step (the C++ Workload): model or layer sizes
or a parameter count, batch, precision, optimizer, bucket, dropout, gradient dtype, CUDA
graphs, accumulation, a sharded optimizer and where a GPU's inputs come from, each checked
with a one-line ConfigError.
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence

from .._runtime import _core
from ..errors import ConfigError
from ..train.config import GRAD_DTYPES, GRAPH_MODES, PRESETS
from .hardware import PRECISIONS

P = _core.perf


# --- the selector --------------------------------------------------------------------
def build_workload(
    model: Optional[str],
    layers: Optional[Sequence[int]],
    params: Optional[int],
    batch_size: int,
    precision: str,
    optimizer: str,
    bucket_mb: float,
    dropout: Optional[float] = None,
    grad_dtype: str = "fp32",
    cuda_graph: str = "auto",
    accumulate: int = 1,
    shard_optimizer: bool = False,
    data_on_device: bool = True,
):
    w = P.Workload()
    w.data_on_device = bool(data_on_device)
    if not isinstance(shard_optimizer, bool):
        raise ConfigError(f"shard_optimizer must be True or False, got {shard_optimizer!r}")
    w.shard_optimizer = shard_optimizer
    try:
        k = operator.index(accumulate) if not isinstance(accumulate, bool) else None
    except TypeError:
        k = None
    if k is None or not 1 <= k <= 2**62:
        raise ConfigError(f"micro-batches per step (accumulate) must be an integer in 1..2^62, got {accumulate!r}")
    w.accumulate = k
    if grad_dtype not in GRAD_DTYPES:
        raise ConfigError(f"unknown gradient dtype '{grad_dtype}' (expected {', '.join(GRAD_DTYPES)})")
    w.grad_dtype = grad_dtype
    if cuda_graph not in GRAPH_MODES:
        raise ConfigError(f"unknown CUDA graph mode '{cuda_graph}' (expected {', '.join(GRAPH_MODES)})")
    w.cuda_graph = cuda_graph
    if dropout is not None:
        if not 0 <= dropout < 1:
            raise ConfigError(f"dropout must be in [0, 1), got {dropout}")
        w.dropout = float(dropout)
    elif model is not None and model in PRESETS:
        w.dropout = PRESETS[model].dropout
    if sum(v is not None for v in (model, layers, params)) != 1:
        raise ConfigError("give exactly one of a model preset, layer sizes or a parameter count")
    if model is not None:
        if model not in PRESETS:
            raise ConfigError(f"unknown model preset '{model}' (expected one of {', '.join(PRESETS)})")
        p = PRESETS[model]
        w.layers = [p.in_features or 50, *p.hidden, p.out_features or 3]
    elif layers is not None:
        w.layers = [int(v) for v in layers]
    else:
        if int(params) < 1:
            raise ConfigError(f"parameter count must be >= 1, got {params}")
        w.params = int(params)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch size must be an integer >= 1, got {batch_size}")
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision '{precision}' (expected {', '.join(PRECISIONS)})")
    if not bucket_mb > 0:
        raise ConfigError(f"bucket size must be > 0 MB, got {bucket_mb}")
    w.global_batch, w.precision, w.optimizer = batch_size, precision, optimizer
    w.bucket_elems = max(1, int(bucket_mb * (1 << 20) / 4))
    return w
