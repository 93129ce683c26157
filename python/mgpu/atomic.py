"""Files written whole or not at all: a temporary file beside the target, fsynced, then
renamed over it. A failure (a full disk, an exception while writing) leaves the old file
as it was and no temporary. Imports nothing of mgpu: every layer may use it."""
from __future__ import annotations

import contextlib
import os
import tempfile


@contextlib.contextmanager
def atomic_file(path: str, binary: bool = False, prefix: str = ".tmp-"):
    """Yield a file open for writing; on a clean exit it replaces `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=os.path.splitext(path)[1], dir=directory)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"newline": ""})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
