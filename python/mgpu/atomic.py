"""Files written whole or not at all: a temporary file beside the target, fsynced, then
renamed over it. A failure (a full disk, an exception while writing) leaves the old file
as it was and no temporary. Imports nothing of mgpu: every layer may use it."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile


def _umask() -> int:
    """The process's umask, read without changing it (os.umask would, racing other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


@contextlib.contextmanager
def atomic_file(path: str, binary: bool = False, prefix: str = ".tmp-", private: bool = True):
    """Yield a file open for writing; on a clean exit it replaces `path`. private: only the
    owner may read it (checkpoints, models, profiles), else the umask decides, as open()'s
    files (results others read). An OSError names `path`, not the temporary."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=os.path.splitext(path)[1], dir=directory)
        if not private:
            os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"newline": ""})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.errno is not None:
            raise OSError(e.errno, e.strerror, path) from e
        raise


def write_json_atomic(path: str, obj) -> None:
    """Write JSON whole or not at all: a failed write leaves the old file and no temporary."""
    with atomic_file(path, private=False) as f:
        json.dump(obj, f, indent=2)
