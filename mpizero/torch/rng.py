"""Randomness keyed to the data, not to the rank: ``with zero.micro_batch(i):``.

Inside the block torch's generators (CPU, and the model's CUDA device) are
seeded from the run's seed, the step and ``i``, the micro-batch's index in the
step's global batch; on leaving, they are what they were before, so the
caller's own random stream is untouched. Dropout and other random layers then
draw the same numbers for micro-batch ``i`` at any world size, however the
global batch is split over ranks, and again when a step runs its closure a
second time. The seed is the one torch was seeded with when ``shard`` ran
(``torch.initial_seed()``), agreed by every rank, unless ``seed=`` is given.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch

SEED_BITS = 63  # torch.manual_seed takes a non-negative int64


def key(seed: int, step: int, index: int) -> int:
    """The seed of micro-batch ``index`` of step ``step``: a hash, so nearby keys give unrelated streams."""
    text = f"mpizero micro-batch {seed} {step} {index}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> (64 - SEED_BITS)


@contextlib.contextmanager
def seeded(seed: int, step: int, index: int, device: torch.device) -> Iterator[None]:
    """Run the block with torch's generators seeded by ``key``; restore them afterwards."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.manual_seed(key(seed, step, index))
        yield
