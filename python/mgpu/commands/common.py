"""What the command modules share: the argparse parser with one-line errors, the value
types of the list options, and the checks of output files before the work begins.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from collections import Counter

from ..errors import ConfigError
from ..selector.history import record_path
from ..selector.profiles import default_profile_path

EXIT_USAGE = 2
INT32_MAX = 2**31 - 1  # the C++ core takes sizes and counts as int
MAX_THREADS = 1024  # per rank: OpenMP and the BLAS fail to start (or crash) far beyond any core count


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) so every rank prints one clear line."""

    def error(self, message):
        # argparse reads a value such as "-1,2" as an option and reports a missing
        # value; say why, and how to pass it.
        missing = re.fullmatch(r"argument (--[\w-]+): expected one argument", message)
        if missing:
            message += f" (a value starting with '-' reads as an option: write {missing.group(1)}=VALUE)"
        raise UsageError(f"{self.prog}: error: {message}")


def _items(text: str, what: str, convert, kind: str) -> list:
    """(item, convert(item)) for each comma-separated item of a list option; none may be empty."""
    items = [v.strip() for v in text.split(",")]
    if items == [""]:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got nothing")
    if "" in items:
        raise argparse.ArgumentTypeError(f"empty value in '{text}' (a doubled or stray comma)")
    pairs = []
    for item in items:
        try:
            pairs.append((item, convert(item)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{item}' is not {kind} (in '{text}')") from None
    return pairs


def bounded_int(what: str, maximum: int):
    """argparse type: one integer in 1..maximum (the range checks after parsing say >= 1 too)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got '{text}'") from None
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{what} must be at most {maximum}, got {text}")
        return value

    parse.__name__ = what
    return parse


def int_list(what: str, distinct: bool = False, maximum: int = INT32_MAX):
    """argparse type: comma-separated positive integers that fit the core's int, e.g.
    `int_list("layer sizes")`. No empty items (`50,,3`), signs, nothing below 1 or above
    INT32_MAX; with `distinct`, no value twice (a sweep's `2,2` is a typo for
    something else: refusing it beats measuring the wrong thing in silence)."""

    def parse(text: str) -> list:
        values = []
        for item, value in _items(text, what, int, "an integer"):
            if value < 1:
                raise argparse.ArgumentTypeError(f"{what} must be >= 1, got {item} (in '{text}')")
            if not (item.isascii() and item.isdigit()):  # int() also takes '+3', '1_000'
                raise argparse.ArgumentTypeError(f"write {what} as plain digits, got '{item}' (in '{text}')")
            if value > maximum:
                raise argparse.ArgumentTypeError(f"{what} must be at most {maximum}, got {item}")
            values.append(value)
        repeated = [v for v, n in Counter(values).items() if n > 1]
        if distinct and repeated:
            raise argparse.ArgumentTypeError(
                f"{what} must be distinct: {repeated[0]} appears {values.count(repeated[0])} times in '{text}'"
            )
        return values

    parse.__name__ = what  # argparse names the type by it in its own messages
    return parse


def float_list(what: str):
    """argparse type: comma-separated finite numbers >= 0 (shares, fractions); no empty items."""

    def parse(text: str) -> list:
        values = []
        for item, value in _items(text, what, float, "a number"):
            if not math.isfinite(value) or value < 0:
                raise argparse.ArgumentTypeError(f"{what} must be finite numbers >= 0, got {item} (in '{text}')")
            values.append(value)
        return values

    parse.__name__ = what
    return parse


def check_output_path(path: str, what: str) -> None:
    """ConfigError unless `path` can be written (before any work whose result would go there)."""
    if not path:
        raise ConfigError(f"{what}: the path is empty")
    directory = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(directory):
        raise ConfigError(f"{what} '{path}': directory '{directory}' does not exist")
    _check_writable_directory(directory, f"{what} '{path}': directory")
    if os.path.isdir(path):
        raise ConfigError(f"{what} '{path}' is a directory")
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block the write until read
        raise ConfigError(f"{what} '{path}' is not a regular file")


def kept_files(profile: str = None, saves: str = None) -> dict:
    """The files mgpu keeps between runs (realpath -> what it is), which no output may name:
    this machine's calibration and the record of checks beside it, and those of `profile`
    where that is a file. `saves`, a calibration the run writes (topo), is that run's
    output, not kept; the record beside it is."""
    read = [(default_profile_path(), "this machine's calibration")]
    if profile and os.path.isfile(profile):
        read.append((profile, "the --profile"))
    kept = {}
    for path, what in read + ([(saves, "the calibration this run saves")] if saves else []):
        kept.setdefault(os.path.realpath(record_path(path)), f"the record of checks beside {what}")
    for path, what in read:
        if not saves or os.path.realpath(path) != os.path.realpath(saves):
            kept[os.path.realpath(path)] = what
    return kept


def check_outputs(outputs: dict, inputs: dict = None, profile: str = None, saves: tuple = None) -> None:
    """check_output_path for each given output (option -> path; None: not given), and
    ConfigError if two outputs name one file (one would overwrite the other), an output
    names an input file (option -> path or None; writing it would destroy what was read)
    or a file mgpu keeps (kept_files(profile, saves' path), existing or not: it would be
    read back as what it is not). `saves`: (what, path) of the calibration the run writes,
    an output too (its path's own checks are the caller's: its directory may be made)."""
    # inputs that are files (a dataset may be a name like 'synthetic', a profile a named one)
    seen = {os.path.realpath(path): what for what, path in (inputs or {}).items() if path and os.path.isfile(path)}
    inputs_seen = set(seen)
    kept = kept_files(profile, saves[1] if saves else None)
    if saves:
        what, path = saves
        real = os.path.realpath(path)
        if real in kept:
            raise ConfigError(f"{what} '{path}' is {kept[real]}, which mgpu keeps: writing it would destroy it")
        seen[real] = what
    for what, path in outputs.items():
        if path is None:
            continue
        check_output_path(path, what)
        real = os.path.realpath(path)
        if real in kept and real not in inputs_seen:
            raise ConfigError(f"{what} '{path}' is {kept[real]}, which mgpu keeps: writing it would destroy it")
        other = seen.setdefault(real, what)
        if other != what:
            if real in inputs_seen:
                raise ConfigError(f"{what} '{path}' is the {other} this run reads: writing it would destroy it")
            raise ConfigError(f"{other} and {what} name the same file '{path}': one would overwrite the other")


def _check_writable_directory(directory: str, what: str) -> None:
    """ConfigError unless a file can be created in `directory`: tried, as os.access answers
    yes for root where a read-only mount or /sys refuses the write (after the work)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".mgpu-write-probe-", dir=directory)
    except OSError as e:
        raise ConfigError(f"{what} '{directory}' is not writable ({e.strerror})") from None
    os.close(fd)
    os.unlink(probe)


def check_outputs_outside_dirs(outputs: dict, dirs: dict, reserved: dict = None) -> None:
    """ConfigError if an output file (option -> path) is a directory the run will write
    (option -> path; made if missing), or inside one under a name the run reserves there
    (option -> regex of file names: a checkpoint's, which the next --resume would take)."""
    for what_dir, directory in dirs.items():
        if not directory:
            continue
        real_dir = os.path.realpath(directory)
        for what, path in outputs.items():
            if not path:
                continue
            # the file's own name as written (an atomic write replaces a symlink, not its target)
            real = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
            if real == real_dir:
                raise ConfigError(f"{what} '{path}' is the directory {what_dir} writes into")
            pattern = (reserved or {}).get(what_dir)
            if pattern and os.path.dirname(real) == real_dir and pattern.match(os.path.basename(real)):
                raise ConfigError(
                    f"{what} '{path}' is named like the files {what_dir} keeps there: "
                    "it would overwrite one, or be taken for one"
                )


def check_output_dir(path: str, what: str) -> None:
    """ConfigError unless `path` is a writable directory or can be made one, parents and all
    (plots go there)."""
    if not path:
        raise ConfigError(f"{what}: the path is empty")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{what} '{path}': '{existing}' is not a directory")
    _check_writable_directory(existing, f"{what} '{path}': directory")
