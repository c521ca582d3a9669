"""Peak RSS and step time against micro-batches per rank, per stage and accumulation mode (issue: ZeRO memory).

Run: python benchmarks/bench_accumulation.py [--code DIR] [--label NAME]
Trains the 12.7M-parameter transformer (width 512, 4 blocks, context 16, global batch 32) for a few steps at
2 ranks for every stage and 1, 2, 4, 8 micro-batches per rank, and prints one table row per run: the mean
step time of the steps after the first, and the process's peak RSS at the end of the steps (``rss_steps``;
``rss`` for code that predates it, which also covers evaluation). ``--code`` runs another checkout's
``mpizero`` (e.g. a ``git worktree`` of an older commit) for before/after figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

from mpizero.comm.launcher import python_under_mpiexec

MODEL = ["--model", "transformer", "--width", "512", "--layers", "4", "--block-size", "16", "--global-batch", "32"]
RANKS = 2


def run(code: str, stage: int, per_rank: int, steps: int, accumulate: str | None) -> tuple[float, float]:
    """Train once; return (mean ms of steps 2..N, peak RSS MiB at the end of the steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "memory.json")
        args = ["-m", "mpizero", "train", *MODEL, "--micro-batches", str(RANKS * per_rank), "--stage", str(stage)]
        args += ["--steps", str(steps), "--log-every", "1", "--memory-json", report]
        args += [] if accumulate is None else ["--accumulate", accumulate]
        env = {**os.environ, "PYTHONPATH": code, "OMP_NUM_THREADS": "1"}
        command = python_under_mpiexec(RANKS, *args)  # run in ``code``: ``python -m`` puts the cwd first on sys.path
        done = subprocess.run(command, cwd=code, env=env, capture_output=True, text=True, check=True)
        times = [float(ms) for ms in re.findall(r"  ([\d.]+) ms  held", done.stdout)][1:]
        with open(report) as f:
            memory = json.load(f)
    return sum(times) / len(times), memory.get("rss_steps", memory["rss"]) / 2**20


def main() -> None:
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
    for stage in args.stages:
        for accumulate in args.accumulate:
            for per_rank in args.per_rank:
                ms, rss = run(args.code, stage, per_rank, args.steps, accumulate)
                print(f"{stage:>5} {accumulate or 'default':>10} {per_rank:>7} {ms:>8.1f} {rss:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
