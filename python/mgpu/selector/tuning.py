"""What `train` asks of the selector for its run: `--bucket-mb auto` and `--batch-shares
auto`, priced on this machine's calibration for train's whole step (its optimizer sharded
or not).
"""

from __future__ import annotations

import os
from typing import Optional

from .._runtime import _core
from ..errors import ConfigError
from ..hostinfo import cpu_description
from . import profiles, recommend
from .profiles import calibrated_kinds, emulation_mismatch
from .workload import build_workload


def run_workload(cfg, sizes, bucket_mb: float):
    """A step of train's as the selector sees it: --accumulate micro-batches of --batch-size
    rows each, at the given bucket."""
    return build_workload(
        None,
        sizes,
        None,
        cfg.batch_size * cfg.accumulate,
        cfg.precision,
        cfg.optimizer,
        bucket_mb,
        cfg.effective_dropout(),
        cfg.grad_dtype,
        cfg.cuda_graph,
        cfg.accumulate,
        cfg.shard_optimizer,
        cfg.data_on_device != "off",  # auto: resident where it fits, as it mostly does
    )


def calibrated_kind_differs(profile, ranks: int, device: str):
    """Why the calibration does not describe a job on `ranks` devices of kind `device`
    (a CPU calibration says nothing of NCCL on GPUs, nor the reverse), or None."""
    kinds = calibrated_kinds(profile, ranks)
    if kinds != [device]:
        return (
            f"the calibration measured {'/'.join(kinds)} devices, this job runs on {device} "
            f"(calibrate with `mgpu topo --device {device}` under the job's launcher)"
        )
    return emulation_mismatch(profile, device)


def calibrated_elsewhere(profile: dict, device: str, device_index: int = 0) -> Optional[str]:
    """How the device a calibration measured differs from this one, or None: on a CPU its
    model and ISA (VMs of one model name differ in AVX-512), on a GPU its name. A
    calibration of other hardware still prices a run, which says so."""
    first = (profile.get("devices") or [{}])[0]
    if device == "cpu":
        there, here = first.get("cpu"), cpu_description()
        if not isinstance(there, dict):
            return None  # a calibration from before the CPU was recorded: nothing to hold against
        missing = [f for f in there.get("isa") or [] if f not in here["isa"]]
        extra = [f for f in here["isa"] if f not in (there.get("isa") or [])]
        if there.get("model") == here["model"] and not missing and not extra:
            return None
        isa = "".join(
            f"; {what} {', '.join(flags)}" for what, flags in (("without", missing), ("with", extra)) if flags
        )
        return f"measured on {there.get('model', '?')}, this machine has {here['model']}{isa}"
    try:
        here = str(_core.cuda_device_info(device_index)["name"])
    except Exception:  # noqa: BLE001 - no device to ask: nothing to hold against
        return None
    there = str(first.get("name", ""))
    return None if not there or there == here else f"measured on {there}, this run's GPU is {here}"


def run_communicator(cfg, ranks: int, device: str) -> Optional[str]:
    """The transport a run of `cfg` reduces with, as train builds it: None on one rank."""
    if ranks < 2:
        return None
    return "nccl" if device == "cuda" and cfg.comm != "mpi" else "mpi"


def calibration_for(ranks: int, device: str, path: Optional[str] = None, communicator: Optional[str] = None) -> tuple:
    """(the calibration at `path` (default: this machine's), None), or (None, why it cannot
    describe a job on `ranks` devices of kind `device` reducing over `communicator` (None:
    any, or one rank): a calibration of NCCL says nothing of MPI staged through the host,
    nor the reverse)."""
    path = path or profiles.default_profile_path()
    if not os.path.exists(path):
        return None, f"no calibration of this machine (run `mpirun -np {ranks} python -m mgpu topo`)"
    try:
        profile = profiles.load_profile(path)
    except ConfigError as e:
        return None, f"the calibration cannot be read: {e}"
    if len(profile["devices"]) < ranks:
        return None, f"the calibration has {len(profile['devices'])} device(s), this job {ranks} ranks"
    differs = calibrated_kind_differs(profile, ranks, device)
    environment = profile.get("environment")
    calibrated = environment.get("communicator") if isinstance(environment, dict) else None
    if not differs and ranks > 1 and communicator and isinstance(calibrated, str) and calibrated != communicator:
        differs = (
            f"the calibration measured the {calibrated.upper()} communicator, this job reduces over "
            f"{communicator.upper()} (calibrate with `mpirun -np {ranks} python -m mgpu topo --device {device} "
            f"--comm {communicator}`)"
        )
    return (None, differs) if differs else (profile, None)


def auto_bucket_mb(cfg, pg, sizes, device: str) -> tuple:
    """(MB, note or None): the model's bucket for this model and rank count on this machine's calibration."""
    if pg.size < 2:
        return 4.0, None  # one rank: no allreduce, nothing to say
    # a calibration that is missing, broken or of other devices must not stop a run that
    # never asked for it by name
    profile, why = calibration_for(pg.size, device, communicator=run_communicator(cfg, pg.size, device))
    if profile is None:
        return 4.0, f"bucket 4 MB: --bucket-mb auto: {why}"
    b = recommend.auto_bucket(profile, run_workload(cfg, sizes, 4.0), pg.size)
    return b["bucket_mb"], f"bucket {b['bucket_mb']:g} MiB (auto): {b['reason']}"


def auto_batch_shares(cfg, pg, sizes, device: str) -> list:
    """Per-rank shares from the strategy selector on this machine's calibration: each
    rank's share in proportion to its device's predicted speed (seed 000's unequal GPUs)."""
    path = profiles.default_profile_path()
    if not os.path.exists(path):
        raise ConfigError(
            "--batch-shares auto needs a calibration of this machine: run "
            f"`mpirun -np {pg.size} python -m mgpu topo` first"
        )
    profile = profiles.load_profile(path)
    if len(profile["devices"]) != pg.size:
        raise ConfigError(
            f"--batch-shares auto: the calibration at {path} has {len(profile['devices'])} "
            f"device(s) but this job has {pg.size} ranks; rerun `mgpu topo` with {pg.size} ranks"
        )
    differs = calibrated_kind_differs(profile, pg.size, device)
    if differs:
        raise ConfigError(f"--batch-shares auto: {differs}")
    w = run_workload(cfg, sizes, cfg.bucket_mb)
    prediction = profiles.P.predict(w, profiles.to_core(profile), pg.size, profiles.P.Options())
    return [float(s) for s in prediction.batch_shares]
