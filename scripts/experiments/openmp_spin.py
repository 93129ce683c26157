"""A/B of environment settings for `mgpu bench` cells, rounds alternated (the order
reversed every other round) with a fresh process per cell and round: the measurement
behind the GOMP_SPINCOUNT mgpu sets for OpenMP-only steps (python/mgpu/_runtime.py,
docs/benchmarks.md; its history in docs/journal.md). Prints each setting's median
samples/s and the median and range of its ratio to the first setting's, round by round.

    .venv/bin/python scripts/experiments/openmp_spin.py --settings "GOMP_SPINCOUNT=0;GOMP_SPINCOUNT=10000" \\
        --threads 2 --rounds 5
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

CELLS = {"medium": ("64,256,1024", 60), "large": ("64,1024", 10)}  # batches, steps per round


def parse_settings(text: str) -> list:
    """'K=V K2=V2;K=V' -> [{K: V, K2: V2}, {K: V}]: one environment change per setting."""
    settings = []
    for item in text.split(";"):
        pairs = [kv for kv in item.split() if kv]
        if not all("=" in kv and kv.index("=") > 0 for kv in pairs):
            raise argparse.ArgumentTypeError(f"a setting is KEY=VALUE pairs, got '{item}'")
        settings.append(dict(kv.split("=", 1) for kv in pairs))
    if len(settings) < 2:
        raise argparse.ArgumentTypeError("give at least two settings, separated by ';'")
    return settings


def run_cell(env_change: dict, model: str, threads: int) -> dict:
    batches, steps = CELLS[model]
    env = {**os.environ, **env_change}
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "mgpu",
                "bench",
                "--model",
                model,
                "--batch-sizes",
                batches,
                "--threads",
                str(threads),
                "--repeats",
                "1",
                "--steps",
                str(steps),
                "--warmup",
                "3",
                "--no-progress",
                "--json",
                out,
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        with open(out) as f:
            return {row["batch_size"]: row["samples_per_sec"] for row in json.load(f)["rows"]}
    finally:
        os.unlink(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--settings",
        type=parse_settings,
        required=True,
        help="';'-separated settings, each space-separated KEY=VALUE pairs",
    )
    p.add_argument("--models", default="medium,large")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    models = a.models.split(",")
    if a.threads < 1 or a.rounds < 1 or not set(models) <= set(CELLS):
        p.error(f"--threads and --rounds must be >= 1 and --models among {', '.join(CELLS)}")
    names = [" ".join(f"{k}={v}" for k, v in s.items()) for s in a.settings]
    rates = {}  # (model, batch) -> setting -> samples/s per round
    for r in range(a.rounds):
        for i in range(len(names)) if r % 2 == 0 else reversed(range(len(names))):
            for model in models:
                for batch, rate in run_cell(a.settings[i], model, a.threads).items():
                    rates.setdefault((model, batch), {}).setdefault(names[i], []).append(rate)
    for (model, batch), by in rates.items():
        base = by[names[0]]
        cells = []
        for name in names:
            ratios = [x / b for x, b in zip(by[name], base)]
            cells.append(
                f"{name}: {np.median(by[name]):,.0f} ({np.median(ratios):.2f}x, {min(ratios):.2f}-{max(ratios):.2f})"
            )
        print(f"{model} b{batch}, {a.threads} thread(s): " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
