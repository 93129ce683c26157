"""`mgpu recommend`: the selector's answer for a model and batch on a hardware profile."""

from __future__ import annotations

from ..atomic import write_json_atomic
from ..errors import ConfigError
from ..selector.hardware import PRECISIONS
from ..selector.memory import MEMORY_MARGIN
from ..selector.profiles import (
    NAMED_PROFILES,
    PROFILE_ALIASES,
    list_profiles,
    profile_sources,
)
from ..selector.recommend import MAX_NODES, format_recommendation, recommend
from ..train.config import DATA_PLACEMENTS, GRAD_DTYPES, GRAPH_MODES, PRESETS
from .common import bounded_int, check_outputs, int_list

MAX_PRICE = 1e6  # per device-hour: beyond any real one, and costs stay finite


# --- CLI: python -m mgpu recommend ----------------------------------------------------


def add_parser(sub) -> None:
    r = sub.add_parser(
        "recommend",
        help="single or multi-GPU? how many, and why (the performance model)",
        description="Predict step time on 1..N devices from a hardware profile and recommend a strategy, with reasons.",
    )
    m = r.add_mutually_exclusive_group(required=True)
    m.add_argument("--list-profiles", action="store_true", help="list the named profiles with their sources")
    m.add_argument("--model", choices=sorted(PRESETS))
    m.add_argument("--layers", type=int_list("layer sizes"), help="in,h1,...,out")
    m.add_argument("--params", type=float, help="only a parameter count (e.g. 7e6)")
    r.add_argument("--batch-size", type=int, default=None, help="global batch size (required with a model)")
    r.add_argument(
        "--devices",
        type=int_list("device counts", distinct=True),
        default=None,
        help="candidate device counts, each once; 1, the base of every speedup, is always one "
        "(default: 1 and the profile's GPUs per node, else 1,2)",
    )
    r.add_argument(
        "--nodes",
        type=bounded_int("--nodes", MAX_NODES),
        default=None,
        help="also predict this many nodes of the profile's GPUs per node (candidates 1 GPU, 1 node, K nodes)",
    )
    r.add_argument(
        "--profile",
        default="auto",
        help="auto | calibrated | NAME (--list-profiles) | PATH.json (default auto: the calibration "
        "from `mgpu topo`, else the visible GPUs, else seed 001's thresholds)",
    )
    r.add_argument("--precision", choices=PRECISIONS, default="fp32")
    r.add_argument(
        "--optimizer",
        choices=("sgd", "adamw"),
        default="adamw",
        help="the optimizer priced (default adamw, the heavier state; train's default is sgd: give it to price that)",
    )
    r.add_argument(
        "--grad-dtype",
        choices=GRAD_DTYPES,
        default="fp32",
        help="type the gradients travel in: bf16/fp16 halve the allreduce (NCCL; default fp32)",
    )
    r.add_argument(
        "--cuda-graph",
        choices=GRAPH_MODES,
        default="auto",
        help="as `train --cuda-graph`: auto (GPUs, models up to 2^24 parameters), on, off; captured "
        "steps pay less per kernel and allreduce after backward",
    )
    r.add_argument(
        "--accumulate",
        type=bounded_int("--accumulate", 2**62),
        default=1,
        help="micro-batches the global batch is split into a step (default 1); train's step of "
        "`--batch-size B --accumulate K` is --batch-size B*K --accumulate K here",
    )
    r.add_argument(
        "--shard-optimizer",
        action="store_true",
        help="as `train --shard-optimizer`: price every multi-device candidate with optimizer state "
        "sharded (1/N a device, gradients reduce-scattered, parameters all-gathered after the update)",
    )
    r.add_argument(
        "--data-on-device",
        choices=DATA_PLACEMENTS,
        default="auto",
        help="as `train --data-on-device`: a GPU's rows gathered from the training set in its memory "
        "(auto, on; train's default where it fits) or copied from the host each step (off)",
    )
    r.add_argument(
        "--bucket-mb",
        type=bucket_mb,
        default="auto",
        help="gradient bucket size in MB, or 'auto' (default: each multi-device candidate at the "
        "bucket the model prefers for it)",
    )
    r.add_argument("--dropout", type=float, default=None, help="default: the preset's, 0 otherwise")
    r.add_argument("--memory-margin", type=float, default=MEMORY_MARGIN, help="usable fraction of device memory")
    r.add_argument(
        "--price",
        type=float,
        default=0.0,
        metavar="PER_DEVICE_HOUR",
        help="price of one device-hour: adds cost per million samples and an ROI line",
    )
    r.add_argument("--json", metavar="PATH", help="write the recommendation as JSON")


def bucket_mb(text: str):
    """--bucket-mb: 'auto' or a positive number of MB."""
    import argparse

    if text == "auto":
        return "auto"
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MB or 'auto', got '{text}'") from None
    if not (v > 0 and v < float("inf")):
        raise argparse.ArgumentTypeError(f"bucket size must be > 0 MB, got {text}")
    if v * 1e6 / 4 > 2**62:  # elements of fp32 gradients: the core counts them in 64 bits
        raise argparse.ArgumentTypeError(f"bucket size must be at most {2**62 * 4 / 1e6:.3g} MB, got {text}")
    return v


def cmd_recommend(a, pg) -> int:
    if a.list_profiles:
        check_outputs({"--json": a.json})
        if pg.is_root:
            print(list_profiles())
            if a.json:  # the same list, machine-readable
                write_json_atomic(
                    a.json,
                    {
                        "profiles": {
                            name: {
                                "title": spec["title"],
                                "gpus_per_node": spec["gpus_per_node"],
                                "sources": profile_sources(spec) if spec["link"] else [],
                            }
                            for name, spec in NAMED_PROFILES.items()
                        },
                        "aliases": dict(PROFILE_ALIASES),
                    },
                )
        return 0
    if a.batch_size is None:
        raise ConfigError("recommend needs --batch-size (the global batch)")
    if a.batch_size > 2**62:  # the core counts samples in 64 bits (below 1: the workload's own check)
        raise ConfigError(f"--batch-size must be at most 2^62, got {a.batch_size}")
    check_outputs({"--json": a.json}, {"--profile": a.profile}, profile=a.profile)
    if not (0 < a.memory_margin <= 1):
        raise ConfigError(f"--memory-margin must be in (0, 1], got {a.memory_margin}")
    if not 0 <= a.price <= MAX_PRICE:  # NaN too
        raise ConfigError(f"--price must be a number from 0 to {MAX_PRICE:g} (a device-hour), got {a.price}")
    params = None
    if a.params is not None:
        if not 1 <= a.params <= 2**62:  # NaN and inf too; the core counts parameters in 64 bits
            raise ConfigError(f"--params must be in 1..2^62, got {a.params}")
        if a.params != int(a.params):
            raise ConfigError(f"--params must be a whole number of parameters, got {a.params}")
        params = int(a.params)
    result = recommend(
        model=a.model,
        layers=a.layers,
        params=params,
        batch_size=a.batch_size,
        devices=a.devices,
        profile=a.profile,
        precision=a.precision,
        optimizer=a.optimizer,
        bucket_mb=a.bucket_mb,
        memory_margin=a.memory_margin,
        price_per_device_hour=a.price,
        dropout=a.dropout,
        grad_dtype=a.grad_dtype,
        nodes=a.nodes,
        cuda_graph=a.cuda_graph,
        accumulate=a.accumulate,
        shard_optimizer=a.shard_optimizer,
        data_on_device=a.data_on_device != "off",
    )
    if pg.is_root:
        print(format_recommendation(result))
        if a.json:
            write_json_atomic(a.json, {"request": {k: v for k, v in vars(a).items() if k != "command"}, **result})
    return 0
