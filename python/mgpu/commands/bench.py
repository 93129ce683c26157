"""`mgpu bench`: training throughput by model, batch size and rank count, seed 001's
methodology, with the physical floors beside each figure.

Per (batch size, ranks): warm-up steps excluded, then repeats x measured steps,
each step timed; outliers (modified z-score > 3.5) removed; median, mean and
95% confidence interval of the step time; the step broken down (forward,
backward, exposed allreduce, optimizer) by the core's timers; speedup and
efficiency against 1 rank; peak memory; the compute floor (model FLOPs at the
measured GEMM rate) and the allreduce floor (the calibrated alpha-beta model).
`--ranks 1,2,...` launches mpirun itself; with several rank counts in rounds that
alternate them (1 2, 2 1, 1 2, ...: `--repeats` rounds, one repeat each; not with
`--observe`), so the machine's drift falls on every count and a speedup is the
median of the rounds' paired ratios; under mpirun it measures the running world.
`--threads 1,2` does the same for thread counts per rank (each its own launch), and
its speedup is then against the fewest ranks with the fewest threads. `--compare torch` runs
the same workload in PyTorch (DDP) in the same run, in rounds alternating with
mgpu's (mgpu, torch, mgpu, ...: the machine's drift falls on both), and reports the
ratio per round; `--validate-selector` sets the selector's predictions beside the
measurements.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import socket
import sys
from typing import Optional

import numpy as np

from .._core import __version__
from .._runtime import gpus_emulated
from ..atomic import atomic_file, write_json_atomic
from ..calibrate.bench import (
    VALIDATION_BOUND,
    add_derived,
    measure_world,
    merge_rounds,
    resolve_layers,
    run_torch,
    run_worker,
    score_validation,
    torch_python,
    validate_selector,
)
from ..errors import ConfigError
from ..selector import costsheet, history
from ..selector.hardware import GPUS, PRECISIONS
from ..selector.memory import gpu_step_memory
from ..selector.profiles import default_profile_path, emulation_mismatch, resolve_profile
from ..selector.tuning import calibration_for
from ..train.config import DATA_PLACEMENTS, GRAD_DTYPES, GRAPH_MODES, PRESETS
from ..train.observe import import_summary_writer
from .common import MAX_THREADS, check_output_dir, check_outputs, int_list


def format_table(rows: list) -> str:
    head = (
        f"{'batch':>6} {'ranks':>5} {'thr':>3} {'samples/s':>10} {'95% CI step ms':>17} "
        f"{'fwd':>6} {'bwd':>6} {'comm':>6} {'opt':>5} {'speedup':>7} {'effic':>5} {'mem MB':>7} "
        f"{'floor ms':>8} {'ar floor':>8} {'torch/s':>9} {'ratio':>5}"
    )
    out = [head]

    def cell(value, spec: str, width: int, suffix: str = "") -> str:
        """A number, or '-' where the row has none (no 1-rank row to compare with, no peer)."""
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return f"{'-':>{width + len(suffix)}}"
        return f"{value:>{width}{spec}}{suffix}"

    for r in rows:
        b = r["breakdown_ms"]
        ci = r["step"]["ci95"]
        torch = r.get("torch", {})
        out.append(
            f"{r['batch_size']:>6} {r['ranks']:>5} {r['threads']:>3} {r['samples_per_sec']:>10,.0f} "
            f"{ci[0] * 1e3:>7.2f}-{ci[1] * 1e3:<8.2f} "
            f"{b['forward']:>6.2f} {b['backward']:>6.2f} {b['comm_wait']:>6.2f} "
            f"{b['optimizer']:>5.2f} {cell(r.get('speedup'), '.2f', 6, 'x')} {cell(r.get('efficiency'), '.0%', 5)} "
            f"{r['peak_memory_bytes'] / 2**20:>7.0f} {r['compute_floor_ms']:>8.2f} "
            f"{cell(r.get('allreduce_floor_ms'), '.2f', 8)} "
            f"{cell(torch.get('samples_per_sec'), ',.0f', 9)} "
            f"{cell(r['samples_per_sec'] / torch['samples_per_sec'] if torch else None, '.2f', 5)}"
        )
    return "\n".join(out)


def record_cells(path: str, profile: dict, rows: list, speedups: bool) -> None:
    """Each priced cell's measured step (and, with `speedups`, a multi-rank cell's speedup
    over 1 rank of its thread count) against its prediction, in the record beside the
    calibration at `path` (history.py)."""
    for r in (r for r in rows if "predicted_step_interval_ms" in r):
        several = speedups and r["ranks"] > 1
        history.append(
            path,
            profile.get("created"),
            r["ranks"],
            r["step"]["median"],
            r["predicted_step_ms"] / 1e3,
            "bench",
            r["inside_interval"],
            r.get("speedup") if several else None,
            r.get("predicted_speedup") if several else None,
            (r["core_round_trip_cpus"], r["core_round_trip_ns"])
            if r["ranks"] > 1 and "core_round_trip_ns" in r
            else None,
        )


def format_predictions(rows: list) -> str:
    """Each priced cell's measured step beside the prediction and its 80 % interval."""
    out = [f"{'batch':>6} {'ranks':>5} {'thr':>3} {'step ms':>9} {'predicted (80% interval)':>26} {'error':>7}"]
    if any(gpus_emulated(r["device"]) for r in rows):  # never mistakable for a real GPU's figures
        out[0] += "  (EMULATED GPUs: the CPU running mgpu's CUDA code)"
    for r in rows:
        if "predicted_step_interval_ms" not in r:
            why = r.get("prediction_error", "not priced")
            out.append(
                f"{r['batch_size']:>6} {r['ranks']:>5} {r['threads']:>3} {r['step']['median'] * 1e3:>9.3g}  {why}"
            )
            continue
        low, high = r["predicted_step_interval_ms"]
        measured = r["step"]["median"] * 1e3
        where = "" if r["inside_interval"] else "  OUTSIDE"
        predicted = f"{r['predicted_step_ms']:.3g} ({low:.3g}-{high:.3g})"
        out.append(
            f"{r['batch_size']:>6} {r['ranks']:>5} {r['threads']:>3} {measured:>9.3g} {predicted:>26} "
            f"{r['predicted_step_ms'] / measured - 1:>+7.0%}{where}"
        )
    return "\n".join(out)


def format_scores(scores: dict) -> str:
    """The selector's scores over this grid (score_validation) in a line or two."""
    if not scores["cells"]:
        lines = ["scores: no cell priced"]
    else:
        lines = [
            f"scores: step error median {scores['median_abs_error']:.1%}, 90th percentile "
            f"{scores['p90_abs_error']:.1%} over {scores['cells']} cells; the 80% interval held the measured "
            f"step in {scores['coverage']:.0%} of them"
        ]
        if scores.get("decisions"):
            lines[0] += (
                f"; decisions right in {sum(d['right'] for d in scores['decisions'])} of {len(scores['decisions'])} "
                f"batches ({scores['decision_accuracy']:.0%}), benchmark required in "
                f"{scores['benchmark_required_share']:.0%}"
            )
    lines += [f"  not priced: batch {u['batch_size']} x {u['ranks']} rank(s): {u['why']}" for u in scores["unpriced"]]
    return "\n".join(lines)


def format_validation(rows: list) -> str:
    out = [f"{'batch':>6} {'ranks':>5} {'measured':>9} {'predicted':>9} {'error':>7}  selector -> fastest measured"]
    for v in rows:
        pred = f"{v['predicted_speedup']:.2f}x" if v["predicted_speedup"] is not None else "n/a"
        err = f"{v['relative_error']:+.0%}" if v["relative_error"] is not None else "n/a"
        verdict = {True: "right", False: "WRONG", None: "asks for a benchmark"}[v["picked_faster"]]
        if v.get("not_priced"):
            verdict = "not scored (a cell not priced: see below)"
        rounds = v.get("measured_speedup_rounds")
        spread = f"; rounds {min(rounds):.2f}-{max(rounds):.2f}x" if rounds and len(rounds) > 1 else ""
        if None not in (v.get("predicted_step_ms"), v.get("predicted_step_1_ms"), v.get("predicted_wait_ms")):
            # where a miss lies: either step (the machine's state may have moved since `topo`),
            # or the wait after backward, which swings with the machine's memory traffic
            spread += (
                f"; ms measured (predicted): step on 1 rank {v['measured_step_1_ms']:.3g} "
                f"({v['predicted_step_1_ms']:.3g}), on {v['ranks']} {v['measured_step_ms']:.3g} "
                f"({v['predicted_step_ms']:.3g}), wait after backward {v['measured_wait_ms']:.3g} "
                f"({v['predicted_wait_ms']:.3g})"
            )
        if v.get("placement_as_calibrated") is not None:
            seen, cal = v["core_round_trip_ns"], v["calibrated_round_trip_ns"]
            where = (
                "as calibrated"
                if v["placement_as_calibrated"]
                else "as topo's second probe"
                if v.get("placement_as_second_probe")
                else "in turn where topo's two probes ran"
                if v.get("by_placement") and sum(b["rounds"] for b in v["by_placement"]) == len(seen) // 2
                else "ANOTHER PLACEMENT than topo's"
            )
            spread += (
                f"; the cores' round trip {min(seen):.0f}-{max(seen):.0f} ns (topo's "
                f"{min(cal):.0f}-{max(cal):.0f}): {where}"
            )
            spread += "".join(
                f"; {b['rounds']} round(s) where topo's {b['probe']} probe of the wait ran "
                f"({min(b['calibrated_round_trip_ns']):.0f}-{max(b['calibrated_round_trip_ns']):.0f} ns): "
                f"{b['measured_speedup']:.2f}x, predicted {b['predicted_speedup']:.2f}x {b['relative_error']:+.0%}"
                for b in v.get("by_placement", [])
            )
        out.append(
            f"{v['batch_size']:>6} {v['ranks']:>5} {v['measured_speedup']:>8.2f}x {pred:>9} {err:>7}  "
            f"{v['selector_strategy']} ({v['selector_devices']}) vs {v['measured_fastest']}: {verdict}{spread}"
        )
    errors = [v["relative_error"] for v in rows if v["relative_error"] is not None]
    if errors:  # what issue 13 asks of a run: every cell within VALIDATION_BOUND, every pick right
        picks = [v["picked_faster"] for v in rows if not v.get("not_priced")]
        unscored = len(rows) - len(picks)
        out.append(
            f"within +-{VALIDATION_BOUND:.0%}: {sum(abs(e) <= VALIDATION_BOUND for e in errors)} of "
            f"{len(errors)} cells (worst {max(errors, key=abs):+.0%}); picks: {picks.count(True)} right, "
            f"{picks.count(False)} wrong, {picks.count(None)} asked for a benchmark"
            + (f", {unscored} not scored" if unscored else "")
        )
    return "\n".join(out)


def write_csv(path: str, rows: list) -> None:
    fields = [
        "batch_size",
        "ranks",
        "threads",
        "device",
        "samples_per_sec",
        "step_median_ms",
        "step_mean_ms",
        "ci95_low_ms",
        "ci95_high_ms",
        "forward_ms",
        "backward_ms",
        "comm_wait_ms",
        "optimizer_ms",
        "speedup",
        "efficiency",
        "peak_memory_bytes",
        "compute_floor_ms",
        "allreduce_floor_ms",
        "predicted_step_ms",
        "predicted_step_low_ms",
        "predicted_step_high_ms",
        "inside_interval",
        "gpu_emulation",
        "torch_samples_per_sec",
        "torch_ratio_median",
        "torch_ratio_min",
        "torch_ratio_max",
    ]
    with atomic_file(path, private=False) as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            s = r["step"]
            w.writerow(
                {
                    "batch_size": r["batch_size"],
                    "ranks": r["ranks"],
                    "threads": r["threads"],
                    "device": r["device"],
                    "samples_per_sec": r["samples_per_sec"],
                    "step_median_ms": s["median"] * 1e3,
                    "step_mean_ms": s["mean"] * 1e3,
                    "ci95_low_ms": s["ci95"][0] * 1e3,
                    "ci95_high_ms": s["ci95"][1] * 1e3,
                    **{f"{k}_ms": v for k, v in r["breakdown_ms"].items()},
                    "speedup": r.get("speedup"),
                    "efficiency": r.get("efficiency"),
                    "peak_memory_bytes": r["peak_memory_bytes"],
                    "compute_floor_ms": r["compute_floor_ms"],
                    "allreduce_floor_ms": r.get("allreduce_floor_ms"),
                    "predicted_step_ms": r.get("predicted_step_ms"),
                    "predicted_step_low_ms": (r.get("predicted_step_interval_ms") or [None, None])[0],
                    "predicted_step_high_ms": (r.get("predicted_step_interval_ms") or [None, None])[1],
                    "inside_interval": r.get("inside_interval"),
                    "gpu_emulation": gpus_emulated(r["device"]),
                    "torch_samples_per_sec": r.get("torch", {}).get("samples_per_sec"),
                    **{f"torch_ratio_{k}": r.get("torch_ratio", {}).get(k) for k in ("median", "min", "max")},
                }
            )


def _plot_subtitle(rows: list, meta: dict) -> str:
    """Model, batch split and machine of a benchmark, for every plot's title."""
    r = rows[0]
    model = f"{meta['model']} " if meta.get("model") else ""
    threads = {x["ranks"]: x["threads"] for x in rows}  # each rank count splits the cores its own way
    threads = (
        f"{r['threads']} thread(s) per rank"
        if len(set(threads.values())) == 1
        else ", ".join(f"{t} thread(s) per rank at {n} rank(s)" for n, t in sorted(threads.items()))
    )
    where = f"{r['device']}, {threads}" + (f" on {meta['host']}" if meta.get("host") else "")
    if meta.get("gpu_emulation"):
        where = f"EMULATED GPUs (the CPU; not GPU speeds), {where}"
    return (
        f"model {model}{'-'.join(map(str, r['layers']))} ({r['params']:,} params), "
        f"{meta.get('optimizer', r.get('optimizer', 'sgd'))}, {r.get('precision', 'fp32')}\n{where}"
    )


def _rate_interval(batch: int, step: dict) -> tuple:
    """samples/s at the median step and the error bar of the step's 95% interval, (below, above)."""
    rate = batch / step["median"]
    low_s, high_s = step["ci95"]
    slowest = batch / high_s if high_s > 0 else rate
    fastest = batch / low_s if low_s > 0 else rate
    return rate, (max(rate - slowest, 0.0), max(fastest - rate, 0.0))


def throughput_figure(rows: list, meta: dict):
    """samples/s against the global batch, one line per rank count with 95% bars; the PyTorch peer dashed."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, n in enumerate(sorted({r["ranks"] for r in rows})):
        cells = sorted((r for r in rows if r["ranks"] == n), key=lambda r: r["batch_size"])
        for who, key, style in (
            ("mgpu", None, dict(marker="o", linestyle="-")),
            ("PyTorch DDP", "torch", dict(marker="s", linestyle="--", mfc="white")),
        ):
            pts = [
                (r["batch_size"], *_rate_interval(r["batch_size"], (r[key] if key else r)["step"]))
                for r in cells
                if key is None or key in r
            ]
            if not pts:
                continue
            batches, rates, bars = zip(*pts)
            ax.errorbar(
                batches,
                rates,
                yerr=np.array(bars).T,
                capsize=4,
                color=colors[i % len(colors)],
                label=f"{who}, {n} rank{'s' if n > 1 else ''}",
                **style,
            )
    batches = sorted({r["batch_size"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(batches))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(b) for b in batches])
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:,.0f}")
    ax.set(xlabel="global batch size (samples per step)", ylabel="samples/s (median step)")
    ax.set_title(f"Throughput; bars: 95% interval of the mean step time\n{_plot_subtitle(rows, meta)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def speedup_figure(rows: list, meta: dict):
    """Measured speedup against 1 rank per batch, the selector's predicted speedup dotted, and the ideal line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ranks = sorted({r["ranks"] for r in rows})
    ax.plot(ranks, ranks, color="0.5", linestyle="--", label="ideal (linear)")
    predicted_any = False
    for i, b in enumerate(sorted({r["batch_size"] for r in rows})):
        cells = sorted((r for r in rows if r["batch_size"] == b and "speedup" in r), key=lambda r: r["ranks"])
        base = next((r for r in rows if r["batch_size"] == b and r["ranks"] == 1), None)
        if not cells or base is None:
            continue
        color = colors[i % len(colors)]
        _, (b_lo, b_hi) = _rate_interval(b, base["step"])
        base_rate = b / base["step"]["median"]
        bars = []
        for r in cells:  # the speedup's interval from both ends' intervals
            rate, (lo, hi) = _rate_interval(b, r["step"])
            bars.append(
                (
                    max(r["speedup"] - (rate - lo) / (base_rate + b_hi), 0.0),
                    max((rate + hi) / max(base_rate - b_lo, 1e-30) - r["speedup"], 0.0),
                )
            )
        ax.errorbar(
            [r["ranks"] for r in cells],
            [r["speedup"] for r in cells],
            yerr=np.array(bars).T,
            capsize=4,
            marker="o",
            color=color,
            label=f"measured, batch {b}",
        )
        pred = [(r["ranks"], r["predicted_speedup"]) for r in cells if r.get("predicted_speedup") is not None]
        if pred:
            predicted_any = True
            ax.plot(*zip(*pred), marker="x", linestyle=":", color=color, label=f"selector's prediction, batch {b}")
    if not predicted_any:
        ax.text(
            0.02,
            0.97,
            "no prediction: give --profile or --validate-selector",
            transform=ax.transAxes,
            va="top",
            fontsize=8,
            color="0.4",
        )
    ax.set_xticks(ranks)
    ax.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(
        range(len(labels)),
        key=lambda i: (
            (0, 0) if labels[i].startswith("ideal") else (int(labels[i].rsplit(" ", 1)[-1]), "prediction" in labels[i])
        ),
    )  # per batch: measured, predicted
    ax.set(xlabel="ranks", ylabel="speedup over 1 rank (same global batch)")
    ax.set_title(f"Speedup over 1 rank; bars: 95% interval\n{_plot_subtitle(rows, meta)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=8)
    fig.tight_layout()
    return fig


def breakdown_figure(rows: list, meta: dict):
    """Each cell's median step split into forward, backward, exposed allreduce and optimizer, beside
    the measured step and the compute floor."""
    import matplotlib.pyplot as plt

    cells = sorted(rows, key=lambda r: (r["batch_size"], r["ranks"]))
    fig, ax = plt.subplots(figsize=(max(7.5, 2.0 + len(cells) * 1.25), 5.4))
    x = np.arange(len(cells))
    bottom = np.zeros(len(cells))
    for k, name in (
        ("forward", "forward"),
        ("backward", "backward"),
        ("comm_wait", "allreduce (exposed)"),
        ("optimizer", "optimizer"),
    ):
        vals = np.array([r["breakdown_ms"][k] for r in cells])
        ax.bar(x, vals, bottom=bottom, width=0.6, label=name)
        bottom += vals
    ax.hlines(
        [r["step"]["median"] * 1e3 for r in cells],
        x - 0.4,
        x + 0.4,
        color="black",
        linewidth=2,
        zorder=3,
        label="measured step (median)",
    )
    ax.hlines(
        [r["compute_floor_ms"] for r in cells],
        x - 0.4,
        x + 0.4,
        color="red",
        linewidth=1.5,
        linestyles="--",
        zorder=3,
        label="compute floor (GEMMs at the measured rate)",
    )
    ax.set_xticks(x, [f"batch {r['batch_size']}\n{r['ranks']} rank{'s' if r['ranks'] > 1 else ''}" for r in cells])
    ax.set(ylabel="ms per step (median of each phase)")
    ax.set_title(f"Step breakdown\n{_plot_subtitle(rows, meta)}", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
    fig.tight_layout()
    return fig


def write_plots(directory: str, rows: list, meta: Optional[dict] = None) -> list:
    """throughput_vs_batch.png, speedup_vs_ranks.png and breakdown.png; `meta` (the result
    dict: model, host, optimizer, emulation) labels them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, make in (
        ("throughput_vs_batch", throughput_figure),
        ("speedup_vs_ranks", speedup_figure),
        ("breakdown", breakdown_figure),
    ):
        fig = make(rows, meta or {})
        paths.append(os.path.join(directory, f"{name}.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


MAX_RANKS_PER_CORE = 16  # --ranks launched on this machine: oversubscribed beyond what measures anything


def cmd_bench(a, pg) -> int:
    for name in ("warmup", "steps", "repeats"):
        if getattr(a, name) < (0 if name == "warmup" else 1):
            raise ConfigError(f"--{name} must be >= {0 if name == 'warmup' else 1}, got {getattr(a, name)}")
    if any(b < 1 for b in a.batch_sizes):
        raise ConfigError(f"batch sizes must be >= 1, got {a.batch_sizes}")
    # Several thread counts are several launches, as several rank counts are; one is this run's.
    a.thread_counts = a.threads or [None]
    a.threads = a.thread_counts[0]
    several_threads = len(a.thread_counts) > 1
    if a.ranks and pg.size > 1 and a.ranks != [pg.size]:  # this world is measured as it is
        raise ConfigError(
            f"--ranks launches mpirun once per rank count: run bench from one process, not under "
            f"mpirun (this world has {pg.size} ranks; --ranks {','.join(map(str, a.ranks))})"
        )
    if several_threads:
        if pg.size > 1:
            raise ConfigError(
                "several --threads values are launched one process group each: run bench from one "
                "process (with --ranks N for N ranks), not under mpirun"
            )
        if pg.resolve_device(a.device)[0] != "cpu":
            raise ConfigError(
                "several --threads values compare CPU thread counts; this run's device is a GPU (use --device cpu)"
            )
        for given, what in (
            (a.validate_selector, "--validate-selector"),
            (a.plots, "--plots"),
            (a.observe, "--observe"),
            (a.explain, "--explain"),
        ):
            if given:
                raise ConfigError(
                    f"{what} takes one thread count per rank; several were given "
                    f"(--threads {','.join(map(str, a.thread_counts))})"
                )
    if a.precision != "fp32" and a.device == "cpu":
        raise ConfigError(f"--precision {a.precision} needs a GPU; the CPU backend computes in fp32")
    if a.accumulate < 1:
        raise ConfigError(f"--accumulate must be >= 1, got {a.accumulate}")
    if a.compare == "torch" and (a.accumulate != 1 or a.grad_dtype != "fp32"):
        raise ConfigError(
            "--compare torch runs the peer without accumulation and with fp32 gradients: "
            "leave --accumulate and --grad-dtype at their defaults"
        )
    if a.layers is not None and (len(a.layers) < 2 or min(a.layers) < 1):
        raise ConfigError(f"layers must be at least two positive sizes, got {a.layers}")
    if a.ranks:
        limit = MAX_RANKS_PER_CORE * (os.cpu_count() or 1)
        if not a.explain and max(a.ranks) > limit:  # launched here, each rank a process of this machine
            raise ConfigError(
                f"--ranks {max(a.ranks)}: bench launches every rank on this machine, at most "
                f"{limit} ({MAX_RANKS_PER_CORE} per core of {os.cpu_count() or 1}); more ranks "
                "take more machines: mpirun --hostfile FILE python -m mgpu bench"
            )
        if max(a.ranks) > min(a.batch_sizes):  # launched or priced (--explain)
            raise ConfigError(
                f"batch {min(a.batch_sizes)} is smaller than {max(a.ranks)} ranks: every rank needs a sample"
            )
    check_outputs({"--json": a.json, "--csv": a.csv}, {"--profile": a.profile}, profile=a.profile)
    if a.explain:
        return explain_step(a, pg)
    if a.observe:
        import_summary_writer()  # --observe times the TensorBoard writer too
    if a.plots is not None:
        check_output_dir(a.plots, "--plots")
    if a.worker_out:  # launched by a driver: measure this world, hand the rows back
        rows = run_worker(pg, a)
        if pg.is_root:
            write_json_atomic(a.worker_out, rows)
        return 0
    # the device this run measures (resolving it may refuse the run)
    device = pg.resolve_device(a.device)[0]
    profile, described, most = None, False, max(a.ranks or [pg.size])
    if a.validate_selector or a.profile:
        profile = resolve_profile(a.profile or "calibrated", most)
        if profile is None:
            raise ConfigError("--validate-selector needs a calibration: run `python -m mgpu topo` under mpirun first")
        mismatch = emulation_mismatch(profile, device) if a.validate_selector else None
        if mismatch:
            raise ConfigError(f"--validate-selector: {mismatch}")
        described = a.profile in (None, "calibrated") and pg.is_root and calibration_for(most, device)[0] is not None
    elif pg.is_root:  # every run holds the prediction of a calibration that describes it
        profile, unpriced = calibration_for(most, device)
        described = profile is not None
        if unpriced:
            print(f"prediction: none ({unpriced})", flush=True)
    # this machine's calibration, where it describes these cells: its record (history.py)
    # gains the CPU cells it priced (GPU cells here run timed, phase by phase)
    recorded = default_profile_path() if described and device == "cpu" else None
    if a.compare == "torch" and pg.size > 1:
        raise ConfigError(
            "--compare torch alternates launches of mgpu and PyTorch: run it from one process "
            "with --ranks N instead of under mpirun"
        )
    py = None
    if a.compare == "torch":
        if gpus_emulated(device):
            raise ConfigError(
                "--compare torch: PyTorch cannot run on the GPU emulation's GPUs (the CPU running "
                "mgpu's CUDA code); compare on real GPUs, or on the CPU with --device cpu"
            )
        py = torch_python()
        if py is None:
            raise ConfigError(
                "--compare torch: no interpreter here can import torch "
                "(pip install torch, or apt-get install python3-torch)"
            )
    # With the peer, or several rank counts to compare: one repeat per round, the sides
    # alternating, in reverse order every other round (1 2, 2 1, ...) so neither side
    # always runs first. --observe interleaves its own off/on rounds inside a launch.
    alternate = py is not None or (
        pg.size == 1 and not a.observe and ((a.ranks is not None and len(a.ranks) > 1) or several_threads)
    )
    rounds = []
    for i in range(a.repeats if alternate else 1):
        rows = measure_world(pg, a, repeats=1 if alternate else a.repeats, reverse=alternate and i % 2 == 1)
        if alternate:  # merged cell by cell: the same order in every round
            rows.sort(key=lambda r: (r["batch_size"], r["ranks"], r["threads"]))
        if pg.is_root and py:
            for r in rows:
                r["torch"] = run_torch(
                    py, r["ranks"], r["layers"], r["dropout"], r["batch_size"], a, r["device"], r["threads"]
                )
        rounds.append(rows)
    if not pg.is_root:
        return 0
    rows = merge_rounds(rounds) if alternate else rounds[0]
    for r in rows:
        r["optimizer"] = a.optimizer
    add_derived(rows, profile, thread_scaling=several_threads)
    if profile is not None and recorded and profile.get("source") == "calibrated":
        record_cells(recorded, profile, rows, speedups=not several_threads)
    print(format_table(rows))
    if any("predicted_step_interval_ms" in r or "prediction_error" in r for r in rows):
        print(format_predictions(rows))
    for r in rows:  # a cell outside its interval: the phase that differs most, and what to do
        warning = (r.get("prediction") or {}).get("warning")
        if warning:
            print(f"mgpu: warning: batch {r['batch_size']} x {r['ranks']} rank(s): {warning}", file=sys.stderr)
    for r in rows:
        t = r.get("torch_ratio")
        if t:
            print(
                f"mgpu / PyTorch {r['torch']['version']}, batch {r['batch_size']} x {r['ranks']} rank(s)"
                + (f" x {r['threads']} thread(s)" if several_threads else "")
                + f", dropout {r['dropout']:g} on both sides"
                + ": "
                f"{t['median']:.2f}x median of {len(t['rounds'])} alternating rounds "
                f"(range {t['min']:.2f}-{t['max']:.2f}x)"
            )
    return report(a, pg, rows, profile)


def report(a, pg, rows: list, profile) -> int:
    """Rank 0: the counters, the observability overhead, validation, JSON, CSV and plots."""
    for r in rows:
        c = r.get("emulation_counters_per_step")
        if c:
            print(
                f"emulated GPU, batch {r['batch_size']} x {r['ranks']} rank(s), per step: "
                f"{c['kernel_launches']:g} kernel launches, {c['graph_launches']:g} graph launches, "
                f"{c['kernels_executed']:g} kernels run, {c['host_syncs']:g} host syncs, "
                f"{c['allocations']:g} allocations, {c['h2d_bytes']:,.0f} B to and {c['d2h_bytes']:,.0f} B "
                f"from the device ({c.get('pageable_h2d_copies', 0):g} from pageable memory), "
                f"{c['collectives']:g} collectives"
            )
    for r in rows:
        o = r.get("observe_overhead")
        if o:
            spread = {k: f"{min(v):.2f}-{max(v):.2f}" for k, v in o["round_medians_ms"].items()}
            print(
                f"observe overhead, batch {r['batch_size']} x {r['ranks']} rank(s): {o['overhead_pct']:+.2f} % "
                f"(median step {o['off']['median'] * 1e3:.2f} ms off, {o['on']['median'] * 1e3:.2f} ms with "
                f"--trace, --log-json, --tensorboard and the straggler check; round medians {spread['off']} ms "
                f"off, {spread['on']} ms on, {len(o['round_medians_ms']['off'])} interleaved rounds each; "
                f"paired rounds median {np.median(o['paired_round_pct']):+.2f} %, "
                f"{min(o['paired_round_pct']):+.2f} to {max(o['paired_round_pct']):+.2f} %); the observer's own "
                f"time {o['observer_ms_per_step']['mean']:.3f} ms/step on average "
                f"({o['observer_pct_of_step']:.3f} % of the step; max {o['observer_ms_per_step']['max']:.2f} ms)"
            )
    result = {
        "version": __version__,
        "host": socket.gethostname(),
        "model": a.model,
        "layers": rows[0]["layers"],
        "optimizer": a.optimizer,
        "precision": a.precision,
        "warmup": a.warmup,
        "steps": a.steps,
        "repeats": a.repeats,
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
        "gpu_emulation": gpus_emulated(rows[0]["device"]),
        "rows": rows,
    }
    if a.validate_selector:
        result["validation"] = validate_selector(rows, profile, a)
        result["scores"] = score_validation(rows, result["validation"])
        print(format_validation(result["validation"]))
        print(format_scores(result["scores"]))
    if a.json:
        write_json_atomic(a.json, result)
    if a.csv:
        write_csv(a.csv, rows)
    if a.plots:
        for path in write_plots(a.plots, rows, result):
            print(f"plot written to {path}")
    return 0


def explain_step(a, pg) -> int:
    """--explain: the analytic cost sheet of the CUDA step (costsheet.py) for each batch
    size and rank count; prints and writes it, runs nothing."""
    if a.device == "cpu":
        raise ConfigError("--explain prices the CUDA step on a GPU's published figures: use --device cuda")
    if a.compare or a.validate_selector or a.plots or a.csv or a.observe:
        raise ConfigError(
            "--explain runs nothing: --compare, --validate-selector, --observe, --plots and --csv do not apply"
        )
    if a.grad_dtype != "fp32":
        raise ConfigError(
            "--explain prices one GPU's step; --grad-dtype changes only the allreduce "
            "(see `mgpu recommend --grad-dtype`)"
        )
    sizes, dropout = resolve_layers(a.model, a.layers)
    sheets = []
    for ranks in a.ranks or [1]:
        for batch in a.batch_sizes:  # cmd_bench saw that every rank has a sample
            w = costsheet.Workload(
                sizes=list(sizes),
                batch=batch,
                precision=a.precision,
                optimizer=a.optimizer,
                dropout=a.dropout if a.dropout is not None else dropout,
                accumulate=a.accumulate,
                ranks=ranks,
                data_on_device=a.data_on_device != "off",
            )
            w.graph = costsheet.uses_graph(a.cuda_graph, w.params)
            sheets.append(costsheet.explain(w, GPUS[a.gpu]))
    # What a GPU holds, as the selector prices it (the sheet prices time only).
    memory = [
        gpu_step_memory(
            a.gpu,
            s.workload.sizes,
            s.workload.batch,
            s.workload.ranks,
            optimizer=s.workload.optimizer,
            precision=s.workload.precision,
            dropout=s.workload.dropout,
            accumulate=s.workload.accumulate,
        )
        for s in sheets
    ]
    if pg.is_root:
        for sheet, mem in zip(sheets, memory):
            print(costsheet.format_sheet(sheet))
            print(
                f"  memory: {mem['bytes'] / 1e9:.2f} GB a GPU of {mem['usable_bytes'] / 1e9:.0f} GB usable"
                + ("" if mem["fits"] else ": DOES NOT FIT (fewer rows a GPU, bf16, or SGD instead of AdamW)")
            )
            if sheet.workload.ranks > 1:
                print("  (per GPU, without the gradient allreduce: `mgpu recommend` models it)")
        print("sources: " + "; ".join(GPUS[a.gpu].sources))
        if a.json:
            write_json_atomic(
                a.json,
                {"version": __version__, "cost_sheets": [{**s.as_dict(), "memory": m} for s, m in zip(sheets, memory)]},
            )
    return 0


def add_parser(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="training throughput by batch and ranks, with floors and the PyTorch peer",
        description=__doc__.splitlines()[0],
    )
    m = b.add_mutually_exclusive_group()
    m.add_argument("--model", choices=sorted(PRESETS), default=None, help="model preset (default: large)")
    m.add_argument("--layers", type=int_list("layer sizes"), help="in,h1,...,out")
    b.add_argument(
        "--batch-sizes",
        type=int_list("batch sizes", distinct=True),
        default=[1024],
        help="global batch sizes, each once (default 1024)",
    )
    b.add_argument(
        "--ranks",
        type=int_list("rank counts", distinct=True),
        default=None,
        help="rank counts to launch with mpirun, several in alternating rounds (default: this world)",
    )
    b.add_argument("--warmup", type=int, default=10)
    b.add_argument("--steps", type=int, default=100)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    b.add_argument("--dropout", type=float, default=None, help="default: the preset's")
    b.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    b.add_argument(
        "--threads",
        type=int_list("thread counts", distinct=True, maximum=MAX_THREADS),
        default=None,
        help="CPU threads per rank; several (e.g. 1,2) are launched in alternating rounds like --ranks",
    )
    b.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="GEMM precision (GPUs): fp32, tf32, bf16, fp16; the PyTorch peer uses the same",
    )
    b.add_argument(
        "--cuda-graph",
        choices=GRAPH_MODES,
        default="auto",
        help="replay steps as CUDA graphs: auto (small models on GPUs), on, off",
    )
    b.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="micro-batches per step: each rank's share of the batch in K parts (default 1)",
    )
    b.add_argument(
        "--grad-dtype",
        choices=GRAD_DTYPES,
        default="fp32",
        help="type the gradients are allreduced in (bf16/fp16: NCCL between GPUs)",
    )
    b.add_argument(
        "--shard-optimizer",
        action="store_true",
        help="ZeRO-1: each rank keeps optimizer state for, and updates, its shard of the parameters",
    )
    b.add_argument(
        "--data-on-device",
        choices=DATA_PLACEMENTS,
        default="auto",
        help="the steps' rows held on the device and gathered there, as train places a training set "
        "(and as the PyTorch peer keeps its inputs): auto (GPUs), on, off (copied from the host each step)",
    )
    b.add_argument("--compare", choices=("torch",), default=None, help="run the same workload in PyTorch (DDP)")
    b.add_argument(
        "--validate-selector",
        action="store_true",
        help="predicted vs measured speedup per cell (needs `mgpu topo` first)",
    )
    b.add_argument("--profile", default=None, help="hardware profile for the floors and predictions")
    b.add_argument(
        "--explain",
        action="store_true",
        help="print the analytic cost sheet of the CUDA step (FLOPs, bytes, launches priced on "
        "--gpu's published figures) and the floor 6 x params x rows a GPU / GEMM rate; runs nothing",
    )
    b.add_argument("--gpu", choices=("h100-sxm",), default="h100-sxm", help="the GPU --explain prices on")
    b.add_argument(
        "--observe",
        action="store_true",
        help="also time steps with train's --trace, --log-json, --tensorboard and straggler check on, "
        "in rounds interleaved with plain ones, and report the overhead",
    )
    b.add_argument("--json", metavar="PATH")
    b.add_argument("--csv", metavar="PATH")
    b.add_argument("--plots", metavar="DIR", help="write PNG plots here")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--worker-out", help=argparse_suppress())


def argparse_suppress():
    return argparse.SUPPRESS
