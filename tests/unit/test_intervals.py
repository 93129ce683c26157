"""The model's error bands from the published tables (issue 42): the band's arithmetic (a
held-out table's offset plus the scatter within tables), that held-out coverage leaves the
scored table out, the spread between tables of one kind, the error model a hardware profile
stores, and that docs/selector-validation.md carries the current scores."""

import math
from pathlib import Path

import numpy as np
import pytest

import mgpu
from mgpu.selector import allreduce_fit as af
from mgpu.selector import gemm_fit as gf
from mgpu.selector import intervals as iv
from mgpu.selector import profiles

DOC = Path(__file__).resolve().parents[2] / "docs" / "selector-validation.md"


def comm_rows():
    return iv.residuals(af.validate(), "bytes")


def gemm_rows():
    return iv.residuals(gf.validate(), "shape")


def test_a_workloads_band_takes_each_offset_either_way_plus_the_scatter_of_its_steps():
    # two workloads the model underpredicts (offsets 0.11 and 0.03): a third may sit either side
    low, high = iv.workload_band([[0.10, 0.12], [0.02, 0.04]])
    assert low == pytest.approx(-high) and 0.10 < high < 0.13 and type(low) is float
    # the repeats' scatter widens it beyond the largest offset
    assert iv.workload_band([[-0.1, 0.3], [0.0, 0.0]])[1] > iv.workload_band([[0.1, 0.1], [0.0, 0.0]])[1] > 0.05
    # what is not finite says nothing; the band needs two steps in all
    assert iv.workload_band([[float("nan")], [0.1, 0.2]]) == pytest.approx(iv.workload_band([[0.1, 0.2]]))
    for few in ([], [[0.1]], [[0.1], [float("inf")]]):
        with pytest.raises(mgpu.ConfigError, match="at least 2 finite"):
            iv.workload_band(few)


def test_a_workloads_band_holds_about_three_quarters_of_a_new_workloads_steps():
    # six workloads of two steps each, offsets of either sign: the band of a seventh
    rng = np.random.default_rng(7)
    inside = []
    for _ in range(2000):
        offsets, scatter = rng.normal(0, 0.05, 7), rng.normal(0, 0.01, (7, 2))
        low, high = iv.workload_band([offsets[i] + scatter[i] for i in range(6)])
        inside.append(low <= offsets[6] + scatter[6, 0] <= high)
    assert 0.70 < np.mean(inside) < 0.80


def test_residuals_carry_the_log_ratio_of_measured_to_predicted():
    for rows, validated, where in (
        (comm_rows(), af.validate(), "bytes"),
        (gemm_rows(), gf.validate(), "shape"),
    ):
        assert len(rows) == len(validated) and rows
        for r, v in zip(rows, validated):
            assert set(r) == {"table", "role", "log_ratio", "error", where}
            assert r["log_ratio"] == pytest.approx(math.log(1.0 / (1.0 + v["error"])))
            assert (r["table"], r["role"], r["error"], r[where]) == (v["table"], v["role"], v["error"], v[where])
    ar = next(zip(comm_rows(), af.validate()))
    assert ar[0]["log_ratio"] == pytest.approx(math.log(ar[1]["measured_us"] / ar[1]["predicted_us"]))


def pct(values):
    """The 10th and 90th percentile of a distribution (system_band's pairings), interpolated."""
    return tuple(np.percentile(values, [10, 90]))


def _table(name, role, offset, scatter):
    rows = [{"table": name, "role": role, "log_ratio": offset + d} for d in scatter]
    for r in rows:
        r["error"] = math.expm1(-r["log_ratio"])
    return rows


def test_system_band_adds_held_out_tables_offsets_to_the_scatter_within_tables():
    flat = [0.0] * 5
    rows = _table("fit", "fit", 1.0, flat) + [
        r for i, off in enumerate((-0.2, 0.0, 0.2)) for r in _table(f"h{i}", "holdout", off, flat)
    ]
    # no scatter: the held-out offsets, once per point (20 of them); a fitted table's offset is not one
    assert iv.system_band(rows) == pytest.approx(pct(np.repeat([-0.2, 0.0, 0.2], 20)))
    assert iv.system_band(rows, leave_out="h2") == pytest.approx(pct(np.repeat([-0.2, 0.0], 15)))
    assert iv.system_band(rows, leave_out="fit") == pytest.approx(iv.system_band(rows))
    # a table left out leaves its scatter too: h3's points spread far, the others' not at all
    wide = rows + _table("h3", "holdout", 0.0, [-0.5] * 10 + [0.5] * 10)
    assert iv.system_band(wide, leave_out="h3") == pytest.approx(iv.system_band(rows))
    assert iv.system_band(wide)[0] < iv.system_band(rows)[0] - 0.01
    with pytest.raises(mgpu.ConfigError, match="no table 'h9' to leave out"):
        iv.system_band(rows, leave_out="h9")
    # no offsets: the band of each point less its own table's median, every table's points
    scatter = np.linspace(-0.1, 0.1, 9)
    centred = _table("fit", "fit", 0.7, scatter) + _table("h0", "holdout", 0.0, scatter)
    centred += _table("h1", "holdout", 0.0, 2 * scatter)
    expected = pct(np.tile(np.concatenate([scatter, scatter, 2 * scatter]), 2))
    assert iv.system_band(centred) == pytest.approx(expected)
    # both: every offset plus every scatter
    both = _table("h0", "holdout", -0.1, scatter) + _table("h1", "holdout", 0.3, scatter)
    sums = [off + d for off in (-0.1, 0.3) for d in np.concatenate([scatter, scatter])]
    assert iv.system_band(both) == pytest.approx(pct(sums))
    both.append({"table": "h1", "role": "holdout", "log_ratio": float("nan"), "error": float("nan")})
    assert iv.system_band(both) == pytest.approx(pct(sums))


def test_system_band_needs_two_held_out_tables():
    rows = _table("fit", "fit", 0.0, [0.0, 0.1]) + _table("h0", "holdout", 0.1, [0.0, 0.1])
    with pytest.raises(mgpu.ConfigError, match="at least 2 held-out tables, got 1"):
        iv.system_band(rows)
    rows += _table("h1", "holdout", -0.1, [0.0, 0.1])
    iv.system_band(rows)
    with pytest.raises(mgpu.ConfigError, match="got 1"):
        iv.system_band(rows, leave_out="h0")


def _synthetic():
    # Two fitted tables spread over [-0.1, 0.1]; held-out tables c and d near them, and "odd"
    # 0.3 above: other systems sat as far from their profile (e and f), so odd's band reaches it.
    spread = np.linspace(-0.1, 0.1, 30)
    rows = _table("a", "fit", 0.0, spread) + _table("b", "fit", 0.001, spread)
    rows += _table("c", "holdout", 0.002, spread) + _table("d", "holdout", -0.02, spread)
    rows += _table("e", "holdout", 0.28, spread[::3]) + _table("f", "holdout", 0.32, spread[::3])
    rows += _table("odd", "holdout", 0.3, np.linspace(-0.02, 0.02, 20))
    return rows


def test_held_out_coverage_leaves_the_scored_table_out():
    rows = _synthetic()
    s = iv.score(rows)
    held = [r for r in rows if r["role"] == "holdout"]
    inside = [lo <= r["log_ratio"] <= hi for r in held for lo, hi in [iv.system_band(rows, leave_out=r["table"])]]
    assert s["coverage"] == pytest.approx(np.mean(inside))
    assert s["points"] == len(held) and s["tables"] == 5
    # the offsets of e and f carry odd's band up to it; the pooled rule's band does not reach it
    alone = iv.score(rows, exclude=["c", "d", "e", "f"])
    assert alone["points"] == 20 and alone["tables"] == 1 and alone["coverage"] > 0.9
    odd_only = [r for r in rows if r["table"] != "odd" or r["role"] == "holdout"]
    pooled_low, pooled_high = np.percentile([r["log_ratio"] for r in odd_only if r["table"] != "odd"], [10, 90])
    assert not any(pooled_low <= r["log_ratio"] <= pooled_high for r in rows if r["table"] == "odd")
    assert iv.pooled_coverage(rows) < s["coverage"]
    with pytest.raises(mgpu.ConfigError, match="no held-out rows"):
        iv.pooled_coverage([r for r in rows if r["role"] == "fit"])
    # without e and f no held-out system sat that far: odd falls outside
    assert iv.score([r for r in rows if r["table"] not in ("e", "f")], exclude=["c", "d"])["coverage"] == 0.0
    # the same figures in-sample for the fitted rows, against the band of every table
    low, high = s["band"]
    assert s["band"] == pytest.approx(iv.system_band(rows))
    fit = [r for r in rows if r["role"] == "fit"]
    assert s["fit"]["points"] == 60 and s["fit"]["tables"] == 2
    assert s["fit"]["coverage"] == pytest.approx(np.mean([low <= r["log_ratio"] <= high for r in fit]))
    assert s["fit"]["median_abs_error"] == pytest.approx(np.median([abs(r["error"]) for r in fit]))
    assert s["p90_abs_error"] == pytest.approx(np.percentile([abs(r["error"]) for r in held], 90))
    with pytest.raises(mgpu.ConfigError, match="no rows to score"):
        iv.score(rows, exclude=["c", "d", "e", "f", "odd"])


def test_between_systems_scores_a_model_exact_on_one_table_against_its_kind():
    points = [
        {"table": "x", "at": 1, "measured": 100.0},
        {"table": "x", "at": 2, "measured": 100.0},
        {"table": "y", "at": 1, "measured": 110.0},
        {"table": "y", "at": 2, "measured": 125.0},
        {"table": "y", "at": 3, "measured": 50.0},
        {"table": "z", "at": 1, "measured": 400.0},
        {"table": "w", "at": 1, "measured": 300.0},
    ]
    kind = {"x": "h100", "y": "h100", "z": "a100", "w": None}
    out = iv.between_systems(points, kind)
    assert out["pairs"] == [("x", "y", 2)] and out["points"] == 2
    errors = [1 - 100 / 110, 0.1, 0.2, 0.25]
    assert out["median_abs_error"] == pytest.approx(np.median(errors))
    assert out["p90_abs_error"] == pytest.approx(np.percentile(errors, 90))
    none = iv.between_systems(points, {"x": "h100", "y": "a100"})
    assert none["pairs"] == [] and none["points"] == 0 and math.isnan(none["p90_abs_error"])
    # a time that is not one is left out; a size twice in a table is refused
    odd = points + [{"table": "x", "at": 3, "measured": 0.0}, {"table": "y", "at": 4, "measured": float("nan")}]
    odd.append({"table": "x", "at": 4, "measured": 120.0})
    assert iv.between_systems(odd, kind) == out
    with pytest.raises(mgpu.ConfigError, match="table 'y' measured size 2 twice"):
        iv.between_systems(points + [{"table": "y", "at": 2, "measured": 1.0}], kind)


def test_published_error_model_is_the_system_bands_and_a_fresh_copy_each_call():
    m = profiles.published_error_model()
    assert set(m) == {"compute", "comm", "compute_shared", "source"} and m["compute_shared"] is True
    for key, rows in (("compute", gemm_rows()), ("comm", comm_rows())):
        assert isinstance(m[key], list) and len(m[key]) == 2 and all(type(v) is float for v in m[key])
        low, high = m[key]
        assert low < 0 < high
        assert (low, high) == pytest.approx(iv.system_band(rows))
        assert f"{len(rows)} " in m["source"]
    assert "GEMM" in m["source"] and "nccl-tests allreduce" in m["source"] and "10th-90th" in m["source"]
    m["compute"][0] = 99.0
    m["comm"] = None
    fresh = profiles.published_error_model()
    assert fresh["compute"][0] != 99.0 and fresh["comm"] is not None


@pytest.mark.parametrize("kind", ["allreduce", "gemm"])
def test_scores_on_the_published_tables_are_finite_shares(kind):
    rows = comm_rows() if kind == "allreduce" else gemm_rows()
    s = iv.score(rows)
    for part in (s, s["fit"]):
        assert part["points"] >= 5 and part["tables"] >= 2
        for key in ("median_abs_error", "p90_abs_error", "coverage"):
            assert type(part[key]) is float and math.isfinite(part[key]), key
        assert 0.0 <= part["coverage"] <= 1.0 and part["median_abs_error"] <= part["p90_abs_error"]
    assert s["band"] == pytest.approx(profiles.published_error_model()["comm" if kind == "allreduce" else "compute"])


def test_known_misses_are_held_out_allreduce_tables():
    held = {t["id"] for t in af.load_published()["tables"] if t["role"] == "holdout"}
    assert set(iv.known_miss_tables()) <= held
    rows = comm_rows()
    assert iv.score(rows, exclude=iv.known_miss_tables())["points"] < iv.score(rows)["points"]


def test_the_validation_page_carries_the_current_scores():
    text = iv.scores_markdown(comm_rows(), gemm_rows())
    assert text.startswith("## Scores: point error and the 80 % interval")
    assert text in DOC.read_text(), "regenerate: python -m mgpu.allreduce_fit --markdown docs/selector-validation.md"
    assert text in af.markdown()


def test_a_non_finite_point_or_step_moves_no_band():
    rows = [
        {"table": t, "role": role, "log_ratio": r}
        for t, role, rs in (
            ("a", "holdout", (0.1, 0.12, 0.08)),
            ("b", "holdout", (-0.05, -0.04)),
            ("c", "fit", (0.0, 0.01)),
        )
        for r in rs
    ]
    base = iv.system_band(rows)
    for bad in (math.inf, -math.inf, math.nan):
        assert iv.system_band(rows + [{"table": "a", "role": "holdout", "log_ratio": bad}]) == pytest.approx(base)
    groups = [[0.1, 0.12], [-0.05, -0.03], [0.02, 0.0]]
    assert iv.workload_band([g + ([math.nan] if i == 0 else []) for i, g in enumerate(groups)]) == pytest.approx(
        iv.workload_band(groups)
    )


def test_the_verdict_holds_coverage_between_its_bounds():
    lo, hi = iv.TARGETS["coverage"]
    verdict = lambda coverage: iv._verdict({"median_abs_error": 0.01, "p90_abs_error": 0.05, "coverage": coverage})[2]
    assert verdict((lo + hi) / 2).endswith(": met)")
    assert verdict(0.99).endswith("not met)") and verdict(lo - 0.01).endswith("not met)")
