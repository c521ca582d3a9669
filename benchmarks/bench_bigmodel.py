"""A model that no single rank can hold, trained at stage 3 on 4 ranks: peak RSS per rank beside the estimator.

Run: python benchmarks/bench_bigmodel.py   (0.5B parameters: minutes, about 12 GiB over 4 ranks)
     python benchmarks/bench_bigmodel.py --model mlp --width 2048 --layers 12 --cap-mib 896   (the test's size)
Every rank's address space is capped (tests/mpi/capped.py sets RLIMIT_AS) below
what one rank needs for the model's fp32 parameters and Adam state. The model is
built from a ShardedInit (``philox_normal``), so no rank ever makes the whole
model. First the model must fail at ``-n 1`` under the cap (an agreed
out-of-memory error at set-up); then ``-n RANKS`` trains it under the same cap.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from mpizero.comm.launcher import python_under_mpiexec
from mpizero.core import formulas
from mpizero.core.engine import IN_FLIGHT
from mpizero.core.memory import format_bytes
from mpizero.progress import progress
from mpizero.training.model import param_shapes
from mpizero.training.registry import Size, entry, formula_setups
from mpizero.training.trainer import DEFAULT_BUCKET_ELEMS

ROOT = Path(__file__).resolve().parent.parent
CAPPED = ROOT / "tests" / "mpi" / "capped.py"
STAGE = 3


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--model", default="transformer", choices=["mlp", "transformer"])
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--cap-mib", type=int, default=5632, help="address space per rank (RLIMIT_AS), MiB")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step, all ranks")
    parser.add_argument("--batch", type=int, default=1, help="samples per micro-batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900, help="seconds for each mpiexec run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def model_of(args):
    spec = entry(args.model, Size(args.width, args.layers, args.heads, args.block_size))
    data = spec.load()
    return spec, data, spec.build(data)


def initializer(shapes: dict, seed: int):
    """Matrices normal(0, 1/sqrt(fan-in)), layer-norm gains 1, biases 0: every element from its own Philox counter."""
    from mpizero import philox_normal

    std = {name: 0.0 if len(shape) == 1 else 1 / math.sqrt(shape[0]) for name, shape in shapes.items()}
    mean = {name: 1.0 if name.endswith(".g") else 0.0 for name in shapes}
    return philox_normal(shapes, seed, std=std, mean=mean)


def worker(args) -> None:
    """Build the engine from the initializer, train ``steps`` steps; rank 0 prints one JSON line per rank."""
    from mpi4py import MPI

    from mpizero import AdamW, ZeroEngine
    from mpizero.core.memory import peak_rss_bytes
    from mpizero.core.precision import PRECISIONS
    from mpizero.training.trainer import Trainer, make_groups

    comm = MPI.COMM_WORLD
    spec, data, model = model_of(args)
    groups = make_groups(model, STAGE, DEFAULT_BUCKET_ELEMS)
    base_rss, base_vm, start = peak_rss_bytes(), vm_bytes("VmSize"), time.perf_counter()
    engine = ZeroEngine(
        initializer(param_shapes(model), args.seed), AdamW(lr=1e-3), comm=comm, groups=groups, stage=STAGE
    )
    setup_s, setup_rss = time.perf_counter() - start, peak_rss_bytes()
    trainer = Trainer(model, engine, PRECISIONS["fp32"])
    losses, start = [], time.perf_counter()
    for step in progress(range(1, args.steps + 1), "bench_bigmodel steps", show=comm.Get_rank() == 0):  # stderr
        batch = lambda m, step=step: spec.micro_batch(data, args.seed, step, m, args.batch, args.micro_batches)  # noqa: E731
        losses.append(trainer.step(batch, args.micro_batches).loss)
    row = {
        "rank": comm.Get_rank(),
        "params": engine.numel,
        "setup_s": setup_s,
        "step_s": (time.perf_counter() - start) / args.steps,
        "base_rss": base_rss,
        "base_vm": base_vm,
        "setup_rss": setup_rss,
        "peak_rss": peak_rss_bytes(),
        "engine_peak": engine.memory_report()["peak_total"],
        "vm_peak": vm_bytes("VmPeak"),
        "initial": engine.initial_digest,
        "final": engine.master_digest(),
        "losses": losses,
    }
    rows = engine.collectives.gather_object(row, "the benchmark's rows")
    for row in rows or ():  # rank 0 prints every rank's line, so lines never interleave
        print(json.dumps(row), flush=True)


def vm_bytes(field: str) -> int:
    """The process's address space now (``VmSize``: what RLIMIT_AS caps) or at its peak (``VmPeak``), from
    Linux's /proc; 0 elsewhere."""
    status = Path("/proc/self/status")
    lines = status.read_text().splitlines() if status.exists() else []
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith(f"{field}:")), 0)


def run(args, ranks: int, read_stderr: bool) -> subprocess.CompletedProcess:
    """The worker under ``mpiexec -n ranks``, each rank capped at ``--cap-mib``; stderr read, or left to the
    terminal (for the worker's progress lines)."""
    command = python_under_mpiexec(
        ranks, "-m", "mpi4py", str(CAPPED), str(args.cap_mib), str(Path(__file__).resolve()), "--worker"
    )
    for flag in ("model", "width", "layers", "heads", "block_size", "steps", "micro_batches", "batch", "seed"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    stderr = subprocess.PIPE if read_stderr else None
    return subprocess.run(
        command, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=args.timeout, env=env, cwd=ROOT
    )


def predicted(spec, data, ranks: int) -> dict[str, int]:
    """The estimator's bytes per rank at stage 3: the states held between steps; and the engine's peak in a step,
    which adds two gathered units (the trainer prefetches the next), the shared arena of the largest unit's
    gradients, and the int64 grad-shard sums of the groups whose reduction is still open (``IN_FLIGHT`` + 1)."""
    units = spec.unit_runs(data)
    setup = dict(formula_setups(units, ranks, "fp32", "exact", "adamw", DEFAULT_BUCKET_ELEMS))[STAGE]
    setup = dataclasses.replace(setup, shared_memory=True)
    held = formulas.engine_bytes(setup)
    states = sum(held[k] for k in ("params", "grads", "master", "optimizer"))
    largest = max(setup.partitions(), key=lambda p: p.padded_numel)
    in_step = 2 * 4 * largest.padded_numel + (IN_FLIGHT + 1) * setup.wire_bytes * largest.shard_numel
    return {"states": states, "peak": states + held["comm"] + in_step}


def main() -> None:
    args = parse()
    if args.worker:
        return worker(args)
    spec, data, model = model_of(args)
    numel = sum(math.prod(s) for s in param_shapes(model).values())
    cap = args.cap_mib * 2**20
    print(
        f"{args.model} width {args.width}, {args.layers} layers: {numel:,} parameters, stage {STAGE}, fp32, AdamW, "
        f"exact reduction; address space capped at {format_bytes(cap)} per rank"
    )
    print(f"fp32 params + Adam state of the whole model: {format_bytes(16 * numel)} (what one rank would need)")
    start = time.perf_counter()
    alone = run(args, 1, read_stderr=True)  # its out-of-memory message is shown below
    failed = alone.returncode != 0 and "out of memory" in alone.stderr
    message = next((line for line in alone.stderr.splitlines() if "out of memory" in line), alone.stderr[-300:])
    print(
        f"-n 1 under the cap: {'fails' if failed else 'DID NOT FAIL'} ({time.perf_counter() - start:.0f} s): {message}"
    )
    start = time.perf_counter()
    done = run(args, args.ranks, read_stderr=False)
    if done.returncode != 0:
        sys.exit(f"-n {args.ranks} failed (exit {done.returncode}); its error output is above:\n{done.stdout}")
    rows = sorted(
        (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"]
    )
    guess = predicted(spec, data, args.ranks)
    print(f"-n {args.ranks} under the cap: trained {args.steps} steps in {time.perf_counter() - start:.0f} s")
    header = (
        "rank",
        "RSS before",
        "after set-up",
        "peak RSS",
        "peak address space",
        "engine peak",
        "estimator: states",
        "peak",
    )
    widths = (10, 12, 10, 19, 12, 18, 10)
    print(f"{header[0]:>4} " + " ".join(f"{h:>{w}}" for h, w in zip(header[1:], widths)))
    for row in rows:
        cells = (row["base_rss"], row["setup_rss"], row["peak_rss"], row["vm_peak"], row["engine_peak"])
        cells += (guess["states"], guess["peak"])
        print(f"{row['rank']:>4} " + " ".join(f"{format_bytes(c):>{w}}" for c, w in zip(cells, widths)))
    first = rows[0]
    print(f"set-up {first['setup_s']:.1f} s, {first['step_s']:.1f} s per step; losses {first['losses']}")
    print(f"initial digest {first['initial']}, final digest {first['final']}")


if __name__ == "__main__":
    main()
