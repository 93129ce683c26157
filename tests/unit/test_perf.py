"""The performance model and strategy selector: formulas, limits and decisions
on synthetic hardware profiles whose right answer is known."""

import copy
import json
import math
import os
import re

import pytest

import mgpu
from mgpu.calibrate.bench import summarize
from mgpu.selector import costsheet, hardware, memory, workload
from mgpu.selector import profiles as perf
from mgpu.selector import recommend as selector_recommend

P = perf.P


def device(flops=1e12, memory=16e9, bandwidth=1e12, launch=0.0, name="dev", kind="cuda"):
    return {
        "name": name,
        "kind": kind,
        "fp32": {"peak_flops": flops, "half_work_flops": 0.0},
        "memory_bytes": memory,
        "memory_bandwidth": bandwidth,
        "launch_overhead_s": launch,
    }


def profile(devices, alpha=0.0, busbw=1e30, overlap=True, overhead=0.0, error=0.1, sync=0.0):
    return {
        "format": perf.PROFILE_FORMAT,
        "version": 1,
        "name": "test",
        "source": "calibrated",
        "devices": devices,
        "step_overhead_s": overhead,
        "model_error": error,
        "link": {
            "name": "test link",
            "alpha_s": alpha,
            "bus_bandwidth": busbw,
            "overlaps_compute": overlap,
            "step_sync_s": sync,
        },
    }


def predict(prof, n, layers=(1024, 4096, 4096, 10), batch=4096, optimizer="sgd"):
    w = workload.build_workload(None, list(layers), None, batch, "fp32", optimizer, 4.0)
    return P.predict(w, perf.to_core(prof), n, P.Options())


def test_ring_allreduce_formula():
    link = P.LinkProfile()
    link.alpha_s, link.bus_bandwidth = 1e-5, 1e10
    assert link.allreduce_seconds(1, 1e9) == 0.0
    assert link.allreduce_seconds(2, 1e9) == pytest.approx(2e-5 + 1e9 / 1e10)
    assert link.allreduce_seconds(4, 1e9) == pytest.approx(6e-5 + 1.5 * 1e9 / 1e10)


def test_gemm_rate_interpolates_measurements_and_clamps():
    g = P.GemmRate(100.0, 10.0)
    assert g.at(10.0) == pytest.approx(50.0) and g.at(1e9) == pytest.approx(100.0, rel=1e-6)
    g.measured = [(1e3, 10.0), (1e6, 40.0), (1e9, 90.0)]
    assert g.at(1e6) == pytest.approx(40.0) and g.at(1.0) == 10.0 and g.at(1e12) == 90.0
    mid = math.sqrt(1e3 * 1e6)  # halfway in log(work)
    assert g.at(mid) == pytest.approx(25.0, rel=1e-9) and 10.0 < g.at(2e4) < g.at(mid)


def test_perfect_link_scales_compute_bound_work_linearly():
    prof = profile([device()] * 4)
    one, four = predict(prof, 1), predict(prof, 4)
    assert one.step_s == pytest.approx(one.forward_s + one.backward_s + one.optimizer_s + one.overhead_s)
    assert four.batch_shares == [1024] * 4
    assert four.speedup == pytest.approx(four.step_s and one.step_s / four.step_s)
    assert 3.8 < four.speedup <= 4.0 and four.efficiency > 0.95


def test_slow_link_makes_one_device_the_answer_and_fast_link_many():
    slow = selector_recommend.recommend(
        layers=[1024, 4096, 4096, 10],
        batch_size=4096,
        devices=[1, 2, 4],
        profile=profile([device()] * 4, alpha=1e-3, busbw=1e8),
    )
    assert slow["strategy"] == "single_gpu" and slow["devices"] == 1
    assert all(c["predicted_speedup"] < 1 for c in slow["candidates"][1:])
    fast = selector_recommend.recommend(
        layers=[1024, 4096, 4096, 10],
        batch_size=4096,
        devices=[1, 2, 4],
        profile=profile([device()] * 4, alpha=1e-6, busbw=1e12),
    )
    assert fast["strategy"] == "multi_gpu" and fast["devices"] == 4
    assert fast["confidence"] > slow["confidence"] * 0.5 and 0 < fast["confidence"] <= 1
    for key in ("predicted_step_ms", "predicted_speedup", "efficiency", "memory_fits"):
        assert key in fast["candidates"][0]


def test_compressed_gradients_halve_the_bandwidth_term_and_add_two_casts():
    args = dict(alpha=0.0, busbw=1e9)  # bandwidth-bound: the bytes decide
    layers, batch = [1024, 4096, 4096, 10], 4096
    prof = perf.to_core(profile([device()] * 2, overlap=False, **args))
    fp32, bf16 = (
        P.predict(
            workload.build_workload(None, layers, None, batch, "fp32", "sgd", 4.0, grad_dtype=g), prof, 2, P.Options()
        )
        for g in ("fp32", "bf16")
    )
    assert bf16.comm_s == pytest.approx(fp32.comm_s / 2, rel=1e-3)
    assert bf16.optimizer_s > fp32.optimizer_s  # narrowing and widening the gradients
    assert bf16.step_s < fp32.step_s
    with pytest.raises(mgpu.ConfigError, match="gradient dtype"):
        workload.build_workload(None, layers, None, batch, "fp32", "sgd", 4.0, grad_dtype="int8")


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
def test_the_gradients_casts_are_launched_kernels_on_a_gpu_and_calls_on_a_cpu(kind):
    # each cast (fp32 read, half written, 6 B a parameter) is a kernel launched outside any
    # graph: on a GPU its work or a launch, whichever is longer (the host enqueues the next
    # while one runs); a CPU's call is its work and then the call's cost
    layers, launch = [1024, 1024, 10], 1e-3
    params = 1024 * 1024 + 1024 + 1024 * 10 + 10
    for bandwidth in (1e12, 1e8):  # a cast far below a launch, and far above it
        prof = perf.to_core(profile([device(bandwidth=bandwidth, launch=launch, kind=kind)] * 2))
        fp32, bf16 = (
            P.predict(
                workload.build_workload(None, layers, None, 64, "fp32", "sgd", 4.0, grad_dtype=g, cuda_graph="off"),
                prof,
                2,
                P.Options(),
            )
            for g in ("fp32", "bf16")
        )
        cast = 6.0 * params / bandwidth
        expected = 2 * (max(cast, launch) if kind == "cuda" else cast + launch)
        assert bf16.optimizer_s - fp32.optimizer_s == pytest.approx(expected, rel=1e-6)


def test_a_gpus_inputs_cost_a_gather_in_its_memory_or_what_their_prefetch_cannot_hide():
    layers, batch, launch, memory = (1024, 4096, 10), 4096, 3e-6, 2e12
    row_bytes = 4.0 * batch * (layers[0] + layers[-1])

    def overhead(resident, link):
        gpu = {**device(bandwidth=memory, launch=launch), "host_to_device_bandwidth": link}
        w = workload.build_workload(
            None, list(layers), None, batch, "fp32", "sgd", 4.0, cuda_graph="off", data_on_device=resident
        )
        p = P.predict(w, perf.to_core(profile([gpu])), 1, P.Options())
        return p.overhead_s, p.forward_s + p.backward_s + p.optimizer_s

    gathered, compute = overhead(True, 50e9)
    assert gathered == pytest.approx((2 * row_bytes + 16.0 * batch) / memory + 3 * launch, rel=1e-9)
    within = 2 * row_bytes / memory + 5 * launch  # the copy into the step's buffers; 2 more launches
    hidden, _ = overhead(False, 50e9)  # 0.34 ms of copy behind ~34 ms of compute
    assert row_bytes / 50e9 < compute and hidden == pytest.approx(within, rel=1e-9)
    slow, _ = overhead(False, row_bytes / (2 * compute))  # a link that takes twice the step
    assert slow == pytest.approx(within + compute, rel=1e-9)
    host = profile([{**device(kind="cpu"), "host_to_device_bandwidth": 0.0}])  # a CPU reads the host's memory
    costs = [
        P.predict(
            workload.build_workload(None, list(layers), None, batch, "fp32", "sgd", 4.0, data_on_device=r),
            perf.to_core(host),
            1,
            P.Options(),
        ).overhead_s
        for r in (True, False)
    ]
    assert costs[0] == costs[1]


def test_overlap_hides_allreduce_behind_backward():
    args = dict(alpha=1e-5, busbw=2e10)
    overlapped, serial = (
        predict(profile([device()] * 2, overlap=True, **args), 2),
        predict(profile([device()] * 2, overlap=False, **args), 2),
    )
    assert overlapped.comm_s == pytest.approx(serial.comm_s)
    assert serial.exposed_comm_s == pytest.approx(serial.comm_s)
    assert overlapped.exposed_comm_s < serial.exposed_comm_s
    assert overlapped.step_s < serial.step_s


@pytest.mark.parametrize("source, base", [("calibrated", 0.9), ("detected", 0.7), ("named", 0.6)])
@pytest.mark.parametrize("busbw", [1e9, 3e9, 5e9, 1e11])  # 0.53x, 1.04x, 1.28x, 1.92x
def test_confidence_follows_the_source_and_the_error_bands_to_one(source, base, busbw):
    # base x min(1, 0.5 + 0.25 x the half widths of the speedup's 80 % interval (in log)
    # between the speedup and 1.0x)
    prof = {**profile([device()] * 2, alpha=1e-5, busbw=busbw, error=0.2), "source": source}
    r = selector_recommend.recommend(layers=[512, 2048, 2048, 10], batch_size=512, devices=[1, 2], profile=prof)
    low, high = r["candidates"][1]["speedup_interval"]
    bands = abs(math.log(low * high) / 2) / (math.log(high / low) / 2)  # the interval's centre
    assert r["confidence"] == pytest.approx(min(0.99, max(0.05, base * min(1.0, 0.5 + 0.25 * bands))))
    assert busbw != 3e9 or bands < 1.5  # below the saturation at 2 bands


def test_equally_fast_candidates_pick_the_fewest_devices():
    # nothing costs but the step's fixed overhead: 1 and 2 devices take the same time
    free = {**device(flops=1e30, bandwidth=1e30), "host_to_device_bandwidth": 0.0}
    r = selector_recommend.recommend(
        layers=[8, 8, 2],
        batch_size=64,
        devices=[1, 2],
        cuda_graph="off",
        profile=profile([free] * 2, alpha=0.0, busbw=1e30, overhead=1e-3),
    )
    one, two = r["candidates"]
    assert one["predicted_step_ms"] == two["predicted_step_ms"] and r["devices"] == 1  # a tie, exactly


@pytest.mark.parametrize("error", [0.05, 0.1, 0.3])
def test_benchmark_required_exactly_where_the_speedup_interval_spans_one(error):
    # over link speeds from a clear loss to a clear gain: the decision follows the best
    # multi-device candidate's 80 % interval, and only it
    seen = set()
    for busbw in [10 ** (k / 16) for k in range(112, 192)]:
        r = selector_recommend.recommend(
            layers=[512, 2048, 2048, 10],
            batch_size=512,
            devices=[1, 2],
            profile=profile([device()] * 2, alpha=1e-5, busbw=busbw, error=error),
        )
        low, high = r["candidates"][1]["speedup_interval"]
        assert low <= r["candidates"][1]["predicted_speedup"] <= high
        expected = "multi_gpu" if low > 1 else "single_gpu" if high < 1 else "benchmark_required"
        assert r["strategy"] == expected, (busbw, low, high)
        seen.add(expected)
        if expected == "benchmark_required":
            assert any("within the model's error" in reason and "spans 1.0x" in reason for reason in r["reasons"])
        if expected == "single_gpu":
            assert any("one device is faster" in reason for reason in r["reasons"])
    assert seen == {"multi_gpu", "single_gpu", "benchmark_required"}


def with_bands(prof, compute, comm, shared=True, speedup=None, together=None):
    bands = {"compute": list(compute), "comm": list(comm), "compute_shared": shared, "source": "test bands"}
    if speedup is not None:
        bands["speedup"] = list(speedup)
    if together is not None:
        bands["compute_together"] = list(together)
    return {**prof, "error_model": bands}


def test_one_band_gives_the_step_interval_its_own_ratios():
    # a step that is all compute: [T exp(low), T exp(high)] exactly
    p = predict(with_bands(profile([device()]), (-0.2, 0.1), (-0.5, 0.5)), 1)
    assert p.exposed_comm_s == 0
    assert p.step_low_s == pytest.approx(p.step_s * math.exp(-0.2))
    assert p.step_high_s == pytest.approx(p.step_s * math.exp(0.1))
    assert p.speedup_low == p.speedup_high == 1.0


def test_compute_and_communication_errors_add_in_quadrature():
    prof = with_bands(profile([device()] * 2, alpha=1e-4, busbw=1e9, overlap=False), (-0.1, 0.1), (-0.3, 0.3))
    p = predict(prof, 2)
    comm, compute = p.exposed_comm_s, p.step_s - p.exposed_comm_s
    assert comm > 0 and compute > 0
    half = math.hypot(compute * math.sinh(0.1), comm * math.sinh(0.3))  # (e^h - e^-h) / 2 each
    center = compute * (math.cosh(0.1) - 1) + comm * (math.cosh(0.3) - 1)
    assert p.step_high_s == pytest.approx(p.step_s + center + half)
    assert p.step_low_s == pytest.approx(p.step_s + center - half)


def test_a_calibrations_whole_step_bands_apply_to_the_step_as_a_whole():
    # held-out steps measured whole steps: their band is not split into independent parts
    prof = with_bands(profile([device()] * 2, alpha=1e-4, busbw=1e9, overlap=False), (-0.2, 0.2), (-0.2, 0.2))
    prof["error_model"]["step_bands"] = True
    p = predict(prof, 2)
    assert p.exposed_comm_s > 0.1 * p.step_s
    assert p.step_low_s == pytest.approx(p.step_s * math.exp(-0.2))
    assert p.step_high_s == pytest.approx(p.step_s * math.exp(0.2))
    del prof["error_model"]["step_bands"]
    split = predict(prof, 2)
    assert split.step_high_s - split.step_low_s < p.step_high_s - p.step_low_s


def test_a_shared_compute_error_cancels_in_the_speedup():
    # no communication at all: with one compute error for every count the speedup is exact;
    # with the counts' errors apart it is not
    base = profile([device()] * 2, alpha=0.0, busbw=1e30)
    shared = predict(with_bands(base, (-0.2, 0.2), (-0.2, 0.2)), 2)
    apart = predict(with_bands(base, (-0.2, 0.2), (-0.2, 0.2), shared=False), 2)
    assert shared.speedup_low == pytest.approx(shared.speedup, rel=1e-9)
    assert shared.speedup_high == pytest.approx(shared.speedup, rel=1e-9)
    assert apart.speedup_low < apart.speedup < apart.speedup_high
    # a device among several has its own band where the counts were measured apart
    wider = predict(with_bands(base, (-0.2, 0.2), (-0.2, 0.2), shared=False, together=(-0.4, 0.4)), 2)
    assert wider.step_high_s - wider.step_low_s > apart.step_high_s - apart.step_low_s


def test_a_measured_speedup_band_is_the_speedup_interval():
    prof = with_bands(profile([device()] * 2, alpha=1e-5, busbw=1e10), (-0.1, 0.1), (-0.1, 0.1), speedup=(-0.3, 0.05))
    p = predict(prof, 2)
    assert p.timing_spread_s == 0
    assert p.speedup_low == pytest.approx(p.speedup * math.exp(-0.3))
    assert p.speedup_high == pytest.approx(p.speedup * math.exp(0.05))


def test_the_timing_spread_widens_a_measured_speedup_band_too():
    # where the cores moved, the wait's spread (the wait itself) joins the held-out band
    base = device(flops=1e11, bandwidth=50e9, kind="cpu")
    busy = {"params": [1e5, 1e6], "update_s": [1e-5, 1e-4], "wait_s": [5e-5, 5e-4], "ranks": 2}
    busy["wait_spread_s"] = [5e-5, 5e-4]
    alone = {**busy, "wait_spread_s": [0.0, 0.0], "ranks": 1}
    dev = {**base, "step_phases": busy, "step_phases_alone": alone}
    prof = with_bands(profile([dev] * 2, alpha=1e-6, busbw=10e9, overlap=False), (-0.1, 0.1), (-0.1, 0.1))
    prof["error_model"]["speedup"] = [-0.2, 0.1]
    p = predict(prof, 2, layers=(64, 256, 256, 8), batch=32)
    assert p.timing_spread_s > 0
    half = math.hypot(0.15, p.timing_spread_s / p.step_s)
    assert math.log(p.speedup_high / p.speedup) == pytest.approx(-0.05 + half)
    assert math.log(p.speedup_low / p.speedup) == pytest.approx(-0.05 - half)


def test_a_profile_before_error_bands_uses_its_model_error():
    prof = profile([device()], error=0.2)
    core = perf.to_core(prof)
    assert core.error.compute.low == pytest.approx(math.log(0.8))
    assert core.error.comm.high == pytest.approx(math.log(1.2))
    assert "not validated" in core.error.source


def test_error_bands_of_a_profile_read_as_written():
    prof = profile([device()])
    prof["error_model"] = {"compute": [-0.1, 0.2], "comm": [-0.3, 0.4]}  # no compute_together, no compute_shared
    e = perf.to_core(prof).error
    assert (e.compute_together.low, e.compute_together.high) == pytest.approx((-0.1, 0.2))  # the compute band's
    assert e.compute_shared is True and (e.comm.low, e.comm.high) == pytest.approx((-0.3, 0.4))
    for error in (1.0, -0.1, 1.5):
        with pytest.raises(mgpu.ConfigError, match="model_error is a relative error in"):
            perf.to_core(profile([device()], error=error))


def test_two_placements_weigh_every_multi_rank_phase_by_their_share():
    phases = {"params": [1e3, 1e6], "update_s": [1.0, 2.0], "wait_s": [3.0, 4.0], "wait_spread_s": [0.5, 0.6]}
    other = {"params": [1e3, 1e6], "update_s": [2.0, 4.0], "wait_s": [9.0, 8.0], "wait_spread_s": [1.5, 0.6]}
    got = perf._placement_weighted(phases, other, 0.25)
    for key in ("update_s", "wait_s", "wait_spread_s"):
        assert got[key] == pytest.approx([0.75 * a + 0.25 * b for a, b in zip(phases[key], other[key])])
    assert perf._placement_weighted(phases, other, 0.0) is phases


def test_named_gpu_profiles_carry_the_published_tables_bands():
    r = selector_recommend.recommend(model="large", batch_size=1024, devices=[1, 2], profile="h100-sxm-8")
    bands = r["error_model"]
    assert "published tables" in bands["source"] and bands["compute_shared"] is True
    assert bands["compute"][0] < 0 < bands["compute"][1] and bands["comm"][0] < 0 < bands["comm"][1]
    for c in r["candidates"]:
        low, high = c["step_interval_ms"]
        assert low < c["predicted_step_ms"] < high


def test_memory_decides_when_one_device_cannot_hold_the_batch():
    layers, batch = [1024, 8192, 8192, 10], 65536
    small = device(memory=6e9)
    r = selector_recommend.recommend(
        layers=layers, batch_size=batch, devices=[1, 2, 4], profile=profile([small] * 4, alpha=1e-3, busbw=1e8)
    )
    one = r["candidates"][0]
    assert not one["memory_fits"] and one["memory_bytes"] > one["memory_usable_bytes"]
    assert r["strategy"] == "multi_gpu" and r["devices"] > 1
    assert any("cannot hold it" in reason for reason in r["reasons"])
    none = selector_recommend.recommend(
        layers=layers, batch_size=batch, devices=[1, 2], profile=profile([device(memory=1e9)] * 2)
    )
    assert none["strategy"] == "does_not_fit"
    assert not any(c["memory_fits"] for c in none["candidates"])


def test_unequal_devices_get_batch_shares_by_speed():
    prof = profile([device(flops=2e12, name="fast"), device(flops=1e12, name="slow")])
    two = predict(prof, 2, batch=3000)
    fast, slow = two.batch_shares
    assert fast + slow == 3000 and fast == pytest.approx(2000, abs=60)
    # whole rows: the floors (6 and 3 of 6.7 and 3.3), the row left over to the largest remainder
    assert predict(prof, 2, batch=10).batch_shares == [7, 3]
    r = selector_recommend.recommend(layers=[1024, 4096, 4096, 10], batch_size=3000, devices=[1, 2], profile=prof)
    assert any("batch shares" in reason for reason in r["reasons"])


def test_dropout_costs_its_measured_time_per_hidden_unit_and_sample():
    prof = perf.to_core(profile([{**device(), "dropout_s_per_unit": 2e-9}]))
    layers, batch = [64, 512, 256, 10], 128

    def at(p):
        return P.predict(
            workload.build_workload(None, layers, None, batch, "fp32", "sgd", 4.0, dropout=p), prof, 1, P.Options()
        )

    assert at(0.3).forward_s - at(0.0).forward_s == pytest.approx(batch * (512 + 256) * 2e-9, rel=1e-9)
    assert at(0.3).backward_s == at(0.0).backward_s  # the backward's ReLU costs the same with a mask


def test_batch_shares_weigh_each_device_at_its_equal_split():
    # a fast device with a costly launch against a slow one without: which is faster depends
    # on the rows, so the shares come from each one's speed at half the batch (32 rows)
    fast = {**device(flops=4e12, launch=50e-6, name="fast"), "graph_node_s": 50e-6}  # captured or not
    slow = {**device(flops=1e12, name="slow"), "graph_node_s": 0.0}
    layers, batch = (512, 2048, 2048, 10), 64
    speed = [32 / (lambda p: p.forward_s + p.backward_s)(predict(profile([d]), 1, layers, 32)) for d in (fast, slow)]
    shares = predict(profile([fast, slow]), 2, layers, batch).batch_shares
    assert sum(shares) == batch and abs(shares[0] - batch * speed[0] / sum(speed)) < 1


def test_every_device_needs_a_sample_of_every_micro_batch():
    # train's `--batch-size 4 --accumulate 16` on 8 GPUs is refused (a rank without a sample):
    # recommend's --batch-size 64 --accumulate 16 leaves 8 GPUs out, and 4 stay
    prof = perf.named_profile("h100-sxm-8")
    r = selector_recommend.recommend(model="medium", batch_size=64, devices=[1, 4, 8], accumulate=16, profile=prof)
    assert [c["devices"] for c in r["candidates"]] == [1, 4]
    assert (
        "8 GPUs left out: micro-batches of 4 samples (a global batch of 64 in 16) give some of them no sample"
        in r["reasons"]
    )
    with pytest.raises(mgpu.ConfigError, match="accumulate 65 is larger than the global batch 64"):
        selector_recommend.recommend(model="medium", batch_size=64, accumulate=65, profile=prof)


def test_break_even_batch_is_where_several_devices_start_to_win():
    prof = profile([device(launch=5e-6)] * 2, alpha=2e-5, busbw=1e10, overhead=1e-4)
    r = selector_recommend.recommend(layers=[256, 1024, 1024, 10], batch_size=64, devices=[1, 2], profile=prof)
    b = r["break_even_batch"]
    assert b is not None and b > 2
    above = selector_recommend.recommend(layers=[256, 1024, 1024, 10], batch_size=b, devices=[1, 2], profile=prof)
    below = selector_recommend.recommend(layers=[256, 1024, 1024, 10], batch_size=b - 1, devices=[1, 2], profile=prof)
    assert above["candidates"][1]["predicted_speedup"] > 1 >= below["candidates"][1]["predicted_speedup"]


def test_prices_give_cost_per_sample_and_roi():
    prof = profile([device()] * 2, alpha=1e-6, busbw=1e11)
    r = selector_recommend.recommend(
        layers=[1024, 4096, 4096, 10], batch_size=4096, devices=[1, 2], profile=prof, price_per_device_hour=3.6
    )
    one, two = r["candidates"]
    assert one["cost_per_million_samples"] == pytest.approx(3.6 / 3600 * one["predicted_step_ms"] / 1e3 / 4096 * 1e6)
    assert two["cost_per_million_samples"] == pytest.approx(
        2 * 3.6 / 3600 * two["predicted_step_ms"] / 1e3 / 4096 * 1e6
    )
    assert r["roi"] and "per million samples" in r["roi"]
    # the pick's own cost, against one device's (a link with latency: two cost more)
    r = selector_recommend.recommend(
        layers=[1024, 4096, 4096, 10],
        batch_size=4096,
        devices=[1, 2],
        price_per_device_hour=3.6,
        profile=profile([device()] * 2, alpha=1e-3, busbw=2e9),
    )
    one, two = r["candidates"]
    assert r["devices"] == 2 and two["cost_per_million_samples"] > 1.01 * one["cost_per_million_samples"]
    assert f"2 GPUs {two['cost_per_million_samples']:.3f} (+" in r["roi"], r["roi"]


@pytest.mark.parametrize(
    "params, batch, strategy",
    [
        (300_000, 512, "single_gpu"),
        (3_000_000, 64, "single_gpu"),
        (3_000_000, 512, "benchmark_required"),
        (7_000_000, 64, "benchmark_required"),
        (20_000_000, 128, "multi_gpu"),
        (20_000_000, 32, "single_gpu"),
        (120_000_000, 16, "multi_gpu"),
    ],
)
def test_without_any_profile_the_seed_thresholds_answer(params, batch, strategy, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no calibration
    monkeypatch.setattr(perf, "detected_profile", lambda devices=None: None)  # and no GPU
    r = selector_recommend.recommend(params=params, batch_size=batch, devices=[1, 2])
    assert r["fallback"] is True and r["strategy"] == strategy
    assert any("threshold table" in reason for reason in r["reasons"])
    assert r["confidence"] < 0.5


@pytest.mark.parametrize("name", sorted(perf.NAMED_PROFILES))
def test_named_profiles_predict_every_preset(name):
    per_node = perf.NAMED_PROFILES[name]["gpus_per_node"]
    for model, batch in (("medium", 256), ("large", 1024), ("xl", 2048)):
        r = selector_recommend.recommend(model=model, batch_size=batch, profile=name)
        assert r["strategy"] in ("single_gpu", "multi_gpu", "benchmark_required", "does_not_fit")
        assert [c["devices"] for c in r["candidates"]] == [1, per_node if per_node > 1 else 2]
        assert all(c["predicted_step_ms"] > 0 and math.isfinite(c["predicted_speedup"]) for c in r["candidates"])
        assert r["profile_source"] == "named"


def test_faster_interconnects_never_predict_slower_steps():
    steps = {
        n: selector_recommend.recommend(model="xl", batch_size=2048, devices=[1, 2], profile=n)["candidates"][1]
        for n in ("pcie-host-bridge", "pcie-p2p")
    }
    assert steps["pcie-p2p"]["allreduce_ms"] < steps["pcie-host-bridge"]["allreduce_ms"]
    assert steps["pcie-p2p"]["predicted_step_ms"] <= steps["pcie-host-bridge"]["predicted_step_ms"]


def test_profiles_round_trip_and_bad_ones_are_refused(tmp_path, monkeypatch):
    path = perf.save_profile(profile([device()] * 2), str(tmp_path / "p.json"))
    assert perf.load_profile(path)["devices"][0]["name"] == "dev"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": perf.PROFILE_FORMAT, "version": 1, "name": "x", "devices": [{}], "link": {}}))
    with pytest.raises(mgpu.ConfigError, match="malformed"):
        perf.load_profile(str(bad))
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(mgpu.ConfigError, match="not an mgpu hardware profile"):
        perf.load_profile(str(tmp_path / "other.json"))
    # the shape said in words, the file named, a directory not taken for an unknown name
    bad.write_text(json.dumps({**json.loads(open(path).read()), "devices": "cpu"}))
    with pytest.raises(mgpu.ConfigError, match="malformed: devices must be a non-empty list of objects"):
        perf.load_profile(str(bad))
    rates = json.loads(open(path).read())
    rates["devices"][0]["fp32"]["peak_flops"] = "fast"
    bad.write_text(json.dumps(rates))
    with pytest.raises(mgpu.ConfigError, match=f"hardware profile '{re.escape(str(bad))}': bad GEMM rate"):
        perf.load_profile(str(bad))
    (tmp_path / "calib").mkdir()
    with pytest.raises(mgpu.ConfigError, match="is a directory"):
        selector_recommend.recommend(model="large", batch_size=64, profile=str(tmp_path / "calib"))
    monkeypatch.chdir(tmp_path)  # a bare name that is a directory here
    with pytest.raises(mgpu.ConfigError, match="'calib' is a directory"):
        selector_recommend.recommend(model="large", batch_size=64, profile="calib")
    with pytest.raises(mgpu.ConfigError, match="unknown hardware profile"):
        selector_recommend.recommend(model="large", batch_size=64, profile="quantum")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch_size=0), "batch size"),
        (dict(batch_size=64, devices=[0, 1]), "device counts"),
        (dict(batch_size=64, precision="fp8"), "precision"),
        (dict(batch_size=64, devices=[1, 16]), "cannot predict 16"),
        (dict(batch_size=64, optimizer="lion"), "optimizer"),
        (dict(batch_size=64, cuda_graph="maybe"), "CUDA graph mode"),
    ],
)
def test_bad_requests_raise_config_errors(kwargs, message):
    prof = profile([device()] * 4)
    with pytest.raises(mgpu.ConfigError, match=message):
        selector_recommend.recommend(layers=[16, 16], profile=prof, **{"devices": [1, 2], **kwargs})


def test_one_device_is_always_a_candidate_the_table_shows():
    """Every speedup is against one device, and one device may be the answer: without it among
    the candidates `--devices 3` answered 1 GPU in a table of one row, of 3 GPUs."""
    prof = profile([device()] * 4)
    r = selector_recommend.recommend(layers=[16, 16], profile=prof, batch_size=64, devices=[3])
    assert [c["devices"] for c in r["candidates"]] == [1, 3] and r["devices"] in (1, 3)
    alone = selector_recommend.recommend(layers=[16, 16], profile=prof, batch_size=1, devices=[2, 4])
    assert alone["devices"] == 1 and [c["devices"] for c in alone["candidates"]] == [1]
    assert "2 GPUs left out: a global batch of 1 gives some of them no sample" in alone["reasons"]


def test_summary_drops_outliers_by_modified_z_score():
    s = summarize([1.0, 1.1, 0.9, 1.0, 1.05, 0.95] * 5 + [50.0])
    assert s["outliers"] == 1 and s["n"] == 30
    assert s["median"] == pytest.approx(1.0) and s["ci95"][0] < s["mean"] < s["ci95"][1] < 1.1


@pytest.mark.parametrize("model", ["medium", "large"])
@pytest.mark.parametrize("batch", [8, 16, 32, 64])
def test_seed_001_grid_on_its_own_hardware_never_recommends_two_gpus(model, batch):
    """Seed 001 measured 0.78-0.90x for these cells on two PCIe GPUs behind a host bridge."""
    r = selector_recommend.recommend(model=model, batch_size=batch, devices=[1, 2], profile="pcie-host-bridge")
    assert r["candidates"][1]["predicted_speedup"] < 1.0
    assert r["strategy"] in ("single_gpu", "benchmark_required")


@pytest.mark.parametrize("profile_name", ["nvlink", "h100-nvswitch"])
def test_large_models_on_fast_interconnects_go_multi_gpu(profile_name):
    r = selector_recommend.recommend(model="xl", batch_size=4096, devices=[1, 2, 4, 8], profile=profile_name)
    assert r["strategy"] == "multi_gpu" and r["devices"] >= 4
    speedups = {c["devices"]: c["predicted_speedup"] for c in r["candidates"]}
    assert 1.5 < speedups[2] < 2 and speedups[4] > speedups[2]
    assert r["devices"] == max(speedups, key=speedups.get)  # the fastest count is recommended


def test_half_precision_gemms_hold_a_half_copy_of_the_weights_and_write_it_in_the_update():
    # The CUDA backend keeps the weights' bf16/fp16 copy (2 B a parameter) that the
    # optimizer update writes; the model charges those bytes in memory and update time.
    layers, batch = [1024, 4096, 4096, 10], 256
    params = sum(a * b + b for a, b in zip(layers, layers[1:]))
    prof = perf.to_core(profile([device()], alpha=0.0, busbw=1e9))
    fp32, bf16 = (
        P.predict(workload.build_workload(None, layers, None, batch, p, "sgd", 4.0), prof, 1, P.Options())
        for p in ("fp32", "bf16")
    )
    # and two half operand buffers (activations, output gradients) of the widest layer's rows
    assert bf16.memory_bytes - fp32.memory_bytes == pytest.approx(2 * params + 2 * 2 * batch * 4096, rel=1e-12)
    tf32 = P.predict(workload.build_workload(None, layers, None, batch, "tf32", "sgd", 4.0), prof, 1, P.Options())
    assert tf32.memory_bytes == fp32.memory_bytes and tf32.optimizer_s == fp32.optimizer_s
    assert bf16.optimizer_s > fp32.optimizer_s


def test_several_devices_hold_the_links_buffers_and_one_device_none():
    prof = profile([device()] * 2, alpha=1e-6, busbw=1e10)
    with_buffers = {**prof, "link": {**prof["link"], "buffer_bytes": 64e6}}
    one, two = predict(prof, 1), predict(prof, 2)
    assert predict(with_buffers, 2).memory_bytes - two.memory_bytes == pytest.approx(64e6)
    assert predict(with_buffers, 1).memory_bytes == one.memory_bytes


def layer_grid(time, rows=(1, 4, 16, 64), widths=(8, 32, 128)):
    """A LayerTimes dict whose every table holds time(r, i, o) (and kind-scaled copies)."""
    cells = [(r, i, o) for r in rows for i in widths for o in widths]
    return {
        "rows": list(rows),
        "widths": list(widths),
        "forward": [time(*c) for c in cells],
        "backward": [2 * time(*c) for c in cells],
        "backward_weights": [1.5 * time(*c) for c in cells],
    }


def multilinear(r, i, o):  # the shape of a GEMM's time: work, weights, activations, a constant
    return 1e-6 + 2e-12 * r * i * o + 3e-11 * i * o + 5e-11 * r * i + 9e-11 * r * o + 4e-9 * o  # in != out


def test_layer_times_interpolate_a_gemm_shaped_time_exactly_and_scale_beyond_the_grid():
    t = perf._layers_to_core(layer_grid(multilinear), "test")
    for r, i, o in [(3, 50, 100), (1, 8, 8), (40, 9, 127), (64, 128, 128), (2, 20, 64)]:
        assert t.forward_s(r, i, o) == pytest.approx(multilinear(r, i, o), rel=1e-9), (r, i, o)
        assert t.backward_s(r, i, o) == pytest.approx(2 * multilinear(r, i, o), rel=1e-9)
        assert t.backward_s(r, i, o, input_gradient=False) == pytest.approx(1.5 * multilinear(r, i, o), rel=1e-9)
    # beyond the largest size the edge's rate holds: time in proportion
    assert t.forward_s(256, 128, 128) == pytest.approx(4 * multilinear(64, 128, 128), rel=1e-9)
    assert t.forward_s(64, 512, 256) == pytest.approx(8 * multilinear(64, 128, 128), rel=1e-9)
    # below the smallest, the edge's time
    assert t.forward_s(1, 2, 3) == pytest.approx(multilinear(1, 8, 8), rel=1e-9)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda g: g.update(rows=[4, 1, 16, 64]), "ascending"),
        (lambda g: g.update(widths=[8]), "ascending"),
        (lambda g: g["forward"].pop(), "grid has"),
        (lambda g: g["backward"].__setitem__(3, 0.0), "positive"),
        (lambda g: g["backward_weights"].__setitem__(0, float("nan")), "positive"),
        (lambda g: g.pop("forward"), "malformed"),
    ],
)
def test_malformed_layer_times_are_refused(change, message):
    grid = layer_grid(multilinear)
    change(grid)
    prof = profile([{**device(kind="cpu"), "layer_times": grid}] * 2)
    with pytest.raises(mgpu.ConfigError, match=message):
        predict(prof, 2)


def test_measured_layer_times_replace_the_gemm_rate_and_one_rank_uses_its_alone_table():
    layers, batch = (32, 128, 128, 8), 64
    base = device(flops=1e11, bandwidth=1e11, kind="cpu")
    slow, fast = (
        layer_grid(lambda r, i, o: 1e-3 * multilinear(r, i, o) / multilinear(1, 8, 8)),
        layer_grid(lambda r, i, o: 0.5e-3 * multilinear(r, i, o) / multilinear(1, 8, 8)),
    )
    plain = profile([base] * 2)
    tabled = profile([{**base, "layer_times": slow}] * 2)
    both = profile([{**base, "layer_times": slow, "layer_times_alone": fast}] * 2)
    p_plain, p_tab = predict(plain, 1, layers, batch), predict(tabled, 1, layers, batch)
    w = workload.build_workload(None, list(layers), None, batch, "fp32", "sgd", 4.0)
    t = perf._layers_to_core(slow, "t")
    expected_forward = sum(t.forward_s(batch, layers[l], layers[l + 1]) for l in range(3))
    relu_dropout, loss = 2 * (8.0 * batch * 128 / 1e11), 12.0 * batch * 8 / 1e11  # passes at 100 GB/s
    assert p_tab.forward_s == pytest.approx(expected_forward + relu_dropout + loss, rel=1e-9)
    assert p_tab.forward_s > 5 * p_plain.forward_s  # the table, not the 100 GFLOP/s rate, decided
    # backward: the first layer without its input gradient; relu backward passes beside
    expected_backward = sum(t.backward_s(batch, layers[l], layers[l + 1], l > 0) for l in range(3))
    relu_backward = sum(12.0 * batch * layers[l] / 1e11 for l in (1, 2))
    assert p_tab.backward_s == pytest.approx(expected_backward + relu_backward, rel=1e-9)
    assert t.backward_s(batch, 32, 128, False) < t.backward_s(batch, 32, 128, True)
    # one rank alone reads the alone table; two ranks the table taken with both computing
    one, two = predict(both, 1, layers, batch), predict(both, 2, layers, batch)
    assert one.forward_s < 0.6 * p_tab.forward_s and one.backward_s < 0.6 * p_tab.backward_s
    assert two.forward_s == pytest.approx(predict(tabled, 2, layers, batch).forward_s)
    assert two.speedup == pytest.approx(one.step_s / two.step_s)
    # half precision has no measured table: the rate decides
    w.precision = "bf16"
    assert P.predict(w, perf.to_core(tabled), 1, P.Options()).forward_s < p_tab.forward_s


def cold_grid(factor):
    """layer_grid(multilinear) with cold tables `factor` times the warm ones."""
    grid = layer_grid(multilinear)
    grid.update({f"{k}_cold": [factor * t for t in grid[k]] for k in ("forward", "backward", "backward_weights")})
    return grid


def test_layers_take_the_cold_tables_by_the_share_of_the_steps_arrays_the_cache_cannot_hold():
    layers, batch = (32, 128, 128, 8), 64
    base = device(flops=1e11, bandwidth=1e11, kind="cpu")
    warm = layer_grid(multilinear)
    arrays = memory.training_memory_bytes(list(layers), batch // 2, optimizer="sgd")  # one rank of two

    def at(cache, grid=cold_grid(3.0), n=2):  # noqa: B008 - one grid, made once
        prof = profile([{**base, "layer_times": grid, "layer_times_alone": grid, "cache_bytes": cache}] * 2)
        return predict(prof, n, layers, batch)

    plain = at(0.0, warm)
    # no cache size, or one that holds both ranks' arrays: the warm tables
    assert at(0.0).forward_s == pytest.approx(plain.forward_s, rel=1e-12)
    assert at(2 * arrays * 1.01).backward_s == pytest.approx(plain.backward_s, rel=1e-12)
    # a cache holding half of the two ranks' arrays: halfway to the cold tables (3x): 2x the layers
    layer_fwd = sum(perf._layers_to_core(warm, "w").forward_s(batch // 2, layers[l], layers[l + 1]) for l in range(3))
    half = at(arrays)
    assert half.forward_s - plain.forward_s == pytest.approx(layer_fwd, rel=1e-9)
    assert plain.backward_s < half.backward_s < at(arrays / 100).backward_s
    # one rank alone: its own arrays (of the whole batch) against the cache, no other rank's
    alone = memory.training_memory_bytes(list(layers), batch, optimizer="sgd")
    assert at(alone * 1.01, n=1).forward_s == pytest.approx(at(alone * 1.01, warm, n=1).forward_s, rel=1e-12)
    assert at(alone / 2, n=1).forward_s > at(alone / 2, warm, n=1).forward_s
    # a calibration from before the cold tables: the warm ones whatever the cache
    assert at(arrays / 100, warm).forward_s == pytest.approx(plain.forward_s, rel=1e-12)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda g: g["forward_cold"].pop(), "a cold table holds"),
        (lambda g: g.pop("backward_cold"), "malformed"),
        (lambda g: g["backward_weights_cold"].__setitem__(2, -1.0), "positive"),
    ],
)
def test_malformed_cold_layer_times_are_refused(change, message):
    grid = cold_grid(2.0)
    change(grid)
    with pytest.raises(mgpu.ConfigError, match=message):
        predict(profile([{**device(kind="cpu"), "layer_times": grid}] * 2), 2)
    with pytest.raises(mgpu.ConfigError, match="cache size must be finite"):
        predict(profile([{**device(kind="cpu"), "cache_bytes": float("nan")}] * 2), 2)


def test_pass_bandwidth_by_size_prices_the_update_and_one_rank_uses_its_alone_table():
    layers, batch = (256, 1024, 1024, 8), 64
    params = 256 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 8 + 8
    base = device(flops=1e11, bandwidth=10e9, kind="cpu")
    cached = [[1e6, 80e9], [1e8, 10e9]]  # 80 GB/s in cache down to 10 GB/s beyond it
    prof = profile([{**base, "pass_bandwidth": cached, "pass_bandwidth_alone": [[1e6, 160e9], [1e8, 20e9]]}] * 2)
    update, health = 20.0 * params, 4.0 * params  # sgd: read w, g, m; write w, m
    t = perf.to_core(prof).devices[0]

    def rate(bytes_, points):  # log-log between the two points
        (b0, r0), (b1, r1) = points
        return math.exp(math.log(r0) + math.log(bytes_ / b0) / math.log(b1 / b0) * math.log(r1 / r0))

    assert t.bandwidth_at(update) == pytest.approx(rate(update, cached), rel=1e-9)
    assert t.bandwidth_at(1e3) == 80e9 and t.bandwidth_at(1e12) == 10e9 and t.bandwidth_at(1e3, alone=True) == 160e9
    two = predict(prof, 2, layers, batch)
    assert two.optimizer_s == pytest.approx(update / rate(update, cached) + health / rate(health, cached), rel=1e-9)
    one = predict(prof, 1, layers, batch)
    assert one.optimizer_s == pytest.approx(two.optimizer_s / 2, rel=1e-9)
    flat = predict(profile([base] * 2), 2, layers, batch)
    assert flat.optimizer_s == pytest.approx((update + health) / 10e9, rel=1e-9)
    bad = profile([{**base, "pass_bandwidth": [[1e8, 10e9], [1e6, 80e9]]}] * 2)
    with pytest.raises(mgpu.ConfigError, match="ascending"):
        predict(bad, 2, layers, batch)


def phases(ranks=2, scale=1.0):
    """In-step phases of a CPU calibration: 1 ns (update) and 0.5 ns (wait) per parameter
    at 1M parameters, per-parameter costs twice as high at 4M (beyond the caches)."""
    return {
        "params": [1e6, 4e6],
        "update_s": [scale * 1e-3, scale * 8e-3],
        "wait_s": [scale * 0.5e-3, scale * 4e-3],
        "wait_spread_s": [0.0, 0.0],
        "ranks": ranks,
    }


def test_step_phases_interpolate_per_parameter_cost_in_log_params_and_clamp():
    # per-parameter seconds, linear between the counts in log(params)
    t = perf._phases_to_core(phases(), "test")
    assert t.update_at(1e6) == pytest.approx(1e-3) and t.wait_at(4e6) == pytest.approx(4e-3)
    assert t.update_at(2e6) == pytest.approx(2e6 * 1.5e-9, rel=1e-9)  # halfway in log(params)
    assert t.update_at(1e3) == pytest.approx(1e-6) and t.update_at(4e7) == pytest.approx(8e-2)  # per param held


def test_measured_step_phases_replace_the_update_health_check_and_allreduce_models():
    layers, batch = (1000, 1000, 1000), 64  # 2.002M parameters
    n_params = 2 * (1000 * 1000 + 1000)
    base = {**device(flops=1e12, bandwidth=50e9, kind="cpu")}
    link = dict(alpha=1e-5, busbw=5e9, overlap=False, sync=1e-3)
    prof = profile([{**base, "step_phases": phases(), "step_phases_alone": phases(1, 0.5)}] * 2, **link)
    t, alone = perf._phases_to_core(phases(), "t"), perf._phases_to_core(phases(1, 0.5), "a")
    one = predict(prof, 1, layers, batch)
    assert one.optimizer_s == pytest.approx(alone.update_at(n_params) + alone.wait_at(n_params), rel=1e-9)
    adamw = predict(prof, 1, layers, batch, optimizer="adamw")
    assert adamw.optimizer_s == pytest.approx(alone.update_at(n_params) * 28 / 20 + alone.wait_at(n_params), rel=1e-9)
    two = predict(prof, 2, layers, batch)
    # at the calibration's world and bucket size the measured wait is the exposed allreduce, skew included
    assert two.exposed_comm_s == pytest.approx(t.wait_at(n_params), rel=1e-9)
    assert two.optimizer_s == pytest.approx(t.update_at(n_params), rel=1e-9)
    assert two.step_s == pytest.approx(
        two.overhead_s + max(two.forward_s + two.backward_s, 0) + two.exposed_comm_s + two.optimizer_s, rel=1e-9
    )  # no step_sync_s on top
    # another bucket size moves the wait by what the link model says it changes
    core = perf.to_core(prof)
    w_small = workload.build_workload(None, list(layers), None, batch, "fp32", "sgd", 1.0)
    small = P.predict(w_small, core, 2, P.Options())
    assert small.exposed_comm_s == pytest.approx(t.wait_at(n_params) + small.comm_s - two.comm_s, rel=1e-9)
    assert small.exposed_comm_s > two.exposed_comm_s  # four times the buckets, four times the latency
    # a calibration on one rank measured no allreduce and no skew: the models add theirs
    solo = profile([{**base, "step_phases": phases(1)}] * 2, **link)
    s = predict(solo, 2, layers, batch)
    assert s.exposed_comm_s == pytest.approx(t.wait_at(n_params) + s.comm_s, rel=1e-9)
    assert s.step_s == pytest.approx(
        s.overhead_s + 1e-3 + s.forward_s + s.backward_s + s.exposed_comm_s + s.optimizer_s, rel=1e-9
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: p.update(params=[4e6, 1e6]), "ascending"),
        (lambda p: p["wait_s"].pop(), "hold"),
        (lambda p: p["update_s"].__setitem__(0, 0.0), "positive"),
        (lambda p: p.update(ranks=0), "ranks"),
        (lambda p: p.pop("ranks"), "malformed"),
    ],
)
def test_malformed_step_phases_are_refused(change, message):
    table = phases()
    change(table)
    with pytest.raises(mgpu.ConfigError, match=message):
        predict(profile([{**device(kind="cpu"), "step_phases": table}] * 2), 2)


def test_a_calibrated_wait_spread_widens_the_error_band_where_steps_are_short():
    layers, batch = (64, 256, 256, 8), 16
    base = device(flops=1e11, bandwidth=50e9, kind="cpu")

    def rec(spread):
        busy = {
            "params": [1e5, 1e6],
            "update_s": [1e-5, 1e-4],
            "wait_s": [5e-5, 5e-4],
            "wait_spread_s": [spread / 10, spread],
            "ranks": 2,
        }
        alone = {**busy, "wait_spread_s": [0.0, 0.0], "ranks": 1}
        prof = profile(
            [{**base, "step_phases": busy, "step_phases_alone": alone}] * 2, alpha=1e-6, busbw=10e9, overlap=False
        )
        return selector_recommend.recommend(layers=list(layers), batch_size=batch, devices=[1, 2], profile=prof)

    steady, jittery = rec(0.0), rec(5e-4)
    one, two = jittery["candidates"]
    assert one["timing_spread_ms"] == 0.0 and two["timing_spread_ms"] > 0.2 * two["predicted_step_ms"]
    # the same predicted gain, but steps that wander by a fifth of themselves cannot promise it:
    # the spread joins the speedup's interval in quadrature
    assert two["predicted_speedup"] == pytest.approx(steady["candidates"][1]["predicted_speedup"])
    (low, high), (steady_low, steady_high) = two["speedup_interval"], steady["candidates"][1]["speedup_interval"]
    spread = two["timing_spread_ms"] / two["predicted_step_ms"]
    assert math.log(high / low) / 2 == pytest.approx(math.hypot(math.log(steady_high / steady_low) / 2, spread))
    assert steady["strategy"] == "multi_gpu" and steady_low > 1
    assert jittery["strategy"] == ("multi_gpu" if low > 1 else "benchmark_required") and low < steady_low
    assert jittery["confidence"] < steady["confidence"]


def test_cores_that_changed_cache_domains_during_calibration_widen_the_multi_rank_band():
    # topo read a cache line's round trip between the ranks' CPUs 52 ns and later 330 ns
    layers, batch = (64, 256, 256, 8), 32
    base = device(flops=1e11, bandwidth=50e9, kind="cpu")
    busy = {
        "params": [1e5, 1e6],
        "update_s": [1e-5, 1e-4],
        "wait_s": [5e-5, 5e-4],
        "wait_spread_s": [0.0, 1e-6],
        "ranks": 2,
    }
    alone = {**busy, "wait_spread_s": [0.0, 0.0], "ranks": 1}

    def rec(readings):
        prof = profile(
            [{**base, "step_phases": busy, "step_phases_alone": alone}] * 2, alpha=1e-6, busbw=10e9, overlap=False
        )
        if readings is not None:
            prof["placement"] = {"cpus": [0, 1], "readings_ns": readings, "wait_probe_ns": readings[1:3]}
        return selector_recommend.recommend(layers=list(layers), batch_size=batch, devices=[1, 2], profile=prof)

    before, steady, moved = rec(None), rec([52.0, 55.0, 61.0, 58.0]), rec([52.0, 55.0, 61.0, 330.0])
    assert steady == before  # one placement throughout: as a calibration without readings
    two = moved["candidates"][1]
    assert two["predicted_speedup"] == pytest.approx(steady["candidates"][1]["predicted_speedup"])
    # the wait may be met in the other placement: its spread is the wait itself (5e-4 s at 1e6 params)
    n_params = sum(i * o + o for i, o in zip(layers, layers[1:]))
    wait = perf._phases_to_core(busy, "busy").wait_at(n_params)
    assert two["timing_spread_ms"] == pytest.approx(wait * 1e3, rel=1e-6)
    assert two["timing_spread_ms"] > steady["candidates"][1]["timing_spread_ms"]
    # a 1.6x gain promised in one placement; its interval widens by the wait
    steady_low = steady["candidates"][1]["speedup_interval"][0]
    assert steady["strategy"] == "multi_gpu" and two["speedup_interval"][0] < steady_low
    assert moved["strategy"] == ("multi_gpu" if two["speedup_interval"][0] > 1 else "benchmark_required")
    assert moved["confidence"] < steady["confidence"]
    assert any("change cache domains (a cache line's round trip 52-330 ns)" in r for r in moved["reasons"])
    assert not any("cache domains" in r for r in steady["reasons"])
    # one rank has no wait of another rank to meet: its band is left as it was
    assert moved["candidates"][0]["timing_spread_ms"] == steady["candidates"][0]["timing_spread_ms"]


def test_bands_of_timed_steps_take_no_steps_jitter_but_still_a_move_of_the_cores():
    # a calibration's bands come from medians of timed steps: a step's jitter is in them
    # already, while a wait that may meet the other placement of the cores is not
    layers, batch = (64, 256, 256, 8), 32
    base = device(flops=1e11, bandwidth=50e9, kind="cpu")
    busy = {"params": [1e5, 1e6], "update_s": [1e-5, 1e-4], "wait_s": [5e-5, 5e-4], "ranks": 2}
    busy["wait_spread_s"] = [2e-5, 2e-4]
    alone = {**busy, "wait_spread_s": [1e-5, 1e-4], "ranks": 1}
    measured = {
        "compute": [-0.05, 0.05],
        "compute_together": [-0.1, 0.1],
        "comm": [-0.1, 0.1],
        "speedup": [-0.2, 0.1],
        "compute_shared": False,
        "step_bands": True,
        "source": "held-out steps",
    }

    def rec(error_model, readings=None):
        prof = profile(
            [{**base, "step_phases": busy, "step_phases_alone": alone}] * 2, alpha=1e-6, busbw=10e9, overlap=False
        )
        prof["error_model"] = error_model
        if readings:
            prof["placement"] = {"cpus": [0, 1], "readings_ns": readings, "wait_probe_ns": readings[1:3]}
        return selector_recommend.recommend(layers=list(layers), batch_size=batch, devices=[1, 2], profile=prof)

    timed, untimed = rec(measured), rec({**measured, "step_bands": False})
    assert [c["timing_spread_ms"] for c in timed["candidates"]] == [0.0, 0.0]
    assert all(c["timing_spread_ms"] > 0 for c in untimed["candidates"])
    one, two = timed["candidates"]
    assert math.log(two["speedup_interval"][1] / two["speedup_interval"][0]) / 2 == pytest.approx(0.15)
    assert untimed["candidates"][1]["speedup_interval"][0] < two["speedup_interval"][0]
    # the cores moved during the calibration: the wait joins the measured bands of several ranks
    moved = rec(measured, [52.0, 55.0, 61.0, 330.0])
    n_params = sum(i * o + o for i, o in zip(layers, layers[1:]))
    wait = perf._phases_to_core(busy, "busy").wait_at(n_params)
    assert moved["candidates"][1]["timing_spread_ms"] == pytest.approx(wait * 1e3, rel=1e-6)
    assert moved["candidates"][0]["timing_spread_ms"] == 0.0
    assert moved["candidates"][1]["speedup_interval"][0] < two["speedup_interval"][0]
    # a spread that is not a duration is refused with measured bands as without
    for bad in (-1e-5, float("nan")):
        busy["wait_spread_s"] = [2e-5, bad]
        for readings in (None, [52.0, 55.0, 61.0, 330.0]):
            with pytest.raises(mgpu.ConfigError, match="spreads >= 0"):
                rec(measured, readings)


def test_a_second_placements_wait_is_priced_beside_the_first_and_weighted_by_its_share():
    # topo probed the wait with the cores at 52-55 ns, and again at 330-335 ns, where it was 3x
    layers, batch = (64, 256, 256, 8), 256
    base = device(flops=1e11, bandwidth=50e9, kind="cpu")
    busy = {
        "params": [1e5, 1e6],
        "update_s": [1e-5, 1e-4],
        "wait_s": [5e-5, 5e-4],
        "wait_spread_s": [0.0, 0.0],
        "ranks": 2,
    }
    far = {**busy, "wait_s": [1.5e-4, 1.5e-3]}
    alone = {**busy, "ranks": 1}

    def calibration(share):
        prof = profile(
            [{**base, "step_phases": busy, "step_phases_other_placement": far, "step_phases_alone": alone}] * 2,
            alpha=1e-6,
            busbw=10e9,
            overlap=False,
        )
        prof["placement"] = {
            "cpus": [0, 1],
            "readings_ns": [50.0, 52.0, 55.0, 330.0, 335.0, 60.0],
            "wait_probe_ns": [52.0, 55.0],
            "other_wait_probe_ns": [330.0, 335.0],
            "other_share": share,
        }
        return prof

    prof = calibration(0.25)
    first, second = perf.placement_profile(prof, "first"), perf.placement_profile(prof, "second")
    assert [d["step_phases"] for d in second["devices"]] == [far, far]
    assert second["placement"]["wait_probe_ns"] == [330.0, 335.0] and second["placement"]["other_share"] == 0.0
    here, there, mixed = (predict(p, 2, layers, batch) for p in (first, second, prof))
    assert here.exposed_comm_s < mixed.exposed_comm_s < there.exposed_comm_s
    # a quarter of the time in the second placement: a quarter of the way to its wait
    assert mixed.exposed_comm_s == pytest.approx(0.75 * here.exposed_comm_s + 0.25 * there.exposed_comm_s, rel=1e-9)
    for share, pinned in ((0.0, here), (1.0, there)):
        assert predict(calibration(share), 2, layers, batch).step_s == pytest.approx(pinned.step_s, rel=1e-12)
    assert predict(prof, 1, layers, batch).step_s == predict(first, 1, layers, batch).step_s  # one rank: no wait
    rec = selector_recommend.recommend(layers=list(layers), batch_size=batch, devices=[1, 2], profile=prof)
    said = next(
        m
        for m in (
            re.search(
                r"2 ranks: ([\d.]+)x with the cores as the wait was first probed \(52-55 ns\), "
                r"([\d.]+)x as it was probed again \(330-335 ns\); priced at ([\d.]+)x, "
                r"as 25% of topo's readings found them in the second placement",
                r,
            )
            for r in rec["reasons"]
        )
        if m
    )
    assert float(said[1]) > float(said[3]) == round(rec["candidates"][1]["predicted_speedup"], 2) > float(said[2])
    # one placement probed: nothing to weigh, nothing to price beside it
    assert perf.placement_profile({**prof, "placement": None}, "second") is None
    assert perf.placement_profile({**prof, "placement": None}, "first")["placement"] is None
    for bad in (-0.1, 1.5, "half", None):
        with pytest.raises(mgpu.ConfigError, match="other_share must be in"):
            perf.to_core(calibration(bad))
    odd = calibration(0.5)
    odd["devices"][0]["step_phases_other_placement"] = {**far, "params": [2e5, 1e6]}
    with pytest.raises(mgpu.ConfigError, match="measured on the step_phases' parameter counts"):
        perf.to_core(odd)
    del odd["devices"][0]["step_phases_other_placement"]
    with pytest.raises(mgpu.ConfigError, match="second probe of the wait without every device"):
        perf.placement_profile(odd, "second")


GOOD_PLACEMENT = {
    "cpus": [0, 1],
    "readings_ns": [50.0, 52.0, 55.0, 330.0, 335.0],
    "wait_probe_ns": [52.0, 55.0],
    "other_wait_probe_ns": [330.0, 335.0],
    "other_share": 0.25,
}


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda p: p.pop("readings_ns"), "readings_ns must be a list"),
        (lambda p: p.update(readings_ns=[]), "readings_ns must be a list"),
        (lambda p: p.update(readings_ns=[50.0, -1.0]), "readings_ns must be a list"),
        (lambda p: p.update(readings_ns="123"), "readings_ns must be a list"),  # not read as [1, 2, 3]
        (lambda p: p.update(readings_ns=[50.0, float("nan")]), "readings_ns must be a list"),
        (lambda p: p.update(readings_ns=[50.0, True]), "readings_ns must be a list"),
        (lambda p: p.pop("wait_probe_ns"), "wait_probe_ns must be a list of 2"),
        (lambda p: p.update(wait_probe_ns=55.0), "wait_probe_ns must be a list of 2"),
        (lambda p: p.update(wait_probe_ns=["a", "b"]), "wait_probe_ns must be a list of 2"),
        (lambda p: p.update(other_wait_probe_ns=[]), "other_wait_probe_ns must be a list of 2"),
        (lambda p: p.update(other_wait_probe_ns=None), "other_wait_probe_ns must be a list of 2"),
        (lambda p: p.pop("other_share"), "other_share must be in"),
        (lambda p: p.update(other_share=True), "other_share must be in"),
        (lambda p: p.update(other_share=1.5), "other_share must be in"),
        (lambda p: p.update(other_share="half"), "other_share must be in"),
    ],
)
def test_a_malformed_placement_is_refused_in_one_line_everywhere_it_is_read(change, says):
    # a hand-edited calibration: to_core, recommend and bench's validation refuse it alike
    from mgpu.calibrate import bench

    placement = copy.deepcopy(GOOD_PLACEMENT)
    change(placement)
    prof = profile([{**device(kind="cpu"), "step_phases": phases(), "step_phases_other_placement": phases()}] * 2)
    prof["placement"] = placement
    for read in (
        lambda: perf.to_core(prof),
        lambda: selector_recommend.recommend(layers=[64, 256, 256, 8], batch_size=256, devices=[1, 2], profile=prof),
        lambda: bench._placement_against_calibration(
            {"core_round_trip_ns": [55.0, 56.0], "core_round_trip_cpus": [0, 1]}, prof
        ),
    ):
        with pytest.raises(mgpu.ConfigError, match=f"malformed \\(placement: {says}") as e:
            read()
        assert "\n" not in str(e.value) and str(e.value).count("malformed") == 1
    prof["placement"] = "here"
    with pytest.raises(mgpu.ConfigError, match="placement: not an object"):
        perf.to_core(prof)


def test_a_malformed_step_phases_table_is_refused_where_the_cores_moved_too():
    prof = profile([{**device(kind="cpu"), "step_phases": [1, 2]}] * 2)
    prof["placement"] = {k: v for k, v in GOOD_PLACEMENT.items() if "other" not in k}
    with pytest.raises(mgpu.ConfigError, match="malformed"):
        perf.to_core(prof)


def test_placement_moved_tells_two_placements_from_one_placements_noise():
    from mgpu.hostinfo import PLACEMENT_RATIO, placement_moved

    assert not placement_moved([]) and not placement_moved([52.0]) and not placement_moved([52.0, 65.0, 58.0])
    assert placement_moved([52.0, 330.0]) and placement_moved([330.0, 52.0, 340.0])
    assert not placement_moved([100.0, 100.0 * PLACEMENT_RATIO]) and placement_moved(
        [100.0, 100.0 * PLACEMENT_RATIO + 1]
    )


def test_core_round_trip_is_measured_between_two_cpus_and_refuses_others():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:  # CI's machines have 2 cores
        ns = [mgpu._core.core_round_trip_ns(cpus[0], cpus[1], batches=8) for _ in range(3)]
        assert all(5.0 < t < 1e5 for t in ns), ns  # a cache line there and back: tens to hundreds of ns
    for a, b, message in (
        (0, 0, "two different CPUs"),
        (-1, 0, "two different CPUs"),
        (0, 1 << 20, "two different CPUs"),
        (0, max(cpus) + 1, "cannot run a thread on CPU"),
    ):
        with pytest.raises(mgpu.ConfigError, match=message):
            mgpu._core.core_round_trip_ns(a, b)
    with pytest.raises(mgpu.ConfigError, match="batches"):
        mgpu._core.core_round_trip_ns(0, 1, batches=0)
    for timeout in (0.0, -1.0, float("nan"), float("inf"), 1e10):  # 1e10 s overflowed the deadline
        with pytest.raises(mgpu.ConfigError, match="timeout_s"):
            mgpu._core.core_round_trip_ns(0, 1, timeout_s=timeout)


def test_a_failed_reading_of_the_cores_is_unknown_not_an_error(monkeypatch):
    # a diagnosis: whatever the probe raises (a refused CPU, a thread that could not start),
    # rank 0 reports no reading and goes on to the barrier the other ranks wait in
    from mgpu.train.process_group import ProcessGroup

    pg = ProcessGroup(comm=None)
    pg.size, pg.hosts = 2, [pg.hosts[0]] * 2
    monkeypatch.setattr(pg, "allgather", lambda obj, what="": [[0, 1], [0, 1]])
    for error in (RuntimeError("thread"), mgpu.DeviceError("no answer"), mgpu.ConfigError("CPU 1 refused")):

        def fail(a, b, error=error):
            raise error

        monkeypatch.setattr(mgpu._core, "core_round_trip_ns", fail)
        assert pg.core_round_trip_ns() is None
    monkeypatch.setattr(mgpu._core, "core_round_trip_ns", lambda a, b: 60.0)
    assert pg.core_round_trip_ns() == {"cpus": [0, 1], "ns": 60.0}
    # the first pair of different CPUs the two may run on: rank 0 on {0, 1}, its peer on {0} only
    monkeypatch.setattr(pg, "allgather", lambda obj, what="": [[0, 1], [0]])
    assert pg.core_round_trip_ns() == {"cpus": [1, 0], "ns": 60.0}
    monkeypatch.setattr(pg, "allgather", lambda obj, what="": [[0], [0]])
    assert pg.core_round_trip_ns() is None  # one CPU between them: nothing to measure


@pytest.mark.parametrize("width", [1000, 2000])  # at 2000 each layer fills four 4 MiB buckets
def test_one_rank_read_from_a_multi_rank_wait_leaves_its_allreduce_out(width):
    # no alone table (a hand-made or merged profile): the 2-rank wait holds an allreduce
    layers, batch = (width, width, width), 64
    n_params = 2 * (width * width + width)
    base = device(flops=1e12, bandwidth=50e9, kind="cpu")
    prof = profile([{**base, "step_phases": phases()}] * 2, alpha=1e-5, busbw=50e9, overlap=False)
    t, two = perf._phases_to_core(phases(), "t"), predict(prof, 2, layers, batch)
    reference = two.comm_s  # the same default buckets at the calibration's 2 ranks
    assert 0 < reference < t.wait_at(n_params)
    one = predict(prof, 1, layers, batch)
    assert one.optimizer_s == pytest.approx(t.update_at(n_params) + t.wait_at(n_params) - reference, rel=1e-9)


def test_step_phases_count_only_where_every_device_has_them():
    # a device without them would add its modelled health check beside the measured wait
    layers, batch = (1000, 1000, 1000), 64
    base = device(flops=1e12, bandwidth=50e9, kind="cpu")
    link = dict(alpha=1e-5, busbw=5e9, overlap=False, sync=1e-4)
    mixed = profile([{**base, "step_phases": phases()}, {**base, "name": "other"}], **link)
    plain = profile([base, {**base, "name": "other"}], **link)
    got, want = predict(mixed, 2, layers, batch), predict(plain, 2, layers, batch)
    assert got.step_s == pytest.approx(want.step_s, rel=1e-12) and got.exposed_comm_s == want.exposed_comm_s
    assert got.optimizer_s == pytest.approx(want.optimizer_s, rel=1e-12)
    assert (
        predict(mixed, 1, layers, batch).optimizer_s != predict(plain, 1, layers, batch).optimizer_s
    )  # alone: its own


def test_layer_and_phase_lookups_without_a_table_are_errors_not_crashes():
    with pytest.raises(mgpu.ConfigError, match="layer times"):
        P.LayerTimes().forward_s(1, 1, 1)
    with pytest.raises(mgpu.ConfigError, match="step phases"):
        P.StepPhases().update_at(1.0)


def test_dropout_timer_checks_its_input_and_times_the_training_kernel():
    """topo's dropout cost: the binding refuses impossible shapes and probabilities with a
    ConfigError, and times one call per repeat."""
    from mgpu import _core

    backend = _core.make_backend("cpu", 0, 1)
    times = _core.time_relu_dropout(backend, 4, 16, 0.3, 3)
    assert len(times) == 3 and all(t > 0 for t in times)
    for rows, cols, p in ((0, 16, 0.3), (4, 0, 0.3), (4, 16, 1.0), (4, 16, -0.1)):
        with pytest.raises(mgpu.ConfigError):
            _core.time_relu_dropout(backend, rows, cols, p, 3)


def test_training_memory_is_the_selectors_memory_of_one_device():
    # train refuses a run that cannot fit with this figure: it must be predict's, less
    # the device's context, and grow with the optimizer's state and the rows.
    prof = perf.named_profile("h100-sxm-8", 1)
    hw = perf.to_core(prof, 1)
    for optimizer, rows in (("sgd", 64), ("adamw", 64), ("adamw", 4096)):
        w = workload.build_workload(None, [50, 1024, 1024, 3], None, rows, "fp32", optimizer, 4.0)
        predicted = P.predict(w, hw, 1, P.Options()).memory_bytes - hw.devices[0].context_bytes
        assert memory.training_memory_bytes([50, 1024, 1024, 3], rows, optimizer=optimizer) == pytest.approx(predicted)
    small = memory.training_memory_bytes([50, 1024, 1024, 3], 64, optimizer="sgd")
    assert memory.training_memory_bytes([50, 1024, 1024, 3], 64, optimizer="adamw") > small
    assert memory.training_memory_bytes([50, 1024, 1024, 3], 4096, optimizer="sgd") > small


# --- captured steps (CUDA graphs) ------------------------------------------------------
SMALL = (64, 256, 256, 10)  # 3 layers, 85K parameters: captured under auto on GPUs


def graph_predict(prof, n, mode, layers=SMALL, batch=512, precision="fp32", accumulate=1):
    # 64 kB buckets: a bucket per layer, the later ones ready before backward ends
    w = workload.build_workload(
        None, list(layers), None, batch, precision, "sgd", 0.0625, cuda_graph=mode, accumulate=accumulate
    )
    return P.predict(w, perf.to_core(prof), n, P.Options())


def graph_kernels(layers, batch, ranks, precision, accumulate=1):
    """Kernels and GEMMs a captured step runs inside its graphs, and the launches of the
    graphs themselves with their argument updates, as the cost sheet lists the CUDA
    backend's step (its counts match the emulated GPU's, tests/emulation)."""
    ops = costsheet.step_ops(
        costsheet.Workload(
            list(layers), batch, precision=precision, optimizer="sgd", graph=True, ranks=ranks, accumulate=accumulate
        )
    )
    inside = sum(o.count for o in ops if o.in_graph and o.kind in ("kernel", "gemm"))
    return inside, 2 * costsheet.counts(ops)["graph_launches"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
# the bias gradients' column sums: one launch, or two (at 128 rows only for the whole share)
@pytest.mark.parametrize("batch", [64, 128, 512])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_captured_steps_price_kernels_as_graph_nodes_and_allreduce_after_backward(precision, batch, accumulate):
    node = 0.5e-6
    kernels = lambda p: p.forward_s + p.backward_s + p.optimizer_s
    for launch in (5e-6, 1.0):  # shorter than the larger kernels' work; longer than any
        gpu = {**device(launch=launch), "graph_node_s": node}
        prof = profile([gpu] * 2, alpha=1e-6, busbw=1e10, overlap=True)
        for n in (1, 2):
            on, off, auto = (
                graph_predict(prof, n, mode, batch=batch, precision=precision, accumulate=accumulate)
                for mode in ("on", "off", "auto")
            )
            assert on.graphs and auto.graphs and not off.graphs
            assert auto.step_s == pytest.approx(on.step_s)
            inside, graph_launches = graph_kernels(SMALL, batch, n, precision, accumulate)
            # In a graph each kernel costs its work and a node; launched on its own, its work
            # or a launch, whichever is longer (the host enqueues while a longer one runs).
            work = kernels(on) - inside * node
            assert work > 0 and kernels(on) == pytest.approx(
                kernels(
                    graph_predict(
                        profile([{**gpu, "launch_overhead_s": node}] * 2, alpha=1e-6, busbw=1e10),
                        n,
                        "on",
                        batch=batch,
                        precision=precision,
                        accumulate=accumulate,
                    )
                )
            )  # a launch's cost does not reach inside, even equal
            if launch == 1.0:
                assert kernels(off) == pytest.approx(inside * launch, rel=1e-9)
            else:
                assert max(work, inside * launch) * (1 - 1e-9) <= kernels(off) < work + inside * launch
            # the graphs' own launches are overhead
            assert on.overhead_s - off.overhead_s == pytest.approx(graph_launches * launch, rel=1e-6)
    on, off = graph_predict(prof, 2, "on", batch=batch), graph_predict(prof, 2, "off", batch=batch)
    assert on.comm_s == pytest.approx(off.comm_s)
    assert on.exposed_comm_s == pytest.approx(on.comm_s)  # nothing hidden behind backward
    assert off.exposed_comm_s < 0.9 * off.comm_s


@pytest.mark.parametrize("resident, bandwidth", [(True, 1e9), (False, 1e8), (False, 1e11)])
@pytest.mark.parametrize("mode", ["on", "off"])
@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_steps_inputs_are_each_micro_batchs_rows_and_targets_and_the_stop_flag(
    mode, accumulate, ranks, resident, bandwidth
):
    # Outside any graph: a launch for the stop flag and for each micro-batch's rows and
    # targets, and their bytes: over the host link where copied, a read and a write in the
    # GPU's memory where gathered from a resident training set, as the cost sheet lists them
    # (its counts match the emulated GPU's, tests/emulation).
    launch, memory, overhead, batch = 5e-6, 1e12, 1e-4, 512
    gpu = {**device(launch=launch, bandwidth=memory), "graph_node_s": 0.5e-6, "host_to_device_bandwidth": bandwidth}
    w = workload.build_workload(
        None,
        list(SMALL),
        None,
        batch,
        "fp32",
        "sgd",
        0.0625,
        cuda_graph=mode,
        accumulate=accumulate,
        data_on_device=resident,
    )
    p = P.predict(w, perf.to_core(profile([gpu] * 2, overhead=overhead)), ranks, P.Options())
    ops = costsheet.step_ops(
        costsheet.Workload(
            list(SMALL),
            batch,
            optimizer="sgd",
            graph=mode == "on",
            ranks=ranks,
            accumulate=accumulate,
            data_on_device=resident,
        )
    )
    inputs = [o for o in ops if o.family in ("stop flag", "input copy", "input gather")]
    assert {o.kind for o in inputs} == ({"memset", "kernel"} if resident else {"memset", "h2d", "d2d"})
    if resident:  # gathered: each row read and written in the GPU's memory
        moved = sum(o.count * o.bytes for o in inputs if o.kind == "kernel") / memory
    else:  # prefetched beside the step before (what its compute cannot hide), then copied within the GPU
        crossing = sum(o.count * o.bytes for o in inputs if o.kind == "h2d") / bandwidth
        within = sum(2 * o.count * o.bytes for o in inputs if o.kind == "d2d") / memory
        moved = max(0.0, crossing - (p.forward_s + p.backward_s + p.optimizer_s)) + within
        # a slow link shows through the step before; a fast one hides behind it
        assert (crossing > p.forward_s + p.backward_s + p.optimizer_s) == (bandwidth < 1e9)
    launched = sum(o.count for o in inputs)  # the host enqueues the prefetch's copies too
    graph_launches = graph_kernels(SMALL, batch, ranks, "fp32", accumulate)[1] if mode == "on" else 0
    expected = (launched + graph_launches) * launch + moved
    assert p.overhead_s - overhead == pytest.approx(expected, rel=1e-4)


def test_graph_mode_auto_follows_the_training_step_rule():
    gpu, cpu = {**device(launch=5e-6), "graph_node_s": 1e-6}, device(launch=5e-6, kind="cpu")
    big = (4096, 4096, 10)  # above StepOptions::kGraphAutoMaxParams
    assert 4096 * 4096 + 4096 + 4096 * 10 + 10 > costsheet.GRAPH_AUTO_MAX_PARAMS
    assert not graph_predict(profile([gpu] * 2), 2, "auto", layers=big).graphs
    # at most 2^24 parameters, as DataParallelStep decides: 4095 x 4096 + 4096 is exactly 2^24
    assert 4095 * 4096 + 4096 == costsheet.GRAPH_AUTO_MAX_PARAMS
    assert graph_predict(profile([gpu] * 2), 2, "auto", layers=(4095, 4096)).graphs
    assert not graph_predict(profile([gpu] * 2), 2, "auto", layers=(4096, 4096)).graphs
    assert graph_predict(profile([gpu] * 2), 2, "on", layers=big).graphs
    assert not graph_predict(profile([cpu] * 2), 2, "auto").graphs  # host backends: only when asked
    assert graph_predict(profile([cpu] * 2), 2, "on").graphs
    # Calibrations from before topo measured it: a GPU's nodes at the published figure,
    # a CPU's recorded calls at its launch cost.
    assert perf.to_core(profile([device(launch=5e-6)])).devices[0].graph_node_s == hardware.GRAPH_NODE_S
    plain = profile([device(launch=5e-6, kind="cpu")] * 2)
    assert graph_predict(plain, 1, "on").forward_s == pytest.approx(graph_predict(plain, 1, "off").forward_s)
    # A device topo could not capture on: training under auto runs it uncaptured.
    failed = {**gpu, "captures": False}
    assert not graph_predict(profile([failed] * 2), 2, "auto").graphs
    assert graph_predict(profile([failed] * 2), 2, "on").graphs
    with pytest.raises(mgpu.ConfigError, match="graph-node"):
        graph_predict(profile([{**gpu, "graph_node_s": -1e-6}] * 2), 2, "on")


def test_recommend_says_when_steps_replay_as_graphs_and_when_overlap_would_beat_them():
    gpu = {**device(flops=2e13, launch=5e-6), "graph_node_s": 0.5e-6}
    layers = [1024, 1024, 1024, 1024, 10]

    def answer(busbw, mode="auto"):
        return selector_recommend.recommend(
            layers=layers,
            batch_size=4096,
            devices=[1, 2],
            cuda_graph=mode,
            profile=profile([gpu] * 2, alpha=1e-5, busbw=busbw, overlap=True),
        )

    r, off = answer(1e10), answer(1e10, "off")
    assert all(c["cuda_graph"] for c in r["candidates"]) and not any(c["cuda_graph"] for c in off["candidates"])
    assert any("replay as CUDA graphs" in line and "follows backward" in line for line in r["reasons"])
    assert not any("CUDA graph" in line for line in off["reasons"])
    # 2 GPUs with graphs win, and 2 without them would win by more: said, against the pick.
    assert r["devices"] == 2 and off["devices"] == 2
    assert off["candidates"][1]["predicted_step_ms"] < 0.98 * r["candidates"][1]["predicted_step_ms"]
    advice = [line for line in r["reasons"] if line.startswith("--cuda-graph off would be faster")]
    assert advice == [
        f"--cuda-graph off would be faster: 2 GPUs at {off['candidates'][1]['predicted_step_ms']:.2f} "
        f"ms a step against {r['candidates'][1]['predicted_step_ms']:.2f} ms for 2 GPUs with graphs, "
        f"the allreduce overlapping backward ({off['candidates'][1]['exposed_allreduce_ms']:.3g} ms "
        "exposed)"
    ], advice
    # A slower link: 2 GPUs without graphs beat 2 with them, but not the 1 GPU picked: no advice.
    r, off = answer(4e9), answer(4e9, "off")
    assert off["candidates"][1]["predicted_step_ms"] < r["candidates"][1]["predicted_step_ms"]
    assert r["devices"] == 1 and off["candidates"][1]["predicted_step_ms"] > r["candidates"][0]["predicted_step_ms"]
    assert not any(line.startswith("--cuda-graph off") for line in r["reasons"])


def test_named_gpu_profiles_carry_the_published_graph_node_time_and_its_source():
    prof = perf.named_profile("h100-sxm-8")
    assert all(d["graph_node_s"] == hardware.GRAPH_NODE_S for d in prof["devices"])
    assert any(s["url"] == hardware.GRAPH_NODE_SOURCE for s in prof["sources"])
    assert perf.to_core(prof).devices[0].graph_node_s == hardware.GRAPH_NODE_S


def test_graph_replay_timer_checks_its_input_and_topo_measures_a_node_cost():
    from mgpu import _core
    from mgpu.calibrate import topo

    be = _core.make_backend("cpu", 0, 1)
    with pytest.raises(mgpu.ConfigError, match="nodes"):
        _core.time_graph_replay(be, 0, 3)
    times = _core.time_graph_replay(be, 16, 4)
    assert len(times) == 4 and all(t > 0 for t in times)
    node = topo.measure_graph_node(be, quick=True)
    assert math.isfinite(node) and node >= 0


def test_cold_layer_timings_sweep_the_cache_and_topo_times_them_where_weights_are_large(monkeypatch):
    from mgpu import _core, hostinfo
    from mgpu.calibrate import topo

    be = _core.make_backend("cpu", 0, 1)
    for times in (
        _core.time_linear(be, 4, 256, 256, 3, sweep_bytes=4 << 20),
        _core.time_linear_backward(be, 4, 256, 256, 3, input_gradient=False, sweep_bytes=4 << 20),
    ):
        assert len(times) == 3 and min(times) > 0
    monkeypatch.setattr(topo, "LAYER_ROWS_QUICK", (1, 512))
    grid = topo.measure_layer_times(be, quick=True, cache_bytes=1 << 20)
    widths, cells = grid["widths"], len(grid["rows"]) * len(grid["widths"]) ** 2
    assert all(len(grid[f"{k}_cold"]) == cells for k in ("forward", "backward", "backward_weights"))
    for n, (r, i, o) in enumerate((r, i, o) for r in grid["rows"] for i in widths for o in widths):
        timed = 4 * i * o >= topo.COLD_MIN_WEIGHT_BYTES and r <= topo.COLD_MAX_ROWS
        # elsewhere the warm time stands for the cold one
        assert (grid["forward_cold"][n] == grid["forward"][n]) != timed, (r, i, o)
    assert "forward_cold" not in topo.measure_layer_times(be, quick=True)  # no cache size: warm only
    assert hostinfo.last_level_cache_bytes() >= 0


def test_a_device_that_cannot_capture_is_marked_and_priced_uncaptured(monkeypatch, capsys):
    from mgpu import _core
    from mgpu.calibrate import topo

    def cannot(*args):
        raise mgpu.ConfigError("the test backend cannot capture")

    monkeypatch.setattr(_core, "time_graph_replay", cannot)
    assert topo.measure_graph_node(_core.make_backend("cpu", 0, 1), quick=True) is None
    err = capsys.readouterr().err
    assert err.startswith("mgpu: warning: topo: capturing a graph failed (the test backend cannot capture)")
    assert err.count("\n") == 1


@pytest.mark.parametrize("mode, captured", [(None, True), ("off", False), ("on", True)])
def test_recommend_cli_takes_the_training_graph_mode(mode, captured, tmp_path, capfd):
    from mgpu.commands import main as cli

    out = tmp_path / "r.json"
    argv = ["recommend", "--profile", "h100-sxm-8", "--model", "medium", "--batch-size", "256", "--json", str(out)]
    assert cli.main(argv + (["--cuda-graph", mode] if mode else [])) == 0
    r = json.loads(out.read_text())
    assert [c["cuda_graph"] for c in r["candidates"]] == [captured, captured]
    assert ("replay as CUDA graphs" in capfd.readouterr().out) == captured
    with pytest.raises(cli.UsageError, match="argument --cuda-graph: invalid choice"):
        cli.build_parser().parse_args(argv + ["--cuda-graph", "sometimes"])


def test_accumulated_micro_batches_share_the_rows_and_only_the_last_backward_overlaps():
    # No launch cost and a rate independent of the work: splitting the rows changes no
    # compute, so what moves is the overlap (the earlier micro-batches' backwards come
    # before any bucket) and the activations (one micro-batch's).
    prof = profile([device(flops=1e12, bandwidth=1e12)] * 2, alpha=1e-6, busbw=4e9, overlap=True)

    def at(k):
        w = workload.build_workload(
            None, [256, 1024, 1024, 1024, 10], None, 4094, "fp32", "sgd", 1.0, cuda_graph="off", accumulate=k
        )
        return P.predict(w, perf.to_core(prof), 2, P.Options())

    one, four = at(1), at(4)  # 2047 rows a device: micro-batches of 511 and 512
    assert four.forward_s + four.backward_s == pytest.approx(one.forward_s + one.backward_s, rel=1e-9)
    assert four.comm_s == pytest.approx(one.comm_s)
    assert one.exposed_comm_s < 0.9 * one.comm_s  # hidden behind the whole backward
    assert four.exposed_comm_s > one.exposed_comm_s  # only behind the last quarter of it
    assert four.memory_bytes < one.memory_bytes
    # activations for the largest micro-batch (512 rows), as one step of 512 rows a device holds
    w = workload.build_workload(None, [256, 1024, 1024, 1024, 10], None, 1024, "fp32", "sgd", 1.0, cuda_graph="off")
    assert four.memory_bytes == pytest.approx(P.predict(w, perf.to_core(prof), 2, P.Options()).memory_bytes, rel=1e-12)
    assert at(10**6).step_s > 0  # more micro-batches than rows: one row each
    # priced per micro-batch size, not one by one: 2^61 micro-batches take no time to price
    w = workload.build_workload(None, [8, 8], None, 2**62, "fp32", "sgd", 1.0, accumulate=2**61 + 1)
    assert math.isfinite(P.predict(w, perf.to_core(prof), 2, P.Options()).step_s)
    for bad in (0, 2.0, True, "3"):
        with pytest.raises(mgpu.ConfigError, match=f"accumulate.*got {bad!r}"):
            at(bad)


def test_a_gemm_costs_its_memory_traffic_where_that_is_longer_than_its_work():
    # 8 rows against a 8192 x 8192 weight matrix: 1 GFLOP at 1 PFLOP/s is 1 us, reading
    # the 268 MB of fp32 weights at 1 TB/s 268 us. Backward's two GEMMs read the weights
    # (input gradient) and write the weight gradient.
    fast = profile([device(flops=1e15, bandwidth=1e12)])
    layer = 8192 * 8192 * 4 / 1e12
    one = predict(fast, 1, layers=(8192, 8192), batch=8)
    assert layer < one.forward_s < 1.01 * layer
    assert layer < one.backward_s < 1.01 * layer  # the first layer has no input gradient: dW only
    # with --accumulate 2 the second micro-batch's weight gradient adds onto the first's: read and written
    w = workload.build_workload(None, [8192, 8192], None, 16, "fp32", "sgd", 4.0, accumulate=2)
    two = P.predict(w, perf.to_core(fast), 1, P.Options())
    assert two.backward_s == pytest.approx(one.backward_s + 2 * layer, rel=0.01)


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_the_step_overhead_is_the_probes_step_less_its_priced_work(kind):
    # topo's probe (a step of PROBE_LAYERS at PROBE_ROWS) measures its own GEMMs, kernels
    # and update too, which every predicted step prices already: calibrated, the model
    # predicts the probe's step as measured, and no overhead goes below zero.
    slow = {**device(flops=1e9, bandwidth=1e9, launch=2e-6, kind=kind), "graph_node_s": 1e-6}
    w = workload.build_workload(None, perf.PROBE_LAYERS, None, perf.PROBE_ROWS, "fp32", "sgd", 4.0, 0.0)
    for measured in (1e-3, 1e-6):
        prof = profile([{**slow, "step_overhead_s": measured}] * 2, overhead=measured)
        perf.net_step_overheads(prof)
        priced = P.predict(w, perf.to_core(prof), 1, P.Options()).step_s
        for dev in prof["devices"]:
            assert dev["probe_step_s"] == measured
        if measured == 1e-3:
            assert 0 < prof["step_overhead_s"] < measured and priced == pytest.approx(measured, rel=1e-9)
        else:  # the probe ran faster than its work's price: nothing left over
            assert prof["step_overhead_s"] == 0 and priced > measured
        before = prof["step_overhead_s"]
        perf.net_step_overheads(prof)  # again: from the probe's time, not from the last result
        assert prof["step_overhead_s"] == before


def test_a_calibration_from_before_the_netting_is_netted_on_load(tmp_path):
    # topo wrote the probe's whole step as the overhead until the probe's priced work was
    # taken out: loading such a profile nets it (in memory; the file stays as it was)
    slow = {**device(flops=1e9, bandwidth=1e9, launch=2e-6, kind="cuda"), "step_overhead_s": 1e-3}
    old = {**profile([slow] * 2, overhead=1e-3), "source": "calibrated"}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = perf.load_profile(str(path))
    assert [d["probe_step_s"] for d in loaded["devices"]] == [1e-3, 1e-3]
    assert 0 < loaded["step_overhead_s"] < 1e-3
    assert json.loads(path.read_text()) == old
    again = tmp_path / "new.json"
    again.write_text(json.dumps(loaded))  # netted already: loading it again changes nothing
    assert perf.load_profile(str(again)) == loaded
    named = {**old, "source": "named"}  # published figures carry no probe: left as they are
    path.write_text(json.dumps(named))
    assert perf.load_profile(str(path))["step_overhead_s"] == 1e-3


def test_half_precision_updates_write_the_weights_half_copy_in_the_same_kernel():
    # 2 B a parameter more for the update's pass (csrc/cuda's optimizer writes the bf16
    # copy the next step's GEMMs read), and no launch more
    gpu = {**device(flops=1e12, bandwidth=1e11, launch=5e-6), "bf16": {"peak_flops": 1e13, "half_work_flops": 0.0}}
    layers, params = (1024, 4096, 4096, 10), 1024 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 10 + 10

    def optimizer(precision):
        w = workload.build_workload(None, list(layers), None, 256, precision, "sgd", 4.0, 0.0, cuda_graph="off")
        return P.predict(w, perf.to_core(profile([gpu])), 1, P.Options()).optimizer_s

    assert optimizer("bf16") - optimizer("fp32") == pytest.approx(2 * params / 1e11, rel=1e-9)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_memory_bound_forward_moves_the_bytes_the_cuda_backend_moves(precision):
    # GEMMs at an unbounded rate cost their operands' and output's traffic; the passes: bias
    # (4 B an output), ReLU (fp32 read and written, + the half copy the next GEMM reads:
    # 10 B, else 8), the input's half copy (fp32 read, half written: 6 B), the loss (12 B)
    gpu = {**device(flops=1e30, bandwidth=1e9), "bf16": {"peak_flops": 1e30, "half_work_flops": 0.0}}
    IN, H, OUT, R = 64, 256, 10, 32
    w = workload.build_workload(None, [IN, H, OUT], None, R, precision, "sgd", 4.0, 0.0, cuda_graph="off")
    half = precision == "bf16"
    eb = 2 if half else 4
    moved = (
        (H * IN + R * IN) * eb
        + 8 * R * H
        + 4 * R * H
        + (10 if half else 8) * R * H  # layer 1 and its ReLU
        + (OUT * H + R * H) * eb
        + 8 * R * OUT
        + 4 * R * OUT  # layer 2
        + (6 * R * IN if half else 0)
        + 12 * R * OUT
    )  # input copy, loss
    assert P.predict(w, perf.to_core(profile([gpu])), 1, P.Options()).forward_s == pytest.approx(moved / 1e9, rel=1e-9)


def test_a_calibration_of_emulated_gpus_is_told_from_a_real_ones():
    here = mgpu.gpus_emulated("cuda")
    assert not mgpu.gpus_emulated("cpu")
    emulated = {"gpu_emulation": True, "devices": [{"name": "x", "kind": "cuda"}]}
    legacy = {"devices": [{"name": "Emulated GPU 1 (mgpu CPU emulation, not a real GPU)", "kind": "cuda"}]}
    real = {"gpu_emulation": False, "devices": [{"name": "NVIDIA H100 80GB HBM3", "kind": "cuda"}]}
    assert perf.profile_is_emulated(emulated) and perf.profile_is_emulated(legacy)
    assert not perf.profile_is_emulated(real) and not perf.profile_is_emulated({"devices": [{"name": "H100"}]})
    for prof in (emulated, legacy, real):
        why = perf.emulation_mismatch(prof, "cuda")
        assert (why is None) == (perf.profile_is_emulated(prof) == here)
        if why:
            assert "measured on" in why and "MGPU_EMULATE_GPU" in why
        assert perf.emulation_mismatch(prof, "cpu") is None  # a CPU job: no GPU to mistake


# --- memory on unequal devices -----------------------------------------------------------
def _need(fast_memory, slow_memory, batch=4000):
    fast = device(flops=3e12, memory=fast_memory, name="fast")
    slow = device(flops=1e12, memory=slow_memory, name="slow")
    return predict(profile([fast, slow]), 2, batch=batch)


def test_unequal_devices_each_hold_their_own_share_against_their_own_memory():
    # the fast device takes 3/4 of the rows, so it needs more memory than the slow one;
    # a capacity so large its load is ~0 leaves the other device the tightest
    fast_need = _need(1e12, 1e30).memory_bytes
    slow_need = _need(1e30, 1e12).memory_bytes
    assert fast_need > slow_need * 1.2
    margin = P.Options().memory_margin
    # the slow device holds its share but not the fast one's: it fits (a check of the
    # largest need against the smallest memory said no)
    slow_memory = (fast_need + slow_need) / 2 / margin
    p = _need(1e30, slow_memory)
    assert p.memory_fits
    assert p.memory_bytes == pytest.approx(slow_need) and p.memory_usable_bytes == pytest.approx(slow_memory * margin)
    # each device short of its own share: not fitting, whichever it is
    assert not _need(1e30, slow_need / margin * 0.9).memory_fits
    assert not _need(fast_need / margin * 0.9, 1e30).memory_fits
    # the report names the device nearest its capacity, here the fast one
    tight = _need(fast_need / margin * 1.01, 1e30)
    assert tight.memory_fits and tight.memory_bytes == pytest.approx(fast_need)


def test_recommend_says_which_device_its_memory_figure_is_and_when_only_one_fits():
    fast_need = _need(1e12, 1e30).memory_bytes
    slow_need = _need(1e30, 1e12).memory_bytes
    margin = P.Options().memory_margin
    fast = device(flops=3e12, memory=1e30, name="fast")
    layers = (1024, 4096, 4096, 10)
    fits = selector_recommend.recommend(
        layers=layers,
        batch_size=4000,
        devices=[1, 2],
        optimizer="sgd",
        bucket_mb=4.0,
        profile=profile([fast, device(flops=1e12, memory=(fast_need + slow_need) / 2 / margin, name="slow")]),
    )
    two = [c for c in fits["candidates"] if c["devices"] == 2][0]
    assert two["memory_fits"]
    memory_lines = [r for r in fits["reasons"] if r.startswith("memory:")]
    assert len(memory_lines) == 1 and (" on the device nearest its capacity" in memory_lines[0]) == (
        fits["devices"] == 2
    ), fits["reasons"]
    # a second device too small for its share: one device, and that is why
    short = selector_recommend.recommend(
        layers=layers,
        batch_size=4000,
        devices=[1, 2],
        optimizer="sgd",
        bucket_mb=4.0,
        profile=profile([fast, device(flops=1e12, memory=slow_need / margin * 0.5, name="slow")]),
    )
    assert short["strategy"] == "single_gpu" and short["devices"] == 1
    assert "no multi-device candidate fits in memory" in short["reasons"], short["reasons"]
    alone = selector_recommend.recommend(layers=layers, batch_size=4000, devices=[1], profile=profile([fast]))
    assert "no multi-device candidate to compare with" in alone["reasons"]
    equal = selector_recommend.recommend(layers=layers, batch_size=4000, devices=[1, 2], profile=profile([fast, fast]))
    assert any(r.startswith("memory:") and " per device" in r for r in equal["reasons"])


@pytest.mark.parametrize(
    "kwargs, given", [(dict(precision="bf16"), "--precision bf16"), (dict(grad_dtype="bf16"), "--grad-dtype bf16")]
)
def test_a_cpu_profile_refuses_what_train_on_cpus_refuses(kwargs, given):
    cpu = profile([device(kind="cpu", name="cpu")] * 2)
    with pytest.raises(mgpu.ConfigError, match=f"{given}: profile 'test' is of CPUs"):
        selector_recommend.recommend(layers=[16, 16], batch_size=64, devices=[1, 2], profile=cpu, **kwargs)
    gpu = selector_recommend.recommend(
        layers=[16, 16], batch_size=64, devices=[1, 2], profile=profile([device()] * 2), **kwargs
    )
    assert gpu["strategy"]


def test_device_counts_beyond_the_models_reach_are_refused_before_a_profile_is_built():
    with pytest.raises(
        mgpu.ConfigError, match=f"--devices: at most {selector_recommend.MAX_DEVICES} devices, got 100000"
    ):
        selector_recommend.recommend(model="medium", batch_size=64, devices=[1, 100000], profile="h100-sxm-8")


# --- a sharded optimizer (ZeRO stage 1: Workload.shard_optimizer) ---------------------
def sharded_pair(prof, n, layers=(1024, 4096, 4096, 10), batch=4096, optimizer="adamw", **kw):
    """(unsharded, sharded) predictions of the same step on n devices."""
    hw = prof if isinstance(prof, P.HardwareProfile) else perf.to_core(prof)
    return tuple(
        P.predict(
            workload.build_workload(None, list(layers), None, batch, "fp32", optimizer, 4.0, shard_optimizer=s, **kw),
            hw,
            n,
            P.Options(),
        )
        for s in (False, True)
    )


FIELDS = ("step_s", "forward_s", "backward_s", "optimizer_s", "overhead_s", "comm_s", "exposed_comm_s", "memory_bytes")


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sharding_on_one_device_changes_nothing(optimizer):
    plain, sharded = sharded_pair(perf.named_profile("h100-sxm-8", 1), 1, optimizer=optimizer)
    assert not sharded.sharded and sharded.gather_s == 0
    assert [getattr(sharded, f) for f in FIELDS] == [getattr(plain, f) for f in FIELDS]
    w = workload.build_workload(None, [1024, 4096, 10], None, 64, "fp32", optimizer, 4.0, shard_optimizer=True)
    assert P.training_memory_bytes(w, 64, 1) == P.training_memory_bytes(w, 64)
    assert P.optimizer_state_bytes(w, 1) == (4 if optimizer == "sgd" else 8) * (1024 * 4096 + 4096 + 4096 * 10 + 10)


@pytest.mark.parametrize("optimizer, per_param", [("sgd", 4), ("adamw", 8)])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_sharded_memory_drops_by_all_but_one_nth_of_the_optimizer_state(optimizer, per_param, n):
    layers = (1024, 4096, 4096, 10)
    params = 1024 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 10 + 10
    plain, sharded = sharded_pair(perf.named_profile("h100-sxm-8", n), n, layers=layers, optimizer=optimizer)
    state = per_param * params
    assert sharded.sharded and not plain.sharded
    assert (plain.optimizer_state_bytes, sharded.optimizer_state_bytes) == (state, state / n)
    assert plain.memory_bytes - sharded.memory_bytes == pytest.approx(state * (n - 1) / n, rel=1e-12)
    # training_memory_bytes with the device count says the same (it leaves the context and buffers out)
    w = workload.build_workload(None, list(layers), None, 512, "fp32", optimizer, 4.0, shard_optimizer=True)
    unsharded = workload.build_workload(None, list(layers), None, 512, "fp32", optimizer, 4.0)
    assert P.training_memory_bytes(unsharded, 512, n) - P.training_memory_bytes(w, 512, n) == pytest.approx(
        state * (n - 1) / n, rel=1e-12
    )
    assert memory.optimizer_state_bytes(list(layers), optimizer=optimizer, optimizer_shards=n) == state / n


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("n", [2, 4])
def test_a_sharded_update_takes_one_nth_of_the_time(optimizer, n):
    # no launch cost, one bandwidth for every size: the update and the health check's
    # sum of squares are bytes over the bandwidth, and a shard has 1/n of the bytes
    plain, sharded = sharded_pair(profile([device()] * n), n, optimizer=optimizer, cuda_graph="off")
    assert sharded.optimizer_s == pytest.approx(plain.optimizer_s / n, rel=1e-12)
    assert (sharded.forward_s, sharded.backward_s) == (plain.forward_s, plain.backward_s)


@pytest.mark.parametrize("overlap", [False, True])
def test_sharded_communication_is_a_reduce_scatter_a_bucket_and_two_all_gathers(overlap):
    # ring alpha-beta: an allreduce is 2(n-1) alpha + 2(n-1)/n B / busbw; a reduce-scatter
    # or an all-gather the same latency and half the bandwidth term
    alpha, busbw, n = 1e-5, 1e10, 4
    layers = [1024, 4096, 4096, 10]
    params = 1024 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 10 + 10
    link = P.LinkProfile()
    link.alpha_s, link.bus_bandwidth = alpha, busbw
    half = lambda b: 2 * (n - 1) * alpha + (n - 1) / n * b / busbw
    assert link.reduce_scatter_seconds(n, 1e8) == pytest.approx(half(1e8), rel=1e-12)
    assert link.all_gather_seconds(n, 1e8) == link.reduce_scatter_seconds(n, 1e8)
    assert link.reduce_scatter_seconds(1, 1e8) == 0.0
    prof = profile([device()] * n, alpha=alpha, busbw=busbw, overlap=overlap)
    hw = perf.to_core(prof)
    # one bucket holds every gradient and the loss and stop slots (1 GiB buckets)
    w = workload.build_workload(None, layers, None, 4096, "fp32", "adamw", 1024.0, shard_optimizer=True)
    s = P.predict(w, hw, n, P.Options())
    reduce_scatter = half(4.0 * (params + 2))
    sums = half(4.0 * 4 * n)  # the health check's 4 floats a rank
    layer_params = [a * b + b for a, b in zip(layers, layers[1:])]
    if overlap:  # layer by layer (NCCL): each layer's gather its own collective
        gathers = sums + sum(half(4.0 * p) for p in layer_params)
        # each later layer arrives while the forward computes the one before (34 ms and
        # 137 ms against 5 ms): only the first layer's gather is waited for
        exposed_gathers = sums + half(4.0 * layer_params[0])
    else:  # at once, waited for before the step ends
        gathers = exposed_gathers = sums + half(4.0 * params)
    assert s.gather_s == pytest.approx(gathers, rel=1e-12)
    assert s.gather_exposed_s == pytest.approx(exposed_gathers, rel=1e-12)
    assert s.comm_s == pytest.approx(reduce_scatter + gathers, rel=1e-12)
    # the one bucket is ready when backward ends: nothing of it hides, overlap or not
    assert s.exposed_comm_s == pytest.approx(reduce_scatter + exposed_gathers, rel=1e-12)
    assert s.step_s == pytest.approx(s.overhead_s + s.forward_s + s.backward_s + s.exposed_comm_s + s.optimizer_s)
    if overlap:  # a fast forward hides next to nothing: each layer waits for its gather, the last for all
        fast = perf.to_core(profile([device(flops=1e18, bandwidth=1e18)] * n, alpha=alpha, busbw=busbw))
        f = P.predict(w, fast, n, P.Options())
        assert gathers - 1e-6 < f.gather_exposed_s < gathers
        captured = workload.build_workload(
            None, layers, None, 4096, "fp32", "adamw", 1024.0, shard_optimizer=True, cuda_graph="on"
        )
        g = P.predict(captured, hw, n, P.Options())  # graphs replay whole steps: the gather waited for at once
        assert g.gather_s == g.gather_exposed_s == pytest.approx(sums + half(4.0 * params), rel=1e-12)
    # compressed gradients halve the reduce-scatter, not the all-gather of fp32 parameters
    wb = workload.build_workload(
        None, layers, None, 4096, "fp32", "adamw", 1024.0, grad_dtype="bf16", shard_optimizer=True
    )
    b = P.predict(wb, hw, n, P.Options())
    assert b.comm_s == pytest.approx(half(2.0 * (params + 2)) + gathers, rel=1e-12)


def test_a_named_links_reduce_scatter_is_its_allreduces_latency_and_half_its_transfer():
    # h100-pcie-nvlink-2's NCCL-shaped link: a 1 GB buffer goes ring/Simple, whose
    # latency is lat + 2(n-1) hop and transfer B 2(n-1)/n / (ring busbw x fraction)
    hw = perf.to_core(perf.named_profile("h100-pcie-nvlink-2", 2))
    m, B, S = hw.link.intra, 1e9, 2  # Simple: the protocols are LL, LL128, Simple
    latency = m.latency_s[S] + 2 * m.hop_s[S]
    transfer = B * 1.0 / (m.ring_busbw * m.bw_fraction[S])
    assert hw.link.allreduce_choice(2, B) == hw.link.reduce_scatter_choice(2, B) == "ring/Simple"
    assert hw.link.allreduce_seconds(2, B) == pytest.approx(latency + transfer, rel=1e-12)
    assert hw.link.reduce_scatter_seconds(2, B) == pytest.approx(latency + transfer / 2, rel=1e-12)
    assert hw.link.all_gather_seconds(2, B) == hw.link.reduce_scatter_seconds(2, B)
    # and predict prices the parameters' all-gather with it, a layer at a time (134M
    # parameters: no graphs, so each layer's gather overlaps the next forward)
    layers = [8192, 8192, 8192, 10]
    _, s = sharded_pair(hw, 2, layers=layers, batch=64)
    layer_params = [a * b + b for a, b in zip(layers, layers[1:])]
    assert not s.graphs
    assert s.gather_s == pytest.approx(
        hw.link.all_gather_seconds(2, 4.0 * 4 * 2) + sum(hw.link.all_gather_seconds(2, 4.0 * p) for p in layer_params),
        rel=1e-12,
    )


# 4.5e9 parameters with AdamW: 72 GB of weights, gradients and state, more than 80 % of
# an 80 GB H100 PCIe; sharded over two, 54 GB each
BIG = ["--params", "4.5e9", "--batch-size", "8", "--profile", "h100-pcie-nvlink-2"]


def test_a_model_only_two_sharded_gpus_hold_gets_the_reason_and_shard_optimizer_picks_it(tmp_path, capfd):
    from mgpu.commands import main as cli

    out = tmp_path / "r.json"
    assert cli.main(["recommend", *BIG, "--json", str(out)]) == 0
    plain = json.loads(out.read_text())
    text = capfd.readouterr().out
    assert plain["strategy"] == "does_not_fit"
    assert [c["memory_fits"] for c in plain["candidates"]] == [False, False]
    assert [c["shard_optimizer"] for c in plain["candidates"]] == [False, False]
    state = plain["candidates"][1]["optimizer_state_bytes"]
    assert state == pytest.approx(8 * 4.5e9, rel=1e-3)
    said = [r for r in plain["reasons"] if "--shard-optimizer" in r]
    assert len(said) == 1, plain["reasons"]
    assert re.match(
        rf"2 GPUs fit with --shard-optimizer: optimizer state {state / 1e9:.2f} GB -> {state / 2e9:.2f} GB a device "
        r"\([\d.]+ GB of [\d.]+ GB usable\), [\d.]+ ms a step",
        said[0],
    ), said[0]
    assert said[0] in text and plain["request"]["shard_optimizer"] is False

    assert cli.main(["recommend", *BIG, "--shard-optimizer", "--json", str(out)]) == 0
    sharded = json.loads(out.read_text())
    text = capfd.readouterr().out
    assert (sharded["strategy"], sharded["devices"]) == ("multi_gpu", 2)
    one, two = sharded["candidates"]
    assert (one["shard_optimizer"], two["shard_optimizer"]) == (False, True)  # one device: nothing to shard
    assert (one["memory_fits"], two["memory_fits"]) == (False, True)
    assert two["optimizer_state_bytes"] == pytest.approx(state / 2)
    assert plain["candidates"][1]["memory_bytes"] - two["memory_bytes"] == pytest.approx(state / 2, rel=1e-9)
    assert two["all_gather_ms"] >= two["all_gather_exposed_ms"] > 0
    assert two["exposed_allreduce_ms"] >= two["all_gather_exposed_ms"]
    assert not any("fit with --shard-optimizer" in r for r in sharded["reasons"])
    assert any("gradient reduce-scatter (optimizer sharded)" in r for r in sharded["reasons"])
    assert "reduce-scatter of one" in text and "optimizer sharded on several devices" in text


def test_recommend_says_when_a_sharded_step_is_faster_by_more_than_the_error():
    # an update far slower than the link (slow memory, a fast link): sharded over four,
    # the update takes a quarter of the time and the all-gather hardly anything
    prof = profile([device(bandwidth=2e10)] * 4, alpha=1e-7, busbw=1e13, error=0.1)
    kw = dict(layers=[1024, 4096, 4096, 10], batch_size=256, devices=[1, 4], profile=prof, optimizer="adamw")
    plain = selector_recommend.recommend(**kw)
    said = [r for r in plain["reasons"] if "--shard-optimizer" in r]
    assert len(said) == 1 and said[0].startswith("--shard-optimizer would be faster: 4 GPUs at "), plain["reasons"]
    assert "(beyond the model's +-" in said[0] and "the update on 1/4 of the parameters" in said[0]
    sharded = selector_recommend.recommend(**kw, shard_optimizer=True)
    assert sharded["candidates"][1]["predicted_step_ms"] * 1.1 < plain["candidates"][1]["predicted_step_ms"]
    assert not any("would be faster" in r for r in sharded["reasons"])
    # where sharding changes nothing worth saying, nothing is said
    quiet = selector_recommend.recommend(**{**kw, "profile": profile([device()] * 4, alpha=1e-3, busbw=1e9)})
    assert not any("--shard-optimizer" in r for r in quiet["reasons"])


def test_gpu_step_memory_prices_a_sharded_optimizer():
    kw = dict(optimizer="adamw", precision="fp32", dropout=0.0)
    layers, params = [1024, 4096, 10], 1024 * 4096 + 4096 + 4096 * 10 + 10
    plain = memory.gpu_step_memory("h100-sxm", layers, 64, 4, **kw)
    sharded = memory.gpu_step_memory("h100-sxm", layers, 64, 4, shard_optimizer=True, **kw)
    assert plain["bytes"] - sharded["bytes"] == pytest.approx(8 * params * 3 / 4, rel=1e-12)
    assert (plain["optimizer_state_bytes"], sharded["optimizer_state_bytes"]) == (8 * params, 2 * params)
    one = memory.gpu_step_memory("h100-sxm", layers, 64, 1, shard_optimizer=True, **kw)
    assert one == memory.gpu_step_memory("h100-sxm", layers, 64, 1, **kw)


def test_a_cost_beyond_floats_is_left_out_not_written_as_infinity():
    # The CLI bounds --price; the API does not: a cost that overflows is no figure at all.
    prof = profile([device()] * 2)
    r = selector_recommend.recommend(layers=[16, 16], profile=prof, batch_size=64, price_per_device_hour=1e308)
    costs = [c.get("cost_per_million_samples") for c in r["candidates"]]
    assert None in costs and all(c is None or math.isfinite(c) for c in costs), costs
    json.dumps(r, allow_nan=False)
    fine = selector_recommend.recommend(layers=[16, 16], profile=prof, batch_size=64, price_per_device_hour=2.0)
    assert all(math.isfinite(c["cost_per_million_samples"]) for c in fine["candidates"])
