"""A digest of named tensors that does not depend on how they are split into pieces.

Each element adds ``weight(tensor, index) * bits`` modulo 2**64 to each of two
lanes, where the odd weights come from a hash of the tensor's name and the
element's index in the tensor. A sum does not care about order or grouping, so
ranks digest only the pieces they hold and the partial digests add up to the
digest of the whole, whatever the world size, stage or grouping. Any change of
one element changes both lanes (an odd weight times a nonzero difference is
nonzero modulo 2**64). It tells runs apart; it is no defence against forgery.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from mpizero.arrays import CHUNK, to_host

LANES = 2
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def partial(pieces: Iterable[tuple[str, int, object]]) -> np.ndarray:
    """The lanes of ``(tensor name, first element index, flat values)`` pieces, each element counted once."""
    total = np.zeros(LANES, dtype=np.uint64)
    for name, start, values in pieces:
        keys = np.frombuffer(hashlib.blake2b(name.encode(), digest_size=8 * LANES).digest(), dtype=np.uint64)
        for lo in range(0, values.shape[0], CHUNK):
            chunk = np.ascontiguousarray(to_host(values[lo : lo + CHUNK]))
            bits = chunk.view(_UNSIGNED[chunk.dtype.itemsize]).astype(np.uint64)
            index = np.arange(start + lo, start + lo + chunk.shape[0], dtype=np.uint64)
            weights = _mixed(index[None, :] ^ keys[:, None]) | np.uint64(1)  # (LANES, chunk)
            total += weights @ bits  # uint64 arithmetic wraps: modulo 2**64
    return total


def combine(partials: Iterable[np.ndarray]) -> str:
    """The digest of the whole from the lanes of its pieces, as hex."""
    total = np.zeros(LANES, dtype=np.uint64)
    for lanes in partials:
        total += np.asarray(lanes, dtype=np.uint64)
    return "".join(f"{int(lane):016x}" for lane in total)


def _mixed(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: every input bit moves about half the output bits."""
    z = (z ^ (z >> np.uint64(30))) * _MIX[0]
    z = (z ^ (z >> np.uint64(27))) * _MIX[1]
    return z ^ (z >> np.uint64(31))
