"""The CPU backend's GEMM libraries (CpuGemm, csrc/cpu/cpu_backend.h): the choice
by product shape, thread count and the CPU's vector width, the MGPU_CPU_GEMM
override, and every library against the float64 reference on the forward and both
backward products."""

import os
import signal
import subprocess
import sys
import time

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
            assert _core.cpu_gemm_library(backend, *shape) == _core.auto_cpu_gemm(
                *shape, threads=threads, avx512=avx512
            )
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
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mgpu",
            "train",
            "--layers",
            "4,8,3",
            "--steps",
            "1",
            "--no-progress",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "MGPU_CPU_GEMM: " in lines[0] and "'openblas' or 'onednn'" in lines[0], lines
    info = subprocess.run(
        [sys.executable, "-m", "mgpu", "info"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, MGPU_CPU_GEMM="openblas"),
    )
    assert "CPU GEMM: OpenBLAS" in info.stdout


def _import_in_fresh_process(**env_changes):
    """(GOMP_SPINCOUNT, OMP_WAIT_POLICY, mgpu.OPENMP_ONLY_ENV, the PyTorch peer's two) after `import mgpu`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "MGPU_CPU_GEMM", "MGPU_SET_OPENMP_ENV")
    }
    env.update(env_changes)
    code = (
        "import json, os, mgpu\nfrom mgpu.calibrate.bench import _mpi_env\npeer = _mpi_env(peer=True)\n"
        "print(json.dumps([os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'), "
        "mgpu.OPENMP_ONLY_ENV, peer.get('GOMP_SPINCOUNT'), peer.get('OMP_WAIT_POLICY')]))"
    )
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
    assert _import_in_fresh_process(GOMP_SPINCOUNT="7", OMP_WAIT_POLICY="active") == ["7", "active", {}, "7", "active"]
    for policy in ("active", "passive"):
        assert _import_in_fresh_process(OMP_WAIT_POLICY=policy) == [None, policy, {}, None, policy]
    # what an mgpu parent set is decided afresh in a child (here: OpenBLAS forced, so no spin)
    inherited = dict(
        OMP_WAIT_POLICY="passive",
        GOMP_SPINCOUNT="10000",
        MGPU_SET_OPENMP_ENV="OMP_WAIT_POLICY=passive,GOMP_SPINCOUNT=10000",
    )
    assert _import_in_fresh_process(**inherited, MGPU_CPU_GEMM="openblas")[:3] == [None, "passive", {}]
    assert _import_in_fresh_process(**inherited)[2] == ({"GOMP_SPINCOUNT": "10000"} if openmp_only else {})


# A training run that counts each SIGUSR2 in a Python handler (no-op otherwise). It says
# when it has trained, then waits for the end of the signals (stdin closed) and ignores
# the rest before it exits: Python resets its handlers on the way out, and a signal sent
# to a thread that holds it for good (an OpenMP worker) stays pending. Its first OpenMP
# team is made before any oneDNN GEMM (by elementwise loops on the OpenBLAS path, as a
# program's own parallel code would), so its workers start with signals unblocked.
_TRAINED = "signal test: trained"
_COUNTING_TRAINER = f"""
import signal, sys
import numpy as np
from mpi4py import MPI  # initialised here, before the signals: PMIx's start-up fails on them
import mgpu
from mgpu.commands.main import main
threads = int(sys.argv[sys.argv.index("--threads") + 1])
early = mgpu.MLP([64, 1024, 64], threads=threads)
mgpu._core.set_cpu_gemm(early._backend, "openblas")
early.loss_and_grad(np.ones((256, 64), np.float32), np.zeros((256, 64), np.float32))
handled = 0
def count(signum, frame):
    global handled
    handled += 1
signal.signal(signal.SIGUSR2, count)
code = main(sys.argv[1:])
# GEMMs outside a training step: each model call holds signals on its own.
import hashlib
direct = mgpu.MLP([50, 512, 512, 3], seed=1, threads=threads)
x = np.random.default_rng(0).standard_normal((64, 50)).astype(np.float32)
losses = [direct.loss_and_grad(x, x[:, :3], "mse", step=i) for i in range(300)]
digest = hashlib.sha1(np.array(losses, np.float32).tobytes())
for g in direct.get_gradients():
    digest.update(g.tobytes())
print("direct calls", digest.hexdigest(), file=sys.stderr)
print("\\n{_TRAINED}", flush=True)
sys.stdin.read()
signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # drops those still pending on threads that hold it
print("handled", handled, file=sys.stderr)
sys.exit(code)
"""


def _catches(pid: int, sig: int) -> bool:
    """Has process `pid` a handler for `sig` yet (the SigCgt mask of /proc/PID/status)?"""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught >> (sig - 1) & 1)


def _malloc_checks() -> dict:
    """glibc's checking malloc (MALLOC_CHECK_=3 needs libc_malloc_debug since glibc 2.34):
    a corrupted chunk aborts at its next free instead of, sometimes, much later."""
    from ctypes.util import find_library

    lib = find_library("c_malloc_debug")
    return {"LD_PRELOAD": lib, "MALLOC_CHECK_": "3"} if lib else {}


def _signal_until_trained(child, sig, seconds) -> int:
    """Send `sig` to each of `child`'s threads in turn (tgkill: an OpenMP worker inside a
    kernel gets its share, not only the thread the kernel would pick) as fast as possible,
    until the child says it has trained (or ends, or `seconds` pass); returns how many."""
    import ctypes
    import select

    tgkill = ctypes.CDLL(None, use_errno=True).tgkill  # glibc >= 2.30
    sent, said, deadline, threads = 0, b"", time.monotonic() + seconds, []
    while child.poll() is None and not _catches(child.pid, sig) and time.monotonic() < deadline:
        time.sleep(0.001)  # before its handler the signal would end the process
    fd = child.stdout.fileno()
    while child.poll() is None and time.monotonic() < deadline:
        if select.select([fd], [], [], 0)[0]:
            said += os.read(fd, 65536)
            if _TRAINED.encode() in said:
                break
        if sent % 1000 == 0:
            try:
                threads = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
            except OSError:
                break
        tgkill(child.pid, threads[sent % len(threads)], sig)
        sent += 1
    return sent


@pytest.mark.parametrize("library", [l for l in LIBRARIES if l != "auto"])
@pytest.mark.parametrize("threads", [1, 2])
def test_signals_during_gemms_leave_the_heap_and_the_result_intact(tmp_path, threads, library):
    # oneDNN's JIT GEMMs (before its fix of March 2026) run with rsp in the heap, where a
    # handled signal wrote its frame: 'free(): invalid pointer' within a second of signals
    # without the holds of async_signals.h, or (2 threads, workers not holding) wrong data.
    env = {k: v for k, v in os.environ.items() if k not in ("MGPU_CPU_GEMM", "LD_PRELOAD")}
    # OMPI_MCA_opal_signal: no OpenMPI backtrace handler, which can deadlock on the
    # malloc lock an aborting malloc check holds; the abort ends the process at once.
    env.update(MGPU_CPU_GEMM=library, OMPI_MCA_opal_signal="", **_malloc_checks())
    args = [
        "train",
        "--layers",
        "50,512,512,3",
        "--batch-size",
        "64",
        "--optimizer",
        "adamw",
        "--dropout",
        "0.1",
        "--no-progress",
        "--device",
        "cpu",
        "--threads",
        str(threads),
        "--seed",
        "5",
        "--steps",
        "600",
    ]
    handled, direct = {}, {}
    for name in ("quiet", "signalled"):
        child = subprocess.Popen(
            [sys.executable, "-c", _COUNTING_TRAINER, *args, "--save", tmp_path / f"{name}.npz"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        sent = _signal_until_trained(child, signal.SIGUSR2, 240) if name == "signalled" else 0
        try:
            _, err = child.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            child.kill()
            _, err = child.communicate()
        err = err.decode(errors="replace")
        assert child.returncode == 0, f"{name}: exit {child.returncode} after {sent} signals: {err[-2000:]}"
        handled[name] = int(err.split("handled ")[-1].split()[0])
        direct[name] = err.split("direct calls ")[-1].split()[0]
    assert handled["quiet"] == 0 and handled["signalled"] > 1000, handled
    assert direct["quiet"] == direct["signalled"], "direct model calls gave other results under signals"
    with np.load(tmp_path / "quiet.npz") as a, np.load(tmp_path / "signalled.npz") as b:
        assert a.files == b.files and all(np.array_equal(a[k], b[k]) for k in a.files)


_WORKER_MASKS = """
import os, signal, threading
import numpy as np
from mgpu import _core

def holding():  # threads other than this one that hold SIGUSR2
    me, count = threading.get_native_id(), 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            blocked = int(next(l.split()[1] for l in f if l.startswith("SigBlk:")), 16)
        if blocked >> (signal.SIGUSR2 - 1) & 1:
            assert int(tid) != me, "the calling thread still holds signals after the call"
            count += 1
    return count

backend = _core.make_backend("cpu", 0, 4)
rng = np.random.default_rng(0)
x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((256, 64), (1024, 64), (1024,)))
def forward(threads, library):  # one GEMM, then the bias on a parallel region (256 x 1024)
    backend.threads = threads
    _core.set_cpu_gemm(backend, library)
    _core.backend_ops.linear_forward(backend, x, w, b)
before = holding()
forward(4, "onednn")
first = holding() - before
forward(2, "openblas")  # a smaller team ends two workers...
forward(4, "openblas")  # ...and a larger one starts two, outside any hold
forward(4, "onednn")
print(first, holding() - before)
"""


@pytest.mark.skipif(not HAS_ONEDNN, reason="the OpenMP workers hold signals for oneDNN's GEMMs only")
def test_openmp_workers_hold_signals_after_their_team_shrinks_and_regrows():
    r = subprocess.run(
        [sys.executable, "-c", _WORKER_MASKS],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "MGPU_CPU_GEMM"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["3", "3"], r.stdout  # 4 threads: the caller and 3 workers
