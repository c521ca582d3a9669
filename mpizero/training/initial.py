"""The built-in models' initial values: built whole (``full``), or piece by piece for the engine (``sharded``).

A model names a rule per tensor (``init_rule(name, shape)``): ``Normal(scale)``
draws the tensor's elements from the model's one generator,
``default_rng([seed, 0])``, in model order, as ``standard_normal * scale`` in
float64 rounded to float32; ``Constant(value)`` draws nothing. ``full`` is the
plain build: every tensor, one after the other. ``sharded`` gives the same bits
as a ``ShardedInit``, whose ``fill`` makes only the pieces a rank asks for.

An element's value depends on every draw before it (the normals are made by
rejection, so a draw takes a varying number of the generator's words), so a
piece cannot be computed on its own: ``_Stream`` walks the generator to it,
keeping the generator's state every ``CHECKPOINT`` draws, so that a piece asked
for again, or out of order (stages 0-2 ask in backward order), starts from the
nearest state kept. A rank thus draws the stream about once and holds at most
one chunk of ``CHECKPOINT`` float64 draws besides the piece it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpizero.arrays import device_module, to_device
from mpizero.core.sharded_init import ShardedInit
from mpizero.training.model import param_shapes

CHECKPOINT = 1 << 20  # draws between kept generator states, and the most drawn at once (8 MiB of float64)


@dataclass(frozen=True)
class Normal:
    """Elements drawn from the model's generator: ``standard_normal * scale`` in float64, rounded to float32."""

    scale: float


@dataclass(frozen=True)
class Constant:
    """Every element ``value``; nothing drawn."""

    value: float


def generator(seed: int) -> np.random.Generator:
    """The one generator a model's initial values are drawn from."""
    return np.random.default_rng([seed, 0])


def full(model, seed: int) -> dict[str, np.ndarray]:
    """Every tensor's initial values, drawn in model order: the same on every rank."""
    rng, params = generator(seed), {}
    for name, shape in param_shapes(model).items():
        rule = model.init_rule(name, shape)
        if isinstance(rule, Normal):
            params[name] = (rng.standard_normal(shape) * rule.scale).astype(np.float32)
        else:
            params[name] = np.full(shape, rule.value, np.float32)
    return params


def sharded(model, seed: int, device: str = "cpu") -> ShardedInit:
    """``full(model, seed)`` as a ``ShardedInit``: the same bits, made only for the pieces a rank asks for."""
    shapes = param_shapes(model)
    rules = {name: model.init_rule(name, shape) for name, shape in shapes.items()}
    return ShardedInit(shapes, _Stream(shapes, rules, seed, device), f"{model!r}.init({seed})", device)


class _Stream:
    """``fill(name, start, stop)`` over the draws ``full`` makes, walking one generator with kept states."""

    def __init__(self, shapes: dict, rules: dict, seed: int, device: str) -> None:
        self.rules, self.xp = rules, device_module(device)
        self.first_draw, drawn = {}, 0  # the draw at which each drawn tensor starts
        for name, shape in shapes.items():
            if isinstance(rules[name], Normal):
                self.first_draw[name], drawn = drawn, drawn + int(np.prod(shape))
        self.rng, self.position = generator(seed), 0  # the generator has made ``position`` draws
        self.states = [self.rng.bit_generator.state]  # states[k]: after k * CHECKPOINT draws

    def __call__(self, name: str, start: int, stop: int):
        rule, out = self.rules[name], np.empty(stop - start, np.float32)
        if isinstance(rule, Normal):
            self._seek(self.first_draw[name] + start)
            self._draw(out, rule.scale)
        else:
            out[...] = rule.value
        return out if self.xp is np else to_device(out, self.xp)

    def _seek(self, target: int) -> None:
        """Bring the generator to ``target`` draws, from where it is or from the nearest state kept before it."""
        k = min(target // CHECKPOINT, len(self.states) - 1)
        if not k * CHECKPOINT <= self.position <= target:
            self.rng.bit_generator.state, self.position = self.states[k], k * CHECKPOINT
        self._draw(None, 1.0, target - self.position)

    def _draw(self, out: np.ndarray | None, scale: float, count: int | None = None) -> None:
        """Make ``count`` draws (default: ``out.size``) in chunks that end at checkpoints; keep them in ``out``."""
        count = out.size if count is None else count
        done = 0
        while done < count:
            n = min(count - done, CHECKPOINT - self.position % CHECKPOINT)
            draws = self.rng.standard_normal(n)
            if out is not None:
                out[done : done + n] = draws * scale  # float64 product, rounded to float32 as ``full``'s astype
            done, self.position = done + n, self.position + n
            if self.position == len(self.states) * CHECKPOINT:
                self.states.append(self.rng.bit_generator.state)
