"""Fixtures of the multi-host tests: a fresh virtual cluster (vcluster.py) per test,
and mpirun across it with what a remote rank needs exported.

The cluster needs root: without it these tests skip with the reason; as root, a
cluster that cannot be made (no iproute2, namespaces refused) FAILS the test,
so CI cannot pass by not running them. Tests marked cluster_slow (the slower
fault cases) run only with MGPU_CLUSTER_SLOW=1 (docs/several-nodes.md)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/conftest.py helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vcluster import Cluster, ClusterError  # noqa: E402

SLOW = os.environ.get("MGPU_CLUSTER_SLOW") == "1"


def pytest_collection_modifyitems(config, items):
    if SLOW:
        return
    slow = [i for i in items if i.get_closest_marker("cluster_slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [i for i in items if not i.get_closest_marker("cluster_slow")]


@pytest.fixture
def cluster(request):
    """Two hosts, two slots each (a test may ask for more hosts with indirect params)."""
    hosts = getattr(request, "param", 2)
    if os.geteuid() != 0:
        pytest.skip("the virtual cluster needs root (network namespaces); run the tests as root")
    try:
        c = Cluster(hosts=hosts, slots=2)
    except ClusterError as e:
        pytest.fail(f"cannot make the virtual cluster on this machine: {e}", pytrace=False)
    with c:
        yield c
