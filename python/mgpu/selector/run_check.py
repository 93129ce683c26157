"""The advisor checks itself on every run: the selector's prediction for a run's own
configuration, from the calibration `--bucket-mb auto` would use, made once before the
first step (predict_run), and held against the run's steady-state steps at its end
(check_run): the measured and predicted step, the error, whether the measurement fell in
the 80 % interval, and where it did not, the phase that differs most and what to do.
"""

from __future__ import annotations

from typing import Optional

from ..errors import ConfigError
from . import history, profiles
from .tuning import calibrated_elsewhere, calibration_for, run_communicator, run_workload

# The core's StepTimings fields and the Prediction's seconds that price them.
PHASES = (
    ("forward", "forward_s"),
    ("backward", "backward_s"),
    ("comm_wait", "exposed_comm_s"),
    ("optimizer", "optimizer_s"),
)

# What to do where a phase is off the prediction by much, slower or faster than it.
ADVICE = {
    ("compute", True): "the machine computes slower than when it was calibrated (other load, another "
    "machine's or setup's calibration): run `mgpu topo` here under the job's launcher",
    ("compute", False): "the machine computes faster than its calibration says (a calibration from a busier "
    "time, another machine or setup): run `mgpu topo` here under the job's launcher",
    ("comm_wait", True): "the wait after backward is longer than calibrated: a straggler rank (see "
    "--straggler-threshold) or a slower link than `mgpu topo` measured (run it again)",
    ("comm_wait", False): "the wait after backward is shorter than calibrated: run `mgpu topo` again",
    ("other", True): "the step spends longer outside its timed phases than calibrated: the data feed, the "
    "Python loop and its outputs, or other processes on the machine",
    ("other", False): "the step spends less outside its timed phases than calibrated: run `mgpu topo` again",
}


def priced_fields(p) -> dict:
    """A core Prediction's step as a check reads it: the step, its 80 % interval and its
    phases, in ms (train's run and each bench cell alike)."""
    return {
        "predicted_step_ms": p.step_s * 1e3,
        "interval_ms": [p.step_low_s * 1e3, p.step_high_s * 1e3],
        "phases_ms": {name: getattr(p, field) * 1e3 for name, field in PHASES} | {"overhead": p.overhead_s * 1e3},
    }


def _none(reason: str) -> dict:
    return {"available": False, "reason": reason}


def predict_run(
    cfg, ranks: int, sizes, device: str, threads: int, batch_shares=None, path: Optional[str] = None
) -> dict:
    """The prediction for a run of `cfg` (bucket resolved) on `ranks` devices of kind `device`
    with `threads` per rank (batch_shares: the run's, None for equal), as a dict;
    {"available": False, "reason": ...} where the calibration at `path` (default: this
    machine's) cannot say: a calibration it cannot use never stops the run."""
    path = path or profiles.default_profile_path()
    profile, why = calibration_for(ranks, device, path, run_communicator(cfg, ranks, device))
    if profile is None:
        return _none(why)
    environment = profile.get("environment")
    calibrated_threads = environment.get("threads_per_rank") if isinstance(environment, dict) else None
    if device == "cpu" and calibrated_threads and calibrated_threads != threads:
        return _none(
            f"the calibration measured {calibrated_threads} thread(s) per rank, this run uses {threads} "
            f"(calibrate with `mgpu topo --threads {threads}`)"
        )
    options = profiles.P.Options()
    options.equal_shares = batch_shares is None
    options.share_weights = [float(s) for s in batch_shares or []]  # the run's split (train splits each micro-batch)
    options.overlap = bool(cfg.overlap)
    try:
        hw = profiles.to_core(profile, ranks)
        p = profiles.P.predict(run_workload(cfg, sizes, cfg.bucket_mb), hw, ranks, options)
    except (ConfigError, KeyError, TypeError, ValueError) as e:  # a prediction never stops a run
        return _none(f"the calibration cannot price this run: {e}")
    return {
        "available": True,
        "ranks": ranks,
        "profile": profile["name"],
        "calibration": path,
        "calibration_created": profile.get("created"),
        "profile_source": profile.get("source", "named"),
        # a calibration copied from other hardware prices the run all the same, and says so
        "calibrated_elsewhere": calibrated_elsewhere(profile, device),
        "gpu_emulation": profiles.profile_is_emulated(profile),
        "intervals_from": hw.error.source,
        "unsure": profiles.unsure_bands(hw.error),  # bands too wide to read as more than a guess
        **priced_fields(p),
        "batch_shares": list(p.batch_shares),  # samples per rank a step, as priced
        "overlap": bool(cfg.overlap),
        "data_on_device": cfg.data_on_device != "off",  # priced with the training set resident (auto: as it mostly is)
    }


def record_run(check: dict, ranks: int) -> None:
    """A checked run's step in the record beside its calibration (history.py): rank 0, once."""
    if (
        check.get("available")
        and check.get("measured_step_ms")
        and check.get("profile_source") == "calibrated"
        and not check.get("calibrated_elsewhere")  # the record is of this machine's calibration
    ):
        history.append(
            check["calibration"],
            check["calibration_created"],
            ranks,
            check["measured_step_ms"] / 1e3,
            check["predicted_step_ms"] / 1e3,
            "train",
            check["inside"],
        )


def check_run(prediction: dict, measured: Optional[dict], phases_timed: bool) -> dict:
    """The prediction against the measured medians (StepTimes.medians(): seconds), or as it
    was where there is none. phases_timed: the phase timings are durations (CPU ranks, timed
    GPU steps), not a device's queueing times."""
    if not prediction.get("available"):
        return dict(prediction)
    out = dict(prediction)
    if measured is None:
        out.update(measured_step_ms=None, note="too few steps after the warm-up to hold the prediction against")
        return out
    step_ms = measured["step"] * 1e3
    low, high = prediction["interval_ms"]
    out.update(
        measured_step_ms=step_ms,
        measured_steps=measured["steps"],
        error=prediction["predicted_step_ms"] / step_ms - 1,
        inside=low <= step_ms <= high,
    )
    if phases_timed:
        phases = {name: measured[name] * 1e3 for name, _ in PHASES}
        if prediction.get("ranks") == 1:  # the model prices one rank's wait (its health check) in its update
            phases["optimizer"] += phases["comm_wait"]
            phases["comm_wait"] = 0.0
        # the step's time outside its timed phases (the feed, the loop, other processes),
        # which the model prices as the step's overhead
        out["measured_phases_ms"] = phases | {"other": max(0.0, step_ms - sum(phases.values()))}
        predicted = dict(prediction["phases_ms"]) | {"other": prediction["phases_ms"].get("overhead", 0.0)}
        out["differs_most"] = max(
            out["measured_phases_ms"], key=lambda name: abs(out["measured_phases_ms"][name] - predicted[name])
        )
    out["warning"] = None if out["inside"] else _warning(out)
    return out


def _warning(check: dict) -> str:
    low, high = check["interval_ms"]
    line = ("EMULATED GPUs (not a GPU's times): " if check.get("gpu_emulation") else "") + (
        f"the measured step ({check['measured_step_ms']:.3g} ms) lies outside the prediction's 80% interval "
        f"({low:.3g}-{high:.3g} ms; {check['predicted_step_ms']:.3g} ms predicted from '{check['profile']}')"
    )
    elsewhere = check.get("calibrated_elsewhere")
    if elsewhere:  # the likeliest cause, whatever the phase
        line += f"; the calibration was {elsewhere}: run `mgpu topo` here under the job's launcher"
    phase = check.get("differs_most")
    if phase is None:  # a GPU's untimed steps: their phases are queueing times
        slower = check["measured_step_ms"] > check["predicted_step_ms"]
        return f"{line}: {ADVICE[('compute', slower)]} (time the phases with --log-json to see which differs)"
    predicted = check["phases_ms"]["overhead" if phase == "other" else phase]
    measured = check["measured_phases_ms"][phase]
    advice = ADVICE[(phase if phase in ("comm_wait", "other") else "compute", measured > predicted)]
    name = "the time outside the timed phases" if phase == "other" else phase
    return f"{line}: {name} differs most ({predicted:.3g} ms predicted, {measured:.3g} measured); {advice}"


def format_check(check: dict) -> str:
    """train's summary line of its prediction."""
    if not check.get("available"):
        return f"prediction: none ({check['reason']})"
    emulated = " (EMULATED GPUs: not a GPU's times)" if check.get("gpu_emulation") else ""
    low, high = check["interval_ms"]
    line = (
        f"prediction{emulated}: {check['predicted_step_ms']:.3g} ms a step (80% interval {low:.3g}-{high:.3g} ms, "
        f"profile '{check['profile']}')"
    )
    if check.get("calibrated_elsewhere"):
        line += f" [the calibration was {check['calibrated_elsewhere']}]"
    if check.get("measured_step_ms") is None:
        return f"{line}; {check.get('note', 'not measured')}"
    where = "inside" if check["inside"] else "OUTSIDE"
    return (
        f"{line}; measured {check['measured_step_ms']:.3g} ms (median of {check['measured_steps']} steps after "
        f"warm-up): predicted {check['error']:+.0%}, {where} the interval"
    )
