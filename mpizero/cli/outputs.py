"""The one check of every output a command names, made on rank 0 before any work and agreed.

An output is refused if writing it would overwrite a checkpoint: it is, or
lies inside, a directory holding a manifest anywhere, or a place where a save
into a checkpoint directory the command names puts one (``catalog``); or an
input; or another output; or if it is not a regular file, or its temporary
file cannot be created (``files``: name and path length, symlink loops,
permissions). Checkpoint directories must be directories that can be made
and written; so must work directories (the disk tier's), which must not be or
lie inside a checkpoint either. No two places a command names may be the same
path, and a work directory and a checkpoint directory may not hold one another:
each is checked against every other before any work.
"""

from __future__ import annotations

import os

from mpizero import files
from mpizero.checkpoint import catalog


def problems(
    outputs: dict[str, str], inputs: dict[str, str], directories: dict[str, str], work_directories: dict[str, str]
) -> list[str]:
    """Why the output files ``{flag: path}`` could not be written, or would clobber a checkpoint, an input
    (``{flag: path}``: files or checkpoints the command reads) or each other; and why the output
    ``directories`` (checkpoint directories) and ``work_directories`` could not be."""
    places = [*inputs.values(), *directories.values()]
    found, others = [], {}
    for flag, path in outputs.items():
        over = catalog.checkpoint_problem(path, places)
        if over:
            found.append(f"{flag} {path} {over}: it would be overwritten")
        else:
            others[flag] = path
    for flag, path in work_directories.items():
        over = catalog.checkpoint_problem(path, places)
        if over:
            found.append(f"{flag} {path} {over}: it would be written into")
    found += files.output_problems(others, inputs, directories)
    found += _overlaps(outputs, directories, work_directories)
    return found + directories_problems({"directories": directories, "work_directories": work_directories})


def directories_problems(named: dict[str, dict[str, str]]) -> list[str]:
    """Why this rank could not make or write the checkpoint and work directories ``named`` (``{kind: {flag:
    path}}``): what every rank checks, since every rank writes into them."""
    made = {**named["directories"], **named["work_directories"]}
    return [p for flag, path in made.items() for p in files.directory_problems(flag, path)]


def on_every_rank(found: list[list[str]]) -> list[str]:
    """Every rank's problems once: rank 0's, then those only other ranks have, naming them (``rank 2: ...``)."""
    others: dict[str, list[int]] = {}
    for rank, problems in enumerate(found[1:], 1):
        for problem in problems:
            if problem not in found[0]:
                others.setdefault(problem, []).append(rank)
    named = [f"rank {ranks[0]}: {p}" if len(ranks) == 1 else f"ranks {ranks}: {p}" for p, ranks in others.items()]
    return found[0] + named


def _overlaps(outputs: dict[str, str], directories: dict[str, str], work_directories: dict[str, str]) -> list[str]:
    """The named places that are one another, and the work and checkpoint directories that hold one another."""
    named = [
        (flag, os.path.realpath(path), path) for flag, path in {**outputs, **directories, **work_directories}.items()
    ]
    found = [
        f"{flag} {path} is also {other_flag}: each needs a place of its own"
        for i, (flag, real, path) in enumerate(named)
        for other_flag, other_real, _ in named[i + 1 :]
        if real == other_real
    ]
    for work_flag, work in work_directories.items():
        for flag, directory in directories.items():
            a, b = os.path.realpath(work), os.path.realpath(directory)
            if a != b and (a.startswith(b + os.sep) or b.startswith(a + os.sep)):
                found.append(f"{work_flag} {work} and {flag} {directory} hold one another: keep them apart")
    return found
