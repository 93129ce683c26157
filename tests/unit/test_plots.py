"""The PNG plots of bench, topo and stress render from their results and carry what a
reader needs: intervals, the PyTorch peer, the selector's prediction and the ideal,
model, batch and machine, thresholds and events, and the emulation where it applies.
(Their look was checked by eye when they were written; these tests keep the content.)"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.container import ErrorbarContainer  # noqa: E402

from mgpu.commands import bench as bench_command
from mgpu.commands import topo as topo_command
from mgpu.monitor import telemetry

LAYERS = [50, 256, 3]
META = {"host": "testhost", "model": None, "optimizer": "sgd", "gpu_emulation": False}


def _step(ms, spread=0.05):
    s = ms / 1e3
    return {"median": s, "mean": s * 1.01, "ci95": [s * (1 - spread), s * (1 + spread)], "n": 10, "outliers": 0}


def bench_rows(torch=True, predicted=True):
    """Rows as cmd_bench makes them (after add_derived) for batches 64, 256 on 1 and 2 ranks."""
    rows = []
    for ranks in (1, 2):
        for batch in (64, 256):
            ms = batch / 100 / ranks + 0.5 * (ranks - 1)
            row = {
                "batch_size": batch,
                "ranks": ranks,
                "threads": 1,
                "device": "cpu",
                "step": _step(ms),
                "samples_per_sec": batch / (ms / 1e3),
                "layers": LAYERS,
                "params": 13827,
                "precision": "fp32",
                "breakdown_ms": {
                    "forward": ms * 0.3,
                    "backward": ms * 0.5,
                    "comm_wait": ms * 0.15,
                    "optimizer": ms * 0.05,
                },
                "compute_floor_ms": ms * 0.4,
            }
            if torch:
                row["torch"] = {"version": "x", "step": _step(ms * 1.5), "samples_per_sec": batch / (ms * 1.5e-3)}
            rows.append(row)
    base = {r["batch_size"]: r for r in rows if r["ranks"] == 1}
    for r in rows:
        r["speedup"] = r["samples_per_sec"] / base[r["batch_size"]]["samples_per_sec"]
        if predicted:
            r["predicted_speedup"] = r["speedup"] * 1.1
    return rows


def _labels(ax):
    return ax.get_legend_handles_labels()[1]


def test_bench_plots_render(tmp_path):
    paths = bench_command.write_plots(str(tmp_path / "plots"), bench_rows(), META)
    assert [p.rsplit("/", 1)[1] for p in paths] == ["throughput_vs_batch.png", "speedup_vs_ranks.png", "breakdown.png"]
    for p in paths:
        assert plt.imread(p).shape[0] > 300  # a real image, not an empty file


def test_throughput_has_intervals_and_the_pytorch_peer():
    rows = bench_rows()
    ax = bench_command.throughput_figure(rows, META).axes[0]
    assert sorted(_labels(ax)) == ["PyTorch DDP, 1 rank", "PyTorch DDP, 2 ranks", "mgpu, 1 rank", "mgpu, 2 ranks"]
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 4 and all(c.has_yerr for c in bars)
    # the 2-rank mgpu line's bar spans batch / ci95 of each cell's step
    mgpu2 = bars[_labels(ax).index("mgpu, 2 ranks")]
    segments = mgpu2.lines[2][0].get_segments()
    cells = [r for r in rows if r["ranks"] == 2]
    for seg, r in zip(segments, cells):
        low, high = sorted(seg[:, 1])
        assert low == pytest.approx(r["batch_size"] / r["step"]["ci95"][1])
        assert high == pytest.approx(r["batch_size"] / r["step"]["ci95"][0])
    title = ax.get_title()
    assert "50-256-3" in title and "testhost" in title and "95%" in title
    assert ax.get_ylim()[0] == 0
    plt.close("all")


def test_throughput_without_the_peer_draws_mgpu_only():
    ax = bench_command.throughput_figure(bench_rows(torch=False), META).axes[0]
    assert not any("PyTorch" in label for label in _labels(ax))
    plt.close("all")


def test_speedup_has_the_prediction_and_the_ideal():
    rows = bench_rows()
    ax = bench_command.speedup_figure(rows, META).axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]  # the legend's order: per batch
    assert labels[0] == "ideal (linear)"
    assert labels[1:] == [
        "measured, batch 64",
        "selector's prediction, batch 64",
        "measured, batch 256",
        "selector's prediction, batch 256",
    ]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["ideal (linear)"].get_ydata()) == [1, 2]
    want = [r["predicted_speedup"] for r in rows if r["batch_size"] == 64]
    assert list(lines["selector's prediction, batch 64"].get_ydata()) == pytest.approx(want)
    ax = bench_command.speedup_figure(bench_rows(predicted=False), META).axes[0]
    assert not any("prediction" in label for label in _labels(ax))
    assert any("no prediction" in t.get_text() for t in ax.texts)
    plt.close("all")


def test_breakdown_names_model_batch_and_machine():
    rows = bench_rows()
    ax = bench_command.breakdown_figure(rows, META).axes[0]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["batch 64\n1 rank", "batch 64\n2 ranks", "batch 256\n1 rank", "batch 256\n2 ranks"]
    assert "50-256-3" in ax.get_title() and "testhost" in ax.get_title() and "13,827 params" in ax.get_title()
    assert {"forward", "backward", "allreduce (exposed)", "optimizer", "measured step (median)"} <= set(_labels(ax))
    plt.close("all")


def test_the_threads_of_each_rank_count_are_named():
    rows = bench_rows()
    for r in rows:
        r["threads"] = 2 // r["ranks"]
    title = bench_command.breakdown_figure(rows, META).axes[0].get_title()
    assert "2 thread(s) per rank at 1 rank(s), 1 thread(s) per rank at 2 rank(s)" in title
    plt.close("all")


def test_emulated_results_say_so_on_every_bench_plot():
    for make in (bench_command.throughput_figure, bench_command.speedup_figure, bench_command.breakdown_figure):
        assert "EMULATED" in make(bench_rows(), {**META, "gpu_emulation": True}).axes[0].get_title()
        assert "EMULATED" not in make(bench_rows(), META).axes[0].get_title()
    plt.close("all")


def topo_profile(ranks=2, name="Test CPU (1 thread)"):
    def device(rank):
        measured = [[w, 5e10 * w / (w + 1e6)] for w in (1e5, 1e6, 1e7, 1e8)]
        return {"rank": rank, "name": name, "fp32": {"peak_flops": 5e10, "half_work_flops": 1e6, "measured": measured}}

    sizes = [4 << (2 * i) for i in range(10)]
    rows = [{"bytes": b, "time_us": 5 + b / 1e3, "busbw_GBps": b / (5e3 + b), "wrong": 0} for b in sizes]
    return {
        "name": "calibrated: testhost",
        "mgpu_version": "0",
        "devices": [device(r) for r in range(ranks)],
        "allreduce": rows if ranks > 1 else [],
        "environment": {"world_size": ranks},
        "link": {"name": "mpi (2 ranks)", "alpha_s": 2.5e-6, "bus_bandwidth": 1e9, "fit_bytes": [1024, 1 << 20]},
    }


def test_topo_plots_render(tmp_path):
    paths = topo_command.write_plots(str(tmp_path), topo_profile())
    assert [p.rsplit("/", 1)[1] for p in paths] == ["gemm.png", "allreduce.png"]
    assert [p.rsplit("/", 1)[1] for p in topo_command.write_plots(str(tmp_path / "one"), topo_profile(1))] == [
        "gemm.png"
    ]


def test_topo_plots_show_measurements_beside_their_fits():
    profile = topo_profile()
    ax = topo_command.gemm_figure(profile).axes[0]
    labels = _labels(ax)
    assert (
        len(labels) == 2
        and labels[0] == "ranks 0, 1 (one fit), fp32: measured"
        and labels[1].startswith("fit: peak 50 GFLOP/s")
    )
    ax = topo_command.allreduce_figure(profile).axes[0]
    labels = _labels(ax)
    assert labels[0].endswith("measured busbw") and any(label.startswith("alpha-beta fit") for label in labels)
    fit = next(line for line in ax.get_lines() if line.get_label().startswith("alpha-beta"))
    # the fitted busbw approaches the link's bus bandwidth at large messages
    assert fit.get_ydata()[-1] == pytest.approx(1.0, rel=0.05)
    assert "testhost" in ax.get_title() and "2 ranks" in ax.get_title()
    assert "EMULATED" in topo_command.gemm_figure(topo_profile(name="Emulated GPU 0")).axes[0].get_title()
    plt.close("all")


def test_telemetry_plot_shows_units_thresholds_and_events(tmp_path):
    samples = [
        {
            "t": t,
            "temperature_c": 60 + t,
            "power_w": 200.0,
            "power_limit_w": 300.0,
            "memory_used_pct": 40.0,
            "utilization_pct": None,
        }
        for t in np.arange(0, 5, 0.5)
    ]
    series = {"rank 0: GPU A": samples, "rank 1: GPU B": samples}
    events = [{"t": 2.0, "rank": 0, "action": "throttle", "message": "hot"}]
    fig = telemetry.figure(series, "stress run", {"temperature_c": 85.0, "power_w": None}, events)
    by_label = {ax.get_ylabel(): ax for ax in fig.axes}
    assert set(by_label) == {"temperature (C)", "power (W)", "memory used (%)"}
    assert "monitor threshold 85" in _labels(by_label["temperature (C)"])
    assert "rank 0: GPU A: power limit" in _labels(by_label["power (W)"])
    assert by_label["memory used (%)"].get_ylim() == (0, 105)
    assert [t.get_text() for t in fig.axes[0].texts] == ["throttle"]
    assert fig._suptitle.get_text() == "stress run"
    paths = telemetry.write_series(str(tmp_path / "tel"), series, "stress run", {}, events)
    assert plt.imread(paths[-1]).shape[0] > 300
    plt.close("all")
