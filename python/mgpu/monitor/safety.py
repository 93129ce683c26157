"""The safety rules shared by `stress` and `train --telemetry`: thresholds on a device's
temperature, memory and power, and what each crossing does (throttle, stop growing the
buffer, warn); every action is an event with its time and reading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..console import write_line


@dataclass
class Thresholds:
    max_temp_c: float = 85.0
    max_memory_pct: float = 95.0
    power_limit_w: Optional[float] = None  # None: the device's enforced limit when telemetry knows it


class SafetyMonitor:
    """Turns readings into actions: throttle (fewer iterations a launch), stop growing
    memory, warn about power. Every action is an event with a time and the reading.
    `breaches` is the threshold test alone, which `train --telemetry` acts on its own way."""

    def __init__(self, thresholds: Thresholds, rank: int = 0, command: str = "stress"):
        self.t, self.rank, self.command = thresholds, rank, command
        self.events: list = []
        self.grow_memory = True
        self._last_power_warning = -1e9

    def event(self, kind: str, message: str, reading: dict) -> None:
        self.events.append({"t": reading.get("t"), "rank": self.rank, "action": kind, "message": message})
        write_line(f"mgpu {self.command} (rank {self.rank}): {message}")  # one write: ranks' lines stay whole

    def breaches(self, reading: Optional[dict]) -> dict:
        """{metric: text} for each threshold this reading is above (temperature_c,
        memory_used_pct, power_w: the configured limit, else the device's enforced one)."""
        out = {}
        if not reading:
            return out
        temp = reading.get("temperature_c")
        if temp is not None and temp > self.t.max_temp_c:
            out["temperature_c"] = f"temperature {temp:.0f} C > {self.t.max_temp_c:g} C"
        mem = reading.get("memory_used_pct")
        if mem is not None and mem > self.t.max_memory_pct:
            out["memory_used_pct"] = f"memory {mem:.1f}% used > {self.t.max_memory_pct:g}%"
        power, limit = reading.get("power_w"), self.t.power_limit_w or reading.get("power_limit_w")
        if power is not None and limit and power > limit:
            out["power_w"] = f"power {power:.0f} W > limit {limit:.0f} W"
        return out

    def check(self, reading: Optional[dict], iterations: int) -> int:
        """Apply the thresholds to a reading; returns the iterations per launch to use."""
        found = self.breaches(reading)
        if "temperature_c" in found and iterations > 1:
            iterations = max(1, iterations // 2)
            self.event("throttle", f"{found['temperature_c']}: {iterations} iterations a launch", reading)
        if "memory_used_pct" in found and self.grow_memory:
            self.grow_memory = False
            self.event("stop_growing_memory", f"{found['memory_used_pct']}: the buffer stops growing", reading)
        if "power_w" in found and (reading.get("t", 0) - self._last_power_warning) > 10:
            self._last_power_warning = reading.get("t", 0)
            self.event("power_warning", found["power_w"], reading)
        return iterations
