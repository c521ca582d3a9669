"""Two nodes on one machine, links capped: the two-level path against the flat one, per step.

Run (as root): python benchmarks/bench_nodes.py --per-node 2 --rate 1gbit --stages 2 3 3k
It makes two namespace nodes (``tests/launch/cluster/nodes.py``), caps each link with a
token bucket, and for each stage runs the same training job once with
``MPIZERO_REDUCE_SCATTER=mpi`` (flat) and once with ``two-level``, MPI over TCP
between the nodes; ``3k`` is stage 3 with each unit kept gathered through the step
(``Trainer(keep_gathered=True)``). Per step after warm-up it reports: the median step time, the
bytes node 0's link carried (its interface counters, sent + received), and the
bytes node 0's ranks sent to the other node by mpizero's own accounting
(``Traffic.inter_node``) beside the formula (``formulas.inter_node_per_step``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
PATHS = ("mpi", "two-level")
STAGES = ("0", "1", "2", "3", "3k")  # 3k: stage 3, units kept gathered through each step


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-node", type=int, default=2, help="ranks on each of the two nodes")
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of each link ('none': uncapped)")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=["2", "3", "3k"])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="timed steps, after 2 warm-up steps")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", choices=STAGES, default="2", help=argparse.SUPPRESS)
    return parser.parse_args()


def link_bytes() -> int:
    """Bytes this node's eth0 has sent and received so far (read from inside its namespace)."""
    shown = json.loads(subprocess.run(["ip", "-s", "-j", "link", "show", "eth0"], capture_output=True).stdout)
    stats = shown[0]["stats64"]
    return stats["tx"]["bytes"] + stats["rx"]["bytes"]


def worker(args) -> None:
    """Train warm-up and timed steps of the transformer; rank 0 prints one JSON line."""
    from mpi4py import MPI
    from threadpoolctl import threadpool_limits

    from mpizero import AdamW, ZeroEngine
    from mpizero.core import formulas
    from mpizero.core.precision import PRECISIONS
    from mpizero.training.datasets import Corpus
    from mpizero.training.trainer import DEFAULT_BUCKET_ELEMS, Trainer, make_groups
    from mpizero.training.transformer import Transformer

    threadpool_limits(limits=1)
    comm = MPI.COMM_WORLD
    data = Corpus.load()
    model = Transformer(len(data.alphabet), 64, args.width, 4, args.layers)
    size = args.global_batch // args.micro_batches
    stage, kept = int(args.stage[0]), args.stage.endswith("k")
    groups = make_groups(model, stage, DEFAULT_BUCKET_ELEMS)
    precision = PRECISIONS["fp32"]
    settings = {"stage": stage, "reduction": "exact", "clip_norm": 1.0, **precision.engine_settings()}
    engine = ZeroEngine(model.init(0), AdamW(lr=1e-3), comm=comm, groups=groups, **settings)
    trainer = Trainer(model, engine, precision, keep_gathered=kept)
    times = []
    for step in range(1, args.steps + 3):
        if step == 3:
            engine.collectives.traffic.clear()
            comm.Barrier()
            link_before = link_bytes() if comm.Get_rank() == 0 else 0
        comm.Barrier()
        start = time.perf_counter()
        trainer.step(lambda m, step=step: data.micro_batch(0, step, m, size, 64), args.micro_batches)
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    comm.Barrier()
    link = (link_bytes() - link_before) / args.steps if comm.Get_rank() == 0 else 0
    traffic = engine.collectives.traffic
    inter = sum(v for op, v in traffic.inter_node.items() if op != "agreement") / args.steps
    node = engine.collectives.node
    node_inter = node.allreduce(inter)
    setup = formulas.formula_setup(engine, kept)
    rounds = -(-args.micro_batches // comm.Get_size())
    predicted = sum(formulas.inter_node_per_step(setup, rounds).values()) * node.Get_size()
    if comm.Get_rank() == 0:
        row = {"params": engine.numel, "path": engine.collectives.paths.reduce_scatter, "link": link}
        row |= {"step_s": float(np.median(times[2:])), "accounted": node_inter, "formula": predicted}
        print(json.dumps(row), flush=True)


def run_config(cluster, args, stage: str, path: str) -> dict:
    command = [str(HERE), "--worker", "--stage", stage, "--width", str(args.width), "--layers", str(args.layers)]
    command += ["--global-batch", str(args.global_batch), "--micro-batches", str(args.micro_batches)]
    command += ["--steps", str(args.steps)]
    env = {"MPIZERO_REDUCE_SCATTER": path}
    done = cluster.mpiexec([args.per_node, args.per_node], command, timeout=900, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"stage {stage}, {path}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]  # UCX may warn on stdout after it
    return json.loads(rows[-1])


def main() -> None:
    args = parse()
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(ROOT / "tests" / "launch"))
    from cluster.nodes import nodes

    from mpizero.progress import progress

    rows = []
    with nodes(2) as cluster:
        if args.rate != "none":
            cluster.cap(args.rate)
        for stage, path in progress([(s, p) for s in args.stages for p in PATHS], "bench_nodes configurations"):
            rows.append((stage, run_config(cluster, args, stage, path)))
    print(
        f"transformer width {args.width}, {args.layers} layers, {rows[0][1]['params']:,} parameters, exact reduction; "
        f"2 nodes x {args.per_node} ranks, links capped at {args.rate}, MPI over TCP between nodes; "
        f"per step, median of {args.steps} after 2 warm-up"
    )
    header = ("stage", "path", "step ms", "x flat", "link MB", "x flat", "accounted MB", "formula MB")
    print("{:>5} {:<10} {:>9} {:>7} {:>9} {:>7} {:>13} {:>11}".format(*header))
    flat = {stage: row for stage, row in rows if row["path"] == "mpi"}
    for stage, row in rows:
        base = flat[stage]
        print(
            f"{stage:>5} {row['path']:<10} {row['step_s'] * 1e3:>9.1f} {row['step_s'] / base['step_s']:>7.2f} "
            f"{row['link'] / 1e6:>9.2f} {row['link'] / base['link']:>7.2f} "
            f"{row['accounted'] / 1e6:>13.2f} {row['formula'] / 1e6:>11.2f}"
        )
    print("link MB: node 0's interface, sent + received; accounted/formula MB: what node 0's ranks sent across")


if __name__ == "__main__":
    main()
