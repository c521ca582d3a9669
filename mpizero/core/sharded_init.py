"""Initial parameter values made piece by piece, so that no rank ever holds more of them than it keeps.

A ``ShardedInit`` describes a model's initial values without holding them: the
tensors' shapes in model order, and ``fill(name, start, stop)``, which returns
elements ``[start, stop)`` of tensor ``name`` flattened (tensor-relative
offsets) as a 1-D float32 array. ``ZeroEngine`` asks only for what this rank
holds: whole tensors at stages 0-2 (every rank holds the full params), only the
pieces of its shard range at stage 3. It asks group by group in group order and,
within a group, tensor by tensor in layout order, each tensor at most once per
group, so a caller may make one unit's values at a time and free them.

``philox_normal`` is such an initializer whose values do not depend on who asks:
element i of a tensor comes from a counter-based generator (Philox) keyed by the
seed and the tensor's name, at the counter of element i, so every rank at every
world size makes the same bits for it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from math import prod

import numpy as np

from mpizero.arrays import DEVICES, array_module, device_module, device_of, to_device

BLOCK = 1 << 16  # elements drawn together: a block's values never depend on the range asked for
RAW_PER_COUNTER = 4  # Philox4x64 yields four 64-bit words per counter value


@dataclass(frozen=True)
class ShardedInit:
    """A model's initial values as shapes and a ``fill`` the engine calls for the ranges a rank holds.

    ``fill(name, start, stop)`` must return a 1-D float32 array of ``stop - start``
    elements on ``device`` (NumPy for ``cpu``, CuPy for ``gpu``), the same values
    whichever rank asks. ``identity`` describes the initializer (e.g.
    ``"philox_normal(seed=0, std=0.02)"``); every rank must give the same, as it
    enters the set-up signature in place of the values themselves.
    """

    shapes: Mapping[str, tuple[int, ...]]
    fill: Callable[[str, int, int], object] = field(compare=False)
    identity: str
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not isinstance(self.shapes, Mapping) or not self.shapes:
            raise ValueError(f"shapes must be a non-empty dict of name -> shape, got {self.shapes!r}")
        shapes = {}
        for name, shape in self.shapes.items():
            dims = tuple(shape) if isinstance(shape, (tuple, list)) else None
            if not isinstance(name, str) or dims is None or not all(_positive_int(d) for d in dims):
                raise ValueError(f"shape of {name!r} must be a tuple of positive ints, got {shape!r}")
            shapes[name] = tuple(int(d) for d in dims)
        object.__setattr__(self, "shapes", shapes)
        if not callable(self.fill):
            raise ValueError(f"fill must be callable as fill(name, start, stop), got {self.fill!r}")
        if not isinstance(self.identity, str) or not self.identity:
            raise ValueError(f"identity must be a non-empty string describing the initializer, got {self.identity!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")

    def numel(self, name: str) -> int:
        return prod(self.shapes[name])


def _positive_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


def from_arrays(params: Mapping) -> ShardedInit:
    """The engine's view of full arrays: ``fill`` slices them (their values enter the signature separately)."""
    first = next(iter(params.values()))
    return ShardedInit(
        {name: tuple(a.shape) for name, a in params.items()},
        lambda name, start, stop: params[name].reshape(-1)[start:stop],
        "full arrays",
        device_of(first),
    )


class FillError(Exception):
    """``fill`` broke its contract on this rank; the engine agrees on it with every rank before raising."""


def checked_fill(init: ShardedInit, xp) -> Callable[[str, int, int], object]:
    """Wrap ``init.fill`` so that an exception or a wrong array becomes a ``FillError`` naming the call."""

    def fill(name: str, start: int, stop: int):
        call = f"fill({name!r}, {start}, {stop})"
        try:
            values = init.fill(name, start, stop)
        except MemoryError:
            raise  # the set-up's own failure, not fill's: reported as such
        except Exception as error:  # any other failure must reach the agreement, not end this rank alone
            raise FillError(f"{call} raised {type(error).__name__}: {error}") from error
        problem = values_problem(values, stop - start, xp)
        if problem is not None:
            raise FillError(f"{call} returned {problem}")
        return values

    return fill


def values_problem(values, numel: int, xp) -> str | None:
    """What is wrong with ``fill``'s answer for ``numel`` elements on ``xp`` (None when nothing is)."""
    expected = f"{xp.__name__}.ndarray"
    kind = f"{type(values).__module__}.{type(values).__name__}"
    if (xp is np and not isinstance(values, np.ndarray)) or array_module(values) is not xp:
        return f"a {kind}, expected a {expected}"
    if tuple(values.shape) != (numel,):
        return f"shape {list(values.shape)}, expected [{numel}]"
    if values.dtype != np.float32:
        return f"dtype {values.dtype}, expected float32"
    return None


def philox_normal(
    shapes: Mapping[str, tuple[int, ...]],
    seed: int,
    std: float | Mapping[str, float] = 0.02,
    mean: float | Mapping[str, float] = 0.0,
    device: str = "cpu",
) -> ShardedInit:
    """Normal(mean, std) values, element i of each tensor the same bits whichever rank makes it.

    ``std`` and ``mean`` are one number, or one per tensor name (a tensor with
    std 0 holds ``mean`` exactly: unit gains, zero biases).
    """
    stds, means = _per_tensor(shapes, std, "std"), _per_tensor(shapes, mean, "mean")
    fill = _PhiloxNormal(int(seed), stds, means, {n: prod(s) for n, s in shapes.items()}, device)
    identity = f"philox_normal(seed={int(seed)}, std={std!r}, mean={mean!r})"
    return ShardedInit(shapes, fill, identity, device)


def _per_tensor(shapes: Mapping, value, what: str) -> dict[str, float]:
    if not isinstance(value, Mapping):
        return dict.fromkeys(shapes, float(value))
    missing = [name for name in shapes if name not in value]
    if missing:
        raise ValueError(f"{what} gives no value for tensors {missing}")
    return {name: float(value[name]) for name in shapes}


@dataclass(frozen=True)
class _PhiloxNormal:
    """``fill`` of ``philox_normal``: Box-Muller on Philox's output, drawn in whole blocks of ``BLOCK``."""

    seed: int
    stds: dict
    means: dict
    numels: dict
    device: str

    def __call__(self, name: str, start: int, stop: int):
        out = np.empty(stop - start, dtype=np.float32)
        std, mean = self.stds[name], self.means[name]
        if std == 0.0:
            out[...] = mean
        else:
            key = tensor_key(self.seed, name)
            for index in range(start // BLOCK, -(-stop // BLOCK)):
                first = index * BLOCK
                lo, hi = max(start, first), min(stop, first + BLOCK)
                block = standard_normal_block(key, self.numels[name], index)
                out[lo - start : hi - start] = block[lo - first : hi - first] * std + mean
        return out if self.device == "cpu" else to_device(out, device_module(self.device))


def tensor_key(seed: int, name: str) -> int:
    """Philox's 128-bit key for one tensor: a digest of the seed and the tensor's name."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=16).digest(), "little")


def standard_normal_block(key: int, numel: int, index: int) -> np.ndarray:
    """Float64 standard normals of elements ``[index * BLOCK, ...)`` of a tensor of ``numel`` elements.

    Element i uses Philox's 64-bit word i (counter ``i // 4``): elements 2j and
    2j + 1 are the cosine and sine of one Box-Muller pair of words 2j, 2j + 1.
    """
    first = index * BLOCK
    count = min(BLOCK, numel - first)
    pairs = -(-count // 2)
    words = np.random.Generator(np.random.Philox(key=key, counter=first // RAW_PER_COUNTER)).random(2 * pairs)
    radius = np.sqrt(-2.0 * np.log1p(-words[0::2]))  # 1 - u is in (0, 1]: no log of zero
    angle = (2.0 * np.pi) * words[1::2]
    normals = np.empty(2 * pairs)
    normals[0::2] = radius * np.cos(angle)
    normals[1::2] = radius * np.sin(angle)
    return normals[:count]
