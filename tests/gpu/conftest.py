"""GPU test policy: tests that need a GPU request the `gpu` fixture (or the
fixtures built on it). They skip when no GPU is visible, and FAIL instead when
MGPU_TEST_GPU=1, so a GPU job cannot pass by skipping everything. Tests in this
directory that need no GPU (the probe on the CPU backend, host-side Philox
checks) run everywhere, CI included."""
import os
import sys
from pathlib import Path

import pytest

from mgpu import _core

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/reference.py, tests/conftest.py helpers

REQUIRE_GPU = os.environ.get("MGPU_TEST_GPU") == "1"


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
def cuda_backend(gpu):
    be = _core.make_backend("cuda", gpu)
    assert be.precision == "fp32"
    return be


@pytest.fixture
def cpu_backend():
    return _core.make_backend("cpu", 0, 1)
