"""Learning-rate schedules: the learning rate as a pure function of the step.

Pure functions of the step number keep resumed runs exact: a checkpoint needs
only the step to continue the schedule. Shapes follow PyTorch's StepLR and
CosineAnnealingLR, optionally preceded by a linear warm-up from lr/warmup to lr.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from ..errors import ConfigError

SCHEDULES = ("constant", "step", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    kind: str = "constant"
    warmup_steps: int = 0
    step_size: int = 1000  # step: multiply by gamma every step_size steps
    gamma: float = 0.1
    total_steps: Optional[int] = None  # cosine: steps to anneal over (the run's length)
    min_lr: float = 0.0  # cosine: the floor

    def __post_init__(self):
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"learning rate must be a finite number > 0, got {self.lr}")
        if self.kind not in SCHEDULES:
            raise ConfigError(f"unknown lr schedule '{self.kind}' (expected {', '.join(SCHEDULES)})")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"warm-up steps must be an integer >= 0, got {self.warmup_steps}")
        if self.kind == "step":
            if not isinstance(self.step_size, int) or self.step_size < 1:
                raise ConfigError(f"lr step size must be an integer >= 1, got {self.step_size}")
            if not (0 < self.gamma <= 1):
                raise ConfigError(f"lr gamma must be in (0, 1], got {self.gamma}")
        if self.kind == "cosine":
            if self.total_steps is None or self.total_steps < 1:
                raise ConfigError("the cosine schedule needs the run's total steps (>= 1)")
            if not (0 <= self.min_lr < self.lr):
                raise ConfigError(f"min lr must be in [0, lr), got {self.min_lr}")

    def lr_at(self, step: int) -> float:
        """Learning rate of 0-based step `step`."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        t = step - self.warmup_steps
        if self.kind == "step":
            return self.lr * self.gamma ** (t // self.step_size)
        if self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(t, span) / span
            return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))
        return self.lr

    def to_dict(self) -> dict:
        return asdict(self)
