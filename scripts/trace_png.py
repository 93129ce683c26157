"""Render a `mgpu train --trace` JSON (Chrome trace events) as a PNG with matplotlib: one
horizontal lane per rank (and one per GPU compute stream), each step's phases coloured, the
layers of forward and backward as ticks along their bottom edge, steps labelled, and under
them the rank's gradient buckets from launch to completion (its "allreduce" lane). For
pictures in docs (docs/observability.md); to explore a trace, open it in ui.perfetto.dev.

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
COLOURS = {
    "data": "#bbbbbb",
    "stage": "#777777",
    "forward": "#4c72b0",
    "loss": "#da8bc3",
    "backward": "#dd8452",
    "forward + loss + backward": "#64b5cd",
    "allreduce wait": "#c44e52",
    "health check": "#ccb974",
    "optimizer": "#55a868",
    "validation": "#8172b3",
    "checkpoint": "#937860",
}


def colour_key(name: str) -> str:
    """A span's legend entry: graph runs ("forward + loss + backward (graph replay)") share one."""
    return name.split(" (")[0]


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
    # A row per rank's host lane, and per rank's GPU compute stream (tid 2) where there is one.
    rows = sorted({(e["pid"], 2 if e.get("tid") == 2 else 0) for e in spans})
    lane_names = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    fig, ax = plt.subplots(figsize=(10, 1.3 + 0.75 * len(rows)))
    for e in spans:
        y = rows.index((e["pid"], 2 if e.get("tid") == 2 else 0))
        if e.get("cat") == "allreduce":  # a bucket, under the phases; neighbours in two shades
            shade = ("#7a1f23", "#e3868a")[e["args"].get("bucket", 0) % 2]
            ax.broken_barh([(ms(e["ts"]), max(e["dur"], 1) / 1000.0)], (y + 0.2, 0.14), facecolors=shade, linewidth=0)
        elif e.get("cat") == "step":  # the step's outline, its number above it
            ax.broken_barh(
                [(ms(e["ts"]), e["dur"] / 1000.0)],
                (y - 0.38, 0.76),
                facecolors="none",
                edgecolors="black",
                linewidth=0.8,
            )
            ax.text(ms(e["ts"]) + e["dur"] / 2000.0, y - 0.42, e["name"], ha="center", va="bottom", fontsize=7)
        elif e.get("cat") == "layer":  # a layer inside forward/backward: a tick along the phase's bottom
            shade = ("#222222", "#eeeeee")[int(e["name"].rsplit(" ", 1)[-1]) % 2]
            ax.broken_barh(
                [(ms(e["ts"]), e["dur"] / 1000.0)], (y + 0.08, 0.08), facecolors=shade, linewidth=0, zorder=3
            )
        else:
            ax.broken_barh(
                [(ms(e["ts"]), e["dur"] / 1000.0)],
                (y - 0.3, 0.46),
                facecolors=COLOURS.get(colour_key(e["name"]), "#999999"),
                linewidth=0,
            )

    def row_label(pid, lane):
        if lane == 0:
            return names[pid]
        emulated = "EMULATED " if "EMULATED" in lane_names.get((pid, 2), "") else ""
        return f"rank {pid}: {emulated}GPU stream"

    ax.set_yticks(range(len(rows)), [row_label(pid, lane) for pid, lane in rows])
    ax.set_ylim(len(rows) - 0.4, -0.65)  # rank 0 on top, room for the step labels
    ax.set_xlabel("ms (from the first step shown; all ranks on rank 0's clock)")
    present = {colour_key(e["name"]) for e in spans if e.get("cat") not in ("step", "allreduce", "layer")}
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for n, c in COLOURS.items() if n in present]
    labels = [n for n in COLOURS if n in present]
    if any(e.get("cat") == "layer" for e in spans):
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="#222222", edgecolor="#999999"))
        labels.append("layers (alternating shades)")
    if any(e.get("cat") == "allreduce" for e in spans):
        handles.append(plt.Rectangle((0, 0), 1, 1, color="#7a1f23"))
        labels.append("bucket allreduce (launch to done)")
    fig.legend(handles, labels, ncol=min(len(handles), 6), fontsize=7, loc="lower center", frameon=False)
    ax.grid(axis="x", alpha=0.3)
    info = doc.get("otherData", {})
    run = ", ".join(
        x
        for x in (
            f"{info['world_size']} rank(s)" if "world_size" in info else "",
            info.get("device", ""),
            "-".join(map(str, info.get("layers", []))) and f"MLP {'-'.join(map(str, info['layers']))}",
            "batch_size" in info and f"global batch {info['batch_size']}",
        )
        if x
    )
    ax.set_title(
        title or f"mgpu train --trace{': ' + run if run else ''} (matplotlib rendering of the trace JSON)", fontsize=9
    )
    legend_rows = -(-len(handles) // 6)
    fig.tight_layout(rect=(0, 0.06 * legend_rows + 0.02, 1, 1))  # room for the legend under the axis
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
