"""GPU test policy: tests that need a GPU request the `gpu` fixture (or the
fixtures built on it). They skip when no GPU is visible, and FAIL instead when
MGPU_TEST_GPU=1, so a GPU job cannot pass by skipping everything. Tests in this
directory that need no GPU (the probe on the CPU backend, host-side Philox
checks) run everywhere, CI included.

With MGPU_EMULATE_GPU=N every test here runs on the GPU emulation
(emulation/README.md), except those marked real_gpu (timing figures), and a
test fails when the emulation reported a rule violation (race, out-of-bounds
access, divergent barrier, mismatched collectives) while it ran."""

import os
import sys
from pathlib import Path

import pytest

from mgpu import _core

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/reference.py, tests/conftest.py helpers

REQUIRE_GPU = os.environ.get("MGPU_TEST_GPU") == "1"
EMULATED = bool(_core.build_info().get("gpu_emulation", False))


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("real_gpu")
    if marker is not None and EMULATED:
        pytest.skip(f"needs real GPU hardware: {marker.args[0] if marker.args else 'timing'}")


@pytest.fixture(autouse=True)
def no_emulation_violations(tmp_path_factory, monkeypatch):
    """On the emulation: the test fails if the emulated GPU saw a rule violation,
    in this process or in any process it started (mpirun ranks, the CLI): they
    all append theirs to MGPU_EMULATE_VIOLATIONS_FILE."""
    if not EMULATED:
        yield
        return
    shared = tmp_path_factory.mktemp("violations") / "violations.txt"
    monkeypatch.setenv("MGPU_EMULATE_VIOLATIONS_FILE", str(shared))
    _core.emulation.clear_violations()
    yield
    found = _core.emulation.violations()
    _core.emulation.clear_violations()
    assert not found, "GPU emulation violations:\n" + "\n".join(found)
    elsewhere = shared.read_text() if shared.exists() else ""
    assert not elsewhere, "GPU emulation violations in processes the test started:\n" + elsewhere


def gpu_count() -> int:
    count = getattr(_core, "cuda_device_count", None)
    return int(count()) if count is not None else 0


def cuda_info() -> dict:
    return _core.build_info()["cuda"]


@pytest.fixture(scope="session")
def gpu():
    """Index of the GPU to test on (0); skip, or fail under MGPU_TEST_GPU=1, without one."""
    info = cuda_info()
    if not info.get("compiled", False):
        reason = "mgpu was built without the CUDA backend"
    elif gpu_count() == 0:
        reason = f"no GPU is visible ({info.get('no_device_reason', 'cudaGetDeviceCount returned 0')})"
    else:
        return 0
    if REQUIRE_GPU:
        pytest.fail(f"MGPU_TEST_GPU=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def two_gpus(gpu):
    """Two GPUs and NCCL between them (MGPU_EMULATE_GPU=2 on the emulation), or skip."""
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs (MGPU_EMULATE_GPU=2 on the emulation)")
    if not hasattr(_core, "NcclCommunicator"):
        pytest.skip("mgpu was built without NCCL")


@pytest.fixture
def cuda_backend(gpu):
    be = _core.make_backend("cuda", gpu)
    assert be.precision == "fp32"
    return be


@pytest.fixture
def cpu_backend():
    return _core.make_backend("cpu", 0, 1)
