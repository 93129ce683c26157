"""The CPU backend's GEMM libraries (CpuGemm, csrc/cpu/cpu_backend.h): the choice
by product shape, thread count and the CPU's vector width, the MGPU_CPU_GEMM
override, and every library against the float64 reference on the forward and both
backward products."""
import os
import subprocess
import sys

import numpy as np
import pytest

import mgpu
from mgpu import _core
from reference import loss_and_grad, rel_err

BLAS = mgpu.build_info()["blas"]
HAS_ONEDNN = bool(BLAS.get("onednn"))
LIBRARIES = ["openblas", "auto"] + (["onednn"] if HAS_ONEDNN else [])


def test_auto_rule_by_shape_and_vector_width():
    limit = int(BLAS["onednn_max_work"])
    small, big = (64, 64, limit // 4096), (64, 64, limit // 4096 + 1)  # at and just above the limit
    assert small[0] * small[1] * small[2] == limit
    dnn = "onednn" if HAS_ONEDNN else "openblas"
    # AVX2: by the number of multiply-adds, whatever the shape.
    assert _core.auto_cpu_gemm(*small, threads=1, avx512=False) == dnn
    assert _core.auto_cpu_gemm(*big, threads=1, avx512=False) == "openblas"
    assert _core.auto_cpu_gemm(1024, 3, 256, threads=1, avx512=False) == dnn
    assert _core.auto_cpu_gemm(*big, threads=2, avx512=False) == "openblas"
    # AVX2, several threads: OpenBLAS throughout (no sleeping OpenMP team to wake per call).
    assert _core.auto_cpu_gemm(*small, threads=2, avx512=False) == "openblas"
    assert _core.auto_cpu_gemm(1024, 3, 256, threads=4, avx512=False) == "openblas"
    # AVX-512, one thread: by the output width, whatever the size.
    width = int(BLAS["onednn_min_width_avx512"])
    assert _core.auto_cpu_gemm(1024, width, 1024, threads=1, avx512=True) == dnn
    assert _core.auto_cpu_gemm(4096, 4096, 4096, threads=1, avx512=True) == dnn
    assert _core.auto_cpu_gemm(1024, width - 1, 1024, threads=1, avx512=True) == "openblas"
    assert _core.auto_cpu_gemm(64, 3, 64, threads=1, avx512=True) == "openblas"
    # AVX-512, several threads: oneDNN throughout (no OpenBLAS threads spinning against its team).
    assert _core.auto_cpu_gemm(64, 3, 64, threads=2, avx512=True) == dnn
    assert _core.auto_cpu_gemm(4096, 4096, 4096, threads=4, avx512=True) == dnn
    for avx512 in (False, True):  # empty products stay with the BLAS
        for threads in (1, 2):
            assert _core.auto_cpu_gemm(64, 0, 64, threads=threads, avx512=avx512) == "openblas"
            assert _core.auto_cpu_gemm(0, 64, 64, threads=threads, avx512=avx512) == "openblas"
    with pytest.raises(mgpu.ConfigError, match="threads must be >= 1"):
        _core.auto_cpu_gemm(64, 64, 64, threads=0, avx512=True)


def test_backend_follows_the_rule_for_this_cpu_and_the_override():
    backend = _core.make_backend("cpu", 0, 1)
    avx512 = bool(BLAS["cpu_avx512"])
    with open("/proc/cpuinfo") as f:  # the rule's ISA is the CPU's, read independently here
        assert avx512 == ("avx512f" in f.read().split())
    shapes = [(64, 64, 64), (1024, 1024, 1024), (1024, 3, 256), (1024, 50, 1024), (64, 0, 64)]
    for threads in (2, 1):
        backend.threads = threads
        for shape in shapes:
            assert _core.cpu_gemm_library(backend, *shape) == _core.auto_cpu_gemm(*shape, threads=threads,
                                                                                    avx512=avx512)
    # Shapes this CPU's rule gives oneDNN and OpenBLAS; the override beats both.
    too_big = (64, 64, int(BLAS["onednn_max_work"]) // 4096 + 1)
    to_dnn, to_blas = (64, 64, 64), ((1024, 3, 256) if avx512 else too_big)
    assert _core.cpu_gemm_library(backend, *to_blas) == "openblas"
    assert _core.cpu_gemm_library(backend, *to_dnn) == ("onednn" if HAS_ONEDNN else "openblas")
    _core.set_cpu_gemm(backend, "openblas")
    assert _core.cpu_gemm_library(backend, *to_dnn) == "openblas"
    if HAS_ONEDNN:
        _core.set_cpu_gemm(backend, "onednn")
        assert _core.cpu_gemm_library(backend, *to_blas) == "onednn"
    else:
        with pytest.raises(mgpu.ConfigError, match="no oneDNN"):
            _core.set_cpu_gemm(backend, "onednn")
    with pytest.raises(mgpu.ConfigError, match="'auto', 'openblas' or 'onednn'"):
        _core.set_cpu_gemm(backend, "mkl")


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layers, rows", [([13, 32, 17, 9, 2], 29), ([64, 300, 10], 7), ([200, 256, 96], 130)])
def test_every_library_matches_the_reference(library, threads, layers, rows):
    m = mgpu.MLP(layers, seed=3, threads=threads)
    _core.set_cpu_gemm(m._backend, library)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, layers[0])).astype(np.float32)
    y = rng.standard_normal((rows, layers[-1])).astype(np.float32)
    value = m.loss_and_grad(x, y, "mse")
    ref_value, ref_grads = loss_and_grad(m.get_parameters(), x, y, "mse")
    assert abs(value - ref_value) <= 1e-5 * max(1.0, abs(ref_value))
    for g, r in zip(m.get_gradients(), ref_grads):
        assert rel_err(g, r) < 1e-4
    first = [g.copy() for g in m.get_gradients()]
    m.loss_and_grad(x, y, "mse")  # the same library twice: bit for bit
    assert all(np.array_equal(a, b) for a, b in zip(first, m.get_gradients()))


def test_bad_environment_choice_is_one_line_exit_2():
    env = dict(os.environ, MGPU_CPU_GEMM="mkl")
    r = subprocess.run([sys.executable, "-m", "mgpu", "train", "--layers", "4,8,3", "--steps", "1", "--no-progress",
                        "--device", "cpu"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "MGPU_CPU_GEMM: " in lines[0] and "'openblas' or 'onednn'" in lines[0], lines
    info = subprocess.run([sys.executable, "-m", "mgpu", "info"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, MGPU_CPU_GEMM="openblas"))
    assert "CPU GEMM: OpenBLAS" in info.stdout


def _import_in_fresh_process(**env_changes):
    """(GOMP_SPINCOUNT, OMP_WAIT_POLICY, mgpu.OPENMP_ONLY_ENV, the PyTorch peer's two) after `import mgpu`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "MGPU_CPU_GEMM", "MGPU_SET_OPENMP_ENV")}
    env.update(env_changes)
    code = ("import json, os, mgpu\nfrom mgpu.bench import _mpi_env\npeer = _mpi_env(peer=True)\n"
            "print(json.dumps([os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'), "
            "mgpu.OPENMP_ONLY_ENV, peer.get('GOMP_SPINCOUNT'), peer.get('OMP_WAIT_POLICY')]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    import json
    return json.loads(r.stdout)


def test_openmp_workers_spin_briefly_only_where_no_openblas_thread_computes():
    # The spin is decided before the core loads: from the CPU's flags (read here
    # independently), the core's oneDNN and MGPU_CPU_GEMM, as the GEMM rule decides.
    with open("/proc/cpuinfo") as f:
        avx512 = "avx512f" in f.read().split()
    openmp_only = avx512 and HAS_ONEDNN
    spin, policy, added, peer_spin, peer_policy = _import_in_fresh_process()
    assert policy == peer_policy == "passive"  # the peer mixes OpenMP and OpenBLAS too
    assert (spin, added) == (("10000", {"GOMP_SPINCOUNT": "10000"}) if openmp_only else (None, {}))
    assert peer_spin is None  # mgpu's own tuning: not for other frameworks
    # OpenBLAS forced: its threads compute in the step, so the workers must yield at once
    assert _import_in_fresh_process(MGPU_CPU_GEMM="openblas")[:3] == [None, "passive", {}]
    assert _import_in_fresh_process(MGPU_CPU_GEMM="onednn")[0] == ("10000" if HAS_ONEDNN else None)
    # the user's settings stand, and reach the peer as given; a policy of theirs gets no spin
    assert _import_in_fresh_process(GOMP_SPINCOUNT="7", OMP_WAIT_POLICY="active") == ["7", "active", {}, "7",
                                                                                        "active"]
    for policy in ("active", "passive"):
        assert _import_in_fresh_process(OMP_WAIT_POLICY=policy) == [None, policy, {}, None, policy]
    # what an mgpu parent set is decided afresh in a child (here: OpenBLAS forced, so no spin)
    inherited = dict(OMP_WAIT_POLICY="passive", GOMP_SPINCOUNT="10000",
                     MGPU_SET_OPENMP_ENV="OMP_WAIT_POLICY=passive,GOMP_SPINCOUNT=10000")
    assert _import_in_fresh_process(**inherited, MGPU_CPU_GEMM="openblas")[:3] == [None, "passive", {}]
    assert _import_in_fresh_process(**inherited)[2] == ({"GOMP_SPINCOUNT": "10000"} if openmp_only else {})
