"""``python -m mpizero verify``: train an MLP at every stage, compare with the reference after every step.

Run: ``mpiexec -n 4 python -m mpizero verify`` (any -n, including 1). With ``--device gpu --against cpu`` it
compares the engine on the GPU with the engine on the host instead, bit for bit (``against``); exit status 3
there means the device refused a precision (named) and nothing else differed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpizero import compiled
from mpizero.arrays import device_module, to_device, to_host
from mpizero.cli import against, options
from mpizero.cli.bitwise import Mismatch, first_difference
from mpizero.cli.verify_runs import (
    JUMP_PER_RANK,
    JUMP_STEP,
    SMALL_STEP,
    build_engine,
    build_model,
    make_optimizer,
    micro_batches_at,
    numerics,
    synthetic_batch,
)
from mpizero.comm.paths import CommPaths, asking_for
from mpizero.core.held import on_host
from mpizero.core.memory import format_bytes
from mpizero.core.optim.oracle import DocumentedOptimizer
from mpizero.core.precision import PRECISIONS, LossScaler
from mpizero.core.reference import Reference
from mpizero.core.stages import STAGES
from mpizero.training.model import forward_backward
from mpizero.training.trainer import Trainer, reference_step

REFERENCE_SETTINGS = ("param_dtype", "clip_norm", "on_nonfinite", "scale_headroom")
NATIVE_TOLERANCE = 1e-4
# relative max-norm; float32 rounding drifts by up to ~2e-8 per step (README, "What verify checks")
SEMANTICS_TOLERANCE, SEMANTICS_TOLERANCE_PER_STEP = 1e-5, 1e-7
# relative max-norm between the averaged mixed-precision gradients and the same step computed in fp32: fp16 stores
# each gradient with an 11-bit significand (relative error up to 2**-11 = 4.9e-4); bf16 keeps gradients in fp32
GRADIENT_TOLERANCE = {"fp16": 2e-3, "bf16": 1e-5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stage", default="all", choices=[*map(str, STAGES), "all"], help="the ZeRO stage to verify, or all"
    )
    options.add(parser, "model", help="mlp: a 13-31-29-5 regression MLP; transformer: 2 blocks of width 16")
    options.add(parser, "device", help="cpu: NumPy; gpu: CuPy arrays, the reference on the GPU too")
    parser.add_argument(
        "--against",
        choices=["cpu"],
        default=None,
        help="with --device gpu or standin: the same gradients through the engine on the host too, compared bit for "
        "bit after every step (instead of the reference on the device, which runs the device's kernels)",
    )
    options.add(parser, "optimizer", default="adam")
    options.add(parser, "precision", choices=[*sorted(PRECISIONS), "all"])
    options.add(parser, "reduction")
    options.add(parser, "steps", default=10, help="steps, each compared with the reference")
    options.add(parser, "seed")
    parser.add_argument(
        "--micro-batches",
        type=options.wholes(1),
        default=None,
        help="micro-batches per step, all ranks; a list (3,120) cycles step by step (default: 3 per rank, but 1 in all "
        f"at step {SMALL_STEP} and {JUMP_PER_RANK} per rank at step {JUMP_STEP}, so a missed scale is redone)",
    )
    parser.add_argument("--batch", type=options.whole(1), default=8, help="samples per micro-batch")
    options.add(parser, "clip_norm")
    options.add(parser, "bucket_elems", default=500)
    parser.add_argument("--perturb-rank", type=int, default=None, help=argparse.SUPPRESS)
    options.add(parser, "watchdog")
    options.add(parser, "scale_headroom")
    parser.add_argument(
        "--paths",
        choices=["auto", "all"],
        default="auto",
        help="auto: the reduce-scatter path the environment picks (MPIZERO_REDUCE_SCATTER); all: that one, then "
        "every other this job can take (node-shared, pieces, one MPI call: the float32 rounds of the last two), "
        "each verified",
    )


def check(args, world_size: int) -> None:
    """Raise a ZeroError for settings no verification could use (ranges are checked while parsing)."""
    problems = []
    if args.against and args.device == "cpu":
        problems.append("--against cpu compares a device with the host: give --device gpu or standin")
    if args.against and args.reduction != "exact":
        problems.append(f"--against cpu needs --reduction exact: {args.reduction} sums differ between paths")
    if args.against and args.paths == "all":
        problems.append("--against cpu compares the device with the host on one path: give it without --paths all")
    if args.perturb_rank is not None and not 0 <= args.perturb_rank < world_size:
        problems.append(f"--perturb-rank {args.perturb_rank} is not a rank of the {world_size} ranks")
    options.raise_problems(problems)


OUTPUTS: dict[str, str] = {}
INPUTS: dict[str, str] = {}
OUTPUT_DIRS: dict[str, str] = {}
WORK_DIRS: dict[str, str] = {}


def precisions(args) -> list[str]:
    """The precisions ``--precision`` names: one, or every one (``all``)."""
    return list(PRECISIONS) if args.precision == "all" else [args.precision]


def with_precision(args, name: str) -> argparse.Namespace:
    """``args`` with ``--precision name``."""
    return argparse.Namespace(**{**vars(args), "precision": name})


def run(args, comm) -> int:
    """Verify each requested precision and stage; print one line each on rank 0; return the exit code."""
    stages = list(STAGES) if args.stage == "all" else [int(args.stage)]
    if args.against:
        return against.run(args, comm, stages, precisions(args))
    failed = False
    for name in precisions(args):
        for stage in stages:
            line, ok, paths = verify_stage(stage, with_precision(args, name), comm)
            lines = [line]
            others = [p for p in paths.runnable() if p != paths.reduce_scatter] if args.paths == "all" else []
            for path in others:  # the same list on every rank: the paths are agreed
                with asking_for(path):
                    other, other_ok, _ = verify_stage(stage, with_precision(args, name), comm, path)
                lines.append(other)
                ok &= other_ok
            failed |= not ok
            if comm.Get_rank() == 0:
                if stage == stages[0] and name == precisions(args)[0]:
                    print(paths.describe(), flush=True)
                print("\n".join(lines), flush=True)
    return 1 if failed else 0


def verify_stage(stage: int, args, comm, path: str | None = None) -> tuple[str, bool, CommPaths]:
    """Train ``args.steps`` steps at ``stage``; return rank 0's line, whether every check passed, and its paths.
    ``path``: the reduce-scatter path asked for, named in the line (None: the environment's, not named)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    model = build_model(args.model)
    xp = device_module(args.device)
    precision = PRECISIONS[args.precision]
    engine, trainer, reference, documented = build_runs(stage, args, comm, model, precision)
    scaler = LossScaler() if precision.loss_scaling else None
    worst, first_mismatch, semantics = 0.0, None, SemanticsRecord.for_steps(args.steps)
    gradients = SemanticsRecord(GRADIENT_TOLERANCE[args.precision]) if args.precision in GRADIENT_TOLERANCE else None
    for step in range(1, args.steps + 1):
        micro_batches = micro_batches_at(step, args.micro_batches, size)
        batches = [to_device(synthetic_batch(model, args.seed, step, m, args.batch), xp) for m in range(micro_batches)]
        engine.collectives.traffic.clear()
        trainer.step(batches.__getitem__, micro_batches)
        taken, compute_params = reference.step_count, reference.compute_params()
        reference_step(model, reference, batches, precision, scaler)
        if reference.step_count > taken:  # a step skipped for fp16 overflow is skipped by torch too
            documented.step(reference.averaged)
            if gradients is not None:
                gradients.note(step, fp32_difference(model, compute_params, batches, reference.averaged))
        if args.perturb_rank == rank and step == 1:
            shard = engine.groups[0].master_shard
            shard[:1] = to_device(np.nextafter(to_host(shard[:1]), np.float32(np.inf)), xp)
        if engine.reduction.bitwise:
            first_mismatch = first_mismatch or compare_bits(step, rank, engine, reference)
        else:
            worst = max(worst, relative_difference(engine, reference))
        semantics.note(step, semantics_difference(engine, documented.params))
    via = "" if path is None else f"  reduce-scatter {path}"
    head = (
        f"stage {stage}{via}  ranks {size}  steps {args.steps}  model {args.model}  optimizer {args.optimizer}  "
        f"{args.precision}  reduction {args.reduction}  {accounting(engine)}  redone {engine.redone_steps}  "
        f"kept {engine.scales.kept_steps}:"
    )
    reference_line, reference_ok = reference_verdict(engine, worst, first_mismatch)
    semantics_line, semantics_ok = semantics.verdict(engine.collectives, documented.name)
    line, ok = f"{head} {reference_line}; {semantics_line}", reference_ok and semantics_ok
    refused = kernels_refused(engine.collectives)
    if refused:
        line, ok = f"{line}; compiled kernels NOT USED, NumPy evaluated them instead: {'; '.join(refused)}", False
    if gradients is not None:
        verdict, detail, gradients_ok = gradients.agreed(engine.collectives)
        line, ok = (
            f"{line}; {args.precision} gradients {verdict} {gradients.tolerance:.0e} of fp32 ({detail})",
            ok and gradients_ok,
        )
    return line, ok, engine.collectives.paths


def kernels_refused(collectives) -> list[str]:
    """Every compiled kernel a rank found giving other bits than NumPy's formula at first load, and why
    (``compiled.REFUSED``): the run's bits are right, by NumPy, but the machine's compiler is not to be trusted
    (collective)."""
    everyone = collectives.allgather_object(list(compiled.REFUSED), "the compiled kernels not used")
    return sorted({f"rank {rank}: {what}" for rank, found in enumerate(everyone) for what in found})


def build_runs(stage: int, args, comm, model, precision):
    """The engine and its trainer, the single-rank reference, and the optimizer's documented algorithm.

    The engine makes its values shard by shard (``initial.sharded``); the reference and the documented optimizer,
    which every rank runs to check its own shard, start from the whole model built at once (``model.init``), so a
    different initial value is caught as a mismatch."""
    params = to_device(model.init(args.seed), device_module(args.device))
    optimizer = make_optimizer(args, model)
    engine = build_engine(stage, args, comm, model, precision, optimizer, args.device)
    settings = numerics(args, precision)
    reference = RecordingReference(params, optimizer, args.reduction, **{k: settings[k] for k in REFERENCE_SETTINGS})
    host_params = {n: to_host(p) for n, p in params.items()}
    documented = DocumentedOptimizer(optimizer, host_params, settings["clip_norm"])
    return engine, Trainer(model, engine, precision), reference, documented


def reference_verdict(engine, worst: float, first_mismatch: Mismatch | None) -> tuple[str, bool]:
    """Agree on the comparison with the reference: bitwise or the first mismatch (exact), or the tolerance (native)."""
    if not engine.reduction.bitwise:
        worst = engine.collectives.allreduce_value(worst, MPI.MAX, "the largest difference")
        ok = worst <= NATIVE_TOLERANCE
        verdict = "within" if ok else "OUTSIDE"
        detail = f"max relative difference {worst:.2e}, tolerance {NATIVE_TOLERANCE:.0e}; not bitwise"
        return f"{verdict} tolerance ({detail})", ok
    reports = [m for m in engine.collectives.allgather_object(first_mismatch, "mismatches") if m is not None]
    if reports:
        return str(min(reports, key=lambda m: (m.step, m.rank))), False
    return "bitwise", True


class RecordingReference(Reference):
    """The reference, keeping each step's averaged gradients (before clipping) in float64."""

    averaged: dict[str, np.ndarray]  # set by every step that is taken

    def average(self, contributions):
        result = super().average(contributions)
        self.averaged = {n: to_host(g).astype(np.float64) for n, g in result.items()}
        return result


@dataclass
class SemanticsRecord:
    """The largest relative difference from the documented optimizer so far, and the first step over tolerance."""

    tolerance: float
    worst: float = 0.0
    first_failure: int = 0

    @classmethod
    def for_steps(cls, steps: int) -> SemanticsRecord:
        """The tolerance grows with the run once float32 drift could approach it: 1e-5, or 1e-7 per step."""
        return cls(max(SEMANTICS_TOLERANCE, SEMANTICS_TOLERANCE_PER_STEP * steps))

    def note(self, step: int, difference: float) -> None:
        self.worst = max(self.worst, difference)
        if not difference <= self.tolerance and not self.first_failure:  # NaN fails too
            self.first_failure = step

    def agreed(self, collectives) -> tuple[str, str, bool]:
        """Agree on the worst difference over ranks: ``within`` or ``OUTSIDE``, the details, whether within."""
        worst = collectives.allreduce_value(self.worst, MPI.MAX, "the largest difference within a tolerance")
        failures = [s for s in collectives.allgather_object(self.first_failure, "tolerance failures") if s]
        detail = f"max rel diff {worst:.1e}"
        if failures:
            detail += f", first over at step {min(failures)}"
        return ("OUTSIDE" if failures else "within"), detail, not failures

    def verdict(self, collectives, name: str) -> tuple[str, bool]:
        """The optimizer-semantics verdict text, and whether it is within tolerance."""
        verdict, detail, ok = self.agreed(collectives)
        return f"optimizer semantics {verdict} {self.tolerance:.0e} of the documented {name} ({detail})", ok


def fp32_difference(model, compute_params: dict, batches: list, averaged: dict) -> float:
    """Max |averaged - the same gradients computed, stored and averaged in fp32 (float64 mean)|, relative to the
    fp32 gradients' max-norm: a tolerance check of the mixed-precision path (never bitwise)."""
    fp32 = {name: np.zeros(p.shape, np.float64) for name, p in compute_params.items()}
    for x, y in batches:
        for name, grad in forward_backward(model, compute_params, x, y)[1].items():
            fp32[name] += to_host(grad).astype(np.float64) / len(batches)
    scale = max(float(np.max(np.abs(g), initial=0.0)) for g in fp32.values()) or 1.0
    return max(float(np.max(np.abs(averaged[n] - g), initial=0.0)) for n, g in fp32.items()) / scale


def semantics_difference(engine, documented_params) -> float:
    """Max |engine master - documented| over this rank's owned ranges, relative to the documented max-norm."""
    scale = max(float(np.max(np.abs(p), initial=0.0)) for p in documented_params.values()) or 1.0
    worst = 0.0
    for group in engine.groups:
        expected = flatten(group, documented_params, np.float64)
        for what, start, buffer in group.held_buffers():
            if what == "master":
                mine = to_host(buffer).astype(np.float64)
                worst = max(worst, float(np.max(np.abs(mine - expected[start : start + mine.size]), initial=0.0)))
    return worst / scale


def accounting(engine) -> str:
    """Rank's bytes held now and at the peak, and bytes sent in the last step."""
    report = engine.memory_report()
    sent = sum(v for op, v in engine.collectives.traffic.sent.items() if op != "agreement")
    return (
        f"held/rank {format_bytes(sum(report['now'].values()))} (peak {format_bytes(report['peak_total'])})  "
        f"sent/step {format_bytes(sent)}"
    )


def compared_pairs(engine, reference):
    """Yield ``(what, group, start, engine array, reference flat slice)`` for every held buffer."""
    for group in engine.groups:
        flat = {"params": flatten(group, reference.params)}
        for state_name in engine.bound.state_names:
            flat[state_name] = flatten(group, {n: s[state_name] for n, s in reference.state.items()})
        for what, start, buffer in group.held_buffers():
            source = flat["params" if what in ("params", "master") else what]
            yield what, group, start, buffer, source[start : start + buffer.size]


def flatten(group, tensors, dtype=np.float32) -> np.ndarray:
    """Lay reference tensors out as the group's padded flat buffer."""
    flat = np.zeros(group.partition.padded_numel, dtype=dtype)
    for name, view in group.layout.views(flat).items():
        view[...] = to_host(tensors[name])
    return flat


def compare_bits(step: int, rank: int, engine, reference) -> Mismatch | None:
    """Return the first element whose raw bytes differ from the reference, or None."""
    return first_difference(step, rank, compared_pairs(engine, reference))


def relative_difference(engine, reference) -> float:
    worst = 0.0
    for _, _, _, mine, expected in compared_pairs(engine, reference):
        scale = float(np.max(np.abs(expected))) or 1.0
        worst = max(worst, float(np.max(np.abs(on_host(mine).astype(np.float32) - expected))) / scale)
    return worst
