"""What ``verify`` trains: its models, their data keyed by step and micro-batch, and the engine built for them."""

from __future__ import annotations

import numpy as np

from mpizero.core.engine import ZeroEngine
from mpizero.core.optim import OPTIMIZERS
from mpizero.training import initial
from mpizero.training.mlp import MLP, regression_batch
from mpizero.training.model import param_shapes
from mpizero.training.trainer import make_groups
from mpizero.training.transformer import Transformer

WIDTHS = (13, 31, 29, 5)
VOCAB = 11
MICRO_BATCHES_PER_RANK = 3  # so a rank that loses one of its own micro-batches is caught
# By default step 2 has one micro-batch in all and step 3 four per rank: the count jumps past what step 2's scale
# prediction holds (three), so step 3 is redone, at about the cost of two ordinary steps.
SMALL_STEP, JUMP_STEP, JUMP_PER_RANK = 2, 3, 4


def build_model(name: str):
    """The verify models: a regression MLP with awkward widths, or a small transformer."""
    return MLP(WIDTHS) if name == "mlp" else Transformer(vocab=VOCAB, block_size=8, width=16, heads=2, n_layer=2)


def synthetic_batch(model, seed: int, step: int, micro_batch: int, size: int):
    """Data generated from the seed, keyed by step and micro-batch (never by rank)."""
    if isinstance(model, MLP):
        return regression_batch(WIDTHS, seed, step, micro_batch, size)
    rng = np.random.default_rng([seed, 5, step, micro_batch])
    tokens = rng.integers(0, VOCAB, size=(size, model.block_size + 1))
    return tokens[:, :-1], tokens[:, 1:]


def micro_batches_at(step: int, counts: list[int] | None, size: int) -> int:
    """Step ``step``'s micro-batches over all ranks: ``counts`` cycled, or the default (``JUMP_STEP``)."""
    if counts is not None:
        return counts[(step - 1) % len(counts)]
    if step == SMALL_STEP:
        return 1
    return (JUMP_PER_RANK if step == JUMP_STEP else MICRO_BATCHES_PER_RANK) * size


def make_optimizer(args, model):
    """The optimizer ``--optimizer`` names, with the settings verify trains with."""
    kind = OPTIMIZERS[args.optimizer]
    return kind.for_shapes(param_shapes(model), **kind.verify_settings)


def numerics(args, precision) -> dict:
    """The engine's settings from the flags: the precision's, the watchdog, clipping and the scale headroom."""
    return dict(
        precision.engine_settings(),
        watchdog=args.watchdog or None,
        clip_norm=args.clip_norm or None,
        scale_headroom=args.scale_headroom,
    )


def build_engine(stage: int, args, comm, model, precision, optimizer, device: str) -> ZeroEngine:
    """The engine at ``stage`` on ``device``, its values made shard by shard (``initial.sharded``)."""
    groups = make_groups(model, stage, args.bucket_elems)
    source = initial.sharded(model, args.seed, device)
    return ZeroEngine(
        source, optimizer, comm=comm, groups=groups, stage=stage, reduction=args.reduction, **numerics(args, precision)
    )
