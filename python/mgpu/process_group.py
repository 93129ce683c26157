"""ProcessGroup: who this process is in a data-parallel job.

World rank and size come from mpi4py (COMM_WORLD by default), the node-local
rank from a shared-memory split (so it is right across nodes), and the device
from the local rank. Without mpi4py or mpirun it is a world of one. Every rank's
host name is gathered at start, so a watchdog error can name the hosts of the
ranks it names (name_hosts) when the job spans several.
"""
from __future__ import annotations

import math
import os
import pickle
import re
import socket
import time
from typing import Any, Callable, Optional

import numpy as np

from . import _core, gpus_emulated
from .errors import CommError, ConfigError
from .telemetry import host_meminfo


# Round trips between the same two CPUs this many times apart come from two placements
# of the cores (on our VMs: 50-100 ns within a last-level cache, 300-360 ns across), not
# from one placement's noise (a few ns).
PLACEMENT_RATIO = 2.0


def placement_moved(readings_ns) -> bool:
    """Whether core_round_trip_ns readings come from more than one placement of the cores."""
    return bool(readings_ns) and max(readings_ns) > PLACEMENT_RATIO * min(readings_ns)


def _import_mpi():
    if os.environ.get("MGPU_NO_MPI") == "1":
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI


class ProcessGroup:
    """Rank bookkeeping and the core communicator for one data-parallel job."""

    def __init__(self, comm: Any = None):
        MPI = _import_mpi() if comm is None else __import__("mpi4py.MPI", fromlist=["MPI"])
        self._mpi = MPI
        self.comm = comm if comm is not None else (MPI.COMM_WORLD if MPI is not None else None)
        if self.comm is None:
            self.rank, self.size, self.local_rank, self.local_size = 0, 1, 0, 1
            self.hosts = [socket.gethostname()]
        else:
            self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
            node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
            node.Free()
            # Gathered now: once a peer is gone, nothing can be gathered any more.
            self.hosts = self.comm.allgather(MPI.Get_processor_name())
        self._core_comm: Optional[_core.Communicator] = None
        self._core_comm_kind: Optional[str] = None
        self._gpu: Optional[int] = None  # this rank's GPU once NCCL binds one; named in stall errors
        self.timeout = 0.0  # seconds a control-plane collective may take (0: forever); see Trainer

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def communicator(self, kind: str = "mpi", device_index: Optional[int] = None) -> "_core.Communicator":
        """The core communicator, created on first use and then reused.

        kind="mpi": MPI over a duplicate of this group's comm (local for one rank).
        kind="nccl": NCCL between the ranks' GPUs (device_index: this rank's GPU,
        default as resolve_device("cuda") picks it), with the MPI communicator as
        heartbeat sidecar so a timeout names the missing ranks.
        """
        if kind not in ("mpi", "nccl"):
            raise ConfigError(f"unknown communicator '{kind}' (expected mpi or nccl)")
        if self._core_comm is not None:
            if self._core_comm_kind != kind:
                raise ConfigError(f"this process group already uses the {self._core_comm_kind} communicator")
            return self._core_comm
        if kind == "nccl":
            self._core_comm = self._nccl_communicator(device_index)
        elif self.size == 1:
            self._core_comm = _core.LocalCommunicator()
        else:
            self._core_comm = self._mpi_communicator()
        self._core_comm_kind = kind
        return self._core_comm

    @property
    def communicator_in_use(self) -> Optional["_core.Communicator"]:
        """The core communicator created so far (MPI or NCCL), or None."""
        return self._core_comm

    def _mpi_communicator(self) -> "_core.Communicator":
        if not hasattr(_core, "MpiCommunicator"):
            raise ConfigError("this build of mgpu has no MPI support; rebuild with MPI to run several ranks")
        return _core.MpiCommunicator(self._mpi._handleof(self.comm))

    def _nccl_device(self, device_index: Optional[int]) -> int:
        """This rank's GPU for NCCL (ConfigError when the build has no NCCL)."""
        if not hasattr(_core, "NcclCommunicator"):
            raise ConfigError("communicator 'nccl' requested, but this build of mgpu has no NCCL "
                              "(built without the CUDA toolkit or NCCL); use --comm mpi")
        return self.resolve_device("cuda")[1] if device_index is None else device_index

    def _nccl_communicator(self, device_index: Optional[int]) -> "_core.Communicator":
        # Every step of the setup is bounded by `timeout`: a rank that never
        # arrives ends it with CommError on the others, not a hang.
        device_index = self._nccl_device(device_index)
        self._check_gpu_sharing(device_index)
        self._gpu = device_index
        sidecar = self._mpi_communicator() if self.size > 1 else None
        unique_id = _core.nccl_unique_id() if self.rank == 0 else None
        unique_id = self.bcast(unique_id, root=0, what="NCCL setup")
        return _core.NcclCommunicator(unique_id, self.rank, self.size, device_index, sidecar,
                                      setup_timeout=self.timeout)

    def close(self) -> None:
        """Collective, at the normal end of a job: completes what the core
        communicator has in flight and releases it (NCCL: finalize, destroy).
        Without it, the communicator is aborted when it is freed."""
        if self._core_comm is not None:
            self._core_comm.close()
            self._core_comm = None
            self._core_comm_kind = None

    def _check_gpu_sharing(self, device_index: int) -> None:
        """Collective: ConfigError on every rank when ranks would share a GPU NCCL cannot share."""
        bus = _core.cuda_device_info(device_index)["pci_bus_id"]
        host = self._mpi.Get_processor_name() if self.comm is not None else "localhost"
        seen = self.allgather((host, bus), what="NCCL setup")
        raise_if_gpu_shared(seen)

    def default_threads(self) -> int:
        """CPU threads per rank when the user gives none: the node's cores shared evenly."""
        cores = _core.build_info()["cpu_threads_available"]
        return max(1, cores // self.local_size)

    def resolve_device(self, device: str) -> tuple[str, int]:
        """'cpu' | 'cuda' | 'auto' -> (backend name, device index for this rank)."""
        if device not in ("cpu", "cuda", "auto"):
            raise ConfigError(f"unknown device '{device}' (expected cpu, cuda or auto)")
        gpus = cuda_device_count()
        if device == "auto":
            device = "cuda" if gpus > 0 else "cpu"
        if device == "cpu":
            return "cpu", 0
        if not _core.build_info()["cuda"]["backend"]:
            raise ConfigError("device 'cuda' requested, but this build of mgpu has no CUDA backend "
                              "(built without the CUDA toolkit); use --device cpu")
        if gpus == 0:
            raise ConfigError(f"device 'cuda' requested, but no GPU is visible ({no_gpu_reason()}); "
                              "use --device cpu")
        return "cuda", self.local_rank % gpus

    # --- small collectives (control plane), bounded by the watchdog timeout ----
    def _wait(self, request, what: str) -> None:
        """Complete a non-blocking MPI request, or raise CommError after `timeout` seconds."""
        if self.timeout <= 0:
            request.Wait()
            return
        start = time.monotonic()
        deadline = start + self.timeout
        # While waiting, beat so peers can tell this waiting rank from a frozen one.
        beat_interval = min(1.0, self.timeout / 4)
        next_beat = start + beat_interval
        comm = self._core_comm
        while not request.Test():
            now = time.monotonic()
            if comm is not None and now > next_beat:
                comm.heartbeat()
                next_beat = now + beat_interval
            if now > deadline:
                why = comm.diagnose_stall(2.5 * beat_interval) if comm is not None else "a peer did not arrive"
                where = f" at step {comm.current_step}" if comm is not None else ""
                gpu = (f" ({'emulated ' if gpus_emulated() else ''}GPU {self._gpu})"
                       if self._gpu is not None else "")
                raise CommError(f"{what}{where} did not complete within {self.timeout:g} s on rank {self.rank}"
                                f"{gpu}: {why}")
            if now - start > 1e-3:
                time.sleep(5e-4)  # waiting long: leave the core to the ranks still working

    def allreduce(self, value, op: str = "sum", what: str = "allreduce"):
        """Sum (max, min) of a number or numeric array across ranks."""
        if self.comm is None:
            return value
        ops = {"sum": self._mpi.SUM, "max": self._mpi.MAX, "min": self._mpi.MIN}
        is_int = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
        send = np.array(value, dtype=np.int64 if is_int else np.float64, ndmin=1)
        recv = np.empty_like(send)
        self._wait(self.comm.Iallreduce(send, recv, op=ops[op]), what)
        if np.ndim(value) == 0:
            return int(recv[0]) if is_int else float(recv[0])
        return recv.reshape(np.shape(value))

    def exscan(self, value: int) -> int:
        """Sum of value over lower ranks (0 on rank 0)."""
        if self.comm is None:
            return 0
        send = np.array([value], dtype=np.int64)
        recv = np.zeros_like(send)
        self._wait(self.comm.Iexscan(send, recv, op=self._mpi.SUM), "exscan")
        return 0 if self.rank == 0 else int(recv[0])

    def bcast(self, obj, root: int = 0, what: str = "broadcast"):
        """Rank root's obj (any picklable object) on every rank, bounded by `timeout`."""
        if self.comm is None:
            return obj
        data = pickle.dumps(obj) if self.rank == root else b""
        size = np.array([len(data)], dtype=np.int64)
        self._wait(self.comm.Ibcast(size, root=root), what)
        buf = np.frombuffer(data, dtype=np.uint8).copy() if self.rank == root else np.empty(int(size[0]), np.uint8)
        self._wait(self.comm.Ibcast(buf, root=root), what)
        return obj if self.rank == root else pickle.loads(buf.tobytes())

    def allgather(self, obj, what: str = "allgather") -> list:
        """Every rank's obj (picklable), in rank order, bounded by `timeout`."""
        if self.comm is None:
            return [obj]
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8).copy()
        sizes = np.empty(self.size, dtype=np.int64)
        self._wait(self.comm.Iallgather(np.array([data.size], dtype=np.int64), sizes), what)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        self._wait(self.comm.Iallgatherv(data, [out, sizes, offsets, self._mpi.BYTE]), what)
        return [pickle.loads(out[o:o + n].tobytes()) for o, n in zip(offsets, sizes)]

    def barrier(self, what: str = "barrier") -> None:
        if self.comm is not None:
            self._wait(self.comm.Ibarrier(), what)

    def sleeping_barrier(self, what: str = "barrier") -> None:
        """A barrier that waits asleep: a rank left out of a measurement keeps off the cores
        (and the memory bus) of the ranks that measure. Bounded by `timeout` as _wait is."""
        if self.comm is None:
            return
        done = self.comm.Ibarrier()
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else math.inf
        while not done.Test():
            if time.monotonic() > deadline:
                raise CommError(f"{what} on rank {self.rank}: not every rank arrived within {self.timeout:g} s")
            time.sleep(0.002)

    def core_round_trip_ns(self) -> Optional[dict]:
        """Collective. On rank 0: {"cpus": [a, b], "ns": t}, a cache line's round trip
        between a CPU rank 0 may run on and one of the next rank's on its node: tens of ns
        where the two share a last-level cache, several times more across cache domains,
        which a hypervisor may move a VM's vCPUs between. None on other ranks, with one
        rank on rank 0's node, where the two have one CPU, or where the reading failed (it
        is a diagnosis: a CPU refused or a partner that never answered must not end the
        job). The other ranks wait asleep meanwhile, off the cores."""
        cpus = self.allgather(sorted(os.sched_getaffinity(0)), what="CPU affinities")
        reading = None
        if self.is_root:
            peers = [r for r in range(1, self.size) if self.hosts[r] == self.hosts[0]]
            pair = next(((a, b) for a in cpus[0] for b in (cpus[peers[0]] if peers else []) if a != b), None)
            try:
                if pair is not None:
                    reading = {"cpus": list(pair), "ns": _core.core_round_trip_ns(*pair)}
            except Exception:  # noqa: BLE001 - whatever failed, the others are waiting for this rank
                reading = None
        self.sleeping_barrier("the cores' round trip")
        return reading

    def clock_offsets(self, clock: Callable[[], float], rounds: int = 8, what: str = "clock offsets") -> list:
        """Collective. On rank 0: for each rank, (offset, uncertainty) in seconds of its
        `clock` against rank 0's, NTP-style: rank 0 sends `rounds` pings, the rank answers
        each with its clock, and of the round trips the shortest gives the offset
        (reply minus the trip's midpoint) to within half its length. [] elsewhere."""
        if self.comm is None:  # one process: one clock
            return [(0.0, 0.0)] * self.size if self.is_root else []
        tag = 0x6D67  # "mg": no other point-to-point traffic uses it
        ping, pong = np.zeros(1), np.zeros(1)
        if not self.is_root:
            for _ in range(rounds):
                self._wait(self.comm.Irecv(ping, source=0, tag=tag), what)
                pong[0] = clock()
                self._wait(self.comm.Isend(pong, dest=0, tag=tag), what)
            return []
        out = [(0.0, 0.0)]
        for rank in range(1, self.size):
            best = None
            for _ in range(rounds):
                t0 = clock()
                self._wait(self.comm.Isend(ping, dest=rank, tag=tag), what)
                self._wait(self.comm.Irecv(pong, source=rank, tag=tag), what)
                t1 = clock()
                if best is None or t1 - t0 < best[1] - best[0]:
                    best = (t0, t1, float(pong[0]))
            t0, t1, theirs = best
            out.append((theirs - (t0 + t1) / 2, (t1 - t0) / 2))
        return out

    def agree(self, error: Optional[BaseException], what: str = "agreement") -> None:
        """Collective: if any rank passes an error, every rank raises one.

        Use after work that can fail on some ranks only (reading files), so the
        others do not wait forever in the next collective.
        """
        if self.comm is None:
            if error is not None:
                raise error
            return
        if self.allreduce(0 if error is None else 1, op="max", what=what) == 0:
            return
        reports = self.allgather(error_report(error), what)  # every rank is here: the flag arrived from all
        raise_agreed(error, reports)

    def name_hosts(self, message: str) -> str:
        """`message` (a watchdog CommError's text) with each rank it names followed by its
        host, when this job spans several hosts; unchanged on one host."""
        return name_hosts(message, self.hosts)

    def abort(self, code: int = 1) -> None:
        """End every rank of the job (after an unexpected error on this one)."""
        if self.comm is not None and self.size > 1:
            self.comm.Abort(code)

    def __repr__(self) -> str:
        return (f"ProcessGroup(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
                f"local_size={self.local_size})")


def error_report(error: Optional[BaseException]):
    """What agree() tells the other ranks of this rank's error (None: no error)."""
    return None if error is None else (type(error).__name__, str(error))


def raise_agreed(error: Optional[BaseException], reports: list) -> None:
    """agree()'s verdict from every rank's error_report: this rank's own error,
    else the first other rank's, named; nothing when no rank failed."""
    if error is not None:
        raise error
    for rank, report in enumerate(reports):
        if report is not None:
            user = report[0] in ("ConfigError", "DataError", "CheckpointError")
            cls = ConfigError if user else _core.DeviceError if report[0] == "DeviceError" else RuntimeError
            raise cls(f"rank {rank}: {report[1]}")


# The rank lists of describe_stall (csrc/core/communicator.h) and of "on rank N".
_RANKS = re.compile(r"\b(ranks?) (\d+(?:, \d+)*)")


def name_hosts(message: str, hosts: list) -> str:
    """Annotate every rank named in `message` with its host (hosts[rank]) when `hosts`
    holds more than one name; then name each host all of whose ranks are named (none of
    them reached the step or answered in it) as the one to suspect. A heuristic: the
    heartbeats cannot yet tell a rank stuck behind another from a frozen one."""
    if len(set(hosts)) < 2:
        return message
    named: set = set()

    def annotate(m) -> str:
        ranks = [int(r) for r in m.group(2).split(", ")]
        if any(r >= len(hosts) for r in ranks):
            return m.group(0)
        named.update(ranks)
        return f"{m.group(1)} " + ", ".join(f"{r} ({hosts[r]})" for r in ranks)

    head, sep, diagnosis = message.partition(": ")
    out = _RANKS.sub(annotate, head) + sep
    named.clear()  # the reporting rank is not a suspect
    out += _RANKS.sub(annotate, diagnosis)
    suspects = [h for h in dict.fromkeys(hosts) if all(r in named for r, x in enumerate(hosts) if x == h)]
    if suspects:
        out += f"; every rank on {', '.join(suspects)} is named: suspect that host or its link (down, frozen or dead)"
    return out


def cuda_device_count() -> int:
    """GPUs visible to this process (0 without a CUDA backend)."""
    count = getattr(_core, "cuda_device_count", None)
    return int(count()) if count is not None else 0


def available_memory(device: str, index: int, local_size: int) -> float:
    """Bytes one rank may use: its GPU's free memory, or its share of the host's
    available memory (MemAvailable over the ranks on this host)."""
    if device == "cuda":
        free, _ = _core.cuda_memory_info(index)
        return float(free)
    try:
        return host_meminfo()["MemAvailable"] / max(local_size, 1)
    except (OSError, ValueError, KeyError):
        raise ConfigError("cannot read the available memory from /proc/meminfo") from None


def no_gpu_reason() -> str:
    """Why no GPU is visible, in the CUDA runtime's words (with the GPU emulation's
    reason where MGPU_EMULATE_GPU is unreadable), for the errors that need one."""
    cuda = _core.build_info()["cuda"]
    return cuda.get("no_device_reason") or "check nvidia-smi and CUDA_VISIBLE_DEVICES"


def raise_if_gpu_shared(seen: list, ranks: str = "ranks") -> None:
    """ConfigError when the GPUs of the ranks (one hashable id each; `ranks`
    names them: "ranks" of mpirun, "threads" of run_on_gpus) repeat and the
    loaded NCCL cannot share a GPU."""
    shared = len(seen) != len(set(seen))
    if not shared:
        return
    code = _core.build_info()["cuda"].get("nccl_loaded_code", 0)
    version = _core.build_info()["cuda"].get("nccl_loaded", "?")
    if gpus_emulated():  # the emulation's NCCL, as strict as the real one it stands for
        ranks_word, version = f"{ranks} (on EMULATED GPUs)", f"{version} (emulated)"
    else:
        ranks_word = ranks
    instead = "use --comm mpi" if ranks == "ranks" else "ask for at most as many GPUs as are visible"
    if code < 23000:
        raise ConfigError(
            f"{len(seen)} {ranks_word} share {len(set(seen))} GPU(s), but NCCL {version} allows one rank per "
            f"GPU (it fails with 'duplicate GPU'); run at most one {ranks[:-1]} per GPU, {instead}, or use "
            "NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1")
    if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        raise ConfigError(
            f"{len(seen)} {ranks_word} share {len(set(seen))} GPU(s): set NCCL_MULTI_RANK_GPU_ENABLE=1 "
            f"(NCCL {version}) to let NCCL run several ranks on one GPU, or {instead}")
