"""topo's two-level link (within nodes, between nodes) as the selector reads it: the
alpha-beta fits of the two sweeps become perf_model.h's intra/inter ring models, and
a prediction over several nodes follows the hierarchical rule (latencies add, the
slower transfer counts). The sweeps themselves run in tests/cluster."""
import pytest

from mgpu import perf
from mgpu.topo import fit_link, hierarchical_link


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
    rec = perf.recommend(layers=[50, 256, 256, 3], batch_size=256, profile=profile, nodes=2)
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
    wider = perf._whole_nodes(profile, 8)
    assert [d["name"] for d in wider["devices"]] == [f"rank {i % 2} of a host" for i in range(8)]
    rec = perf.recommend(layers=[50, 256, 256, 3], batch_size=256, profile=profile, nodes=4)
    assert [c["devices"] for c in rec["candidates"]] == [1, 2, 8]
    del profile["link"]["nccl"]  # no inter-node model: nothing to repeat by
    assert perf._whole_nodes(profile, 8) is profile
