"""`mgpu train --device cuda` end to end under mpirun with 2 ranks, one GPU each,
over NCCL: the run equals the CPU backend's and a 1-rank run, and a run stopped
at a checkpoint and resumed (--resume) ends bit-identical to the run that never
stopped. On the GPU emulation (MGPU_EMULATE_GPU=2) this is CI's NCCL training run."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

import mgpu
from conftest import mpi_env, mpirun  # tests/conftest.py helpers
from mgpu import _core

DATA = [
    "--dataset",
    "digits",
    "--layers",
    "64,32,10",
    "--batch-size",
    "64",
    "--dropout",
    "0.1",
    "--no-progress",
    "--watchdog-timeout",
    "60",
]
ARGS = ["--device", "cuda", "--optimizer", "adamw", "--lr", "0.003", *DATA]


def train(tmp_path, name, ranks, *extra, args=ARGS):
    out = tmp_path / f"{name}.json"
    params = tmp_path / f"{name}.npz"
    r = mpirun(
        ranks,
        [sys.executable, "-m", "mgpu", "train", *args, "--json", out, "--save", params, *extra],
        timeout=600,
        env=mpi_env(),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    with np.load(params) as z:
        flat = np.concatenate([z[k].ravel() for k in sorted(z.files)])
    return json.loads(out.read_text()), flat


def test_nccl_training_equals_one_rank_and_resumes_bit_identical(two_gpus, tmp_path):
    _, one = train(tmp_path, "one", 1, "--steps", "12")
    result, two = train(tmp_path, "two", 2, "--steps", "12", "--comm", "nccl")
    assert np.allclose(two, one, rtol=1e-4, atol=1e-6), np.max(np.abs(two - one))
    ckpt = tmp_path / "ckpt"
    train(tmp_path, "first", 2, "--steps", "7", "--comm", "nccl", "--checkpoint-dir", ckpt)
    _, resumed = train(tmp_path, "resumed", 2, "--steps", "12", "--comm", "nccl", "--checkpoint-dir", ckpt, "--resume")
    assert np.array_equal(resumed, two)


def test_every_figure_of_emulated_gpus_says_so_also_after_a_resume_on_the_cpu(two_gpus, tmp_path):
    # The epoch lines and the last line of a run on the emulation say so; a run resumed on
    # the CPU from its checkpoint still holds that epoch's figures, and says so too. On
    # real GPUs none of it appears.
    emulated = mgpu.gpus_emulated("cuda")
    ckpt, out = tmp_path / "ckpt", tmp_path / "resumed.json"
    first = mpirun(
        2,
        [sys.executable, "-m", "mgpu", "train", *ARGS, "--steps", "3", "--comm", "nccl", "--checkpoint-dir", ckpt],
        timeout=600,
        env=mpi_env(),
    )
    assert first.returncode == 0, first.stdout + first.stderr
    epochs = [line for line in first.stdout.splitlines() if line.startswith("epoch")]
    assert epochs and all(("on EMULATED GPUs" in line) == emulated for line in epochs), first.stdout
    cpu_args = ["--device", "cpu", *ARGS[2:]]
    resumed = mpirun(
        2,
        [
            sys.executable,
            "-m",
            "mgpu",
            "train",
            *cpu_args,
            "--steps",
            "6",
            "--checkpoint-dir",
            ckpt,
            "--resume",
            "--json",
            out,
        ],
        timeout=600,
        env=mpi_env(),
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    done = [line for line in resumed.stdout.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and ("with epochs run on EMULATED GPUs" in done[0]) == emulated, resumed.stdout
    assert json.loads(out.read_text())["gpu_emulation"] == emulated


@pytest.mark.parametrize("optimizer, lr", [("sgd", "0.05"), ("adamw", "0.003")])
def test_nccl_training_equals_the_cpu_backend(two_gpus, tmp_path, optimizer, lr):
    # Same data order, dropout masks (Philox keyed by global sample) and exact averaging:
    # the CUDA kernels, cuBLAS and NCCL on two GPUs give the CPU backend's parameters.
    common = [*DATA, "--optimizer", optimizer, "--lr", lr, "--steps", "12"]
    _, cpu = train(tmp_path, "cpu", 1, args=["--device", "cpu", *common])
    _, gpus = train(tmp_path, "gpus", 2, "--comm", "nccl", args=["--device", "cuda", *common])
    assert np.allclose(gpus, cpu, rtol=1e-4, atol=1e-6), np.max(np.abs(gpus - cpu))


def test_trace_of_a_gpu_run_says_whether_the_gpus_are_emulated(two_gpus, tmp_path):
    # On the emulation the trace must say its GPUs are the CPU, in its metadata and on
    # every rank's tracks; the core's spans come from CUDA events on each rank's compute
    # stream (nothing synchronised to time them), on a lane of their own.
    trace = tmp_path / "trace.json"
    r = mpirun(
        2,
        [
            sys.executable,
            "-m",
            "mgpu",
            "train",
            *ARGS,
            "--steps",
            "4",
            "--comm",
            "nccl",
            "--trace",
            trace,
            "--trace-steps",
            "1:3",
            "--bucket-mb",
            "0.002",
        ],
        timeout=600,
        env=mpi_env(),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(trace.read_text())
    emulated = bool(_core.build_info().get("gpu_emulation", False))
    assert doc["otherData"]["gpu_emulation"] is emulated and ("warning" in doc["otherData"]) is emulated
    names = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert len(names) == 2 and all(("EMULATED" in n) is emulated for n in names)
    steps = [e for e in doc["traceEvents"] if e.get("cat") == "step"]
    assert sorted((e["pid"], e["args"]["step"]) for e in steps) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    # Each bucket's allreduce on the rank's "allreduce" lane, timed by CUDA events
    # on the communication stream, within its step.
    plan = _core.plan_buckets(doc["otherData"]["layers"], int(0.002 * (1 << 20) / 4))
    assert len(plan) > 1
    for outer in steps:
        buckets = sorted(
            (
                e
                for e in doc["traceEvents"]
                if e.get("cat") == "allreduce"
                and e["pid"] == outer["pid"]
                and e["args"]["step"] == outer["args"]["step"]
            ),
            key=lambda e: e["args"]["bucket"],
        )
        assert [(e["args"]["offset"], e["args"]["count"]) for e in buckets] == [(o, n) for o, n, _ in plan]
        for e in buckets:
            assert e["tid"] == 1 and e["args"]["bytes"] == 4 * e["args"]["count"] and e["dur"] >= 0
            assert outer["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + 1
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert all(("EMULATED" in lanes[(rank, 2)]) is emulated and "CUDA events" in lanes[(rank, 2)] for rank in (0, 1))
    for outer in steps:  # the step's work on its GPU: after the host began it, in the order it runs
        spans = sorted(
            (
                e
                for e in doc["traceEvents"]
                if e.get("ph") == "X"
                and e["tid"] == 2
                and e["pid"] == outer["pid"]
                and e["args"]["step"] == outer["args"]["step"]
            ),
            key=lambda e: (e["ts"], -e["dur"]),
        )
        names = [e["name"] for e in spans]
        # small model: CUDA graphs (auto), captured at step 1, replayed at step 2; with two
        # ranks the tail (health check, verdict, update) is a graph of its own after the allreduce
        how = {1: "graph capture + replay", 2: "graph replay"}[outer["args"]["step"]]
        assert names == [
            "stage",
            f"forward + loss + backward ({how})",
            "allreduce wait",
            f"health check + optimizer ({how})",
        ], names
        assert spans[0]["ts"] >= outer["ts"] - 1 and all(e["dur"] >= 0 for e in spans)
        for e, nxt in zip(spans, spans[1:]):
            assert e["ts"] + e["dur"] == pytest.approx(nxt["ts"], abs=1)


def test_training_telemetry_says_whether_the_gpus_are_emulated(two_gpus, tmp_path):
    # On the emulation the readings are the host CPU's: every rank's series, the CSV's
    # device column, the PNG's title and --json's source must say so, and a real GPU's
    # telemetry must never carry the word.
    prefix, out = tmp_path / "tel", tmp_path / "run.json"
    r = mpirun(
        2,
        [
            sys.executable,
            "-m",
            "mgpu",
            "train",
            *ARGS,
            "--steps",
            "4",
            "--comm",
            "nccl",
            "--telemetry",
            prefix,
            "--telemetry-interval",
            "0.1",
            "--json",
            out,
        ],
        timeout=600,
        env=mpi_env(),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    emulated = bool(_core.build_info().get("gpu_emulation", False))
    series = json.loads((tmp_path / "tel.json").read_text())
    assert len(series) == 2 and all(("emulated GPU" in label) is emulated for label in series)
    rows = (tmp_path / "tel.csv").read_text().splitlines()[1:]
    assert rows and all(("emulated GPU" in row) is emulated for row in rows)
    assert (b"EMULATED" in (tmp_path / "tel.png").read_bytes()) is emulated
    assert ("emulated" in json.loads(out.read_text())["telemetry"]["source"]) is emulated


@pytest.mark.parametrize(
    "command",
    [
        [
            "train",
            "--device",
            "cuda",
            "--layers",
            "64,4096,4096,3",
            "--batch-size",
            "64",
            "--steps",
            "1",
            "--no-progress",
        ],
        [
            "bench",
            "--device",
            "cuda",
            "--layers",
            "64,4096,4096,3",
            "--batch-sizes",
            "64",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--no-progress",
        ],
    ],
)
def test_a_model_too_big_for_one_ranks_gpu_ends_every_rank_with_one_line(two_gpus, command):
    # 17M parameters need ~0.4 GB a rank: rank 1's GPU has 0.18 GiB, rank 0's 4 GiB. The
    # memory check is agreed, so rank 0 does not wait for rank 1 in a collective.
    if not _core.build_info().get("gpu_emulation", False):
        pytest.skip("sets each rank's GPU memory through the emulation (MGPU_EMULATE_GPU_MEMORY)")
    run = [sys.executable, "-m", "mgpu", *command]
    cmd = [
        "mpirun",
        "--oversubscribe",
        "--bind-to",
        "none",
        "-np",
        "1",
        "-x",
        "MGPU_EMULATE_GPU_MEMORY=4GiB",
        *run,
        ":",
        "-np",
        "1",
        "-x",
        "MGPU_EMULATE_GPU_MEMORY=0.18GiB",
        *run,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=mpi_env())
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("mgpu")]
    # both ranks name rank 1's refusal: its need, more than its 0.18 GiB
    figures = [re.search(r"needs about ([0-9.]+) GB a rank .* more than the ([0-9.]+) GB", line) for line in lines]
    assert len(lines) == 2 and all(figures), r.stderr
    assert len({f.groups() for f in figures}) == 1 and float(figures[0][1]) > float(figures[0][2]) > 0.18, r.stderr
    assert any(line.startswith("mgpu: error (rank 0): rank 1: ") for line in lines) and "Traceback" not in r.stderr


def test_the_training_set_goes_to_the_gpu_where_it_fits_beside_the_step(gpu, tmp_path):
    # 24,000 training rows of 500 features (48 MB resident) beside a step that needs ~70 MB:
    # resident on a 4 GiB GPU, staged from the host on a 0.1 GiB one, and refused there with `on`.
    if not _core.build_info().get("gpu_emulation", False):
        pytest.skip("sets the GPU's memory through the emulation (MGPU_EMULATE_GPU_MEMORY)")
    rng = np.random.default_rng(0)
    data = tmp_path / "wide.npz"
    np.savez(data, x=rng.standard_normal((30000, 500), dtype=np.float32), y=rng.integers(0, 2, 30000))
    base = [sys.executable, "-m", "mgpu", "train", "--device", "cuda", "--dataset", str(data), "--layers", "500,16,2"]
    base += ["--batch-size", "64", "--steps", "2", "--no-progress"]

    def train_with(memory, *extra):
        out = tmp_path / "run.json"
        env = dict(mpi_env(), MGPU_EMULATE_GPU_MEMORY=memory)
        r = subprocess.run([*base, "--json", out, *extra], capture_output=True, text=True, timeout=300, env=env)
        return r, json.loads(out.read_text()) if r.returncode == 0 else None

    r, result = train_with("4GiB")
    assert r.returncode == 0 and result["data_placement"]["resident"], r.stdout + r.stderr
    assert result["data_placement"]["bytes"] == 24000 * (500 * 4 + 4 + 8)
    assert "training set: on the device (auto: 48.3 MB, which fit beside the step" in r.stdout
    r, result = train_with("0.1GiB")
    assert r.returncode == 0 and not result["data_placement"]["resident"], r.stdout + r.stderr
    assert "training set: each step's rows copied from the host (auto: 48.3 MB, which do not fit" in r.stdout
    r, _ = train_with("0.1GiB", "--data-on-device", "on")
    lines = [line for line in r.stderr.splitlines() if line.startswith("mgpu")]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "the training set (0.0483 GB, --data-on-device)" in lines[0]
