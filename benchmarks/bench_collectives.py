"""Gradient reduction and parameter gather: mpizero's paths against raw mpi4py, same buffers.

Run: mpiexec -n 2 python benchmarks/bench_collectives.py [--sizes-mib 1 16 64] [--repeat 5]
Prints, per float32 gradient size, the median seconds of each path and its time
relative to the raw mpi4py call it replaces on the same buffers (x raw < 1: faster);
i64 rows move the exact reduction's int64 wire. The two "round" rows are one round of stages 2-3 off shared
memory: encoded into int64 and reduce-scattered, or encoded as float32 (one contribution's exact values are
float32 integers), sent whole to the owners (all-to-all) and widened there into int64. Ratios are what to
compare: one run.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

from mpizero.comm.collectives import Collectives
from mpizero.comm.paths import ENV_VAR
from mpizero.comm.transports.pieces import reduce_scatter_in_pieces
from mpizero.core.layout import FlatLayout
from mpizero.core.reduce.reduction import REDUCTIONS
from mpizero.core.reduce.scales import HEADROOM
from mpizero.progress import progress


def median_seconds(comm, fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return float(np.median(times))


def reduction_path(coll, reduction, grads, layout, shard_out):
    """Encode this rank's gradient, reduce-scatter it, decode the averaged shard (what a stage 2-3 step does)."""
    numel, size = grads["g"].size, coll.comm.Get_size()
    local = coll.shared_buffer(numel, reduction.wire_dtype) if coll.shared else np.empty(numel, reduction.wire_dtype)
    reduced = np.empty(shard_out.size, dtype=reduction.wire_dtype)
    prediction = reduction.predict((1.0, size), HEADROOM)  # gradients in [-1, 1]

    def run():
        reduction.encode(local, grads, layout, [prediction], True)
        coll.reduce_scatter(local, reduced)
        reduction.decode(reduced, prediction.k if prediction else 0, size, shard_out)

    return run


def round_path(coll, grads, layout, narrow: bool):
    """One exact round off shared memory (``GroupGradients._scatter_round``): int64 reduce-scatter, or float32
    all-to-all widened at the owner."""
    exact, numel, size = REDUCTIONS["exact"], grads["g"].size, coll.comm.Get_size()
    buffer = np.empty(numel, exact.round_dtype if narrow else exact.wire_dtype)
    blocks, reduced = np.empty_like(buffer), np.empty(numel // size, exact.wire_dtype)
    prediction = exact.predict((1.0, size), HEADROOM)

    def run():
        exact.encode(buffer, grads, layout, [prediction], True)
        if narrow:
            coll.alltoall(buffer, blocks, counted_as="reduce_scatter")
            exact.widen(blocks.reshape(size, -1), reduced, True)
        else:
            coll.reduce_scatter(buffer, reduced)

    return run


def arena_path(coll, wide, wide_shard):
    """The engine's stage 2-3 path on one host: gradients already encoded in the shared arena."""
    arena = coll.shared_buffer(wide.size, wide.dtype)
    arena[...] = wide
    return lambda: coll.reduce_scatter(arena, wide_shard)


def measure(comm, coll, one_call_coll, mib: int, repeat: int) -> list[tuple]:
    """Time every path on one buffer size; return ``(MiB, path, seconds, GiB/s, ratio to raw)`` rows.

    Sizes are of the float32 gradient; int64 rows move twice the bytes (the exact reduction's wire).
    """
    size = comm.Get_size()
    numel = mib * 2**20 // 4 // size * size
    grad = np.random.default_rng(comm.Get_rank()).uniform(-1, 1, numel).astype(np.float32)
    wide = np.ones(numel, np.int64)
    layout = FlatLayout.from_shapes({"g": (numel,)})
    shard, wide_shard = np.empty(numel // size, np.float32), np.empty(numel // size, np.int64)
    full = np.zeros(numel, np.float32)
    raw_rs = median_seconds(comm, lambda: comm.Reduce_scatter_block(grad, shard, op=MPI.SUM), repeat)
    raw_wide = median_seconds(comm, lambda: comm.Reduce_scatter_block(wide, wide_shard, op=MPI.SUM), repeat)
    raw_ag = median_seconds(comm, lambda: comm.Allgather(shard, full), repeat)
    one_call = median_seconds(comm, lambda: one_call_coll.reduce_scatter(grad, shard), repeat)
    one_call_wide = median_seconds(comm, lambda: one_call_coll.reduce_scatter(wide, wide_shard), repeat)
    pieces = median_seconds(comm, lambda: reduce_scatter_in_pieces(comm, wide, wide_shard), repeat)
    arena = median_seconds(comm, arena_path(coll, wide, wide_shard), repeat)
    native = median_seconds(comm, reduction_path(coll, REDUCTIONS["native"], {"g": grad}, layout, shard), repeat)
    exact = median_seconds(comm, reduction_path(coll, REDUCTIONS["exact"], {"g": grad}, layout, shard), repeat)
    round_wide = median_seconds(comm, round_path(one_call_coll, {"g": grad}, layout, False), repeat)
    round_narrow = median_seconds(comm, round_path(one_call_coll, {"g": grad}, layout, True), repeat)
    paths = [
        ("raw Reduce_scatter_block f32", raw_rs, raw_rs),
        ("mpizero reduce_scatter f32 (one call)", one_call, raw_rs),
        ("raw Reduce_scatter_block i64", raw_wide, raw_wide),
        ("mpizero reduce_scatter i64 (one call)", one_call_wide, raw_wide),
        ("mpizero reduce_scatter i64 (pieces)", pieces, raw_wide),
        ("mpizero reduce_scatter i64 (shared arena)", arena, raw_wide),
        ("mpizero native: encode+RS+decode", native, raw_rs),
        ("mpizero exact: encode+RS+decode", exact, raw_rs),
        ("exact round, i64 wire: encode+RS", round_wide, raw_rs),
        ("exact round, f32 wire: encode+A2A+widen", round_narrow, raw_rs),
        ("raw Allgather f32", raw_ag, raw_ag),
        ("mpizero allgather f32", median_seconds(comm, lambda: coll.allgather(shard, full), repeat), raw_ag),
    ]
    return [(mib, name, seconds, mib / seconds / 1024, seconds / base) for name, seconds, base in paths]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    os.environ[ENV_VAR] = "mpi"  # the wrappers as one MPI call each
    one_call_coll = Collectives(comm)
    os.environ[ENV_VAR] = "auto"  # what the engine does
    coll = Collectives(comm)
    sizes = progress(args.sizes_mib, "bench_collectives sizes", show=comm.Get_rank() == 0)  # stderr, every 5 s
    rows = [row for mib in sizes for row in measure(comm, coll, one_call_coll, mib, args.repeat)]
    if comm.Get_rank() == 0:
        print(f"ranks {comm.Get_size()}, median of {args.repeat}, float32 buffer sizes")
        print(f"{'MiB':>5}  {'path':<42} {'seconds':>9} {'GiB/s f32':>9} {'x raw':>6}")
        for mib, name, seconds, rate, ratio in rows:
            print(f"{mib:>5}  {name:<42} {seconds:>9.4f} {rate:>9.2f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()
