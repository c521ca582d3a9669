"""Command line: mpiexec -n N python -m mpizero {example,verify,check,train,estimate,plot,consolidate} [options].

One rank works too: ``python -m mpizero verify``. Bad input (a flag out of
range, flags that contradict each other, an output file that cannot be
written, ranks that run different mpizero code or hold different checkpoint
keys) is found before any work, printed once on one line, and exits with
status 2; so is an error every rank agreed on during the run. Any other
exception on any rank prints that rank's traceback and aborts the whole job,
and Ctrl-C on any rank ends the whole job, so no rank waits forever.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from mpi4py import MPI
from threadpoolctl import threadpool_limits

from mpizero import checkpoint_key
from mpizero.cli import check, consolidate, estimate, example, options, outputs, plot, train, verify
from mpizero.comm import local_device
from mpizero.comm.collectives import Collectives
from mpizero.comm.job import interrupt, launch
from mpizero.errors import ZeroError

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

# Each command module has: add_arguments(parser), check(args, world_size) (raises ZeroError and fills in
# defaults that depend on the world size), OUTPUTS ({dest: flag} of files rank 0 writes), OUTPUT_DIRS (checkpoint
# directories it writes into), WORK_DIRS (directories every rank keeps its own files in while it runs: the disk
# tier's), INPUTS (checkpoints it reads, which no output may overwrite) and run(args, comm).
COMMANDS = {
    "example": example,
    "verify": verify,
    "check": check,
    "train": train,
    "estimate": estimate,
    "plot": plot,
    "consolidate": consolidate,
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keep the description's lines; show each option's default unless it is None or False."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and not any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one ZeroError line, and whose help only rank 0 prints."""

    def error(self, message: str):
        raise ZeroError(message)

    def print_help(self, file=None) -> None:
        if MPI.COMM_WORLD.Get_rank() == 0:
            super().print_help(file)


def description(module) -> str:
    """The module's docstring as plain text for --help."""
    return module.__doc__.replace("``", "").strip()


def make_parser() -> Parser:
    parser = Parser(prog="python -m mpizero", description="ZeRO stages 0-3 over MPI", formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        summary = description(module).splitlines()[0].split(": ", 1)[-1]  # without "python -m mpizero NAME: "
        sub = commands.add_parser(name, help=summary, description=description(module), formatter_class=HelpFormatter)
        module.add_arguments(sub)
    return parser


def check_paths(args, module, collectives) -> None:
    """Raise on every rank unless rank 0 can write every output the flags name without clobbering a checkpoint,
    an input or another output, and every rank can make and write the directories it writes into (each rank's
    checkpoint files, its offload files)."""
    tables = {
        "outputs": module.OUTPUTS,
        "inputs": module.INPUTS,
        "directories": module.OUTPUT_DIRS,
        "work_directories": module.WORK_DIRS,
    }
    named = {kind: _given(args, table) for kind, table in tables.items()}
    if not named["outputs"] and not named["directories"] and not named["work_directories"]:
        return
    rank = collectives.comm.Get_rank()
    found = outputs.problems(**named) if rank == 0 else outputs.directories_problems(named)
    everyone = collectives.allgather_object(found, "the output-path check")
    options.raise_problems(outputs.on_every_rank(everyone))


def _given(args, table: dict[str, str]) -> dict[str, str]:
    """``{flag: path}`` of the flags in ``table`` (``{dest: flag}``) that were given."""
    return {flag: getattr(args, dest) for dest, flag in table.items() if getattr(args, dest)}


def main(argv: list[str] | None = None) -> int:
    comm = MPI.COMM_WORLD
    interrupt.end_job_on_interrupt(comm.Get_rank())
    try:
        launch.refuse_split_launch()
        args = make_parser().parse_args(argv)
        module = COMMANDS[args.command]
        collectives = Collectives(comm, getattr(args, "watchdog", options.WATCHDOG_SECONDS) or None)
        if module.INPUTS or module.OUTPUT_DIRS:  # a command that reads or writes checkpoints
            checkpoint_key.agreed(collectives)
        module.check(args, comm.Get_size())
        check_paths(args, module, collectives)
        if getattr(args, "device", "cpu") != "cpu":  # one device per local rank, current before any allocation
            chosen = local_device.use_local_device(collectives, args.device)
            said = local_device.describe(collectives, chosen)
            if comm.Get_rank() == 0:
                print(f"devices ({args.device}): {said}", flush=True)
        if not any(v in os.environ for v in THREAD_VARIABLES):
            threadpool_limits(limits=1)  # one BLAS thread per rank: reproducible, and cores not oversubscribed
        return module.run(args, comm)
    except ZeroError as error:
        if comm.Get_rank() == 0:
            print(f"mpizero: error: {error}", file=sys.stderr, flush=True)
        return 2
    except Exception:
        print(f"mpizero: rank {comm.Get_rank()} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        comm.Abort(1)
        return 1
