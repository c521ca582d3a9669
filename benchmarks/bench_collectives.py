"""Gradient reduction and parameter gather: mpizero's paths against raw mpi4py, same buffers.

Run: mpiexec -n 2 python benchmarks/bench_collectives.py [--sizes-mib 1 16 64] [--repeat 5]
Prints, per float32 buffer size, the median seconds of each path and its ratio to raw
``Reduce_scatter_block`` / ``Allgather`` on float32 (ratios are what to compare: one run).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpizero.collectives import Collectives
from mpizero.layout import FlatLayout
from mpizero.reduction import REDUCTIONS


def median_seconds(comm, fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return float(np.median(times))


def reduction_path(coll, reduction, grads, specs, shard_out):
    """Encode this rank's gradient, reduce-scatter it, decode the averaged shard (what a step does)."""
    local = np.empty(grads["g"].size, dtype=reduction.wire_dtype)
    reduced = np.empty(shard_out.size, dtype=reduction.wire_dtype)
    scale = reduction.scale_for(1.0, coll.comm.Get_size())

    def run():
        reduction.encode(local, [grads], specs, scale)
        coll.reduce_scatter(local, reduced)
        reduction.decode(reduced, scale, coll.comm.Get_size(), shard_out)

    return run


def measure(comm, coll, mib: int, repeat: int) -> list[tuple]:
    """Time every path on one buffer size; return ``(MiB, path, seconds, GiB/s, ratio to raw)`` rows."""
    size = comm.Get_size()
    numel = mib * 2**20 // 4 // size * size
    grad = np.random.default_rng(comm.Get_rank()).uniform(-1, 1, numel).astype(np.float32)
    specs = FlatLayout.from_shapes({"g": (numel,)}).specs
    shard = np.empty(numel // size, np.float32)
    full = np.zeros(numel, np.float32)
    raw_rs = median_seconds(comm, lambda: comm.Reduce_scatter_block(grad, shard, op=MPI.SUM), repeat)
    raw_ag = median_seconds(comm, lambda: comm.Allgather(shard, full), repeat)
    paths = {
        "raw Reduce_scatter_block f32": raw_rs,
        "mpizero native (encode+RS+decode)": median_seconds(
            comm, reduction_path(coll, REDUCTIONS["native"], {"g": grad}, specs, shard), repeat
        ),
        "mpizero exact (int64 encode+RS+decode)": median_seconds(
            comm, reduction_path(coll, REDUCTIONS["exact"], {"g": grad}, specs, shard), repeat
        ),
        "raw Allgather f32": raw_ag,
        "mpizero allgather_in_place": median_seconds(comm, lambda: coll.allgather_in_place(full), repeat),
    }
    rows = []
    for name, seconds in paths.items():
        base = raw_ag if "gather" in name.lower() else raw_rs
        rows.append((mib, name, seconds, mib / seconds / 1024, seconds / base))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    coll = Collectives(comm)
    rows = [row for mib in args.sizes_mib for row in measure(comm, coll, mib, args.repeat)]
    if comm.Get_rank() == 0:
        print(f"ranks {comm.Get_size()}, median of {args.repeat}, float32 buffer sizes")
        print(f"{'MiB':>5}  {'path':<40} {'seconds':>9} {'GiB/s':>7} {'x raw':>6}")
        for mib, name, seconds, rate, ratio in rows:
            print(f"{mib:>5}  {name:<40} {seconds:>9.4f} {rate:>7.2f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()
