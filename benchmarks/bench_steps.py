"""Step time and peak memory per rank for each stage, precision, reduction and overlap setting.

Run: python benchmarks/bench_steps.py --ranks 2 --model transformer --width 128 --layers 4
Each configuration runs in its own ``mpiexec -n RANKS`` job (so peak RSS is its
own); the table gives the median step time after warm-up, its ratio to the
stage 0 row of the same precision and reduction, and the largest peak RSS
of any rank. Compare ratios within one run: these machines are noisy.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import subprocess
import time
from pathlib import Path

import numpy as np

from mpizero.comm.job.launcher import python_under_mpiexec
from mpizero.progress import progress

HERE = Path(__file__).resolve()


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model", default="transformer", choices=["mlp", "transformer"])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--widths", type=int, nargs="+", default=None, help="sweep model widths (overrides --width)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--reductions", nargs="+", default=["exact"])
    parser.add_argument("--overlap", nargs="+", default=["on", "off"], choices=["on", "off"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--reduction", default="exact", help=argparse.SUPPRESS)
    parser.add_argument("--no-overlap", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def worker(args) -> None:
    """Train ``steps`` steps of one configuration; rank 0 prints a JSON line."""
    from mpi4py import MPI
    from threadpoolctl import threadpool_limits

    from mpizero import AdamW, ZeroEngine
    from mpizero.core.precision import PRECISIONS
    from mpizero.training.datasets import Corpus, Digits
    from mpizero.training.mlp import MLP
    from mpizero.training.trainer import DEFAULT_BUCKET_ELEMS, Trainer, make_groups
    from mpizero.training.transformer import Transformer

    threadpool_limits(limits=1)
    comm = MPI.COMM_WORLD
    size = args.global_batch // args.micro_batches
    if args.model == "mlp":
        data, model = Digits.load(), MLP((64, *[args.width] * args.layers, 10), objective="xent")
        batch = lambda step, m: data.micro_batch(0, step, m, size, args.micro_batches)  # noqa: E731
    else:
        data = Corpus.load()
        model = Transformer(len(data.alphabet), 64, args.width, 4, args.layers)
        batch = lambda step, m: data.micro_batch(0, step, m, size, 64)  # noqa: E731
    precision = PRECISIONS[args.precision]
    engine = ZeroEngine(
        model.init(0),
        AdamW(lr=1e-3),
        comm=comm,
        groups=make_groups(model, args.stage, DEFAULT_BUCKET_ELEMS),
        stage=args.stage,
        reduction=args.reduction,
        clip_norm=1.0,
        **precision.engine_settings(),
        overlap=not args.no_overlap,
    )
    trainer = Trainer(model, engine, precision)
    times = []
    what = f"stage {args.stage}, {args.precision}, {args.reduction}, width {args.width}"
    for step in progress(range(1, args.steps + 1), what, show=comm.Get_rank() == 0):  # stderr, every 5 s
        comm.Barrier()
        start = time.perf_counter()
        trainer.step(lambda m, step=step: batch(step, m), args.micro_batches)
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    peak_kib = comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, op=MPI.MAX)
    if comm.Get_rank() == 0:
        warm = times[2:] or times
        row = {"params": engine.numel, "step_s": float(np.median(warm)), "peak_rss_mib": peak_kib / 1024}
        print(json.dumps(row), flush=True)


def run_config(args, stage: int, precision: str, reduction: str, overlap: str) -> dict:
    command = python_under_mpiexec(args.ranks, str(HERE))
    command += ["--worker", "--stage", str(stage), "--precision", precision, "--reduction", reduction]
    command += ["--model", args.model, "--width", str(args.width), "--layers", str(args.layers)]
    command += ["--global-batch", str(args.global_batch), "--micro-batches", str(args.micro_batches)]
    command += ["--steps", str(args.steps)] + (["--no-overlap"] if overlap == "off" else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run(
        command, stdout=subprocess.PIPE, text=True, timeout=900, env=env, check=True
    )  # stderr: progress
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse()
    if args.worker:
        return worker(args)
    rows = []
    configs = list(
        itertools.product(args.widths or [args.width], args.precisions, args.reductions, args.overlap, args.stages)
    )
    for width, precision, reduction, overlap, stage in progress(configs, "bench_steps configurations"):
        args.width = width
        row = run_config(args, stage, precision, reduction, overlap)
        rows.append((width, precision, reduction, overlap, stage, row))
    print(
        f"{args.model}, {args.layers} layers, {args.ranks} ranks, global batch {args.global_batch} in "
        f"{args.micro_batches} micro-batches, median of {args.steps - 2} steps after 2 warm-up"
    )
    header = ("width", "params", "precision", "reduction", "overlap", "stage", "step ms", "x stage 0", "peak RSS MiB")
    print("{:>6} {:>12} {:<9} {:<9} {:<7} {:>5} {:>9} {:>9} {:>12}".format(*header))
    baseline = {(w, p, r, o): row["step_s"] for w, p, r, o, s, row in rows if s == 0}
    for width, precision, reduction, overlap, stage, row in rows:
        base = baseline.get((width, precision, reduction, overlap))
        ratio = f"{row['step_s'] / base:9.2f}" if base else f"{'-':>9}"
        print(
            f"{width:>6} {row['params']:>12,} {precision:<9} {reduction:<9} {overlap:<7} {stage:>5} "
            f"{row['step_s'] * 1e3:>9.1f} {ratio} {row['peak_rss_mib']:>12.0f}"
        )


if __name__ == "__main__":
    main()
