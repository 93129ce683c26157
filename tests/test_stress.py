"""`mgpu stress` on the CPU: verification that catches an injected fault in every
kernel, telemetry files, the safety monitor's actions, several ranks, clean stops
and one-line errors."""

import csv
import json
import os
import re
import resource
import signal
import subprocess
import time

import pytest

from conftest import PYTHON, ROOT, mpi_env, mpirun, run_cli
from mgpu import _core
from mgpu.monitor.safety import SafetyMonitor, Thresholds
from mgpu.monitor.telemetry import Sampler, summarize
from procs import mpi_ranks, wait_for  # tests/procs.py

MGPU = [PYTHON, "-m", "mgpu"]
SMALL = ["--memory-mb", "8", "--compute-size", "4096", "--gemm-size", "128", "--no-progress"]


def test_short_run_verifies_every_kernel_and_writes_telemetry(tmp_path):
    r = run_cli(
        [
            "stress",
            "--duration",
            "2",
            *SMALL,
            "--interval",
            "0.2",
            "--json",
            tmp_path / "s.json",
            "--telemetry",
            tmp_path / "tel",
        ]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "s.json").read_text())
    (dev,) = report["devices"]
    assert dev["verdict"] == "OK" and dev["errors"] == {"compute": 0, "gemm": 0, "memory": 0}
    assert all(dev["checked"][k] > 0 and dev["runs"][k] > 0 for k in ("compute", "gemm", "memory"))
    assert dev["buffer_bytes"] == 8 << 20 and report["gpu_emulation"] is False
    # where no sensor gave a temperature, the run says --max-temp went unwatched
    assert ("--max-temp was not watched" in r.stdout) == (not dev["temperature_watched"]), r.stdout
    for key in (
        "compute_ops_per_s",
        "gemm_flops",
        "gemm_reference_flops",
        "memory_GBps",
        "copy_reference_GBps",
        "memory_vs_copy",
        "gemm_vs_reference",
    ):
        assert dev["rates"][key] > 0
    tel = dev["telemetry"]
    assert tel["memory_used_pct"]["min"] <= tel["memory_used_pct"]["max"]
    with open(tmp_path / "tel.csv") as f:
        assert len(list(csv.DictReader(f))) >= 3
    assert (tmp_path / "tel.png").stat().st_size > 1000
    assert "OK" in r.stdout


@pytest.mark.parametrize("kernel", ["compute", "gemm", "memory"])
def test_an_injected_bit_flip_makes_the_device_faulty(tmp_path, kernel):
    r = run_cli(
        [
            "stress",
            "--duration",
            "1",
            "--kernel",
            kernel,
            *SMALL,
            "--inject-fault",
            kernel,
            "--json",
            tmp_path / "f.json",
        ]
    )
    assert r.returncode == 1, r.stderr[-2000:]
    (dev,) = json.loads((tmp_path / "f.json").read_text())["devices"]
    assert dev["verdict"] == "FAULTY" and dev["errors"][kernel] >= 1 and dev["injected_fault"] == [kernel]


def test_random_pattern_uses_all_128_bits_of_each_philox_call():
    seed, pass_index = 0x123456789, 3
    key = [seed & 0xFFFFFFFF, (seed >> 32) ^ ((0x57E5 * 0x9E3779B9) & 0xFFFFFFFF)]  # philox_draw, kStress
    for k in (0, 1, 2**32 + 5):
        v = _core.philox4x32_10([k & 0xFFFFFFFF, k >> 32, pass_index, 1], key)
        want = [(v[0] << 32) | v[1], (v[2] << 32) | v[3]]
        assert [_core.stress_word("random", seed, pass_index, 2 * k + j) for j in (0, 1)] == want
    assert _core.stress_word("address", 0, 1, 5) == ~5 & (2**64 - 1)
    assert _core.stress_word("walking_ones", 0, 2, 63) == 2


def test_verification_is_exact_without_faults():
    dev = _core.make_stress_device("cpu", 0, 1)
    c = dev.compute(1000, 5, 3, 1000, False)
    assert c.checked == 1000 and c.mismatches == 0 and c.nonfinite == 0
    g = dev.gemm(64, 3, 1, 0.0, False)
    assert g.checked == 2 * 64 * 64 + 64 * 64 and g.mismatches == 0  # 2 repeats + the first's fp64 check
    with pytest.raises(ValueError, match="fp32 only"):
        dev.gemm(64, 2, 1, 0.0, False, "bf16")
    assert dev.copy_bandwidth(1 << 20) > 1e8
    dev.resize_buffer(1 << 20)
    for pattern in ("walking_ones", "address", "random"):
        m = dev.memory(pattern, 0, 1, False)
        assert m.checked == (1 << 20) // 8 and m.mismatches == 0
    with pytest.raises(ValueError, match="unknown memory pattern"):
        dev.memory("zebra", 0, 0, False)


def test_safety_monitor_throttles_stops_growing_and_warns():
    m = SafetyMonitor(Thresholds(max_temp_c=85, max_memory_pct=95, power_limit_w=300))
    assert m.check({"t": 0.0, "temperature_c": 70, "memory_used_pct": 50}, 16) == 16 and not m.events
    assert m.check({"t": 1.0, "temperature_c": 90}, 16) == 8
    assert m.check({"t": 2.0, "temperature_c": 91}, 8) == 4
    assert m.check({"t": 3.0, "memory_used_pct": 96.5}, 4) == 4 and m.grow_memory is False
    m.check({"t": 4.0, "power_w": 320.0}, 4)
    m.check({"t": 5.0, "power_w": 330.0}, 4)  # within 10 s of the last warning: not repeated
    assert [e["action"] for e in m.events] == ["throttle", "throttle", "stop_growing_memory", "power_warning"]
    # the device's own enforced limit applies when none is configured
    m2 = SafetyMonitor(Thresholds())
    m2.check({"t": 0.0, "power_w": 400.0, "power_limit_w": 350.0}, 4)
    assert m2.events[-1]["action"] == "power_warning"


def test_sampler_collects_and_summarizes():
    values = iter(range(100))
    s = Sampler(lambda: {"temperature_c": float(next(values))}, interval=0.01).start()
    time.sleep(0.2)
    samples = s.stop()
    assert len(samples) >= 3 and samples[0]["t"] <= samples[-1]["t"]
    assert summarize(samples)["temperature_c"] == {"min": 0.0, "max": float(len(samples) - 1)}


def test_a_run_that_verified_too_little_is_unverified_not_ok(tmp_path):
    # Time is up after the first compute launch: gemm and memory never ran, and the memory
    # fault asked for was never injected. Exit 4: nothing faulty seen, nothing vouched for.
    r = run_cli(["stress", "--duration", "0.001", *SMALL, "--inject-fault", "memory", "--json", tmp_path / "u.json"])
    assert r.returncode == 4, r.stderr[-2000:]
    (dev,) = json.loads((tmp_path / "u.json").read_text())["devices"]
    assert dev["verdict"] == "UNVERIFIED" and dev["checked"]["memory"] == 0 and dev["injected_fault"] is None
    assert "memory not tested" in dev["unverified"]
    assert "the memory fault asked for was never injected" in dev["unverified"]
    assert "UNVERIFIED (" in r.stdout and "memory not tested" in r.stdout


def test_an_injected_fault_the_tolerance_lets_through_is_not_ok(tmp_path):
    args = ["stress", "--duration", "1", "--kernel", "gemm", *SMALL, "--inject-fault", "gemm", "--gemm-tol", "0.9"]
    r = run_cli([*args, "--json", tmp_path / "g.json"])
    (dev,) = json.loads((tmp_path / "g.json").read_text())["devices"]
    assert r.returncode == 4 and dev["unverified"] == ["the injected gemm fault was not caught"], r.stderr[-2000:]


def test_a_buffer_stopped_before_it_grew_skips_the_memory_pass_with_a_report(tmp_path):
    # The monitor sees memory above the threshold after the first (compute) launch: the
    # buffer never grows, the memory pass is skipped as an event, the other kernels burn on.
    r = run_cli(
        ["stress", "--duration", "1.5", *SMALL, "--max-memory-percent", "0.001", "--interval", "0.05"]
        + ["--json", tmp_path / "m.json"]
    )
    assert r.returncode == 4, r.stderr[-2000:]
    report = json.loads((tmp_path / "m.json").read_text())
    (dev,) = report["devices"]
    assert dev["buffer_bytes"] == 0 and dev["checked"]["memory"] == 0 and dev["checked"]["gemm"] > 0
    assert dev["unverified"] == ["memory not tested"]
    assert [e["action"] for e in report["events"]] == ["stop_growing_memory", "skip_memory"]


def test_an_allocation_beyond_the_host_is_one_line_not_a_traceback():
    # The size fits the memory the host reports, not the address space this process may
    # have: the core's std::bad_alloc reaches the command line as one line, exit 1.
    def limit_address_space():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    r = subprocess.run(
        [*MGPU, "stress", "--kernel", "compute", "--compute-size", "2000000000", "--duration", "1", "--no-progress"],
        cwd=ROOT,
        env=mpi_env(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit_address_space,
    )
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "mgpu: error: out of host memory (std::bad_alloc)"
    ], r.stderr[-2000:]


def test_two_ranks_report_one_device_each(tmp_path):
    r = mpirun(2, [*MGPU, "stress", "--duration", "1.5", *SMALL, "--json", tmp_path / "m.json"])
    assert r.returncode == 0, r.stderr[-2000:]
    devices = json.loads((tmp_path / "m.json").read_text())["devices"]
    assert [d["rank"] for d in devices] == [0, 1] and all(d["verdict"] == "OK" for d in devices)


def test_sigterm_stops_cleanly_with_a_report(tmp_path):
    out = tmp_path / "t.json"
    p = subprocess.Popen(
        [*MGPU, "stress", "--duration", "120", *SMALL, "--json", out],
        cwd=ROOT,
        env=mpi_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(3)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0 and time.monotonic() - t0 < 20, err[-2000:]
    assert "mgpu: SIGTERM on rank 0: stopping the stress run\n" in err, err[-2000:]
    report = json.loads(out.read_text())
    assert report["stopped_early"] is True and report["devices"][0]["seconds"] < 60


@pytest.mark.parametrize("how", ["SIGTERM to rank 1 only", "SIGUSR1 to mpirun"])
def test_a_stop_on_one_rank_stops_every_rank_with_a_report(tmp_path, how):
    out = tmp_path / "s.json"
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", *MGPU, "stress", "--duration", "120"]
    cmd += [*SMALL, "--hang-timeout", "30", "--json", out]
    p = subprocess.Popen(
        list(map(str, cmd)),
        cwd=ROOT,
        env=mpi_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )

    def ranks():
        children = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout
        return mpi_ranks(map(int, children.split()))

    try:
        wait_for(lambda: len(ranks()) == 2 or p.poll() is not None, 60, "two ranks")
        time.sleep(5)  # past the reference timings: every kernel burning
        t0 = time.monotonic()
        if how.startswith("SIGTERM"):
            os.kill(ranks()[1], signal.SIGTERM)
        else:
            p.send_signal(signal.SIGUSR1)  # mpirun forwards it to every rank
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0 and time.monotonic() - t0 < 25, err[-2000:]
    report = json.loads(out.read_text())
    assert report["stopped_early"] is True
    assert all(d["verdict"] == "OK" and d["seconds"] < 60 for d in report["devices"]), report["devices"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--duration", "-1"], "--duration"),
        (["--memory-fraction", "1.5"], "--memory-fraction"),
        (["--kernel", "fft"], "invalid choice"),
        (["--gemm-size", "0"], "--gemm-size"),
        (["--device", "cpu", "--gemm-precision", "bf16"], "needs a GPU"),
        (["--duration", "inf"], "--duration must be finite"),
        (["--max-temp", "nan"], "--max-temp"),
        (["--max-memory-percent", "200"], "--max-memory-percent"),
        (["--power-limit", "0"], "--power-limit"),
        (["--interval", "inf"], "--interval"),
        (["--interval", "1e10"], "at most 604800 seconds"),
        (["--hang-timeout", "1e300"], "--hang-timeout"),
        (["--max-memory-percent", "100.0001"], "got 100.0001"),
        # a buffer beyond the host (it failed mid-run with a DeviceError, or swapped), both sizes, an idle fault
        (["--memory-mb", "1e12"], "is more than the"),
        (["--memory-mb", "8", "--memory-fraction", "0.5"], "not both"),
        (["--kernel", "gemm", "--inject-fault", "memory"], "--inject-fault memory needs the memory kernel"),
        (["--gemm-tol", "nan"], "--gemm-tol must be a relative tolerance in [0, 1), got nan"),
        (["--gemm-tol", "1"], "--gemm-tol"),
        # sizes the kernels could not hold: refused before the first launch, not mid-run
        (["--gemm-size", "46340"], "--gemm-size 46340 needs"),
        (["--compute-size", "2147483647", "--gemm-size", "25000"], "together need"),  # each fits alone
    ],
)
def test_stress_bad_input_one_line_on_every_rank(args, message):
    r = mpirun(2, [*MGPU, "stress", "--no-progress", *args], timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    errors = [p.splitlines()[0] for p in re.split(r"(?=mgpu(?: \w+)?: error)", r.stderr) if p.startswith("mgpu")]
    assert len(errors) == 2 and all(message in e for e in errors), r.stderr
