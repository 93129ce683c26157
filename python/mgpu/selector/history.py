"""This machine's record of the selector against its own runs: `train` and `bench` append a
line for each step they priced from a calibration (checks.jsonl beside the calibration's
file), and the calibration's error bands are those of its held-out steps and of that record
together. Every record is of a run after the calibration, so the bands learn, held out in
time, how far this machine drifts from what `topo` saw (a VM's neighbours come and go).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Iterable, List, Optional

from ..hostinfo import placement_moved, round_trips_readable
from . import intervals

RECORD_NAME = "checks.jsonl"
KEEP = 1000  # the newest records a band is built from
HELD_OUT_WORKLOAD = ("layers", "batch", "dropout")  # what a held-out check keeps of the step it measured
# A step 20x off its prediction says the run was not the step priced (a stall, another
# machine's file): such records are left out, as the model refuses bands beyond e^3.
MAX_LOG_RATIO = 3.0


def record_path(profile_path: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(profile_path)), RECORD_NAME)


def append(
    profile_path: str,
    calibration: str,
    devices: int,
    measured_s: float,
    predicted_s: float,
    what: str,
    inside: bool,
    measured_speedup: Optional[float] = None,
    predicted_speedup: Optional[float] = None,
    round_trip: Optional[tuple] = None,
) -> None:
    """One priced step of a run against the calibration created at `calibration` (inside:
    whether it fell in its prediction's 80 % interval; round_trip: (cpus, ns readings) of
    where the ranks' cores sat around a multi-rank step, see placed_elsewhere). A cache
    that cannot be written leaves the run's figures as they are, without the record."""
    if not (measured_s > 0 and predicted_s > 0):
        return
    line = {
        "calibration": calibration,
        "devices": int(devices),
        "log_ratio": math.log(measured_s / predicted_s),  # log(measured / predicted)
        "inside": bool(inside),
        "what": what,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if measured_speedup and predicted_speedup and measured_speedup > 0 and predicted_speedup > 0:
        line["speedup_log_ratio"] = math.log(measured_speedup / predicted_speedup)
    if round_trip is not None:
        line["round_trip_cpus"], line["round_trip_ns"] = list(round_trip[0]), list(round_trip[1])  # read() checks them
    try:
        with open(record_path(profile_path), "a") as f:  # one write: lines of concurrent runs stay whole
            f.write(json.dumps(line) + "\n")
    except OSError:
        pass


def read(profile_path: str, calibration: Optional[str]) -> List[dict]:
    """The newest KEEP records of the calibration created at `calibration` (lines that are
    not a record, of another calibration, or beyond MAX_LOG_RATIO are left out)."""
    try:
        with open(record_path(profile_path)) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    out = []
    for text in lines:
        try:
            rec = json.loads(text)
        except ValueError:
            continue
        if (
            isinstance(rec, dict)
            and calibration is not None
            and rec.get("calibration") == calibration
            and isinstance(rec.get("devices"), int)
            and not isinstance(rec["devices"], bool)
            and rec["devices"] >= 1
            and isinstance(rec.get("log_ratio"), float)
            and abs(rec["log_ratio"]) <= MAX_LOG_RATIO
            and isinstance(rec.get("speedup_log_ratio", 0.0), float)
            and abs(rec.get("speedup_log_ratio", 0.0)) <= MAX_LOG_RATIO
            and _round_trip_readable(rec)
        ):
            out.append(rec)
    return out[-KEEP:]


def placed_elsewhere(step: dict, placement: Optional[dict]) -> bool:
    """Whether a multi-rank step (a held-out check's "together_round_trip_ns", a record's
    "round_trip_ns", with the CPUs they were read between) ran with the ranks' cores in
    neither placement where `topo` probed the wait after backward, or moved during it. The
    model prices the wait as probed; the other placement's cost is the wait's own spread
    where the cores were seen to move (profiles._wait_spread), so such a step's error is
    not the model's. False where it cannot be told: no readings, other CPUs, or a first
    probe that itself spanned a move."""
    readings = step.get("together_round_trip_ns", step.get("round_trip_ns"))
    cpus = step.get("together_round_trip_cpus", step.get("round_trip_cpus"))
    if not isinstance(placement, dict) or not readings or cpus != placement.get("cpus"):
        return False
    probes = [placement.get("wait_probe_ns"), placement.get("other_wait_probe_ns")]
    probes = [p for p in probes if p]
    if not probes or placement_moved(probes[0]):
        return False
    readings = [float(t) for t in readings]
    return all(placement_moved(readings + [float(t) for t in p]) for p in probes)


def _round_trip_readable(rec: dict) -> bool:
    """A record without readings of where the cores sat, or with CPUs and positive ns."""
    if "round_trip_ns" not in rec and "round_trip_cpus" not in rec:
        return True
    cpus = rec.get("round_trip_cpus")
    return (
        round_trips_readable(rec.get("round_trip_ns"))
        and isinstance(cpus, list)
        and all(isinstance(c, int) and not isinstance(c, bool) for c in cpus)
    )


def error_model(profile: dict, records: Iterable[dict] = ()) -> dict:
    """A calibration's error model: bands (10th-90th percentile of log(measured / predicted))
    over its held-out steps and the record's steps: alone (one device), on several devices
    (compute and communication alike), and the speedup. Multi-rank steps placed elsewhere
    (placed_elsewhere) are left out of the bands while at least two others remain, and
    counted ("placed_elsewhere"): the cores were seen to move."""
    checks = profile["held_out_steps"]
    records = list(records)
    placement = profile.get("placement")
    several = [c for c in checks if "together_s" in c]
    several_records = [r for r in records if r["devices"] > 1]
    kept = [c for c in several if not placed_elsewhere(c, placement)]
    kept_records = [r for r in several_records if not placed_elsewhere(r, placement)]
    if len(kept) + len(kept_records) < 2:  # every step elsewhere: the only evidence there is
        kept, kept_records = several, several_records
    left_out = len(several) + len(several_records) - len(kept) - len(kept_records)
    alone = _by_workload(checks, lambda c: math.log(c["alone_s"] / c["alone_predicted_s"]))
    together = _by_workload(kept, lambda c: math.log(c["together_s"] / c["together_predicted_s"]))
    speedup = _by_workload(
        kept,
        lambda c: math.log((c["alone_s"] / c["together_s"]) / (c["alone_predicted_s"] / c["together_predicted_s"])),
    )
    # a record is of a run's own workload, which it does not name: each one its own
    alone += [[r["log_ratio"]] for r in records if r["devices"] == 1]
    together += [[r["log_ratio"]] for r in kept_records]
    speedup += [[r["speedup_log_ratio"]] for r in kept_records if "speedup_log_ratio" in r]
    ranks = len(profile["devices"])
    compute = list(intervals.workload_band(alone))
    steps = lambda groups: sum(len(g) for g in groups)
    model = {
        "compute": compute,
        "compute_together": list(intervals.workload_band(together)) if steps(together) >= 2 else compute,
        "comm": list(intervals.workload_band(together)) if steps(together) >= 2 else compute,
        "compute_shared": False,
        "step_bands": True,
        "source": f"{len(checks)} held-out steps at calibration"
        + (f" alone and on {ranks} ranks" if several else " alone")
        + (f" and {len(records)} priced steps of this machine's runs since" if records else "")
        + " (10th-90th percentile of measured/predicted, a workload's offset either way plus its steps' scatter"
        + (
            f"; {left_out} multi-rank step(s) with the ranks' cores in a placement the wait was not probed in left out"
            if left_out
            else ""
        )
        + ")",
    }
    if steps(speedup) >= 2:
        model["speedup"] = list(intervals.workload_band(speedup))
    if left_out:
        model["placed_elsewhere"] = left_out
    return model


def _by_workload(checks: List[dict], log_ratio) -> List[List[float]]:
    """The checks' log ratios grouped by the workload they ran (layers, batch, dropout; a check
    without them, its own)."""
    groups: dict = {}
    for i, c in enumerate(checks):
        key = (tuple(c["layers"]), c["batch"], c["dropout"]) if all(k in c for k in HELD_OUT_WORKLOAD) else i
        groups.setdefault(key, []).append(log_ratio(c))
    return list(groups.values())


def summary(records: List[dict]) -> dict:
    """How often the record's steps fell in their prediction's 80 % interval."""
    judged = [r for r in records if isinstance(r.get("inside"), bool)]
    return {"steps": len(records), "judged": len(judged), "inside": sum(r["inside"] for r in judged)}
