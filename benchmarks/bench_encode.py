"""The host's exact encode per element and micro-batch: single, paired, and DDP's float32 add, on one core.

Run: python benchmarks/bench_encode.py [--elements N] [--repeats R]
Adds two micro-batches' float32 gradients (N elements each) into an int64 sum as two single encodes
(``kernels.encode``: 20 bytes an element and micro-batch after the first) and as one paired encode
(``kernels.encode_pair``: 12), and into a float32 buffer as DDP's ``.grad += dW`` does (12); prints the best
of R timings of each as nanoseconds per element and micro-batch, and checks that the two encodes' bytes agree.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mpizero.core.reduce import exact, kernels


def best_seconds(action, repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``action()``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=8_400_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal(args.elements).astype(np.float32) for _ in range(2))
    singles, paired, added = np.zeros(args.elements, np.int64), np.zeros(args.elements, np.int64), np.zeros_like(x)
    k, every = 30, exact.INF_BITS

    def two_singles():
        kernels.encode(singles, x, k, 0, every, False)
        kernels.encode(singles, y, k, 0, every, False)

    def one_pair():
        kernels.encode_pair(paired, x, y, k, 0, every, False)

    def float32_adds():
        np.add(added, x, out=added)
        np.add(added, y, out=added)

    per = 1e9 / (2 * args.elements)
    rows = [
        (name, best_seconds(f, args.repeats) * per)
        for name, f in (
            ("two single encodes", two_singles),
            ("one paired encode", one_pair),
            ("float32 add (DDP)", float32_adds),
        )
    ]
    print(f"{args.elements:,} elements, best of {args.repeats}, kernel: {kernels.backend()}")
    print(f"{'':22}ns per element and micro-batch")
    for name, ns in rows:
        print(f"{name:22}{ns:10.3f}")
    print("paired bytes equal the singles':", paired.tobytes() == singles.tobytes())


if __name__ == "__main__":
    main()
