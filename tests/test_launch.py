"""Tests that launch mpirun themselves, so a plain `pytest` covers several ranks:
the distributed suite at 1, 2 and 3 ranks, and the CLI's behaviour under mpirun
(results, bad input on every rank, failures on one rank only, no hangs)."""

import json
import re
import time

import numpy as np
import pytest

from conftest import PYTHON, mpirun, run_cli

MGPU = [PYTHON, "-m", "mgpu"]


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_distributed_suite_under_mpirun(ranks):
    from conftest import mpi_env

    r = mpirun(
        ranks,
        [PYTHON, "-m", "pytest", "tests/distributed", "-q", "-p", "no:cacheprovider"],
        env=mpi_env(MGPU_EXPECT_WORLD=ranks),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count(" passed") == ranks, r.stdout[-2000:]
    assert "failed" not in r.stdout


def test_two_rank_training_writes_results(tmp_path):
    out, params = tmp_path / "out.json", tmp_path / "params.npz"
    r = mpirun(
        2, [*MGPU, "train", "--model", "medium", "--epochs", "2", "--json", out, "--save", params, "--no-progress"]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["device"] == "cpu"
    losses = [h["train_loss"] for h in result["history"]]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert all(k in result["history"][0] for k in ("epoch", "train_loss", "val_loss"))
    assert result["samples_per_sec"] > 0 and result["config"]["layers"] == [50, 256, 128, 64, 3]
    with np.load(params, allow_pickle=False) as f:
        assert f["layers.0.weight"].shape == (256, 50) and f["layers.3.bias"].shape == (3,)
    assert r.stdout.count("mgpu 0.") == 1, "summary printed by rank 0 only"


def test_one_and_two_ranks_train_the_same_model(tmp_path):
    args = [
        "train",
        "--layers",
        "50,64,3",
        "--steps",
        "12",
        "--batch-size",
        "37",
        "--optimizer",
        "adamw",
        "--no-progress",
        "--dropout",
        "0.1",
    ]
    one = run_cli([*args, "--save", tmp_path / "one.npz"])
    assert one.returncode == 0, one.stderr
    two = mpirun(2, [*MGPU, *args, "--save", tmp_path / "two.npz"])
    assert two.returncode == 0, two.stderr
    with np.load(tmp_path / "one.npz") as a, np.load(tmp_path / "two.npz") as b:
        for k in a.files:
            assert np.linalg.norm(a[k] - b[k]) <= 1e-5 * np.linalg.norm(a[k]), k


def test_classification_history_has_accuracy(tmp_path):
    out = tmp_path / "digits.json"
    r = run_cli(
        [
            "train",
            "--dataset",
            "digits",
            "--layers",
            "64,64,10",
            "--epochs",
            "3",
            "--optimizer",
            "adamw",
            "--batch-size",
            "64",
            "--json",
            out,
            "--no-progress",
        ]
    )
    assert r.returncode == 0, r.stderr
    h = json.loads(out.read_text())["history"]
    assert 0.5 < h[-1]["val_accuracy"] <= 1.0


BAD_ARGS = [
    (["--batch-size", "0"], "batch size"),
    (["--batch-size", "1"], "smaller than the number of ranks"),
    (["--layers", ""], "layers"),
    (["--layers", "50,x,3"], "'x' is not an integer"),
    (["--layers", "50,,3"], "empty value"),
    (["--layers", "50,3000000000,3"], "at most 2147483647"),
    (["--batch-shares", "0.5,,0.5"], "empty value"),
    (["--model", "huge"], "invalid choice"),
    (["--lr", "-1"], "learning rate"),
    (["--optimizer", "lbfgs"], "invalid choice"),
    (["--dataset", "nowhere.npz"], "does not exist"),
    (["--dataset", "digits", "--loss", "mse"], "mse needs float targets"),
    (["--dataset", "digits", "--layers", "10,5,10"], "10 inputs but the dataset has 64"),
    (["--epochs", "0"], "epochs"),
    (["--threads", "0"], "threads"),
    (["--device", "cuda"], "CUDA|GPU"),
    (["--json", "/nonexistent-dir/out.json"], "does not exist"),
    (["--batch-shares", "1,2,3"], "batch-shares"),
]


@pytest.mark.parametrize("args, message", BAD_ARGS)
def test_bad_cli_input_one_line_on_every_rank(args, message):
    t0 = time.monotonic()
    r = mpirun(2, [*MGPU, "train", "--no-progress", *args], timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    errors = [line for line in r.stderr.splitlines() if "error" in line and line.startswith("mgpu")]
    assert len(errors) == 2 and all(line.count("error") == 1 for line in errors), r.stderr
    assert all(re.search(message, text) for text in errors), errors
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 60


def test_bad_cli_input_single_process():
    r = run_cli(["train", "--batch-size", "-3"])
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "batch size" in r.stderr
    r = run_cli(["frobnicate"])
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_failure_on_one_rank_only_ends_every_rank(tmp_path):
    """Rank 1 cannot read its dataset while rank 0 can: both must stop with exit 2, not hang."""
    good = tmp_path / "good.npz"
    rng = np.random.default_rng(0)
    np.savez(good, x=rng.standard_normal((40, 4)), y=rng.standard_normal((40, 2)))
    common = ["train", "--layers", "4,8,2", "--steps", "3", "--batch-size", "8", "--no-progress"]
    import subprocess

    from conftest import mpi_env

    cmd = [
        "mpirun",
        "--oversubscribe",
        "-np",
        "1",
        *MGPU,
        *common,
        "--dataset",
        good,
        ":",
        "-np",
        "1",
        *MGPU,
        *common,
        "--dataset",
        tmp_path / "missing.npz",
    ]
    t0 = time.monotonic()
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120, env=mpi_env())
    assert r.returncode == 2, r.stderr
    assert "rank 1" in r.stderr and "does not exist" in r.stderr
    assert time.monotonic() - t0 < 60


def test_save_does_not_clobber_on_bad_input(tmp_path):
    saved = tmp_path / "keep.npz"
    saved.write_bytes(b"precious")
    r = run_cli(["train", "--lr", "0", "--save", saved])
    assert r.returncode == 2 and saved.read_bytes() == b"precious"


def test_info_reports_the_build():
    r = run_cli(["info", "--json"])
    assert r.returncode == 0
    info = json.loads(r.stdout)
    assert info["version"] and "cpu" in info["backends"] and info["mpi"]["enabled"] is True
    assert {"toolkit_found", "nccl_found", "backend"} <= set(info["cuda"])


def test_info_prints_a_summary_once_under_mpirun():
    import mgpu

    r = mpirun(2, [*MGPU, "info"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count(f"mgpu {mgpu.__version__} (") == 1 and r.stdout.count("BLAS:") == 1
    assert "rank 0 of 2" in r.stdout and not r.stdout.lstrip().startswith("{")
    build = mgpu.build_info()
    assert build["blas"]["library"] in r.stdout and build["mpi"]["library"] in r.stdout


def test_errors_of_ranks_failing_together_stay_on_their_own_lines():
    """Every rank fails at the same moment: each rank's line must arrive whole (one write
    with its newline), never glued to another rank's. Repeated: the race is not every time."""
    for _ in range(3):
        r = mpirun(4, [*MGPU, "train", "--lr", "0", "--no-progress"], timeout=120)
        assert r.returncode == 2, r.stderr[-2000:]
        lines = [line for line in r.stderr.splitlines() if "mgpu" in line]
        ranks = sorted(
            int(m.group(1))
            for line in lines
            if (m := re.fullmatch(r"mgpu: error \(rank (\d)\): learning rate must be \S.*got 0\.0", line))
        )
        assert ranks == [0, 1, 2, 3], r.stderr
