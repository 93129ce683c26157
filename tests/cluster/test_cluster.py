"""mgpu across several hosts: virtual hosts (network namespaces with their own hostname,
address and local disk; vcluster.py) joined by mpirun over TCP.

Node awareness (local rank and size, the device each rank picks, 2 hosts x 2 ranks
equal to 1 rank, checkpoints written and read by rank 0 alone) and network faults (a
cut link, a partition while a checkpoint is written, a slow and lossy link, a frozen
host, a killed host): every surviving rank must exit within --watchdog-timeout + 10 s
naming the unreachable ranks and host, and every checkpoint left must verify. Each
fault test prints its measured times (pytest -s shows them)."""

import json
import re
import signal
import time

import numpy as np
import pytest

from clusterrun import ClusterRun, ended
from conftest import run_cli  # tests/conftest.py
from mgpu.train.checkpoint import list_checkpoints, load_checkpoint
from procs import wait_for  # tests/procs.py

MGPU = ["-m", "mgpu"]
LAYERS = (50, 64, 3)
TRAIN = [
    "train",
    "--layers",
    ",".join(map(str, LAYERS)),
    "--batch-size",
    "37",
    "--optimizer",
    "adamw",
    "--dropout",
    "0.1",
    "--no-progress",
    "--seed",
    "3",
]
# A few ms a step on 4 ranks here: long-running, so a fault lands mid-step.
LONG = [
    "train",
    "--layers",
    "50,512,512,3",
    "--batch-size",
    "128",
    "--no-progress",
    "--steps",
    "1000000",
    "--checkpoint-every",
    "10",
]
WATCHDOG = 3
GRACE = 10  # the goal: every surviving rank exits within --watchdog-timeout + GRACE s


def params_of(path):
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def assert_close(a, b, rel=1e-5):
    for k in a:  # same samples, same global batch: equal within float32 rounding
        assert np.linalg.norm(a[k] - b[k]) <= rel * np.linalg.norm(a[k]), k


PROBE = """
import json, socket, sys
from mpi4py import MPI
import mgpu
from mgpu import ProcessGroup
pg = ProcessGroup()
dev = pg.resolve_device("auto")
# a file per rank: the ranks' stdout lines can interleave on their way to mpirun
open(f"{sys.argv[1]}/probe-{pg.rank}.json", "w").write(json.dumps({"rank": pg.rank, "host": socket.gethostname(),
      "processor": MPI.Get_processor_name(),
      "local_rank": pg.local_rank, "local_size": pg.local_size, "device": dev, "threads": pg.default_threads(),
      "cores": mgpu.build_info()["cpu_threads_available"],
      "hosts": pg.hosts}))
"""


@pytest.mark.parametrize("gpus_per_host", [0, 2])
def test_node_local_rank_and_device_on_each_host(cluster, tmp_path, gpus_per_host):
    """4 ranks on 2 hosts: each host numbers its own ranks 0, 1; with 2 (emulated) GPUs per
    host each rank takes the GPU of its local rank, so the hosts' GPU 0 and 1 are both used."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    run = ClusterRun(cluster, 4, [script, tmp_path], tmp_path, emulate_gpu=gpus_per_host or None)
    assert run.wait(120) == 0, run.stderr[-3000:]
    seen = sorted((json.loads(p.read_text()) for p in tmp_path.glob("probe-*.json")), key=lambda p: p["rank"])
    assert [p["rank"] for p in seen] == [0, 1, 2, 3], run.stdout
    hosts = [cluster.hostname(i) for i in (0, 0, 1, 1)]
    assert [p["host"] for p in seen] == hosts and [p["processor"] for p in seen] == hosts
    assert all(p["hosts"] == hosts for p in seen)
    assert [(p["local_rank"], p["local_size"]) for p in seen] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    expected = [["cuda", r] for r in (0, 1, 0, 1)] if gpus_per_host else [["cpu", 0]] * 4
    assert [p["device"] for p in seen] == expected
    assert all(p["threads"] == max(1, p["cores"] // 2) for p in seen)  # the node's cores shared by its 2 ranks


def test_two_hosts_equal_one_rank_and_only_rank_0_touches_checkpoints(cluster, tmp_path):
    """2 hosts x 2 ranks reproduce 1 rank; checkpoints land on host 0's disk only, and a
    resume works although host 1's disk holds no checkpoint (rank 0 reads and broadcasts)."""
    one = run_cli([*TRAIN, "--steps", 24, "--save", tmp_path / "one.npz"])
    assert one.returncode == 0, one.stderr
    ckpt = cluster.disk / "ckpt"  # the same path on every host, a different disk on each
    first = ClusterRun(
        cluster,
        4,
        [
            *MGPU,
            *TRAIN,
            "--steps",
            12,
            "--checkpoint-dir",
            ckpt,
            "--checkpoint-every",
            6,
            "--save",
            tmp_path / "first.npz",
        ],
        tmp_path,
        "first",
    )
    assert first.wait(120) == 0, first.stderr[-3000:]
    on_host0 = list_checkpoints(str(cluster.host_disk(0) / "ckpt"))
    assert [p.rsplit("/", 1)[1] for p in on_host0] == ["ckpt-000000006.npz", "ckpt-000000012.npz"]
    assert list_checkpoints(str(cluster.host_disk(1) / "ckpt")) == [], "a rank on host 1 wrote a checkpoint"
    resumed = ClusterRun(
        cluster,
        4,
        [*MGPU, *TRAIN, "--steps", 24, "--checkpoint-dir", ckpt, "--resume", "--save", tmp_path / "resumed.npz"],
        tmp_path,
        "resumed",
    )
    assert resumed.wait(120) == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "ckpt-000000012.npz" in resumed.stdout
    assert list_checkpoints(str(cluster.host_disk(1) / "ckpt")) == []
    mid = run_cli([*TRAIN, "--steps", 12, "--save", tmp_path / "mid.npz"])
    assert mid.returncode == 0, mid.stderr
    assert_close(params_of(tmp_path / "mid.npz"), params_of(tmp_path / "first.npz"))
    assert_close(params_of(tmp_path / "one.npz"), params_of(tmp_path / "resumed.npz"))


def test_topo_measures_the_links_within_and_between_hosts_apart(cluster, tmp_path):
    """topo on 2 hosts x 2 ranks: besides the whole world's sweep, one within each host
    (both hosts at once) and one between the hosts (a rank each), both bit exact, fitted
    apart and handed to the selector as its two-level link (recommend --nodes)."""
    out = tmp_path / "profile.json"
    run = ClusterRun(cluster, 4, [*MGPU, "topo", "--quick", "--max-mb", "1", "--out", out], tmp_path, "topo")
    assert run.wait(300) == 0, run.stderr[-3000:]
    profile = json.loads(out.read_text())
    levels = profile["nodes"]
    assert levels["nodes"] == 2 and levels["ranks_per_node"] == 2 and profile["gpus_per_node"] == 2
    for level in ("intra", "inter"):
        rows = levels[f"{level}_allreduce"]
        assert rows and rows[-1]["bytes"] == 1 << 20 and all(r["wrong"] == 0 for r in rows)
        assert levels[level]["bus_bandwidth"] > 0 and levels[level]["alpha_s"] >= 0
    # (no claim on which level is faster: 4 ranks on this machine's 2 cores time the
    # within-host sweep oversubscribed, the between-host one with the other ranks asleep)
    nccl = profile["link"]["nccl"]
    assert nccl["gpus_per_node"] == 2
    assert nccl["intra"]["ring_busbw"] == levels["intra"]["bus_bandwidth"]
    assert nccl["inter"]["ring_busbw"] == levels["inter"]["bus_bandwidth"]
    assert "between the nodes (one rank each)" in run.stdout and "within each node" in run.stdout
    r = run_cli(["recommend", "--layers", "50,256,256,3", "--batch-size", "256", "--profile", out, "--nodes", "2"])
    assert r.returncode == 0, r.stderr
    assert "4" in r.stdout  # 2 nodes x 2 ranks among the candidates


# --- faults -------------------------------------------------------------------------------
class Fault:
    """A long 2x2 run checkpointing every 10 steps to host 0's disk; `inject` happens after
    the first checkpoint (or when `when` says). Measures each rank's time to exit."""

    def __init__(
        self, cluster, tmp_path, watchdog=WATCHDOG, args=LONG, name="fault", emulate_gpu=None, np=4, per_host=None
    ):
        self.cluster, self.watchdog = cluster, watchdog
        self.ckpt = cluster.host_disk(0) / "ckpt"
        self.run = ClusterRun(
            cluster,
            np,
            [*MGPU, *args, "--checkpoint-dir", cluster.disk / "ckpt", "--watchdog-timeout", watchdog],
            tmp_path,
            name,
            emulate_gpu,
            per_host,
        )

    def start(self, when=None):
        when = when or (lambda: list_checkpoints(str(self.ckpt)))
        wait_for(lambda: when() or self.run.job.proc.poll() is not None, 180, "the fault's moment")
        assert self.run.job.proc.poll() is None, self.run.stderr[-3000:]
        self.ranks = {}
        for i in range(self.cluster.hosts):
            self.ranks.update({r: (i, pid) for r, pid in self.cluster.rank_pids(i).items()})
        assert len(self.ranks) >= 2, self.ranks

    def measure(self, survivors, limit):
        """Seconds from now (the fault) until each rank in `survivors` and mpirun exit
        (None: still running after `limit` s)."""
        t0 = time.monotonic()
        times = {}
        while time.monotonic() - t0 < limit:
            for r in survivors:
                if r not in times and ended(self.ranks[r][1]):
                    times[r] = time.monotonic() - t0
            if "mpirun" not in times and self.run.job.proc.poll() is not None:
                times["mpirun"] = time.monotonic() - t0
            if len(times) == len(survivors) + 1:
                break
            time.sleep(0.01)
        return times

    def check_checkpoints(self):
        kept = list_checkpoints(str(self.ckpt))
        assert kept, "no checkpoint left"
        for path in kept:
            load_checkpoint(path)  # verifies every array's SHA-256
        assert not [p for p in self.ckpt.iterdir() if p.name.startswith(".tmp")], "a partial checkpoint was left"
        assert list_checkpoints(str(self.cluster.host_disk(1) / "ckpt")) == []
        return kept


def host_named(stderr, host):
    """The watchdog's line naming `host` as unreachable, from a rank on another host."""
    return re.search(
        rf"mgpu: error: \w+ at step \d+ did not complete within {WATCHDOG} s on rank \d \(mgpu-h0\): "
        rf"[^\n]*rank[^\n]*\({host}\)[^\n]*; every rank on {host} is named: suspect that host",
        stderr,
    )


def report(what, times):
    print(
        f"\n{what}: "
        + ", ".join(
            f"{k if k == 'mpirun' else f'rank {k}'} exited after {v:.2f} s"
            for k, v in sorted(times.items(), key=lambda kv: str(kv[0]))
        )
    )


def test_cut_link_ends_every_rank_within_the_watchdog(cluster, tmp_path):
    f = Fault(cluster, tmp_path)
    f.start()
    cluster.link_down(1)
    times = f.measure([0, 1, 2, 3], WATCHDOG + GRACE + 30)
    report("link of mgpu-h1 cut", times)
    for r in (0, 1, 2, 3):  # both sides of the cut time out and abort
        assert times.get(r, 1e9) <= WATCHDOG + GRACE, (r, times, f.run.stderr[-3000:])
    assert host_named(f.run.stderr, "mgpu-h1"), f.run.stderr[-3000:]
    assert "mpirun" in times, f"mpirun still running {WATCHDOG + GRACE + 30} s after the cut"
    assert f.run.job.returncode != 0 and "Traceback" not in f.run.stderr
    f.check_checkpoints()


def test_frozen_host_is_named_and_the_others_exit(cluster, tmp_path):
    f = Fault(cluster, tmp_path)
    f.start()
    assert cluster.signal_host(1, signal.SIGSTOP) >= 3  # its daemon and both ranks
    times = f.measure([0, 1], WATCHDOG + GRACE)
    for r in (0, 1):
        assert times.get(r, 1e9) <= WATCHDOG + GRACE, (r, times, f.run.stderr[-3000:])
    assert host_named(f.run.stderr, "mgpu-h1"), f.run.stderr[-3000:]
    # mpirun waits for the frozen host's daemon (OpenMPI has no daemon heartbeat): thawed,
    # that host learns of the abort and the job ends.
    waited = "mpirun" not in times
    cluster.signal_host(1, signal.SIGCONT)
    thawed = time.monotonic()
    assert f.run.job.wait(30) is not None, "mpirun did not end after the frozen host was thawed"
    report("mgpu-h1 frozen (SIGSTOP)", times)
    print(
        f"mpirun {'waited for the frozen host; ended' if waited else 'ended'} "
        f"{time.monotonic() - thawed:.2f} s after SIGCONT"
    )
    assert f.run.job.returncode != 0 and "Traceback" not in f.run.stderr
    f.check_checkpoints()


def test_killed_host_ends_the_job(cluster, tmp_path):
    f = Fault(cluster, tmp_path)
    f.start()
    cluster.signal_host(1, signal.SIGKILL)
    times = f.measure([0, 1], WATCHDOG + GRACE)
    report("mgpu-h1 killed (SIGKILL)", times)
    for r in (0, 1):
        assert times.get(r, 1e9) <= WATCHDOG + GRACE, (r, times, f.run.stderr[-3000:])
    assert f.run.job.wait(30) is not None and f.run.job.returncode != 0
    # mpirun sees the daemon's connection drop and names the host (before any watchdog)
    assert re.search(r"lost communication with a remote daemon|mgpu-h1|10\.213\.0\.2", f.run.stderr), f.run.stderr
    f.check_checkpoints()


@pytest.mark.cluster_slow
def test_partition_while_a_checkpoint_is_written(cluster, tmp_path):
    """The link is cut while rank 0 writes a checkpoint (its temporary file exists): that
    checkpoint completes or is absent, never partial, and every earlier one verifies."""
    big = [
        "train",
        "--layers",
        "50,1536,1536,3",
        "--batch-size",
        "64",
        "--optimizer",
        "adamw",
        "--no-progress",
        "--steps",
        "1000000",
        "--checkpoint-every",
        "5",
        "--keep-checkpoints",
        "100",
    ]
    f = Fault(cluster, tmp_path, args=big)
    f.start(lambda: list_checkpoints(str(f.ckpt)) and any(p.name.startswith(".tmp") for p in f.ckpt.iterdir()))
    writing = [p.name for p in f.ckpt.iterdir() if p.name.startswith(".tmp")]
    cluster.link_down(1)
    times = f.measure([0, 1, 2, 3], WATCHDOG + GRACE + 30)
    report(f"partition while {writing} was written", times)
    for r in (0, 1, 2, 3):
        assert times.get(r, 1e9) <= WATCHDOG + GRACE, (r, times, f.run.stderr[-3000:])
    assert re.search(r"on rank [01] \(mgpu-h0\): .*\(mgpu-h1\)", f.run.stderr), f.run.stderr[-3000:]
    assert len(f.check_checkpoints()) >= 2


@pytest.mark.cluster_slow
def test_slow_lossy_link_slows_the_job_and_changes_nothing(cluster, tmp_path):
    steps = 8
    args = [*MGPU, *TRAIN, "--steps", steps, "--watchdog-timeout", 60]
    clean = ClusterRun(
        cluster, 4, [*args, "--save", tmp_path / "clean.npz", "--json", tmp_path / "clean.json"], tmp_path, "clean"
    )
    assert clean.wait(120) == 0, clean.stderr[-3000:]
    how, rate = cluster.slow_lossy_link(1)
    t0 = time.monotonic()
    slow = ClusterRun(
        cluster, 4, [*args, "--save", tmp_path / "slow.npz", "--json", tmp_path / "slow.json"], tmp_path, "slow"
    )
    assert slow.wait(300) == 0, slow.stderr[-3000:]
    wall = time.monotonic() - t0
    seconds = {
        n: sum(e["seconds"] for e in json.loads((tmp_path / f"{n}.json").read_text())["history"])
        for n in ("clean", "slow")
    }
    print(
        f"\n{how} on mgpu-h1's link: {steps} steps took {seconds['slow']:.2f} s "
        f"(clean {seconds['clean']:.2f} s); job {wall:.1f} s"
    )
    # Every step's allreduce crosses the link at least once each way (>= 0.4 s a step with
    # 200 ms each way), and at least host 1's partial sum of the gradients (4 bytes a
    # parameter) crosses it at `rate`.
    params = sum(a * b + b for a, b in zip(LAYERS, LAYERS[1:]))
    floor = steps * (0.4 if rate is None else params * 4 / rate)
    assert seconds["slow"] >= floor > seconds["clean"], (floor, seconds)
    a, b = params_of(tmp_path / "clean.npz"), params_of(tmp_path / "slow.npz")
    assert all(np.array_equal(a[k], b[k]) for k in a), "a slow link changed the result"


@pytest.mark.cluster_slow
@pytest.mark.parametrize("fault", ["freeze", "cut"])
def test_emulated_gpus_across_hosts(cluster, tmp_path, fault):
    """One emulated GPU per host, NCCL's stand-in across the link: training matches 1 rank,
    and a frozen host or cut link ends the other within the watchdog, named."""
    if fault == "freeze":
        one = run_cli([*TRAIN, "--steps", 6, "--save", tmp_path / "one.npz"])
        assert one.returncode == 0, one.stderr
        ok = ClusterRun(
            cluster,
            2,
            [*MGPU, *TRAIN, "--steps", 6, "--device", "cuda", "--comm", "nccl", "--save", tmp_path / "two.npz"],
            tmp_path,
            "ok",
            emulate_gpu=1,
            per_host=1,
        )
        assert ok.wait(300) == 0, ok.stderr[-3000:]
        assert "nccl allreduce" in ok.stdout, ok.stdout
        assert_close(params_of(tmp_path / "one.npz"), params_of(tmp_path / "two.npz"), rel=1e-4)
    gpu = [
        "train",
        "--layers",
        "16,32,3",
        "--batch-size",
        "16",
        "--no-progress",
        "--steps",
        "1000000",
        "--checkpoint-every",
        "5",
        "--device",
        "cuda",
        "--comm",
        "nccl",
    ]
    f = Fault(cluster, tmp_path, args=gpu, emulate_gpu=1, np=2, per_host=1)
    f.start()
    if fault == "freeze":
        cluster.signal_host(1, signal.SIGSTOP)
    else:
        cluster.link_down(1)
    times = f.measure([0], WATCHDOG + GRACE)
    report(f"emulated GPUs, mgpu-h1 {fault}", times)
    cluster.signal_host(1, signal.SIGCONT)
    assert times.get(0, 1e9) <= WATCHDOG + GRACE, (times, f.run.stderr[-3000:])
    assert re.search(r"on rank 0 \(mgpu-h0\) \(emulated GPU 0\): .*rank 1 \(mgpu-h1\)", f.run.stderr), f.run.stderr[
        -3000:
    ]
    f.check_checkpoints()
