"""Process helpers the fault tests (test_faults.py) and the virtual cluster
(cluster/vcluster.py) share; no pytest here, since vcluster.py also runs as a script."""

import time
from pathlib import Path


def mpi_ranks(pids) -> dict:
    """rank -> pid of the processes among `pids` that are MPI ranks (by the
    OMPI_COMM_WORLD_RANK their launcher put in their environment)."""
    found = {}
    for pid in pids:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        for var in env:
            if var.startswith(b"OMPI_COMM_WORLD_RANK="):
                found[int(var.split(b"=")[1])] = pid
    return found


def wait_for(condition, timeout, what, poll=0.01):
    """Poll `condition` until it holds; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")
