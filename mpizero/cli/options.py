"""Options several commands share, each defined once with its range, and the checks they share.

A command adds them with ``add(parser, "model", "precision", ...)``; keyword
arguments change what one command needs differently (``default=``, ``help=``).
Range checks are argparse types, so a bad value is reported before any work;
checks that relate flags to each other raise ``ZeroError``.
"""

from __future__ import annotations

import argparse
import math

from mpizero.arrays import DEVICES
from mpizero.core.config import MAX_HEADROOM
from mpizero.core.optim import OPTIMIZERS
from mpizero.core.precision import PRECISIONS
from mpizero.core.reduce.reduction import REDUCTIONS
from mpizero.core.reduce.scales import HEADROOM
from mpizero.core.stages import STAGES
from mpizero.errors import ZeroError
from mpizero.training.registry import MODELS, Size, entry, formula_setups
from mpizero.training.trainer import DEFAULT_BUCKET_ELEMS

MAX_WHOLE = 2**31 - 1  # a count beyond a C int reaches no loop, buffer or MPI call of a real run


def whole(minimum: int, maximum: int = MAX_WHOLE):
    """An argparse type: a whole number in ``[minimum, maximum]`` (``1e8`` is accepted as 100000000)."""

    def parse(text: str) -> int:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value.is_integer()):
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}")
        value = int(value)
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be from {minimum} to {maximum}, got {value}")
        return value

    return parse


def wholes(minimum: int, maximum: int = MAX_WHOLE):
    """An argparse type: whole numbers in ``[minimum, maximum]``, separated by commas (``3,120``)."""
    one = whole(minimum, maximum)

    def parse(text: str) -> list[int]:
        return [one(part) for part in text.split(",")]

    return parse


def path(text: str) -> str:
    """An argparse type: a file or directory path, refused where empty (it names no place) or holding a NUL."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"must be a path, got {text!r}")
    return text


def number(minimum: float, above: bool = False):
    """An argparse type: a finite number ``>= minimum`` (``> minimum`` when ``above``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'>' if above else '>='} {minimum:g}, got {text!r}"
            )
        return value

    return parse


def watchdog_seconds(text: str) -> float:
    """An argparse type: 0 (no watchdog) or at least ``MIN_WATCHDOG_SECONDS``: a shorter wait than ranks that
    merely drift apart take would end every run in its first collective."""
    value = number(0)(text)
    if 0 < value < MIN_WATCHDOG_SECONDS:
        raise argparse.ArgumentTypeError(
            f"must be 0 (no watchdog) or at least {MIN_WATCHDOG_SECONDS:g} s (a shorter wait would end the run in "
            f"its first collective), got {text!r}"
        )
    return value


MIN_WATCHDOG_SECONDS = 1.0
MAX_RANKS = 2**31 - 1  # an MPI rank is a C int
WATCHDOG_SECONDS = 300.0  # also for the collectives of commands without --watchdog

OPTIONS = {
    "model": (["--model"], dict(default="mlp", choices=list(MODELS), help="the model and the data it trains on")),
    "device": (
        ["--device"],
        dict(
            default="cpu",
            choices=DEVICES,
            help="cpu: NumPy arrays; gpu: CuPy arrays; standin: the GPU code paths on a CPU stand-in for CuPy",
        ),
    ),
    "stage": (
        ["--stage"],
        dict(
            type=int,
            default=2,
            choices=sorted(STAGES),
            help="ZeRO stage: 1 shards optimizer state, 2 also grads, 3 also params",
        ),
    ),
    "steps": (["--steps"], dict(type=whole(1), default=100, help="training steps")),
    "optimizer": (["--optimizer"], dict(default="adamw", choices=sorted(OPTIMIZERS), help="the optimizer")),
    "precision": (
        ["--precision"],
        dict(
            default="fp32",
            choices=sorted(PRECISIONS),
            help="parameter dtype (master weights stay fp32); fp16 scales the loss",
        ),
    ),
    "reduction": (
        ["--reduction"],
        dict(
            default="exact",
            choices=sorted(REDUCTIONS),
            help="exact: bitwise fixed-point sum; native: MPI's float32 sum",
        ),
    ),
    "clip_norm": (["--clip-norm"], dict(type=number(0), default=1.0, help="clip the global gradient norm (0: off)")),
    "seed": (["--seed"], dict(type=whole(0), default=0, help="seed of the initial parameters and the data")),
    "micro_batches": (["--micro-batches"], dict(type=whole(1), default=4, help="micro-batches per step, all ranks")),
    "bucket_elems": (
        ["--bucket-elems"],
        dict(type=whole(1), default=DEFAULT_BUCKET_ELEMS, help="stages 0-2: elements per gradient bucket"),
    ),
    "watchdog": (
        ["--watchdog"],
        dict(type=watchdog_seconds, default=WATCHDOG_SECONDS, help="seconds a collective may wait (0: forever)"),
    ),
    "width": (["--width"], dict(type=whole(1), default=None, help="hidden width (default: mlp 128, transformer 64)")),
    "layers": (["--layers"], dict(type=whole(1), default=2, help="hidden layers (mlp) or blocks (transformer)")),
    "heads": (["--heads"], dict(type=whole(1), default=4, help="transformer: attention heads, a divisor of --width")),
    "block_size": (["--block-size"], dict(type=whole(1), default=32, help="transformer: context length in characters")),
    "ranks": (["--ranks"], dict(type=whole(1, MAX_RANKS), default=4, help="ranks to predict for")),
    "scale_headroom": (
        ["--scale-headroom"],
        dict(
            type=whole(0, MAX_HEADROOM),
            default=HEADROOM,
            help="exact reduction: bits of headroom in the predicted scale; a step beyond it is redone",
        ),
    ),
    "accumulate": (
        ["--accumulate"],
        dict(
            default="auto",
            choices=["auto", "round", "local"],
            help="round: reduce-scatter each micro-batch round; local: one buffer, reduced once; auto: round at 2-3",
        ),
    ),
}
SIZES = ("width", "layers", "heads", "block_size")
MODEL_SETTINGS = ("model", *SIZES, "precision", "reduction", "optimizer", "bucket_elems")


def model_setups(args):
    """Yield ``(stage, formulas.Setup)`` for the model and settings that ``MODEL_SETTINGS`` name, at every stage."""
    task = entry(args.model, Size.of(args))
    return formula_setups(
        task.unit_runs(task.load()), args.ranks, args.precision, args.reduction, args.optimizer, args.bucket_elems
    )


def add(parser: argparse.ArgumentParser, *names: str, **changes) -> None:
    """Add the named shared options; ``changes`` (``default=``, ``help=``, ...) apply to every one of them."""
    for name in names:
        flags, settings = OPTIONS[name]
        parser.add_argument(*flags, **{**settings, **changes})


def raise_problems(problems: list[str]) -> None:
    """Raise one ZeroError listing every problem on one line, if there are any."""
    if problems:
        raise ZeroError("; ".join(problems))


def model_problems(args) -> list[str]:
    """What is wrong with the model sizes the flags name (e.g. heads that do not divide the width)."""
    return entry(args.model, Size.of(args)).problems()
