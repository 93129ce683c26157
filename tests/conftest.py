"""Shared test helpers: launching mpirun from a test (as root, oversubscribed)."""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

# No test reads the developer's calibration (~/.cache/mgpu/profile.json): with one,
# `train` takes --bucket-mb auto and --batch-shares auto from it and a run differs from
# CI's, which has none. Tests that need a calibration write their own.
_TEST_CACHE = tempfile.mkdtemp(prefix="mgpu-test-cache-")
os.environ["XDG_CACHE_HOME"] = _TEST_CACHE
atexit.register(shutil.rmtree, _TEST_CACHE, True)


def mpi_env(**extra):
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        PYTHONUNBUFFERED="1",
        # one thread per rank: ranks share this machine's cores
        OMP_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


def mpirun(n, args, timeout=300, env=None, cwd=None):
    """Run `mpirun -np n <args>`; returns the CompletedProcess (text)."""
    cmd = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or mpi_env(), cwd=cwd or ROOT)


def run_cli(args, timeout=300, env=None):
    return subprocess.run(
        [PYTHON, "-m", "mgpu", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or mpi_env(),
        cwd=ROOT,
    )


@pytest.fixture
def root():
    return ROOT
