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

from . import intervals

RECORD_NAME = "checks.jsonl"
KEEP = 1000  # the newest records a band is built from
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
) -> None:
    """One priced step of a run against the calibration created at `calibration` (inside:
    whether it fell in its prediction's 80 % interval). A cache that cannot be written
    leaves the run's figures as they are, without the record."""
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
            and isinstance(rec.get("log_ratio"), float)
            and abs(rec["log_ratio"]) <= MAX_LOG_RATIO
            and isinstance(rec.get("speedup_log_ratio", 0.0), float)
            and abs(rec.get("speedup_log_ratio", 0.0)) <= MAX_LOG_RATIO
        ):
            out.append(rec)
    return out[-KEEP:]


def error_model(profile: dict, records: Iterable[dict] = ()) -> dict:
    """A calibration's error model: bands (10th-90th percentile of log(measured / predicted))
    over its held-out steps and the record's steps: alone (one device), on several devices
    (compute and communication alike), and the speedup."""
    checks = profile["held_out_steps"]
    records = list(records)
    alone = [math.log(c["alone_s"] / c["alone_predicted_s"]) for c in checks]
    together = [math.log(c["together_s"] / c["together_predicted_s"]) for c in checks if "together_s" in c]
    speedup = [
        math.log((c["alone_s"] / c["together_s"]) / (c["alone_predicted_s"] / c["together_predicted_s"]))
        for c in checks
        if "together_s" in c
    ]
    alone += [r["log_ratio"] for r in records if r["devices"] == 1]
    together += [r["log_ratio"] for r in records if r["devices"] > 1]
    speedup += [r["speedup_log_ratio"] for r in records if r["devices"] > 1 and "speedup_log_ratio" in r]
    ranks = len(profile["devices"])
    compute = list(intervals.band(alone))
    model = {
        "compute": compute,
        "compute_together": list(intervals.band(together)) if len(together) >= 2 else compute,
        "comm": list(intervals.band(together)) if len(together) >= 2 else compute,
        "compute_shared": False,
        "step_bands": True,
        "source": f"{len(checks)} held-out steps at calibration"
        + (f" alone and on {ranks} ranks" if together else " alone")
        + (f" and {len(records)} priced steps of this machine's runs since" if records else "")
        + " (10th-90th percentile of measured/predicted)",
    }
    if len(speedup) >= 2:
        model["speedup"] = list(intervals.band(speedup))
    return model


def summary(records: List[dict]) -> dict:
    """How often the record's steps fell in their prediction's 80 % interval."""
    judged = [r for r in records if isinstance(r.get("inside"), bool)]
    return {"steps": len(records), "judged": len(judged), "inside": sum(r["inside"] for r in judged)}
