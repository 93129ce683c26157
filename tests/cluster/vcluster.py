"""A virtual cluster on one machine: K hosts as network namespaces, for multi-node tests.

Each host is a network namespace with its own address (10.213.0.<i+1>/24 on a veth
to a bridge in a "switch" namespace), its own hostname (a UTS namespace made at each
entry) and its own local disk (a per-host directory bound over one path in a private
mount namespace, so `<workdir>/disk` is a different directory on every host, as a
node-local disk is). mpirun runs on host 0 and starts the others' daemons through an
rsh agent that enters their namespaces with a clean environment (what ssh gives), so
only what `-x` forwards reaches a remote rank. Nothing of the machine's own network is
touched: every address, link and namespace here is created by this module and removed
by close() (also at exit, and by the sweep of namespaces whose owner pid is dead).

Needs root, iproute2 (ip, tc) and util-linux (unshare). Run by hand:
    python tests/cluster/vcluster.py --hosts 2 -- mpirun -np 4 python -m mgpu info
(scripts/cluster.sh wraps it; docs/several-nodes.md).
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/procs.py, also when run as a script
from procs import mpi_ranks  # noqa: E402

PREFIX = "mgpuc"  # namespace names: mgpuc<owner pid>-h<i>, mgpuc<owner pid>-sw
SUBNET = "10.213.0"
NETMASK = 24
_NS = re.compile(rf"^{PREFIX}(\d+)-(h\d+|sw)\b")
# OpenMPI across the hosts: TCP between hosts, shared memory within one, our subnet
# only, no tree spawn (every daemon started from host 0), and a daemon whose link to
# mpirun is cut notices within ~10 s (TCP keepalive) instead of the default ~8 min.
MCA = {
    "btl": "tcp,vader,self",
    "btl_tcp_if_include": f"{SUBNET}.0/{NETMASK}",
    "oob_tcp_if_include": f"{SUBNET}.0/{NETMASK}",
    "plm_rsh_no_tree_spawn": "1",
    "oob_tcp_keepalive_time": "2",
    "oob_tcp_keepalive_intvl": "2",
    "oob_tcp_keepalive_probes": "3",
}
TCP_RETRIES2 = 4
# What a remote host's shell starts with (ssh gives a clean environment).
REMOTE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ClusterError(RuntimeError):
    """The virtual cluster cannot be made here (not root, no iproute2, no namespaces)."""


def _run(*cmd, check=True):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise ClusterError(f"`{shlex.join(map(str, cmd))}` failed: {r.stderr.strip() or r.returncode}")
    return r


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _our_namespaces() -> list:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line and _NS.match(line.split()[0])]


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process in namespace `ns` (SIGCONT first: a stopped one must die too)."""
    for _ in range(20):
        pids = [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        time.sleep(0.05)


def sweep_stale() -> list:
    """Remove namespaces of earlier clusters whose owner process is gone (a crash, a
    SIGKILLed pytest). Returns the names removed."""
    removed = []
    for ns in _our_namespaces():
        owner = int(_NS.match(ns).group(1))
        if owner != os.getpid() and not _alive(owner):
            _kill_namespace_processes(ns)
            _run("ip", "netns", "delete", ns, check=False)
            removed.append(ns)
    return removed


def check_possible() -> None:
    """ClusterError with the reason when namespaces cannot be made here."""
    if os.geteuid() != 0:
        raise ClusterError("the virtual cluster needs root (network namespaces, veth links)")
    for tool in ("ip", "tc", "unshare", "mpirun"):
        if shutil.which(tool) is None:
            raise ClusterError(f"`{tool}` not found (apt-get install iproute2 util-linux openmpi-bin)")


class Cluster:
    """K virtual hosts; use as a context manager (close() also runs at exit)."""

    def __init__(self, hosts: int = 2, slots: int = 2, workdir=None):
        check_possible()
        if not 1 <= hosts <= 200:
            raise ClusterError(f"hosts must be 1..200, got {hosts}")
        self.hosts, self.slots = hosts, slots
        self.owner = os.getpid()
        self.prefix = f"{PREFIX}{self.owner}"
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"mgpu-cluster-{self.owner}-"))
        self.disk = self.workdir / "disk"  # each host's private local disk is mounted here
        self.agent = self.workdir / "rsh-agent"
        self.hostfile = self.workdir / "hostfile"
        self._closed = False
        self._jobs = []
        sweep_stale()
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    # --- names ------------------------------------------------------------------
    def ns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def hostname(self, i: int) -> str:
        return f"mgpu-h{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def link(self, i: int) -> str:
        """Host i's interface (in its namespace); at most 15 characters, as Linux wants."""
        return f"mc{self.owner}h{i}"[:15]

    def host_disk(self, i: int) -> Path:
        return self.workdir / f"h{i}" / "disk"

    # --- making and removing ------------------------------------------------------
    def _create(self) -> None:
        sw = f"{self.prefix}-sw"
        if len(self.link(self.hosts - 1)) > 15 or f"mc{self.owner}h" != self.link(0)[:-1]:
            raise ClusterError(f"pid {self.owner} too long for interface names")
        _run("ip", "netns", "add", sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for i in range(self.hosts):
            ns = self.ns(i)
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", self.link(i), "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", sw)
            _run("ip", "-n", sw, "link", "set", f"p{i}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/{NETMASK}", "dev", self.link(i))
            _run("ip", "-n", ns, "link", "set", self.link(i), "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # TCP gives up on an unanswered peer after ~6 s instead of ~15 min (per namespace), so
            # mpirun notices a daemon behind a cut link; a cluster tuned for failover does the same.
            _run("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.tcp_retries2={TCP_RETRIES2}")
            self.host_disk(i).mkdir(parents=True, exist_ok=True)
        self.disk.mkdir(exist_ok=True)
        self.hostfile.write_text("".join(f"{self.address(i)} slots={self.slots}\n" for i in range(self.hosts)))
        cases = "\n".join(f"  {self.address(i)}|{self.hostname(i)}) i={i} ;;" for i in range(self.hosts))
        self.agent.write_text(f"""#!/bin/sh
# OpenMPI's rsh agent for this virtual cluster (written by tests/cluster/vcluster.py):
# "ssh HOST COMMAND..." enters HOST's namespaces and runs COMMAND with a clean environment.
host=$1; shift
case "$host" in
{cases}
  *) echo "rsh-agent: unknown host '$host'" >&2; exit 255 ;;
esac
exec ip netns exec {self.prefix}-h$i unshare --uts --mount --propagation private \\
  sh -c 'hostname "$1" && mount --bind "$2" "$3" && shift 3 && exec env -i PATH={REMOTE_PATH} HOME=/root sh -c "$*"' \\
  sh mgpu-h$i {self.workdir}/h$i/disk {self.disk} "$@"
""")
        self.agent.chmod(0o755)

    def close(self) -> None:
        """Kill everything running on the hosts, delete the namespaces (and with them the
        links), and remove the work directory when this cluster made it. Idempotent."""
        if self._closed or os.getpid() != self.owner:
            return
        self._closed = True
        for job in self._jobs:
            job.kill()
        for ns in [self.ns(i) for i in range(self.hosts)] + [f"{self.prefix}-sw"]:
            _kill_namespace_processes(ns)
            _run("ip", "netns", "delete", ns, check=False)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        atexit.unregister(self.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # --- running --------------------------------------------------------------------
    def enter(self, i: int, env_clean: bool = False) -> list:
        """The command prefix that runs a command on host i (its network, hostname and disk)."""
        clean = f"env -i PATH={REMOTE_PATH} HOME=/root " if env_clean else ""
        return [
            "ip",
            "netns",
            "exec",
            self.ns(i),
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'hostname "$1" && mount --bind "$2" "$3" && shift 3 && exec {clean}"$@"',
            "sh",
            self.hostname(i),
            str(self.host_disk(i)),
            str(self.disk),
        ]

    def mpirun_args(self, np: int, export=(), extra_mca=None, per_host=None) -> list:
        """`mpirun` over every host (np ranks, filled host by host, or per_host on each),
        exporting the names in `export`."""
        mca = dict(MCA, plm_rsh_agent=str(self.agent), **(extra_mca or {}))
        args = ["mpirun", "-np", str(np), "--hostfile", str(self.hostfile), "--bind-to", "none"]
        if per_host:
            args += ["--npernode", str(per_host)]
        for k, v in mca.items():
            args += ["--mca", k, v]
        for name in export:
            args += ["-x", name]
        return args

    def run(self, cmd, host: int = 0, timeout: float = 300, env=None, **kw):
        """Run cmd on host `host`, wait (killing the namespaces' processes on timeout)."""
        job = self.start(cmd, host=host, env=env, **kw)
        try:
            job.wait(timeout)
        finally:
            job.kill()
        return job

    def start(self, cmd, host: int = 0, env=None, stdout=None, stderr=None, cwd=None) -> "Job":
        job = Job(self, [*self.enter(host), *map(str, cmd)], env=env, stdout=stdout, stderr=stderr, cwd=cwd)
        self._jobs.append(job)
        return job

    def pids(self, i: int) -> list:
        return [int(p) for p in _run("ip", "netns", "pids", self.ns(i), check=False).stdout.split()]

    def rank_pids(self, i: int) -> dict:
        """rank -> pid of the MPI ranks running on host i."""
        return mpi_ranks(self.pids(i))

    # --- faults ------------------------------------------------------------------------
    def link_down(self, i: int) -> None:
        _run("ip", "-n", self.ns(i), "link", "set", self.link(i), "down")

    def link_up(self, i: int) -> None:
        _run("ip", "-n", self.ns(i), "link", "set", self.link(i), "up")

    def netem(self, i: int, spec: str) -> None:
        """Shape host i's outgoing traffic, e.g. "delay 200ms loss 5%" (tc netem)."""
        _run("tc", "-n", self.ns(i), "qdisc", "replace", "dev", self.link(i), "root", "netem", *spec.split())

    def netem_peer(self, i: int, spec: str) -> None:
        """The same on the switch's end of host i's link (its incoming traffic)."""
        _run("tc", "-n", f"{self.prefix}-sw", "qdisc", "replace", "dev", f"p{i}", "root", "netem", *spec.split())

    def slow_lossy_link(self, i: int):
        """Make host i's link slow and lossy both ways. With netem (most kernels, module
        sch_netem): 200 ms delay and 5 % loss; returns (description, None). Kernels built
        without netem get what they have: a 1 Mbit/s token bucket (tbf) and 5 % of
        packets dropped by nftables; returns (description, rate in bytes/s)."""
        try:
            self.netem(i, "delay 200ms loss 5%")
            self.netem_peer(i, "delay 200ms loss 5%")
            return "netem delay 200ms loss 5% both ways", None
        except ClusterError as e:
            if "qdisc kind is unknown" not in str(e):
                raise
        if shutil.which("nft") is None:
            raise ClusterError(
                "this kernel has no netem and `nft` is missing for the fallback (apt-get install nftables)"
            )
        for ns, dev in ((self.ns(i), self.link(i)), (f"{self.prefix}-sw", f"p{i}")):
            _run(
                "tc",
                "-n",
                ns,
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                "1mbit",
                "burst",
                "4kb",
                "latency",
                "2s",
            )
        _run(
            "ip",
            "netns",
            "exec",
            self.ns(i),
            "nft",
            "add table inet mgpu; add chain inet mgpu out { type filter hook output priority 0; }; "
            f"add rule inet mgpu out oifname {self.link(i)} numgen random mod 100 < 5 drop; "
            "add chain inet mgpu in { type filter hook input priority 0; }; "
            f"add rule inet mgpu in iifname {self.link(i)} numgen random mod 100 < 5 drop",
        )
        return "no netem in this kernel: tbf 1mbit + nftables 5% loss both ways", 1e6 / 8

    def signal_host(self, i: int, sig) -> int:
        """Send sig to every process on host i (its daemon and ranks); returns how many."""
        pids = self.pids(i)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return len(pids)


class Job:
    """A command started on a host, in its own session, with captured output."""

    def __init__(self, cluster, cmd, env=None, stdout=None, stderr=None, cwd=None):
        self.cluster = cluster
        self.out_path = stdout or tempfile.mktemp(prefix="job-", suffix=".out", dir=cluster.workdir)
        self.err_path = stderr or str(self.out_path) + ".err"
        with open(self.out_path, "w") as o, open(self.err_path, "w") as e:
            self.proc = subprocess.Popen(cmd, stdout=o, stderr=e, env=env, cwd=cwd, start_new_session=True)
        self.started = time.monotonic()

    def wait(self, timeout):
        """The exit code, or None if it ran past `timeout` seconds (then still running)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self):
        """End the job's process group and whatever it started on any host."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        for i in range(self.cluster.hosts):  # remote daemons and ranks are not in our session
            _kill_namespace_processes(self.cluster.ns(i))

    @property
    def returncode(self):
        return self.proc.returncode

    @property
    def stdout(self) -> str:
        return Path(self.out_path).read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return Path(self.err_path).read_text(errors="replace")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="Start K virtual hosts (network namespaces) and run a command on host 0. In the "
        "command, {hostfile}, {agent} and {mpirun} are replaced: {mpirun} by mpirun with "
        "the hostfile, rsh agent and TCP settings of this cluster. Without a command, "
        "runs a 2-rank-per-host training demo."
    )
    p.add_argument("--hosts", type=int, default=2, help="virtual hosts (default 2)")
    p.add_argument("--slots", type=int, default=2, help="ranks per host in the hostfile (default 2)")
    p.add_argument(
        "--slow-link",
        action="store_true",
        help="make host 1's link slow and lossy (netem 200 ms + 5%% loss, or tbf + nftables loss)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND... (run on host 0)")
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    export = [
        "PYTHONPATH",
        "OMPI_ALLOW_RUN_AS_ROOT",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
        "OMP_NUM_THREADS",
        "MGPU_EMULATE_GPU",
    ]
    try:
        with Cluster(a.hosts, a.slots) as c:
            if a.slow_link:
                print(
                    f"cluster: {c.hostname(1 % a.hosts)}'s link: {c.slow_lossy_link(1 % a.hosts)[0]}", file=sys.stderr
                )
            env = dict(
                os.environ,
                OMPI_ALLOW_RUN_AS_ROOT="1",
                OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                PYTHONPATH=os.environ.get("PYTHONPATH", str(Path(__file__).resolve().parents[2] / "python")),
            )
            mpirun = c.mpirun_args(a.hosts * a.slots, [e for e in export if e in env])
            if not cmd:
                cmd = [
                    "{mpirun}",
                    sys.executable,
                    "-m",
                    "mgpu",
                    "train",
                    "--layers",
                    "50,256,3",
                    "--steps",
                    "200",
                    "--no-progress",
                    "--watchdog-timeout",
                    "10",
                    "--checkpoint-dir",
                    "{disk}/ckpt",
                    "--checkpoint-every",
                    "50",
                ]
            full = []
            for word in cmd:
                if word == "{mpirun}":
                    full += mpirun
                else:
                    full.append(
                        word.replace("{hostfile}", str(c.hostfile))
                        .replace("{agent}", str(c.agent))
                        .replace("{disk}", str(c.disk))
                    )
            print(
                f"cluster: {a.hosts} host(s) "
                + ", ".join(f"{c.hostname(i)}={c.address(i)}" for i in range(a.hosts))
                + f"; running on {c.hostname(0)}: {shlex.join(full)}",
                file=sys.stderr,
                flush=True,
            )
            r = subprocess.run([*c.enter(0), *full], env=env)
            return r.returncode
    except ClusterError as e:
        print(f"cluster: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
