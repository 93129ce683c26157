"""`mgpu topo`: measure this machine and save the calibration profile the selector
predicts from; the profile as a table, and its GEMM and allreduce plots.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from ..atomic import write_json_atomic
from ..calibrate.topo import PLACEMENT_TRIES, PROBE_LAYERS, MiB, run_topo
from ..errors import ConfigError
from ..hostinfo import placement_moved
from ..selector.hardware import PRECISIONS
from ..selector.profiles import default_profile_path, save_profile
from ..train.config import COMMS, check_comm_for_device
from .common import MAX_THREADS, bounded_int, check_output_dir, check_output_path, check_outputs


def _cpu_tables_line(d: dict) -> str:
    """What a CPU rank's tables say at a glance: the largest measured model's update and
    wait in a real step, with every rank busy against rank 0 alone."""
    busy, alone = d["step_phases"], d.get("step_phases_alone", d["step_phases"])
    grid = d["layer_times"]
    cold = (
        f", warm and cold (after sweeping {2 * d['cache_bytes'] / 2**20:.0f} MiB: a last-level cache of "
        f"{d['cache_bytes'] / 2**20:.0f} MiB)"
        if "forward_cold" in grid and d.get("cache_bytes")
        else ""
    )
    text = (
        f"layer times on {len(grid['rows'])} rows x {len(grid['widths'])}x{len(grid['widths'])} widths{cold}; "
        f"in training at {busy['params'][-1] / 1e6:.1f}M params: update {busy['update_s'][-1] * 1e3:.2f} ms, "
        f"wait after backward {busy['wait_s'][-1] * 1e3:.2f} ms with {busy['ranks']} rank(s) busy"
    )
    if alone is not busy:
        text += f"; {alone['update_s'][-1] * 1e3:.2f} and {alone['wait_s'][-1] * 1e3:.2f} ms alone"
    return text


def placement_line(placement: dict) -> str:
    """Where rank 0 and its node's next rank ran during the calibration, read as a cache
    line's round trip between their CPUs, and whether that moved."""
    a, b = placement["cpus"]
    at_wait, every = placement["wait_probe_ns"], placement["readings_ns"]
    text = (
        f"ranks' cores (CPUs {a} and {b}): a cache line's round trip {min(at_wait):.0f}-{max(at_wait):.0f} ns "
        f"around the probe of the wait after backward, {min(every):.0f}-{max(every):.0f} ns over "
        f"{len(every)} readings"
    )
    if placement_moved(at_wait):
        text += (
            "; the cores changed cache domains (as a VM's vCPUs do when its hypervisor moves them) during "
            f"each of {PLACEMENT_TRIES} tries at that probe: its wait mixes two placements, and "
            "predictions for several ranks hold in neither"
        )
    elif placement_moved(every):
        other = placement.get("other_wait_probe_ns")
        text += (
            "; the cores changed cache domains during the calibration (as a VM's vCPUs do when its "
            "hypervisor moves them), and a multi-rank wait changes with them: "
            + (
                f"the wait was probed again with them at {min(other):.0f}-{max(other):.0f} ns, where "
                f"{placement.get('other_share', 0.0):.0%} of the readings found them, and `recommend` prices "
                "several ranks in both placements, weighted so"
                if other
                else f"predictions for several ranks hold where the wait was probed, at "
                f"{min(at_wait):.0f}-{max(at_wait):.0f} ns"
            )
        )
    return text


def _us_or_not_measured(seconds) -> str:
    return f"{seconds * 1e6:.2f} us" if seconds else "not measured"


def _bandwidth(bytes_per_s: float) -> str:
    """GB/s with a decimal, or MB/s below 1 GB/s (an emulated GPU's read 0.0 GB/s)."""
    return f"{bytes_per_s / 1e9:.1f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.1f} MB/s"


def _probe_text(d: dict) -> str:
    if "probe_step_s" not in d:  # a profile from before the probe's work was taken out
        return ""
    return (
        f" (a step of {'x'.join(map(str, PROBE_LAYERS))} took {d['probe_step_s'] * 1e6:.1f} us, less its priced work)"
    )


def format_topo(profile: dict) -> str:
    lines = [f"{profile['name']}  (mgpu {profile['mgpu_version']})"]
    shown = set()
    for d in profile["devices"]:
        pooled = d.get("pooled_ranks") or []
        if d["rank"] in shown:
            continue  # its figures are the line of the ranks it was pooled with
        shown.update(pooled)
        fp = ", ".join(f"{p} {d[p]['peak_flops'] / 1e9:,.0f} GFLOP/s" for p in PRECISIONS if p in d)
        hosts = sorted({e["host"] for e in profile["devices"] if e["rank"] in pooled}) or [d["host"]]
        who = (
            f"ranks {', '.join(map(str, pooled))} on {', '.join(hosts)} (one device model: the median of "
            "their rates and overheads)"
            if pooled
            else f"rank {d['rank']} on {d['host']}"
        )
        lines.append(
            f"  {who}: {d['name']}; GEMM peak {fp}; "
            f"memory bw {_bandwidth(d['memory_bandwidth'])}; kernel overhead "
            f"{d['launch_overhead_s'] * 1e6:.2f} us (as a graph node "
            f"{_us_or_not_measured(d.get('graph_node_s'))}); step overhead {d['step_overhead_s'] * 1e6:.1f} us"
            f"{_probe_text(d)}; "
            f"dropout {d['dropout_s_per_unit'] * 1e9:.2f} ns/unit"
        )
        if "cpu" in d:
            cpu = d["cpu"]
            lines.append(
                f"    {cpu['cores']} core{'s' if cpu['cores'] != 1 else ''}, ISA {' '.join(cpu['isa'])}, "
                f"OPENBLAS_CORETYPE={cpu['openblas_coretype'] or '(unset)'}"
            )
        if d.get("host_to_device_bandwidth"):
            lines.append(f"    host-to-device {d['host_to_device_bandwidth'] / 1e9:.1f} GB/s")
        if "step_phases" in d:
            lines.append("    " + _cpu_tables_line(d))
    if profile.get("placement"):
        lines.append("  " + placement_line(profile["placement"]))
    if profile["allreduce"]:
        lines.append(f"  allreduce ({profile['link']['name']}), float32 sum, in place:")
        lines.append(
            f"  {'bytes':>12} {'count':>10} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11} {'wrong':>6}"
            f" {'raw MPI busbw':>14} {'vs raw':>7} {'with deadline':>14} {'vs raw':>7}"
        )
        for r in profile["allreduce"]:
            raw = f" {r['raw_mpi_busbw_GBps']:>14.3f} {r['vs_raw_mpi']:>6.0%}" if "vs_raw_mpi" in r else ""
            if "deadline_vs_raw_mpi" in r:
                raw += f" {r['deadline_busbw_GBps']:>14.3f} {r['deadline_vs_raw_mpi']:>6.0%}"
            lines.append(
                f"  {r['bytes']:>12,} {r['count']:>10,} {r['time_us']:>10.1f} {r['algbw_GBps']:>11.3f} "
                f"{r['busbw_GBps']:>11.3f} {r['wrong']:>6}{raw}"
            )
        link = profile["link"]
        lines.append(
            f"  fit over {link['fit_bytes'][0]:,}-{link['fit_bytes'][1]:,} B: alpha {link['alpha_s'] * 1e6:.2f} us "
            f"per ring step, busbw {link['bus_bandwidth'] / 1e9:.2f} GB/s "
            f"(median error {link['fit_median_rel_error']:.0%}); a step on {profile['environment']['world_size']} "
            f"ranks costs {link['step_sync_s'] * 1e6:.0f} us more than alone (latency, skew)"
        )
        levels = profile.get("nodes")
        if levels:
            for level, ranks in (("intra", levels["ranks_per_node"]), ("inter", levels["nodes"])):
                fit = levels[level]
                if fit is None:
                    lines.append("  within a node: 1 rank per node, nothing to measure")
                    continue
                what = "within each node" if level == "intra" else "between the nodes (one rank each)"
                lines.append(
                    f"  {what}, {ranks} ranks: alpha {fit['alpha_s'] * 1e6:.2f} us per ring step, busbw "
                    f"{fit['bus_bandwidth'] / 1e9:.2f} GB/s (fit over {fit['fit_bytes'][0]:,}-"
                    f"{fit['fit_bytes'][1]:,} B, median error {fit['fit_median_rel_error']:.0%})"
                )
            if "nccl" in link:
                lines.append(
                    f"  the selector models {levels['nodes']} nodes x {levels['ranks_per_node']} ranks from "
                    "these two links (recommend --nodes)"
                )
        elif link.get("measured") and profile["environment"].get("communicator") == "mpi":
            lines.append(
                "  one node: no inter-node link to measure (run topo under mpirun across hosts with a hostfile)"
            )
    else:
        lines.append("  allreduce: 1 rank, nothing to measure (run under mpirun -np N)")
    return "\n".join(lines)


def _plot_title(what: str, profile: dict) -> str:
    emulated = any("emulat" in d["name"].lower() for d in profile["devices"])
    return f"{what}\n{profile['name']}, mgpu {profile['mgpu_version']}" + (
        "\nEMULATED GPUs: the CPU running mgpu's CUDA code, not GPU speeds" if emulated else ""
    )


def gemm_figure(profile: dict):
    """Each rank's measured GEMM rate by work and precision, with the fitted peak w / (w + h) the model uses."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    seen = {}
    for d in profile["devices"]:
        for p in PRECISIONS:
            if p not in d or (d["name"], p) in seen:  # identical devices were given the same fit
                continue
            color = colors[len(seen) % len(colors)]
            seen[(d["name"], p)] = True
            work, rate = np.array(d[p]["measured"], float).T
            same = [e["rank"] for e in profile["devices"] if e["name"] == d["name"]]  # homogenize() merged them
            label = f"rank {same[0]}" if len(same) == 1 else f"ranks {', '.join(map(str, same))} (one fit)"
            if len({e["name"] for e in profile["devices"]}) > 1:
                label = f"{d['name']}, {label}"
            ax.plot(work, rate / 1e9, "o", color=color, label=f"{label}, {p}: measured")
            w = np.geomspace(work.min(), work.max(), 100)
            fit = d[p]["peak_flops"] * w / (w + d[p]["half_work_flops"])
            ax.plot(
                w,
                fit / 1e9,
                "-",
                color=color,
                alpha=0.7,
                label=f"fit: peak {d[p]['peak_flops'] / 1e9:,.0f} GFLOP/s, half at "
                f"{d[p]['half_work_flops'] / 1e6:,.1f} MFLOP",
            )
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set(xlabel="work of one Linear GEMM (FLOP = 2 x batch x in x out)", ylabel="GFLOP/s")
    ax.set_title(_plot_title("GEMM rate by size", profile), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def allreduce_figure(profile: dict):
    """The allreduce sweep's bus bandwidth by message size, the alpha-beta fit, and bare MPI where measured."""
    import matplotlib.pyplot as plt

    rows, link = profile["allreduce"], profile["link"]
    n = profile["environment"]["world_size"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    size = np.array([r["bytes"] for r in rows], float)
    ax.plot(size, [r["busbw_GBps"] for r in rows], "o-", label=f"{link['name']}: measured busbw")
    raw = [(r["bytes"], r["raw_mpi_busbw_GBps"]) for r in rows if "raw_mpi_busbw_GBps" in r]
    if raw:
        ax.plot(*zip(*raw), "s--", mfc="white", label="bare MPI_Allreduce (mpi4py): busbw")
    steps = 2.0 * (n - 1)
    model = steps * link["alpha_s"] + steps / n * size / link["bus_bandwidth"]
    ax.plot(
        size,
        size / model / 1e9 * steps / n,
        ":",
        color="black",
        label=f"alpha-beta fit: alpha {link['alpha_s'] * 1e6:.2f} us, busbw {link['bus_bandwidth'] / 1e9:.2f} GB/s",
    )
    lo, hi = link.get("fit_bytes", (size.min(), size.max()))
    ax.axvspan(lo, hi, color="0.9", zorder=0, label="sizes the fit uses (gradient buckets)")
    if any(r["wrong"] for r in rows):
        ax.text(0.02, 0.97, "SOME RESULTS WERE NOT BIT-EXACT", transform=ax.transAxes, va="top", color="red")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(lambda v, _: _bytes_label(v))
    ax.set_ylim(bottom=0)
    ax.set(xlabel="message size (float32 sum, in place)", ylabel="bus bandwidth, GB/s (algbw x 2(n-1)/n)")
    ax.set_title(_plot_title(f"Allreduce on {n} ranks", profile), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def _bytes_label(v: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= scale:
            return f"{v / scale:g} {unit}"
    return f"{v:g} B"


PLOT_FILES = ("gemm.png", "allreduce.png")


def write_plots(directory: str, profile: dict) -> list:
    """gemm.png, and allreduce.png when the profile has a sweep (more than one rank)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    figures = [("gemm", gemm_figure)] + ([("allreduce", allreduce_figure)] if profile["allreduce"] else [])
    paths = []
    for name, make in figures:
        fig = make(profile)
        paths.append(os.path.join(directory, f"{name}.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def cmd_topo(a, pg) -> int:
    if a.max_bytes < 4:
        raise ConfigError(f"--max-mb must be at least 4 bytes, got {a.max_bytes} bytes")
    if a.threads is not None and a.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {a.threads}")
    if a.no_save and a.out is not None:
        raise ConfigError("--out names the file the profile is saved to, and --no-save saves none: give one of them")
    # the plots' files where their directory exists already (else it is made, empty)
    plots = (
        {f"--plots {name}": os.path.join(a.plots, name) for name in PLOT_FILES}
        if a.plots and os.path.isdir(a.plots)
        else {}
    )
    if a.out is not None:  # "" too: an empty path, not the default
        check_output_path(a.out, "--out")
    saves = ("--out", a.out) if a.out is not None else ("the calibration this run saves", default_profile_path())
    check_outputs({"--json": a.json, **plots}, saves=None if a.no_save else saves)
    if a.plots is not None:
        check_output_dir(a.plots, "--plots")
    check_comm_for_device(a.comm, pg.resolve_device(a.device)[0])
    profile = run_topo(pg, device=a.device, threads=a.threads, max_bytes=a.max_bytes, quick=a.quick, comm_kind=a.comm)
    if pg.is_root:
        print(format_topo(profile))
        if a.json:
            write_json_atomic(a.json, profile)
        if a.plots:
            for path in write_plots(a.plots, profile):
                print(f"plot written to {path}")
        if not a.no_save:  # last: an output that fails leaves the calibration there was
            path = save_profile(profile, a.out if a.out is not None else default_profile_path())
            print(f"profile written to {path}")
        bad = sum(r["wrong"] for r in profile["allreduce"])
        if bad:
            print(f"mgpu: error: {bad} allreduce results were not bit-exact", flush=True)
            pg.barrier()
            return 1
    pg.barrier()
    return 0


def _mebibytes(text: str) -> int:
    """argparse type of --max-mb: MiB (a number) -> bytes; a one-line error for nan and inf."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB, got '{text}'") from None
    if not 0 <= value <= 1 << 20:
        raise argparse.ArgumentTypeError(f"expected MiB between 0 and {1 << 20}, got '{text}'")
    return int(value * MiB)


def add_parser(sub) -> None:
    t = sub.add_parser(
        "topo",
        help="measure devices, GEMM rates and the allreduce; write the calibration profile",
        description="Measure this machine (under mpirun: every rank's device and the communicator) "
        "and save the calibration profile the strategy selector uses.",
    )
    t.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    t.add_argument(
        "--threads",
        type=bounded_int("threads per rank", MAX_THREADS),
        default=None,
        help="CPU threads per rank (default: cores / ranks per node)",
    )
    t.add_argument(
        "--max-mb",
        dest="max_bytes",
        metavar="MIB",
        type=_mebibytes,
        default=256 * MiB,
        help="largest allreduce in MiB (default 256)",
    )
    t.add_argument(
        "--comm",
        choices=COMMS,
        default="auto",
        help="the communicator measured, as train's --comm: auto (NCCL between GPUs, else MPI), nccl, mpi "
        "(host-staged on GPUs)",
    )
    t.add_argument("--quick", action="store_true", help="fewer sizes and repeats (seconds, not minutes)")
    t.add_argument("--out", metavar="PATH", help=f"profile path (default {default_profile_path()})")
    t.add_argument("--no-save", action="store_true", help="measure and print only")
    t.add_argument("--json", metavar="PATH", help="also write the profile here")
    t.add_argument("--plots", metavar="DIR", help="write PNG plots here: GEMM rate by size, the allreduce sweep")
