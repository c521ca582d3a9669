"""``python -m mpizero train``: train the MLP on handwritten digits or the transformer on text.

Run: ``mpiexec -n 4 python -m mpizero train --model transformer --stage 3`` (any -n,
including 1). The same global batch and micro-batches give byte-identical
``--save-params`` files at every -n and stage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable

from mpizero import files
from mpizero.arrays import device_module, to_device
from mpizero.checkpoint import catalog, compat, store
from mpizero.cli import options, preflight
from mpizero.comm import agree
from mpizero.comm.collectives import Collectives
from mpizero.core import faults, formulas
from mpizero.core.config import DiskOffload
from mpizero.core.engine import ZeroEngine
from mpizero.core.memory import format_bytes, peak_rss_bytes
from mpizero.core.optim import OPTIMIZERS
from mpizero.core.precision import PRECISIONS
from mpizero.core.stages import reduce_scatters, sharding
from mpizero.progress import progress
from mpizero.training import initial, readout
from mpizero.training.registry import Size, entry
from mpizero.training.trainer import Trainer, make_groups

OUTPUTS = {"save_params": "--save-params", "memory_json": "--memory-json"}
INPUTS = {"resume": "--resume"}
OUTPUT_DIRS = {"checkpoint_dir": "--checkpoint-dir"}
WORK_DIRS = {"offload_dir": "--offload-dir"}
MIN_MICRO_BATCHES = 4
DEFAULT_KEEP = 2
MAX_GLOBAL_BATCH = 2**40  # keeps choosing --micro-batches (a divisor search) quick


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add(parser, "model", "device", "stage", "steps")
    parser.add_argument(
        "--global-batch",
        type=options.whole(1, MAX_GLOBAL_BATCH),
        default=64,
        help="samples (sequences) per step, all ranks",
    )
    options.add(
        parser,
        "micro_batches",
        default=None,
        help=f"micro-batches per step, all ranks (default: the smallest divisor of --global-batch "
        f"that is >= {MIN_MICRO_BATCHES} and >= the number of ranks)",
    )
    options.add(parser, "optimizer")
    parser.add_argument("--lr", type=options.number(0, above=True), default=3e-3, help="learning rate")
    options.add(parser, "precision", "reduction", "clip_norm", "seed", *options.SIZES)
    parser.add_argument(
        "--loss-scale-power", type=options.whole(0, 127), default=16, help="fp16: initial loss scale is 2**this"
    )
    options.add(parser, "bucket_elems", "accumulate", "scale_headroom")
    parser.add_argument("--no-overlap", action="store_true", help="use blocking collectives only")
    parser.add_argument(
        "--keep-gathered",
        action="store_true",
        help="stage 3: keep each unit's full params gathered through a step's micro-batches (one all-gather of "
        "each a step, not two a round: pays across hosts; holds the whole model's params during the step)",
    )
    options.add(parser, "watchdog")
    parser.add_argument("--log-every", type=options.whole(1), default=10, help="steps between progress lines")
    parser.add_argument(
        "--save-params", type=options.path, default=None, help="write the final fp32 master parameters here (.npy)"
    )
    parser.add_argument(
        "--memory-json",
        type=options.path,
        default=None,
        help="write rank 0's memory report and every rank's peaks here (JSON)",
    )
    parser.add_argument(
        "--offload-dir",
        type=options.path,
        default=None,
        help="keep the master, optimizer and grad shards in files here, each rank in a directory of its own "
        "(the disk tier)",
    )
    parser.add_argument("--checkpoint-dir", type=options.path, default=None, help="save sharded checkpoints here")
    parser.add_argument(
        "--checkpoint-every",
        type=options.whole(1),
        default=None,
        help="steps between checkpoints (needs --checkpoint-dir)",
    )
    parser.add_argument(
        "--keep", type=options.whole(1), default=None, help="complete checkpoints to keep (needs --checkpoint-dir; 2)"
    )
    parser.add_argument(
        "--resume", type=options.path, default=None, help="a checkpoint, or a directory of them (newest complete)"
    )
    parser.add_argument(
        "--resume-override",
        action="append",
        default=[],
        metavar="SETTING",
        help="on --resume, take this setting (lr, clip-norm, precision, ...) from the command line, not the checkpoint",
    )
    parser.add_argument(
        "--no-memory-check", action="store_true", help="start even if the predicted memory exceeds what is available"
    )


def check(args, world_size: int) -> None:
    """Raise a ZeroError naming every flag no run could use; choose --micro-batches if it was not given."""
    problems = options.model_problems(args)
    if args.global_batch < world_size:
        problems.append(f"--global-batch {args.global_batch} is smaller than the {world_size} ranks")
    elif args.micro_batches is None:
        least = min(max(MIN_MICRO_BATCHES, world_size), args.global_batch)
        args.micro_batches = smallest_divisor(args.global_batch, least)
    elif args.global_batch % args.micro_batches:
        problems.append(f"--global-batch {args.global_batch} must split into --micro-batches {args.micro_batches}")
    elif args.micro_batches < world_size:
        problems.append(f"--micro-batches {args.micro_batches} is fewer than the {world_size} ranks")
    if args.accumulate == "round" and not reduce_scatters(args.stage):
        problems.append("--accumulate round needs a stage whose gradients meet in a reduce-scatter (1-3), got 0")
    if args.keep_gathered and not sharding(args.stage).params:
        problems.append(f"--keep-gathered keeps stage 3's units gathered; at --stage {args.stage} they always are")
    problems += checkpoint_problems(args) + override_problems(args)
    options.raise_problems(problems)


def smallest_divisor(n: int, least: int) -> int:
    """The smallest divisor of ``n`` that is ``>= least``, found in O(sqrt(n)) steps (``n`` may be prime)."""
    divisors = (d for k in range(1, math.isqrt(n) + 1) if n % k == 0 for d in (k, n // k))
    return min(d for d in divisors if d >= least)


def checkpoint_problems(args) -> list[str]:
    """What is wrong with the checkpoint flags: one without the other, or flags that would save nothing."""
    problems = []
    if (args.checkpoint_dir is None) != (args.checkpoint_every is None):
        problems.append("--checkpoint-dir and --checkpoint-every go together: give both or neither")
    elif args.checkpoint_every is not None and args.checkpoint_every > args.steps:
        every, steps = args.checkpoint_every, args.steps
        problems.append(f"--checkpoint-every {every} is more than --steps {steps}: no checkpoint would be saved")
    if args.keep is not None and args.checkpoint_dir is None:
        problems.append("--keep needs --checkpoint-dir: there are no checkpoints to keep")
    args.keep = args.keep or DEFAULT_KEEP
    return problems


# The settings that change a run's numbers: a resumed run must match them (or name them in --resume-override),
# and their digest is the run's identity. Those that fix the tensors and optimizer states cannot be overridden.
RUN_SETTINGS = (
    *("model", "width", "layers", "heads", "block_size", "optimizer"),
    *("lr", "precision", "reduction", "clip_norm", "global_batch", "micro_batches", "accumulate", "seed"),
    "loss_scale_power",
)
FIXED_SETTINGS = RUN_SETTINGS[:6]


def override_problems(args) -> list[str]:
    """What is wrong with --resume-override: without --resume, or naming a setting a resumed run cannot change."""
    args.resume_override = [name.replace("-", "_") for name in args.resume_override]
    hyper = set(OPTIMIZERS[args.optimizer].hyper_names())
    allowed = sorted(hyper | set(RUN_SETTINGS) - set(FIXED_SETTINGS))
    unknown = sorted(set(args.resume_override) - set(allowed))
    problems = []
    if args.resume_override and not args.resume:
        problems.append("--resume-override needs --resume: there is no checkpoint to override")
    if unknown:
        shown = ", ".join(name.replace("_", "-") for name in allowed)
        problems.append(f"--resume-override names {unknown}, not settings a resumed run can change ({shown})")
    return problems


def run_settings(args, task) -> dict:
    """This run's ``RUN_SETTINGS`` (the width as the model resolves it)."""
    return {**{name: getattr(args, name) for name in RUN_SETTINGS}, "width": task.width}


ACCUMULATE = {"auto": None, "round": True, "local": False}  # Trainer's reduce_each_round


def run(args, comm) -> int:
    task = entry(args.model, Size.of(args))
    data = task.load()
    model = task.build(data)
    preflight.check(args, task, data, Collectives(comm, args.watchdog or None))
    rss_baseline = peak_rss_bytes()  # the interpreter, NumPy, MPI and the data: before any training state
    precision = PRECISIONS[args.precision]
    xp = device_module(args.device)
    engine = make_engine(args, model, precision, comm)
    trainer = Trainer(
        model, engine, precision, 2.0**args.loss_scale_power, ACCUMULATE[args.accumulate], args.keep_gathered
    )
    settings = run_settings(args, task)
    first_step, run_id = 1, compat.run_identity(settings)
    if args.resume:
        done, run_id = resume(args, engine, trainer, settings)
        first_step = done + 1
    if args.checkpoint_dir:
        store.claim(engine.collectives, args.checkpoint_dir, run_id, continuing=bool(args.resume))
    size = args.global_batch // args.micro_batches

    def batch(m: int, step: int):
        return to_device(task.micro_batch(data, args.seed, step, m, size, args.micro_batches), xp)

    rank0 = comm.Get_rank() == 0
    if rank0:
        print(
            f"{args.model}: {engine.numel:,} parameters, stage {args.stage}, {comm.Get_size()} ranks, "
            f"{args.precision}, {args.reduction} reduction; {engine.collectives.paths.describe()}",
            flush=True,
        )
    for step in progress(range(first_step, args.steps + 1), "train", show=rank0):  # stderr, every 5 s
        faults.maybe_kill("step", step, comm.Get_rank())
        engine.collectives.traffic.clear()
        start = time.perf_counter()
        report = trainer.step(lambda m, step=step: batch(m, step), args.micro_batches)
        elapsed = time.perf_counter() - start
        if rank0 and (step % args.log_every == 0 or step in (first_step, args.steps)):
            print(progress_line(args, task, step, report, elapsed, engine.memory()), flush=True)
        if args.checkpoint_dir and step % args.checkpoint_every == 0:
            path = store.save(
                engine, args.checkpoint_dir, training_state(step, engine, trainer, settings, run_id), args.keep
            )
            if rank0:
                print(f"saved {path}", flush=True)
    rss_steps = peak_rss_bytes()  # before evaluation and saving
    if rank0:
        print_accounting(trainer, -(-args.micro_batches // comm.Get_size()))
        steps = args.steps - first_step + 1
        print(f"redone (scale prediction missed): {engine.redone_steps} of {steps} steps")
        print(f"gradients kept beyond the predicted range: {engine.scales.kept_steps} of {steps} steps")
    walk = readout.unit_masters(engine, model.units)
    if rank0:
        print(task.evaluate(model, data, walk), flush=True)
    readout.drain(walk)
    problem = None
    if args.save_params:
        problem = written(lambda: readout.save_flat(args.save_params, engine, model.units, rank0))
    row = {**engine.memory_report(), "rss_baseline": rss_baseline, "rss_steps": rss_steps}
    rows = engine.collectives.gather_object(row, "every rank's memory report")
    if rank0 and args.memory_json and problem is None:
        memory = {**row, "ranks": [{key: r[key] for key in RANK_PEAKS} for r in rows]}
        problem = written(lambda: files.write(args.memory_json, lambda f: f.write(json.dumps(memory).encode())))
    agree.raise_if_any(engine.collectives, problem, "writing the outputs")
    return 0


RANK_PEAKS = ("rss_baseline", "rss_steps", "rss", "peak_total", "mapped")  # --memory-json's row per rank


def written(write: Callable[[], None]) -> str | None:
    """Run ``write``; return what went wrong, for every rank to report, or None."""
    try:
        write()
    except OSError as error:
        return f"cannot write {store.describe(error)}"
    except files.OutputError as error:  # replaced by something not a file since the check before the steps
        return str(error)
    return None


def make_engine(args, model, precision, comm) -> ZeroEngine:
    """The engine, built from ``initial.sharded``: at stage 3 each rank makes only its shard of the values."""
    source = initial.sharded(model, args.seed, args.device)
    return ZeroEngine(
        source,
        OPTIMIZERS[args.optimizer].for_shapes(source.shapes, lr=args.lr),
        comm=comm,
        groups=make_groups(model, args.stage, args.bucket_elems),
        stage=args.stage,
        reduction=args.reduction,
        clip_norm=args.clip_norm or None,
        **precision.engine_settings(),
        overlap=not args.no_overlap,
        watchdog=args.watchdog or None,
        scale_headroom=args.scale_headroom,
        offload=DiskOffload(args.offload_dir) if args.offload_dir else None,
    )


def training_state(step: int, engine, trainer, settings: dict, run_id: str) -> dict:
    """Everything besides the shards that the next step needs: counters, loss scale, the run and its settings."""
    scaler = trainer.scaler
    return {
        "step": int(step),
        "optimizer_steps": int(engine.step_count),
        "skipped_steps": int(engine.skipped_steps),
        "loss_scale": None if scaler is None else [float(scaler.scale), int(scaler.good_steps)],
        "data": {},
        "settings": settings,
        "run": run_id,
    }


def resume(args, engine, trainer, settings: dict) -> tuple[int, str]:
    """Load the checkpoint ``--resume`` names into the engine and trainer; return the step it ended and its run.

    The checkpoint's optimizer and every other setting in ``RUN_SETTINGS`` must equal this run's
    (``--resume-override NAME`` lets NAME differ), and ``--steps`` must go past its step.
    """
    comm = engine.comm
    path, torn = catalog.resolve_agreed(engine.collectives, args.resume)
    if comm.Get_rank() == 0:
        for message in torn:
            print(message, flush=True)
    loaded = store.load(engine, path, overrides=args.resume_override)
    state = loaded.training
    where = os.path.join(path, store.MANIFEST)
    compat.check_settings(state.get("settings", {}), settings, where, args.resume_override)
    if state["optimizer_steps"] + state["skipped_steps"] != state["step"]:
        raise store.CheckpointError(
            f"{where}: field training.step: {state['step']}, but optimizer_steps {state['optimizer_steps']} "
            f"+ skipped_steps {state['skipped_steps']} = {state['optimizer_steps'] + state['skipped_steps']}"
        )
    if args.steps <= state["step"]:
        raise store.CheckpointError(
            f"--steps {args.steps} does not go past step {state['step']}, where {path} ended: nothing would be trained"
        )
    engine.step_count, engine.skipped_steps = state["optimizer_steps"], state["skipped_steps"]
    if trainer.scaler is not None and state["loss_scale"] is not None:
        trainer.scaler.scale, trainer.scaler.good_steps = state["loss_scale"]
    if comm.Get_rank() == 0:
        read = f"rank 0 read {loaded.bytes_read:,} bytes of rank files"
        print(f"resumed from {path} after step {state['step']} ({read})", flush=True)
    return state["step"], state["run"]


def progress_line(args, task, step: int, report, elapsed: float, held: dict) -> str:
    """One line of progress: step, loss, throughput, step time, bytes this rank holds."""
    skipped = "  (skipped)" if report.skipped else ""
    scale = f"  scale {report.loss_scale:g}" if args.precision == "fp16" else ""
    memory = " ".join(f"{kind} {nbytes / 1024:.0f}K" for kind, nbytes in held.items())
    rate = args.global_batch * task.samples_per_item / elapsed
    return (
        f"step {step:>5}  loss {report.loss:.4f}{skipped}{scale}  "
        f"{rate:,.0f} {task.unit}/s  {elapsed * 1e3:.1f} ms  held/rank {memory}"
    )


def print_accounting(trainer, rounds: int) -> None:
    """Rank 0's bytes by kind (now and peak), peak RSS, and the last step's traffic beside the formula."""
    engine = trainer.engine
    report = engine.memory_report()
    on_disk = f"  on disk {format_bytes(report['disk'])}" if report["disk"] else ""
    print("memory on rank 0:  " + "  ".join(f"{k} {format_bytes(v)}" for k, v in report["now"].items()) + on_disk)
    print(
        "peak during steps: "
        + "  ".join(f"{k} {format_bytes(v)}" for k, v in report["peak"].items())
        + f"  total {format_bytes(report['peak_total'])}  (process peak RSS {format_bytes(report['rss'])}"
        + (f", of it up to {format_bytes(report['mapped'])} other ranks' shared blocks)" if report["mapped"] else ")")
    )
    traffic = engine.collectives.traffic
    setup = formulas.formula_setup(engine, trainer.keep_gathered)
    predicted = formulas.traffic_per_step(setup, rounds, trainer.reduce_each_round)
    print(f"sent per step:     {beside(traffic.sent, predicted)}  agreement {format_bytes(traffic.sent['agreement'])}")
    if setup.nodes > 1:
        across = formulas.inter_node_per_step(setup, rounds, trainer.reduce_each_round)
        print(f"to other nodes:    {beside(traffic.inter_node, across)}")


def beside(measured, predicted: dict) -> str:
    """``op 1.2 MiB (formula 1.2 MiB)`` for every op the formula predicts."""
    return "  ".join(f"{op} {format_bytes(measured[op])} (formula {format_bytes(b)})" for op, b in predicted.items())
