"""CUDA stress kernels (kernels/stress.cu) against the CPU StressDevice: clean runs
verify with zero mismatches, an injected bit flip is caught in every kernel, and the
GEMM burn runs near the plain cuBLAS rate (reported, not asserted: that is a benchmark)."""
import pytest

from mgpu import _core


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
    assert g.checked == 3 * 512 * 512 and g.mismatches == 0 and g.nonfinite == 0
    assert dev.gemm(512, 3, 1, 1e-3, True, precision).mismatches == 1


@pytest.mark.real_gpu("a bandwidth figure: the emulation copies host memory")
def test_copy_reference_bandwidth(dev):
    assert dev.copy_bandwidth(64 << 20) > 1e11  # any data-centre GPU copies > 100 GB/s


@pytest.mark.parametrize("pattern", ["walking_ones", "address", "random"])
def test_memory_patterns_read_back_exactly(dev, pattern):
    assert dev.resize_buffer(64 << 20) == 64 << 20
    m = dev.memory(pattern, 5, 2, False)
    assert m.checked == (64 << 20) // 8 and m.mismatches == 0
    assert dev.memory(pattern, 5, 3, True).mismatches == 1


def test_cuda_and_cpu_burns_do_the_same_work(dev):
    cpu = _core.make_stress_device("cpu", 0, 1)
    for d in (dev, cpu):
        c = d.compute(4096, 2, 9, 4096, False)
        assert c.mismatches == 0 and c.work == 4096 * 2 * 10
