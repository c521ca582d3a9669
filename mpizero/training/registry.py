"""The models the command line trains and estimates, by name: how each is built from the size flags, fed and judged.

``MODELS`` is the one table: ``train``, ``estimate`` and ``plot`` take their
``--model`` choices from it and ask the entry, never the name, what to do.
Every entry has the same interface: ``problems()`` (what is wrong with the
sizes), ``load()`` (its data), ``data_problems(data)`` (what the sizes ask of
the data that it cannot give), ``build(data)``, ``unit_runs(data)`` (the
model's units as runs of alike ones, for the formulas), ``micro_batch(...)``,
``batch_bytes(data, samples, loaded)`` (about the memory the data of a step
takes), ``samples_per_item`` and ``unit`` (for throughput), and
``evaluate(model, data, masters)`` (given the trained params unit by unit, so
that no rank holds them all).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from mpizero.core import formulas
from mpizero.core.optim import OPTIMIZERS
from mpizero.core.precision import PRECISIONS
from mpizero.core.reduce.reduction import REDUCTIONS
from mpizero.core.stages import STAGES
from mpizero.training import readout
from mpizero.training.datasets import Corpus, Digits
from mpizero.training.mlp import MLP
from mpizero.training.runs import Run, group_runs
from mpizero.training.transformer import Transformer


@dataclass(frozen=True)
class Size:
    """The size flags: hidden width (None: the model's default), layers or blocks, heads, context length."""

    width: int | None = None
    layers: int = 2
    heads: int = 4
    block_size: int = 32

    @classmethod
    def of(cls, args) -> Size:
        """The sizes a parsed command line names."""
        return cls(args.width, args.layers, args.heads, args.block_size)


class DigitsMLP:
    """An MLP on 8x8 handwritten digits: 64 inputs, ``layers`` hidden ReLU layers, 10 classes."""

    default_width = 128
    unit = "samples"
    samples_per_item = 1

    def __init__(self, size: Size) -> None:
        self.size = size
        self.width = size.width or self.default_width

    def problems(self) -> list[str]:
        return []

    def data_problems(self, data: Digits) -> list[str]:
        return []

    def load(self) -> Digits:
        return Digits.load()

    def build(self, data: Digits) -> MLP:
        return MLP((data.x.shape[1], *[self.width] * self.size.layers, 10), objective="xent")

    def unit_runs(self, data: Digits) -> list[Run]:
        """The units of ``build(data)`` as runs: the first layer, ``layers - 1`` alike, the classifier."""
        d_in, width = data.x.shape[1], self.width
        layers = [((d_in, width), 1), ((width, width), self.size.layers - 1), ((width, 10), 1)]
        return [Run((a * b, b), count) for (a, b), count in layers]

    def batch_bytes(self, data: Digits, samples: int, loaded: int) -> int:
        """About the bytes of ``loaded`` micro-batches of ``samples`` digits, one of them through forward and
        backward (each layer keeps its input and pre-activation; backward makes one more of each)."""
        d_in, outputs = data.x.shape[1], self.width * self.size.layers + 10
        return samples * (loaded * (4 * d_in + 8) + 4 * (2 * d_in + 4 * outputs))

    def micro_batch(self, data: Digits, seed: int, step: int, micro_batch: int, size: int, count: int):
        return data.micro_batch(seed, step, micro_batch, size, count)

    def evaluate(self, model: MLP, data: Digits, masters: Iterable[dict]) -> str:
        """Held-out accuracy; ``masters`` gives each unit's params in turn (``readout.unit_masters``)."""
        x, y = data.held_out()
        out = readout.forward(model.units, x, masters)
        return f"held-out accuracy: {np.mean(out.argmax(axis=1) == y):.4f} on {len(y)} digits"


class TextTransformer:
    """A character-level transformer on the shipped text corpus: ``layers`` blocks of ``heads`` heads."""

    default_width = 64
    unit = "tokens"

    def __init__(self, size: Size) -> None:
        self.size = size
        self.width = size.width or self.default_width

    @property
    def samples_per_item(self) -> int:
        return self.size.block_size

    def problems(self) -> list[str]:
        if self.width % self.size.heads:
            return [f"--width {self.width} must be a multiple of --heads {self.size.heads}"]
        return []

    def data_problems(self, data: Corpus) -> list[str]:
        """A window of ``block_size`` + 1 characters must fit in the training text and in the held-out text."""
        held_out = len(data.tokens) - data.split
        longest = min(data.split - 2, held_out - 1)
        if self.size.block_size > longest:
            return [
                f"--block-size {self.size.block_size} is longer than the corpus allows ({data.split:,} training and "
                f"{held_out:,} held-out characters): at most {longest:,}"
            ]
        return []

    def load(self) -> Corpus:
        return Corpus.load()

    def build(self, data: Corpus) -> Transformer:
        return Transformer(len(data.alphabet), self.size.block_size, self.width, self.size.heads, self.size.layers)

    def unit_runs(self, data: Corpus) -> list[Run]:
        """The units of ``build(data)`` as runs: the embedding, ``layers`` alike blocks, the head."""
        embedding, block, head = Transformer(
            len(data.alphabet), self.size.block_size, self.width, self.size.heads, 1
        ).units
        return [Run(_numels(embedding), 1), Run(_numels(block), self.size.layers), Run(_numels(head), 1)]

    def batch_bytes(self, data: Corpus, samples: int, loaded: int) -> int:
        """About the bytes of ``loaded`` micro-batches of ``samples`` windows, one of them through forward and
        backward: per token each block keeps about 16 widths and one attention row per head, the head a few
        vocabulary-sized rows; backward makes about one block's worth more."""
        t, width, heads, vocab = self.size.block_size, self.width, self.size.heads, len(data.alphabet)
        block = 16 * width + heads * t
        return samples * t * (loaded * 16 + 4 * ((self.size.layers + 1) * block + 4 * vocab))

    def micro_batch(self, data: Corpus, seed: int, step: int, micro_batch: int, size: int, count: int):
        return data.micro_batch(seed, step, micro_batch, size, self.size.block_size)

    def evaluate(self, model: Transformer, data: Corpus, masters: Iterable[dict]) -> str:
        """Held-out loss; ``masters`` gives each unit's params in turn (``readout.unit_masters``)."""
        x, y = data.held_out(self.size.block_size)
        loss, _ = model.loss(readout.forward(model.units, x, masters), y)
        return f"held-out loss: {loss:.4f} nats/char (unigram entropy {data.unigram_entropy():.4f})"


MODELS = {"mlp": DigitsMLP, "transformer": TextTransformer}


def entry(name: str, size: Size):
    """The named model at the given sizes."""
    return MODELS[name](size)


def _numels(unit) -> tuple[int, ...]:
    return tuple(math.prod(shape) for shape in unit.param_shapes().values())


def formula_setups(units: list[Run], ranks: int, precision: str, reduction: str, optimizer: str, bucket_elems: int):
    """Yield ``(stage, formulas.Setup)`` for a model of these units trained as these settings say, at every stage.

    ``units``: the model's units as runs of alike ones (an entry's ``unit_runs``), so no size takes long.
    """
    states = OPTIMIZERS[optimizer].states_per_element()
    param_bytes = PRECISIONS[precision].param_dtype.itemsize
    wire_bytes, round_bytes = REDUCTIONS[reduction].wire_dtype.itemsize, REDUCTIONS[reduction].round_dtype.itemsize
    for stage in STAGES:
        groups = group_runs(units, stage, bucket_elems)
        numels, counts = tuple(sum(g.tensors) for g in groups), tuple(g.count for g in groups)
        setup = formulas.Setup(numels, ranks, stage, param_bytes, wire_bytes, round_bytes, states, group_counts=counts)
        yield stage, setup
