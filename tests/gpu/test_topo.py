"""`mgpu topo --device cuda` under mpirun with 2 ranks, one GPU each: the device
entries (GEMM rates, kernel and graph-node costs, the step overhead net of the probe's
priced work), a bit-exact NCCL allreduce sweep and its fit, and `recommend` on the
profile it writes. On the GPU emulation (MGPU_EMULATE_GPU=2) the profile and the
answer say they are the emulation's. It crashed on its first multi-GPU run: the
step-sync probe asked the process group for MPI's communicator after the sweep's
NCCL one."""

import json
import sys

from conftest import mpi_env, mpirun, run_cli  # tests/conftest.py helpers
from mgpu import _core

EMULATED = bool(_core.build_info().get("gpu_emulation", False))


def test_topo_on_two_gpus_measures_devices_and_nccl_and_recommend_reads_it(two_gpus, tmp_path):
    path = tmp_path / "profile.json"
    env = mpi_env(XDG_CACHE_HOME=tmp_path / "cache")
    r = mpirun(
        2,
        [sys.executable, "-m", "mgpu", "topo", "--device", "cuda", "--quick", "--max-mb", "1", "--out", path],
        timeout=600,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    profile = json.loads(path.read_text())
    assert profile["source"] == "calibrated" and len(profile["devices"]) == 2
    for d in profile["devices"]:
        assert d["kind"] == "cuda" and d["fp32"]["peak_flops"] > 0 and d["memory_bandwidth"] > 0
        assert d["launch_overhead_s"] > 0 and d["host_to_device_bandwidth"] > 0
        assert d["graph_node_s"] > 0 or d.get("captures") is False
        # the probe's own kernels are priced by every prediction: not counted again
        assert 0 <= d["step_overhead_s"] < d["probe_step_s"]
    assert profile["link"]["name"].startswith("nccl") and profile["link"]["overlaps_compute"]
    assert profile["link"]["bus_bandwidth"] > 0 and profile["link"]["step_sync_s"] >= 0
    rows = profile["allreduce"]
    assert rows[0]["bytes"] == 4 and rows[-1]["bytes"] == 1 << 20 and all(row["wrong"] == 0 for row in rows)
    # its error model from held-out steps on one GPU and on both
    model = profile["error_model"]
    assert "held-out steps at calibration alone and on 2 ranks" in model["source"]
    assert all(model[k][0] <= model[k][1] for k in ("compute", "compute_together", "comm", "speedup"))
    assert all(c["alone_s"] > 0 and c["together_s"] > 0 for c in profile["held_out_steps"])
    assert profile["gpu_emulation"] is EMULATED
    assert ("EMULATED" in profile["name"]) is EMULATED and ("GPU EMULATION" in r.stdout + r.stderr) is EMULATED

    rec = run_cli(
        ["recommend", "--model", "medium", "--batch", "256", "--profile", path, "--json", tmp_path / "rec.json"],
        env=env,
    )
    assert rec.returncode == 0, rec.stdout + rec.stderr
    answer = json.loads((tmp_path / "rec.json").read_text())
    assert [c["devices"] for c in answer["candidates"]] == [1, 2]
    assert not any("unequal devices" in line for line in answer["reasons"])  # two of one kind
    assert answer["gpu_emulation"] is EMULATED
    assert ("GPU EMULATION: this profile is of mgpu's emulated GPUs" in rec.stdout) is EMULATED
    # without a calibration: the profile detected from the visible GPUs says so too
    rec = run_cli(
        ["recommend", "--model", "medium", "--batch", "256", "--json", tmp_path / "detected.json"],
        env=mpi_env(XDG_CACHE_HOME=tmp_path / "empty-cache"),
    )
    assert rec.returncode == 0, rec.stdout + rec.stderr
    detected = json.loads((tmp_path / "detected.json").read_text())
    assert detected["profile_source"] == "detected" and detected["gpu_emulation"] is EMULATED
    assert ("GPU EMULATION" in rec.stdout) is EMULATED
