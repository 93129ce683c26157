"""The named GPU profiles' GEMM rates against the published GEMM tables they are fitted
to (and held-out ones): the bounds of docs/gemm-validation.md, that the profiles use
the fitted rates, and that a wrong rate fails the bounds."""

import copy

import numpy as np
import pytest

from mgpu.selector import gemm_fit as gf
from mgpu.selector import profiles as perf

# Tables outside the bounds, each with why; strict: a table that comes within them
# must leave this list.
KNOWN_MISSES = {
    ("xla-sm90-tf32", "median"): "TF32 kernels on H100 gain rate with size well past the point where a fixed cost "
    "per GEMM stops mattering (marginal 53 TFLOP/s from 256^3 to 512^3, 465 from 1024^3 "
    "to 2048^3): one peak and one fixed time split the difference",
    ("xla-sm90-tf32", "worst"): "the same: 256^3 runs at 5.7 TFLOP/s",
}


def _tables(role, bound):
    ids = [t["id"] for t in gf.load_published()["tables"] if t["role"] == role]
    return [
        pytest.param(t, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[(t, bound)]))
        if (t, bound) in KNOWN_MISSES
        else t
        for t in ids
    ]


def _errors(table, fits=None):
    errs = [abs(r["error"]) for r in gf.validate(fits) if r["table"] == table]
    assert len(errs) >= 4, table
    return errs


@pytest.mark.parametrize("table", _tables("fit", "median") + _tables("holdout", "median"))
def test_median_error_within_bounds(table):
    assert np.median(_errors(table)) <= gf.BOUNDS["median"]


@pytest.mark.parametrize("table", _tables("fit", "worst") + _tables("holdout", "worst"))
def test_worst_error_within_bounds(table):
    assert max(_errors(table)) <= gf.BOUNDS["worst"]


def test_every_known_miss_names_a_table():
    ids = {t["id"] for t in gf.load_published()["tables"]}
    assert {table for table, _ in KNOWN_MISSES} <= ids


def test_the_fit_recovers_a_rate_it_was_given():
    peak, half = 300e12, 2.5e9
    rows = [(n, n, n, 2.0 * n**3, (2.0 * n**3 + half) / peak) for n in (256, 512, 1024, 2048, 4096, 8192)]
    got_peak, got_half, harness = gf.fit_rate(rows)
    assert got_peak == pytest.approx(peak, rel=1e-6) and got_half == pytest.approx(half, rel=1e-6) and harness == {}
    # timed per call by events: the harness's cost a call comes out apart from the GEMM's
    with_cost = [(*r[:4], r[4] - half / peak + gf.TYPICAL_FIXED_S + 30e-6) for r in rows]
    got_peak, got_half, harness = gf.fit_rate(with_cost, ["events-table"] * len(rows))
    assert got_peak == pytest.approx(peak, rel=1e-6) and got_half == pytest.approx(gf.TYPICAL_FIXED_S * peak)
    assert harness == {"events-table": pytest.approx(30e-6)}
    # rows no bounded rate fits (faster than the pinned fixed time), or none: an error, which
    # fitted_rates turns into the spec figures rather than breaking every profile
    with pytest.raises(ValueError):
        gf.fit_rate([(256, 256, 256, 2 * 256**3, 4e-6), (512, 512, 512, 2 * 512**3, 5e-6)], ["t", "t"])
    with pytest.raises(ValueError):
        gf.fit_rate([])
    # a fixed time beyond the bound is not taken: the rows of a slow mid-size kernel
    slow = [(*r[:4], r[4] + 50e-6) for r in rows]
    assert gf.fit_rate(slow)[1] / gf.fit_rate(slow)[0] <= gf.MAX_FIXED_S * (1 + 1e-9)


def test_host_bound_rows_are_left_out():
    # 30 back-to-back torch.mm calls timed from the host: under 20 us a call the host's
    # dispatch sets the pace, and such rows would pull the fixed time up.
    table = {
        "quantity": "tflops",
        "timing": "host-loop",
        "points": [[1024, 1024, 1024, 180.0], [4096, 4096, 4096, 780.0]],
    }
    assert [r[:3] for r in gf.points(table)] == [(4096, 4096, 4096)]
    assert len(gf.points({**table, "timing": "kernel"})) == 2


def test_named_profiles_price_gemms_at_the_fitted_rates():
    prof = perf.named_profile("h100-sxm-8", 1)
    dev = prof["devices"][0]
    for precision in ("fp32", "tf32", "bf16", "fp16"):
        fit = gf.rate("h100-sxm", precision)
        assert dev[precision]["peak_flops"] == fit["peak_flops"]
        assert dev[precision]["half_work_flops"] == fit["half_work_flops"]
    urls = {s["url"] for s in prof["sources"]}
    assert any("matmul_interpolator_data" in u for u in urls), "the GEMM tables are the profile's sources"
    # the mixed pair: each GPU its own rate, bf16 from its own table
    pair = perf.named_profile("rtx5080-rtx4060")["devices"]
    assert pair[0]["bf16"]["peak_flops"] > 2 * pair[1]["bf16"]["peak_flops"] > 0


def test_fp16_and_bf16_share_a_fit_only_where_one_is_missing():
    fits = gf.fitted_rates()
    assert fits[("h100-sxm", "fp16")].get("shared_from") == "bf16"
    assert fits[("a100-80gb", "bf16")].get("shared_from") == "fp16"
    assert "shared_from" not in fits[("h100-sxm", "bf16")]


def test_a_wrong_rate_fails_the_bounds():
    fits = copy.deepcopy(gf.fitted_rates())
    fits[("h100-sxm", "fp32")]["half_work_flops"] *= 10  # e.g. the tensor-core fixed cost given to FP32
    assert max(_errors("torch-mm-h100-sxm-fp32", fits)) > gf.BOUNDS["worst"]
    fits = copy.deepcopy(gf.fitted_rates())
    fits[("a100-80gb", "fp16")]["peak_flops"] /= 1.5
    assert np.median(_errors("azure-nd-a100-v4-fp16", fits)) > gf.BOUNDS["median"]


@pytest.mark.parametrize(
    "name, known",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA GH200 480GB", None),  # a Grace Hopper superchip: its own memory and host link
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None),
        ("NVIDIA GeForce RTX 4060 Laptop GPU", None),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-PCIE-40GB", None),
        ("NVIDIA GeForce RTX 5080", "rtx-5080"),
        ("NVIDIA GeForce RTX 4060", "rtx-4060"),
        ("NVIDIA GeForce RTX 4060 Ti", None),
        ("NVIDIA L4", None),
        ("Emulated GPU 0 (mgpu CPU emulation, not a real GPU)", None),
    ],
)
def test_a_visible_gpu_of_a_named_profile_is_priced_at_its_published_rates(monkeypatch, name, known):
    class FakeCore:
        perf = perf._core.perf

        @staticmethod
        def build_info():
            return {
                "cuda": {
                    "devices": [
                        {"name": name, "multiprocessors": 132, "total_memory_mib": 81559, "compute_capability": "9.0"}
                    ]
                }
            }

    monkeypatch.setattr(perf, "_core", FakeCore)
    dev = perf.detected_profile()["devices"][0]
    if known:
        assert dev["fp32"]["peak_flops"] == gf.rate(known, "fp32")["peak_flops"]
        assert dev["bf16"]["half_work_flops"] == gf.rate(known, "bf16")["half_work_flops"]
    else:  # estimated from its properties: not any fitted GPU's rate
        fitted = {f["peak_flops"] for f in gf.fitted_rates().values()}
        assert dev["fp32"]["peak_flops"] not in fitted
    assert dev["memory_bytes"] == 81559 * 2**20 and dev["name"] == name


@pytest.mark.parametrize(
    "cc, lanes, bf16_over_fp32",
    [("9.0", 128, 16.0), ("8.0", 64, 16.0), ("8.9", 128, 4.0), ("7.0", 64, None), ("7.5", 64, None)],
)
def test_an_unknown_gpu_is_estimated_with_the_fitted_gpus_fixed_time(monkeypatch, cc, lanes, bf16_over_fp32):
    # Every precision's fixed time (half / peak) is the small kernels' measured one: one
    # half-peak work shared by all precisions gave FP32 GEMMs a fixed cost 10-16x too long.
    class FakeCore:
        perf = perf._core.perf

        @staticmethod
        def build_info():
            return {
                "cuda": {
                    "devices": [
                        {
                            "name": "NVIDIA L4",
                            "multiprocessors": 58,
                            "total_memory_mib": 23034,
                            "compute_capability": cc,
                        }
                    ]
                }
            }

    monkeypatch.setattr(perf, "_core", FakeCore)
    dev = perf.detected_profile()["devices"][0]
    assert dev["fp32"]["peak_flops"] == pytest.approx(0.7 * 58 * lanes * 2 * 1.7e9)
    for precision in ("fp32", "tf32", "bf16", "fp16"):
        if precision in dev:
            rate = dev[precision]
            assert rate["half_work_flops"] / rate["peak_flops"] == pytest.approx(gf.TYPICAL_FIXED_S)
    if bf16_over_fp32:
        assert dev["bf16"]["peak_flops"] == pytest.approx(bf16_over_fp32 * dev["fp32"]["peak_flops"])
    else:  # Volta: FP16 tensor cores only
        assert "bf16" not in dev and "tf32" not in dev and dev["fp16"]["peak_flops"] > dev["fp32"]["peak_flops"]


def test_a_gpu_calibration_is_checked_against_the_fit(tmp_path, capsys):
    # What a lent GPU shows (scripts/gpu_session.sh gemm): topo's measured points of an
    # H100 against the published fit, point by point; GPUs no fit knows are left out.
    fit = gf.rate("h100-sxm", "bf16")
    at = lambda w, slower: fit["peak_flops"] * w / (w + fit["half_work_flops"]) / slower  # noqa: E731
    profile = {
        "devices": [
            {
                "name": "NVIDIA H100 80GB HBM3",
                "kind": "cuda",
                "bf16": {"measured": [[2e8, at(2e8, 1.0)], [2e10, at(2e10, 1.25)]]},
            },
            {"name": "NVIDIA L4", "kind": "cuda", "bf16": {"measured": [[2e8, 1e12]]}},
        ]
    }
    rows = gf.check_profile(profile)
    assert [(r["device"], r["precision"]) for r in rows] == [(0, "bf16"), (0, "bf16")]
    assert rows[0]["error"] == pytest.approx(0.0) and rows[1]["error"] == pytest.approx(1 / 1.25 - 1)
    path = tmp_path / "topo.json"
    path.write_text(__import__("json").dumps(profile))
    assert gf.main(["--check-profile", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("(h100-sxm) bf16") == 2 and "-20.0%" in out
