"""Peak RSS and step time against micro-batches per rank, per stage and accumulation mode (issue: ZeRO memory).

Run: python benchmarks/bench_accumulation.py [--code DIR] [--label NAME]
Trains the 12.7M-parameter transformer (width 512, 4 blocks, context 16, global batch 32) for a few steps at
2 ranks for every stage and 1, 2, 4, 8 micro-batches per rank, and prints one table row per run: the mean
step time of the steps after the first, and the largest peak RSS of any rank at the end of the steps. Each run
is this script's own worker (engine and trainer, no evaluation), so ``--code`` can run another checkout's
``mpizero`` (e.g. a ``git worktree`` of an older commit) for before/after figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from mpizero.comm.job.launcher import python_under_mpiexec
from mpizero.progress import progress

RANKS = 2


def run(code: str, stage: int, per_rank: int, steps: int, accumulate: str | None) -> tuple[float, float]:
    """Train once in a worker job; return (mean ms of steps 2..N, largest peak RSS MiB of the steps)."""
    args = [__file__, "--worker", str(stage), str(per_rank), str(steps), accumulate or "default"]
    env = {**os.environ, "PYTHONPATH": code, "OMP_NUM_THREADS": "1"}
    command = python_under_mpiexec(RANKS, *args)  # run in ``code``: the cwd comes first on sys.path
    done = subprocess.run(command, cwd=code, env=env, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["ms"], result["rss"] / 2**20


def worker(stage: int, per_rank: int, steps: int, accumulate: str) -> None:
    """One training job under mpiexec, on whichever ``mpizero`` is first on the path; rank 0 prints JSON."""
    import resource
    import time

    from mpi4py import MPI
    from threadpoolctl import threadpool_limits

    from mpizero import AdamW, ZeroEngine
    from mpizero.core.precision import PRECISIONS
    from mpizero.training.datasets import Corpus
    from mpizero.training.trainer import Trainer, make_groups
    from mpizero.training.transformer import Transformer

    threadpool_limits(1)
    comm, corpus = MPI.COMM_WORLD, Corpus.load()
    model = Transformer(len(corpus.alphabet), 16, 512, 4, 4)
    total = RANKS * per_rank
    engine = ZeroEngine(
        model.init(0), AdamW(lr=3e-3), comm=comm, groups=make_groups(model, stage, 1 << 21), stage=stage
    )
    extra = {} if accumulate == "default" else {"reduce_each_round": accumulate == "round"}
    trainer = Trainer(model, engine, PRECISIONS["fp32"], **extra)
    times = []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        trainer.step(lambda m, step=step: corpus.micro_batch(0, step, m, 32 // total, 16), total)
        times.append(time.perf_counter() - start)
    rss = comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, op=MPI.MAX)
    if comm.Get_rank() == 0:
        print(json.dumps({"ms": 1e3 * sum(times[1:]) / len(times[1:]), "rss": rss}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        stage, per_rank, steps, accumulate = sys.argv[2:]
        worker(int(stage), int(per_rank), int(steps), accumulate)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", default=os.getcwd(), help="the checkout whose mpizero runs")
    parser.add_argument("--label", default="this code")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--per-rank", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--accumulate", nargs="+", default=[None], help="round and/or local (default: the default)")
    args = parser.parse_args()
    print(f"{args.label}: transformer 12.7M, {RANKS} ranks, global batch 32, mean of steps 2-{args.steps}")
    print(f"{'stage':>5} {'accumulate':>10} {'mb/rank':>7} {'step ms':>8} {'RSS MiB':>8}")
    configs = [(s, a, p) for s in args.stages for a in args.accumulate for p in args.per_rank]
    for stage, accumulate, per_rank in progress(configs, "bench_accumulation runs"):  # stderr, every 5 s
        ms, rss = run(args.code, stage, per_rank, args.steps, accumulate)
        print(f"{stage:>5} {accumulate or 'default':>10} {per_rank:>7} {ms:>8.1f} {rss:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
