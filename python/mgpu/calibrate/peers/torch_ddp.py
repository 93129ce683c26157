"""PyTorch peer of `mgpu bench --compare torch`: the same MLP, loss, optimizer,
batch and step methodology in PyTorch, data-parallel with DDP (gloo on the CPU,
NCCL on GPUs), launched by the benchmark under mpirun (ranks from OpenMPI's
environment). Standalone: it runs in whichever interpreter has torch (the
venv's, or Debian's /usr/bin/python3 with python3-torch), without mgpu.

Prints one JSON line on rank 0: per-step seconds of the measured steps.
"""

import argparse
import contextlib
import json
import os
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", required=True)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, required=True, help="global")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--precision",
        choices=("fp32", "tf32", "bf16", "fp16"),
        default="fp32",
        help="as mgpu's: tf32 GEMMs, or bf16/fp16 autocast with fp32 master weights",
    )
    p.add_argument(
        "--shard-optimizer",
        action="store_true",
        help="as mgpu's: ZeroRedundancyOptimizer shards the optimizer state and update over the ranks",
    )
    p.add_argument("--port", type=int, default=29533)
    a = p.parse_args()
    # torch.set_num_threads does not reach the BLAS: Debian's torch calls OpenBLAS,
    # which would otherwise use every core. Same threads as mgpu, or the peer cheats.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(a.threads)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(a.threads)
    if a.precision != "fp32" and a.device != "cuda":
        raise SystemExit(f"--precision {a.precision} needs --device cuda")
    if a.device == "cuda":  # fp32 means IEEE fp32 GEMMs, as mgpu's default
        torch.backends.cuda.matmul.allow_tf32 = a.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = a.precision == "tf32"
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.precision)
    scaler = torch.amp.GradScaler("cuda") if a.precision == "fp16" else None
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0))
    device = (
        torch.device("cuda", local % max(torch.cuda.device_count(), 1)) if a.device == "cuda" else torch.device("cpu")
    )
    if world > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(a.port))
        dist.init_process_group("nccl" if a.device == "cuda" else "gloo", rank=rank, world_size=world)
    sizes = [int(v) for v in a.layers.split(",")]
    torch.manual_seed(0)
    mods = []
    for i in range(len(sizes) - 1):
        mods.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i + 2 < len(sizes):
            mods.append(torch.nn.ReLU())
            if a.dropout > 0:
                mods.append(torch.nn.Dropout(a.dropout))
    net = torch.nn.Sequential(*mods).to(device)
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if a.device == "cuda" else None)
    kind, settings = (
        (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}) if a.optimizer == "sgd" else (torch.optim.AdamW, {"lr": 1e-3})
    )
    if a.shard_optimizer and world > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=kind, **settings)
    else:
        opt = kind(net.parameters(), **settings)
    lossf = torch.nn.MSELoss()
    local_batch = a.batch_size // world + (rank < a.batch_size % world)
    xs = [torch.randn(local_batch, sizes[0], device=device) for _ in range(4)]
    ys = [torch.randn(local_batch, sizes[-1], device=device) for _ in range(4)]
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    def step(i):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=half) if half is not None else contextlib.nullcontext():
            loss = lossf(net(xs[i % 4]).float(), ys[i % 4])
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()

    for i in range(a.warmup):
        step(i)
    times = []
    for _ in range(a.repeats):
        if world > 1:
            dist.barrier()
        for i in range(a.steps):
            sync()
            t0 = time.perf_counter()
            step(i)
            sync()
            times.append(time.perf_counter() - t0)
    if rank == 0:
        print(
            json.dumps(
                {
                    "impl": "torch",
                    "version": torch.__version__,
                    "ranks": world,
                    "precision": a.precision,
                    # what it ran, as it parsed it: bench checks it is the workload mgpu ran
                    "workload": {
                        "layers": sizes,
                        "dropout": a.dropout,
                        "batch_size": a.batch_size,
                        "optimizer": a.optimizer,
                        "threads": a.threads,
                        "shard_optimizer": a.shard_optimizer and world > 1,
                    },
                    "step_seconds": times,
                }
            )
        )
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
