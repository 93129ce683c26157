"""`mgpu train --telemetry` under mpirun with 2 ranks: every rank's samples gathered into
the CSV, JSON and PNG with training samples/s; a threshold below the current reading
warns, or with its stop flag stops the run at a step boundary with a checkpoint; bad
input is one line per rank and exit 2. The monitor's temperature logic, which this VM
cannot exercise (no thermal sensor), is tested with an injected reader."""

import csv
import json
import sys

import pytest

from conftest import mpirun  # tests/conftest.py helpers
from mgpu.monitor import telemetry
from mgpu.monitor import training as train_telemetry
from mgpu.monitor.safety import Thresholds

TRAIN = [
    sys.executable,
    "-m",
    "mgpu",
    "train",
    "--dataset",
    "digits",
    "--layers",
    "64,32,10",
    "--batch-size",
    "64",
    "--no-progress",
    "--straggler-threshold",
    "0",
    "--watchdog-timeout",
    "60",
]


def memory_used_pct():
    """What the CPU sampler reads now (host-wide); the tests' thresholds sit below it."""
    value = telemetry.cpu_reading()["memory_used_pct"]
    if value is None:
        pytest.skip("this machine's /proc/meminfo gives no memory reading")
    return value


def test_telemetry_gathers_every_rank_and_warns_below_the_reading(tmp_path):
    below = memory_used_pct() / 2
    prefix, out = tmp_path / "tel", tmp_path / "run.json"
    r = mpirun(
        2,
        [
            *TRAIN,
            "--steps",
            "400",
            "--telemetry",
            prefix,
            "--telemetry-interval",
            "0.05",
            "--max-memory-percent",
            f"{below:g}",
            "--json",
            out,
        ],
    )
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["steps"] == 400 and result["stopped"] is None  # a warning, not a stop
    warnings = [line for line in r.stderr.splitlines() if "training goes on" in line]
    assert sorted(w.split(")")[0] for w in warnings) == ["mgpu train (rank 0", "mgpu train (rank 1"], r.stderr
    assert {e["action"] for e in result["telemetry"]["events"]} == {"warning"}

    with open(f"{prefix}.csv") as f:
        rows = list(csv.DictReader(f))
    series = json.loads((tmp_path / "tel.json").read_text())
    assert len(series) == 2
    for rank, (label, samples) in enumerate(sorted(series.items())):
        assert label.startswith(f"rank {rank} cpu")
        mine = [row for row in rows if row["device"] == label]
        assert len(mine) == len(samples) >= 2
        times = [float(row["t"]) for row in mine]
        assert times == sorted(times) and len(set(times)) == len(times)
        assert any(s["samples_per_s"] for s in samples), samples  # this rank's throughput was measured
        assert all(s["memory_used_pct"] is not None for s in samples)
    png = (tmp_path / "tel.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert result["telemetry"]["files"] == [f"{prefix}.csv", f"{prefix}.json", f"{prefix}.png"]


def test_stop_above_a_threshold_checkpoints_and_says_why(tmp_path):
    below = memory_used_pct() / 2
    ckpt, out = tmp_path / "ckpt", tmp_path / "run.json"
    r = mpirun(
        2,
        [
            *TRAIN,
            "--steps",
            "100000",
            "--telemetry",
            tmp_path / "tel",
            "--max-memory-percent",
            f"{below:g}",
            "--stop-above-memory",
            "--checkpoint-dir",
            ckpt,
            "--json",
            out,
        ],
    )
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["steps"] < 100000 and "--stop-above-memory" in result["stopped"]
    assert f"stopped at step {result['steps']} (memory" in r.stdout and "continue with --resume" in r.stdout
    assert result["checkpoint"] and (ckpt / result["checkpoint"].split("/")[-1]).exists()
    assert {e["action"] for e in result["telemetry"]["events"]} == {"stop"}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--telemetry-interval", "0"], "--telemetry-interval must be"),
        (["--telemetry-interval", "-1"], "--telemetry-interval must be"),
        (["--telemetry-interval", "nan"], "--telemetry-interval must be"),
        (["--telemetry-interval", "1e10"], "at most 604800 seconds"),  # overflowed the sampler thread's timer
        (["--max-temp", "inf"], "--max-temp must be"),
        (["--max-memory-percent", "0"], "--max-memory-percent"),
        (["--prefix-in", "missing/tel"], "does not exist"),
        (["--prefix-in", "taken"], "is a directory"),
        (["--prefix-in", "same", "--json", "same.json"], "name the same file"),
    ],
)
def test_bad_telemetry_input_is_one_line_per_rank(tmp_path, extra, message):
    (tmp_path / "taken.png").mkdir()
    if extra[0] == "--prefix-in":
        extra = ["--telemetry", tmp_path / extra[1], *[tmp_path / e if e.endswith(".json") else e for e in extra[2:]]]
    else:
        extra = ["--telemetry", tmp_path / "tel", *extra]
    r = mpirun(2, [*TRAIN, "--steps", "5", *extra], timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("mgpu")]  # not mpirun's own notice
    assert sorted(line.split(")")[0] for line in lines) == ["mgpu: error (rank 0", "mgpu: error (rank 1"], r.stderr
    assert all(message in line for line in lines), r.stderr
    assert not list(tmp_path.glob("*.csv")) and "epoch" not in r.stdout  # refused before training


def test_telemetry_options_without_telemetry_are_refused(tmp_path):
    r = mpirun(2, [*TRAIN, "--steps", "5", "--stop-above-temp"], timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("mgpu")]
    assert len(lines) == 2 and all("--stop-above-temp belongs to the training telemetry" in x for x in lines)


class _Rank0:
    rank, size, is_root = 0, 1, True


class _Trainer:
    def __init__(self):
        self.stop_reasons = []

    def request_stop(self, reason):
        self.stop_reasons.append(reason)


def _telemetry_reading(monkeypatch, readings, stop_on):
    """A TrainTelemetry whose reader returns `readings` one by one (no sensor faked in mgpu:
    the reader is swapped in this test only); sampled by hand, no thread."""
    it = iter(readings)
    monkeypatch.setattr(train_telemetry, "reader_for", lambda device, index: ("test reader", lambda: dict(next(it))))
    return train_telemetry.TrainTelemetry(
        _Rank0(),
        prefix="unused",
        interval=1.0,
        device="cpu",
        device_index=0,
        thresholds=Thresholds(max_temp_c=80.0),
        stop_on=stop_on,
    )


def test_monitor_warns_once_per_crossing_of_the_temperature_threshold(monkeypatch):
    tel = _telemetry_reading(monkeypatch, [{"temperature_c": t} for t in (70, 90, 95, 60, 85)], stop_on=())
    trainer = _Trainer()
    for _ in range(5):
        tel.sampler.sample()
        tel.on_step(trainer, 8)
        tel.on_step(trainer, 8)  # the same reading seen again: no second warning
    assert [e["action"] for e in tel.monitor.events] == ["warning", "warning"]
    assert "temperature 90 C > 80 C" in tel.monitor.events[0]["message"] and not trainer.stop_reasons
    assert tel.sampler.samples[-1]["samples_per_s"] > 0  # steps happened between the samples


def test_stop_above_temp_requests_one_stop(monkeypatch):
    tel = _telemetry_reading(monkeypatch, [{"temperature_c": t} for t in (70, 90, 95)], stop_on=("temperature_c",))
    trainer = _Trainer()
    for _ in range(3):
        tel.sampler.sample()
        tel.on_step(trainer, 8)
    assert trainer.stop_reasons == ["temperature 90 C > 80 C (--stop-above-temp)"]
    assert [e["action"] for e in tel.monitor.events] == ["stop"]
