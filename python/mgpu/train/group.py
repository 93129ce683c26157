"""The group of ranks a job trains on, behind one interface: `Group`, the Protocol that
Trainer, the commands and user code program against, and `GroupBase`, what its two
transports share (device choice, the core communicator and its NCCL factory, agreement
on errors). ProcessGroup (process_group.py) is ranks as MPI processes; ThreadGroup
(thread_group.py) is ranks as threads of one process, one GPU each.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Optional, Protocol

from .._runtime import _core, gpus_emulated
from ..console import write_line
from ..errors import ConfigError
from ..hostinfo import cuda_device_count, no_gpu_reason


class Group(Protocol):
    """Who this rank is in a data-parallel job, and the collectives its Python side needs.
    Every collective is bounded by `timeout` seconds (0: forever) and raises CommError when
    a peer does not arrive."""

    rank: int
    size: int
    local_rank: int  # among the ranks on this host
    local_size: int
    timeout: float

    @property
    def is_root(self) -> bool: ...
    def communicator(self, kind: str = "mpi", device_index: Optional[int] = None) -> Any: ...
    @property
    def communicator_in_use(self) -> Any: ...
    def close(self) -> None: ...
    def default_threads(self) -> int: ...
    def resolve_device(self, device: str) -> tuple: ...
    def allreduce(self, value, op: str = "sum", what: str = "allreduce"): ...
    def exscan(self, value: int) -> int: ...
    def bcast(self, obj, root: int = 0): ...
    def allgather(self, obj, what: str = "allgather") -> list: ...
    def barrier(self, what: str = "barrier") -> None: ...
    def sleeping_barrier(self, what: str = "barrier") -> None: ...
    def core_round_trip_ns(self) -> Optional[dict]: ...
    def clock_offsets(self, clock: Callable[[], float], rounds: int = 8, what: str = "clock offsets") -> list: ...
    def agree(self, error: Optional[BaseException], what: str = "agreement") -> None: ...
    def name_hosts(self, message: str) -> str: ...
    def abort(self, code: int = 1) -> None: ...
    def stop_notice(self) -> "StopNotice": ...


class StopNotice:
    """A stop one rank asks for (a signal) that the others hear at their next poll, for
    loops whose ranks meet in no collective until their end (stress). Alone: nothing to
    tell. Collective to create; close() after the loop."""

    def tell(self) -> None:
        """Tell every other rank to stop (once; polled, never waited for)."""

    def heard(self) -> bool:
        """Whether another rank told this one to stop."""
        return False

    def close(self) -> None:
        pass


class GroupBase:
    """What both transports share; a transport adds its collectives and its communicators
    (_mpi_communicator, _nccl_communicator)."""

    _told_no_emulated_gpu = False  # per process: resolve_device runs several times a command

    def __init__(self, rank: int, size: int, local_rank: int, local_size: int, hosts: list):
        self.rank, self.size, self.local_rank, self.local_size = rank, size, local_rank, local_size
        self.hosts = hosts  # every rank's host, so a watchdog error can name them
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

    def _nccl_device(self, device_index: Optional[int]) -> int:
        """This rank's GPU for NCCL (ConfigError when the build has no NCCL)."""
        if not hasattr(_core, "NcclCommunicator"):
            raise ConfigError(
                "communicator 'nccl' requested, but this build of mgpu has no NCCL "
                "(built without the CUDA toolkit or NCCL); use --comm mpi"
            )
        return self.resolve_device("cuda")[1] if device_index is None else device_index

    def close(self) -> None:
        """Collective, at the normal end of a job: completes what the core
        communicator has in flight and releases it (NCCL: finalize, destroy).
        Without it, the communicator is aborted when it is freed."""
        if self._core_comm is not None:
            self._core_comm.close()
            self._core_comm = None
            self._core_comm_kind = None

    def stop_notice(self) -> StopNotice:
        return StopNotice()  # one rank: nobody to tell (a transport with peers overrides it)

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
            if not gpus and gpus_emulated() and self.rank == 0 and not GroupBase._told_no_emulated_gpu:
                GroupBase._told_no_emulated_gpu = True  # asked for, none there: said once, not taken silently
                write_line(f"mgpu: note: no emulated GPU ({no_gpu_reason()}): --device auto runs on the CPU")
        if device == "cpu":
            return "cpu", 0
        if not _core.build_info()["cuda"]["backend"]:
            raise ConfigError(
                "device 'cuda' requested, but this build of mgpu has no CUDA backend "
                "(built without the CUDA toolkit); use --device cpu"
            )
        if gpus == 0:
            raise ConfigError(f"device 'cuda' requested, but no GPU is visible ({no_gpu_reason()}); use --device cpu")
        return "cuda", self.local_rank % gpus

    def name_hosts(self, message: str) -> str:
        """`message` (a watchdog CommError's text) with each rank it names followed by its
        host, when this job spans several hosts; unchanged on one host."""
        return name_hosts(message, self.hosts)

    def _mpi_communicator(self) -> "_core.Communicator":
        raise NotImplementedError  # a transport's own

    def _nccl_communicator(self, device_index: Optional[int]) -> "_core.Communicator":
        raise NotImplementedError  # a transport's own


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
            "NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1"
        )
    if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        raise ConfigError(
            f"{len(seen)} {ranks_word} share {len(set(seen))} GPU(s): set NCCL_MULTI_RANK_GPU_ENABLE=1 "
            f"(NCCL {version}) to let NCCL run several ranks on one GPU, or {instead}"
        )
