"""Shared test helpers: launching mpirun from a test (as root, oversubscribed)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def mpi_env(**extra):
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONUNBUFFERED="1",
               # one thread per rank: ranks share this machine's cores
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def mpirun(n, args, timeout=300, env=None, cwd=None):
    """Run `mpirun -np n <args>`; returns the CompletedProcess (text)."""
    cmd = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or mpi_env(),
                          cwd=cwd or ROOT)


def run_cli(args, timeout=300, env=None):
    return subprocess.run([PYTHON, "-m", "mgpu", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env or mpi_env(), cwd=ROOT)


@pytest.fixture
def root():
    return ROOT
