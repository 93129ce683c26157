"""Training observability (issue 17) under mpirun: `train --trace` writes a Chrome
trace with one track per rank, every traced step's phases nested in it and the ranks'
clocks comparable; `--log-json` one line per step and rank plus the run's events;
`--tensorboard` scalars that TensorBoard's own reader reads back; a rank given most of
the batch is named the straggler; bad options fail on every rank before training."""

import json
import os
import sys

import numpy as np
import pytest

from conftest import mpi_env, mpirun
from mgpu.train.observe import FIELDS, find_straggler, parse_step_range

TRAIN = [
    sys.executable,
    "-m",
    "mgpu",
    "train",
    "--model",
    "medium",
    "--batch-size",
    "96",
    "--no-progress",
    "--watchdog-timeout",
    "120",
]
PHASES = ["data", "stage", "forward", "loss", "backward", "allreduce wait", "health check", "optimizer"]
LAYERS = 4  # the medium model's linear layers
US = 1.0  # one microsecond: the trace's timestamps are floats of microseconds


def _run(n, *args):
    r = mpirun(n, [*TRAIN, *map(str, args)], timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """One 3-rank run with every output on (steps 2-5 traced, a checkpoint at step 4)."""
    d = tmp_path_factory.mktemp("observe")
    paths = {"trace": d / "trace.json", "log": d / "log.jsonl", "tb": d / "tb", "json": d / "result.json"}
    _run(
        3,
        "--steps",
        12,
        "--trace",
        paths["trace"],
        "--trace-steps",
        "2:6",
        "--log-json",
        paths["log"],
        "--tensorboard",
        paths["tb"],
        "--json",
        paths["json"],
        "--checkpoint-dir",
        d / "ckpt",
        "--checkpoint-every",
        4,
        "--observe-every",
        5,
    )
    return paths


def test_trace_has_one_track_per_rank_with_nested_phases(observed):
    doc = json.loads(observed["trace"].read_text())
    events = doc["traceEvents"]
    assert doc["otherData"]["gpu_emulation"] is False and doc["otherData"]["trace_steps"] == [2, 6]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    spans = [e for e in events if e["ph"] == "X"]
    for rank in range(3):
        steps = sorted((e for e in spans if e["pid"] == rank and e["cat"] == "step"), key=lambda e: e["ts"])
        assert [e["args"]["step"] for e in steps] == [2, 3, 4, 5]  # the window, nothing else
        for step in steps:
            phases = sorted(
                (
                    e
                    for e in spans
                    if e["pid"] == rank and e["cat"] == "phase" and e["args"]["step"] == step["args"]["step"]
                ),
                key=lambda e: e["ts"],
            )
            assert [p["name"] for p in phases] == PHASES
            assert all(p["tid"] == 0 for p in phases)  # the CPU's spans: on its step lane, nested in the step
            end = step["ts"] + step["dur"]
            for p, nxt in zip(phases, phases[1:] + [None]):
                assert p["dur"] >= 0 and step["ts"] - US <= p["ts"] and p["ts"] + p["dur"] <= end + US
                if nxt is not None:  # back to back, in the order they run
                    assert p["ts"] + p["dur"] <= nxt["ts"] + US
            # each layer's forward and backward, in the order they run, tiling their phase
            for phase, order in (("forward", range(LAYERS)), ("backward", reversed(range(LAYERS)))):
                (outer,) = [p for p in phases if p["name"] == phase]
                layers = sorted(
                    (
                        e
                        for e in spans
                        if e["pid"] == rank
                        and e["cat"] == "layer"
                        and e["args"]["step"] == step["args"]["step"]
                        and e["name"].startswith(phase)
                    ),
                    key=lambda e: e["ts"],
                )
                assert [e["name"] for e in layers] == [f"{phase} layer {i}" for i in order]
                assert layers[0]["ts"] == pytest.approx(outer["ts"], abs=US)
                assert layers[-1]["ts"] + layers[-1]["dur"] == pytest.approx(outer["ts"] + outer["dur"], abs=US)
                for e, nxt in zip(layers, layers[1:]):
                    assert e["dur"] >= 0 and e["ts"] + e["dur"] == pytest.approx(nxt["ts"], abs=US)
        # the checkpoint after step 3 (the 4th step) is on every rank's track
        assert [e["args"]["step"] for e in spans if e["pid"] == rank and e["name"] == "checkpoint"] == [3]


def test_trace_has_each_ranks_bucket_allreduces_within_their_step(tmp_path):
    from mgpu import _core

    trace = tmp_path / "trace.json"
    _run(2, "--steps", 4, "--trace", trace, "--trace-steps", "1:4", "--bucket-mb", 0.25)
    doc = json.loads(trace.read_text())
    plan = _core.plan_buckets(doc["otherData"]["layers"], int(0.25 * (1 << 20) / 4))
    assert len(plan) > 1
    events = doc["traceEvents"]
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert lanes == {(0, 0): "step", (0, 1): "allreduce", (1, 0): "step", (1, 1): "allreduce"}
    spans = [e for e in events if e["ph"] == "X"]
    for rank in range(2):
        for step in (1, 2, 3):
            (outer,) = [e for e in spans if e["pid"] == rank and e["cat"] == "step" and e["args"]["step"] == step]
            (wait,) = [
                e for e in spans if e["pid"] == rank and e["name"] == "allreduce wait" and e["args"]["step"] == step
            ]
            buckets = sorted(
                (e for e in spans if e["pid"] == rank and e["cat"] == "allreduce" and e["args"]["step"] == step),
                key=lambda e: e["args"]["bucket"],
            )
            assert all(e["tid"] == 1 for e in buckets)
            assert [(e["args"]["offset"], e["args"]["count"]) for e in buckets] == [(o, n) for o, n, _ in plan]
            assert all(e["args"]["bytes"] == 4 * e["args"]["count"] for e in buckets)
            # CPU + MPI: blocking per-bucket allreduces after backward, so inside the
            # step's exposed wait, one after another
            for e, nxt in zip(buckets, buckets[1:] + [None]):
                assert (
                    e["dur"] >= 0
                    and outer["ts"] - US <= e["ts"]
                    and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + US
                )
                assert wait["ts"] - US <= e["ts"] and e["ts"] + e["dur"] <= wait["ts"] + wait["dur"] + US
                if nxt is not None:
                    assert e["ts"] + e["dur"] <= nxt["ts"] + US


def test_trace_clocks_are_comparable_across_ranks(observed):
    # An allreduce completes only once every rank has started it: on one clock, no
    # rank's wait ends before the last rank's wait began. The trace moves each rank
    # onto rank 0's clock by the offset measured at the start and end, to within its
    # uncertainty (half the best ping-pong: microseconds, a few milliseconds when 3
    # ranks share 2 cores), so the margin is that plus 1 ms; per-rank origins alone
    # (each rank's own start) are off by far more.
    doc = json.loads(observed["trace"].read_text())
    offsets = doc["otherData"]["clock_offsets"]
    assert len(offsets) == 3 and offsets[0] == [[0.0, 0.0, offsets[0][0][2]], [0.0, 0.0, offsets[0][1][2]]]
    margin = 1e-3 + max(min(start[1], end[1]) for start, end in offsets)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] == "allreduce wait"]
    for step in range(2, 6):
        waits = [e for e in spans if e["args"]["step"] == step]
        assert len(waits) == 3
        assert max(e["ts"] for e in waits) <= min(e["ts"] + e["dur"] for e in waits) + margin * 1e6 * US


def test_clock_offsets_find_a_shifted_clock(tmp_path):
    # rank r's clock runs r x 5 s ahead of rank 0's: rank 0 measures each offset to
    # within the uncertainty it reports (half the shortest of 8 round trips)
    script = tmp_path / "offsets.py"
    script.write_text(
        "import json, sys, time\n"
        "from mgpu.train.process_group import ProcessGroup\n"
        "pg = ProcessGroup()\n"
        "out = pg.clock_offsets(lambda: time.perf_counter() + 5.0 * pg.rank)\n"
        "if pg.is_root:\n"
        "    json.dump(out, open(sys.argv[1], 'w'))\n"
    )
    r = mpirun(3, [sys.executable, str(script), str(tmp_path / "out.json")], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert out[0] == [0.0, 0.0] and len(out) == 3
    for rank, (offset, uncertainty) in enumerate(out):
        assert 0 <= uncertainty < 0.05 and abs(offset - 5.0 * rank) <= uncertainty + 1e-6


def test_log_json_has_every_step_of_every_rank_and_the_events(observed):
    lines = [json.loads(line) for line in observed["log"].read_text().splitlines()]
    kinds = [e["event"] for e in lines]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end" and lines[0]["world_size"] == 3
    steps = [e for e in lines if e["event"] == "step"]
    assert sorted((e["step"], e["rank"]) for e in steps) == [(s, r) for s in range(12) for r in range(3)]
    for e in steps:
        assert set(e["times"]) == {"data", "forward", "backward", "comm_wait", "optimizer", "step"}
        assert all(v >= 0 for v in e["times"].values()) and e["times"]["step"] > e["times"]["forward"]
    # every rank reports the same (agreed) loss for a step
    for s in range(12):
        assert len({e["loss"] for e in steps if e["step"] == s}) == 1
    ckpts = [e["step"] for e in lines if e["event"] == "checkpoint"]
    assert ckpts == [3, 7, 11]  # after the 4th, 8th and 12th step
    result = json.loads(observed["json"].read_text())
    assert [e["val_loss"] for e in lines if e["event"] == "epoch"] == [h["val_loss"] for h in result["history"]]


def test_tensorboard_scalars_read_back_with_tensorboards_reader(observed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(observed["tb"]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "train/loss",
        "train/learning_rate",
        "train/grad_norm",
        "train/loss_scale",
        "train/skipped_steps",
        "epoch/samples_per_sec",
        "val/loss",
    } <= tags
    log = [json.loads(line) for line in observed["log"].read_text().splitlines()]
    losses = {e["step"]: e["loss"] for e in log if e["event"] == "step" and e["rank"] == 0}
    read = {s.step: s.value for s in acc.Scalars("train/loss")}
    assert read.keys() == losses.keys() and all(np.isclose(read[s], losses[s]) for s in read)
    assert [s.value for s in acc.Scalars("train/skipped_steps")] == [0.0] * 12
    assert all(s.value > 0 for s in acc.Scalars("train/grad_norm"))
    result = json.loads(observed["json"].read_text())
    assert [s.value for s in acc.Scalars("val/loss")] == pytest.approx([h["val_loss"] for h in result["history"]])
    assert [s.value for s in acc.Scalars("epoch/samples_per_sec")] == pytest.approx(
        [h["samples_per_sec"] for h in result["history"]]
    )


def test_a_rank_with_most_of_the_batch_is_named_the_straggler(tmp_path):
    out, log = tmp_path / "r.json", tmp_path / "log.jsonl"
    # rank 1 computes 9 of every 10 rows: it is slow in forward/backward, rank 0 waits in the allreduce
    r = _run(
        2,
        "--steps",
        30,
        "--batch-size",
        1024,
        "--batch-shares",
        "0.1,0.9",
        "--observe-every",
        10,
        "--json",
        out,
        "--log-json",
        log,
    )
    result = json.loads(out.read_text())
    assert result["stragglers"], r.stderr
    assert all(
        s["rank"] == 1 and s["phase"] in ("forward", "backward") and s["slower_by"] > 0.25 for s in result["stragglers"]
    )
    assert result["history"][-1]["stragglers"]
    assert "straggler: rank 1" in r.stderr
    assert [e["rank"] for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "straggler"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--trace", "{d}/t.json", "--trace-steps", "5:2"], "empty or negative step range"),
        (["--trace", "{d}/no/such/dir/t.json"], "does not exist"),
        (["--trace-steps", "1:3"], "give --trace PATH too"),
        (["--json", "{d}/same.json", "--trace", "{d}/same.json"], "name the same file"),
        (["--log-json", "{d}"], "is a directory"),
        (["--tensorboard", "{d}/tb"], "needs the tensorboardX package"),
    ],
)
def test_bad_observe_options_fail_on_every_rank_before_training(tmp_path, args, message):
    env = mpi_env()
    if "--tensorboard" in args:  # a tensorboardX that cannot be imported, ahead of the real one
        fake = tmp_path / "hide" / "tensorboardX"
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "hide"), env.get("PYTHONPATH", "")])
    args = [a.format(d=tmp_path) for a in args]
    r = mpirun(2, [*TRAIN, "--steps", "3", *args], env=env, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 2 and all(message in line for line in errors), r.stderr
    assert "Traceback" not in r.stderr and "epoch" not in r.stdout  # nothing trained
    assert not (tmp_path / "tb").exists()


def test_parse_step_range():
    assert parse_step_range("5:10") == (5, 10) and parse_step_range("3:") == (3, None)
    assert parse_step_range(":4") == (0, 4)
    for bad in ("5", "5:5", "5:2", "-1:3", "a:b"):
        with pytest.raises(Exception):  # noqa: B017 - whatever argparse's type raises, it refuses
            parse_step_range(bad)


def _rows(rank, backward, n=10):
    """n synthetic step records of one rank (the last column is the rank, as gathered)."""
    rec = dict.fromkeys(FIELDS, 0.0)
    rec.update(t_begin=0.0, t_call=0.001, forward=0.010, backward=backward, optimizer=0.002)
    rows = []
    for step in range(n):
        rec.update(step=step, total=rec["forward"] + backward + 0.005 + rec["optimizer"], comm_wait=0.005)
        rows.append([rec[f] for f in FIELDS] + [rank])
    return np.array(rows)


def test_find_straggler_names_the_slow_rank_and_phase():
    table = np.concatenate([_rows(0, 0.02), _rows(1, 0.02), _rows(2, 0.05)])
    found = find_straggler(table, 3, 0.25)
    assert found["rank"] == 2 and found["phase"] == "backward"
    assert found["phase_excess_seconds"] == pytest.approx(0.03) and found["steps"] == [0, 9]
    assert find_straggler(np.concatenate([_rows(0, 0.02), _rows(1, 0.021)]), 2, 0.25) is None
    assert find_straggler(np.concatenate([_rows(0, 0.02, 3), _rows(1, 0.2, 3)]), 2, 0.25) is None  # too few steps


def test_bench_observe_reports_the_overhead_of_every_output(tmp_path):
    from conftest import run_cli

    out = tmp_path / "bench.json"
    r = run_cli(
        [
            "bench",
            "--layers",
            "16,32,4",
            "--batch-sizes",
            "32",
            "--steps",
            "4",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--device",
            "cpu",
            "--observe",
            "--no-progress",
            "--json",
            out,
        ]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    o = json.loads(out.read_text())["rows"][0]["observe_overhead"]
    assert o["off"]["n"] + o["off"]["outliers"] == 8 and o["on"]["n"] + o["on"]["outliers"] == 8
    assert len(o["round_medians_ms"]["off"]) == len(o["round_medians_ms"]["on"]) == len(o["paired_round_pct"]) == 2
    assert o["observer_ms_per_step"]["mean"] > 0 and "observe overhead" in r.stdout
    assert not list(tmp_path.glob("mgpu-bench-observe-*"))
