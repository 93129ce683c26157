"""Checkpoints: everything a run needs to continue exactly, in a file that is never unpickled.

Format (version 1): an .npz archive read with allow_pickle=False holding
  params            float32 (num_params,)   the flat parameter buffer
  opt.<name>        float32 (num_params,)   optimizer state (momentum_buffer, exp_avg, exp_avg_sq)
  meta              uint8                   UTF-8 JSON: format, version, model, config, world
                                            size, step/epoch/sampler position, loss scale,
                                            history, and a SHA-256 of every array
Writes are atomic (temporary file in the same directory, fsync, rename, fsync of
the directory), so a crash or full disk leaves the previous checkpoint intact.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from typing import Optional

import numpy as np

from ..atomic import atomic_file
from ..errors import ConfigError
from ..npzfile import NpzError, read_npz

FORMAT = "mgpu-checkpoint"
VERSION = 1
CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{9})\.npz$")


class CheckpointError(ConfigError):
    """A checkpoint cannot be written, read, or used for this run."""


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:09d}.npz"


def step_of(path: str) -> Optional[int]:
    """The step in a checkpoint's file name (None for a name mgpu did not give)."""
    m = CHECKPOINT_NAME.match(os.path.basename(path))
    return int(m.group(1)) if m else None


def checkpoint_step(path: str) -> Optional[int]:
    """The step a checkpoint holds, by its metadata (whatever the file's name), or None
    where that cannot be read (load_checkpoint then says why)."""
    if not os.path.isfile(path):  # a FIFO would block the read
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes().decode())
        step = meta["state"]["global_step"]
    except Exception:  # noqa: BLE001 - any unreadable file: the full load reports it
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def list_checkpoints(directory: str) -> list:
    """Checkpoint paths in `directory`, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise CheckpointError(f"cannot list checkpoint directory '{directory}': {e.strerror}") from None
    found = sorted((int(m.group(1)), n) for n in names if (m := CHECKPOINT_NAME.match(n)))
    return [os.path.join(directory, n) for _, n in found]


def latest_checkpoint(directory: str) -> Optional[str]:
    paths = list_checkpoints(directory)
    return paths[-1] if paths else None


def misnamed_checkpoint(directory: str) -> Optional[tuple]:
    """(path, step held) of the first checkpoint in `directory` whose metadata holds
    another step than its name says (renamed by hand), or None. Picking the newest and
    pruning go by name, so such a file would be resumed or deleted out of its order."""
    for path in list_checkpoints(directory):
        held = checkpoint_step(path)
        if held is not None and held != step_of(path):
            return path, held
    return None


def prepare_directory(directory: str) -> None:
    """Create the checkpoint directory if needed and check it is writable (before training)."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create checkpoint directory '{directory}': {e.strerror}") from None
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory '{directory}' is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CheckpointError(f"checkpoint directory '{directory}' is not writable")


def save_checkpoint(directory: str, step: int, arrays: dict, meta: dict, keep: int) -> str:
    """Write checkpoint `step` atomically, then delete all but the newest `keep`.

    On any failure the temporary file is removed, earlier checkpoints are left
    as they were, and CheckpointError says why.
    """
    meta = dict(meta, format=FORMAT, version=VERSION, checksums={k: _digest(v) for k, v in arrays.items()})
    payload = dict(arrays, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    path = os.path.join(directory, checkpoint_name(step))
    try:
        with atomic_file(path, binary=True, prefix=".tmp-ckpt-") as f:
            np.savez(f, **payload)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power loss
        finally:
            os.close(dir_fd)
    except OSError as e:
        reason = "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
        previous = latest_checkpoint(directory)
        kept = f"; previous checkpoint {os.path.basename(previous)} kept" if previous else ""
        raise CheckpointError(f"cannot write checkpoint for step {step} in '{directory}': {reason}{kept}") from None
    for old in list_checkpoints(directory)[:-keep]:
        if os.path.abspath(old) == os.path.abspath(path):
            continue  # a resumed run's older step, below one the run it rewound wrote: never the one just saved
        try:
            os.unlink(old)
        except OSError:
            pass  # pruning is best effort; the new checkpoint is safe
    return path


def load_checkpoint(path: str) -> tuple:
    """(arrays, meta) of a checkpoint, verified: format, version and checksums."""
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint '{path}' is a directory (give a file, or --checkpoint-dir)")
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block the read
        raise CheckpointError(f"checkpoint '{path}' is not a regular file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint '{path}': {e.strerror}") from None
    try:
        arrays = read_npz(raw)
    except NpzError as e:
        raise CheckpointError(f"cannot read checkpoint '{path}': {e}") from None
    if "meta" not in arrays:
        raise CheckpointError(f"'{path}' is not an mgpu checkpoint (no metadata)")
    try:
        meta = json.loads(arrays.pop("meta").tobytes().decode())
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint '{path}' has corrupt metadata") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"'{path}' is not an mgpu checkpoint")
    if meta.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint '{path}' has format version {meta.get('version')}; this mgpu reads version {VERSION}"
        )
    checksums = meta.get("checksums", {})
    if set(checksums) != set(arrays):
        raise CheckpointError(f"checkpoint '{path}' is incomplete (arrays do not match its metadata)")
    for name, array in arrays.items():
        if _digest(array) != checksums[name]:
            raise CheckpointError(f"checkpoint '{path}' is corrupt (checksum mismatch in '{name}')")
    return arrays, meta


def check_compatible(meta: dict, expected: dict, path: str) -> None:
    """Refuse a checkpoint whose run cannot be continued by this one: each key of
    `expected` (architecture, loss, optimizer, batch, seed, ...) must match."""
    saved = meta.get("compat", {})
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint '{path}' has malformed metadata: compat is {saved!r}")
    # The dataset by its contents where both runs have them (the same file under another
    # path is the same dataset; another file under the same path is not), else by name.
    by_contents = "dataset_sha256" in saved and "dataset_sha256" in expected
    for key, value in expected.items():
        if key == ("dataset" if by_contents else "dataset_sha256"):
            continue
        if saved.get(key) != value:
            if key == "dataset_sha256":
                raise CheckpointError(
                    f"checkpoint '{path}' does not fit this run: its dataset held other samples "
                    f"than {expected.get('dataset', 'this one')!r} holds here"
                )
            raise CheckpointError(
                f"checkpoint '{path}' does not fit this run: {key} is {saved.get(key)!r} there but {value!r} here"
            )
