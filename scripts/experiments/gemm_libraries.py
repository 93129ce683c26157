"""OpenBLAS, oneDNN and libxsmm on a model's own fp32 GEMM shapes, one thread: each
layer's forward (row-major NT), input-gradient (NN) and weight-gradient (TN)
product, timed by scripts/experiments/gemm_libraries.c (compiled here with the system's cc;
needs libopenblas-dev, libdnnl-dev and libxsmm-dev), the libraries alternating
within every repeat. libxsmm twice: through its BLAS interface (JIT kernels up to
its size threshold, the BLAS beyond) and its JIT kernel asked for the shape
directly. The measurement behind issue 14's "libxsmm" entry in docs/journal.md
(2026-11-24: measured, not adopted).

    .venv/bin/python scripts/experiments/gemm_libraries.py --model medium --batch 64
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mgpu.calibrate.bench import resolve_layers
from mgpu.hostinfo import cpu_description
from mgpu.train.config import PRESETS

HERE = Path(__file__).resolve().parent
LIBRARIES = ("openblas", "onednn", "libxsmm", "libxsmm jit")


def build(workdir: str) -> str:
    exe = os.path.join(workdir, "gemm_libraries")
    cmd = [
        "cc",
        "-O2",
        "-o",
        exe,
        str(HERE / "gemm_libraries.c"),
        "-ldnnl",
        "-lxsmm",
        "-lxsmmnoblas",
        "-lopenblas",
        "-lm",
        "-lpthread",
        "-ldl",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(
            f"gemm_libraries: cannot build the harness (apt install libopenblas-dev libdnnl-dev libxsmm-dev): "
            f"{r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"
        )
    return exe


def shapes(sizes, batch):
    """(name, form, M, N, K) of every GEMM a step of the model issues (the first layer has no input gradient)."""
    out = []
    for l in range(len(sizes) - 1):
        IN, OUT = sizes[l], sizes[l + 1]
        out.append((f"L{l} forward", "nt", batch, OUT, IN))
        if l > 0:
            out.append((f"L{l} dX", "nn", batch, IN, OUT))
        out.append((f"L{l} dW", "tn", OUT, IN, batch))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="medium")
    p.add_argument("--batch", type=int, default=64, help="rows of each GEMM's batch side (default 64)")
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args()
    if a.batch < 1 or a.repeats < 1:
        sys.exit("gemm_libraries: --batch and --repeats must be >= 1")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", DNNL_VERBOSE="0")
    sizes, _ = resolve_layers(a.model, None)
    cpu = cpu_description()
    print(f"{a.model} {sizes}, batch {a.batch}, 1 thread, {cpu['model']} ({', '.join(cpu['isa'])})")
    print(f"{'GEMM':<12} {'form':>4} {'M':>5} {'N':>5} {'K':>5}" + "".join(f" {n + ' us':>15}" for n in LIBRARIES))
    totals = [0.0] * len(LIBRARIES)
    flops = 0.0
    with tempfile.TemporaryDirectory() as work:
        exe = build(work)
        for name, form, M, N, K in shapes(sizes, a.batch):
            r = subprocess.run(
                [exe, form, str(M), str(N), str(K), str(a.repeats)], capture_output=True, text=True, env=env, check=True
            )
            *seconds, diff = [float(v) for v in r.stdout.split()]
            if diff > 1e-3 * K**0.5:
                sys.exit(f"gemm_libraries: {name}: the libraries disagree by {diff:g}")
            # A shape the JIT makes no kernel for counts at libxsmm's BLAS-interface time.
            jit = seconds[3] if seconds[3] == seconds[3] else seconds[2]
            seconds = seconds[:3] + [jit]
            for i, s in enumerate(seconds):
                totals[i] += s
            flops += 2.0 * M * N * K
            cells = "".join(f" {s * 1e6:>15.2f}" for s in seconds[:3])
            cells += f" {jit * 1e6:>15.2f}" if r.stdout.split()[3] != "nan" else f" {'(none)':>15}"
            print(f"{name:<12} {form:>4} {M:>5} {N:>5} {K:>5}{cells}")
    print(f"{'all GEMMs':<30}" + "".join(f" {t * 1e6:>15.1f}" for t in totals))
    print(f"{'GFLOP/s':<30}" + "".join(f" {flops / t / 1e9:>15.1f}" for t in totals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
