"""Checks ``train`` makes before its first step, once the model is built: sizes against the data, memory, disk.

Each rank checks what it can see (its host's available memory for the ranks
on it, the free space where rank 0 will write) and the ranks agree, so a run
that could not finish stops now, on every rank with the same message, rather
than after its steps.
"""

from __future__ import annotations

import math

from mpizero.comm import agree
from mpizero.core import files, formulas
from mpizero.core.memory import format_bytes
from mpizero.core.optim import OPTIMIZERS
from mpizero.training.model import param_shapes
from mpizero.training.registry import formula_setups

JSON_BYTES = 1 << 16  # room for --memory-json and a manifest's fixed part


def check(args, task, data, model, collectives) -> None:
    """Raise the same ZeroError on every rank if the data, the memory or the disk cannot hold this run."""
    problems = task.data_problems(data)
    if not args.no_memory_check:
        units = task.unit_runs(data)
        problems += memory_problems(args, units, collectives.comm.Get_size(), collectives.node.Get_size())
    if collectives.comm.Get_rank() == 0:
        problems += files.space_problems(space_needed(args, model))
    agree.raise_if_any(collectives, "; ".join(problems) or None, "before the first step")


def predicted_bytes(args, units: list, ranks: int) -> int:
    """Bytes one rank needs: the engine's buffers at ``--stage`` (``formulas``) and the full fp32 initial
    parameters every rank builds before it keeps its shard."""
    setups = dict(formula_setups(units, ranks, args.precision, args.reduction, args.optimizer, args.bucket_elems))
    numel = sum(sum(unit.tensors) * unit.count for unit in units)
    return sum(formulas.engine_bytes(setups[args.stage]).values()) + 4 * numel


def memory_problems(args, units: list, ranks: int, ranks_here: int) -> list[str]:
    """Whether the ranks on this host fit in its available memory."""
    available = available_memory()
    needed = predicted_bytes(args, units, ranks)
    if available is None or needed * ranks_here <= available:
        return []
    return [
        f"predicted memory {format_bytes(needed)} per rank x {ranks_here} ranks on this host = "
        f"{format_bytes(needed * ranks_here)}, but {format_bytes(available)} is available: use smaller sizes, "
        "a higher --stage, more hosts, or --no-memory-check"
    ]


def available_memory() -> int | None:
    """Linux's estimate of memory available without swapping (``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def space_needed(args, model) -> dict[str, tuple[str, int]]:
    """What rank 0's outputs and one checkpoint will write, by flag: ``{flag: (path, bytes)}``."""
    numel = sum(math.prod(shape) for shape in param_shapes(model).values())
    states = 1 + len(OPTIMIZERS[args.optimizer](lr=1.0).state_names)
    needs = {}
    if args.checkpoint_dir:
        needs["--checkpoint-dir"] = (args.checkpoint_dir, 4 * states * numel + JSON_BYTES)
    if args.save_params:
        needs["--save-params"] = (args.save_params, 4 * numel + JSON_BYTES)
    if args.memory_json:
        needs["--memory-json"] = (args.memory_json, JSON_BYTES)
    return needs
