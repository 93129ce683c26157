"""The model's error bands from the published tables (issue 42): the band's arithmetic, that
held-out coverage leaves the scored table out, the error model a hardware profile stores, and
that docs/selector-validation.md carries the current scores."""

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


def test_band_is_the_10th_and_90th_percentile_with_linear_interpolation():
    assert iv.band(range(11)) == (1.0, 9.0)
    assert iv.band([0.0, 1.0]) == pytest.approx((0.1, 0.9))
    assert iv.band([3.0, -1.0, 0.5, 2.0]) == pytest.approx((-1.0 + 0.3 * 1.5, 2.0 + 0.7 * 1.0))
    low, high = iv.band(np.linspace(-1, 1, 101))
    assert (low, high) == pytest.approx((-0.8, 0.8)) and type(low) is float and type(high) is float


def test_band_leaves_out_what_is_not_finite_and_needs_two_values():
    assert iv.band([0.0, float("nan"), 1.0, float("inf"), -float("inf")]) == pytest.approx((0.1, 0.9))
    for few in ([], [0.5], [0.5, float("nan")], [float("inf")] * 3):
        with pytest.raises(mgpu.ConfigError, match="at least 2 finite"):
            iv.band(few)


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


def _synthetic():
    # Three ordinary tables whose points spread over [-0.1, 0.1], and one held-out table whose
    # points lie well above them: in-sample they are 18 % of the points, most inside the pooled band.
    rows = []
    for i, table in enumerate(("a", "b", "c")):
        for r in np.linspace(-0.1, 0.1, 30):
            rows.append({"table": table, "role": "holdout" if i == 2 else "fit", "log_ratio": r + i * 1e-3})
    rows += [{"table": "odd", "role": "holdout", "log_ratio": 0.3 + k * 1e-3} for k in range(20)]
    for r in rows:
        r["error"] = math.expm1(-r["log_ratio"])
    return rows


def test_held_out_coverage_leaves_the_scored_table_out():
    rows = _synthetic()
    s = iv.score(rows)
    odd = [r for r in rows if r["table"] == "odd"]
    low, high = s["band"]
    assert np.mean([low <= r["log_ratio"] <= high for r in odd]) > 0.4  # the pooled band covers most
    alone = iv.score(rows, exclude=["c"])  # only the outlying table scored
    assert alone["points"] == 20 and alone["tables"] == 1 and alone["coverage"] == 0.0
    # table c: its band from a, b and odd covers its points but the lowest ones
    c = iv.score(rows, exclude=["odd"])
    assert c["points"] == 30 and 0.7 < c["coverage"] < 1.0
    assert s["coverage"] == pytest.approx((c["coverage"] * 30 + 0) / 50)
    # the same figures in-sample for the fitted rows, against the pooled band
    fit = [r for r in rows if r["role"] == "fit"]
    assert s["fit"]["points"] == 60 and s["fit"]["tables"] == 2
    assert s["fit"]["coverage"] == pytest.approx(np.mean([low <= r["log_ratio"] <= high for r in fit]))
    assert s["fit"]["median_abs_error"] == pytest.approx(np.median([abs(r["error"]) for r in fit]))
    assert s["p90_abs_error"] == pytest.approx(
        np.percentile([abs(r["error"]) for r in rows if r["role"] == "holdout"], 90)
    )
    with pytest.raises(mgpu.ConfigError, match="no rows to score"):
        iv.score(rows, exclude=["c", "odd"])


def test_published_error_model_is_the_pooled_bands_and_a_fresh_copy_each_call():
    m = profiles.published_error_model()
    assert set(m) == {"compute", "comm", "compute_shared", "source"} and m["compute_shared"] is True
    for key, rows in (("compute", gemm_rows()), ("comm", comm_rows())):
        assert isinstance(m[key], list) and len(m[key]) == 2 and all(type(v) is float for v in m[key])
        low, high = m[key]
        assert low < 0 < high
        assert (low, high) == pytest.approx(iv.band(r["log_ratio"] for r in rows))
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
