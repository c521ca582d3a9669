"""Checks ``train`` makes before its first step, once the model is built: data, memory, disk, checkpoint files.

Each rank checks what it can see (its host's available memory for the ranks
on it, the free space of each file system its host writes to, for what every
rank of the host will write there together: the offload files each claims at
set-up, and rank 0's outputs and the checkpoints on disk at once; whether rank 0 can create
the files of the last checkpoint it will save) and the ranks agree, so a run
that could not finish stops now, on every rank with the same message, rather
than after its steps. (The key is agreed earlier, by ``main``.)
"""

from __future__ import annotations

import dataclasses

from mpizero import files
from mpizero.checkpoint import catalog
from mpizero.comm import agree
from mpizero.comm.job.ranks import world_ranks
from mpizero.core import formulas
from mpizero.core.memory import format_bytes
from mpizero.core.optim import OPTIMIZERS
from mpizero.errors import CheckpointError
from mpizero.training.registry import formula_setups

JSON_BYTES = 1 << 16  # room for --memory-json and a manifest's fixed part
RANK_ROW_BYTES = 256  # room for one rank's peaks in --memory-json


def check(args, task, data, collectives) -> None:
    """Raise the same ZeroError on every rank if the data, the memory or the disk cannot hold this run."""
    problems, units = task.data_problems(data), task.unit_runs(data)
    numel = sum(sum(unit.tensors) * unit.count for unit in units)
    if not args.no_memory_check:
        ranks = collectives.comm.Get_size()
        size, loaded = args.global_batch // args.micro_batches, -(-args.micro_batches // ranks)
        one_host = collectives.one_host and args.device != "gpu"  # as the engine's ``Collectives.node_blocks``
        needed = predicted_bytes(args, units, ranks, one_host) + task.batch_bytes(data, size, loaded)
        if args.device == "gpu":  # one rank's need against its device's free memory: never a false refusal
            problems += memory_problems(needed, 1, device_memory(), "on its GPU")
        else:
            problems += memory_problems(needed, collectives.node.Get_size(), available_memory(), "on this host")
    ranks = collectives.comm.Get_size()
    problems += space_problems(args, units, numel, collectives)
    if collectives.comm.Get_rank() == 0:
        problems += save_problems(args, ranks)
    agree.raise_if_any(collectives, "; ".join(problems) or None, "before the first step")


def space_problems(args, units: list, numel: int, collectives) -> list[str]:
    """Whether the file systems this rank's host writes to hold what all of the host's ranks will write there
    together (collective: every rank says what it will write, and where)."""
    rank, ranks = collectives.comm.Get_rank(), collectives.comm.Get_size()
    needs = space_needed(args, numel, ranks) if rank == 0 else []
    if args.offload_dir:
        needs.append(("--offload-dir", args.offload_dir, offload_bytes(args, units, ranks)))
    host = world_ranks(collectives.node)  # the ranks sharing this rank's memory: its host, as the engine's paths
    everyone = collectives.allgather_object((host, needs), "the disk space each rank will write")
    return files.space_problems([need for where, named in everyone if where == host for need in named])


def save_problems(args, ranks: int) -> list[str]:
    """Whether rank 0 can create the files of the last checkpoint this run saves (their names are the longest)."""
    if not args.checkpoint_dir:
        return []
    last = args.steps - args.steps % args.checkpoint_every
    problem = catalog.save_problem(args.checkpoint_dir, last, ranks)
    return [f"--checkpoint-dir {args.checkpoint_dir}: {problem}"] if problem else []


def predicted_bytes(args, units: list, ranks: int, one_host: bool) -> int:
    """Bytes one rank's model states need: the engine's buffers at ``--stage`` (``formulas``), with
    ``--offload-dir`` the most states an update reads in at once, with ``--keep-gathered`` the full params kept
    through a step (none where every rank shares one host's memory: ``one_host``, read in place). The initial
    values are made shard by shard (``initial.sharded``), so no rank builds the whole model besides them."""
    setup = _setup(args, units, ranks)
    read_in = formulas.offload_bytes(setup)["in_memory_peak"] if setup.offloaded else 0
    kept = formulas.kept_bytes(dataclasses.replace(setup, shared_memory=one_host))
    return sum(formulas.engine_bytes(setup).values()) + read_in + kept


def offload_bytes(args, units: list, ranks: int) -> int:
    """Bytes of offload files one rank claims at set-up (``formulas.offload_bytes``)."""
    return formulas.offload_bytes(_setup(args, units, ranks))["disk"]


def _setup(args, units: list, ranks: int):
    """The engine's setup at ``--stage`` for the formulas, offloaded with ``--offload-dir``, kept gathered with
    ``--keep-gathered``."""
    setups = dict(formula_setups(units, ranks, args.precision, args.reduction, args.optimizer, args.bucket_elems))
    return dataclasses.replace(setups[args.stage], offloaded=bool(args.offload_dir), keep_gathered=args.keep_gathered)


def memory_problems(needed: int, ranks_here: int, available: int | None, where: str) -> list[str]:
    """Whether ``ranks_here`` ranks of ``needed`` bytes each fit in ``available`` bytes (None: unknown)."""
    if available is None or needed * ranks_here <= available:
        return []
    return [
        f"predicted memory {format_bytes(needed)} per rank x {ranks_here} ranks {where} = "
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


def device_memory() -> int | None:
    """Free bytes on this rank's current CUDA device, or None where CuPy cannot say."""
    try:
        import cupy

        return int(cupy.cuda.Device().mem_info[0])
    except Exception:  # no CuPy or no usable device: --device gpu reports that itself, once, elsewhere
        return None


def checkpoints_to_come(args) -> int:
    """The most checkpoints this run will have on disk at once beyond those there now: the ``--keep`` newest stay
    while the next is written; a resumed run's are there already, and its saves up to the step it resumes after
    are made. Where the folders cannot be read, as for a fresh run (the resume or the save names the problem)."""
    try:
        there = sum(found.complete for found in catalog.catalog(args.checkpoint_dir))
        resumed = (catalog.step_of(catalog.resolve(args.resume)[0]) if args.resume else 0) or 0
    except (OSError, CheckpointError):
        there = resumed = 0
    saves = args.steps // args.checkpoint_every - resumed // args.checkpoint_every
    return max(min(saves, args.keep + 1 - min(there, args.keep)), 0)


def space_needed(args, numel: int, ranks: int) -> list[tuple[str, str, int]]:
    """What rank 0's outputs and the checkpoints of ``numel`` parameters (every rank's files) will write at most
    beyond what is on disk now (``checkpoints_to_come``): ``(flag, path, bytes)``."""
    states = 1 + OPTIMIZERS[args.optimizer].states_per_element()
    needs = []
    if args.checkpoint_dir:
        more = checkpoints_to_come(args)
        needs.append(("--checkpoint-dir", args.checkpoint_dir, more * (4 * states * numel + JSON_BYTES)))
    if args.save_params:
        needs.append(("--save-params", args.save_params, 4 * numel + JSON_BYTES))
    if args.memory_json:
        needs.append(("--memory-json", args.memory_json, JSON_BYTES + RANK_ROW_BYTES * ranks))
    return needs
