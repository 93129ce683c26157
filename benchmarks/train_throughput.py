"""Training throughput on the CPU: mgpu (1 and N ranks) beside PyTorch, same run.

Measures samples/s of full training steps (forward, loss, backward, gradient
allreduce, SGD-momentum update) of a model preset at a global batch on the
synthetic set; warm-up steps excluded; the median of repeats is reported.
The PyTorch peer runs the same model (nn.Linear/ReLU/Dropout stack), loss,
optimizer, batch and thread count, in whichever interpreter has torch
(this one, or Debian's /usr/bin/python3 with python3-torch).

    .venv/bin/python benchmarks/train_throughput.py --model large --batch-size 1024 \
        --ranks 1,2 --threads 1 --coretypes env,Haswell,SkylakeX --json out/bench-cpu.json

Worker modes (--worker mgpu|torch) are what the driver launches; run them by hand
only to debug.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _layers(model: str, layers: str | None):
    # kept free of mgpu imports so the torch worker can run in another interpreter
    presets = {"medium": ([256, 128, 64], 0.2, 50, 3), "large": ([1024, 1024, 512, 512, 256], 0.3, 50, 3),
               "xl": ([8192, 6144, 4096, 2048, 1024], 0.0, 4096, 512)}
    if layers:
        sizes = [int(v) for v in layers.split(",")]
        return sizes, 0.0
    hidden, dropout, i, o = presets[model]
    return [i, *hidden, o], dropout


def _timed(step, warmup: int, steps: int, repeats: int, batch: int, sync=lambda: None):
    for _ in range(warmup):
        step()
    rates = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        rates.append(batch * steps / (time.perf_counter() - t0))
    return rates


def worker_mgpu(a):
    import numpy as np
    import mgpu
    from mgpu.data import local_slice, synthetic_regression
    pg = mgpu.ProcessGroup()
    sizes, dropout = _layers(a.model, a.layers)
    x, y = synthetic_regression(a.batch_size * 4, sizes[0], sizes[-1])
    model = mgpu.MLP(sizes, seed=0, dropout=dropout, threads=a.threads)
    trainer = mgpu.Trainer(model, loss="mse", optimizer="sgd", lr=1e-3, momentum=0.9, process_group=pg,
                           bucket_elems=int(a.bucket_mb * 262144), overlap=not a.no_overlap)
    part = local_slice(a.batch_size, pg.rank, pg.size)
    batches = [(x[i * a.batch_size:(i + 1) * a.batch_size][part], y[i * a.batch_size:(i + 1) * a.batch_size][part])
               for i in range(4)]
    state = {"i": 0}

    def step():
        bx, by = batches[state["i"] % 4]
        state["i"] += 1
        trainer.step(bx, by, global_batch=a.batch_size, first_sample=part.start)

    pg.barrier()
    rates = _timed(step, a.warmup, a.steps, a.repeats, a.batch_size, sync=pg.barrier)
    if pg.is_root:
        print(json.dumps({"impl": "mgpu", "ranks": pg.size, "threads": a.threads, "rates": rates,
                          "params": model.num_params, "blas": mgpu.build_info()["blas"]["config"]}))


def worker_torch(a):
    import torch
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    sizes, dropout = _layers(a.model, a.layers)
    mods = []
    for i in range(len(sizes) - 1):
        mods.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i + 2 < len(sizes):
            mods.append(torch.nn.ReLU())
            if dropout > 0:
                mods.append(torch.nn.Dropout(dropout))
    net = torch.nn.Sequential(*mods)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    lossf = torch.nn.MSELoss()
    xs = [torch.randn(a.batch_size, sizes[0]) for _ in range(4)]
    ys = [torch.randn(a.batch_size, sizes[-1]) for _ in range(4)]
    state = {"i": 0}

    def step():
        i = state["i"] % 4
        state["i"] += 1
        opt.zero_grad(set_to_none=True)
        loss = lossf(net(xs[i]), ys[i])
        loss.backward()
        opt.step()

    rates = _timed(step, a.warmup, a.steps, a.repeats, a.batch_size)
    print(json.dumps({"impl": "torch", "ranks": 1, "threads": a.threads, "rates": rates,
                      "version": torch.__version__}))


def _torch_python():
    for py in (sys.executable, "/usr/bin/python3"):
        if os.path.exists(py) and subprocess.run([py, "-c", "import torch"], capture_output=True).returncode == 0:
            return py
    return None


def _run(cmd, env):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"benchmark worker failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=["mgpu", "torch"])
    p.add_argument("--model", default="large", choices=["medium", "large", "xl"])
    p.add_argument("--layers")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--coretypes", default="env",
                   help="OPENBLAS_CORETYPE settings to compare: 'env' (as inherited), 'auto' (unset), or names")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--json")
    a = p.parse_args()
    if a.worker == "mgpu":
        return worker_mgpu(a)
    if a.worker == "torch":
        return worker_torch(a)

    common = ["--model", a.model, "--batch-size", a.batch_size, "--threads", a.threads, "--warmup", a.warmup,
              "--steps", a.steps, "--repeats", a.repeats, "--bucket-mb", a.bucket_mb]
    if a.layers:
        common += ["--layers", a.layers]
    if a.no_overlap:
        common.append("--no-overlap")
    common = [str(c) for c in common]
    torch_py = None if a.no_torch else _torch_python()
    results = []
    for coretype in a.coretypes.split(","):
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS=str(a.threads))
        if coretype == "auto":
            env.pop("OPENBLAS_CORETYPE", None)
        elif coretype != "env":
            env["OPENBLAS_CORETYPE"] = coretype
        label = env.get("OPENBLAS_CORETYPE", "auto-detected")
        row = {"openblas_coretype": label}
        for n in [int(v) for v in a.ranks.split(",")]:
            cmd = ["mpirun", "-np", str(n), "--bind-to", "core" if n > 1 else "none", sys.executable,
                   __file__, "--worker", "mgpu", *common]
            r = _run(cmd, env)
            row[f"mgpu_{n}"] = statistics.median(r["rates"])
            row.setdefault("params", r["params"])
            row.setdefault("blas", r["blas"])
        if torch_py:
            r = _run([torch_py, __file__, "--worker", "torch", *common], env)
            row["torch_1"] = statistics.median(r["rates"])
            row["torch_version"] = r["version"]
        results.append(row)
        line = f"OPENBLAS_CORETYPE={label:13s}"
        for k, v in row.items():
            if k.startswith(("mgpu_", "torch_1")):
                line += f"  {k}: {v:9.0f}/s"
        if "torch_1" in row:
            line += f"  mgpu_1/torch: {row['mgpu_1'] / row['torch_1']:.2f}x"
        if "mgpu_2" in row:
            line += f"  mgpu_2/mgpu_1: {row['mgpu_2'] / row['mgpu_1']:.2f}x"
        print(line, flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=2))


if __name__ == "__main__":
    main()
