"""The analytic cost sheet of one CUDA training step (`mgpu bench --device cuda --explain`).

Lists what the CUDA backend issues in one steady-state step (csrc/core/train_step.cpp,
csrc/cuda/cuda_backend.cu, kernels/): every GEMM, kernel, copy and host synchronisation,
with its FLOPs, bytes and launches, priced on a named GPU from published figures: GEMMs
on the curve the selector fits to published GEMM tables (gemm_fit), other kernels at the
measured HBM bandwidth, input copies at the measured host-to-device rate, launches and
synchronisations at measured latencies (and the assumptions each figure names); the
selector's named GPU profiles take the same figures. It compares the
predicted step with the floor 6 x params x rows / (fitted peak GEMM rate) and names what makes
up the difference. Arithmetic only: nothing here runs on a GPU. The counts of launches,
GEMM calls, host synchronisations and copied bytes are checked against the GPU emulation's
counters (tests/gpu/test_cost_sheet.py), so the sheet cannot drift from the code.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import List, Optional

from . import gemm_fit
from .hardware import H100_SXM, HOST_LOOP_S, GpuSpec

# --- the GPU ---------------------------------------------------------------------------------


# What would remove each family's cost (the gaps' causes, as the sheet prints them).
REMEDIES = {
    "input copy": "rows not resident (--data-on-device off, or a training set too large for the GPU): copied "
    "in on a copy stream while the step before computes (what that cannot hide shows), then within the GPU "
    "into the staged buffers",
    "input gather": "the step's rows gathered from the training set held on the GPU (--data-on-device): a "
    "read and a write of each row; the first layer reading its rows through the index would save the write",
    "operand casts": "fp32 -> half copies of the input and the loss gradient, once each (the weights' copy "
    "is the optimizer's, the activations' and their gradients' the ReLU kernels'); the loss "
    "kernel and the input staging could write them too",
    "optimizer": "fp32 master weights and state read and written once per step, whatever the batch: its "
    "share of the floor falls as the samples per step grow",
    "health check": "one read of every gradient for the norm and the NaN/Inf check",
    "relu/dropout": "a read and write of every activation, forward and backward",
    "bias broadcast": "bias written into the output before the GEMM adds onto it (a cuBLASLt bias epilogue "
    "would fuse it)",
    "bias gradient": "a read of every output gradient for the column sums",
}

HALF_PRECISIONS = ("bf16", "fp16")
GRAPH_AUTO_MAX_PARAMS = 1 << 24  # StepOptions::kGraphAutoMaxParams (csrc/core/train_step.h)


# kernels/reduce.cu's column_splits: the bias gradient's row splits (one launch,
# or two with a second pass over the splits' partials when there are several).
REDUCE_BLOCKS, COL_TILE, COL_ROWS, COL_UNROLL = 528, 32, 8, 8
COLUMN_PARTIALS = 2 * REDUCE_BLOCKS * COL_TILE


def column_splits(B: int, OUT: int) -> int:
    ceil = lambda a, b: -(-a // b)
    splits = min(
        ceil(REDUCE_BLOCKS, ceil(OUT, COL_TILE)),
        ceil(B, COL_ROWS * COL_UNROLL),
        COL_ROWS * COL_UNROLL,
        COLUMN_PARTIALS // OUT,
    )
    return max(splits, 1)


def uses_graph(mode: str, params: int) -> bool:
    """Whether a step of `params` parameters replays a CUDA graph under --cuda-graph `mode`."""
    return mode == "on" or (mode == "auto" and params <= GRAPH_AUTO_MAX_PARAMS)


def gemm_seconds(gpu: GpuSpec, precision: str, flops: float) -> float:
    """A GEMM's time by its work, as the selector prices it (GemmRate in perf_model.h):
    flops / peak plus the fitted fixed time half / peak."""
    fit = gemm_fit.rate(gpu.gemm_type, precision)
    return float((flops + fit["half_work_flops"]) / fit["peak_flops"])


def best_gemm_rate(gpu: GpuSpec, precision: str) -> float:
    """The fitted peak: the rate a large GEMM approaches."""
    return float(gemm_fit.rate(gpu.gemm_type, precision)["peak_flops"])


# --- the step's operations ------------------------------------------------------------------


@dataclass
class Op:
    """One kind of operation in the step, `count` times per step."""

    family: str  # what it belongs to (the rows of the sheet)
    kind: str  # gemm | kernel | memset | h2d | d2h | d2d | graph | sync
    beside: bool = False  # on a stream of its own while the step before computes (the prefetch)
    count: int = 1
    flops: float = 0.0  # per operation
    bytes: float = 0.0  # device memory traffic (or bus bytes for copies), per operation
    in_graph: bool = False
    gemm_shape: Optional[tuple] = None

    def seconds(self, gpu: GpuSpec, precision: str) -> float:
        """Device time of one operation (copies: bus time; syncs and graph launches: 0)."""
        if self.kind == "gemm":  # the fitted fixed time is its shortest
            return max(gemm_seconds(gpu, precision, self.flops), self.bytes / gpu.hbm_bytes_per_s)
        if self.kind in ("kernel", "memset"):  # in a graph a short kernel's run is part of its node's cost
            return max(self.bytes / gpu.hbm_bytes_per_s, 0.0 if self.in_graph else gpu.min_kernel_s)
        if self.kind in ("h2d", "d2h"):
            return self.bytes / gpu.h2d_bytes_per_s
        if self.kind == "d2d":  # read and written; a copy takes a kernel's shortest time too
            return max(2 * self.bytes / gpu.hbm_bytes_per_s, gpu.min_kernel_s)
        return 0.0


@dataclass
class Workload:
    sizes: List[int]
    batch: int  # global batch
    precision: str = "fp32"
    optimizer: str = "sgd"
    momentum: bool = True
    dropout: float = 0.0
    loss: str = "mse"
    accumulate: int = 1
    graph: bool = False
    ranks: int = 1
    data_on_device: bool = True  # the rows gathered from a training set on the GPU (train's default there)

    @property
    def params(self) -> int:
        return sum(self.sizes[l] * self.sizes[l + 1] + self.sizes[l + 1] for l in range(len(self.sizes) - 1))


# sizeof(StepVerdict) (csrc/core/step_verdict.h): two doubles, two floats, a float and an int32.
STEP_VERDICT_BYTES = 32


def micro_batches(batch: int, ranks: int, accumulate: int, rank: int = 0) -> List[int]:
    """Rows of each micro-batch on `rank`, split as data.split_counts and Trainer.step split them."""
    local = batch // ranks + (1 if rank < batch % ranks else 0)
    k = min(accumulate, max(local, 1))
    return [local * (i + 1) // k - local * i // k for i in range(k)]


def step_ops(w: Workload) -> List[Op]:
    """What one steady-state step issues on rank 0, in order (world size 1 issues no collective)."""
    if w.precision not in ("fp32", "tf32", *HALF_PRECISIONS):
        raise ValueError(f"unknown precision '{w.precision}'")
    half = w.precision in HALF_PRECISIONS
    eb = 2 if half else 4  # GEMM operand bytes
    s = w.sizes
    L = len(s) - 1
    ops: List[Op] = [Op("stop flag", "memset", bytes=4)]
    if not w.data_on_device:  # the step's rows, x and y, prefetched during the step before (Trainer.fit on GPUs)
        local = sum(micro_batches(w.batch, w.ranks, w.accumulate))
        ops.append(Op("input copy", "h2d", bytes=local * s[0] * 4, beside=True))
        ops.append(Op("input copy", "h2d", bytes=local * (s[-1] * 4 if w.loss == "mse" else 4), beside=True))
    written = False
    for r in micro_batches(w.batch, w.ranks, w.accumulate):
        if r == 0:
            continue
        g = w.graph
        target_bytes = r * s[-1] * 4 if w.loss == "mse" else r * 4
        if w.data_on_device:  # each a read and a write of the rows, and their row numbers read
            ops.append(Op("input gather", "kernel", bytes=2 * r * s[0] * 4 + r * 8))
            ops.append(Op("input gather", "kernel", bytes=2 * target_bytes + r * 8))
        else:  # prefetched (below), then copied into the staged buffers
            ops.append(Op("input copy", "d2d", bytes=r * s[0] * 4))
            ops.append(Op("input copy", "d2d", bytes=target_bytes))
        if g:
            ops.append(Op("graph replay", "kernel", bytes=8))  # set_replay_args
            ops.append(Op("graph replay", "graph"))
        for l in range(L):  # forward: inp (r, IN), w (OUT, IN) -> out (r, OUT)
            IN, OUT = s[l], s[l + 1]
            ops.append(Op("bias broadcast", "kernel", bytes=r * OUT * 4 + OUT * 4, in_graph=g))
            # Half operands: the weights' copy is the optimizer's, an activation's the ReLU's
            # that produced it; only the input is cast (once: backward reads that copy too).
            if half and l == 0:
                ops.append(Op("operand casts", "kernel", bytes=r * IN * 6, in_graph=g))
            ops.append(
                Op(
                    "GEMM forward",
                    "gemm",
                    flops=2.0 * r * IN * OUT,
                    in_graph=g,
                    gemm_shape=(OUT, r, IN),
                    bytes=(OUT * IN + r * IN) * eb + 2 * r * OUT * 4,
                )
            )
            if l + 1 < L:  # + its half copy, written with it
                ops.append(Op("relu/dropout", "kernel", bytes=r * OUT * (10 if half else 8), in_graph=g))
        C = s[-1]
        ops.append(Op("loss", "kernel", in_graph=g, bytes=r * C * 12 if w.loss == "mse" else r * C * 8 + r * 4))
        ops.append(Op("loss", "kernel", bytes=64, in_graph=g))  # finalize_partials
        if written:
            ops.append(Op("loss", "kernel", bytes=12, in_graph=g))  # axpy into the loss slot
        for l in reversed(range(L)):  # backward: dout (r, OUT) -> dW (OUT, IN), db (OUT), dinp (r, IN)
            IN, OUT = s[l], s[l + 1]
            acc = 2 if written else 1
            if half and l == L - 1:  # the loss gradient, cast once for both GEMMs; later ones are the ReLU's
                ops.append(Op("operand casts", "kernel", bytes=r * OUT * 6, in_graph=g))
            if l > 0:
                ops.append(
                    Op(
                        "GEMM backward",
                        "gemm",
                        flops=2.0 * r * IN * OUT,
                        in_graph=g,
                        gemm_shape=(IN, r, OUT),
                        bytes=(OUT * IN + r * OUT) * eb + r * IN * 4,
                    )
                )
            ops.append(
                Op(
                    "GEMM backward",
                    "gemm",
                    flops=2.0 * r * IN * OUT,
                    in_graph=g,
                    gemm_shape=(IN, OUT, r),
                    bytes=(r * IN + r * OUT) * eb + acc * OUT * IN * 4,
                )
            )
            splits = column_splits(r, OUT)
            if splits == 1:
                ops.append(Op("bias gradient", "kernel", bytes=r * OUT * 4 + acc * OUT * 4, in_graph=g))
            else:  # row splits into partials, then their fixed-order sum
                ops.append(Op("bias gradient", "kernel", bytes=r * OUT * 4 + splits * OUT * 4, in_graph=g))
                ops.append(Op("bias gradient", "kernel", bytes=splits * OUT * 4 + acc * OUT * 4, in_graph=g))
            if l > 0:  # + the half copy of the gradient it passes on
                ops.append(Op("relu/dropout", "kernel", bytes=r * IN * (14 if half else 12), in_graph=g))
        written = True
    # The tail (health check, verdict, update) runs on the device with no host wait:
    # inside the last micro-batch's graph on one GPU, as a graph of its own after
    # the allreduce on several, launched kernel by kernel without graphs.
    P = w.params
    tail_graph = w.graph and w.ranks > 1
    if tail_graph:
        ops.append(Op("graph replay", "kernel", bytes=8))  # set_replay_args
        ops.append(Op("graph replay", "graph"))
    g = w.graph
    ops.append(Op("health check", "kernel", bytes=P * 4, in_graph=g))  # sum_squares
    ops.append(Op("health check", "kernel", bytes=64, in_graph=g))  # its finalize
    ops.append(Op("health check", "kernel", bytes=64, in_graph=g))  # the verdict (decide_step)
    state = {"sgd": 2 if w.momentum else 1, "adamw": 3}[w.optimizer]  # arrays read and written
    # + the gradient, read; + the parameters' half copy, written, for half-precision GEMMs
    ops.append(Op("optimizer", "kernel", bytes=P * 4 * (2 * state + 1) + (P * 2 if half else 0), in_graph=g))
    ops.append(Op("verdict read-back", "d2h", bytes=STEP_VERDICT_BYTES))  # loss, stop, norm, applied
    ops.append(Op("host sync", "sync"))
    return ops


# --- the sheet --------------------------------------------------------------------------------


@dataclass
class Sheet:
    workload: Workload
    gpu: GpuSpec
    rows: "OrderedDict[str, dict]" = field(default_factory=OrderedDict)
    totals: dict = field(default_factory=dict)
    gaps: list = field(default_factory=list)

    def as_dict(self) -> dict:
        w = self.workload
        return {
            "gpu": self.gpu.name,
            "sources": list(self.gpu.sources),
            "workload": {
                "layers": list(w.sizes),
                "batch": w.batch,
                "precision": w.precision,
                "optimizer": w.optimizer,
                "loss": w.loss,
                "accumulate": w.accumulate,
                "cuda_graph": w.graph,
                "ranks": w.ranks,
                "params": w.params,
                "data_on_device": w.data_on_device,
            },
            "rows": [dict(family=k, **v) for k, v in self.rows.items()],
            "totals": self.totals,
            "gaps": self.gaps,
        }


def counts(ops: List[Op]) -> dict:
    """Per-step counts in the emulation's terms (emulation/README.md): kernel launches
    outside graphs, kernels run, graph launches, GEMM calls issued outside graphs, host
    synchronisations, bytes each way."""
    kernels = [o for o in ops if o.kind == "kernel"]
    return {
        "kernel_launches": sum(o.count for o in kernels if not o.in_graph),
        "kernels_executed": sum(o.count for o in kernels),
        "graph_launches": sum(o.count for o in ops if o.kind == "graph"),
        "blas_calls": sum(o.count for o in ops if o.kind == "gemm" and not o.in_graph),
        "host_syncs": sum(o.count for o in ops if o.kind == "sync"),
        "h2d_bytes": sum(o.count * o.bytes for o in ops if o.kind == "h2d"),
        "pageable_h2d_copies": 0,  # every input goes through the backend's pinned staging
        "d2h_bytes": sum(o.count * o.bytes for o in ops if o.kind == "d2h"),
        "d2d_bytes": sum(o.count * o.bytes for o in ops if o.kind == "d2d"),
    }


def explain(w: Workload, gpu: GpuSpec = H100_SXM) -> Sheet:
    """Prices `step_ops(w)` on `gpu`: device time per family, launch and synchronisation
    costs, the step, the floor and the gaps between them."""
    ops = step_ops(w)
    sheet = Sheet(w, gpu)
    device = in_graph = beside = 0.0
    for o in ops:
        row = sheet.rows.setdefault(o.family, {"launches": 0, "gemms": 0, "gflop": 0.0, "mbytes": 0.0, "ms": 0.0})
        t = o.count * o.seconds(gpu, w.precision)
        if o.beside:  # on its own stream, beside the step before: what it cannot hide is priced below
            beside += t
            row["mbytes"] += o.count * o.bytes / 1e6
            continue
        if o.in_graph:
            in_graph += t + o.count * gpu.graph_node_s
        row["launches"] += o.count if o.kind in ("kernel", "graph") else 0
        row["gemms"] += o.count if o.kind == "gemm" else 0
        row["gflop"] += o.count * o.flops / 1e9
        row["mbytes"] += o.count * o.bytes / 1e6
        row["ms"] += t * 1e3
        device += t
    # Launch costs. On the device: a gap before each stream operation, a node's cost
    # inside a graph. On the host: an enqueue per operation outside graphs; when the
    # host is slower than the device, the device waits for it. A synchronisation drains
    # the queue, so its latency adds to the step, and so does the host loop after it
    # (the device is idle until the next step's first launch).
    issued = [o for o in ops if o.kind in ("kernel", "memset", "gemm", "h2d", "d2h", "d2d", "graph")]
    gaps = sum(
        o.count * (gpu.graph_node_s if o.in_graph else gpu.stream_gap_s)
        for o in issued
        if o.kind != "graph" and not o.beside
    )
    host = sum(o.count * gpu.launch_s for o in issued if not o.in_graph)
    syncs = sum(o.count for o in ops if o.kind == "sync")
    stream = device + gaps
    busy = max(stream, beside)  # a prefetch longer than the step it hides behind holds the next one up
    step = HOST_LOOP_S + max(busy, host) + syncs * gpu.sync_s
    # rank 0 holds the most rows (a share of the batch, rounded up): the slowest GPU's floor
    floor = 6.0 * w.params * sum(micro_batches(w.batch, w.ranks, w.accumulate)) / best_gemm_rate(gpu, w.precision)
    c = counts(ops)
    sheet.totals = {
        "device_ms": device * 1e3,
        "prefetch_ms": beside * 1e3,
        "launch_gaps_ms": gaps * 1e3,
        "host_issue_ms": host * 1e3,
        "host_bound": host > busy,
        "sync_ms": syncs * gpu.sync_s * 1e3,
        "host_loop_ms": HOST_LOOP_S * 1e3,
        "in_graph_ms": in_graph * 1e3,
        "step_ms": step * 1e3,
        "floor_ms": floor * 1e3,
        "ratio_to_floor": step / floor,
        "samples_per_s": w.batch / step,
        **c,
    }
    # What separates the step from the floor, largest first; they add up to step - floor.
    # The GEMMs' work is below 6 x params x rows (the first layer computes no input
    # gradient, a bias no product): a negative entry, so that the rest are not understated.
    gemm_ms = sum(v["ms"] for k, v in sheet.rows.items() if k.startswith("GEMM"))
    gemm_at_peak_ms = sum(o.count * o.flops for o in ops if o.kind == "gemm") / best_gemm_rate(gpu, w.precision) * 1e3
    causes = [
        ("GEMM shapes below cuBLAS's best rate (and their fp32 output traffic)", gemm_ms - gemm_at_peak_ms),
        (
            "GEMM work below 6 x params x rows: the first layer computes no input gradient, a bias no product",
            gemm_at_peak_ms - floor * 1e3,
        ),
    ]
    causes += [
        (f"{k}: " + REMEDIES.get(k, "memory-bound, or the shortest kernel time"), v["ms"])
        for k, v in sheet.rows.items()
        if not k.startswith("GEMM") and v["ms"] > 0
    ]
    causes.append(
        (
            "launch gaps and host issue" + (" (host-bound: the GPU waits for launches)" if host > busy else ""),
            (max(stream, host) - device) * 1e3,
        )
    )
    causes.append(
        (
            "input prefetch longer than the step it hides behind: rows not resident cross the host link",
            (max(busy, host) - max(stream, host)) * 1e3,
        )
    )
    causes.append(("host synchronisation", syncs * gpu.sync_s * 1e3))
    causes.append(
        ("host loop: mgpu's Python and bookkeeping a step, while the drained device waits", HOST_LOOP_S * 1e3)
    )
    sheet.gaps = [
        {"cause": k, "ms": v, "of_floor": v / (floor * 1e3)}
        for k, v in sorted(causes, key=lambda kv: -kv[1])
        if abs(v) > 1e-6
    ]
    return sheet


def format_sheet(sheet: Sheet) -> str:
    w, t = sheet.workload, sheet.totals
    head = (
        f"cost sheet: layers {','.join(map(str, w.sizes))} ({w.params / 1e6:.2f}M params), batch {w.batch}"
        f"{f' over {w.ranks} GPUs' if w.ranks > 1 else ''}, {w.precision}, {w.optimizer}, "
        f"accumulate {w.accumulate}, CUDA graph {'on' if w.graph else 'off'}, on an {sheet.gpu.name} "
        f"(analytic, from published figures: nothing was run)"
    )
    lines = [head, f"  {'what':<18}{'launches':>9} {'GEMMs':>6} {'GFLOP':>9} {'MB':>9} {'ms':>8}"]
    for k, v in sheet.rows.items():  # a space between columns: huge models widen them, never merge them
        lines.append(
            f"  {k:<18}{v['launches']:>9} {v['gemms']:>6} {v['gflop']:>9.2f} {v['mbytes']:>9.2f} {v['ms']:>8.4f}"
        )
    lines.append(
        f"  device work {t['device_ms']:.4f} ms + launch gaps {t['launch_gaps_ms']:.4f} ms; host issue "
        f"{t['host_issue_ms']:.4f} ms{' (host-bound)' if t['host_bound'] else ''}; "
        f"{t['host_syncs']} host sync {t['sync_ms']:.4f} ms; host loop {t['host_loop_ms']:.4f} ms"
    )
    if w.graph:
        lines.append(
            f"  the graph replay: {t['in_graph_ms']:.4f} ms of the step ({100 * t['in_graph_ms'] / t['step_ms']:.0f} %)"
        )
    lines.append(
        f"  predicted step {t['step_ms']:.4f} ms ({t['samples_per_s']:,.0f} samples/s); floor 6 x params "
        f"x rows a GPU / peak {w.precision} GEMM rate = {t['floor_ms']:.4f} ms; step / floor = "
        f"{t['ratio_to_floor']:.2f}x"
    )
    lines.append("  gaps to the floor:")
    for g in sheet.gaps:
        lines.append(f"    {g['ms']:9.4f} ms ({100 * g['of_floor']:6.1f} % of the floor)  {g['cause']}")
    return "\n".join(lines)
