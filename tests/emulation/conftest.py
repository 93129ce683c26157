"""Tests of the GPU emulation itself (emulation/README.md). They run when the
emulation is loaded (MGPU_EMULATE_GPU=N; scripts/test.sh runs them so) and
skip in the plain CPU suite, where the real-GPU module is loaded."""

import sys
from pathlib import Path

import pytest

from mgpu import _core

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/conftest.py helpers, reference.py

EMULATED = bool(_core.build_info().get("gpu_emulation", False))


def pytest_collection_modifyitems(config, items):
    if EMULATED:
        return
    skip = pytest.mark.skip(reason="needs the GPU emulation (run with MGPU_EMULATE_GPU=2)")
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_context():
    """Each test starts and ends on a healthy emulated context with no violations recorded."""
    if EMULATED:
        _core.emulation.clear_violations()
    yield
    if EMULATED:
        _core.emulation.clear_violations()
