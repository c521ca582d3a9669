"""A model that no single rank can hold, trained at stage 3 on 4 ranks: peak RSS per rank beside the estimator.

Run: python benchmarks/bench_bigmodel.py   (0.5B parameters: minutes, about 12 GiB over 4 ranks)
     python benchmarks/bench_bigmodel.py --model mlp --width 2048 --layers 12 --cap-mib 896   (the test's size)
     python benchmarks/bench_bigmodel.py --width 2560 --layers 25 --cap-mib 6144 --offload-dir /var/tmp/off
       (2B parameters, the optimizer states on disk: the in-memory run cannot even be set up at -n 4)
Every rank's address space is capped (tests/training/capped.py sets RLIMIT_AS) below
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

from mpizero.comm.job.launcher import python_under_mpiexec
from mpizero.core import formulas
from mpizero.core.config import DiskOffload
from mpizero.core.engine import IN_FLIGHT
from mpizero.core.memory import format_bytes
from mpizero.progress import progress
from mpizero.training.model import param_shapes
from mpizero.training.registry import Size, entry, formula_setups
from mpizero.training.trainer import DEFAULT_BUCKET_ELEMS

ROOT = Path(__file__).resolve().parent.parent
CAPPED = ROOT / "tests" / "training" / "capped.py"
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
    parser.add_argument(
        "--offload-dir",
        default=None,
        help="keep the master, optimizer and grad shards in files here (DiskOffload); the proof is "
        "then that the in-memory run fails at -n RANKS under the cap",
    )
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
    from mpizero.core.states import InFile
    from mpizero.training.trainer import Trainer, make_groups

    comm = MPI.COMM_WORLD
    spec, data, model = model_of(args)
    groups = make_groups(model, STAGE, DEFAULT_BUCKET_ELEMS)
    base_rss, base_vm, start = peak_rss_bytes(), vm_bytes("VmSize"), time.perf_counter()
    offloaded = {"offload": DiskOffload(args.offload_dir)} if args.offload_dir else {}
    engine = ZeroEngine(
        initializer(param_shapes(model), args.seed),
        AdamW(lr=1e-3),
        comm=comm,
        groups=groups,
        stage=STAGE,
        **offloaded,
    )
    setup_s, setup_rss = time.perf_counter() - start, peak_rss_bytes()
    files = [g.place.file for g in engine.groups if isinstance(g.place, InFile)]
    io_before = [sum(getattr(f, k) for f in files) for k in ("read_bytes", "written_bytes", "io_seconds")]
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
        **{
            k: (sum(getattr(f, k) for f in files) - before) / args.steps
            for k, before in zip(("read_bytes", "written_bytes", "io_seconds"), io_before)
        },
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


def run(args, ranks: int, read_stderr: bool, offloaded: bool = False) -> subprocess.CompletedProcess:
    """The worker under ``mpiexec -n ranks``, each rank capped at ``--cap-mib`` (offloaded, or not); stderr read, or
    left to the terminal (for the worker's progress lines)."""
    command = python_under_mpiexec(
        ranks, "-m", "mpi4py", str(CAPPED), str(args.cap_mib), str(Path(__file__).resolve()), "--worker"
    )
    for flag in ("model", "width", "layers", "heads", "block_size", "steps", "micro_batches", "batch", "seed"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if offloaded:
        command += ["--offload-dir", args.offload_dir]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    stderr = subprocess.PIPE if read_stderr else None
    return subprocess.run(
        command, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=args.timeout, env=env, cwd=ROOT
    )


def predicted(spec, data, ranks: int, offloaded: bool, capped: bool = True) -> dict[str, int]:
    """The estimator's bytes per rank at stage 3: the states held between steps; and the engine's peak in a step,
    which adds two gathered units (the trainer prefetches the next), one round's int64 buffer of the largest
    unit, the int64 grad-shard sums of the groups whose reduction is still open (``IN_FLIGHT`` + 1), the owner
    sums unless ``capped`` (under an address-space cap they are off) and, offloaded, the states an update reads in
    at once; and, offloaded, the bytes on disk."""
    units = spec.unit_runs(data)
    setup = dict(formula_setups(units, ranks, "fp32", "exact", "adamw", DEFAULT_BUCKET_ELEMS))[STAGE]
    setup = dataclasses.replace(setup, shared_memory=not capped, offloaded=offloaded)
    held, on_disk = formulas.engine_bytes(setup), formulas.offload_bytes(setup)
    states = sum(held[k] for k in ("params", "grads", "master", "optimizer"))
    largest = max(setup.partitions(), key=lambda p: p.padded_numel)
    wire = setup.wire_bytes
    in_step = (2 * 4 + wire) * largest.padded_numel + (IN_FLIGHT + 1) * wire * largest.shard_numel
    read_in = on_disk["in_memory_peak"] if offloaded else 0
    return {"states": states, "peak": states + held["comm"] + in_step + read_in, "disk": on_disk["disk"]}


def main() -> None:
    args = parse()
    if args.worker:
        return worker(args)
    spec, data, model = model_of(args)
    numel = sum(math.prod(s) for s in param_shapes(model).values())
    cap, offloaded = args.cap_mib * 2**20, bool(args.offload_dir)
    print(
        f"{args.model} width {args.width}, {args.layers} layers: {numel:,} parameters, stage {STAGE}, fp32, AdamW, "
        f"exact reduction; address space capped at {format_bytes(cap)} per rank"
        + (f"; master, optimizer and grad shards offloaded to {args.offload_dir}" if offloaded else "")
    )
    print(f"fp32 params + Adam state of the whole model: {format_bytes(16 * numel)} (what one rank would need)")
    if offloaded:
        layers, most = largest_in_memory(args)
        print(
            f"the largest of this shape whose in-memory peak (estimator) fits this machine's "
            f"{format_bytes(memory_total())} at -n {args.ranks}: {layers} layers, {most:,} parameters "
            f"({numel / most:.2f} x smaller than this one)"
        )
        print(f"dd on {args.offload_dir}: {disk_bandwidth(args.offload_dir)}")
    failing = args.ranks if offloaded else 1  # offloaded: the in-memory run fails even on every rank
    start = time.perf_counter()
    alone = run(args, failing, read_stderr=True)  # its out-of-memory message is shown below
    failed = alone.returncode != 0 and "out of memory" in alone.stderr
    message = next((line for line in alone.stderr.splitlines() if "out of memory" in line), alone.stderr[-300:])
    print(
        f"-n {failing} in memory under the cap: {'fails' if failed else 'DID NOT FAIL'} "
        f"({time.perf_counter() - start:.0f} s): {message}"
    )
    start = time.perf_counter()
    done = run(args, args.ranks, read_stderr=False, offloaded=offloaded)
    if done.returncode != 0:
        sys.exit(f"-n {args.ranks} failed (exit {done.returncode}); its error output is above:\n{done.stdout}")
    rows = sorted(
        (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"]
    )
    guess = predicted(spec, data, args.ranks, offloaded)
    how = "offloaded" if offloaded else "in memory"
    print(f"-n {args.ranks} {how} under the cap: trained {args.steps} steps in {time.perf_counter() - start:.0f} s")
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
    if offloaded:
        read, written = (sum(r[k] for r in rows) for k in ("read_bytes", "written_bytes"))
        busiest = max(r["io_seconds"] for r in rows)
        print(
            f"on disk: {format_bytes(guess['disk'])} per rank (estimator); per step, all ranks: read "
            f"{format_bytes(read)}, wrote {format_bytes(written)} ({(read + written) / first['params']:.1f} bytes per "
            f"parameter); the busiest rank's reads and writes took {busiest:.1f} s of the step's "
            f"{first['step_s']:.1f} s: {format_bytes((read + written) / busiest)}/s over all ranks while it did"
        )
    print(f"initial digest {first['initial']}, final digest {first['final']}")


def largest_in_memory(args) -> tuple[int, int]:
    """The most layers (and their parameters) of ``args``' width whose in-memory peak per rank (``predicted``, with
    no cap: owner sums on) times the ranks fits in the machine's memory."""
    room, layers, most = memory_total(), 0, 0
    while True:
        spec, data, model = model_of(argparse.Namespace(**{**vars(args), "layers": layers + 1}))
        if predicted(spec, data, args.ranks, offloaded=False, capped=False)["peak"] * args.ranks > room:
            return layers, most
        layers, most = layers + 1, sum(math.prod(s) for s in param_shapes(model).values())


def memory_total() -> int:
    """The machine's memory (``MemTotal``), in bytes."""
    line = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:"))
    return int(line.split()[1]) * 1024


def disk_bandwidth(directory: str) -> str:
    """``dd``'s write and read speed of 2 GiB in ``directory``, bypassing the page cache (``direct``)."""
    path = os.path.join(directory, "dd-probe")
    speeds = []
    for dd in (
        ["dd", "if=/dev/zero", f"of={path}", "bs=16M", "count=128", "oflag=direct", "conv=fsync"],
        ["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"],
    ):
        done = subprocess.run(dd, capture_output=True, text=True, check=True)
        speeds.append(done.stderr.strip().splitlines()[-1].rsplit(",", 1)[-1].strip())
    os.remove(path)
    return f"write {speeds[0]}, read {speeds[1]} (2 GiB, O_DIRECT)"


if __name__ == "__main__":
    main()
