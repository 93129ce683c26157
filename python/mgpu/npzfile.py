"""Reading .npz archives (datasets, checkpoints, saved parameters) in mgpu's words. Never
unpickles; a file that is not what mgpu reads gets one reason without the path (the
caller says which file): not an archive, truncated, empty, a member holding Python
objects. NumPy's own messages would point at unpickling an untrusted file instead.
Imports nothing of mgpu: every layer may use it."""

from __future__ import annotations

import io
import os
import zipfile
from typing import Union

import numpy as np

_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first member, or an empty archive
_NPY_MAGIC = b"\x93NUMPY"


class NpzError(ValueError):
    """Why a file is not an .npz archive mgpu reads (one line, without the file's name)."""


def read_npz(source: Union[str, os.PathLike, bytes]) -> dict:
    """Every member of the .npz archive at `source` (a path, or the file's bytes) as an
    array, by name; NpzError says what is wrong otherwise. OSError (a missing or
    unreadable path) passes through for the caller to word."""
    raw = source if isinstance(source, bytes) else _read(source)
    if not raw:
        raise NpzError("the file is empty (0 bytes), not a NumPy .npz archive")
    if raw.startswith(_NPY_MAGIC):
        raise NpzError("a single .npy array, not an .npz archive (save named arrays with numpy.savez)")
    if not raw.startswith(_ZIP_MAGIC):
        raise NpzError("not a NumPy .npz archive (neither a zip archive nor NumPy data)")
    try:
        archive = np.load(io.BytesIO(raw), allow_pickle=False)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError):
        raise NpzError("a corrupt or truncated .npz archive (its zip directory cannot be read)") from None
    arrays = {}
    with archive:
        for name in archive.files:
            arrays[name] = _member(archive, name)
    return arrays


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _member(archive, name: str):
    try:
        return archive[name]
    except ValueError as e:
        if "allow_pickle" in str(e) or "Object arrays" in str(e) or "pickled" in str(e):
            raise NpzError(f"'{name}' holds Python objects; mgpu reads numeric arrays only") from None
        raise NpzError(f"'{name}' is corrupt or truncated in the archive") from None
    except (zipfile.BadZipFile, EOFError, OSError, KeyError):  # a CRC mismatch, a cut member
        raise NpzError(f"'{name}' is corrupt or truncated in the archive") from None
