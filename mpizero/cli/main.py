"""Command line: ``mpiexec -n N python -m mpizero {example,verify,train,estimate,plot,consolidate} [options]``.

One rank works too: ``python -m mpizero verify``. An error every rank agreed on
is printed once and exits with status 2; any other exception on any rank prints
that rank's traceback and aborts the whole job, so no rank waits forever.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from mpi4py import MPI
from threadpoolctl import threadpool_limits

from mpizero.cli import consolidate, estimate, example, plot, train, verify
from mpizero.comm import launch
from mpizero.comm.agree import ZeroError

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

COMMANDS = {
    "example": example,
    "verify": verify,
    "train": train,
    "estimate": estimate,
    "plot": plot,
    "consolidate": consolidate,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpizero", description="ZeRO stages 0-3 over MPI")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        module.add_arguments(commands.add_parser(name, help=module.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    if not any(v in os.environ for v in THREAD_VARIABLES):
        threadpool_limits(limits=1)  # one BLAS thread per rank: reproducible, and cores not oversubscribed
    comm = MPI.COMM_WORLD
    try:
        launch.refuse_split_launch(comm)
        return COMMANDS[args.command].run(args, comm)
    except ZeroError as error:
        if comm.Get_rank() == 0:
            print(f"mpizero: error: {error}", file=sys.stderr, flush=True)
        return 2
    except BaseException:
        print(f"mpizero: rank {comm.Get_rank()} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        comm.Abort(1)
        return 1
