"""Turns a GPU session's outputs ($OUT of scripts/gpu_session.sh) into a dated section of
docs/gpu-results.md: the device and versions, and each measured `bench` step beside the
cost sheet's prediction for the same workload (`bench --explain`).

    python3 scripts/gpu_report.py OUT_DIR [--doc docs/gpu-results.md] [--no-append] [--emulated]

Writes OUT_DIR/gpu-results-section.md and appends it to the doc unless --no-append (the device
tool brings OUT_DIR back; the doc edit on the device machine does not travel, so copy the section
in). Results of the GPU emulation are left out, or with --emulated (a dry run of the session)
listed with every row marked EMULATED.
"""

import argparse
import datetime
import glob
import json
import os
import re
import sys


def first_line(path, pattern):
    try:
        with open(path) as f:
            for line in f:
                if re.search(pattern, line):
                    return line.strip()
    except OSError:
        pass
    return "not recorded"


def key(w):
    # rows from before --data-on-device copied their inputs in
    return (
        tuple(w["layers"]),
        w["batch"],
        w["precision"],
        w["accumulate"],
        bool(w["cuda_graph"]),
        bool(w.get("data_on_device", False)),
    )


def selector_rows(out_dir, emulated_ok):
    """One row per 1-rank GPU step of `bench --validate-selector` (selector-*.json) that has a prediction."""
    rows = []
    for path in sorted(glob.glob(os.path.join(out_dir, "selector-*.json"))):
        result = json.load(open(path))
        emulated = bool(result.get("gpu_emulation"))
        if emulated and not emulated_ok:
            continue
        for r in result["rows"]:
            if r["device"] != "cuda" or r["ranks"] != 1 or not r.get("predicted_step_ms"):
                continue
            step, predicted = r["step"]["median"] * 1e3, r["predicted_step_ms"]
            rows.append(
                f"| {os.path.basename(path)}{' (EMULATED)' if emulated else ''} | "
                f"{','.join(map(str, r['layers']))} | {r['batch_size']} | {step:.4g} | {predicted:.4g} | "
                f"{step / predicted - 1:+.1%} |"
            )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--doc", default=os.path.join(os.path.dirname(__file__), "..", "docs", "gpu-results.md"))
    p.add_argument("--no-append", action="store_true", help="write the section file only, not the doc")
    p.add_argument("--emulated", action="store_true", help="list the emulation's results, marked EMULATED")
    a = p.parse_args()
    env = os.path.join(a.out_dir, "env.log")
    predicted = {}
    for path in glob.glob(os.path.join(a.out_dir, "explain-*.json")):
        for sheet in json.load(open(path))["cost_sheets"]:
            predicted[key(sheet["workload"])] = sheet["totals"]
    rows = []
    for path in sorted(glob.glob(os.path.join(a.out_dir, "bench-*.json"))):
        result = json.load(open(path))
        emulated = bool(result.get("gpu_emulation"))
        if emulated and not a.emulated:
            print(f"gpu_report: {path} comes from the GPU emulation: not a GPU figure, left out", file=sys.stderr)
            continue
        for r in result["rows"]:
            if r["device"] != "cuda":
                continue
            w = {
                "layers": r["layers"],
                "batch": r["batch_size"],
                "precision": r["precision"],
                "accumulate": r.get("accumulate", 1),
                "cuda_graph": r.get("cuda_graph", False),
                "data_on_device": r.get("data_on_device", False),
            }
            t = predicted.get(key(w))
            step = r["step"]["median"] * 1e3
            lo, hi = (v * 1e3 for v in r["step"]["ci95"])
            torch = r.get("torch", {}).get("samples_per_sec")
            sheet = f"{t['step_ms']:.4g} | {t['floor_ms']:.4g} | {step / t['floor_ms']:.3g}x" if t else "- | - | -"
            peer = f"{r['samples_per_sec'] / torch:.2f}x" if torch else "-"
            rows.append(
                f"| {os.path.basename(path)}{' (EMULATED)' if emulated else ''} | "
                f"{w['batch']} x {r['ranks']} | {w['precision']} | "
                f"{w['accumulate']} | {'on' if r.get('cuda_graph') else 'off'} | "
                f"{'on the GPU' if w['data_on_device'] else 'prefetched'} | "
                f"{step:.4g} ({lo:.4g}-{hi:.4g}) | {sheet} | {peer} |"
            )
    today = datetime.date.today().isoformat()
    title = f"Session of {today} (scripts/gpu_session.sh)"
    if a.emulated:
        title = f"Dry run of {today} on the GPU emulation (EMULATED: no figure here is a GPU's)"
    section = [
        f"\n## {title}\n",
        f"- device: {first_line(env, r'NVIDIA|GPU')}",
        f"- driver/CUDA: {first_line(env, r'Driver Version|CUDA Version')}",
        f"- nvcc: {first_line(env, r'release')}",
        f"- torch: {first_line(env, r'^torch')}",
        f"- MPI: {first_line(env, r'Open MPI|MPICH')}",
        "",
        "Measured step (median, 95 % interval) against the cost sheet's prediction and floor "
        "(`bench --explain`, H100 SXM figures; on another GPU the prediction does not apply):",
        "",
        "| run | batch x ranks | precision | accumulate | graph | inputs | step ms | predicted ms | floor ms | "
        "step / floor | vs PyTorch |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    if not rows:
        section.append("| (no GPU bench results found) ||||||||||| ")
    selector = selector_rows(a.out_dir, a.emulated)
    if selector:
        section += [
            "",
            "The selector's 1-GPU prediction (`bench --validate-selector` on the session's `topo` profile): "
            "error = measured / predicted - 1:",
            "",
            "| run | layers | batch | step ms | predicted ms | error |",
            "|---|---|---|---|---|---|",
            *selector,
        ]
    text = "\n".join(section) + "\n"
    with open(os.path.join(a.out_dir, "gpu-results-section.md"), "w") as f:
        f.write(text)
    if not a.no_append:
        with open(a.doc, "a") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
