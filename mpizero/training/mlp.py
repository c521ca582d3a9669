"""A NumPy MLP with hand-written backward: a sequence of dense ReLU units.

ReLU keeps every operation exactly rounded, so a gradient depends only on its
inputs. The tests check every backward against finite differences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpizero.arrays import array_module
from mpizero.training import initial
from mpizero.training.initial import Normal
from mpizero.training.model import mean_squared_error, softmax_cross_entropy


@dataclass(frozen=True)
class Dense:
    """``out = relu(x @ w + b)``, or without the ReLU on the last unit."""

    name: str
    d_in: int
    d_out: int
    relu: bool

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {f"{self.name}.w": (self.d_in, self.d_out), f"{self.name}.b": (self.d_out,)}

    def forward(self, x, params):
        z = x @ params[f"{self.name}.w"] + params[f"{self.name}.b"]  # (B, d_out)
        out = array_module(z).maximum(z, 0) if self.relu else z
        return out, (x, z)

    def backward(self, dout, cache, params):
        x, z = cache
        dz = dout * (z > 0) if self.relu else dout  # (B, d_out)
        grads = {f"{self.name}.w": x.T @ dz, f"{self.name}.b": dz.sum(axis=0)}
        dx = dz @ params[f"{self.name}.w"].T  # (B, d_in)
        return dx, grads


@dataclass(frozen=True)
class MLP:
    """Dense ReLU units of the given widths; ``mse`` regression or ``xent`` classification loss."""

    widths: tuple[int, ...]
    objective: str = "mse"

    @property
    def units(self) -> list[Dense]:
        last = len(self.widths) - 2
        return [Dense(f"l{i}", a, b, i < last) for i, (a, b) in enumerate(zip(self.widths, self.widths[1:]))]

    def init_rule(self, name: str, shape: tuple[int, ...]) -> Normal:
        """He-initialised weights; biases zero, but drawn (times 0.0, so a negative draw gives -0.0) as ever."""
        return Normal(float(np.sqrt(2.0 / shape[0])) if len(shape) == 2 else 0.0)

    def init(self, seed: int) -> dict[str, np.ndarray]:
        """The initial float32 parameters, the same on every rank."""
        return initial.full(self, seed)

    def loss(self, out, target):
        if self.objective == "xent":
            return softmax_cross_entropy(out, target)
        return mean_squared_error(out, target)


def regression_batch(widths: tuple[int, ...], seed: int, step: int, micro_batch: int, size: int):
    """Return ``(x, y)`` float32 for one micro-batch, keyed by seed, step and micro-batch index."""
    teacher = np.random.default_rng([seed, 1]).standard_normal((widths[0], widths[-1]))
    rng = np.random.default_rng([seed, 2, step, micro_batch])
    x = rng.standard_normal((size, widths[0]))
    y = np.sin(x @ teacher) + 0.1 * rng.standard_normal((size, widths[-1]))
    return x.astype(np.float32), y.astype(np.float32)
