"""Lines to the user from any rank: each written to stderr in one write, so the lines of
ranks that report together reach mpirun whole.
"""

from __future__ import annotations

import os
import sys


def write_line(text: str) -> None:
    """Write `text` and its newline to stderr in one write: lines of ranks that fail
    together then reach mpirun whole, never glued into one line."""
    data = (text.replace("\n", " ") + "\n").encode("utf-8", "replace")
    # A progress bar's line ends first (closing it writes its newline). tqdm may be half
    # imported: a signal handler runs this between any two lines of the main thread.
    bars = getattr(getattr(sys.modules.get("tqdm"), "tqdm", None), "_instances", ())
    for bar in list(bars or ()):
        bar.close()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (captured)
        sys.stderr.write(data.decode("utf-8"))
        sys.stderr.flush()
        return
    sys.stderr.flush()
    os.write(fd, data)
