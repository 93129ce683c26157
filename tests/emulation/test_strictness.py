"""The emulation is stricter than a GPU: each scenario of emulation/selftest.cu
either computes the right answer or is refused with a message that names the
kernel and the rule, where a GPU would hang, crash later or silently compute
garbage."""

import gc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import mgpu
from mgpu import _core


def scenario(name):
    return _core.emulation.selftest(name)


def test_block_reduction_with_barriers_is_exact():
    assert float(scenario("block_sum")) == 256.0
    assert _core.emulation.violations() == []


def test_missing_barriers_give_a_wrong_sum():
    # Threads run as fibers in order: without __syncthreads thread 0 sums
    # shared memory the others have not written yet, every time.
    assert float(scenario("block_sum_without_barriers")) != 256.0


def test_warp_shuffles_reduce_each_warp():
    assert float(scenario("warp_sum")) == 32.0


def test_atomics_from_every_thread_count_once():
    assert int(scenario("atomics")) == 300


@pytest.mark.parametrize(
    "name, words",
    [
        ("divergent_barrier", ["divergent_barrier_kernel", "__syncthreads", "exited"]),
        ("shuffle_names_absent_lane", ["shuffle_kernel", "do not exist"]),
        ("shuffle_names_exited_lane", ["shuffle_kernel", "exited"]),
        ("out_of_bounds_write", ["write_kernel", "out of bounds", "1024"]),
        ("use_after_free", ["write_kernel", "freed"]),
        ("host_pointer_argument", ["write_kernel", "host memory"]),
        ("wrong_memcpy_kind", ["cudaMemcpyHostToDevice", "device memory"]),
        ("too_many_threads", ["write_kernel", "1024"]),
        ("dynamic_shared_over_default", ["dynamic_shared_kernel", "shared memory"]),
        ("race_between_streams", ["race", "write_kernel", "copy_kernel", "no ordering"]),
        ("misaligned_vector_load", ["float4_copy_kernel", "16 bytes", "misaligned"]),
    ],
)
def test_broken_rules_are_reported_by_name(name, words):
    said = scenario(name)
    assert said, f"{name} was accepted"
    for w in words:
        assert w in said, (w, said)


def test_right_mask_and_event_ordering_are_accepted():
    assert scenario("shuffle_half_warp") == ""
    assert scenario("ordered_by_event") == ""
    assert scenario("aligned_vector_load") == ""
    assert _core.emulation.violations() == []


@pytest.mark.parametrize("call, flagged", [("free", True), ("free_async", False)])
def test_device_wide_free_during_an_in_process_collective_is_reported(call, flagged):
    # On a GPU this can deadlock (the collective waits for this thread, cudaFree
    # waits for the collective); stream-ordered frees cannot.
    assert scenario(f"{call}_during_in_process_collective") == ""
    said = [v for v in _core.emulation.violations() if "single-process multi-GPU NCCL" in v]
    if flagged:
        assert said and "cudaFree on GPU 1" in said[0] and "cudaFreeAsync" in said[0], said
    else:
        assert said == []


def test_a_reduce_gives_its_root_what_an_allreduce_gives():
    # Bit for bit (a reduce-scatter built of reduces then equals an allreduce on its
    # parts); a non-root passes no receive buffer, which NCCL ignores.
    assert scenario("reduce_matches_allreduce") == ""
    assert _core.emulation.violations() == []


def test_dynamic_shared_memory_opt_in():
    assert float(scenario("dynamic_shared_opt_in")) == 63.0


def test_capture_refuses_a_synchronisation_and_invalidates():
    during, end = scenario("sync_during_capture").split(" | ")
    assert "not permitted when stream is capturing" in during
    assert "cudaStreamSynchronize" in end and "invalidated" in end.lower() or "previous error" in end


def test_a_captured_graph_replays():
    assert float(scenario("graph_replay")) == 5.0 * 256


def test_emulated_devices_say_so():
    info = _core.build_info()
    assert info["gpu_emulation"] and info["cuda"]["emulated"]
    assert mgpu.gpus_emulated("cuda") and not mgpu.gpus_emulated("cpu")  # what every tool asks
    for d in info["cuda"]["devices"]:
        assert "emulat" in d["name"].lower() and "not a real GPU" in d["name"]


def test_emulated_gpus_are_alike_as_identical_gpus_are():
    # one name for all: topo's medians and the selector's mixed-device rule group by name,
    # and two emulated GPUs were told apart as "unequal devices"
    names = {d["name"] for d in _core.build_info()["cuda"]["devices"]}
    assert len(names) == 1, names


def test_bench_refuses_the_pytorch_peer_on_emulated_gpus():
    from conftest import run_cli  # tests/conftest.py

    r = run_cli(
        ["bench", "--device", "cuda", "--model", "medium", "--batch-sizes", "64", "--steps", "2", "--compare", "torch"]
    )
    assert r.returncode == 2 and "PyTorch cannot run on the GPU emulation" in r.stderr, r.stderr
    assert len([line for line in r.stderr.splitlines() if line.startswith("mgpu: error")]) == 1


def test_info_says_the_gpus_are_emulated():
    from conftest import run_cli  # tests/conftest.py

    r = run_cli(["info"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("GPU EMULATION") and "not real GPUs" in lines[0]
    assert all("EMULATED" in line for line in lines if line.startswith(("CUDA:", "NCCL:", "GPUs:")))


@pytest.mark.parametrize(
    "env, reason",
    [
        ({"MGPU_EMULATE_GPU": "abc"}, "MGPU_EMULATE_GPU='abc' is not a GPU count in 0..64"),
        ({"MGPU_EMULATE_GPU_MEMORY": "lots"}, "MGPU_EMULATE_GPU_MEMORY='lots' is not a size in bytes > 0"),
        ({"MGPU_EMULATE_GPU_MEMORY": "-5"}, "MGPU_EMULATE_GPU_MEMORY='-5' is not a size"),
    ],
)
def test_an_emulation_setting_it_cannot_read_is_no_gpu_and_says_why(env, reason):
    # It was ignored (a default memory size), or --device auto ran on the CPU unsaid.
    from conftest import mpi_env, run_cli  # tests/conftest.py

    env = {**mpi_env(), "MGPU_EMULATE_GPU": "1", **env}
    info = run_cli(["info"], env=env)
    assert info.returncode == 0 and "GPUs:     none visible" in info.stdout and reason in info.stdout, info.stdout
    r = run_cli(["stress", "--duration", "0.2", "--memory-mb", "4", "--no-progress"], env=env)
    assert r.returncode in (0, 4), r.stderr
    assert "mgpu: note: no emulated GPU (" in r.stderr and reason in r.stderr and "runs on the CPU" in r.stderr


@pytest.mark.parametrize(
    "graph, accumulate, precision, layers, batch, placement",
    [
        ("on", 1, "fp32", None, 64, "auto"),
        ("off", 1, "fp32", None, 64, "auto"),
        ("on", 1, "fp32", None, 64, "off"),  # rows copied from the host each step
        ("on", 4, "fp32", None, 64, "auto"),
        ("on", 1, "bf16", None, 64, "auto"),
        ("off", 3, "bf16", "7,5,9,3", 64, "off"),
        ("on", 1, "fp32", "7,40,3", 512, "auto"),
    ],
)  # bias gradients in row splits (two launches each)
def test_bench_reports_the_cuda_work_of_a_step(tmp_path, graph, accumulate, precision, layers, batch, placement):
    # The emulation's counters are the only performance signal without a GPU:
    # `mgpu bench` reports them per steady-state step: no allocation, and one
    # host synchronisation (the read-back of the step's verdict: loss, norm, applied).
    # The analytic cost sheet (`bench --explain`) lists the same launches, GEMM
    # calls, syncs and copied bytes, or it prices a step the code does not run.
    import json
    import subprocess
    import sys

    from conftest import mpi_env  # tests/conftest.py
    from mgpu.calibrate.bench import resolve_layers
    from mgpu.selector import costsheet

    out = tmp_path / "bench.json"
    model = ["--layers", layers] if layers else ["--model", "medium"]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mgpu",
            "bench",
            "--device",
            "cuda",
            *model,
            "--batch-sizes",
            str(batch),
            "--ranks",
            "1",
            "--steps",
            "2",
            "--repeats",
            "1",
            "--warmup",
            "1",
            "--cuda-graph",
            graph,
            "--accumulate",
            str(accumulate),
            "--precision",
            precision,
            "--data-on-device",
            placement,
            "--no-progress",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=mpi_env(),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "GPU EMULATION" in r.stdout and "per step:" in r.stdout
    row = json.loads(out.read_text())["rows"][0]
    counted = row["emulation_counters_per_step"]
    assert counted["allocations"] == 0 and counted["kernels_executed"] > 0
    assert counted["host_syncs"] == 1, counted
    # one replayed graph per micro-batch, or every kernel launched; with graphs on one
    # GPU, the last one holds the tail (health check, verdict, update) too: nothing is
    # launched outside them but each replay's arguments
    assert counted["graph_launches"] == (accumulate if graph == "on" else 0), counted
    assert row["data_on_device"] == (placement == "auto")  # auto: resident on GPUs
    assert (counted["h2d_bytes"] == 0) == row["data_on_device"], counted  # resident: nothing copied in
    gathers = 2 if row["data_on_device"] else 0  # a resident training set's rows: x and y gathered
    if graph == "on":
        assert counted["kernel_launches"] == accumulate * (1 + gathers) and counted["blas_calls"] == 0, counted
    assert row["accumulate"] == accumulate
    sizes, dropout = resolve_layers(
        None if layers else "medium", [int(v) for v in layers.split(",")] if layers else None
    )
    sheet = costsheet.counts(
        costsheet.step_ops(
            costsheet.Workload(
                sizes=sizes,
                batch=batch,
                precision=precision,
                dropout=dropout,
                accumulate=accumulate,
                graph=graph == "on",
                data_on_device=row["data_on_device"],
            )
        )
    )
    assert {k: counted[k] for k in sheet} == sheet


def test_stress_defaults_scale_down_on_the_emulation(tmp_path):
    # `mgpu stress --device cuda` with no sizes: GPU-sized defaults would run for
    # hours on the emulation; scaled down, it ends cleanly well within a minute
    # and says why its sizes are not the documented defaults.
    import json
    import subprocess
    import sys
    import time

    from conftest import mpi_env  # tests/conftest.py

    t0 = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mgpu",
            "stress",
            "--device",
            "cuda",
            "--no-progress",
            "--json",
            str(tmp_path / "s.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=mpi_env(),
    )
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "GPU EMULATION" in r.stdout and "defaults scaled down to --duration 10" in r.stdout
    assert "--memory-mb 8" in r.stdout and "--gemm-size 64" in r.stdout
    (dev,) = json.loads((tmp_path / "s.json").read_text())["devices"]
    assert dev["verdict"] == "OK" and dev["buffer_bytes"] <= 8 << 20
    assert elapsed < 45, elapsed


def test_device_timers_time_back_to_back_calls_between_waits():
    # A step waits once, not after every kernel: topo's device timers share one wait
    # among the calls of a sample (a wait per call priced its latency into every kernel).
    be = _core.make_backend("cuda", 0, 1)
    repeats = 4
    before = _core.emulation.counters()
    samples = _core.time_axpy(be, 1, repeats)
    after = _core.emulation.counters()
    launched = {k: after[k] - before[k] for k in ("kernel_launches", "host_syncs")}
    assert len(samples) == repeats and all(t > 0 for t in samples)
    assert launched["host_syncs"] == repeats + 2  # after the warm-up, the sizing call and each sample
    assert launched["kernel_launches"] >= 2 + 2 * repeats + 2, launched  # zeros, warm-up, sizing, >= 2 a sample
    # The graph-node timer's replays go back to back too, and it releases its graph.
    before = _core.emulation.counters()
    _core.time_graph_replay(be, 8, repeats)
    after = _core.emulation.counters()
    assert after["graph_launches"] - before["graph_launches"] >= 2 + repeats  # warm-up, sizing, the samples
    assert after["host_syncs"] - before["host_syncs"] <= repeats + 4  # + before the capture and at the release


@pytest.mark.parametrize(
    "call, issued",
    [
        ("reduce_scatter_sum", "reduce float32 sum root {r} x{n}"),
        ("all_gather", "broadcast float32 root {r} x{n}"),
    ],
)
def test_ranks_cutting_a_range_into_different_parts_are_a_mismatch(call, issued):
    # Every rank must pass the same parts. Here thread 0 cuts 8 elements 3 + 5 and
    # thread 1 4 + 4: on NCCL their per-part calls would pair up wrongly (a hang or
    # wrong values); the emulation compares the groups and names both ranks' calls.
    comms = _core.nccl_init_all([0, 1])
    parts = {0: [3, 5], 1: [4, 4]}

    def run(comm):
        comm.timeout = 30.0
        try:  # (not pytest.raises: its traceback would keep `comm` alive past the test)
            getattr(comm, call)(np.ones(8, np.float32), parts[comm.rank])
        except _core.CommError as e:
            return str(e)
        return "no CommError"

    with ThreadPoolExecutor(2) as pool:
        said = list(pool.map(run, comms))
    # Destroyed now, not by a later garbage collection while another test's collectives
    # run (a device-wide cudaFreeHost then, which the emulation reports).
    del comms
    gc.collect()
    for rank, text in enumerate(said):
        assert f"on rank {rank} (emulated GPU {rank})" in text and "NCCL calls differ between ranks" in text, text
        for r, cut in parts.items():
            calls = ", ".join(issued.format(r=owner, n=n) for owner, n in enumerate(cut))
            assert f"rank {r} issued group of 2: [{calls}]" in text, text
    assert any("NCCL calls differ between ranks" in v for v in _core.emulation.violations())
