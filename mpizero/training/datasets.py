"""Real data that works offline: handwritten digits and a text corpus, both shipped in the package.

Every micro-batch is a function of (seed, step, micro-batch index) only, never
of the rank, so the same global batch is seen at any world size.
"""

from __future__ import annotations

import gzip
from collections import Counter
from dataclasses import dataclass
from importlib import resources

import numpy as np

HELD_OUT_DIGITS = 297


def _data_file(name: str):
    return resources.files(__package__) / "data" / name


@dataclass(frozen=True)
class Digits:
    """8x8 digit images (inputs scaled to [0, 1]); the last 297 are held out for evaluation."""

    x: np.ndarray
    y: np.ndarray

    @classmethod
    def load(cls) -> Digits:
        with gzip.open(_data_file("digits.csv.gz").open("rb")) as raw:
            table = np.loadtxt(raw, delimiter=",", dtype=np.float32)
        return cls((table[:, :-1] / np.float32(16.0)).astype(np.float32), table[:, -1].astype(np.int64))

    @property
    def train_size(self) -> int:
        return len(self.y) - HELD_OUT_DIGITS

    def micro_batch(self, seed: int, step: int, micro_batch: int, size: int, micro_batches: int):
        """Micro-batch ``micro_batch`` of ``micro_batches`` in the step's global batch.

        Global batches walk an endless stream of the training set, reshuffled each epoch.
        """
        positions = ((step - 1) * micro_batches + micro_batch) * size + np.arange(size)
        epochs, offsets = np.divmod(positions, self.train_size)
        rows = np.empty(size, dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            in_epoch = epochs == epoch
            rows[in_epoch] = np.random.default_rng([seed, 3, epoch]).permutation(self.train_size)[offsets[in_epoch]]
        return self.x[rows], self.y[rows]

    def held_out(self):
        return self.x[self.train_size :], self.y[self.train_size :]


@dataclass(frozen=True)
class Corpus:
    """A character-level text corpus: the first 90% for training, the rest held out."""

    tokens: np.ndarray
    alphabet: str

    @classmethod
    def load(cls) -> Corpus:
        text = _data_file("gpl-3.0.txt").read_text(encoding="utf-8")
        alphabet = "".join(sorted(set(text)))
        lookup = {c: i for i, c in enumerate(alphabet)}
        return cls(np.array([lookup[c] for c in text], dtype=np.int64), alphabet)

    @property
    def split(self) -> int:
        return len(self.tokens) * 9 // 10

    def micro_batch(self, seed: int, step: int, micro_batch: int, size: int, block_size: int):
        """``size`` random windows of the training text: inputs and next-character targets (size, block_size)."""
        rng = np.random.default_rng([seed, 4, step, micro_batch])
        starts = rng.integers(0, self.split - block_size - 1, size=size)
        x = np.stack([self.tokens[s : s + block_size] for s in starts])
        y = np.stack([self.tokens[s + 1 : s + block_size + 1] for s in starts])
        return x, y

    def held_out(self, block_size: int):
        """Consecutive windows covering the held-out text."""
        rest = self.tokens[self.split :]
        count = (len(rest) - 1) // block_size
        x = rest[: count * block_size].reshape(count, block_size)
        y = rest[1 : count * block_size + 1].reshape(count, block_size)
        return x, y

    def unigram_entropy(self) -> float:
        """Entropy of the character frequencies in nats: the loss of a model that ignores context."""
        counts = np.array(list(Counter(self.tokens.tolist()).values()), dtype=np.float64)
        p = counts / counts.sum()
        return float(-(p * np.log(p)).sum())
