"""The CPU backend's GEMM libraries on a model's own shapes: each layer's forward
(linear_forward) and backward (linear_backward: the input- and weight-gradient
GEMMs and the bias sums) timed with OpenBLAS, oneDNN and the `auto` rule, the
libraries alternating within every repeat so the machine's drift falls on all.
This is the measurement behind CpuGemm's rule (csrc/cpu/cpu_backend.h) and the
GEMM table of docs/benchmarks.md (its history in docs/journal.md).

    .venv/bin/python scripts/experiments/gemm_options.py --model medium --batch 64 --threads 1
"""

import argparse
import json
import os
import sys

import numpy as np

from mgpu import _core, build_info
from mgpu.calibrate.bench import resolve_layers
from mgpu.hostinfo import cpu_description
from mgpu.train.config import PRESETS


def cpu_name() -> str:
    """CPU model and vector extensions, as `mgpu topo` reports them."""
    cpu = cpu_description()
    return f"{cpu['model']} ({', '.join(cpu['isa']) or 'no SSE4.2/AVX'})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="large")
    p.add_argument("--batch", type=int, default=1024, help="rows per GEMM (one rank's share)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args()
    if a.batch < 1 or a.threads < 1 or a.repeats < 1:
        p.error("--batch, --threads and --repeats must be >= 1")
    libraries = ["openblas", "auto"] + (["onednn"] if build_info()["blas"].get("onednn") else [])
    backends = {}
    for lib in libraries:
        backends[lib] = _core.make_backend("cpu", 0, a.threads)
        _core.set_cpu_gemm(backends[lib], lib)
    sizes, _ = resolve_layers(a.model, None)
    rows = []
    for l in range(len(sizes) - 1):
        IN, OUT = sizes[l], sizes[l + 1]
        times = {lib: {"forward": [], "backward": []} for lib in libraries}
        inner = max(1, int(2e7 / (2.0 * a.batch * IN * OUT)))  # calls per sample: well above timer resolution
        for _ in range(a.repeats):
            for lib in libraries:
                be = backends[lib]
                times[lib]["forward"].append(sum(_core.time_linear(be, a.batch, IN, OUT, inner)) / inner)
                times[lib]["backward"].append(sum(_core.time_linear_backward(be, a.batch, IN, OUT, inner)) / inner)
        row = {
            "layer": l,
            "in": IN,
            "out": OUT,
            "forward_library": _core.cpu_gemm_library(backends["auto"], a.batch, OUT, IN),
            "ms": {lib: {k: float(np.median(v)) * 1e3 for k, v in t.items()} for lib, t in times.items()},
        }
        rows.append(row)
    flops = {
        "forward": lambda r: 2.0 * a.batch * r["in"] * r["out"],
        "backward": lambda r: 2.0 * a.batch * r["in"] * r["out"] * 2,
    }
    print(
        f"{a.model} {sizes}, {a.batch} rows, {a.threads} thread(s); {cpu_name()}; "
        f"{build_info()['blas']['library']}, oneDNN {build_info()['blas'].get('onednn') or 'absent'}; "
        f"medians of {a.repeats} alternating repeats, GFLOP/s"
    )
    head = f"{'layer':>5} {'shape':>12}  " + "  ".join(f"{lib + ' fwd':>13} {lib + ' bwd':>13}" for lib in libraries)
    print(head)
    for r in rows:
        cells = []
        for lib in libraries:
            for k in ("forward", "backward"):
                cells.append(f"{flops[k](r) / (r['ms'][lib][k] * 1e-3) / 1e9:>13.1f}")
        print(
            f"{r['layer']:>5} {r['in']:>5}x{r['out']:<6}  "
            + "  ".join(f"{cells[2 * i]} {cells[2 * i + 1]}" for i in range(len(libraries)))
        )
    totals = {lib: sum(r["ms"][lib]["forward"] + r["ms"][lib]["backward"] for r in rows) for lib in libraries}
    print("all GEMMs of a step: " + ", ".join(f"{lib} {ms:.3f} ms" for lib, ms in totals.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "cpu": cpu_name(),
                    "model": a.model,
                    "sizes": sizes,
                    "batch": a.batch,
                    "threads": a.threads,
                    "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
                    "rows": rows,
                    "totals_ms": totals,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
