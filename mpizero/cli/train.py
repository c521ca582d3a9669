"""``python -m mpizero train``: train the MLP on handwritten digits or the transformer on text.

Run: ``mpiexec -n 4 python -m mpizero train --model transformer --stage 3`` (any -n,
including 1). The same global batch and micro-batches give byte-identical
``--save-params`` files at every -n and stage.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from mpizero.checkpoint import store as checkpoint
from mpizero.checkpoint.flags import keep_count
from mpizero.comm.agree import ZeroError
from mpizero.core import faults, formulas
from mpizero.core.arrays import DEVICES, device_module, to_device
from mpizero.core.engine import ZeroEngine
from mpizero.core.memory import format_bytes
from mpizero.core.optim import OPTIMIZERS
from mpizero.core.precision import PRECISIONS
from mpizero.core.stages import STAGES, sharding
from mpizero.training.mlp import MLP
from mpizero.training.model import param_shapes
from mpizero.training.trainer import Trainer, make_groups
from mpizero.training.transformer import Transformer

DEFAULT_BUCKET_ELEMS = 1 << 21  # 8 MiB of float32; see README for the measurement behind it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="mlp", choices=["mlp", "transformer"])
    parser.add_argument("--device", default="cpu", choices=DEVICES, help="gpu: CuPy arrays (fp32 or fp16)")
    parser.add_argument("--stage", type=int, default=2, choices=sorted(STAGES))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global-batch", type=int, default=64, help="samples (sequences) per step, all ranks")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step, all ranks")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS))
    parser.add_argument("--reduction", default="exact", choices=["exact", "native"])
    parser.add_argument("--clip-norm", type=float, default=1.0, help="0 disables clipping")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--width", type=int, default=None, help="hidden width (mlp 128, transformer 64)")
    parser.add_argument("--layers", type=int, default=2, help="hidden layers / transformer blocks")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=32, help="transformer context length")
    parser.add_argument("--loss-scale-power", type=int, default=16, help="fp16: initial loss scale 2**this")
    parser.add_argument("--bucket-elems", type=int, default=DEFAULT_BUCKET_ELEMS)
    parser.add_argument("--no-overlap", action="store_true", help="use blocking collectives only")
    parser.add_argument("--watchdog", type=float, default=300.0, help="seconds a collective may wait (0: off)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--save-params", default=None, help="write the final fp32 master parameters (.npy)")
    parser.add_argument("--memory-json", default=None, help="write rank 0's memory report (JSON)")
    parser.add_argument("--checkpoint-dir", default=None, help="save sharded checkpoints here")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: never)")
    parser.add_argument("--keep", type=keep_count, default=2, help="complete checkpoints to keep (>= 1)")
    parser.add_argument("--resume", default=None, help="a checkpoint, or a directory of them (newest complete)")
    parser.add_argument(
        "--resume-override",
        action="append",
        default=[],
        metavar="HYPER",
        help="on --resume, take this optimizer hyper-parameter (lr, ...) from the command line, not the checkpoint",
    )


def build(args, corpus_vocab: int | None = None):
    """Return the model the flags describe."""
    if args.model == "mlp":
        width = args.width or 128
        return MLP((64, *[width] * args.layers, 10), objective="xent")
    width = args.width or 64
    return Transformer(corpus_vocab, args.block_size, width, args.heads, args.layers)


def check_arguments(args, world_size: int) -> None:
    """Raise a ZeroError naming the value for flags no run could use (the same on every rank)."""
    problems = []
    if args.steps < 1:
        problems.append(f"--steps must be >= 1, got {args.steps}")
    if args.micro_batches < 1 or args.global_batch % max(args.micro_batches, 1):
        problems.append(f"--global-batch {args.global_batch} must split into --micro-batches {args.micro_batches}")
    if args.micro_batches < world_size:
        problems.append(f"--micro-batches {args.micro_batches} is fewer than the {world_size} ranks")
    if args.lr <= 0 or args.clip_norm < 0 or args.bucket_elems < 1 or args.layers < 1:
        problems.append("--lr, --bucket-elems and --layers must be positive and --clip-norm >= 0")
    if args.device == "gpu" and args.precision == "bf16":
        problems.append("--precision bf16 is not available with --device gpu (CuPy has no bfloat16)")
    if problems:
        raise ZeroError("; ".join(problems))


DATA_SETTINGS = ("model", "seed", "global_batch", "micro_batches", "block_size")


def run(args, comm) -> int:
    from mpizero.training.datasets import Corpus, Digits

    check_arguments(args, comm.Get_size())
    data = Digits.load() if args.model == "mlp" else Corpus.load()
    model = build(args, None if args.model == "mlp" else len(data.alphabet))
    precision = PRECISIONS[args.precision]
    xp = device_module(args.device)
    engine = make_engine(args, model, precision, comm, xp)
    trainer = Trainer(model, engine, precision, 2.0**args.loss_scale_power)
    first_step = resume(args, engine, trainer) + 1 if args.resume else 1
    size = args.global_batch // args.micro_batches
    if args.model == "mlp":
        batch = lambda m, step: data.micro_batch(args.seed, step, m, size, args.micro_batches)  # noqa: E731
    else:
        batch = lambda m, step: data.micro_batch(args.seed, step, m, size, args.block_size)  # noqa: E731
    rank0 = comm.Get_rank() == 0
    if rank0:
        print(
            f"{args.model}: {engine.numel:,} parameters, stage {args.stage}, {comm.Get_size()} ranks, "
            f"{args.precision}, {args.reduction} reduction",
            flush=True,
        )
    for step in range(first_step, args.steps + 1):
        faults.maybe_kill("step", step, comm.Get_rank())
        engine.collectives.traffic.clear()
        start = time.perf_counter()
        report = trainer.step(lambda m, step=step: to_device(batch(m, step), xp), args.micro_batches)
        elapsed = time.perf_counter() - start
        if rank0 and (step % args.log_every == 0 or step in (first_step, args.steps)):
            print(progress_line(args, step, report, elapsed, engine.memory()), flush=True)
        if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
            path = checkpoint.save(engine, args.checkpoint_dir, training_state(args, step, engine, trainer), args.keep)
            if rank0:
                print(f"saved {path}", flush=True)
    master = engine.master_params()
    if rank0:
        print_accounting(engine, -(-args.micro_batches // comm.Get_size()))
        evaluate(args, model, data, master)
        if args.save_params:
            save_flat(args.save_params, model, master)
        if args.memory_json:
            with open(args.memory_json, "w") as f:
                json.dump(engine.memory_report(), f)
    return 0


def make_engine(args, model, precision, comm, xp) -> ZeroEngine:
    return ZeroEngine(
        to_device(model.init(args.seed), xp),
        OPTIMIZERS[args.optimizer](lr=args.lr),
        comm=comm,
        groups=make_groups(model, sharding(args.stage).params, args.bucket_elems),
        stage=args.stage,
        reduction=args.reduction,
        param_dtype=precision.param_dtype.name,
        clip_norm=args.clip_norm or None,
        on_nonfinite="skip" if precision.loss_scaling else "raise",
        overlap=not args.no_overlap,
        watchdog=args.watchdog or None,
    )


def training_state(args, step: int, engine, trainer) -> dict:
    """Everything besides the shards that the next step needs: counters, loss scale, data settings."""
    scaler = trainer.scaler
    return {
        "step": int(step),
        "optimizer_steps": int(engine.step_count),
        "skipped_steps": int(engine.skipped_steps),
        "loss_scale": None if scaler is None else [float(scaler.scale), int(scaler.good_steps)],
        "data": {name: getattr(args, name) for name in DATA_SETTINGS},
    }


def resume(args, engine, trainer) -> int:
    """Load the checkpoint ``--resume`` names into the engine and trainer; return the step it ended.

    The checkpoint's optimizer type and hyper-parameters must equal this run's
    (``--resume-override NAME`` lets NAME differ), and its data settings too.
    """
    comm = engine.comm
    found = None
    if comm.Get_rank() == 0:
        try:
            found = checkpoint.resolve(args.resume)
        except checkpoint.CheckpointError as error:
            found = str(error)
    found = engine.collectives.bcast_object(found, "the checkpoint to resume")
    if isinstance(found, str):
        raise checkpoint.CheckpointError(found)
    path, torn = found
    if comm.Get_rank() == 0:
        for message in torn:
            print(message, flush=True)
    state = checkpoint.load(engine, path, overrides=args.resume_override)
    where = os.path.join(path, checkpoint.MANIFEST)
    for k in DATA_SETTINGS:
        if state["data"].get(k) != getattr(args, k):
            raise checkpoint.CheckpointError(
                f"{where}: field training.data.{k}: checkpoint {state['data'].get(k)!r}, "
                f"this run --{k.replace('_', '-')} {getattr(args, k)!r} (data settings must match)"
            )
    if state["optimizer_steps"] + state["skipped_steps"] != state["step"]:
        raise checkpoint.CheckpointError(
            f"{where}: field training.step: {state['step']}, but optimizer_steps {state['optimizer_steps']} "
            f"+ skipped_steps {state['skipped_steps']} = {state['optimizer_steps'] + state['skipped_steps']}"
        )
    engine.step_count, engine.skipped_steps = state["optimizer_steps"], state["skipped_steps"]
    if trainer.scaler is not None and state["loss_scale"] is not None:
        trainer.scaler.scale, trainer.scaler.good_steps = state["loss_scale"]
    if comm.Get_rank() == 0:
        print(f"resumed from {path} after step {state['step']}", flush=True)
    return state["step"]


def progress_line(args, step: int, report, elapsed: float, held: dict) -> str:
    """One line of progress: step, loss, throughput, step time, bytes this rank holds."""
    per_sample, unit = (args.block_size, "tokens") if args.model == "transformer" else (1, "samples")
    skipped = "  (skipped)" if report.skipped else ""
    scale = f"  scale {report.loss_scale:g}" if args.precision == "fp16" else ""
    memory = " ".join(f"{kind} {nbytes / 1024:.0f}K" for kind, nbytes in held.items())
    return (
        f"step {step:>5}  loss {report.loss:.4f}{skipped}{scale}  "
        f"{args.global_batch * per_sample / elapsed:,.0f} {unit}/s  {elapsed * 1e3:.1f} ms  held/rank {memory}"
    )


def print_accounting(engine, rounds: int) -> None:
    """Rank 0's bytes by kind (now and peak), peak RSS, and the last step's traffic beside the formula."""
    report = engine.memory_report()
    print("memory on rank 0:  " + "  ".join(f"{k} {format_bytes(v)}" for k, v in report["now"].items()))
    print(
        "peak during steps: "
        + "  ".join(f"{k} {format_bytes(v)}" for k, v in report["peak"].items())
        + f"  total {format_bytes(report['peak_total'])}  (process peak RSS {format_bytes(report['rss'])})"
    )
    traffic = engine.collectives.traffic
    predicted = formulas.traffic_per_step(formula_setup(engine), rounds)
    moved = "  ".join(
        f"{op} {format_bytes(traffic.sent[op])} (formula {format_bytes(b)})" for op, b in predicted.items()
    )
    print(f"sent per step:     {moved}  agreement {format_bytes(traffic.sent['agreement'])}")


def formula_setup(engine) -> formulas.Setup:
    """The ``formulas.Setup`` describing a live engine."""
    return formulas.Setup(
        tuple(g.layout.numel for g in engine.groups),
        engine.comm.Get_size(),
        engine.config.stage,
        engine.groups[0].param_dtype.itemsize,
        engine.reduction.wire_dtype.itemsize,
        len(engine.optimizer.state_names),
        engine.config.align,
        engine.collectives.shared and engine.groups[0].xp is np,
    )


def evaluate(args, model, data, master) -> None:
    """Print the held-out figure the README quotes for this model."""
    from mpizero.training.model import forward_backward

    if args.model == "mlp":
        x, y = data.held_out()
        out = x
        for unit in model.units:
            out, _ = unit.forward(out, master)
        print(f"held-out accuracy: {np.mean(out.argmax(axis=1) == y):.4f} on {len(y)} digits")
    else:
        x, y = data.held_out(args.block_size)
        loss, _ = forward_backward(model, master, x, y)
        print(f"held-out loss: {loss:.4f} nats/char (unigram entropy {data.unigram_entropy():.4f})")


def save_flat(path: str, model, master: dict) -> None:
    """Write every parameter, in model order, as one flat float32 .npy; atomically."""
    flat = np.concatenate([master[name].reshape(-1) for name in param_shapes(model)])
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, flat)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
