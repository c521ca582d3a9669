"""This machine's memory bandwidth, STREAM-like: copy and in-place add over NumPy arrays far larger than cache.

Run: python benchmarks/bench_bandwidth.py [--mib 1024]   (bench_peers.py --bandwidth prints the same line)
One process, then two at once, each with two float64 arrays of its own. Bytes are counted as STREAM counts them,
those read plus those written (copy: 2 per element, ``a += b``: 3); the write-allocate reads a cache may add are
not counted. Each figure is the best of ``--repeats``; with two processes a repeat starts on both together and
lasts until the slower one ends. The arrays are written before timing, so no page fault is timed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from pathlib import Path

import numpy as np

# name: (kernel on arrays a and b, bytes moved per byte of one array)
KERNELS = {"copy": (lambda a, b: np.copyto(b, a), 2), "add": (lambda a, b: np.add(a, b, out=a), 3)}


def kernel_seconds(mib: int, repeats: int, barrier) -> dict[str, list[float]]:
    """Time each kernel ``repeats`` times over two ``mib``-MiB arrays, each repeat after ``barrier``."""
    a, b = np.full(mib << 17, 1.0), np.full(mib << 17, 2.0)  # 2**17 float64 per MiB
    seconds = {name: [] for name in KERNELS}
    for name, (kernel, _) in KERNELS.items():
        for _ in range(repeats):
            barrier.wait()
            start = time.perf_counter()
            kernel(a, b)
            seconds[name].append(time.perf_counter() - start)
    return seconds


def bandwidth(processes: int, mib: int, repeats: int) -> dict[str, float]:
    """Bytes per second of each kernel, summed over ``processes`` processes that run it at once (best repeat)."""
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(processes), context.SimpleQueue()
    workers = [
        context.Process(target=lambda: results.put(kernel_seconds(mib, repeats, barrier))) for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    seconds = [results.get() for _ in workers]
    for worker in workers:
        worker.join()
    return {
        name: max(processes * moved * (mib << 20) / max(s[name][r] for s in seconds) for r in range(repeats))
        for name, (_, moved) in KERNELS.items()
    }


def l3_cache() -> str:
    """The L3 cache size the kernel reports (for example ``300 MiB``), or ``unknown``."""
    path = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    size = path.read_text().strip() if path.exists() else ""
    return f"{int(size[:-1]) >> 10} MiB" if size.endswith("K") else size or "unknown"


def bandwidth_line(mib: int = 1024, repeats: int = 5) -> str:
    """One line: copy and add bandwidth in GB/s for one process and for two at once."""
    parts = []
    for processes in (1, 2):
        rates = bandwidth(processes, mib, repeats)
        figures = ", ".join(f"{name} {rate / 1e9:.1f} GB/s" for name, rate in rates.items())
        parts.append(f"{processes} process{'es at once' if processes > 1 else ''}: {figures}")
    return (
        f"memory bandwidth (NumPy, two {mib} MiB float64 arrays per process, L3 {l3_cache()}, best of {repeats}, "
        f"bytes read + written): {'; '.join(parts)} (all processes together)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="size of each array, MiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(bandwidth_line(args.mib, args.repeats))


if __name__ == "__main__":
    main()
