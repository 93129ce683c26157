"""topo's two-level link (within nodes, between nodes) as the selector reads it: the
alpha-beta fits of the two sweeps become perf_model.h's intra/inter ring models, and
a prediction over several nodes follows the hierarchical rule (latencies add, the
slower transfer counts). The sweeps themselves run in tests/cluster."""

import pytest

from mgpu.calibrate.topo import fit_link, hierarchical_link
from mgpu.selector import profiles as perf
from mgpu.selector import recommend as selector_recommend


def sweep(alpha_step, busbw, n, sizes=(1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22)):
    """Rows of an exact alpha-beta link on n ranks, as allreduce_sweep writes them."""
    steps = 2 * (n - 1)
    return [{"bytes": b, "time_us": (steps * alpha_step + steps / n * b / busbw) * 1e6} for b in sizes]


def test_the_fits_of_two_levels_predict_a_hierarchical_allreduce():
    intra = fit_link(sweep(1e-6, 10e9, 2), 2)
    inter = fit_link(sweep(40e-6, 1e9, 2), 2)
    assert intra["alpha_s"] == pytest.approx(1e-6, rel=1e-3) and intra["bus_bandwidth"] == pytest.approx(10e9, rel=1e-3)
    assert inter["alpha_s"] == pytest.approx(40e-6, rel=1e-3) and inter["bus_bandwidth"] == pytest.approx(1e9, rel=1e-3)
    profile = perf.named_profile("cpu", 4)
    profile["link"]["nccl"] = hierarchical_link(intra, inter, 2)
    profile["gpus_per_node"] = 2
    link = perf.to_core(profile, 4).link
    b = 8 << 20
    # within a node: the intra ring alone
    assert link.allreduce_seconds(2, b) == pytest.approx(2 * 1e-6 + b / 10e9, rel=1e-3)
    # 2 nodes x 2: both latencies, and the slower of the node's transfer and the
    # network's (each rank sends its half of the bytes between the nodes)
    expected = (2 * 1e-6 + 2 * 40e-6) + max(b / 10e9, (b / 2) / 1e9)
    assert link.allreduce_seconds(4, b) == pytest.approx(expected, rel=1e-3)
    rec = selector_recommend.recommend(layers=[50, 256, 256, 3], batch_size=256, profile=profile, nodes=2)
    assert 4 in [c["devices"] for c in rec["candidates"]]


def test_a_calibration_of_two_hosts_answers_for_more_hosts_node_by_node():
    # topo measured 2 hosts x 2 ranks; --nodes 4 repeats those hosts (not the last rank)
    # over the same inter-node link.
    profile = perf.named_profile("cpu", 4)
    profile["source"] = "calibrated"
    for i, d in enumerate(profile["devices"]):
        d["name"] = f"rank {i % 2} of a host"
    profile["link"]["nccl"] = hierarchical_link(fit_link(sweep(1e-6, 10e9, 2), 2), fit_link(sweep(40e-6, 1e9, 2), 2), 2)
    profile["gpus_per_node"] = 2
    wider = selector_recommend._whole_nodes(profile, 8)
    assert [d["name"] for d in wider["devices"]] == [f"rank {i % 2} of a host" for i in range(8)]
    rec = selector_recommend.recommend(layers=[50, 256, 256, 3], batch_size=256, profile=profile, nodes=4)
    assert [c["devices"] for c in rec["candidates"]] == [1, 2, 8]
    del profile["link"]["nccl"]  # no inter-node model: nothing to repeat by
    assert selector_recommend._whole_nodes(profile, 8) is profile


class _PlacementsInTurn:
    """Rank 0 of a process group whose cores' round trips read as given, in turn."""

    def __init__(self, readings_ns):
        self.readings = iter(readings_ns)

    def core_round_trip_ns(self):
        return {"cpus": [0, 1], "ns": next(self.readings)}

    def bcast(self, obj, what=""):
        return obj


@pytest.mark.parametrize(
    "readings_ns, probes",
    [
        ([55.0, 60.0], 1),  # one placement throughout: measured once
        ([55.0, 330.0, 340.0, 335.0], 2),  # moved during the first: again
        ([55.0, 330.0, 340.0, 60.0, 58.0, 330.0], 3),  # moved each time: the last try is kept
    ],
)
def test_the_wait_is_probed_again_while_the_cores_moved_during_its_probe(monkeypatch, readings_ns, probes):
    from mgpu.calibrate import topo

    tables = iter(range(1, 10))
    monkeypatch.setattr(topo, "measure_step_phases", lambda *args: {"probe": next(tables)})
    log = topo.PlacementLog(_PlacementsInTurn(readings_ns))
    table, pair = topo.step_phases_in_one_placement(log.pg, 1, True, log)
    assert table == {"probe": probes} and pair == readings_ns[-2:] and log.readings == readings_ns
    assert probes <= topo.PLACEMENT_TRIES and log.cpus == [0, 1]
    assert log.samples == []  # a probe's readings follow the cores' moves: no sample of their time


@pytest.mark.parametrize(
    "readings_ns, says",
    [
        ([52.0, 55.0, 54.0, 56.0], None),
        ([52.0, 55.0, 54.0, 330.0], "hold where the wait was probed, at 54-55 ns"),
        ([52.0, 55.0, 330.0, 54.0, 330.0, 60.0, 330.0, 58.0], "during each of 3 tries at that probe"),
    ],
)
def test_topo_says_whether_and_when_the_cores_changed_cache_domains(readings_ns, says):
    from mgpu.commands.topo import placement_line

    placement = {"cpus": [0, 1], "readings_ns": readings_ns, "wait_probe_ns": readings_ns[-3:-1]}
    text = placement_line(placement)
    assert text.startswith("ranks' cores (CPUs 0 and 1): a cache line's round trip")
    assert (says in text) if says else "cache domains" not in text
    if says and "hold where" in says:  # and probed again where the cores went
        text = placement_line({**placement, "other_wait_probe_ns": [330.0, 335.0], "other_share": 0.25})
        assert (
            "probed again with them at 330-335 ns, where 25% of the readings found them, and `recommend` "
            "prices several ranks in both placements, weighted so"
        ) in text


class _WatchedPlacements(_PlacementsInTurn):
    """As _PlacementsInTurn, on a clock that only the watch's half-second sleeps move."""

    def __init__(self, readings_ns, monkeypatch):
        from mgpu.calibrate import topo

        super().__init__(readings_ns)
        self.clock = 0.0
        monkeypatch.setattr(topo.time, "monotonic", lambda: self.clock)
        monkeypatch.setattr(topo.time, "sleep", lambda s: setattr(self, "clock", self.clock + s))
        self.is_root = True


@pytest.mark.parametrize(
    "readings_ns, first_tries, second_ns, watched",
    [
        # first probe at 55-60 ns; the watch (1 s in quick mode: 3 readings) sees nothing else
        ([55.0, 60.0, 58.0, 57.0, 59.0], 1, None, [58.0, 57.0, 59.0]),
        # the cores move to 330 ns: the wait is probed there (330 -> 335) and kept, and the watch goes on
        ([55.0, 60.0, 330.0, 335.0, 331.0, 58.0, 57.0], 1, [330.0, 335.0], [330.0, 331.0, 58.0, 57.0]),
        # they move back during that probe (330 -> 58): not kept, and the watch runs out
        ([55.0, 60.0, 330.0, 58.0, 57.0, 59.0, 56.0], 1, None, [330.0, 57.0, 59.0, 56.0]),
        # the first probe moved in every try: no placement to tell another from, no watch
        ([55.0, 330.0, 58.0, 330.0, 60.0, 320.0], 3, None, []),
    ],
)
def test_the_wait_is_probed_in_a_second_placement_where_the_cores_go_during_the_watch(
    monkeypatch, readings_ns, first_tries, second_ns, watched
):
    from mgpu.calibrate import topo

    tables = iter(range(1, 10))
    monkeypatch.setattr(topo, "measure_step_phases", lambda *args: {"probe": next(tables)})
    log = topo.PlacementLog(_WatchedPlacements(readings_ns, monkeypatch))
    got = topo.step_phases_by_placement(log.pg, 1, True, log)
    assert got["first"] == {"probe": first_tries} and got["home"] == readings_ns[2 * first_tries - 2 : 2 * first_tries]
    assert got["second"] == ({"probe": first_tries + 1} if second_ns else None) and got["other"] == second_ns
    assert next(log.pg.readings, None) is None, "every reading given was taken"
    # every reading is kept; the watch's, taken every half second, are the samples of the time
    assert log.readings == readings_ns and log.samples == watched


def test_the_second_placements_share_counts_the_readings_found_there():
    assert topo_other_share([55.0, 330.0, 60.0, 335.0, 58.0], [52.0, 56.0], [330.0, 334.0]) == pytest.approx(2 / 5)
    assert topo_other_share([55.0, 60.0], [52.0, 56.0], [330.0, 334.0]) == 0.0
    assert topo_other_share([], [52.0, 56.0], [330.0, 334.0]) == 0.0
    # a reading in neither (a third placement, or one taken as the cores moved) counts for neither
    assert topo_other_share([55.0, 140.0, 330.0], [52.0, 56.0], [330.0, 334.0]) == pytest.approx(1 / 2)


def topo_other_share(*args):
    from mgpu.calibrate.topo import other_share

    return other_share(*args)


def test_no_second_placement_is_looked_for_without_a_peer_on_the_node(monkeypatch):
    from mgpu.calibrate import topo

    monkeypatch.setattr(topo, "measure_step_phases", lambda *args: {"probe": 1})

    class Alone(_WatchedPlacements):
        def core_round_trip_ns(self):
            return None

    log = topo.PlacementLog(Alone([], monkeypatch))
    got = topo.step_phases_by_placement(log.pg, 1, True, log)
    assert got["first"] == {"probe": 1} and (got["home"], got["second"], got["other"]) == (None, None, None)
    assert log.readings == log.samples == [] and log.cpus is None


def test_held_out_steps_on_several_cpu_ranks_say_where_the_cores_sat(monkeypatch):
    import contextlib

    from mgpu.calibrate import topo

    monkeypatch.setattr(topo, "_step_seconds", lambda *args: 1e-3)
    monkeypatch.setattr(topo, "_self_group", lambda: None)
    monkeypatch.setattr(topo, "_timeouts_kept", lambda pg: contextlib.nullcontext())
    pg = _PlacementsInTurn([60.0, 62.0, 330.0, 335.0, 61.0, 340.0])
    pg.size, pg.is_root, pg.sleeping_barrier = 2, True, lambda *args: None
    checks = topo.measure_held_out_steps(pg, "cpu", 0, 1, True, "mpi")
    assert [c["together_round_trip_ns"] for c in checks] == [[60.0, 62.0], [330.0, 335.0], [61.0, 340.0]]
    assert all(c["together_round_trip_cpus"] == [0, 1] for c in checks)
    # GPU ranks: their steps are not the CPUs' to place
    pg = _PlacementsInTurn([])
    pg.size, pg.is_root, pg.sleeping_barrier = 2, True, lambda *args: None
    checks = topo.measure_held_out_steps(pg, "cuda", 0, 1, True, "nccl")
    assert all("together_s" in c and "together_round_trip_ns" not in c for c in checks)


def test_round_trips_are_positive_finite_and_as_many_as_asked():
    from mgpu.hostinfo import placement_moved, round_trips_readable

    assert round_trips_readable([60.0, 61]) and round_trips_readable([60.0, 61.0], 2)
    for bad in ([0.0, 5.0], [1.0, float("inf")], [1.0, float("nan")], [], [True, 5.0], "60", None):
        assert not round_trips_readable(bad), bad
    assert not round_trips_readable([60.0, 61.0, 62.0], 2) and not round_trips_readable([60.0], 2)
    # two placements are the readings' ratio past PLACEMENT_RATIO (2): a cache's 60-100 ns
    # against the 300-360 ns across cache domains, not one placement's jitter
    assert not placement_moved([100.0, 170.0]) and placement_moved([100.0, 250.0]) and not placement_moved([])


def test_ranks_of_one_device_model_are_pooled_and_printed_once_as_such():
    """Identical devices get the median of their measurements (the probe's step too), and
    topo's text says the line is theirs together, once, not one rank's own figures twice."""
    from mgpu.calibrate.topo import homogenize
    from mgpu.commands.topo import format_topo

    def entry(rank, overhead, probe):
        return {
            "rank": rank,
            "host": "h",
            "name": "AMD EPYC",
            "kind": "cpu",
            "memory_bandwidth": 1e11,
            "launch_overhead_s": 4e-7,
            "graph_node_s": 4e-7,
            "step_overhead_s": overhead,
            "probe_step_s": probe,
            "dropout_s_per_unit": 1e-9,
            "fp32": {"measured": [[1e6, 1e10], [1e9, 1e11]], "peak_flops": 1e11, "half_work_flops": 1e6},
        }

    entries = [entry(0, 10e-6, 15e-6), entry(1, 30e-6, 45e-6), {**entry(2, 5e-6, 7e-6), "name": "other CPU"}]
    homogenize(entries)
    assert [e["pooled_ranks"] for e in entries[:2]] == [[0, 1], [0, 1]] and "pooled_ranks" not in entries[2]
    assert entries[0]["step_overhead_s"] == entries[1]["step_overhead_s"] == pytest.approx(20e-6)
    assert entries[0]["probe_step_s"] == entries[1]["probe_step_s"] == pytest.approx(30e-6)
    text = format_topo({"name": "test", "mgpu_version": "0", "devices": entries, "allreduce": []})
    lines = [line for line in text.splitlines() if "GEMM peak" in line]
    assert len(lines) == 2 and lines[0].startswith("  ranks 0, 1 on h (one device model: the median of")
    assert "step overhead 20.0 us" in lines[0] and "took 30.0 us" in lines[0]
    assert lines[1].startswith("  rank 2 on h: other CPU")
