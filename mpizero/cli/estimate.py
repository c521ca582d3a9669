"""``python -m mpizero estimate``: predicted model-state bytes per rank, and traffic per step.

Run: ``python -m mpizero estimate --params 7.5e9 --ranks 64`` (the ZeRO paper's
formulas), or ``python -m mpizero estimate --model transformer --ranks 4``
(mpizero's own buffers for that model, padding counted exactly).
"""

from __future__ import annotations

import argparse

from mpizero.cli import options
from mpizero.core import formulas
from mpizero.core.errors import ZeroError
from mpizero.core.memory import format_bytes

OUTPUTS: dict[str, str] = {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params", type=options.number(0, above=True), default=None, help="Psi, for the paper's formulas"
    )
    options.add(parser, "ranks", default=None, required=True)
    parser.add_argument(
        "--k", type=options.whole(0), default=formulas.PAPER_K, help="paper: optimizer bytes per parameter"
    )
    options.add(parser, "model", default=None, help="predict mpizero's own buffers for this model")
    options.add(parser, *options.MODEL_SETTINGS[1:])
    options.add(parser, "micro_batches", help="micro-batches per step, all ranks (stage 3 gathers once per round)")


def check(args, world_size: int) -> None:
    """Raise a ZeroError unless there is something to estimate, at sizes the model can have."""
    if args.params is None and args.model is None:
        raise ZeroError("give --params PSI (the paper's formulas) or --model NAME (mpizero's buffers), or both")
    if args.model is not None:
        options.raise_problems(options.model_problems(args))


def run(args, comm) -> int:
    if comm.Get_rank() != 0:
        return 0
    if args.params is not None:
        print_paper_table(args.params, args.ranks, args.k)
    if args.model is not None:
        print_model_table(args)
    return 0


def print_paper_table(psi: float, ranks: int, k: int) -> None:
    print(f"ZeRO paper, mixed-precision Adam (K = {k}), Psi = {psi:g} parameters, N = {ranks} ranks")
    print(f"{'configuration':<20} {'model states per rank':>22}")
    for name, nbytes in formulas.paper_model_states(psi, ranks, k).items():
        print(f"{name:<20} {nbytes / 1e9:>19.1f} GB")


def print_model_table(args) -> None:
    rounds = -(-args.micro_batches // args.ranks)
    print(f"mpizero {args.model}, {args.precision}, {args.reduction} reduction, {args.ranks} ranks: bytes per rank")
    kinds = ("params", "grads", "master", "optimizer", "comm")
    print(f"{'stage':<6}" + "".join(f"{k:>12}" for k in kinds) + f"{'states':>12}{'traffic/step':>14}")
    for stage, setup in options.model_setups(args):
        held = formulas.engine_bytes(setup)
        states = sum(held[k] for k in ("params", "grads", "master", "optimizer"))
        traffic = sum(formulas.traffic_per_step(setup, rounds).values())
        cells = "".join(f"{format_bytes(held[k]):>12}" for k in kinds)
        print(f"{stage:<6}{cells}{format_bytes(states):>12}{format_bytes(traffic):>14}")
