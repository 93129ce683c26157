"""StepTimes: a run's steady-state step, for holding the selector's prediction against it
(`train` reports both). Fed once per step with the step's seconds and the core's phase
timings; keeps the newest steps after a warm-up, so a long run holds a bounded window.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np

# The core's StepTimings fields, in the order a step runs them.
PHASES = ("forward", "backward", "comm_wait", "optimizer")


class StepTimes:
    """warmup: steps left out at the start (first shapes, caches, the allocator's growth);
    keep: the newest steps whose medians are reported."""

    def __init__(self, warmup: int = 5, keep: int = 4096):
        if warmup < 0 or keep < 1:
            raise ValueError(f"warmup must be >= 0 and keep >= 1, got {warmup}, {keep}")
        self.warmup = warmup
        self.seen = 0
        self._rows = deque(maxlen=keep)

    def add(self, seconds: float, timings) -> None:
        """One step: its wall seconds and the core's StepTimings (forward, backward, ...)."""
        self.seen += 1
        if self.seen > self.warmup:
            self._rows.append((seconds, *(float(getattr(timings, p)) for p in PHASES)))

    @property
    def steady_steps(self) -> int:
        return len(self._rows)

    def medians(self, least: int = 5) -> Optional[dict]:
        """Median seconds of the step and of each phase over the kept steps; None with fewer than `least`."""
        if len(self._rows) < max(1, least):
            return None
        rows = np.asarray(self._rows, dtype=np.float64)
        out = {"step": float(np.median(rows[:, 0]))}
        out.update({p: float(np.median(rows[:, i + 1])) for i, p in enumerate(PHASES)})
        out["steps"] = len(rows)
        return out
