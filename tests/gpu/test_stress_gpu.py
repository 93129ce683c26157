"""CUDA stress kernels (kernels/stress.cu) against the CPU StressDevice: clean runs
verify with zero mismatches, an injected bit flip is caught in every kernel, the GEMM
burn's independent check of its first result counts what its CPU and NumPy references
count (so a deterministic corruption is caught), and the GEMM burn runs near the plain
cuBLAS rate (reported, not asserted: that is a benchmark)."""

import numpy as np
import pytest

from mgpu import _core

EMULATED = bool(_core.build_info().get("gpu_emulation", False))


@pytest.fixture
def dev(gpu):
    return _core.make_stress_device("cuda", gpu, 0)


def test_compute_burn_verifies_and_catches_a_flip(dev):
    c = dev.compute(1 << 16, 8, 3, 4096, False)
    assert c.checked == 4096 and c.mismatches == 0 and c.nonfinite == 0 and c.seconds > 0
    assert dev.compute(1 << 16, 8, 3, 4096, True).mismatches == 1


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_gemm_burn_is_deterministic_and_catches_a_flip(dev, precision):
    g = dev.gemm(512, 4, 1, 0.0, False, precision)
    # 3 repeats against the first, and the first against 4096 fp64 samples (once per n, seed, precision)
    assert g.checked == 3 * 512 * 512 + 4096 and g.mismatches == 0 and g.nonfinite == 0
    g = dev.gemm(512, 3, 1, 1e-3, True, precision)
    assert g.checked == 3 * 512 * 512 and g.mismatches == 1  # the first is known: all 3 compared


def round_bf16(x):
    """fp32 -> bf16 -> fp32, round to nearest even (finite inputs), as __float2bfloat16."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def sampled(n, samples):
    return np.array([_core.stress_sample_index(k, n * n, samples) for k in range(samples)])


def host_gemm_check(a, b, c, precision, samples):
    """The independent check's rule in NumPy: mismatches among c's sampled elements."""
    n = a.shape[0]
    if precision == "bf16":
        a, b = round_bf16(a), round_bf16(b)
    idx = sampled(n, samples)
    rows, cols = np.divmod(idx, n)
    products = a.astype(np.float64)[rows] * b.astype(np.float64)[:, cols].T
    bound = np.array(
        [_core.stress_gemm_bound(s, n, _core.stress_gemm_input_error(precision)) for s in np.abs(products).sum(1)]
    )
    return int((~(np.abs(c.ravel()[idx].astype(np.float64) - products.sum(1)) <= bound)).sum())


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_gemm_reference_check_counts_as_its_references(dev, precision):
    # A deterministic defect (every GEMM wrong the same way) is invisible to the
    # comparison with the first result; the fp64 check of the first must see it.
    n, samples = 40, 600
    rng = np.random.default_rng(5)
    a, b = rng.random((2, n, n), dtype=np.float32) - 0.5
    ops = (round_bf16(a), round_bf16(b)) if precision == "bf16" else (a, b)
    exact = ops[0].astype(np.float64) @ ops[1].astype(np.float64)
    cpu = _core.make_stress_device("cpu", 0, 1)
    clean = dev.gemm_verify(a, b, exact.astype(np.float32), precision, samples)
    assert clean.checked == samples and clean.mismatches == 0 and clean.nonfinite == 0

    # Sampled elements moved by 3x their bound (wrong) or 0.4x (within it), one NaN.
    idx = sampled(n, samples)
    rows, cols = np.divmod(idx, n)
    abs_sum = np.abs(ops[0].astype(np.float64)[rows] * ops[1].astype(np.float64)[:, cols].T).sum(1)
    bound = np.array([_core.stress_gemm_bound(s, n, _core.stress_gemm_input_error(precision)) for s in abs_sum])
    c = exact.copy().ravel()
    c[idx[0::3]] += 3.0 * bound[0::3]
    c[idx[1::3]] -= 0.4 * bound[1::3]
    c[idx[5]] = np.nan
    c = c.astype(np.float32).reshape(n, n)
    want = host_gemm_check(a, b, c, precision, samples)
    assert want == len(idx[0::3]) + 1
    got = dev.gemm_verify(a, b, c, precision, samples)
    assert (got.mismatches, got.nonfinite) == (want, 1)
    ref = cpu.gemm_verify(a, b, c, precision, samples)
    assert (ref.mismatches, ref.nonfinite) == (want, 1)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_gemm_reference_check_catches_a_flipped_bit_in_a_device_result(dev, precision):
    # The burn's own product, with the top mantissa bit (the burn's fault hook)
    # flipped in its largest sampled element: the flip is the same in every
    # repeat, so only the fp64 check can see it.
    n = 256
    rng = np.random.default_rng(6)
    a, b = rng.random((2, n, n), dtype=np.float32) - 0.5
    ops = (round_bf16(a), round_bf16(b)) if precision == "bf16" else (a, b)
    c = (ops[0].astype(np.float64) @ ops[1].astype(np.float64)).astype(np.float32)
    assert dev.gemm_verify(a, b, c, precision).mismatches == 0
    idx = sampled(n, 4096)
    target = idx[np.argmax(np.abs(c.ravel()[idx]))]
    c.ravel().view(np.uint32)[target] ^= 1 << 22
    assert dev.gemm_verify(a, b, c, precision).mismatches == 1


@pytest.mark.real_gpu("a bandwidth figure: the emulation copies host memory")
def test_copy_reference_bandwidth(dev):
    assert dev.copy_bandwidth(64 << 20) > 1e11  # any data-centre GPU copies > 100 GB/s


@pytest.mark.parametrize("pattern", ["walking_ones", "address", "random"])
def test_memory_patterns_read_back_exactly(dev, pattern):
    assert dev.resize_buffer(64 << 20) == 64 << 20
    m = dev.memory(pattern, 5, 2, False)
    assert m.checked == (64 << 20) // 8 and m.mismatches == 0
    assert dev.memory(pattern, 5, 3, True).mismatches == 1


@pytest.mark.parametrize("words", [1, 2, 3, 6, 7, 1001])
@pytest.mark.parametrize("pattern", ["walking_ones", "address", "random"])
def test_memory_patterns_count_a_flip_in_either_word_of_a_pair(dev, pattern, words):
    # Kernels and references handle words in pairs (one Philox call for two random
    # words): the flipped word, words // 2, is the first or second of its pair or
    # an odd buffer's last word alone, on the GPU and on the CPU reference.
    cpu = _core.make_stress_device("cpu", 0, 1)
    for d in (dev, cpu):
        assert d.resize_buffer(8 * words) == 8 * words
        m = d.memory(pattern, 9, 1, False)
        assert m.checked == words and m.mismatches == 0
        assert d.memory(pattern, 9, 1, True).mismatches == 1, (d.name, words // 2)


def test_gemm_burn_waits_for_the_gpu_once_per_call(dev):
    n, nn = 8, 64
    syncs = lambda: _core.emulation.counters()["host_syncs"] if EMULATED else 0  # noqa: E731
    before = syncs()
    g = dev.gemm(n, 5, 4, 0.0, False)  # the first result, its fp64 check, 4 compared repeats
    assert (g.checked, g.mismatches, g.nonfinite) == (4 * nn + nn, 0, 0)
    assert g.work == 5 * 2 * n**3 and g.seconds > 0
    if EMULATED:
        assert syncs() - before == 1
    # More repeats than the ring of event pairs holds: one wait per ring's worth,
    # and a fault injected into the last repeat (in the second ring) still counts.
    before = syncs()
    g = dev.gemm(n, 70, 4, 0.0, False)
    assert (g.checked, g.mismatches) == (70 * nn, 0) and g.work == 70 * 2 * n**3
    if EMULATED:
        assert syncs() - before == 2
    assert dev.gemm(n, 70, 4, 0.0, True).mismatches == 1


def test_cuda_and_cpu_burns_do_the_same_work(dev):
    cpu = _core.make_stress_device("cpu", 0, 1)
    for d in (dev, cpu):
        c = d.compute(4096, 2, 9, 4096, False)
        assert c.mismatches == 0 and c.work == 4096 * 2 * 10


# `mgpu stress --device cuda` end to end, at sizes small enough for the emulation
# (valid, if light, on a real GPU).
CLI_SMALL = ["--device", "cuda", "--memory-mb", "8", "--compute-size", "16384", "--gemm-size", "64", "--no-progress"]


def stress_cli(tmp_path, *args):
    import json

    from conftest import run_cli  # tests/conftest.py (on sys.path via tests/gpu/conftest.py)

    r = run_cli(["stress", *CLI_SMALL, *args, "--json", tmp_path / "s.json"], timeout=300)
    devices = json.loads((tmp_path / "s.json").read_text())["devices"] if (tmp_path / "s.json").exists() else None
    return r, devices


def test_stress_cli_on_the_gpu_verifies_every_kernel(gpu, tmp_path):
    r, devices = stress_cli(tmp_path, "--duration", "3")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    (dev,) = devices
    assert dev["verdict"] == "OK" and dev["errors"] == {"compute": 0, "gemm": 0, "memory": 0}
    assert dev["nonfinite"] == 0 and dev["injected_fault"] is None
    assert all(dev["runs"][k] > 0 and dev["checked"][k] > 0 for k in ("compute", "gemm", "memory"))
    assert "OK; errors {'compute': 0, 'gemm': 0, 'memory': 0}" in r.stdout
    emulated = bool(_core.build_info().get("gpu_emulation", False))
    assert ("not a real GPU" in r.stdout) == emulated  # the device name says it is emulated


@pytest.mark.parametrize("kernel", ["compute", "gemm", "memory"])
def test_stress_cli_on_the_gpu_catches_an_injected_fault(gpu, tmp_path, kernel):
    r, devices = stress_cli(tmp_path, "--duration", "1", "--kernel", kernel, "--inject-fault", kernel)
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    (dev,) = devices
    assert dev["verdict"] == "FAULTY" and dev["errors"][kernel] >= 1 and dev["injected_fault"] == [kernel]
    assert "FAULTY" in r.stdout
