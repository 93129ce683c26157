"""The advisor checks itself (issue 42): a run's own prediction from the calibration, held
against its steady-state steps (StepTimes), the warning that names the phase that differs
most, and bench --validate-selector's scores over a grid."""

import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

import mgpu
from mgpu.calibrate.bench import DECISION_TOLERANCE, score_validation
from mgpu.commands.bench import format_predictions
from mgpu.commands.train import checked_prediction
from mgpu.selector import history, profiles, run_check
from mgpu.selector import intervals as iv
from mgpu.selector.recommend import recommend
from mgpu.selector.tuning import calibration_for
from mgpu.train.config import TrainConfig
from mgpu.train.step_times import PHASES, StepTimes

SIZES = [32, 256, 256, 4]


def timings(forward=1e-3, backward=2e-3, comm_wait=5e-4, optimizer=2e-4):
    return SimpleNamespace(forward=forward, backward=backward, comm_wait=comm_wait, optimizer=optimizer)


def cpu_profile(threads=1, devices=2, layer_scale=1.0):
    """A calibrated CPU profile whose layers take `layer_scale` x what a 20 GFLOP/s core takes."""
    device = {
        "name": "test cpu",
        "kind": "cpu",
        "fp32": {"peak_flops": 20e9 / layer_scale, "half_work_flops": 0.0},
        "memory_bytes": 16e9,
        "memory_bandwidth": 10e9 / layer_scale,
        "launch_overhead_s": 0.0,
    }
    return {
        "format": "mgpu-hardware-profile",
        "version": 1,
        "name": "calibrated: test",
        "source": "calibrated",
        "devices": [device] * devices,
        "link": {"name": "test", "alpha_s": 1e-6, "bus_bandwidth": 5e9, "overlaps_compute": False},
        "step_overhead_s": 1e-5,
        "error_model": {"compute": [-0.1, 0.1], "comm": [-0.2, 0.3], "compute_shared": False, "source": "test"},
        "environment": {"threads_per_rank": threads, "world_size": devices},
    }


def write(tmp_path, profile) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    return str(path)


def config(**kw):
    return TrainConfig(batch_size=128, steps=10, **kw).validate(2)


def test_step_times_leaves_out_the_warm_up_and_keeps_the_newest():
    t = StepTimes(warmup=3, keep=4)
    for _ in range(3):
        t.add(100.0, timings(forward=100.0))  # the warm-up: never counted
    assert t.steady_steps == 0 and t.medians(least=1) is None
    for s in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        t.add(s, timings(forward=s / 10))
    m = t.medians(least=4)
    assert t.seen == 9 and t.steady_steps == 4 and m["steps"] == 4
    assert m["step"] == pytest.approx(4.5) and m["forward"] == pytest.approx(0.45)  # 3..6: the newest 4
    assert set(m) == {"step", "steps", *PHASES}
    assert t.medians(least=5) is None
    with pytest.raises(ValueError):
        StepTimes(warmup=-1)


def test_no_calibration_no_prediction(tmp_path):
    p = run_check.predict_run(config(), 2, SIZES, "cpu", 1, path=str(tmp_path / "none.json"))
    assert p == {"available": False, "reason": p["reason"]} and "no calibration" in p["reason"]
    check = run_check.check_run(p, {"step": 1e-3, "steps": 10}, phases_timed=True)
    assert check == p
    assert run_check.format_check(check).startswith("prediction: none (no calibration of this machine")


@pytest.mark.parametrize(
    "profile, ranks, device, threads, why",
    [
        (cpu_profile(threads=2), 2, "cpu", 1, "2 thread(s) per rank, this run uses 1"),
        (cpu_profile(devices=1), 2, "cpu", 1, "1 device(s), this job 2 ranks"),
        (cpu_profile(), 2, "cuda", 1, "measured cpu devices, this job runs on cuda"),
    ],
)
def test_a_calibration_that_cannot_describe_the_run_says_why(tmp_path, profile, ranks, device, threads, why):
    p = run_check.predict_run(config(), ranks, SIZES, device, threads, path=write(tmp_path, profile))
    assert p["available"] is False and why in p["reason"], p


def gpu_profile(communicator="nccl", devices=2):
    """A calibrated profile of `devices` GPUs whose allreduce was measured over `communicator`."""
    device = {
        "name": "test gpu",
        "kind": "cuda",
        "fp32": {"peak_flops": 20e12, "half_work_flops": 0.0},
        "memory_bytes": 80e9,
        "memory_bandwidth": 2e12,
        "launch_overhead_s": 5e-6,
    }
    link = {"name": communicator, "alpha_s": 1e-5, "bus_bandwidth": 50e9, "overlaps_compute": communicator == "nccl"}
    return {
        **cpu_profile(devices=devices),
        "devices": [device] * devices,
        "link": link,
        "environment": {"world_size": devices, "communicator": communicator},
    }


@pytest.mark.parametrize("calibrated, comm", [("nccl", "mpi"), ("mpi", "auto"), ("mpi", "nccl")])
def test_a_calibration_of_another_communicator_is_no_prediction(tmp_path, calibrated, comm):
    # NCCL's link says nothing of MPI staged through the host, nor the reverse
    path = write(tmp_path, gpu_profile(calibrated))
    p = run_check.predict_run(config(comm=comm), 2, SIZES, "cuda", 1, path=path)
    used = "MPI" if comm == "mpi" else "NCCL"
    assert p["available"] is False, p
    assert f"measured the {calibrated.upper()} communicator, this job reduces over {used}" in p["reason"], p
    assert f"topo --device cuda --comm {used.lower()}" in p["reason"]
    matching = "mpi" if calibrated == "mpi" else "auto"  # the communicator calibrated prices
    assert run_check.predict_run(config(comm=matching), 2, SIZES, "cuda", 1, path=path)["available"]
    # one rank reduces nothing: any calibration of the device prices it
    assert run_check.predict_run(config(comm=comm), 1, SIZES, "cuda", 1, path=path)["available"]


def test_a_run_whose_training_set_stayed_on_the_host_is_checked_against_that_step(tmp_path, monkeypatch):
    # --data-on-device auto on a GPU is priced resident; where the set did not fit (or its
    # placement failed) the check prices the step that ran: rows copied from the host
    profile = gpu_profile(devices=1)
    profile["devices"][0]["host_to_device_bandwidth"] = 2e9
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "mgpu").mkdir()
    (tmp_path / "mgpu" / "profile.json").write_text(json.dumps(profile))
    cfg = dataclasses.replace(config(), bucket_mb=4.0)
    priced = run_check.predict_run(cfg, 1, SIZES, "cuda", 1)
    assert priced["available"] and priced["data_on_device"] is True
    plan = SimpleNamespace(
        prediction=priced, config=cfg, device="cuda", sizes=tuple(SIZES), threads=1, batch_shares=None
    )

    def trainer(resident, root=True):
        return SimpleNamespace(
            pg=SimpleNamespace(is_root=root, size=1),
            data_placement={"resident": resident, "bytes": 0, "why": "test"},
            config=SimpleNamespace(timed=False),
            step_times=SimpleNamespace(medians=lambda: None),
        )

    assert checked_prediction(plan, trainer(True))["predicted_step_ms"] == priced["predicted_step_ms"]
    moved = checked_prediction(plan, trainer(False))
    assert moved["data_on_device"] is False and moved["predicted_step_ms"] > priced["predicted_step_ms"]
    assert checked_prediction(plan, trainer(False, root=False))["data_on_device"] is True  # rank 0 speaks


def test_a_malformed_calibration_is_no_prediction_not_an_error(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text("{not json")
    p = run_check.predict_run(config(), 2, SIZES, "cpu", 1, path=str(path))
    assert p["available"] is False and "cannot be read" in p["reason"]


def test_the_prediction_carries_its_interval_and_phases(tmp_path):
    p = run_check.predict_run(config(), 2, SIZES, "cpu", 1, path=write(tmp_path, cpu_profile()))
    assert p["available"] and p["profile"] == "calibrated: test" and p["intervals_from"] == "test"
    low, high = p["interval_ms"]
    assert 0 < low < p["predicted_step_ms"] < high
    assert set(p["phases_ms"]) == {"forward", "backward", "comm_wait", "optimizer", "overhead"}
    assert sum(p["phases_ms"].values()) == pytest.approx(p["predicted_step_ms"], rel=1e-6)
    assert p["batch_shares"] == [64, 64] and p["overlap"] is True
    # one rank of a 2-device calibration: no communication
    one = run_check.predict_run(config(), 1, SIZES, "cpu", 1, path=write(tmp_path, cpu_profile()))
    assert one["phases_ms"]["comm_wait"] == 0 and one["predicted_step_ms"] > p["predicted_step_ms"]


def test_the_prediction_prices_the_runs_own_batch_shares(tmp_path):
    """--batch-shares 0.9,0.1: the rank with 90 % of the batch sets the step, as it does in the run."""
    path = write(tmp_path, cpu_profile())
    even = run_check.predict_run(config(), 2, SIZES, "cpu", 1, path=path)
    uneven = run_check.predict_run(config(), 2, SIZES, "cpu", 1, batch_shares=[0.9, 0.1], path=path)
    assert uneven["batch_shares"] == [115, 13]  # split_counts' largest remainder
    assert uneven["phases_ms"]["forward"] > 1.5 * even["phases_ms"]["forward"]
    assert uneven["predicted_step_ms"] > even["predicted_step_ms"]
    one = run_check.predict_run(config(), 2, SIZES, "cpu", 1, batch_shares=[1, 0], path=path)
    assert one["batch_shares"] == [128, 0]


def test_without_overlap_the_whole_allreduce_is_exposed(tmp_path):
    """--no-overlap: one allreduce of the gradient after backward, nothing of it hidden."""
    prof = cpu_profile()
    prof["link"]["overlaps_compute"] = True  # a link that progresses during backward
    path = write(tmp_path, prof)
    overlapped = run_check.predict_run(config(bucket_mb=0.05), 2, SIZES, "cpu", 1, path=path)
    after = run_check.predict_run(config(bucket_mb=0.05, overlap=False), 2, SIZES, "cpu", 1, path=path)
    assert overlapped["overlap"] is True and after["overlap"] is False
    assert after["phases_ms"]["comm_wait"] > overlapped["phases_ms"]["comm_wait"]
    assert after["predicted_step_ms"] > overlapped["predicted_step_ms"]
    # the core's schedule: the same buckets, every one after compute; sharded, one
    # reduce-scatter of the whole gradient (one latency instead of one a bucket)
    hw = profiles.to_core(prof, 2)
    w = run_check.run_workload(config(), SIZES, 0.05)
    on, off = profiles.P.Options(), profiles.P.Options()
    off.overlap = False
    p_on, p_off = profiles.P.predict(w, hw, 2, on), profiles.P.predict(w, hw, 2, off)
    assert p_off.comm_s == pytest.approx(p_on.comm_s) and p_off.bucket_elems == p_on.bucket_elems
    assert p_off.exposed_comm_s == pytest.approx(p_off.comm_s) and p_on.exposed_comm_s < p_on.comm_s
    sharded = run_check.run_workload(config(shard_optimizer=True), SIZES, 0.05)
    s_on, s_off = profiles.P.predict(sharded, hw, 2, on), profiles.P.predict(sharded, hw, 2, off)
    assert s_off.bucket_elems > s_on.bucket_elems and s_off.comm_s < s_on.comm_s
    bad = profiles.P.Options()
    bad.share_weights = [1.0, 2.0, 3.0]
    with pytest.raises(mgpu.ConfigError, match="batch shares: need 2"):
        profiles.P.predict(w, hw, 2, bad)


def prediction(step=10.0, low=8.0, high=12.0, **phases):
    ms = {"forward": 3.0, "backward": 5.0, "comm_wait": 1.5, "optimizer": 0.4, "overhead": 0.1, **phases}
    return {
        "available": True,
        "profile": "calibrated: test",
        "predicted_step_ms": step,
        "interval_ms": [low, high],
        "phases_ms": ms,
    }


def measured(step, forward=3e-3, backward=5e-3, comm_wait=1.5e-3, optimizer=0.4e-3, steps=50):
    return {
        "step": step,
        "forward": forward,
        "backward": backward,
        "comm_wait": comm_wait,
        "optimizer": optimizer,
        "steps": steps,
    }


def test_a_measurement_inside_the_interval_is_said_and_not_warned():
    check = run_check.check_run(prediction(), measured(11e-3), phases_timed=True)
    assert check["inside"] and check["warning"] is None
    assert check["error"] == pytest.approx(10 / 11 - 1) and check["measured_steps"] == 50
    line = run_check.format_check(check)
    assert "10 ms a step (80% interval 8-12 ms" in line and "measured 11 ms" in line
    assert "predicted -9%, inside the interval" in line


@pytest.mark.parametrize(
    "phase, value, advice",
    [
        ("comm_wait", 9e-3, "a straggler rank"),
        ("comm_wait", 0.0, "shorter than calibrated"),
        ("backward", 15e-3, "computes slower than when it was calibrated"),
        ("forward", 0.1e-3, "computes faster than its calibration says"),
        ("other", 10e-3, "the data feed, the Python loop"),
    ],
)
def test_outside_the_interval_the_warning_names_the_phase_that_differs_most(phase, value, advice):
    # steps whose timed phases and the time outside them add up (as measured steps' do)
    phases = {k: v for k, v in measured(0.0).items() if k not in ("step", "steps")}
    if phase != "other":
        phases[phase] = value
    step = sum(phases.values()) + (value if phase == "other" else 0.1e-3)
    expected = prediction(low=9.0)  # 8-12 ms would hold the step without its wait (8.5 ms)
    check = run_check.check_run(expected, measured(step, **phases), phases_timed=True)
    assert not check["inside"] and check["differs_most"] == phase
    assert check["measured_phases_ms"]["other"] == pytest.approx((step - sum(phases.values())) * 1e3)
    name = "the time outside the timed phases" if phase == "other" else phase
    assert f"{name} differs most" in check["warning"] and advice in check["warning"]
    assert "outside the prediction's 80% interval (9-12 ms" in check["warning"]
    assert "OUTSIDE the interval" in run_check.format_check(check)


def test_one_ranks_wait_is_held_against_the_update_the_model_prices_it_in():
    """On one rank the model prices the wait after backward (the health check) in the
    update; the trainer times it as the wait: compared as the model splits the step."""
    one = {**prediction(step=10.0, low=9.5, high=10.5, comm_wait=0.0, optimizer=1.9), "ranks": 1}
    check = run_check.check_run(one, measured(11.5e-3, comm_wait=1.5e-3, optimizer=0.4e-3, backward=6.5e-3), True)
    assert check["measured_phases_ms"]["comm_wait"] == 0 and check["measured_phases_ms"]["optimizer"] == pytest.approx(
        1.9
    )
    assert check["differs_most"] == "backward"


def test_untimed_device_steps_warn_without_naming_a_phase():
    check = run_check.check_run(prediction(), measured(30e-3), phases_timed=False)
    assert "differs_most" not in check and "measured_phases_ms" not in check
    assert "--log-json" in check["warning"] and "slower than when it was calibrated" in check["warning"]


def test_too_few_steps_say_so():
    check = run_check.check_run(prediction(), None, phases_timed=True)
    assert check["measured_step_ms"] is None and "too few steps" in run_check.format_check(check)


def test_a_calibration_whose_compute_is_wrong_warns_on_a_compute_phase(tmp_path):
    # calibrated as 4x faster than the steps run: the measured forward and backward differ most
    slow = run_check.predict_run(config(), 2, SIZES, "cpu", 1, path=write(tmp_path, cpu_profile()))
    fast = run_check.predict_run(config(), 2, SIZES, "cpu", 1, path=write(tmp_path, cpu_profile(layer_scale=0.25)))
    truth = {k: v / 1e3 for k, v in slow["phases_ms"].items()}
    check = run_check.check_run(fast, {**truth, "step": slow["predicted_step_ms"] / 1e3, "steps": 20}, True)
    assert not check["inside"] and check["differs_most"] in ("forward", "backward")
    assert "computes slower" in check["warning"]


def cell(batch, ranks, step_ms, predicted_ms, low, high, speedup=None, why=None):
    row = {"batch_size": batch, "ranks": ranks, "step": {"median": step_ms / 1e3}}
    if why:
        row["prediction_error"] = why
    else:
        row.update(predicted_step_ms=predicted_ms, inside_interval=low <= step_ms <= high)
    return row


def verdict(batch, ranks, measured_speedup, strategy, devices):
    return {
        "batch_size": batch,
        "ranks": ranks,
        "measured_speedup": measured_speedup,
        "selector_strategy": strategy,
        "selector_devices": devices,
    }


def test_scores_error_coverage_and_decisions():
    rows = [
        cell(64, 1, 10.0, 11.0, 9, 12),  # +10 %, inside
        cell(64, 2, 12.0, 10.0, 9, 11),  # -17 %, outside
        cell(256, 1, 40.0, 40.0, 35, 45),  # 0 %, inside
        cell(256, 2, 25.0, 24.0, 20, 26),  # -4 %, inside
        cell(1024, 1, 100.0, 90.0, 85, 99),  # -10 %, outside
        cell(1024, 2, 55.0, 50.0, 45, 60),  # -9 %, inside
    ]
    validation = [
        verdict(64, 2, 0.83, "single_gpu", 1),  # right: one is faster
        verdict(256, 2, 1.6, "benchmark_required", 2),  # wrong: 1.6x is not within 5 %
        verdict(1024, 2, 1.82, "multi_gpu", 2),  # right
    ]
    s = score_validation(rows, validation)
    errors = [0.1, 10 / 12 - 1, 0.0, 24 / 25 - 1, -0.1, 50 / 55 - 1]
    assert s["cells"] == 6 and s["unpriced"] == []
    assert s["median_abs_error"] == pytest.approx(np.median(np.abs(errors)))
    assert s["p90_abs_error"] == pytest.approx(np.percentile(np.abs(errors), 90))
    assert s["coverage"] == pytest.approx(4 / 6)
    assert [d["right"] for d in s["decisions"]] == [True, False, True]
    assert s["decision_accuracy"] == pytest.approx(2 / 3) and s["benchmark_required_share"] == pytest.approx(1 / 3)


def test_a_benchmark_required_is_right_only_where_the_candidates_measured_alike():
    rows = [cell(64, 1, 10.0, 10.0, 9, 11), cell(64, 2, 10.2, 10.0, 9, 11)]
    near = DECISION_TOLERANCE + (1 - DECISION_TOLERANCE) / 2  # within the tolerance of the best
    s = score_validation(rows, [verdict(64, 2, near, "benchmark_required", 1)])
    assert s["decisions"] == [{"layers": [], "batch_size": 64, "benchmark_required": True, "right": True}]
    # a pick just inside the tolerance of the best is right; one beyond it is not
    s = score_validation(rows, [verdict(64, 2, 1 / near, "single_gpu", 1)])
    assert s["decisions"][0]["right"] is True
    s = score_validation(rows, [verdict(64, 2, 1.2, "single_gpu", 1)])
    assert s["decisions"][0]["right"] is False


@pytest.mark.parametrize("share, right", [(0.93, False), (0.96, True)])
def test_a_pick_is_right_within_five_percent_of_the_best(share, right):
    # the rule in figures: one device picked where two measured 1/share x faster
    rows = [cell(64, 1, 10.0, 10.0, 9, 11), cell(64, 2, 10.0 * share, 10.0, 9, 11)]
    assert score_validation(rows, [verdict(64, 2, 1 / share, "single_gpu", 1)])["decisions"][0]["right"] is right


def test_a_pick_of_a_device_count_not_measured_is_wrong():
    rows = [cell(64, 1, 10.0, 10.0, 9, 11), cell(64, 2, 10.0, 10.0, 9, 11)]
    s = score_validation(rows, [verdict(64, 2, 1.0, "multi_gpu", 4)])
    assert s["decisions"][0]["right"] is False


def test_unpriced_cells_are_listed_and_their_batches_not_judged():
    why = "calibrated at 1 thread(s) per rank, measured at 2 (bench --threads 1)"
    rows = [cell(64, 1, 10.0, 0, 0, 0, why=why), cell(64, 2, 8.0, 7.5, 7, 9)]
    s = score_validation(rows, [verdict(64, 2, 1.25, "multi_gpu", 2)])
    assert s["cells"] == 1 and s["coverage"] == 1.0 and "decisions" not in s
    assert s["unpriced"] == [{"batch_size": 64, "ranks": 1, "why": why}]
    assert math.isclose(s["median_abs_error"], abs(7.5 / 8 - 1))


def test_the_calibration_for_a_job_says_why_not_where_it_cannot_describe_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    profile, why = calibration_for(2, "cpu")
    assert profile is None and "no calibration of this machine" in why
    (tmp_path / "mgpu").mkdir()
    (tmp_path / "mgpu" / "profile.json").write_text(json.dumps(cpu_profile()))
    profile, why = calibration_for(2, "cpu")
    assert why is None and profile["name"] == "calibrated: test"
    assert calibration_for(4, "cpu")[1] == "the calibration has 2 device(s), this job 4 ranks"
    assert "this job runs on cuda" in calibration_for(2, "cuda")[1]


def test_bench_prints_each_cells_prediction_beside_its_measurement():
    rows = [
        {**cell(64, 1, 10.0, 9.0, 8.5, 9.5), "threads": 1, "device": "cpu", "predicted_step_interval_ms": [8.5, 9.5]},
        {
            **cell(64, 2, 6.0, 0, 0, 0, why="calibrated at 1 thread(s) per rank, measured at 2"),
            "threads": 2,
            "device": "cpu",
        },
    ]
    text = format_predictions(rows).splitlines()
    assert "predicted (80% interval)" in text[0]
    assert "9 (8.5-9.5)" in text[1] and "-10%" in text[1] and text[1].endswith("OUTSIDE")
    assert text[2].endswith("calibrated at 1 thread(s) per rank, measured at 2")


def test_bench_holds_each_cell_as_train_holds_its_run(capfd):
    """add_derived gives every cell train's prediction object: priced cells checked against
    their timed phases (a cell far off warns, naming the phase), unpriced ones say why."""
    from mgpu.calibrate.bench import add_derived

    def row(ranks, threads, step_ms, backward_ms):
        phases = {"forward": 0.05, "backward": backward_ms, "comm_wait": 0.0, "optimizer": 0.01}
        return {
            "layers": SIZES,
            "batch_size": 128,
            "ranks": ranks,
            "threads": threads,
            "device": "cpu",
            "samples_per_sec": 128 / step_ms * 1e3,
            "step": {"median": step_ms / 1e3},
            "step_seconds": [step_ms / 1e3] * 7,
            "breakdown_ms": phases,
        }

    profile = cpu_profile()
    rows = [row(1, 1, 0.2, 0.1), row(1, 2, 0.2, 0.1)]
    add_derived(rows, profile)
    priced, unpriced = rows[0]["prediction"], rows[1]["prediction"]
    assert unpriced == {"available": False, "reason": rows[1]["prediction_error"]}
    assert priced["available"] and priced["measured_steps"] == 7
    assert priced["predicted_step_ms"] == pytest.approx(rows[0]["predicted_step_ms"])
    assert priced["interval_ms"] == pytest.approx(rows[0]["predicted_step_interval_ms"])
    assert priced["inside"] is rows[0]["inside_interval"]
    one = {
        **row(1, 1, 0.2, 0.1),
        "breakdown_ms": {"forward": 0.05, "backward": 0.1, "comm_wait": 0.03, "optimizer": 0.01},
    }
    add_derived([one], profile)  # one rank's wait is held against the update, where the model prices it
    assert one["prediction"]["measured_phases_ms"]["comm_wait"] == 0
    assert one["prediction"]["measured_phases_ms"]["optimizer"] == pytest.approx(0.04)
    slow = [row(1, 1, 50.0, 49.0)]  # backward 50x what a 20 GFLOP/s core takes
    add_derived(slow, profile)
    check = slow[0]["prediction"]
    assert not check["inside"] and check["differs_most"] == "backward"
    assert "backward differs most" in check["warning"] and "mgpu topo" in check["warning"]
    assert "cores sat elsewhere" not in check["warning"]
    # a 2-rank cell read with the cores elsewhere than topo's probe of the wait: said as the cause
    placed = {**profile, "placement": {"cpus": [0, 1], "readings_ns": [60.0, 330.0], "wait_probe_ns": [60.0, 62.0]}}
    for ns, said in (([330.0, 325.0], True), ([61.0, 63.0], False)):
        cell = {**row(2, 1, 50.0, 49.0), "core_round_trip_ns": ns, "core_round_trip_cpus": [0, 1]}
        add_derived([cell], placed)
        warning = cell["prediction"]["warning"]
        cause = "the ranks' cores sat elsewhere than where `topo` probed the wait"
        assert (f"{cause} (a cache line's round trip 325-330 ns, topo's 60-62)" in warning) is said


def test_grids_of_several_models_are_judged_per_model_and_batch():
    small, large = [50, 64, 3], [50, 1024, 3]
    rows = [
        {**cell(64, 1, 10.0, 10.0, 9, 11), "layers": small},
        {**cell(64, 2, 12.0, 12.0, 11, 13), "layers": small},
        {**cell(64, 1, 50.0, 50.0, 45, 55), "layers": large},
        {**cell(64, 2, 30.0, 30.0, 27, 33), "layers": large},
    ]
    validation = [
        {**verdict(64, 2, 0.83, "single_gpu", 1), "layers": small},
        {**verdict(64, 2, 1.67, "single_gpu", 1), "layers": large},
    ]
    s = score_validation(rows, validation)
    assert [(d["layers"], d["right"]) for d in s["decisions"]] == [(small, True), (large, False)]


def held_out_profile(created="2026-11-28T10:00:00+0000"):
    """A calibration with two held-out checks (measured and predicted seconds)."""
    checks = [
        {"alone_s": 1.05, "alone_predicted_s": 1.0, "together_s": 0.6, "together_predicted_s": 0.5},
        {"alone_s": 0.95, "alone_predicted_s": 1.0, "together_s": 0.5, "together_predicted_s": 0.5},
    ]
    return {**cpu_profile(), "created": created, "held_out_steps": checks}


def test_the_error_model_is_the_held_out_steps_bands():
    m = history.error_model(held_out_profile())
    # checks without their workload: each its own, its offset taken either way (intervals.workload_band)
    assert m["compute"] == pytest.approx(iv.workload_band([[math.log(1.05)], [math.log(0.95)]]))
    assert m["compute"] == pytest.approx([math.log(0.95), -math.log(0.95)])
    assert m["compute_together"] == m["comm"] == pytest.approx([-math.log(1.2), math.log(1.2)])
    speedups = [math.log((1.05 / 0.6) / (1.0 / 0.5)), math.log((0.95 / 0.5) / (1.0 / 0.5))]
    assert m["speedup"] == pytest.approx([-max(map(abs, speedups)), max(map(abs, speedups))])
    assert m["compute_shared"] is False and m["step_bands"] is True
    assert m["source"].startswith("2 held-out steps at calibration alone and on 2")


def test_a_workloads_repeats_are_one_offset_and_their_scatter():
    # the same MLP at the start and at the end of topo: one workload, the drift between its two
    # steps its scatter; two MLPs: two offsets
    profile = held_out_profile()
    a, b = ({"layers": [8, 64, 2], "batch": 64, "dropout": 0.1}, {"layers": [16, 128, 4], "batch": 64, "dropout": 0.1})
    ratios = [(a, 1.10), (b, 0.98), (a, 1.14), (b, 1.00)]
    profile["held_out_steps"] = [
        {**w, "alone_s": r, "alone_predicted_s": 1.0, "together_s": 0.5 * r, "together_predicted_s": 0.5}
        for w, r in ratios
    ]
    m = history.error_model(profile)
    by_workload = [[math.log(1.10), math.log(1.14)], [math.log(0.98), math.log(1.00)]]
    assert m["compute"] == pytest.approx(iv.workload_band(by_workload)) and m["comm"] == pytest.approx(m["compute"])
    assert m["compute"] != pytest.approx(iv.workload_band([[math.log(r)] for _, r in ratios]))


def test_the_record_widens_its_calibrations_bands_and_no_other(tmp_path):
    profile = held_out_profile()
    path = write(tmp_path, profile)
    narrow = history.error_model(profile)
    for ratio in (1.3, 1.4, 0.7):  # this machine's runs since: slower and faster than predicted
        history.append(path, profile["created"], 1, ratio, 1.0, "train", ratio < 1)
        history.append(path, profile["created"], 2, ratio, 1.0, "bench", False, 1.2, 2.0)
    history.append(path, "another calibration", 1, 9.0, 1.0, "train", False)
    history.append(path, profile["created"], 1, 30.0, 1.0, "train", False)  # a stall, not the step priced
    history.append(path, profile["created"], 2, 1.0, 1.0, "bench", True, 1.0, 40.0)
    with open(history.record_path(path), "a") as f:
        f.write('not a record\n{"calibration": 1}\n')
        for devices in (-3, 0, True):  # no device count a step ran on
            rec = {"calibration": profile["created"], "devices": devices, "log_ratio": 0.1, "what": "train"}
            f.write(json.dumps(rec) + "\n")
    records = history.read(path, profile["created"])
    assert len(records) == 6 and {r["what"] for r in records} == {"train", "bench"}
    wide = history.error_model(profile, records)
    assert wide["compute"][0] < narrow["compute"][0] and wide["compute"][1] > narrow["compute"][1]
    assert wide["speedup"][0] < narrow["speedup"][0]
    assert "and 6 priced steps of this machine's runs since" in wide["source"]
    # loading the calibration applies its record; the file itself is left as topo wrote it
    loaded = profiles.load_profile(path)
    assert loaded["error_model"] == wide and json.loads(open(path).read())["error_model"] == profile["error_model"]
    assert loaded["record"] == {"steps": 6, "judged": 6, "inside": 1}
    r = recommend(layers=SIZES, batch_size=128, devices=[1, 2], profile=loaded)
    assert r["record"]["inside"] == 1 and any("1 of 6 priced steps (17%)" in reason for reason in r["reasons"])


def test_held_out_steps_priced_by_an_older_model_are_priced_anew_on_load(tmp_path):
    # a calibration's bands compare its held-out steps with the model's predictions: after
    # an mgpu whose model prices them differently, the bands must be this model's
    profile = held_out_profile()
    for check, layers in zip(profile["held_out_steps"], ([8, 64, 2], [16, 128, 4])):
        check.update(layers=layers, batch=64, dropout=0.1)
    assert profiles.price_held_out_steps(profile)  # the hand-written predictions were not the model's
    current = [dict(c) for c in profile["held_out_steps"]]
    assert not profiles.price_held_out_steps(profile)  # priced by this model: nothing moves
    loaded = profiles.load_profile(write(tmp_path, profile))
    assert loaded["error_model"] == profile["error_model"]  # as topo wrote it
    for c in profile["held_out_steps"]:  # an older model's predictions
        c["alone_predicted_s"] *= 2
        c["together_predicted_s"] *= 0.5
    loaded = profiles.load_profile(write(tmp_path, profile))
    assert loaded["held_out_steps"] == current
    expected = history.error_model({**profile, "held_out_steps": current})
    assert loaded["error_model"]["compute"] == pytest.approx(expected["compute"])
    assert loaded["error_model"]["comm"] == pytest.approx(expected["comm"])
    assert loaded["error_model"]["source"].endswith("held-out steps re-priced by this mgpu's model")
    # checks without their workload (hand-made, or from before topo kept it) stay as written
    bare = held_out_profile()
    assert not profiles.price_held_out_steps(bare) and bare == held_out_profile()


def test_an_unwritable_record_leaves_the_run_alone(tmp_path):
    profile = held_out_profile()
    path = write(tmp_path, profile)
    (tmp_path / history.RECORD_NAME).mkdir()  # not a file: appending fails
    history.append(path, profile["created"], 1, 1.0, 1.0, "train", True)
    assert history.read(path, profile["created"]) == []
    history.append(path, profile["created"], 1, 0.0, 1.0, "train", True)  # nothing measured: nothing recorded


def test_train_records_its_checked_step(tmp_path):
    profile = held_out_profile()
    path = write(tmp_path, profile)
    p = run_check.predict_run(config(), 2, SIZES, "cpu", 1, path=path)
    assert p["calibration"] == path and p["calibration_created"] == profile["created"]
    check = run_check.check_run(p, measured(p["predicted_step_ms"] * 1.1e-3), phases_timed=True)
    run_check.record_run(check, 2)
    run_check.record_run(run_check.check_run(p, None, True), 2)  # unmeasured: not recorded
    (rec,) = history.read(path, profile["created"])
    assert rec["devices"] == 2 and rec["what"] == "train" and rec["log_ratio"] == pytest.approx(math.log(1.1))
    assert rec["inside"] == check["inside"]


def test_a_calibration_of_other_hardware_prices_the_run_and_says_so(tmp_path):
    """A calibration copied from another CPU (another model, or the same model name without
    AVX-512) still prices the run; the line and the warning say where it was measured, and
    its step stays out of the record, which is of this machine's calibration."""
    from mgpu.hostinfo import cpu_description
    from mgpu.selector.tuning import calibrated_elsewhere

    here = cpu_description()
    profile = held_out_profile()
    assert calibrated_elsewhere(profile, "cpu") is None  # no CPU recorded: nothing to hold against
    for d in profile["devices"]:
        d["cpu"] = dict(here)
    assert calibrated_elsewhere(profile, "cpu") is None
    for d in profile["devices"]:  # the same model name without an ISA extension (a Zen 3 VM beside a Zen 4)
        d["cpu"] = {**here, "isa": here["isa"][:-1]}
    assert calibrated_elsewhere(profile, "cpu").endswith(f"; with {here['isa'][-1]}")
    for d in profile["devices"]:
        d["cpu"] = {**here, "model": "Other CPU 9000", "isa": here["isa"] + ["avx512_fake"]}
    why = calibrated_elsewhere(profile, "cpu")
    assert (
        why.startswith(f"measured on Other CPU 9000, this machine has {here['model']}") and "without avx512_fake" in why
    )
    path = write(tmp_path, profile)
    p = run_check.predict_run(config(), 2, SIZES, "cpu", 1, path=path)
    assert p["available"] and p["calibrated_elsewhere"] == why
    check = run_check.check_run(p, measured(p["predicted_step_ms"] * 3e-3), phases_timed=True)
    assert why in run_check.format_check(check) and why in check["warning"] and "mgpu topo" in check["warning"]
    run_check.record_run(check, 2)
    assert history.read(path, profile["created"]) == []


def placed_profile(together, other_probe=None, first_probe=(60.0, 62.0)):
    """A calibration whose wait was probed with the ranks' cores at `first_probe` ns (and at
    `other_probe`), with held-out checks given as (together measured/predicted, round
    trips in ns or None)."""
    checks = []
    for ratio, readings in together:
        check = {"alone_s": 1.0, "alone_predicted_s": 1.0, "together_s": 0.5 * ratio, "together_predicted_s": 0.5}
        if readings is not None:
            check.update(together_round_trip_cpus=[0, 1], together_round_trip_ns=list(readings))
        checks.append(check)
    placement = {"cpus": [0, 1], "readings_ns": [60.0, 61.0], "samples_ns": [60.0], "wait_probe_ns": list(first_probe)}
    if other_probe is not None:
        placement.update(other_wait_probe_ns=list(other_probe), other_share=0.5)
    return {**held_out_profile(), "held_out_steps": checks, "placement": placement}


def test_multi_rank_steps_with_the_cores_where_the_wait_was_not_probed_leave_the_bands():
    # on a VM whose vCPUs change cache domains, a 2-rank held-out step measured across
    # domains (330 ns) is slower for the placement, not for the model's error
    near, far, moving = (61.0, 63.0), (330.0, 325.0), (61.0, 330.0)
    m = history.error_model(placed_profile([(1.0, near), (1.05, near), (1.35, far), (1.4, moving)]))
    assert m["comm"] == m["compute_together"] == pytest.approx([-math.log(1.05), math.log(1.05)])
    assert m["speedup"] == pytest.approx([-math.log(1.05), math.log(1.05)])
    assert m["placed_elsewhere"] == 2 and "2 multi-rank step(s) with the ranks' cores in a placement" in m["source"]
    # where the wait was probed in that placement too, a step there is one the model priced
    m = history.error_model(placed_profile([(1.0, near), (1.05, near), (1.35, far)], other_probe=(328.0, 331.0)))
    assert m["comm"][1] == pytest.approx(math.log(1.35)) and "placed_elsewhere" not in m
    # where it cannot be told (no readings, other CPUs, a first probe that moved) every step counts
    for profile in (
        placed_profile([(1.0, near), (1.35, None)]),
        placed_profile([(1.0, near), (1.35, far)], first_probe=(60.0, 330.0)),
    ):
        assert history.error_model(profile)["comm"][1] == pytest.approx(math.log(1.35))
    other_cpus = placed_profile([(1.0, near), (1.35, far)])
    other_cpus["held_out_steps"][1]["together_round_trip_cpus"] = [0, 2]
    assert history.error_model(other_cpus)["comm"][1] == pytest.approx(math.log(1.35))
    # every multi-rank step elsewhere: they are the only evidence of that machine's steps
    m = history.error_model(placed_profile([(1.3, far), (1.35, far)]))
    assert m["comm"][1] == pytest.approx(math.log(1.35)) and "placed_elsewhere" not in m


def test_a_run_met_in_another_placement_leaves_the_bands_and_widens_the_wait(tmp_path):
    profile = placed_profile([(1.0, (61.0, 63.0)), (1.05, (60.0, 62.0))])
    profile["error_model"] = history.error_model(profile)
    path = write(tmp_path, profile)
    assert not profiles.placement_moved_in(profiles.load_profile(path))
    history.append(path, profile["created"], 2, 1.02, 1.0, "bench", True, 1.9, 2.0, ([0, 1], [62.0, 64.0]))
    history.append(path, profile["created"], 2, 1.5, 1.0, "bench", False, 1.4, 2.0, ([0, 1], [330.0, 335.0]))
    history.append(path, profile["created"], 2, 1.5, 1.0, "bench", False, 1.4, 2.0, ([0, 1], ["x"]))  # not a record
    with open(history.record_path(path), "a") as f:
        f.write(json.dumps({**json.loads(open(history.record_path(path)).readline()), "round_trip_ns": [-1.0]}) + "\n")
    records = history.read(path, profile["created"])
    assert [r.get("round_trip_ns") for r in records] == [[62.0, 64.0], [330.0, 335.0]]
    loaded = profiles.load_profile(path)
    comm = loaded["error_model"]["comm"]
    assert comm[1] == pytest.approx(math.log(1.05)) and loaded["error_model"]["placed_elsewhere"] == 1
    # the cores were seen to move: a multi-rank step's wait joins its interval whole
    assert profiles.placement_moved_in(loaded)
    r = recommend(layers=SIZES, batch_size=128, devices=[1, 2], profile=loaded)
    assert any(
        reason.startswith("runs since the calibration met the ranks' cores in another") for reason in r["reasons"]
    )


def test_bands_wider_than_twice_the_model_are_said_to_be_a_guess(tmp_path):
    """A calibration whose model misses its own held-out steps by 4x (edited rates, say)
    carries intervals that wide: the run is inside them, and is told what they are worth."""
    narrow = run_check.predict_run(config(), 2, SIZES, "cpu", 1, path=write(tmp_path, cpu_profile()))
    assert narrow["unsure"] is None
    wide = cpu_profile()
    wide["error_model"]["compute"] = [math.log(0.25), math.log(4.0)]
    p = run_check.predict_run(config(), 2, SIZES, "cpu", 1, path=write(tmp_path, wide))
    assert "compute band spans x0.25 to x4 of the model" in p["unsure"] and "mgpu topo" in p["unsure"]
    r = recommend(
        layers=SIZES, batch_size=128, devices=[1, 2], profile=profiles.load_profile(str(tmp_path / "profile.json"))
    )
    assert p["unsure"] in r["reasons"] and r["confidence"] <= 0.5  # not "90 %" beside a guess
    sure = recommend(
        layers=SIZES, batch_size=128, devices=[1, 2], profile=profiles.load_profile(write(tmp_path, cpu_profile()))
    )
    assert sure["confidence"] > 0.5
    wide["error_model"]["compute"], wide["error_model"]["comm"] = [-0.1, 0.1], [-0.1, math.log(2.1)]
    p = run_check.predict_run(config(), 2, SIZES, "cpu", 1, path=write(tmp_path, wide))
    assert "communication band spans x0.9 to x2.1" in p["unsure"]


def test_placed_elsewhere_tells_only_what_the_readings_can_tell():
    placement = placed_profile([], other_probe=(328.0, 331.0))["placement"]
    step = lambda ns, cpus=(0, 1): {"together_round_trip_ns": list(ns), "together_round_trip_cpus": list(cpus)}
    assert not history.placed_elsewhere(step((61.0, 63.0)), placement)  # the first probe's placement
    assert not history.placed_elsewhere(step((330.0, 325.0)), placement)  # the second probe's
    assert history.placed_elsewhere(step((61.0, 330.0)), placement)  # moved during the step
    one_probe = placed_profile([])["placement"]
    assert history.placed_elsewhere(step((330.0, 325.0)), one_probe)
    assert not history.placed_elsewhere(step((330.0, 325.0), cpus=(0, 2)), one_probe)  # other CPUs: unknown
    assert not history.placed_elsewhere({}, one_probe) and not history.placed_elsewhere(step((330.0,)), None)
    moved_probe = placed_profile([], first_probe=(60.0, 330.0))["placement"]
    assert not history.placed_elsewhere(step((900.0, 910.0)), moved_probe)  # its own probe spanned a move
    record = {"round_trip_ns": [330.0, 325.0], "round_trip_cpus": [0, 1]}  # a bench record's readings
    assert history.placed_elsewhere(record, one_probe)


def test_steps_elsewhere_leave_the_bands_only_while_two_others_remain():
    near, far = (61.0, 63.0), (330.0, 325.0)
    # one step here and two elsewhere: too little to leave them out, every step counts
    m = history.error_model(placed_profile([(1.0, near), (1.35, far), (1.4, far)]))
    assert "placed_elsewhere" not in m and m["comm"][1] == pytest.approx(math.log(1.4))
    m = history.error_model(placed_profile([(1.0, near), (1.02, near), (1.35, far), (1.4, far)]))
    assert m["placed_elsewhere"] == 2 and m["comm"][1] < math.log(1.1)


def test_records_feed_the_bands_they_measured_and_no_other():
    profile = placed_profile([(1.0, (61.0, 63.0)), (1.02, (61.0, 62.0))])
    base = history.error_model(profile)
    rec = lambda devices, ratio, **kw: {"devices": devices, "log_ratio": math.log(ratio), **kw}
    # a 2-rank record widens the multi-rank bands, not the one-device compute band
    m = history.error_model(profile, [rec(2, 1.5), rec(2, 1.6)])
    assert m["compute"] == pytest.approx(base["compute"]) and m["comm"][1] > base["comm"][1]
    # a 2-rank record read in another placement is left out, its speedup too
    far = {"round_trip_ns": [330.0, 325.0], "round_trip_cpus": [0, 1]}
    m = history.error_model(profile, [rec(2, 1.5, speedup_log_ratio=math.log(0.5), **far)])
    assert m["speedup"] == pytest.approx(base["speedup"]) and m["placed_elsewhere"] == 1
    # held-out steps that differ only in dropout are two workloads, two offsets
    steps = [
        {"layers": [8, 8], "batch": 64, "dropout": d, "alone_s": r, "alone_predicted_s": 1.0}
        for d, r in ((0.0, 1.1), (0.0, 1.12), (0.1, 0.9), (0.1, 0.92))
    ]
    m = history.error_model({**held_out_profile(), "held_out_steps": steps})
    by_workload = [[math.log(1.1), math.log(1.12)], [math.log(0.9), math.log(0.92)]]
    assert m["compute"] == pytest.approx(iv.workload_band(by_workload))


@pytest.mark.parametrize(
    "line",
    [
        "3",
        "[1]",
        '{"devices": "2", "log_ratio": 0.1}',
        '{"devices": 2, "log_ratio": 0.1, "speedup_log_ratio": "x"}',
        '{"devices": 1, "log_ratio": -3.5}',  # 33x faster than priced: a mistake, not the model's error
        '{"devices": 2, "log_ratio": 0.1, "round_trip_cpus": [0, 1]}',  # CPUs without readings
        '{"devices": 2, "log_ratio": 0.1, "round_trip_cpus": [true, 1], "round_trip_ns": [60.0, 61.0]}',
    ],
)
def test_a_line_that_is_no_record_is_skipped_and_the_calibration_loads(tmp_path, line):
    profile = held_out_profile()
    path = write(tmp_path, profile)
    without = profiles.load_profile(path)["error_model"]
    text = line if not line.startswith("{") else json.dumps({**json.loads(line), "calibration": profile["created"]})
    with open(history.record_path(path), "w") as f:
        f.write(text + "\n")
    assert history.read(path, profile["created"]) == []
    assert profiles.load_profile(path)["error_model"] == without


def test_the_record_keeps_the_newest_of_its_calibration(tmp_path, monkeypatch):
    profile = held_out_profile()
    path = write(tmp_path, profile)
    monkeypatch.setattr(history, "KEEP", 2)
    for ratio in (1.1, 1.2, 1.3):
        history.append(path, profile["created"], 1, ratio, 1.0, "train", True)
    assert [r["log_ratio"] for r in history.read(path, profile["created"])] == pytest.approx(
        [math.log(1.2), math.log(1.3)]
    )
    with open(history.record_path(path), "a") as f:  # a record of no calibration's, or one without the field
        f.write('{"calibration": null, "devices": 1, "log_ratio": 0.1}\n{"devices": 1, "log_ratio": 0.1}\n')
    assert history.read(path, None) == []  # a calibration without a creation time has no record
    judged = history.summary([{"inside": True}, {"inside": "yes"}, {"inside": False}, {}])
    assert judged == {"steps": 4, "judged": 2, "inside": 1}


def test_a_named_profiles_check_stays_out_of_the_record(tmp_path):
    profile = held_out_profile()
    path = write(tmp_path, profile)
    p = run_check.predict_run(config(), 2, SIZES, "cpu", 1, path=path)
    check = run_check.check_run(p, measured(p["predicted_step_ms"] * 1e-3), phases_timed=True)
    run_check.record_run({**check, "profile_source": "named"}, 2)
    assert history.read(path, profile["created"]) == []


def test_a_gpu_run_is_priced_whatever_threads_its_calibration_recorded(tmp_path):
    gpus = {**profiles.named_profile("nvlink", 2), "environment": {"threads_per_rank": 1}}
    p = run_check.predict_run(config(), 2, SIZES, "cuda", 4, path=write(tmp_path, gpus))
    assert p["available"], p
    cpus = run_check.predict_run(config(), 2, SIZES, "cpu", 4, path=write(tmp_path, cpu_profile()))
    assert not cpus["available"] and "--threads 4" in cpus["reason"]


def test_a_wait_longer_than_its_allreduce_is_not_called_part_of_it():
    """The wait after backward holds the ranks' skew and the health check beside the
    allreduce: where it is the longer, the reason names it apart ("3.1 ms of it" of a 1.2 ms
    allreduce read as a contradiction)."""
    p = cpu_profile()
    for d in p["devices"]:
        d["step_phases"] = {
            "params": [1e4, 1e6],
            "update_s": [1e-5, 1e-4],
            "wait_s": [0.02, 0.02],
            "wait_spread_s": [0.0, 0.0],
            "ranks": 2,
        }
    r = recommend(layers=SIZES, batch_size=4096, devices=[1, 2], profile=p)
    two = r["candidates"][1]
    assert two["exposed_allreduce_ms"] > two["allreduce_ms"]
    (line,) = [x for x in r["reasons"] if "gradient allreduce takes" in x]
    assert "of it not hidden" not in line and "the wait after backward" in line
    plain = recommend(layers=SIZES, batch_size=4096, devices=[1, 2], profile=cpu_profile())
    (line,) = [x for x in plain["reasons"] if "gradient allreduce takes" in x]
    assert "of it not hidden behind backward" in line


def test_a_cpu_calibration_of_several_ranks_says_what_its_one_rank_candidate_is():
    """Calibrated as 2 ranks x 1 thread, the 1-rank candidate is 1 rank of 1 thread: a
    speedup against half the cores a 1-rank train would use, unless the answer says so."""
    r = recommend(layers=SIZES, batch_size=128, devices=[1, 2], profile=cpu_profile(threads=1, devices=2))
    (said,) = [x for x in r["reasons"] if x.startswith("CPU ranks are priced at the calibration's 1 thread")]
    assert "not one on all 2 of those cores" in said and "topo --threads 2" in said
    alone = recommend(layers=SIZES, batch_size=128, devices=[1], profile=cpu_profile(threads=2, devices=1))
    assert not [x for x in alone["reasons"] if x.startswith("CPU ranks are priced")]
