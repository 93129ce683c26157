"""bench's derived figures (add_derived): which row a speedup is against, and what its
efficiency divides by, for rank counts, thread counts and both."""

import pytest

from mgpu.calibrate import bench
from mgpu.commands import bench as bench_command


def _row(ranks, threads, rounds_ms, batch=64):
    return {
        "batch_size": batch,
        "ranks": ranks,
        "threads": threads,
        "samples_per_sec": batch / (rounds_ms[0] / 1e3),
        "round_step_medians": [ms / 1e3 for ms in rounds_ms],
    }


def test_rank_counts_against_one_rank_and_efficiency_per_rank():
    rows = [_row(1, 2, [10.0, 12.0]), _row(2, 1, [6.0, 5.0])]  # default threads: cores / ranks
    bench.add_derived(rows, None)
    assert rows[1]["speedup_rounds"] == pytest.approx([10 / 6, 12 / 5])
    assert rows[1]["speedup"] == pytest.approx((10 / 6 + 12 / 5) / 2)
    assert rows[1]["efficiency"] == pytest.approx(rows[1]["speedup"] / 2)  # per rank, as before
    assert rows[0]["speedup"] == pytest.approx(1.0)


def test_without_one_rank_a_rank_sweep_has_no_speedup():
    rows = [_row(2, 1, [6.0]), _row(4, 1, [4.0])]
    bench.add_derived(rows, None)
    assert all("speedup" not in r and "efficiency" not in r for r in rows)
    # and the table says so with a dash (it printed 'nanx nan%')
    for r in rows:
        r.update(
            step={"ci95": [0.004, 0.006]},
            breakdown_ms=dict.fromkeys(("forward", "backward", "comm_wait", "optimizer"), 1.0),
            peak_memory_bytes=1e8,
            compute_floor_ms=0.5,
        )
    table = bench_command.format_table(rows)
    assert "nan" not in table and table.splitlines()[1].split().count("-") == 5  # speedup to the peer's ratio


def test_a_steps_confidence_interval_stays_at_or_above_zero():
    # three skewed samples: the t-interval of their mean reached below zero
    s = bench.summarize([1e-3, 5e-3, 0.2e-3])
    assert s["ci95"][0] == 0.0 < s["mean"] < s["ci95"][1]


@pytest.mark.parametrize("ranks", [1, 2])
def test_thread_counts_against_the_fewest_threads_and_efficiency_per_thread(ranks):
    rows = [_row(ranks, 4, [3.0, 3.0]), _row(ranks, 1, [10.0, 10.0]), _row(ranks, 2, [5.5, 5.0])]
    bench.add_derived(rows, None, thread_scaling=True)
    by_threads = {r["threads"]: r for r in rows}
    assert by_threads[1]["speedup"] == pytest.approx(1.0)
    assert by_threads[2]["speedup"] == pytest.approx((10 / 5.5 + 2) / 2)
    assert by_threads[2]["efficiency"] == pytest.approx(by_threads[2]["speedup"] / 2)
    assert by_threads[4]["efficiency"] == pytest.approx(10 / 3 / 4)


def test_ranks_and_threads_together_scale_by_both():
    rows = [_row(1, 1, [12.0]), _row(1, 2, [6.5]), _row(2, 1, [6.4]), _row(2, 2, [3.4])]
    bench.add_derived(rows, None, thread_scaling=True)
    two_by_two = next(r for r in rows if (r["ranks"], r["threads"]) == (2, 2))
    assert two_by_two["speedup"] == pytest.approx(12 / 3.4)
    assert two_by_two["efficiency"] == pytest.approx(12 / 3.4 / 4)


def test_a_failed_peer_is_reported_by_its_exception_not_by_mpiruns_banner():
    from mgpu.calibrate.bench import peer_error

    banner = (
        "-" * 74 + "\nPrimary job  terminated normally, but 1 process returned\na non-zero exit code. "
        "Per user-direction, the job has been aborted.\n" + "-" * 74 + "\n"
    )
    raised = 'Traceback (most recent call last):\n  File "peer.py", line 3\nRuntimeError: no NCCL built in\n'
    assert peer_error(raised + banner) == "RuntimeError: no NCCL built in"
    assert peer_error("peer: cannot bind port 29500\n" + banner) == "peer: cannot bind port 29500"
    assert peer_error("") == "(no error output)"
    # the rank that failed first, not the one that printed last; Open MPI 5's prterun notice skipped
    first = "Traceback (most recent call last):\nValueError: bad shape\n"
    later = "Traceback (most recent call last):\nRuntimeError: peer aborted\n"
    assert peer_error(first + later + banner) == "ValueError: bad shape"
    assert (
        peer_error(
            "prterun detected that one or more processes exited with non-zero status,\n"
            "thus causing the job to be terminated.\npeer: out of memory\n"
        )
        == "peer: out of memory"
    )


@pytest.mark.parametrize("seen, as_calibrated", [([55.0, 60.0, 58.0, 61.0], True), ([55.0, 330.0, 58.0, 61.0], False)])
def test_validation_says_whether_a_cell_ran_where_topo_found_the_cores(monkeypatch, seen, as_calibrated):
    profile = {"placement": {"cpus": [0, 1], "readings_ns": [52.0, 54.0, 57.0, 60.0], "wait_probe_ns": [54.0, 57.0]}}
    monkeypatch.setattr(bench, "_predict", lambda row, prof: type("P", (), {"speedup": 1.25}))
    cell = {"core_round_trip_ns": seen, "core_round_trip_cpus": [0, 1], "speedup_rounds": [1.1, 1.3]}
    got = bench._placement_against_calibration(cell, profile)
    # the rounds wholly in the probe's placement: both, or the second only
    here = [1.1, 1.3] if as_calibrated else [1.3]
    assert got == {
        "core_round_trip_ns": seen,
        "calibrated_round_trip_ns": [54.0, 57.0],
        "placement_as_calibrated": as_calibrated,
        "placement_as_second_probe": False,
        "by_placement": [
            {
                "probe": "first",
                "calibrated_round_trip_ns": [54.0, 57.0],
                "rounds": len(here),
                "measured_speedup": pytest.approx(sum(here) / len(here)),
                "predicted_speedup": 1.25,
                "relative_error": pytest.approx(1.25 / (sum(here) / len(here)) - 1),
            }
        ],
    }
    row = {
        "batch_size": 64,
        "ranks": 2,
        "measured_speedup": 1.2,
        "measured_speedup_rounds": [1.1, 1.3],
        "predicted_speedup": 1.25,
        "relative_error": 0.04,
        "predicted_step_ms": None,
        "selector_strategy": "multi_gpu",
        "selector_devices": 2,
        "measured_fastest": 2,
        "picked_faster": True,
        **got,
    }
    text = bench_command.format_validation([row])
    placement = "as calibrated" if as_calibrated else "ANOTHER PLACEMENT than topo's"
    assert f"the cores' round trip {min(seen):.0f}-{max(seen):.0f} ns (topo's 54-57): {placement}" in text
    assert f"; {len(here)} round(s) where topo's first probe of the wait ran (54-57 ns): " in text
    assert text.splitlines()[-1] == (
        "within +-10%: 1 of 1 cells (worst +4%); picks: 1 right, 0 wrong, 0 asked for a benchmark"
    )
    # unknown on either side (a GPU, one rank per node, a calibration from before): nothing claimed
    # ... or read between other CPUs than topo's (bench's unbound ranks, topo's bound ones)
    for given, prof in (
        ({}, profile),
        (cell, {}),
        (cell, {"placement": None}),
        ({**cell, "core_round_trip_cpus": [0, 2]}, profile),
    ):
        assert bench._placement_against_calibration(given, prof) == {"placement_as_calibrated": None}
    assert "round trip" not in bench_command.format_validation([{**row, "placement_as_calibrated": None}])


def test_rounds_in_topos_second_placement_are_held_against_its_second_probe(monkeypatch):
    from mgpu.selector import profiles as perf

    profile = {
        "placement": {
            "cpus": [0, 1],
            "readings_ns": [54.0, 57.0, 330.0, 335.0],
            "wait_probe_ns": [54.0, 57.0],
            "other_wait_probe_ns": [330.0, 335.0],
            "other_share": 0.4,
        }
    }
    pinned = {probe: {"pinned": probe} for probe in ("first", "second")}
    monkeypatch.setattr(perf, "placement_profile", lambda prof, probe: pinned[probe])
    monkeypatch.setattr(
        bench, "_predict", lambda row, prof: type("P", (), {"speedup": 0.9 if prof is pinned["second"] else 1.3})
    )
    # three rounds: near, far, and one the cores left during it (in neither)
    cell = {
        "core_round_trip_ns": [55.0, 58.0, 331.0, 329.0, 60.0, 330.0],
        "core_round_trip_cpus": [0, 1],
        "speedup_rounds": [1.28, 0.93, 1.1],
    }
    got = bench._placement_against_calibration(cell, profile)
    assert got["placement_as_calibrated"] is False and got["placement_as_second_probe"] is False
    assert [(b["probe"], b["rounds"], b["measured_speedup"], b["predicted_speedup"]) for b in got["by_placement"]] == [
        ("first", 1, 1.28, 1.3),
        ("second", 1, 0.93, 0.9),
    ]
    assert got["by_placement"][1]["relative_error"] == pytest.approx(0.9 / 0.93 - 1)


def test_the_validation_counts_its_cells_within_the_bound_and_its_picks():
    def cell(batch, error, picked):
        return {
            "batch_size": batch,
            "ranks": 2,
            "measured_speedup": 1.5,
            "predicted_speedup": 1.5 * (1 + error),
            "relative_error": error,
            "predicted_step_ms": None,
            "selector_strategy": "multi_gpu",
            "selector_devices": 2,
            "measured_fastest": 2,
            "picked_faster": picked,
        }

    text = bench_command.format_validation([cell(64, 0.12, None), cell(256, -0.10, True), cell(1024, -0.31, False)])
    assert text.splitlines()[-1] == (
        "within +-10%: 1 of 3 cells (worst -31%); picks: 1 right, 1 wrong, 1 asked for a benchmark"
    )
    # no prediction (a profile that could not price the rows): no count
    none = {**cell(64, 0.0, None), "predicted_speedup": None, "relative_error": None}
    assert "within" not in bench_command.format_validation([none])


def test_a_cell_is_named_by_the_placements_its_rounds_ran_in(monkeypatch):
    from mgpu.selector import profiles as perf

    profile = {
        "placement": {
            "cpus": [0, 1],
            "readings_ns": [54.0, 57.0, 330.0, 335.0],
            "wait_probe_ns": [54.0, 57.0],
            "other_wait_probe_ns": [330.0, 335.0],
            "other_share": 0.4,
        }
    }
    monkeypatch.setattr(perf, "placement_profile", lambda prof, probe: {"pinned": probe})
    monkeypatch.setattr(bench, "_predict", lambda row, prof: type("P", (), {"speedup": 1.2}))
    row = {
        "batch_size": 64,
        "ranks": 2,
        "measured_speedup": 1.2,
        "predicted_speedup": 1.2,
        "relative_error": 0.0,
        "predicted_step_ms": None,
        "selector_strategy": "multi_gpu",
        "selector_devices": 2,
        "measured_fastest": 2,
        "picked_faster": True,
    }
    for readings, where in (
        ([331.0, 329.0, 334.0, 330.0], "as topo's second probe"),
        ([55.0, 58.0, 331.0, 329.0], "in turn where topo's two probes ran"),
        ([55.0, 330.0, 56.0, 58.0], "ANOTHER PLACEMENT than topo's"),
    ):
        cell = {"core_round_trip_ns": readings, "core_round_trip_cpus": [0, 1], "speedup_rounds": [1.2, 1.2]}
        text = bench_command.format_validation([{**row, **bench._placement_against_calibration(cell, profile)}])
        assert f"(topo's 54-57): {where}" in text, text


def test_rounds_without_readings_leave_a_cells_placement_unknown():
    def cell(readings):
        c = {
            "batch_size": 64,
            "ranks": 2,
            "step_seconds": [1e-3],
            "breakdown_ms": {"forward": 1.0},
            "peak_memory_bytes": 1,
        }
        return {**c, "core_round_trip_ns": readings, "core_round_trip_cpus": [0, 1]} if readings else c

    merged = bench.merge_rounds([[cell([55.0, 56.0])], [cell(None)]])
    assert "core_round_trip_ns" not in merged[0] and "core_round_trip_cpus" not in merged[0]
    merged = bench.merge_rounds([[cell([55.0, 56.0])], [cell([330.0, 331.0])]])
    assert merged[0]["core_round_trip_ns"] == [55.0, 56.0, 330.0, 331.0]


def test_a_batch_whose_base_was_not_priced_is_not_scored(monkeypatch):
    """A 1-rank cell at another thread count than the calibration's is not priced; its
    2-rank cell's speedup is measured against it, so neither its error nor the pick count."""
    import types

    monkeypatch.setattr(bench, "recommend", lambda **kw: {"strategy": "multi_gpu", "devices": 2})
    why = "calibrated at 1 thread(s) per rank, measured at 2 (bench --threads 1)"

    def row(ranks, **extra):
        return {
            "layers": [8, 8],
            "batch_size": 64,
            "ranks": ranks,
            "step": {"median": 1e-3 / ranks},
            "breakdown_ms": {"comm_wait": 0.0},
            "speedup": float(ranks),
            **extra,
        }

    rows = [row(1, prediction_error=why), row(2, predicted_speedup=1.9, predicted_step_ms=0.5)]
    a = types.SimpleNamespace(
        optimizer="sgd", precision="fp32", grad_dtype="fp32", cuda_graph="off", accumulate=1, shard_optimizer=False
    )
    (v,) = bench.validate_selector(rows, {}, a)
    assert v["not_priced"] == why and v["picked_faster"] is None
    assert v["predicted_speedup"] is None and v["relative_error"] is None
    assert "not scored" in bench_command.format_validation([v])
    # priced on both sides: scored as before
    rows[0] = row(1, predicted_step_ms=1.0)
    (v,) = bench.validate_selector(rows, {}, a)
    assert v["not_priced"] is None and v["picked_faster"] is True and v["relative_error"] == pytest.approx(-0.05)


def test_a_speedup_is_the_median_of_its_paired_rounds():
    rows = [_row(1, 1, [1.0, 1.0, 1.0]), _row(2, 1, [0.5, 0.5, 5.0])]  # a stalled round: 0.2x
    bench.add_derived(rows, None)
    assert rows[1]["speedup_rounds"] == pytest.approx([2.0, 2.0, 0.2]) and rows[1]["speedup"] == pytest.approx(2.0)


def test_the_fastest_cell_is_judged_by_the_paired_speedup_and_a_wrong_pick_says_so(monkeypatch):
    """Rounds paired with 1 rank's say 2 ranks are faster, though their pooled samples/s
    (a slow round among them) say otherwise: the printed speedup's measure decides."""
    import types

    monkeypatch.setattr(bench, "recommend", lambda **kw: {"strategy": "single_gpu", "devices": 1})
    a = types.SimpleNamespace(
        optimizer="sgd", precision="fp32", grad_dtype="fp32", cuda_graph="off", accumulate=1, shard_optimizer=False
    )
    rows = [
        {
            "layers": [8, 8],
            "batch_size": 64,
            "ranks": n,
            "step": {"median": 1e-3},
            "breakdown_ms": {"comm_wait": 0.0},
            "samples_per_sec": sps,
            "speedup": s,
            "predicted_speedup": 1.0,
            "predicted_step_ms": 1.0,
        }
        for n, sps, s in ((1, 1000.0, 1.0), (2, 900.0, 1.3))
    ]
    (v,) = bench.validate_selector(rows, {}, a)
    assert v["measured_fastest"] == 2 and v["picked_faster"] is False
    assert "WRONG" in bench_command.format_validation([v])


def test_a_gpu_cell_is_priced_whatever_the_threads_a_cpu_calibration_ran():
    gpu = {"devices": [{"kind": "cuda"}], "environment": {"threads_per_rank": 1}}
    assert bench._cannot_price({"device": "cuda", "ranks": 1, "threads": 8}, gpu) is None
    cpu = {"devices": [{"kind": "cpu"}], "environment": {"threads_per_rank": 1}}
    assert "measured at 8" in bench._cannot_price({"device": "cpu", "ranks": 1, "threads": 8}, cpu)
    assert "describes cuda devices, this cell ran on cpu" in bench._cannot_price(
        {"device": "cpu", "ranks": 1, "threads": 1}, gpu
    )
