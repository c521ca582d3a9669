"""``python -m mpizero estimate``: predicted model-state bytes per rank, and traffic per step.

Run: ``python -m mpizero estimate --params 7.5e9 --ranks 64`` (the ZeRO paper's
formulas), or ``python -m mpizero estimate --model transformer --ranks 4``
(mpizero's own buffers for that model, padding counted exactly).
"""

from __future__ import annotations

import argparse
import math

from mpizero.core import formulas
from mpizero.core.memory import format_bytes
from mpizero.core.optim import OPTIMIZERS
from mpizero.core.precision import PRECISIONS
from mpizero.core.stages import STAGES, sharding
from mpizero.training.model import param_shapes
from mpizero.training.trainer import make_groups


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=float, default=None, help="Psi, for the paper's formulas")
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--k", type=int, default=formulas.PAPER_K, help="optimizer bytes per parameter (paper)")
    parser.add_argument("--model", choices=["mlp", "transformer"], default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS))
    parser.add_argument("--reduction", default="exact", choices=["exact", "native"])
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    parser.add_argument("--bucket-elems", type=int, default=1 << 21)
    parser.add_argument("--micro-batches", type=int, default=4, help="global micro-batches per step")


def run(args, comm) -> int:
    if comm.Get_rank() != 0:
        return 0
    if args.ranks < 1:
        raise SystemExit(f"--ranks must be >= 1, got {args.ranks}")
    if args.params is None and args.model is None:
        raise SystemExit("give --params PSI (paper formulas) or --model mlp|transformer")
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


def model_setups(args):
    """Yield ``(stage, Setup, numel)`` for the model the flags describe, at every stage."""
    from mpizero.cli.train import build
    from mpizero.training.datasets import Corpus

    model = build(args, None if args.model == "mlp" else len(Corpus.load().alphabet))
    shapes = param_shapes(model)
    precision = PRECISIONS[args.precision]
    states = len(OPTIMIZERS[args.optimizer](lr=1.0).state_names)
    for stage in STAGES:
        groups = make_groups(model, sharding(stage).params, args.bucket_elems)
        numels = tuple(sum(math.prod(shapes[n]) for n in names) for names in groups)
        wire = 8 if args.reduction == "exact" else 4
        yield stage, formulas.Setup(numels, args.ranks, stage, precision.param_dtype.itemsize, wire, states)


def print_model_table(args) -> None:
    rounds = -(-args.micro_batches // args.ranks)
    print(f"mpizero {args.model}, {args.precision}, {args.reduction} reduction, {args.ranks} ranks: bytes per rank")
    kinds = ("params", "grads", "master", "optimizer", "comm")
    print(f"{'stage':<6}" + "".join(f"{k:>12}" for k in kinds) + f"{'states':>12}{'traffic/step':>14}")
    for stage, setup in model_setups(args):
        held = formulas.engine_bytes(setup)
        states = sum(held[k] for k in ("params", "grads", "master", "optimizer"))
        traffic = sum(formulas.traffic_per_step(setup, rounds).values())
        cells = "".join(f"{format_bytes(held[k]):>12}" for k in kinds)
        print(f"{stage:<6}{cells}{format_bytes(states):>12}{format_bytes(traffic):>14}")
