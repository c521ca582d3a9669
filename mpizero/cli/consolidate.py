"""``python -m mpizero consolidate DIR OUT.npz``: full fp32 parameters by name from a sharded checkpoint.

Like DeepSpeed's ``zero_to_fp32``: padding stripped, any world size and stage;
``DIR`` is a checkpoint or a directory of them (the newest complete one is
used). ``--optimizer`` adds each tensor's optimizer state as ``NAME/STATE``.
The output loads with ``numpy.load(OUT, allow_pickle=False)``. Rank 0 does the
work; a bad checkpoint (checksum, structure, files) exits 2 on every rank and
writes nothing.
"""

from __future__ import annotations

import argparse
import sys

from mpizero.checkpoint import catalog, store
from mpizero.cli import options
from mpizero.comm import agree
from mpizero.comm.collectives import Collectives


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=options.path, help="a checkpoint directory, or a directory of checkpoints")
    parser.add_argument("output", type=options.path, help="the .npz file to write")
    parser.add_argument("--optimizer", action="store_true", help="include the optimizer state")
    options.add(parser, "watchdog", help="seconds the other ranks may wait for rank 0 to finish (0: forever)")


def check(args, world_size: int) -> None:
    """Nothing beyond the output check: the checkpoint itself is validated when it is read."""


OUTPUTS = {"output": "output"}
INPUTS = {"checkpoint": "checkpoint"}
OUTPUT_DIRS: dict[str, str] = {}
WORK_DIRS: dict[str, str] = {}


def run(args, comm) -> int:
    problem = None
    if comm.Get_rank() == 0:
        try:
            _consolidate(args)
        except agree.ZeroError as error:  # a bad checkpoint, or an output that must not be written
            problem = str(error)
        except OSError as error:
            problem = f"cannot write {store.describe(error)}"
    agree.raise_if_any(Collectives(comm, args.watchdog or None), problem, "cannot consolidate")
    return 0


def _consolidate(args) -> None:
    path, torn = catalog.resolve(args.checkpoint)
    for message in torn:
        print(message, file=sys.stderr)
    names = store.consolidate(path, args.output, include_optimizer=args.optimizer)
    print(f"wrote {len(names)} arrays from {path} to {args.output}")
