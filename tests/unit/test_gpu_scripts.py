"""scripts/gpu_prepare.sh and scripts/gpu_session.sh (issue 38) without building or running anything:
their syntax, their argument handling, and gpu_report.py's dry-run flags. The dry run itself
(`OUT=DIR MGPU_EMULATE_GPU=1 bash scripts/gpu_session.sh`, ~10 minutes) is a documented command
(docs/gpu-results.md), not a test."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def sh(*args, **kw):
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, timeout=60, **kw)


@pytest.mark.parametrize("script", ["gpu_prepare.sh", "gpu_session.sh"])
def test_the_scripts_parse_and_say_what_they_are_for(script):
    assert sh("-n", SCRIPTS / script).returncode == 0
    r = sh(SCRIPTS / script, "--help")
    assert r.returncode == 0 and "issue 38" in r.stdout, r.stdout + r.stderr


def test_session_lists_its_stages_in_order_of_value():
    r = sh(SCRIPTS / "gpu_session.sh", "--list")
    assert r.returncode == 0
    assert r.stdout.split()[:9] == ["install", "env", "tests", "bench", "topo", "sanitize", "trace", "stress", "report"]


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("gpu_session.sh", ["no-such-stage"], "unknown stage no-such-stage"),
        ("gpu_session.sh", ["--no-such-option"], "unknown option"),
        ("gpu_prepare.sh", ["--no-such-option"], "unknown argument"),
    ],
)
def test_bad_arguments_stop_before_anything_runs(tmp_path, script, args, message):
    # exit 2 with one message, nothing written to OUT (the session checks its stages first)
    r = sh(SCRIPTS / script, *args, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_report_of_a_dry_run_marks_every_figure_emulated_and_leaves_the_doc_alone(tmp_path):
    row = {
        "device": "cuda",
        "layers": [50, 256, 128, 64, 3],
        "batch_size": 64,
        "precision": "fp32",
        "cuda_graph": True,
        "ranks": 1,
        "samples_per_sec": 1000.0,
        "step": {"median": 2e-4, "ci95": [1.9e-4, 2.1e-4]},
    }
    (tmp_path / "bench-medium.json").write_text(json.dumps({"gpu_emulation": True, "rows": [row]}))
    selector = dict(row, batch_size=32, predicted_step_ms=0.25)  # measured 0.2 ms: the selector's error -20 %
    (tmp_path / "selector-1gpu.json").write_text(json.dumps({"gpu_emulation": True, "rows": [selector]}))
    doc = tmp_path / "doc.md"
    doc.write_text("unchanged\n")
    r = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_report.py"), str(tmp_path), "--doc", str(doc), "--no-append", "--emulated"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert doc.read_text() == "unchanged\n"
    section = (tmp_path / "gpu-results-section.md").read_text()
    assert "EMULATED" in section.splitlines()[1]
    rows = [line for line in section.splitlines() if line.startswith("| bench-")]
    assert len(rows) == 1 and "(EMULATED)" in rows[0]
    rows = [line for line in section.splitlines() if line.startswith("| selector-")]
    assert len(rows) == 1 and "(EMULATED)" in rows[0] and rows[0].endswith("| 32 | 0.2 | 0.25 | -20.0% |"), rows
