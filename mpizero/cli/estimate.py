"""``python -m mpizero estimate``: predicted model-state bytes per rank, and traffic per step.

Run: ``python -m mpizero estimate --params 7.5e9 --ranks 64`` (the ZeRO paper's
formulas), or ``python -m mpizero estimate --model transformer --ranks 4``
(mpizero's own buffers for that model, padding counted exactly). ``--scale``
adds, per stage, collective calls and bytes per step, agreement bytes, what
one checkpoint save writes and what a reshard onto 3/4 of the ranks reads: ``estimate --model transformer --width 4416
--layers 32 --heads 32 --precision bf16 --ranks 4096 --micro-batches 32768 --scale``.
"""

from __future__ import annotations

import argparse
import dataclasses

from mpizero.checkpoint import scale
from mpizero.cli import options
from mpizero.core import formulas
from mpizero.core.memory import format_bytes
from mpizero.core.reduce.exact import FLOAT32_BITS, SUM_BITS
from mpizero.errors import ZeroError
from mpizero.training.registry import Size, entry, formula_setups
from mpizero.training.runs import group_runs

OUTPUTS: dict[str, str] = {}
INPUTS: dict[str, str] = {}
OUTPUT_DIRS: dict[str, str] = {}
WORK_DIRS: dict[str, str] = {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params", type=options.number(0, above=True), default=None, help="Psi, for the paper's formulas"
    )
    options.add(parser, "ranks", default=None, required=True)
    parser.add_argument(
        "--k", type=options.whole(0), default=formulas.PAPER_K, help="paper: optimizer bytes per parameter"
    )
    options.add(parser, "model", default=None, help="predict mpizero's own buffers for this model")
    options.add(parser, *options.MODEL_SETTINGS[1:])
    options.add(parser, "micro_batches", help="micro-batches per step, all ranks (stage 3 gathers once per round)")
    parser.add_argument(
        "--scale", action="store_true", help="with --model: calls, bytes per step and checkpoint files per stage"
    )
    parser.add_argument(
        "--offload",
        action="store_true",
        help="with --model: the master, optimizer and grad shards on disk (train --offload-dir): bytes in memory "
        "and on disk per stage, and the largest model of this shape --ram and --disk hold",
    )
    parser.add_argument(
        "--ram", type=options.number(0, above=True), default=None, help="with --offload: bytes of memory, all ranks"
    )
    parser.add_argument(
        "--disk", type=options.number(0, above=True), default=None, help="with --offload: bytes of disk, all ranks"
    )


def check(args, world_size: int) -> None:
    """Raise a ZeroError unless there is something to estimate, at sizes the model can have."""
    if args.params is None and args.model is None:
        raise ZeroError("give --params PSI (the paper's formulas) or --model NAME (mpizero's buffers), or both")
    for flag in ("scale", "offload"):
        if getattr(args, flag) and args.model is None:
            raise ZeroError(f"--{flag} needs --model NAME: the groups and tensors it counts come from the model")
    if (args.ram or args.disk) and not args.offload:
        raise ZeroError("--ram and --disk go with --offload")
    if args.model is not None:
        options.raise_problems(options.model_problems(args))


def run(args, comm) -> int:
    if comm.Get_rank() != 0:
        return 0
    if args.params is not None:
        print_paper_table(args.params, args.ranks, args.k)
    if args.model is not None:
        print_model_table(args)
    if args.scale:
        print_scale_table(args)
    if args.offload:
        print_offload_table(args)
    return 0


def print_paper_table(psi: float, ranks: int, k: int) -> None:
    print(f"ZeRO paper, mixed-precision Adam (K = {k}), Psi = {psi:g} parameters, N = {ranks} ranks")
    print(f"{'configuration':<20} {'model states per rank':>22}")
    for name, nbytes in formulas.paper_model_states(psi, ranks, k).items():
        print(f"{name:<20} {nbytes / 1e9:>19.1f} GB")


def print_model_table(args) -> None:
    rounds = -(-args.micro_batches // args.ranks)
    print(f"mpizero {args.model}, {args.precision}, {args.reduction} reduction, {args.ranks} ranks: bytes per rank")
    kinds = ("params", "grads", "master", "optimizer", "comm")
    print(f"{'stage':<6}" + "".join(f"{k:>12}" for k in kinds) + f"{'states':>12}{'traffic/step':>14}")
    for stage, setup in options.model_setups(args):
        held = formulas.engine_bytes(setup)
        states = sum(held[k] for k in ("params", "grads", "master", "optimizer"))
        traffic = sum(formulas.traffic_per_step(setup, rounds).values())
        cells = "".join(f"{format_bytes(held[k]):>12}" for k in kinds)
        print(f"{stage:<6}{cells}{format_bytes(states):>12}{format_bytes(traffic):>14}")


def print_offload_table(args) -> None:
    """Per stage, offloaded: bytes per rank in memory between steps (``engine_bytes``), the most an update reads in
    at once, and on disk; per parameter over all ranks, in memory and on disk; and how many parameters of this
    shape ``--ram`` and ``--disk`` hold (model states only: add the activations and transient buffers)."""
    task = entry(args.model, Size.of(args))
    numel = sum(sum(unit.tensors) * unit.count for unit in task.unit_runs(task.load()))
    print(f"offloaded (train --offload-dir), {args.ranks} ranks, {numel:,} parameters: bytes per rank")
    columns = ("in memory", "update reads", "on disk", "memory/param", "disk/param", "fits")
    print(f"{'stage':<6}" + "".join(f"{c:>14}" for c in columns))
    for stage, setup in options.model_setups(args):
        setup = dataclasses.replace(setup, offloaded=True)
        in_memory, on_disk = sum(formulas.engine_bytes(setup).values()), formulas.offload_bytes(setup)
        per_param = [(b * args.ranks) / numel for b in (in_memory + on_disk["in_memory_peak"], on_disk["disk"])]
        limits = [room / cost for room, cost in zip((args.ram, args.disk), per_param) if room and cost]
        cells = [format_bytes(b) for b in (in_memory, on_disk["in_memory_peak"], on_disk["disk"])]
        cells += [f"{b:.1f} B" for b in per_param] + [f"{min(limits):.3g}" if limits else "-"]
        print(f"{stage:<6}" + "".join(f"{c:>14}" for c in cells))


def print_scale_table(args) -> None:
    """Per stage 1-3: bytes held, calls and bytes per step by collective, and one checkpoint save, per rank.

    Stages 1-3 reduce gradients by reduce-scatter only, so no all-reduce column is shown.
    """
    task = entry(args.model, Size.of(args))
    units = task.unit_runs(task.load())
    n, rounds = args.ranks, -(-args.micro_batches // args.ranks)
    setups = formula_setups(units, n, args.precision, args.reduction, args.optimizer, args.bucket_elems)
    headroom = (args.micro_batches - 1).bit_length()
    print(
        f"at scale: {sum(sum(u.tensors) * u.count for u in units):,} parameters, {n} ranks, {args.micro_batches} "
        f"micro-batches per step ({rounds} per rank), clip on"
    )
    print("per rank and step (sent = received): rs/ag/agr = reduce-scatter/all-gather/agreement")
    print(f"checkpoint: files per save, rank 0's file, the manifest; rank 0 reloading onto {max(3 * n // 4, 1)} ranks")
    print(
        f"{'stage':<6}{'groups':>7}{'held':>11}{'rs':>11}{'ag':>11}{'agr':>11}{'calls rs/ag/agr':>16}"
        f"{'files':>7}{'rank file':>11}{'manifest':>11}{'needs':>11}{'reads':>11}"
    )
    for stage, setup in setups:
        if stage == 0:
            continue
        numels = [g.tensors for g in group_runs(units, stage, args.bucket_elems)]  # as ``build`` lists its groups
        held = sum(formulas.engine_bytes(setup).values())
        sent = formulas.traffic_per_step(setup, rounds)
        calls = formulas.calls_per_step(setup, rounds, True, args.reduction)
        agreed = formulas.agreement_bytes_per_step(setup, tuple(map(len, numels)), args.micro_batches, True)
        save = scale.one_save(*_named(numels, setup.counts()), _states(setup), n, max(3 * n // 4, 1))
        cells = "".join(f"{format_bytes(b):>11}" for b in (held, sent["reduce_scatter"], sent["allgather"], agreed))
        counts = "/".join(str(calls[op]) for op in ("reduce_scatter", "allgather", "agreement"))
        saved = "".join(
            f"{format_bytes(save[k]):>11}" for k in ("rank file", "manifest", "reshard needs", "reshard reads")
        )
        print(f"{stage:<6}{sum(setup.counts()):>7}{cells}{counts:>16}{save['files']:>7,}{saved}")
    print(
        f"exact reduction: {args.micro_batches} contributions take {headroom} of the int64 sum's {SUM_BITS} bits, "
        f"leaving {SUM_BITS - headroom} (it refuses above 2**{SUM_BITS - FLOAT32_BITS} contributions)"
    )


def _named(numels: list[tuple[int, ...]], counts: tuple[int, ...]) -> tuple[dict, list[list[str]]]:
    """Shapes and groups for a checkpoint of these groups (each ``count`` times), under made-up tensor names."""
    shapes, groups = {}, []
    for numels_of, count in zip(numels, counts, strict=True):
        for _ in range(count):
            groups.append([f"unit{len(groups):04d}.tensor{j:02d}" for j in range(len(numels_of))])
            shapes.update(zip(groups[-1], ((numel,) for numel in numels_of), strict=True))
    return shapes, groups


def _states(setup: formulas.Setup) -> list[str]:
    return ["master", *(f"state{k}" for k in range(setup.optimizer_states))]
