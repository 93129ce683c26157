"""The CPU backend's GEMM libraries (CpuGemm, csrc/cpu/cpu_backend.h): the choice
by product size, the MGPU_CPU_GEMM override, and every library against the
float64 reference on the forward and both backward products."""
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


def test_auto_picks_by_product_size():
    backend = _core.make_backend("cpu", 0, 1)
    limit = int(BLAS["onednn_max_work"])
    small, big = (64, 64, limit // 4096), (64, 64, limit // 4096 + 1)  # at and just above the limit
    assert small[0] * small[1] * small[2] == limit
    expected_small = "onednn" if HAS_ONEDNN else "openblas"
    assert _core.cpu_gemm_library(backend, *small) == expected_small
    assert _core.cpu_gemm_library(backend, *big) == "openblas"
    assert _core.cpu_gemm_library(backend, 64, 0, 64) == "openblas"  # empty products stay with the BLAS
    _core.set_cpu_gemm(backend, "openblas")
    assert _core.cpu_gemm_library(backend, *small) == "openblas"
    if HAS_ONEDNN:
        _core.set_cpu_gemm(backend, "onednn")
        assert _core.cpu_gemm_library(backend, *big) == "onednn"
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
