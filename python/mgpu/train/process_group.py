"""ProcessGroup: the ranks of a data-parallel job as MPI processes (a Group, group.py).

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
import socket
import time
from typing import Any, Callable, Optional

import numpy as np

from .._runtime import _core, gpus_emulated
from ..errors import CommError, ConfigError
from .group import GroupBase, StopNotice, error_report, raise_agreed, raise_if_gpu_shared


def _import_mpi():
    if os.environ.get("MGPU_NO_MPI") == "1":
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI


class ProcessGroup(GroupBase):
    """The ranks of a job as MPI processes (a Group): rank bookkeeping, the core
    communicator, and the control plane's collectives over mpi4py."""

    def __init__(self, comm: Any = None):
        MPI = _import_mpi() if comm is None else __import__("mpi4py.MPI", fromlist=["MPI"])
        self._mpi = MPI
        self.comm = comm if comm is not None else (MPI.COMM_WORLD if MPI is not None else None)
        if self.comm is None:
            super().__init__(0, 1, 0, 1, [socket.gethostname()])
            return
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        local_rank, local_size = node.Get_rank(), node.Get_size()
        node.Free()
        # Gathered now: once a peer is gone, nothing can be gathered any more.
        super().__init__(rank, size, local_rank, local_size, self.comm.allgather(MPI.Get_processor_name()))

    def _mpi_communicator(self) -> "_core.Communicator":
        if not hasattr(_core, "MpiCommunicator"):
            raise ConfigError("this build of mgpu has no MPI support; rebuild with MPI to run several ranks")
        return _core.MpiCommunicator(self._mpi._handleof(self.comm))

    def _nccl_communicator(self, device_index: Optional[int]) -> "_core.Communicator":
        # Every step of the setup is bounded by `timeout`: a rank that never
        # arrives ends it with CommError on the others, not a hang.
        device_index = self._nccl_device(device_index)
        self._check_gpu_sharing(device_index)
        self._gpu = device_index
        sidecar = self._mpi_communicator() if self.size > 1 else None
        unique_id = _core.nccl_unique_id() if self.rank == 0 else None
        unique_id = self.bcast(unique_id, root=0, what="NCCL setup")
        return _core.NcclCommunicator(
            unique_id, self.rank, self.size, device_index, sidecar, setup_timeout=self.timeout
        )

    def _check_gpu_sharing(self, device_index: int) -> None:
        """Collective: ConfigError on every rank when ranks would share a GPU NCCL cannot share."""
        bus = _core.cuda_device_info(device_index)["pci_bus_id"]
        host = self._mpi.Get_processor_name() if self.comm is not None else "localhost"
        seen = self.allgather((host, bus), what="NCCL setup")
        raise_if_gpu_shared(seen)

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
                gpu = f" ({'emulated ' if gpus_emulated() else ''}GPU {self._gpu})" if self._gpu is not None else ""
                raise CommError(
                    f"{what}{where} did not complete within {self.timeout:g} s on rank {self.rank}{gpu}: {why}"
                )
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
        return [pickle.loads(out[o : o + n].tobytes()) for o, n in zip(offsets, sizes)]

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

    def stop_notice(self) -> StopNotice:
        if self.comm is None or self.size == 1:
            return StopNotice()
        return _MpiStopNotice(self.comm.Dup(), self._mpi)

    def abort(self, code: int = 1) -> None:
        """End every rank of the job (after an unexpected error on this one)."""
        if self.comm is not None and self.size > 1:
            self.comm.Abort(code)

    def __repr__(self) -> str:
        return (
            f"ProcessGroup(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
            f"local_size={self.local_size})"
        )


class _MpiStopNotice(StopNotice):
    """One small message to each peer on a communicator of its own, found by a probe."""

    TAG = 1

    def __init__(self, comm, mpi):
        self._comm, self._mpi, self._sends, self._heard = comm, mpi, [], False

    def tell(self) -> None:
        if self._sends or self._heard:
            return
        me = self._comm.Get_rank()
        self._sends = [self._comm.isend(True, dest=r, tag=self.TAG) for r in range(self._comm.Get_size()) if r != me]

    def heard(self) -> bool:
        if not self._heard and self._comm.Iprobe(source=self._mpi.ANY_SOURCE, tag=self.TAG):
            self._heard = True
        return self._heard

    def close(self) -> None:
        """Collective: completes this rank's notices and takes in those sent to it, so none
        is left unmatched when the communicator goes."""
        told = self._comm.allgather(bool(self._sends))
        me = self._comm.Get_rank()
        for sender, sent in enumerate(told):
            if sent and sender != me:
                self._comm.recv(source=sender, tag=self.TAG)
        for r in self._sends:  # after the receives: a send may complete only once matched
            r.wait()
        self._comm.Free()
