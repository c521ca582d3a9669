"""Per-rank cost of a training step and of set-up as the number of ranks grows, beside the formulas.

Run: python benchmarks/bench_scale.py                 (N = 1, 2, 4, 8, 16, 32; oversubscribed is fine)
     python benchmarks/bench_scale.py --ranks 2 8 --clip 0
Each N is one ``mpiexec -n N`` job that builds a tiny transformer's engine at stages 1-3 and trains 3
steps, one micro-batch per rank. Per rank and per step it reports, from ``engine.collectives.traffic``:
calls and bytes of each collective, the seconds spent blocked in collectives, and the set-up time (engine
construction), beside ``formulas.calls_per_step``, ``agreement_bytes_per_step`` and ``traffic_per_step``.
Oversubscribed ranks share cores, so times grow with N here for that reason alone: read the counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
OPS = ("reduce_scatter", "allreduce", "allgather", "agreement")
STEPS = 3
VOCAB, BLOCK = 11, 8


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--clip", type=float, default=1.0, help="clip norm (0: off)")
    parser.add_argument("--reduction", default="exact", choices=["exact", "native"])
    parser.add_argument("--rounds", type=int, default=1, help="micro-batches per rank and step")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def worker(args) -> None:
    """Build each stage's engine and train ``STEPS`` steps; rank 0 prints one JSON line per stage."""
    from mpi4py import MPI

    from mpizero import AdamW, ZeroEngine
    from mpizero.comm import windows
    from mpizero.comm.job.ranks import world_ranks
    from mpizero.core import formulas
    from mpizero.core.precision import PRECISIONS
    from mpizero.training.trainer import DEFAULT_BUCKET_ELEMS, Trainer, make_groups
    from mpizero.training.transformer import Transformer

    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    model = Transformer(vocab=VOCAB, block_size=BLOCK, width=16, heads=2, n_layer=2)
    precision = PRECISIONS["fp32"]

    def batch(step: int, m: int):
        tokens = np.random.default_rng([step, m]).integers(0, VOCAB, size=(4, BLOCK + 1))
        return tokens[:, :-1], tokens[:, 1:]

    for stage in args.stages:
        comm.Barrier()
        earlier_windows = len(windows.held(world_ranks(comm)))  # the engine before: freed at this one's set-up
        start = time.perf_counter()
        engine = ZeroEngine(
            model.init(0),
            AdamW(lr=1e-3),
            comm=comm,
            groups=make_groups(model, stage, DEFAULT_BUCKET_ELEMS),
            stage=stage,
            reduction=args.reduction,
            clip_norm=args.clip or None,
        )
        setup_s = time.perf_counter() - start
        setup_calls = dict(engine.collectives.traffic.calls)
        trainer, traffic, seconds, steps_s = Trainer(model, engine, precision), engine.collectives.traffic, [], []
        for step in range(1, STEPS + 1):
            traffic.clear()
            start = time.perf_counter()
            trainer.step(lambda m, step=step: batch(step, m), size * args.rounds)
            steps_s.append(time.perf_counter() - start)
            seconds.append(dict(traffic.seconds))
        setup, clip = formulas.formula_setup(engine), bool(args.clip)
        tensors = tuple(len(g.layout.specs) for g in engine.groups)
        row = {
            "ranks": size,
            "stage": stage,
            "groups": len(engine.groups),
            "calls": {op: traffic.calls[op] for op in OPS},
            "sent": {op: traffic.sent[op] for op in OPS},
            "received": {op: traffic.received[op] for op in OPS},
            "formula_calls": formulas.calls_per_step(setup, args.rounds, clip, args.reduction),
            "formula_sent": formulas.traffic_per_step(setup, args.rounds),
            "formula_agreement": formulas.agreement_bytes_per_step(
                setup, tensors, size * args.rounds, clip, args.reduction
            ),
            # the slowest rank's mean over the steps after the first, in seconds
            "comm_s": comm.allreduce(sum(sum(s.values()) for s in seconds[1:]) / (STEPS - 1), op=MPI.MAX),
            "agreement_s": comm.allreduce(sum(s.get("agreement", 0.0) for s in seconds[1:]) / (STEPS - 1), op=MPI.MAX),
            "step_s": comm.allreduce(sum(steps_s[1:]) / (STEPS - 1), op=MPI.MAX),
            "setup_s": comm.allreduce(setup_s, op=MPI.MAX),
            "setup_calls": setup_calls,
            "earlier_windows": earlier_windows,
        }
        if comm.Get_rank() == 0:
            print(json.dumps(row), flush=True)


def run(ranks: int, args) -> list[dict]:
    """Run the worker under ``mpiexec -n ranks``; return its rows."""
    from mpizero.comm.job.launcher import python_under_mpiexec

    command = python_under_mpiexec(ranks, "-m", "mpi4py", str(HERE), "--worker", "--clip", str(args.clip))
    command += ["--reduction", args.reduction, "--stages", *map(str, args.stages)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode:
        sys.exit(f"mpiexec -n {ranks} failed:\n{done.stdout}\n{done.stderr}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def matches(row: dict, clip: bool) -> str:
    """'yes' when the measured calls and bytes equal the formulas, else what differs.

    With clipping, the norm's sum is a Python int whose pickle is up to ``NORM_SUM_BYTES - 5`` bytes
    shorter than the formula's longest: 'yes-k' says the agreement bytes were k below the formula.
    """
    from mpizero.core.formulas import NORM_SUM_BYTES

    differ = [op for op in OPS if row["calls"][op] != row["formula_calls"][op]]
    differ += [f"{op} bytes" for op, b in row["formula_sent"].items() if row["sent"][op] != b]
    short = row["formula_agreement"] - row["sent"]["agreement"]
    if not (0 <= short <= (NORM_SUM_BYTES - 5 if clip else 0)):
        differ.append(f"agreement {row['sent']['agreement']} B vs {row['formula_agreement']} B")
    return ", ".join(differ) if differ else "yes" if short == 0 else f"yes-{short}"


def print_table(rows: list[dict], args) -> None:
    print(
        f"transformer width 16, 2 blocks, fp32, {args.reduction} reduction, clip {args.clip:g}, one micro-batch "
        f"per rank; per rank and per step (step {STEPS} of {STEPS}; times: slowest rank, mean of steps 2-{STEPS})"
    )
    print(
        f"{'stage':>5} {'N':>3} {'groups':>6} {'calls rs/ar/ag/agr':>19} {'rs B':>7} {'ag B':>7} "
        f"{'agr B sent/recv':>16} {'= formula':>9} {'comm ms':>8} {'agr ms':>7} {'step ms':>8} {'set-up ms':>9}"
    )
    for row in sorted(rows, key=lambda r: (r["stage"], r["ranks"])):
        calls = "/".join(str(row["calls"][op]) for op in OPS)
        agreement = f"{row['sent']['agreement']}/{row['received']['agreement']}"
        same = matches(row, bool(args.clip))
        print(
            f"{row['stage']:>5} {row['ranks']:>3} {row['groups']:>6} {calls:>19} {row['sent']['reduce_scatter']:>7} "
            f"{row['sent']['allgather']:>7} {agreement:>16} {same:>9} {row['comm_s'] * 1e3:>8.1f} "
            f"{row['agreement_s'] * 1e3:>7.1f} {row['step_s'] * 1e3:>8.1f} {row['setup_s'] * 1e3:>9.1f}"
        )


def main() -> None:
    args = parse()
    if args.worker:
        return worker(args)
    from mpizero.progress import progress

    rows = [row for ranks in progress(args.ranks, "bench_scale world sizes") for row in run(ranks, args)]
    print_table(rows, args)


if __name__ == "__main__":
    main()
