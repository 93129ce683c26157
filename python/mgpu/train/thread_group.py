"""ThreadGroup: the ranks of a data-parallel job as threads of one process, one
GPU each (single-process multi-GPU, the seeds' "DataParallel" mode: no mpirun).

It is a Group as ProcessGroup is (group.py), so Trainer, the CLI's train command and user
code run on it unchanged: each thread builds its model on its own GPU and
steps its own Trainer. The NCCL communicators come from one ncclCommInitAll
(made by rank 0 for every rank); the small control-plane collectives (batch
sizes, validation sums, agreement on errors, checkpoint broadcast) meet at a
barrier of the threads. The core releases the GIL for the step, so the threads'
GPUs run concurrently.

    def work(pg):
        model = mgpu.MLP(layers, device="cuda", device_index=pg.local_rank)
        return mgpu.Trainer(model, process_group=pg).fit(data, batch_size=256, epochs=5)

    histories = mgpu.run_on_gpus(work, gpus=4)
"""

from __future__ import annotations

import copy
import os
import signal
import socket
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from .._runtime import _core
from ..errors import CommError, ConfigError
from ..hostinfo import cuda_device_count, no_gpu_reason
from .group import GroupBase, error_report, raise_agreed, raise_if_gpu_shared


class _Shared:
    """What the threads of one group share, and where they meet. A meeting that
    every rank reached counts as completed even if the group fails right after
    (threading.Barrier would break it for the threads not yet woken)."""

    def __init__(self, size: int):
        self.size = size
        self.cond = threading.Condition()
        self.arrived = 0
        self.generation = 0  # completed meetings
        self.slots: list = [None] * size
        self.failed: Optional[str] = None  # why the group was aborted
        self.comms: Any = None  # the NCCL communicators, or the error making them
        self.stop_hooks: list = []  # called with a signal's name (see _StopOnSignals)

    def meet(self, timeout: float, what: str) -> Optional[str]:
        """Wait until every rank arrives; the reason for failing when the group failed or timed out."""
        with self.cond:
            if self.failed is not None:
                return self.failed
            generation = self.generation
            self.arrived += 1
            if self.arrived == self.size:
                self.arrived = 0
                self.generation += 1
                self.cond.notify_all()
                return None
            self.cond.wait_for(
                lambda: self.generation != generation or self.failed is not None, timeout if timeout > 0 else None
            )
            if self.generation != generation:
                return None
            if self.failed is None:
                self.failed = f"{what} did not complete within {timeout:g} s: a rank of this process stopped responding"
                self.cond.notify_all()
            return self.failed

    def abort(self, why: str) -> None:
        with self.cond:
            if self.failed is None:
                self.failed = why
            self.cond.notify_all()


class ThreadGroup(GroupBase):
    """Rank `rank` of a group of `shared.size` threads of this process (a Group)."""

    def __init__(self, shared: _Shared, rank: int):
        super().__init__(rank, shared.size, rank, shared.size, [socket.gethostname()] * shared.size)
        self._shared = shared
        self.comm = None  # no MPI communicator: the threads meet in _Shared

    # --- meeting the other threads ---------------------------------------------
    def _meet(self, what: str) -> None:
        why = self._shared.meet(self.timeout, what)
        if why is not None:
            raise CommError(f"{what} on rank {self.rank}: {why}")

    def _exchange(self, value, what: str, take: Callable[[list], Any] = list):
        """take(every rank's value, in rank order): what this rank keeps of them."""
        sh = self._shared
        sh.slots[self.rank] = value
        self._meet(what)
        kept = take(sh.slots)
        self._meet(what)  # nobody writes (or mutates) the next round's slot before every rank has taken this one
        return kept

    # --- the Group's collectives --------------------------------------------------
    def allreduce(self, value, op: str = "sum", what: str = "allreduce"):
        if self.size == 1:
            return value
        values = self._exchange(value, what)
        is_int = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
        stacked = np.array(values, dtype=np.int64 if is_int else np.float64)
        reduced = {"sum": np.sum, "max": np.max, "min": np.min}[op](stacked, axis=0)
        if np.ndim(value) == 0:
            return int(reduced) if is_int else float(reduced)
        return np.asarray(reduced).reshape(np.shape(value))

    def exscan(self, value: int) -> int:
        if self.size == 1:
            return 0
        return int(sum(self._exchange(int(value), "exscan")[: self.rank]))

    def bcast(self, obj, root: int = 0):
        if self.size == 1:
            return obj
        # Ranks own what they receive, as they would in separate processes.
        return self._exchange(
            obj if self.rank == root else None,
            "broadcast",
            lambda slots: slots[root] if self.rank == root else copy.deepcopy(slots[root]),
        )

    def allgather(self, obj, what: str = "allgather") -> list:
        if self.size == 1:
            return [obj]
        return self._exchange(obj, what, copy.deepcopy)

    def barrier(self, what: str = "barrier") -> None:
        if self.size > 1:
            self._meet(what)

    def sleeping_barrier(self, what: str = "barrier") -> None:
        self.barrier(what)

    def core_round_trip_ns(self) -> None:
        """Threads of one process, a GPU each: no ranks' cores to place (see ProcessGroup's)."""
        self.barrier("the cores' round trip")
        return None

    def clock_offsets(self, clock: Callable[[], float], rounds: int = 8, what: str = "clock offsets") -> list:
        """ProcessGroup.clock_offsets for threads: one process, one perf_counter, so each
        rank's clock against rank 0's follows from one reading of `clock` between two of
        perf_counter, to within half their gap (rounds unused)."""
        before = time.perf_counter()
        reading = clock()
        after = time.perf_counter()
        mine = (reading - (before + after) / 2, (after - before) / 2)  # clock minus perf_counter
        both = self._exchange(mine, what) if self.size > 1 else [mine]
        if not self.is_root:
            return []
        d0, u0 = both[0]
        return [(d - d0, u + u0) for d, u in both]

    def agree(self, error: Optional[BaseException], what: str = "agreement") -> None:
        raise_agreed(error, self._exchange(error_report(error), what) if self.size > 1 else [])

    def abort(self, code: int = 1) -> None:
        """Make every other thread's next (or current) meeting raise CommError.
        A thread inside an NCCL collective is freed by the communicator's watchdog
        timeout instead (Trainer's `timeout`)."""
        self._shared.abort(f"rank {self.rank} failed (exit code {code})")

    # --- devices and communicators ------------------------------------------------
    def resolve_device(self, device: str) -> tuple:
        kind, _ = super().resolve_device(device)
        if self.size == 1:
            return kind, 0
        if kind != "cuda":
            why = f"no GPU is visible ({no_gpu_reason()})" if cuda_device_count() == 0 else "the device is the CPU"
            raise ConfigError(
                f"single-process mode drives GPUs, one thread each, and {why}; CPU ranks run under "
                "mpirun (mpirun -np N python -m mgpu train --device cpu)"
            )
        gpus = cuda_device_count()
        if gpus < self.size and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
            raise ConfigError(
                f"{self.size} GPU threads asked for, but {gpus} GPU(s) visible: one thread drives "
                f"one GPU (NCCL >= 2.30 shares a GPU with NCCL_MULTI_RANK_GPU_ENABLE=1)"
            )
        return "cuda", self.rank % gpus

    def communicator(self, kind: str = "mpi", device_index: Optional[int] = None) -> "_core.Communicator":
        if kind == "mpi" and self.size > 1:
            raise ConfigError(
                "the threads of one process have no MPI communicator: single-process "
                "multi-GPU training uses NCCL (--comm auto or nccl, --device cuda)"
            )
        return super().communicator(kind, device_index)

    def _nccl_communicator(self, device_index: Optional[int]) -> "_core.Communicator":
        devices = self._exchange(int(self._nccl_device(device_index)), "NCCL initialisation")
        sh = self._shared
        if self.rank == 0:  # ncclCommInitAll makes every rank's communicator at once
            try:
                raise_if_gpu_shared(devices, "threads")  # before NCCL's own, opaque "invalid usage"
                sh.comms = _core.nccl_init_all(devices)
            except Exception as e:  # noqa: BLE001 - handed to every rank below
                sh.comms = e
        self._meet("NCCL initialisation")
        if isinstance(sh.comms, Exception):
            raise type(sh.comms)(str(sh.comms))
        return sh.comms[self.rank]

    def on_stop_request(self, hook: Callable[[str], None]) -> None:
        """Call hook(signal name) when run_on_gpus's main thread receives SIGTERM, SIGINT or SIGUSR1."""
        with self._shared.cond:
            self._shared.stop_hooks.append(hook)

    def __repr__(self) -> str:
        return f"ThreadGroup(rank={self.rank}, size={self.size})"


STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
_RANK_THREAD = "mgpu-rank-"  # the name prefix of run_on_gpus's threads


def rank_threads_alive() -> bool:
    """Whether threads of run_on_gpus still run (after it raised KeyboardInterrupt)."""
    return any(t.name.startswith(_RANK_THREAD) for t in threading.enumerate())


def run_on_gpus(fn: Callable[[ThreadGroup], Any], gpus: Optional[int] = None) -> list:
    """Run fn(pg) on one thread per GPU (all visible GPUs by default), each with
    its ThreadGroup rank; return the results in rank order. If a thread fails,
    the others are released from their next meeting and the first error is
    raised here. SIGTERM/SIGINT/SIGUSR1 reach the hooks the threads registered
    (Trainer-driving code asks to stop at the next step); a second SIGINT
    raises KeyboardInterrupt here at once, while the threads may still be inside
    the core (they stop at their next meeting): a process that then exits must
    not finalize the interpreter under them (see the CLI's os._exit). Call it
    from the main thread."""
    if gpus is None:
        gpus = cuda_device_count()
    if not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(
            f"the number of GPUs must be an integer >= 1, got {gpus!r}" + (" (no GPU is visible)" if gpus == 0 else "")
        )
    shared = _Shared(gpus)
    results: list = [None] * gpus
    errors: list = [None] * gpus

    def body(rank: int) -> None:
        pg = ThreadGroup(shared, rank)
        try:
            results[rank] = fn(pg)
        except BaseException as e:  # noqa: BLE001 - reported by the caller's thread
            errors[rank] = e
            pg.abort(1)

    stopping = []

    def on_signal(signum, frame):
        name = signal.Signals(signum).name
        if stopping and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stopping.append(name)
        with shared.cond:
            hooks = list(shared.stop_hooks)
        for hook in hooks:
            hook(name)

    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    threads = [threading.Thread(target=body, args=(r,), name=f"{_RANK_THREAD}{r}", daemon=True) for r in range(gpus)]
    try:
        if in_main:
            for name in STOP_SIGNALS:
                sig = getattr(signal, name)
                previous[sig] = signal.signal(sig, on_signal)
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.2)  # short joins: the main thread stays free to take signals
    except BaseException:
        # A second SIGINT: the caller gets it at once; the threads leave at their next
        # meeting rather than train on unwatched (in a notebook the process lives on).
        shared.abort("interrupted")
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    failed = [e for e in errors if e is not None]
    if failed:
        # The cause, not the CommErrors it caused on the other ranks.
        raise next((e for e in failed if not isinstance(e, CommError)), failed[0])
    return results
