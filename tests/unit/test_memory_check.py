"""train's memory check against what a run really allocates: the bytes the check prices
(memory.rank_memory_bytes) must cover a rank's peak resident growth from the check to the
end of a short run, or a run the check lets through can be ended by the OOM killer; and
they must not price a run several times over what it takes, or runs that fit are refused.
Peak RSS (VmHWM) is the kernel's count, not a timing: it does not swing with load."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import mpi_env, mpirun
from mgpu import _core
from mgpu.errors import ConfigError
from mgpu.selector import hardware, memory
from mgpu.train.model import MLP

# Runs `mgpu train` with check_training_memory wrapped to note the estimate and the
# resident size when it is called; at exit writes "need growth" in bytes to
# $MEMORY_REPORT.<rank>.
PROBE = r"""
import atexit, os, sys
from mgpu.commands import train as train_command
from mgpu.selector import memory
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
seen = {}
check = memory.check_training_memory
def noted(layers, rows, **kw):
    seen["rss"] = status("VmRSS")
    seen["need"] = memory.rank_memory_bytes(layers, rows, optimizer=kw["optimizer"], precision=kw["precision"],
                                          dropout=kw["dropout"], eval_rows=kw["eval_rows"], nccl=kw["nccl"],
                                          mpi_bucket_bytes=kw["mpi_bucket_bytes"])
    return check(layers, rows, **kw)
train_command.check_training_memory = noted
def report():  # a file per rank: mpirun may join the ranks' stdout lines
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    with open(os.environ["MEMORY_REPORT"] + "." + rank, "w") as f:
        f.write(f"{int(seen['need'])} {status('VmHWM') - seen['rss']}")
atexit.register(report)
from mgpu.commands.main import main
sys.argv = ["mgpu", "train", "--steps", "3", "--no-progress", *sys.argv[1:]]
sys.exit(main())
"""


def _need_and_growth(report: Path) -> list:
    return [tuple(int(v) for v in p.read_text().split()) for p in sorted(report.parent.glob(report.name + ".*"))]


@pytest.mark.parametrize(
    "args",
    [
        # weights and optimizer state dominate; batch 64, but validation runs 1024-row chunks
        ["--layers", "64,4096,4096,10", "--batch-size", "64", "--optimizer", "adamw"],
        # activations and dropout masks dominate
        ["--layers", "512,1024,1024,10", "--batch-size", "8000", "--optimizer", "adamw", "--dropout", "0.5"],
        ["--layers", "512,2048,2048,2048,10", "--batch-size", "8000", "--optimizer", "sgd", "--dropout", "0.2"],
        # class labels, a small model: the fixed overhead
        ["--layers", "64,2048,10", "--batch-size", "4000", "--dataset", "digits"],
    ],
    ids=["weights", "activations", "deep", "labels"],
)
def test_the_check_covers_what_a_run_allocates(args, tmp_path):
    report = tmp_path / "memory"
    r = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=mpi_env(MEMORY_REPORT=str(report)),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    [(need, growth)] = _need_and_growth(report)
    assert growth <= need, f"the run grew by {growth / 1e6:.0f} MB, the check priced {need / 1e6:.0f} MB"
    assert need <= 4 * growth + memory.RUNTIME_OVERHEAD_BYTES, "the check prices several times what the run takes"


@pytest.mark.parametrize("bucket_mb", ["4", "16"])  # 16: what --bucket-mb auto picks for it on a calibrated VM
def test_the_check_covers_each_rank_of_a_two_rank_run(tmp_path, bucket_mb):
    report = tmp_path / "memory"
    r = mpirun(
        2,
        [
            sys.executable,
            "-c",
            PROBE,
            "--layers",
            "512,2048,2048,2048,10",
            "--batch-size",
            "8000",
            "--optimizer",
            "adamw",
            "--dropout",
            "0.2",
            "--bucket-mb",
            bucket_mb,
        ],
        timeout=300,
        env=mpi_env(MEMORY_REPORT=str(report)),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    seen = _need_and_growth(report)
    assert len(seen) == 2 and all(growth <= need for need, growth in seen), seen


def test_validation_chunks_are_priced_when_they_hold_more_rows_than_a_step():
    # A wide model at batch 8 evaluates 1024 rows at a time: the activations of those
    # rows, not the step's 8, size the buffers.
    layers, kw = [64, 4096, 4096, 10], dict(optimizer="sgd", precision="fp32", dropout=0.0)
    chunk = _core.MLP.EVAL_CHUNK_ROWS
    step_only = memory.rank_memory_bytes(layers, 8, **kw)
    assert memory.rank_memory_bytes(layers, 8, eval_rows=10 * chunk, **kw) == pytest.approx(
        memory.rank_memory_bytes(layers, chunk, **kw)
    )
    assert memory.rank_memory_bytes(layers, 8, eval_rows=100, **kw) == pytest.approx(
        memory.rank_memory_bytes(layers, 100, **kw)
    )
    # the buffers grow by half again at least (MLP::ensure_capacity): 1000 step rows, then
    # a 1024-row chunk, leave buffers for 1500 (allocated in full on a GPU)
    assert memory.rank_memory_bytes(layers, 1000, eval_rows=5000, **kw) == pytest.approx(
        memory.rank_memory_bytes(layers, 1500, **kw)
    )
    assert memory.rank_memory_bytes(layers, 8, eval_rows=4, **kw) == pytest.approx(step_only)
    assert memory.rank_memory_bytes(layers, 8, nccl=True, **kw) == pytest.approx(step_only + hardware.NCCL_BUFFER_BYTES)


def test_predict_in_chunks_equals_row_by_row():
    # predict runs EVAL_CHUNK_ROWS at a time (bounded activation memory); the chunk
    # edges must not shift or drop rows.
    chunk = _core.MLP.EVAL_CHUNK_ROWS
    model = MLP([7, 16, 3], seed=3, device="cpu", threads=1)
    x = np.random.default_rng(0).standard_normal((2 * chunk + 5, 7), dtype=np.float32)
    whole = model.forward(x)
    pieces = np.concatenate([model.forward(x[i : i + 300]) for i in range(0, len(x), 300)])
    assert whole.shape == (len(x), 3)
    np.testing.assert_allclose(whole, pieces, rtol=1e-5, atol=1e-6)
    assert not np.allclose(whole[chunk - 1 : chunk + 1], whole[:2])


# --- a sharded optimizer: 1/N of the state a rank -------------------------------------
LAYERS = [64, 4096, 4096, 10]
PARAMS = 64 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 10 + 10


@pytest.mark.parametrize("optimizer, per_param", [("sgd", 4), ("adamw", 8)])
def test_a_sharded_optimizer_holds_its_share_of_the_state(optimizer, per_param):
    # SGD's momentum 4 B a parameter, AdamW's two moments 8 B, as the selector prices them
    kw = dict(optimizer=optimizer, precision="fp32", dropout=0.0)
    state = per_param * PARAMS
    assert memory.training_memory_bytes(LAYERS, 8, **kw) - memory.training_memory_bytes(
        LAYERS, 8, optimizer_shards=4, **kw
    ) == pytest.approx(state * 3 / 4, rel=1e-12)
    plain = memory.rank_memory_bytes(LAYERS, 8, **kw)
    assert memory.rank_memory_bytes(LAYERS, 8, optimizer_shards=1, **kw) == plain
    assert plain - memory.rank_memory_bytes(LAYERS, 8, optimizer_shards=2, **kw) == pytest.approx(
        state / 2 * (1 + memory.RUNTIME_OVERHEAD_FRACTION), rel=1e-12
    )
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="optimizer_shards must be an integer >= 1"):
            memory.rank_memory_bytes(LAYERS, 8, optimizer_shards=bad, **kw)


def test_the_memory_check_names_what_a_sharded_optimizer_would_need(monkeypatch):
    kw = dict(optimizer="adamw", precision="fp32", dropout=0.0, device="cpu", device_index=0, local_ranks=4)
    plain = memory.rank_memory_bytes(LAYERS, 8, optimizer="adamw", precision="fp32", dropout=0.0)
    sharded = memory.rank_memory_bytes(LAYERS, 8, optimizer="adamw", precision="fp32", dropout=0.0, optimizer_shards=4)
    usable = (plain + sharded) / 2  # the unsharded run does not fit, the sharded one does
    monkeypatch.setattr(memory, "available_memory", lambda device, index, ranks: usable)
    with pytest.raises(ConfigError) as e:
        memory.check_training_memory(LAYERS, 8, **kw)
    assert str(e.value).endswith(f"; --shard-optimizer would need about {sharded / 1e9:.3g} GB a rank")
    memory.check_training_memory(LAYERS, 8, optimizer_shards=4, **kw)  # sharded, it fits
    # over the run's 2 ranks (on this host 4) sharding saves less: the hint prices those
    two = memory.rank_memory_bytes(LAYERS, 8, optimizer="adamw", precision="fp32", dropout=0.0, optimizer_shards=2)
    assert two <= usable
    with pytest.raises(ConfigError, match=f"would need about {two / 1e9:.3g} GB"):
        memory.check_training_memory(LAYERS, 8, world_ranks=2, **kw)
    # no hint where sharding would not fit either, nor on one rank, nor when already sharded
    monkeypatch.setattr(memory, "available_memory", lambda device, index, ranks: sharded * 0.99)
    for extra in ({}, {"world_ranks": 1}, {"optimizer_shards": 4}):
        with pytest.raises(ConfigError) as e:
            memory.check_training_memory(LAYERS, 8, **{**kw, **extra})
        assert "--shard-optimizer" not in str(e.value)
    with pytest.raises(ConfigError, match=r"adamw state \(1/4 of it\)"):
        memory.check_training_memory(LAYERS, 8, optimizer_shards=4, **kw)
