"""The command line: python -m mgpu {train,info,topo,recommend,bench,stress} (under mpirun -np N for several ranks).

User errors print one line on stderr and exit with code 2 on every rank;
unexpected errors end the whole MPI job instead of leaving ranks hanging.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

from .._core import __version__
from .._runtime import gpus_emulated
from ..console import write_line
from ..errors import CommError, ConfigError, MgpuError, NumericsError
from ..train.process_group import ProcessGroup
from . import bench, info, recommend, stress, topo, train
from .common import EXIT_USAGE, Parser, UsageError

# Each command: the module that adds its parser, and what runs it (in `mgpu --help`'s order).
COMMANDS = {
    "train": (train.add_parser, train.cmd_train),
    "info": (info.add_parser, info.cmd_info),
    "topo": (topo.add_parser, topo.cmd_topo),
    "recommend": (recommend.add_parser, recommend.cmd_recommend),
    "bench": (bench.add_parser, bench.cmd_bench),
    "stress": (stress.add_parser, stress.cmd_stress),
}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="mgpu", description="Data-parallel MLP training on GPUs (NCCL) or CPUs (MPI).")
    p.add_argument("--version", action="version", version=f"mgpu {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add_parser, _ in COMMANDS.values():
        add_parser(sub)
    return p


EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # as a shell reports a process that SIGPIPE ended


def main(argv=None) -> int:
    pg = None
    try:
        args = build_parser().parse_args(argv)
        pg = ProcessGroup()
        if pg.is_root and gpus_emulated() and args.command in ("bench", "topo"):
            # Their tables are timings: say first that these GPUs are the CPU emulating them
            # (train says it in its header line, stress and info in the device names).
            print(info.emulation_banner() + "; their timings are not GPU timings", flush=True)
        if getattr(args, "gpus", None) is not None:
            code = train.train_in_one_process(args, pg)
        else:
            code = COMMANDS[args.command][1](args, pg)
        sys.stdout.flush()  # a reader gone (`| head`) shows here, inside the handlers below
        return code
    except UsageError as e:
        write_line(str(e))
        return EXIT_USAGE
    except ConfigError as e:
        write_line(("mgpu: error: " if pg is None or pg.size == 1 else f"mgpu: error (rank {pg.rank}): ") + str(e))
        return EXIT_USAGE
    except NumericsError as e:  # decided identically on every rank: no one is left waiting
        write_line(f"mgpu: error: {e}")
        return 1
    except CommError as e:  # a peer is gone or stuck: end the whole job
        write_line(f"mgpu: error: {pg.name_hosts(str(e)) if pg is not None else e}")
        if pg is not None:
            pg.abort(1)
        return 1
    except KeyboardInterrupt:
        write_line("mgpu: interrupted")
        if pg is not None:
            pg.abort(130)
        return 130
    except BrokenPipeError:
        # Whoever read the output went away (`mgpu info | head`): stop, without a traceback,
        # and without another failed flush of stdout at exit.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        if pg is not None and pg.size > 1:
            pg.abort(EXIT_BROKEN_PIPE)
        return EXIT_BROKEN_PIPE
    except OSError as e:
        # a file the run reads or writes (an output the checks could not foresee): one line
        where = f": '{e.filename}'" if e.filename else ""
        write_line(
            ("mgpu: error: " if pg is None or pg.size == 1 else f"mgpu: error (rank {pg.rank}): ")
            + f"{e.strerror or e}{where}"
        )
        if pg is not None and pg.size > 1:
            pg.abort(EXIT_USAGE)
        return EXIT_USAGE
    except MemoryError as e:  # an allocation beyond the host (std::bad_alloc in the core)
        write_line(f"mgpu: error: out of host memory{f' ({e})' if str(e) else ''}")
        if pg is not None:
            pg.abort(1)
        return 1
    except Exception as e:  # noqa: BLE001 - last line of defence: never leave peers hanging
        if isinstance(e, MgpuError):
            write_line(f"mgpu: error: {type(e).__name__}: {e}")
        else:
            traceback.print_exc()
        if pg is not None:
            pg.abort(1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
