"""The NCCL communicator: one rank in this process, and two ranks under
mpirun sharing GPU 0 (NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1); with an
older NCCL, ranks sharing a GPU get a clear ConfigError. CUDA + MPI (host-staged
gradients) under mpirun needs no NCCL at all."""

import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from conftest import mpi_env, mpirun  # tests/conftest.py helpers
from mgpu import _core
from sharded import check_sharded  # tests/sharded.py

WORKER = Path(__file__).with_name("nccl_worker.py")
HAS_NCCL = hasattr(_core, "NcclCommunicator")
NCCL_CODE = _core.build_info()["cuda"].get("nccl_loaded_code", 0)

needs_nccl = pytest.mark.skipif(not HAS_NCCL, reason="mgpu was built without NCCL")


def one_rank(gpu):
    return _core.NcclCommunicator(_core.nccl_unique_id(), 0, 1, gpu)


@needs_nccl
def test_single_rank_collectives(gpu):
    comm = one_rank(gpu)
    assert (comm.name, comm.rank, comm.size, comm.device) == ("nccl", 0, 1, gpu)
    x = np.arange(1000, dtype=np.float32)
    comm.allreduce_sum(x)
    assert np.array_equal(x, np.arange(1000, dtype=np.float32))
    comm.allreduce_sum_bucketed(x, 300)
    comm.broadcast(x, 0)
    comm.barrier()
    comm.timeout = 5.0
    comm.begin_step(3)
    comm.allreduce_sum(x)
    assert comm.missing_peers() == []
    with pytest.raises(_core.CommError):
        comm.broadcast(x, 1)


@needs_nccl
def test_bad_unique_id_and_cpu_backend_are_config_errors(gpu):
    with pytest.raises(ValueError, match="128 bytes"):
        _core.NcclCommunicator(b"short", 0, 1, gpu)
    be = _core.make_backend("cpu", 0, 1)
    model = _core.MLP(be, [4, 3], 0.0, 0)
    with pytest.raises(ValueError, match="needs the CUDA backend"):
        _core.DataParallelStep(model, _core.Optimizer(model, "sgd"), one_rank(gpu), "mse")


@needs_nccl
@pytest.mark.parametrize("overlap, graph", [(True, "off"), (False, "off"), (True, "on")])
def test_single_rank_nccl_step_equals_local(gpu, overlap, graph):
    sizes = [16, 40, 40, 4]
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((32, 16)).astype(np.float32), rng.integers(0, 4, 32)) for _ in range(10)]
    params = {}
    for kind in ("local", "nccl"):
        model = _core.MLP(_core.make_backend("cuda", gpu), sizes, 0.1, 7)
        comm = _core.LocalCommunicator() if kind == "local" else one_rank(gpu)
        step = _core.DataParallelStep(
            model,
            _core.Optimizer(model, "adamw"),
            comm,
            "cross_entropy",
            _core.StepOptions(bucket_elems=700, overlap=overlap, graph=graph),
        )
        assert step.overlaps == (overlap and graph == "off")  # a captured step allreduces after backward
        assert step.uses_graphs == (graph == "on")
        for t, (x, y) in enumerate(data):
            r = step.step([(x, y, 0)], 32, t, 1e-3, request_stop=(t == 9))
            assert r.applied and r.stop_requested == (t == 9)
        params[kind] = model.get_parameters()
    assert np.array_equal(params["nccl"], params["local"])


def launch(n, mode, extra_env=None, timeout=300):
    env = mpi_env(**(extra_env or {}))
    return mpirun(n, [sys.executable, WORKER, mode], timeout=timeout, env=env)


@needs_nccl
def test_two_ranks_share_gpu0(gpu):
    if NCCL_CODE < 23000:
        pytest.skip(f"NCCL {_core.build_info()['cuda']['nccl_loaded']} < 2.30 cannot put two ranks on one GPU")
    r = launch(2, "nccl", {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "CUDA_VISIBLE_DEVICES": "0"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("OK") == 2, r.stdout + r.stderr


@needs_nccl
def test_sharing_a_gpu_without_support_is_a_config_error(gpu):
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    if NCCL_CODE >= 23000:
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = "0"  # supported, but not enabled: same clear error
    r = launch(2, "nccl-expect-config-error", env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("OK") == 2, r.stdout + r.stderr


@needs_nccl
@pytest.mark.parametrize("mode", ["nccl-zero-rows", "nccl-zero-rows+graph"])
def test_a_rank_without_rows_groups_its_allreduces_like_the_others(gpu, mode):
    # A rank with 0 rows skips backward; its bucket allreduces must still form
    # the same NCCL groups as its peers' (real NCCL: hang or wrong sums otherwise;
    # the emulation compares every group across ranks).
    if _core.cuda_device_count() < 2 and NCCL_CODE < 23000:
        pytest.skip("needs 2 GPUs (or NCCL >= 2.30 to share one)")
    r = launch(2, mode)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("OK") == 2, r.stdout + r.stderr


# (ids without "mpi": pytest-mpi would skip a test with that keyword unless --with-mpi)
@pytest.mark.parametrize("mode", ["mpi", "mpi+graph"], ids=["staged", "staged-graph"])
def test_two_ranks_cuda_with_mpi_staging(gpu, mode):
    if not hasattr(_core, "MpiCommunicator"):
        pytest.skip("mgpu was built without MPI")
    r = launch(2, mode, {"CUDA_VISIBLE_DEVICES": "0"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("OK") == 2, r.stdout + r.stderr
    if _core.build_info().get("gpu_emulation", False):
        # Staged through pinned memory behind fences: a step waits for its GPU once for
        # all its buckets and once for its read-back, not once per bucket.
        counts = re.findall(r"SYNCS (\S+) BUCKETS (\d+)", r.stdout)
        assert len(counts) == 2, r.stdout
        for syncs, buckets in counts:
            assert int(buckets) >= 4 and float(syncs) <= 2.0, r.stdout


@needs_nccl
def test_reduce_scatter_and_all_gather_between_processes(gpu):
    # Uneven parts, an empty one, and a part on every rank; sync and async; each
    # rank checks its parts against numpy (tests/sharded.py).
    if _core.cuda_device_count() < 2 and NCCL_CODE < 23000:
        pytest.skip("needs 2 GPUs (or NCCL >= 2.30 to share one)")
    r = launch(2, "sharded")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("OK") == 2, r.stdout + r.stderr


@needs_nccl
@pytest.mark.parametrize("form", ["sync", "async"])
def test_reduce_scatter_and_all_gather_between_threads(gpu, form):
    # One thread per visible GPU (ncclCommInitAll), as `train --gpus N`.
    comms = _core.nccl_init_all(list(range(_core.cuda_device_count())))
    exact = len(comms) <= 2 or _core.build_info().get("gpu_emulation", False)
    for comm in comms:
        comm.timeout = 60.0  # a wrong grouping fails instead of hanging
    with ThreadPoolExecutor(len(comms)) as pool:
        for done in [pool.submit(check_sharded, comm, form, exact) for comm in comms]:
            done.result()
