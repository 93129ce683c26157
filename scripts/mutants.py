#!/usr/bin/env python3
"""Mutation testing: how many small, realistic bugs does the test suite catch?

Each mutant in scripts/mutants.toml replaces one exact piece of one source file.
The runner copies the working tree (tracked and untracked, not ignored files) to a
scratch directory, builds the extension there once (CMake + Ninja; later runs and
later mutants rebuild incrementally), checks that each mutant's own tests pass on
the unmutated code, then for every mutant: applies it, rebuilds what it touches,
runs its own tests, and on a survivor the whole suite of its path (`cpu`: the CPU
suite; `emulation`: tests/gpu and tests/emulation on two emulated GPUs). A mutant
counts as killed only when a test fails; a run past --timeout is reported, not
counted. Nothing outside the scratch directory is modified.

    .venv/bin/python scripts/mutants.py               # every mutant, then the score
    .venv/bin/python scripts/mutants.py --list
    .venv/bin/python scripts/mutants.py --only clip-without-min --fast-only

Exit status: 0 every mutant killed, 1 some survived or timed out, 2 the runner
could not run (a stale mutant, a build failure, its tests failing unmutated).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITES = {  # path -> (extension target, environment, the whole suite's paths)
    "cpu": ("_core", {}, ["tests"]),
    "emulation": ("_core_emu", {"MGPU_EMULATE_GPU": "2"}, ["tests/gpu", "tests/emulation"]),
}


class RunnerError(Exception):
    """The runner cannot give a meaningful score (exit status 2)."""


@dataclass
class Mutant:
    name: str
    suite: str
    file: str
    old: str
    new: str
    tests: list
    why: str = ""
    result: str = "not run"
    killed_by: list = field(default_factory=list)
    phase: str = ""
    seconds: float = 0.0


def load_mutants(path: Path, source: Path) -> list:
    with open(path, "rb") as f:
        entries = tomllib.load(f).get("mutant", [])
    mutants, names = [], set()
    for i, e in enumerate(entries):
        missing = {"name", "suite", "file", "old", "new", "tests"} - set(e)
        if missing:
            raise RunnerError(f"{path.name}: mutant #{i + 1} lacks {', '.join(sorted(missing))}")
        m = Mutant(**e)
        if m.name in names:
            raise RunnerError(f"{path.name}: two mutants are named '{m.name}'")
        names.add(m.name)
        if m.suite not in SUITES:
            raise RunnerError(f"mutant '{m.name}': unknown suite '{m.suite}' (expected {', '.join(SUITES)})")
        target = source / m.file
        if not target.is_file():
            raise RunnerError(f"mutant '{m.name}': no file {m.file}")
        found = target.read_text().count(m.old)
        if found != 1 or m.old == m.new:
            raise RunnerError(
                f"mutant '{m.name}' is stale: its code occurs {found} times in {m.file} "
                f"(must be exactly once); update {path.name}"
            )
        mutants.append(m)
    return mutants


def sync_tree(src: Path, dst: Path) -> int:
    """Make dst's sources equal to src's working tree; returns the files copied. Only
    changed files are rewritten, so the build stays incremental."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=src,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    wanted = {p for p in listed if p and (src / p).is_file()}
    copied = 0
    for rel in wanted:
        a, b = src / rel, dst / rel
        if not b.is_file() or a.read_bytes() != b.read_bytes():
            b.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(a, b)  # a fresh mtime: Ninja rebuilds what depends on it
            copied += 1
    for b in list(dst.rglob("*")):  # sources deleted since the last sync
        rel = b.relative_to(dst).as_posix()
        if (
            b.is_file()
            and rel not in wanted
            and b.suffix not in (".so", ".pyc")
            and not rel.startswith((".pytest_cache/", "build/"))
        ):
            b.unlink()
    return copied


def run(cmd, cwd, env=None, timeout=None, log=None) -> tuple:
    """(exit status or None on timeout, output); the whole process group ends on timeout."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    if log:
        log.write_text(out)
    return rc, out


class Scratch:
    """The scratch copy: sources under src/, the CMake build under build/."""

    def __init__(self, directory: Path, python: str):
        self.dir, self.python = directory, python
        self.src, self.build_dir, self.logs = directory / "src", directory / "build", directory / "logs"
        for d in (self.src, self.build_dir, self.logs):
            d.mkdir(parents=True, exist_ok=True)

    def configure(self) -> None:
        if (self.build_dir / "build.ninja").exists():
            return
        pybind11_dir = subprocess.run(
            [self.python, "-c", "import pybind11; print(pybind11.get_cmake_dir())"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        rc, out = run(
            [
                "cmake",
                "-S",
                str(self.src),
                "-B",
                str(self.build_dir),
                "-G",
                "Ninja",
                "-DCMAKE_BUILD_TYPE=Release",
                f"-Dpybind11_DIR={pybind11_dir}",
                f"-DPython_EXECUTABLE={self.python}",
                "-DCMAKE_CUDA_ARCHITECTURES=80",
            ],  # one architecture: nvcc's time halves
            cwd=self.dir,
            log=self.logs / "configure.log",
        )
        if rc != 0:
            raise RunnerError(f"cmake failed (log: {self.logs / 'configure.log'}):\n{out[-2000:]}")

    def build(self, target: str, log_name: str) -> None:
        rc, out = run(["ninja", "-C", str(self.build_dir), target], cwd=self.dir, log=self.logs / log_name)
        if rc != 0:
            raise RunnerError(f"building {target} failed (log: {self.logs / log_name}):\n{out[-2000:]}")
        built = next(self.build_dir.glob(f"{target}.*.so"), None)
        if built is None:
            raise RunnerError(f"this build has no {target} module (see {self.logs / 'configure.log'})")
        installed = self.src / "python" / "mgpu" / built.name
        tmp = installed.with_name(installed.name + ".new")  # never overwrite a loaded module in place
        shutil.copyfile(built, tmp)
        os.replace(tmp, installed)

    def pytest(self, suite: str, paths: list, stop_first: bool, timeout: float, log_name: str) -> tuple:
        """(status, failing tests): status 'pass', 'fail', 'timeout' or 'error'."""
        env = dict(os.environ, PYTHONPATH=str(self.src / "python"), **SUITES[suite][1])
        if suite == "cpu":
            env.pop("MGPU_EMULATE_GPU", None)
        cmd = (
            f"source scripts/mpi_env.sh && exec {self.python} -m pytest -q -rfE -p no:cacheprovider "
            + ("-x " if stop_first else "")
            + " ".join(paths)
        )
        rc, out = run(["bash", "-c", cmd], cwd=self.src, env=env, timeout=timeout, log=self.logs / log_name)
        if rc is None:
            return "timeout", []
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
        if rc == 0:
            return "pass", []
        if rc == 1 and failed:
            return "fail", failed
        return "error", [f"pytest exit status {rc} (log: {self.logs / log_name})"]


def try_mutant(m: Mutant, scratch: Scratch, fast_only: bool, timeout: float) -> None:
    target = scratch.src / m.file
    original = target.read_text()
    t0 = time.monotonic()
    try:
        target.write_text(original.replace(m.old, m.new))
        scratch.build(SUITES[m.suite][0], f"{m.name}.build.log")
        status, failed = scratch.pytest(m.suite, m.tests, False, timeout, f"{m.name}.fast.log")
        m.phase = "own tests"
        if status == "pass" and not fast_only:
            status, failed = scratch.pytest(m.suite, SUITES[m.suite][2], True, timeout, f"{m.name}.suite.log")
            m.phase = "whole suite"
    finally:
        target.write_text(original)
    m.seconds = time.monotonic() - t0
    m.result = {"fail": "killed", "pass": "survived"}.get(status, status)
    m.killed_by = failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=Path, default=ROOT / "scripts" / "mutants.toml", help="the mutant list")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="just these mutants")
    parser.add_argument("--suite", choices=sorted(SUITES), help="just the mutants of this path")
    parser.add_argument("--fast-only", action="store_true", help="each mutant's own tests only, no whole suite")
    parser.add_argument(
        "--scratch",
        type=Path,
        default=ROOT / "build" / "mutants",
        help="scratch copy and build (kept between runs: rebuilds are incremental)",
    )
    parser.add_argument("--timeout", type=float, default=1200, help="seconds for one pytest run (default 1200)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    try:
        mutants = load_mutants(args.mutants, ROOT)
        if args.only:
            unknown = set(args.only) - {m.name for m in mutants}
            if unknown:
                raise RunnerError(f"no mutant named {', '.join(sorted(unknown))} (see --list)")
            mutants = [m for m in mutants if m.name in args.only]
        if args.suite:
            mutants = [m for m in mutants if m.suite == args.suite]
        if args.list:
            for m in mutants:
                print(f"{m.name:36} {m.suite:10} {m.file}: {m.why}")
            return 0
        if not mutants:
            raise RunnerError("no mutant selected")
        scratch = Scratch(args.scratch.resolve(), sys.executable)
        print(
            f"mutants: {len(mutants)}; scratch {scratch.dir}: {sync_tree(ROOT, scratch.src)} files updated", flush=True
        )
        scratch.configure()
        suites = sorted({m.suite for m in mutants})
        for suite in suites:  # the unmutated build, and each mutant's own tests green on it
            t0 = time.monotonic()
            scratch.build(SUITES[suite][0], f"baseline-{suite}.build.log")
            own = sorted({t for m in mutants if m.suite == suite for t in m.tests})
            status, failed = scratch.pytest(suite, own, False, args.timeout, f"baseline-{suite}.log")
            if status != "pass":
                raise RunnerError(
                    f"the mutants' own tests do not pass unmutated ({suite}: {status}): "
                    + ", ".join(failed or ["no output"])
                )
            print(
                f"baseline {suite}: built, {len(own)} test selections pass unmutated ({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
        for m in mutants:
            try_mutant(m, scratch, args.fast_only, args.timeout)
            by = m.killed_by[0] if m.killed_by else ""
            more = f" (+{len(m.killed_by) - 1} more)" if len(m.killed_by) > 1 else ""
            print(f"{m.name:36} {m.suite:10} {m.result:9} {m.seconds:6.0f} s  {m.phase}: {by}{more}", flush=True)
    except RunnerError as e:
        print(f"mutants: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mutants: interrupted (the scratch copy is restored on the next run)", file=sys.stderr)
        return 2
    for suite in suites:
        part = [m for m in mutants if m.suite == suite]
        print(f"{suite}: {sum(m.result == 'killed' for m in part)}/{len(part)} killed")
    killed = sum(m.result == "killed" for m in mutants)
    print(
        f"mutation score: {killed}/{len(mutants)} killed"
        + ("" if args.fast_only else " (own tests, then the whole suite on survivors)")
        + f"; logs in {scratch.logs}"
    )
    for m in mutants:
        if m.result != "killed":
            print(f"  {m.result}: {m.name} ({m.file}): {m.why}")
    return 0 if killed == len(mutants) else 1


if __name__ == "__main__":
    sys.exit(main())
