"""The named GPU profiles' GEMM rates, fitted to published GEMM benchmarks.

The perf model prices a GEMM of w FLOP at rate(w) = peak * w / (w + half) (GemmRate in
perf_model.h): the time is w / peak plus a fixed half / peak. Each GPU type and
precision with a published table (data/gemm_published.json) gets the (peak, half) that
minimise the squared relative error of the time over its 'fit' tables' rows; 'holdout'
tables are only checked. fp16 and bf16 share the tensor cores' rate: one with no
table of its own takes the other's fit. The fit is a bounded linear least squares
(numpy, no scipy), done when a profile first needs it.

    python -m mgpu.gemm_fit --markdown docs/gemm-validation.md
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
from typing import Optional

import numpy as np

from .hardware import gemm_curve, known_gpu_type

DATA = os.path.join(os.path.dirname(__file__), "data", "gemm_published.json")
BOUNDS = {"median": 0.15, "worst": 0.35}  # per table, as for the allreduce tables (issue 13)
HOST_BOUND_S = 20e-6  # host-loop rows faster than this a call measure the host's dispatch
# A GEMM's fixed time (half / peak). Where kernel-timed tables reach small sizes a small
# GEMM takes 5-7 us (XLA's H100 table: 256^3 in 5.2 us BF16, 5.9 TF32; cuBLASLt on an RTX
# 4060 Ti, github.com/AD2605/gemm-zoo benchmarks.md at 674e352: 128^3 in 6.5-7.0 us). Tables
# from 1024^3 up cannot tell a fixed time from a slow mid-size kernel (an RTX 5080's 1024^3
# FP32 at 2/3 of its 2048^3 rate would fit 31 us): the bounds keep their extrapolation to
# the small GEMMs of an MLP step near what was measured there. The lower one is the fastest
# small GEMM measured (5.2 us): an RTX 4060's FP32 table, slower per FLOP at 10240^3 than at
# 1024^3, fitted no fixed time at all, and a mixed RTX 5080 + RTX 4060 pair then gave the
# 4060 four times the 5080's rows of a small model.
MIN_FIXED_S, TYPICAL_FIXED_S, MAX_FIXED_S = 5e-6, 6e-6, 10e-6
_SHARED = {"fp16": "bf16", "bf16": "fp16"}


@functools.lru_cache(maxsize=1)
def load_published() -> dict:
    with open(DATA) as f:
        return json.load(f)


def points(table: dict) -> list:
    """(m, n, k, work FLOP, seconds a GEMM) of a table's rows, less host-bound ones."""
    out = []
    for m, n, k, value in table["points"]:
        work = 2.0 * m * n * k
        to_seconds = {
            "tflops": lambda v, w=work: w / (v * 1e12),
            "flops": lambda v, w=work: w / v,
            "time_us": lambda v: v * 1e-6,
        }
        seconds = to_seconds[table["quantity"]](value)
        if table["timing"] == "host-loop" and seconds < HOST_BOUND_S:
            continue
        out.append((int(m), int(n), int(k), work, seconds))
    return out


def fit_rate(rows: list, harness: Optional[list] = None, fixed_s: Optional[float] = None) -> tuple:
    """(peak FLOP/s, half FLOP, {table: seconds}) minimising the squared relative error of
    the time w / peak + half / peak (+ the harness's cost a call, for rows whose harness[i]
    names a table timed per call by events, which bracket its dispatch: fitted per table).
    A linear least squares in (1 / peak, fixed time, harness costs) with the fixed time in
    [MIN_FIXED_S, MAX_FIXED_S] (or at fixed_s where given: the caller's for tables that cannot
    show one) and the costs >= 0, by trying each bound active or not."""
    if fixed_s is not None and not MIN_FIXED_S <= fixed_s <= MAX_FIXED_S:
        raise ValueError(f"a fixed time must lie in {MIN_FIXED_S}-{MAX_FIXED_S} s, got {fixed_s}")
    harness = harness or [None] * len(rows)
    if not rows:
        raise ValueError("no rows to fit")
    groups = sorted({h for h in harness if h is not None})
    work = np.array([r[3] for r in rows])
    t = np.array([r[4] for r in rows])
    cols = [work / t, 1.0 / t] + [np.array([h == g for h in harness]) / t for g in groups]
    a = np.stack(cols, axis=1)
    best = None
    # With every row timed by events, a GEMM's fixed time and the harness's cost are one
    # constant: the fixed time is then the small kernels' measured one.
    choices = (
        (fixed_s,)
        if fixed_s is not None
        else (TYPICAL_FIXED_S,)
        if all(h is not None for h in harness)
        else ("free", MIN_FIXED_S, MAX_FIXED_S)
    )
    for fixed_choice in choices:
        for zeroed in itertools.product((False, True), repeat=len(groups)):
            theta = np.zeros(a.shape[1])
            free = [0] + ([1] if fixed_choice == "free" else []) + [2 + j for j, z in enumerate(zeroed) if not z]
            if fixed_choice != "free":
                theta[1] = fixed_choice
            rhs = np.ones(len(t)) - a @ theta
            theta[free] = np.linalg.lstsq(a[:, free], rhs, rcond=None)[0]
            if (
                theta[0] <= 0
                or not MIN_FIXED_S * (1 - 1e-9) <= theta[1] <= MAX_FIXED_S * (1 + 1e-9)
                or (theta[2:] < 0).any()
            ):
                continue
            cost = float(((a @ theta - 1.0) ** 2).sum())
            if best is None or cost < best[0]:
                best = (cost, theta)
    if best is None:
        raise ValueError("no rate with a positive peak fits these rows")
    theta = best[1]
    peak = 1.0 / theta[0]
    return peak, float(theta[1] * peak), {g: float(c) for g, c in zip(groups, theta[2:])}


@functools.lru_cache(maxsize=1)
def fitted_rates() -> dict:
    """{(gpu type, precision): {"peak_flops", "half_work_flops", "tables", "harness_s"}} from
    the fit tables (harness_s: the fitted cost a call of event-timed tables' harnesses)."""
    rows, harness, tables, timings = {}, {}, {}, {}
    for t in load_published()["tables"]:
        if t["role"] != "fit":
            continue
        for gpu in t["gpus"]:
            key = (gpu, t["precision"])
            new = points(t)
            rows.setdefault(key, []).extend(new)
            harness.setdefault(key, []).extend([t["id"] if t["timing"] == "events" else None] * len(new))
            tables.setdefault(key, []).append(t["id"])
            timings.setdefault(key, set()).add(t["timing"])
    out = {}
    for key, r in rows.items():
        # Host-loop rows start where a call outlasts the host's dispatch (20 us): they cannot
        # tell a 5-10 us fixed time from a slow mid-size kernel, and fitted it at either bound
        # (an RTX 4060's 0, an RTX 5080's 10 us), which ranked the 4060 faster on the small
        # GEMMs of an MLP step. Their fixed time is the small kernels' measured one.
        fixed = TYPICAL_FIXED_S if timings[key] == {"host-loop"} else None
        try:
            peak, half, cost = fit_rate(r, harness[key], fixed)
        except ValueError:  # no rows, or none a bounded rate fits: the spec figures stand (the tests fail)
            continue
        out[key] = {"peak_flops": peak, "half_work_flops": half, "tables": tables[key], "harness_s": cost}
    for (gpu, precision), fit in list(out.items()):
        other = _SHARED.get(precision)
        if other and (gpu, other) not in out:
            out[(gpu, other)] = {**fit, "shared_from": precision}
    return out


def rate(gpu: str, precision: str) -> Optional[dict]:
    """The fitted rate of a GPU type at a precision (its sibling's where it prices on one), or None
    where no table has it."""
    return fitted_rates().get((gemm_curve(gpu), precision))


def sources(gpu: str) -> list:
    """The published tables behind a GPU type's fitted rates, as profile sources."""
    return [
        {"url": t["source"], "figure": f"GEMM table ({t['role']}, {t['precision']}): {t['system']}"}
        for t in load_published()["tables"]
        if gemm_curve(gpu) in t["gpus"]
    ]


def validate(fits: Optional[dict] = None) -> list:
    """Every row of every table against its GPU's fitted rate: error = predicted / measured time - 1."""
    fits = fitted_rates() if fits is None else fits
    out = []
    for t in load_published()["tables"]:
        gpu = t["gpus"][0]
        fit = fits.get((gpu, t["precision"]))
        if fit is None:
            continue
        for m, n, k, work, seconds in points(t):
            predicted = (work + fit["half_work_flops"]) / fit["peak_flops"] + fit["harness_s"].get(t["id"], 0.0)
            out.append(
                {
                    "table": t["id"],
                    "gpu": gpu,
                    "precision": t["precision"],
                    "role": t["role"],
                    "shape": (m, n, k),
                    "measured_tflops": work / seconds / 1e12,
                    "predicted_tflops": work / predicted / 1e12,
                    "error": predicted / seconds - 1.0,
                }
            )
    return out


def summary(rows: list) -> list:
    by = {}
    for r in rows:
        by.setdefault(r["table"], []).append(r)
    out = []
    for table, rs in by.items():
        errs = [abs(r["error"]) for r in rs]
        worst = max(rs, key=lambda r: abs(r["error"]))
        out.append(
            {
                "table": table,
                "gpu": rs[0]["gpu"],
                "precision": rs[0]["precision"],
                "role": rs[0]["role"],
                "points": len(rs),
                "median": float(np.median(errs)),
                "worst": max(errs),
                "worst_at": "x".join(map(str, worst["shape"])),
            }
        )
    return out


def markdown() -> str:
    rows, fits = validate(), fitted_rates()
    doc = load_published()
    lines = [
        "# Selector validation: GEMM rates against published benchmarks",
        "",
        "Generated by `python -m mgpu.gemm_fit --markdown docs/gemm-validation.md` from "
        "`python/mgpu/selector/data/gemm_published.json`. The named GPU profiles price a GEMM of w FLOP at "
        "rate(w) = peak w / (w + half), i.e. w / peak plus a fixed time half / peak (the model adds the "
        "launch apart), fitted per GPU and precision to the 'fit' tables (least squares on the relative "
        "error of the time); 'holdout' tables are never fitted. Error = predicted / measured time - 1. The "
        f"fixed time lies in {MIN_FIXED_S * 1e6:.0f}-{MAX_FIXED_S * 1e6:.0f} us (small GEMMs measured kernel "
        "by kernel take 5-7 us; tables from 1024^3 up cannot tell a fixed time from a slow mid-size kernel, "
        "nor show one a table slower per FLOP at its largest sizes would fit below zero: a GPU and "
        f"precision fitted to host-loop tables alone takes the {TYPICAL_FIXED_S * 1e6:.0f} us small kernels "
        "take). Tables timed per "
        "call by CUDA events also time their harness's dispatch: a cost a call fitted per table, with the "
        f"GEMM's fixed time then at the {TYPICAL_FIXED_S * 1e6:.0f} us small kernels take. Rows of "
        f"host-timed loops under {HOST_BOUND_S * 1e6:.0f} us a call are left out (the host's dispatch, not "
        "the GPU, set them). tests/unit/test_gemm_model.py asserts the bounds (median |error| <= "
        f"{BOUNDS['median']:.0%}, worst <= {BOUNDS['worst']:.0%} per table). Below a table's smallest size "
        "the rate is the fit's extrapolation.",
        "",
        "| GPU | precision | peak TFLOP/s | half-peak work GFLOP | fixed time us | harness us a call | fitted to |",
        "|---|---|---|---|---|---|---|",
    ]
    for (gpu, precision), f in sorted(fits.items()):
        fitted = ", ".join(f["tables"]) + (f" (the {f['shared_from']} fit)" if "shared_from" in f else "")
        harness = ", ".join(f"{c * 1e6:.1f}" for c in f["harness_s"].values()) or "-"
        lines.append(
            f"| {gpu} | {precision} | {f['peak_flops'] / 1e12:.1f} | {f['half_work_flops'] / 1e9:.3g} | "
            f"{f['half_work_flops'] / f['peak_flops'] * 1e6:.1f} | {harness} | {fitted} |"
        )
    lines += [
        "",
        "| table | GPU | precision | role | points | median abs error | worst abs error (at m x n x k) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summary(rows):
        lines.append(
            f"| {s['table']} | {s['gpu']} | {s['precision']} | {s['role']} | {s['points']} | "
            f"{s['median']:.1%} | {s['worst']:.1%} ({s['worst_at']}) |"
        )
    lines += ["", "## Sources", ""]
    for t in doc["tables"]:
        lines.append(
            f"- `{t['id']}` ({t['role']}, {', '.join(t['gpus'])}, {t['precision']}, timing: {t['timing']}): "
            f"{t['system']}. {t['source']} ({t['note']})"
        )
    lines += [
        "",
        "## Every point",
        "",
        "| table | m x n x k | measured TFLOP/s | predicted TFLOP/s | error |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['table']} | {'x'.join(map(str, r['shape']))} | {r['measured_tflops']:.1f} | "
            f"{r['predicted_tflops']:.1f} | {r['error']:+.1%} |"
        )
    return "\n".join(lines) + "\n"


def check_profile(profile: dict) -> list:
    """A calibration's GEMM points (mgpu topo on GPUs) against the published fit of each
    of its GPUs that a named profile knows: rows of device, precision, work, measured and
    fitted FLOP/s, error (fitted / measured time - 1). The fit's time has no launch; topo's
    points do, so small GEMMs read slower than the fit by about a launch."""
    rows = []
    for i, dev in enumerate(profile.get("devices", [])):
        gpu = known_gpu_type(str(dev.get("name", ""))) if dev.get("kind") == "cuda" else None
        for precision in ("fp32", "tf32", "bf16", "fp16"):
            fit = rate(gpu, precision) if gpu else None
            if fit is None:
                continue
            for work, measured in (dev.get(precision) or {}).get("measured", []):
                fitted = fit["peak_flops"] * work / (work + fit["half_work_flops"])
                rows.append(
                    {
                        "device": i,
                        "gpu": gpu,
                        "precision": precision,
                        "work": work,
                        "measured_flops": measured,
                        "fitted_flops": fitted,
                        "error": measured / fitted - 1.0,
                    }
                )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mgpu.gemm_fit", description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", metavar="PATH", help="write the validation page here")
    ap.add_argument(
        "--check-profile",
        metavar="PATH",
        help="compare a GPU calibration's GEMM points (mgpu topo --device cuda --json) with the fits",
    )
    a = ap.parse_args(argv)
    if a.check_profile:
        with open(a.check_profile) as f:
            doc = json.load(f)
        rows = check_profile(doc.get("profile", doc))
        if not rows:
            print("no GEMM points of a GPU the published fits know (H100, A100 SXM, RTX 5080, RTX 4060)")
        for r in rows:
            print(
                f"GPU {r['device']} ({r['gpu']}) {r['precision']:4s} {r['work'] / 1e9:10.4f} GFLOP  measured "
                f"{r['measured_flops'] / 1e12:8.2f} TFLOP/s  fit {r['fitted_flops'] / 1e12:8.2f}  time error of "
                f"the fit {r['error']:+.1%}"
            )
        return 0
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown())
    for s in summary(validate()):
        print(
            f"{s['table']:28s} {s['role']:8s} {s['points']:3d} points  median {s['median']:6.1%}  "
            f"worst {s['worst']:6.1%} at {s['worst_at']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
