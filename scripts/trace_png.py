"""Render a `mgpu train --trace` JSON (Chrome trace events) as a PNG with matplotlib: one
horizontal lane per rank, each step's phases coloured, steps labelled, and under them the
rank's gradient buckets from launch to completion (its "allreduce" lane). For pictures in
docs (README "Watching a run"); to explore a trace, open it in ui.perfetto.dev instead.

    python scripts/trace_png.py out/trace.json docs/trace.png [--steps A:B]
"""
from __future__ import annotations

import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Phase and loop-span colours, in the order the trace's steps run them (observe.PHASES).
COLOURS = {"data": "#bbbbbb", "forward": "#4c72b0", "backward": "#dd8452", "allreduce wait": "#c44e52",
           "health check + optimizer": "#55a868", "validation": "#8172b3", "checkpoint": "#937860"}


def render(doc: dict, out: str, steps=None, title: str = "") -> None:
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}

    def wanted(e):
        step = e.get("args", {}).get("step")
        return e.get("ph") == "X" and (steps is None or (step is not None and steps[0] <= step < steps[1]))
    spans = [e for e in events if wanted(e)]
    if not spans:
        raise SystemExit(f"trace_png: no steps in {steps} in this trace")
    t0 = min(e["ts"] for e in spans)
    ms = lambda us: (us - t0) / 1000.0  # noqa: E731
    ranks = sorted(names)
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.75 * len(ranks)))
    for e in spans:
        y = ranks.index(e["pid"])
        if e.get("cat") == "allreduce":  # a bucket, under the phases; neighbours in two shades
            shade = ("#7a1f23", "#e3868a")[e["args"].get("bucket", 0) % 2]
            ax.broken_barh([(ms(e["ts"]), max(e["dur"], 1) / 1000.0)], (y + 0.2, 0.14), facecolors=shade,
                           linewidth=0)
        elif e.get("cat") == "step":  # the step's outline, its number above it
            ax.broken_barh([(ms(e["ts"]), e["dur"] / 1000.0)], (y - 0.38, 0.76), facecolors="none",
                           edgecolors="black", linewidth=0.8)
            ax.text(ms(e["ts"]) + e["dur"] / 2000.0, y - 0.42, e["name"], ha="center", va="bottom", fontsize=7)
        else:
            ax.broken_barh([(ms(e["ts"]), e["dur"] / 1000.0)], (y - 0.3, 0.46),
                           facecolors=COLOURS.get(e["name"], "#999999"), linewidth=0)
    ax.set_yticks(range(len(ranks)), [names[r] for r in ranks])
    ax.set_ylim(len(ranks) - 0.4, -0.65)  # rank 0 on top, room for the step labels
    ax.set_xlabel("ms (from the first step shown; all ranks on one clock)")
    present = {e["name"] for e in spans if e.get("cat") not in ("step", "allreduce")}
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for n, c in COLOURS.items() if n in present]
    labels = [n for n in COLOURS if n in present]
    if any(e.get("cat") == "allreduce" for e in spans):
        handles.append(plt.Rectangle((0, 0), 1, 1, color="#7a1f23"))
        labels.append("bucket allreduce (launch to done)")
    fig.legend(handles, labels, ncol=len(handles), fontsize=7, loc="lower center", frameon=False)
    ax.grid(axis="x", alpha=0.3)
    info = doc.get("otherData", {})
    run = ", ".join(x for x in (f"{info['world_size']} rank(s)" if "world_size" in info else "",
                                info.get("device", ""),
                                "-".join(map(str, info.get("layers", []))) and
                                f"MLP {'-'.join(map(str, info['layers']))}",
                                "batch_size" in info and f"global batch {info['batch_size']}") if x)
    ax.set_title(title or f"mgpu train --trace{': ' + run if run else ''} "
                          f"(matplotlib rendering of the trace JSON)", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))  # room for the legend under the axis
    fig.savefig(out, dpi=90)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("png")
    p.add_argument("--steps", default=None, help="A:B, the steps A <= step < B to draw (default: all traced)")
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    steps = tuple(int(v) for v in a.steps.split(":")) if a.steps else None
    with open(a.trace) as f:
        render(json.load(f), a.png, steps, a.title)
    print(f"written to {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
