"""`mgpu topo`, `mgpu recommend` and `mgpu bench` from the command line, under
mpirun where they measure a communicator: files, JSON fields, bit-exact
allreduce checks, the selector's validation, and one-line errors."""

import csv
import json
import math
import os
import re
import subprocess

import numpy as np
import pytest

from conftest import PYTHON, mpi_env, mpirun, run_cli
from mgpu.hostinfo import placement_moved
from mgpu.selector import history, profiles

MGPU = [PYTHON, "-m", "mgpu"]


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    """A 2-rank calibration of this machine, made once for the module."""
    d = tmp_path_factory.mktemp("topo")
    r = mpirun(
        2,
        [
            *MGPU,
            "topo",
            "--quick",
            "--max-mb",
            "1",
            "--threads",
            "1",
            "--out",
            d / "profile.json",
            "--json",
            d / "topo.json",
            "--plots",
            d / "plots",
        ],
        env=mpi_env(XDG_CACHE_HOME=d / "cache"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return d, r


def test_topo_measures_devices_and_a_bit_exact_allreduce_sweep(calibration):
    d, r = calibration
    profile = json.loads((d / "profile.json").read_text())
    assert profile == json.loads((d / "topo.json").read_text())
    assert profile["source"] == "calibrated" and len(profile["devices"]) == 2
    for dev in profile["devices"]:
        assert dev["fp32"]["peak_flops"] > 1e9 and len(dev["fp32"]["measured"]) >= 4
        assert dev["memory_bandwidth"] > 1e8 and dev["cpu"]["cores"] >= 1
        # CPU ranks share caches and memory: layer times and pass bandwidths with both
        # ranks computing, and rank 0's alone (identical devices: it stands for both)
        for key in ("layer_times", "layer_times_alone"):
            grid = dev[key]
            cells = len(grid["rows"]) * len(grid["widths"]) ** 2
            assert cells >= 8 and all(
                len(grid[k]) == cells and min(grid[k]) > 0 for k in ("forward", "backward", "backward_weights")
            )
            # more rows, more time (the same widths); an input gradient costs a GEMM
            per_rows = len(grid["widths"]) ** 2
            assert grid["forward"][-per_rows] > grid["forward"][0]
            assert grid["backward"][-1] > grid["backward_weights"][-1]
            # and cold, each call after sweeping the last-level cache (where sysfs names it)
            if dev["cache_bytes"] > 0:
                assert all(
                    len(grid[f"{k}_cold"]) == cells and min(grid[f"{k}_cold"]) > 0
                    for k in ("forward", "backward", "backward_weights")
                )
        for key in ("pass_bandwidth", "pass_bandwidth_alone"):
            assert len(dev[key]) >= 3 and all(b > 0 and r > 1e8 for b, r in dev[key])
        # real steps: the wait after backward holds the allreduce with 2 ranks, not alone
        together, alone = dev["step_phases"], dev["step_phases_alone"]
        assert together["ranks"] == 2 and alone["ranks"] == 1 and len(together["params"]) >= 2
        assert min(together["update_s"] + alone["update_s"]) > 0 and min(together["wait_s"] + alone["wait_s"]) > 0
        assert together["wait_s"][-1] > alone["wait_s"][-1]
        assert all(
            len(t["wait_spread_s"]) == len(t["params"]) and min(t["wait_spread_s"]) >= 0 for t in (together, alone)
        )
        # the step overhead: the probe's step less the model's price of the probe's own work
        assert 0 <= dev["step_overhead_s"] < dev["probe_step_s"]
    assert profile["step_overhead_s"] == max(dev["step_overhead_s"] for dev in profile["devices"])
    # where the ranks' cores sat: a cache line's round trip between their CPUs, read at the
    # calibration's start, around each try at the probe of the wait after backward (again
    # while the cores moved during it), during a watch for a second placement, and at its end
    placement = profile["placement"]
    if len(os.sched_getaffinity(0)) < 2:  # the two ranks share one CPU: no pair to read
        assert placement is None
        return
    ns = placement["readings_ns"]
    assert len(set(placement["cpus"])) == 2 and all(5 < t < 1e5 for t in ns), placement
    assert placement["wait_probe_ns"] == ns[1:3] or placement_moved(ns[1:3])  # a try moved: probed again
    # the readings taken at times that did not depend on the placement: the start, the first
    # probe's, the watch's (one or more), the end
    samples = placement["samples_ns"]  # the start, the watch's (one a half second), the end
    assert samples[0] == ns[0] and samples[-1] == ns[-1] and len(samples) >= 4
    if "other_wait_probe_ns" in placement:  # the cores went elsewhere: the wait was probed there too
        assert 0 < placement["other_share"] <= 1
        assert all(dev["step_phases_other_placement"]["ranks"] == 2 for dev in profile["devices"])
    assert f"ranks' cores (CPUs {placement['cpus'][0]} and {placement['cpus'][1]})" in r.stdout
    for key in (
        "layer_times",
        "pass_bandwidth",
        "step_phases",
        "layer_times_alone",
        "pass_bandwidth_alone",
        "step_phases_alone",
    ):
        assert profile["devices"][0][key] == profile["devices"][1][key], key  # identical devices: one table
    rows = profile["allreduce"]
    assert rows[0]["bytes"] == 4 and rows[-1]["bytes"] == 1 << 20
    assert all(row["wrong"] == 0 for row in rows)
    assert rows[-1]["raw_mpi_busbw_GBps"] > 0 and rows[-1]["vs_raw_mpi"] > 0  # held against bare MPI_Allreduce
    assert rows[-1]["deadline_busbw_GBps"] > 0  # and timed as training calls it (with a watchdog deadline)
    # one node: one link; tests/cluster measures two hosts' links apart
    assert profile["nodes"] is None and profile["gpus_per_node"] == 0 and "nccl" not in profile["link"]
    assert "one node: no inter-node link to measure" in r.stdout
    for row in rows:  # busbw = algbw x 2(n-1)/n with n = 2
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"])
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / (row["time_us"] * 1e-6) / 1e9, rel=1e-6)
    link = profile["link"]
    assert link["alpha_s"] >= 0 and link["bus_bandwidth"] > 0 and link["fitted_at_ranks"] == 2
    assert "algbw GB/s" in r.stdout and "busbw GB/s" in r.stdout
    assert not (d / "cache" / "mgpu").exists(), "--out given: the cache is left alone"
    assert sorted(p.name for p in (d / "plots").iterdir()) == ["allreduce.png", "gemm.png"]


def test_topo_step_probe_leaves_the_communicators_timeout_alone(tmp_path):
    # The probe trains with Trainers, which set their watchdog on the shared group
    # and communicator; left there, the allreduce sweep after it timed the
    # deadline path (a worker-thread handoff per call) as if it were the plain call.
    script = tmp_path / "probe.py"
    script.write_text(
        "from mgpu.train.process_group import ProcessGroup\n"
        "from mgpu.calibrate.topo import measure_step_phases\n"
        "pg = ProcessGroup()\n"
        "comm = pg.communicator()\n"
        "kept = []\n"
        "for pg_timeout, comm_timeout in ((0.0, 0.0), (7.0, 0.0), (0.0, 11.0)):\n"
        "    pg.timeout, comm.timeout = pg_timeout, comm_timeout\n"
        "    table = measure_step_phases(pg, 'cpu', 1, quick=True)\n"
        "    assert table['ranks'] == pg.size and min(table['update_s']) > 0\n"
        "    kept.append((pg.timeout == pg_timeout, comm.timeout == comm_timeout))\n"
        "everyone = pg.comm.gather(kept, root=0)\n"
        "if pg.rank == 0:\n"
        "    print(everyone)\n"
    )
    r = mpirun(2, [PYTHON, script])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == str([[(True, True)] * 3] * 2)


def test_recommend_on_the_calibration(calibration, tmp_path):
    d, _ = calibration
    out = tmp_path / "rec.json"
    r = run_cli(
        [
            "recommend",
            "--layers",
            "50,1024,1024,3",
            "--batch-size",
            "1024",
            "--devices",
            "1,2",
            "--profile",
            d / "profile.json",
            "--json",
            out,
        ]
    )
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())
    assert rec["profile_source"] == "calibrated" and rec["fallback"] is False
    assert rec["strategy"] in ("single_gpu", "multi_gpu", "benchmark_required")
    assert [c["devices"] for c in rec["candidates"]] == [1, 2]
    assert "strategy:" in r.stdout and "break-even" in r.stdout or rec["break_even_batch"] is None


def test_recommend_cli_example_from_the_issue(tmp_path):
    out = tmp_path / "xl.json"
    r = run_cli(
        [
            "recommend",
            "--model",
            "xl",
            "--batch-size",
            "2048",
            "--devices",
            "1,2,4",
            "--profile",
            "nvlink",
            "--json",
            out,
            "--price",
            "2.5",
        ]
    )
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())
    for key in ("strategy", "devices", "candidates", "break_even_batch", "reasons", "confidence", "roi"):
        assert key in rec
    for c in rec["candidates"]:
        for key in ("predicted_step_ms", "predicted_speedup", "efficiency", "memory_fits"):
            assert key in c
    assert rec["strategy"] == "multi_gpu" and rec["devices"] in (2, 4)  # 120M params on NVLink
    assert rec["params"] > 100e6


def test_recommend_without_calibration_or_gpu_falls_back(tmp_path):
    r = run_cli(
        ["recommend", "--params", "3e5", "--batch-size", "64", "--json", tmp_path / "f.json"],
        env=mpi_env(XDG_CACHE_HOME=tmp_path / "empty"),
    )
    assert r.returncode == 0, r.stderr
    rec = json.loads((tmp_path / "f.json").read_text())
    assert rec["fallback"] is True and rec["strategy"] == "single_gpu"
    assert "seed 001" in r.stdout


def test_bench_launches_each_rank_count_and_validates_the_selector(calibration, tmp_path):
    d, _ = calibration
    r = run_cli(
        [
            "bench",
            "--layers",
            "50,256,256,3",
            "--batch-sizes",
            "64,256",
            "--ranks",
            "1,2",
            "--warmup",
            "2",
            "--steps",
            "8",
            "--repeats",
            "2",
            "--threads",
            "1",
            "--validate-selector",
            "--profile",
            d / "profile.json",
            "--json",
            tmp_path / "b.json",
            "--csv",
            tmp_path / "b.csv",
            "--plots",
            tmp_path / "plots",
            "--no-progress",
        ],
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "b.json").read_text())
    rows = result["rows"]
    assert sorted((x["batch_size"], x["ranks"]) for x in rows) == [(64, 1), (64, 2), (256, 1), (256, 2)]
    for x in rows:
        assert x["step"]["n"] + x["step"]["outliers"] == 16
        assert x["step"]["ci95"][0] <= x["step"]["mean"] <= x["step"]["ci95"][1]
        assert x["samples_per_sec"] == pytest.approx(x["batch_size"] / x["step"]["median"])
        assert set(x["breakdown_ms"]) == {"forward", "backward", "comm_wait", "optimizer"}
        assert x["compute_floor_ms"] > 0 and x["peak_memory_bytes"] > 0
        assert "predicted_step_ms" in x and "allreduce_floor_ms" in x
        assert len(x["round_step_medians"]) == 2  # rank counts in 2 alternating rounds, 8 steps each
        if x["ranks"] == 1:
            assert x["speedup"] == pytest.approx(1.0)
    one = {x["batch_size"]: x for x in rows if x["ranks"] == 1}
    for x in (x for x in rows if x["ranks"] == 2):  # a speedup pairs the rounds measured back to back
        pairs = [b / t for b, t in zip(one[x["batch_size"]]["round_step_medians"], x["round_step_medians"])]
        assert x["speedup_rounds"] == pytest.approx(pairs) and x["speedup"] == pytest.approx(sum(pairs) / 2)
    assert len(result["validation"]) == 2
    assert all(len(v["measured_speedup_rounds"]) == 2 for v in result["validation"])
    assert "; rounds " in r.stdout
    # where the ranks' cores sat before and after each round, beside topo's readings (bench's
    # unbound ranks read CPUs 0 and 1, as topo's bound ones do on this VM)
    if len(os.sched_getaffinity(0)) >= 2:
        for v in result["validation"]:
            assert len(v["core_round_trip_ns"]) == 4 and len(v["calibrated_round_trip_ns"]) == 2
            assert isinstance(v["placement_as_calibrated"], bool)
        assert "the cores' round trip" in r.stdout
    two = {x["batch_size"]: x for x in rows if x["ranks"] == 2}
    for v in result["validation"]:
        assert v["predicted_speedup"] > 0 and v["selector_strategy"] in (
            "single_gpu",
            "multi_gpu",
            "benchmark_required",
        )
        cell = two[v["batch_size"]]  # where a miss lies: the step and its wait, measured beside predicted
        assert v["measured_wait_ms"] == cell["breakdown_ms"]["comm_wait"]
        assert v["predicted_wait_ms"] == cell["predicted_breakdown_ms"]["comm_wait"] > 0
        assert v["predicted_step_ms"] == cell["predicted_step_ms"] > v["predicted_wait_ms"]
        assert v["measured_step_1_ms"] == pytest.approx(one[v["batch_size"]]["step"]["median"] * 1e3)
        assert v["predicted_step_1_ms"] == one[v["batch_size"]]["predicted_step_ms"]
    assert "wait after backward" in r.stdout
    with open(tmp_path / "b.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "breakdown.png",
        "speedup_vs_ranks.png",
        "throughput_vs_batch.png",
    ]
    assert re.search(r"measured\s+predicted", r.stdout)
    # every cell holds its 80 % interval, and the grid is scored (issue 42)
    for x in rows:
        low, high = x["predicted_step_interval_ms"]
        assert 0 < low < high  # (a calibration's bands may lie to one side of the point: a biased model)
        assert x["inside_interval"] == (low <= x["step"]["median"] * 1e3 <= high)
    scores = result["scores"]
    assert scores["cells"] == 4 and 0 <= scores["coverage"] <= 1
    assert scores["median_abs_error"] <= scores["p90_abs_error"]
    assert [d["batch_size"] for d in scores["decisions"]] == [64, 256]
    assert 0 <= scores["decision_accuracy"] <= 1 and 0 <= scores["benchmark_required_share"] <= 1
    assert "scores: step error median" in r.stdout and "the 80% interval held the measured step" in r.stdout
    assert "predicted (80% interval)" in r.stdout


def test_bench_under_mpirun_measures_that_world(tmp_path):
    r = mpirun(
        2,
        [
            *MGPU,
            "bench",
            "--layers",
            "20,32,3",
            "--batch-sizes",
            "32",
            "--warmup",
            "1",
            "--steps",
            "4",
            "--repeats",
            "1",
            "--json",
            tmp_path / "w.json",
            "--no-progress",
        ],
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "w.json").read_text())["rows"]
    assert [x["ranks"] for x in rows] == [2]


def _torch_available():
    from mgpu.calibrate.bench import torch_python

    return torch_python() is not None


@pytest.mark.skipif(not _torch_available(), reason="no interpreter with torch (the peer is optional)")
def test_bench_compares_with_pytorch_in_the_same_run(tmp_path):
    r = run_cli(
        [
            "bench",
            "--layers",
            "50,128,3",
            "--batch-sizes",
            "64",
            "--ranks",
            "1,2",
            "--warmup",
            "2",
            "--steps",
            "5",
            "--repeats",
            "2",
            "--threads",
            "1",
            "--dropout",
            "0.1",
            "--compare",
            "torch",
            "--json",
            tmp_path / "t.json",
            "--no-progress",
        ],
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert sorted(x["ranks"] for x in rows) == [1, 2]
    for x in rows:
        assert x["torch"]["samples_per_sec"] > 0 and x["torch"]["version"]
        # the same workload on both sides: the preset's dropout too, which the peer's own default lacks
        ran = x["torch"]["workload"]
        assert ran["layers"] == x["layers"] and ran["dropout"] == x["dropout"] == 0.1 and ran["batch_size"] == 64
        assert ran["threads"] == x["threads"] == 1 and ran["optimizer"] == "sgd"
        # two alternating rounds of 5 steps each side, merged; the ratio per round pair
        assert len(x["step_seconds"]) == 10 and len(x["torch"]["step_seconds"]) == 10
        ratio = x["torch_ratio"]
        assert len(ratio["rounds"]) == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]
        assert "median of 2 alternating rounds" in r.stdout


def test_bench_alternates_thread_counts_and_pairs_their_rounds(tmp_path):
    r = run_cli(
        [
            "bench",
            "--layers",
            "50,128,3",
            "--batch-sizes",
            "64,256",
            "--threads",
            "2,1",
            "--warmup",
            "1",
            "--steps",
            "4",
            "--repeats",
            "2",
            "--json",
            tmp_path / "t.json",
        ],
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # one launch per thread count, in the given order and then reversed (the drift falls on both)
    launches = [line for line in r.stderr.splitlines() if line.startswith("bench: ")]
    assert launches == [f"bench: 1 rank(s) x {t} thread(s)..." for t in (2, 1, 1, 2)]
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert sorted((x["batch_size"], x["ranks"], x["threads"]) for x in rows) == [
        (64, 1, 1),
        (64, 1, 2),
        (256, 1, 1),
        (256, 1, 2),
    ]
    one = {x["batch_size"]: x for x in rows if x["threads"] == 1}  # the base: the fewest threads
    for x in rows:
        assert len(x["step_seconds"]) == 8 and len(x["round_step_medians"]) == 2  # 2 rounds of 4 steps
        pairs = [b / t for b, t in zip(one[x["batch_size"]]["round_step_medians"], x["round_step_medians"])]
        assert x["speedup_rounds"] == pytest.approx(pairs) and x["speedup"] == pytest.approx(sum(pairs) / 2)
        assert x["efficiency"] == pytest.approx(x["speedup"] / x["threads"])
    for extra, what in ((["--validate-selector"], "--validate-selector"), (["--plots", tmp_path / "p"], "--plots")):
        bad = run_cli(["bench", "--layers", "50,128,3", "--threads", "1,2", *extra], timeout=120)
        assert bad.returncode == 2 and f"{what} takes one thread count per rank" in bad.stderr, bad.stderr[-2000:]
        assert "Traceback" not in bad.stderr


def test_output_whose_reader_is_gone_ends_quietly():
    # `mgpu info | head -1`: the pipe's reader is gone before mgpu writes (closed here up front)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run(
            [*MGPU, "info"], stdout=write_end, stderr=subprocess.PIPE, text=True, env=mpi_env(), timeout=120
        )
    finally:
        os.close(write_end)
    assert r.returncode == 141, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize(
    "args, message",
    [
        (["recommend", "--model", "large", "--batch-size", "0"], "batch size"),
        (["recommend", "--model", "large", "--batch-size", "64", "--devices", "0,2"], "device counts"),
        (["recommend", "--model", "large", "--batch-size", "64", "--profile", "nosuch"], "unknown hardware profile"),
        (["recommend", "--batch-size", "64"], "one of the arguments"),
        (["bench", "--steps", "0"], "--steps must be >= 1"),
        (["bench", "--batch-sizes", "1", "--layers", "4,4"], "smaller than the number of ranks"),
        (["topo", "--max-mb", "0"], "--max-mb"),
        (["topo", "--max-mb", "1e400"], "--max-mb"),
        (["bench", "--ranks", "2,2"], "rank counts must be distinct"),
        (["bench", "--threads", "1,1"], "thread counts must be distinct"),
        (["bench", "--threads", "1,2"], "not under mpirun"),
        (["bench", "--ranks", "1,2", "--layers", "4,4"], "--ranks launches mpirun once per rank count"),
        (["bench", "--compare", "torch"], "alternates launches"),
        (["bench", "--plots", "/proc/version/plots"], "is not a directory"),
    ],
)
def test_tool_bad_input_one_line_on_every_rank(args, message):
    r = mpirun(2, [*MGPU, *args], timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("mgpu") and "error" in line]
    assert len(errors) == 2 and all(message in e and e.count("error") == 1 for e in errors), r.stderr
    assert "Traceback" not in r.stderr


def test_train_batch_shares_auto_follows_the_calibration(calibration, tmp_path):
    d, _ = calibration
    cache = tmp_path / "cache"
    (cache / "mgpu").mkdir(parents=True)
    (cache / "mgpu" / "profile.json").write_text((d / "profile.json").read_text())
    args = [
        *MGPU,
        "train",
        "--layers",
        "50,64,3",
        "--steps",
        "3",
        "--batch-size",
        "101",
        "--batch-shares",
        "auto",
        "--no-progress",
        "--json",
        tmp_path / "t.json",
    ]
    r = mpirun(2, args, env=mpi_env(XDG_CACHE_HOME=cache))
    assert r.returncode == 0, r.stderr[-2000:]
    shares = json.loads((tmp_path / "t.json").read_text())["config"]["batch_shares"]
    assert len(shares) == 2 and sum(shares) == 101  # identical ranks: an even split
    assert abs(shares[0] - shares[1]) <= 1
    r = mpirun(2, args, env=mpi_env(XDG_CACHE_HOME=tmp_path / "none"))
    assert r.returncode == 2 and r.stderr.count("needs a calibration") == 2, r.stderr[-2000:]


def test_topo_measures_its_own_error_on_held_out_steps(calibration):
    d, _ = calibration
    profile = json.loads((d / "profile.json").read_text())
    model, checks = profile["error_model"], profile["held_out_steps"]
    assert "held-out steps at calibration alone and on 2 ranks" in model["source"]
    assert model["compute_shared"] is False and len(checks) >= 3
    for c in checks:
        assert min(c["alone_s"], c["together_s"], c["alone_predicted_s"], c["together_predicted_s"]) > 0
    # each 2-rank step says where the ranks' cores sat around it
    placement = profile["placement"]
    if placement is not None:
        assert all(c["together_round_trip_cpus"] == placement["cpus"] for c in checks)
        assert all(t in placement["readings_ns"] for c in checks for t in c["together_round_trip_ns"])
    # each band: a workload's median log(measured / predicted) either way plus its steps' scatter,
    # of the 2-rank steps those in a placement the wait was probed in
    kept = [c for c in checks if not history.placed_elsewhere(c, placement)]
    kept = kept if len(kept) >= 2 else checks
    assert ("placed_elsewhere" in model) == (len(kept) < len(checks))

    def by_workload(steps, ratio):
        groups = {}
        for c in steps:
            groups.setdefault((tuple(c["layers"]), c["batch"]), []).append(ratio(c))
        return list(groups.values())

    alone = by_workload(checks, lambda c: math.log(c["alone_s"] / c["alone_predicted_s"]))
    together = by_workload(kept, lambda c: math.log(c["together_s"] / c["together_predicted_s"]))
    assert len(alone) == len(checks) // 2  # each MLP at topo's start and end
    for key, groups in (("compute", alone), ("compute_together", together), ("comm", together)):
        offsets = [float(np.median(g)) for g in groups]
        within = [v - o for g, o in zip(groups, offsets) for v in g]
        pairs = [s * o + w for o in offsets for s in (1, -1) for w in within]
        assert model[key] == pytest.approx(list(np.percentile(pairs, [10, 90])))
    low, high = model["speedup"]
    assert -3 < low <= high < 3 and low == pytest.approx(-high)


def _train_with(profile: dict, tmp_path, name: str):
    cache = tmp_path / name
    (cache / "mgpu").mkdir(parents=True)
    (cache / "mgpu" / "profile.json").write_text(json.dumps(profile))
    out = tmp_path / f"{name}.json"
    args = [*MGPU, "train", "--layers", "50,256,256,3", "--steps", "40", "--batch-size", "256", "--threads", "1"]
    args += ["--no-progress", "--json", out, "--log-json", tmp_path / f"{name}.jsonl"]
    r = mpirun(2, args, env=mpi_env(XDG_CACHE_HOME=cache))
    assert r.returncode == 0, r.stderr[-2000:]
    log = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    return r, json.loads(out.read_text())["prediction"], log


def test_train_holds_the_calibrations_prediction_against_its_steps(calibration, tmp_path):
    d, _ = calibration
    r, p, log = _train_with(json.loads((d / "profile.json").read_text()), tmp_path, "own")
    assert p["available"] and p["profile_source"] == "calibrated" and p["measured_steps"] >= 30
    low, high = p["interval_ms"]
    assert 0 < low < high and p["measured_step_ms"] > 0
    assert p["error"] == pytest.approx(p["predicted_step_ms"] / p["measured_step_ms"] - 1)
    assert p["inside"] == (low <= p["measured_step_ms"] <= high)
    assert set(p["measured_phases_ms"]) == {"forward", "backward", "comm_wait", "optimizer", "other"}
    assert r.stdout.count("prediction: ") == 1 and "(80% interval" in r.stdout
    assert r.stderr.count("mgpu: warning: the measured step") == (0 if p["inside"] else 1)
    # the JSON-lines log: the prediction at the start, held against the steps before the end
    events = [e["event"] for e in log]
    assert events.index("prediction") == events.index("run_end") - 1
    assert log[0]["prediction"]["predicted_step_ms"] == p["predicted_step_ms"]
    assert log[events.index("prediction")]["measured_step_ms"] == p["measured_step_ms"]
    # and rank 0 keeps it in the record beside the calibration, which its bands learn from
    (record,) = [json.loads(line) for line in (tmp_path / "own" / "mgpu" / "checks.jsonl").read_text().splitlines()]
    assert record["devices"] == 2 and record["what"] == "train"
    assert record["log_ratio"] == pytest.approx(math.log(p["measured_step_ms"] / p["predicted_step_ms"]))


def test_a_wrong_calibration_warns_naming_the_phase(calibration, tmp_path):
    # a calibration whose layers ran 5x faster than this machine's (another machine's, say)
    d, _ = calibration
    profile = json.loads((d / "profile.json").read_text())
    for dev in profile["devices"]:
        for key in ("layer_times", "layer_times_alone"):
            grid = dev[key]
            for table in [k for k in grid if k.startswith(("forward", "backward"))]:
                grid[table] = [t / 5 for t in grid[table]]
    # with that machine's own bands, wait spread and cores that stayed put (this quick
    # calibration's, on a busy machine, may be wide, and a placement seen moving widens the
    # 2-rank wait spread to the wait itself: either held a 5x miss inside the interval)
    profile["error_model"] = {"compute": [-0.1, 0.1], "comm": [-0.1, 0.1], "step_bands": True, "source": "another"}
    profile.pop("placement", None)
    for dev in profile["devices"]:
        dev.pop("step_phases_other_placement", None)
        for key in ("step_phases", "step_phases_alone"):
            if isinstance(dev.get(key), dict) and "wait_spread_s" in dev[key]:
                dev[key]["wait_spread_s"] = [0.0 for _ in dev[key]["wait_spread_s"]]
    # that machine's file, whole: its held-out steps priced by all of the above, so loading
    # it prices them alike and keeps its bands (priced before the placement and the wait
    # spread were changed, a load re-priced them and rebuilt the bands from a 5x miss)
    profiles.price_held_out_steps(profile)
    r, p, _ = _train_with(profile, tmp_path, "wrong")
    assert p["available"] and not p["inside"] and p["differs_most"] in ("forward", "backward"), json.dumps(p)
    assert "re-priced" not in p["intervals_from"], p["intervals_from"]
    assert r.stderr.count("mgpu: warning: the measured step") == 1  # rank 0 alone says it
    assert f"{p['differs_most']} differs most" in r.stderr and "computes slower" in r.stderr
    assert "OUTSIDE the interval" in r.stdout


def test_a_step_over_the_whole_dataset_is_not_priced_as_its_batch(calibration, tmp_path):
    d, _ = calibration
    cache = tmp_path / "cache"
    (cache / "mgpu").mkdir(parents=True)
    (cache / "mgpu" / "profile.json").write_text((d / "profile.json").read_text())
    data = tmp_path / "small.npz"
    np.savez(data, x=np.zeros((40, 8), np.float32), y=np.zeros((40, 2), np.float32))
    args = ["train", "--dataset", data, "--layers", "8,8,2", "--batch-size", "512", "--steps", "3", "--threads", "1"]
    r = run_cli([*args, "--no-progress", "--json", tmp_path / "t.json"], env=mpi_env(XDG_CACHE_HOME=cache))
    assert r.returncode == 0, r.stderr
    assert "prediction: none (a step takes the whole dataset" in r.stdout
    assert not (cache / "mgpu" / "checks.jsonl").exists()


def test_train_without_a_calibration_says_it_has_no_prediction(tmp_path):
    r = run_cli(
        ["train", "--layers", "8,8,2", "--steps", "3", "--no-progress", "--json", tmp_path / "t.json"],
        env=mpi_env(XDG_CACHE_HOME=tmp_path / "empty"),
    )
    assert r.returncode == 0, r.stderr
    assert "prediction: none (no calibration of this machine" in r.stdout
    p = json.loads((tmp_path / "t.json").read_text())["prediction"]
    assert p["available"] is False and "mgpu topo" in p["reason"]
