"""A checkpoint directory: the checkpoints in it, whose they are, which is newest, and which old ones go.

A checkpoint is a directory holding a manifest, whatever it is called; a save
names it ``ckpt-00000012`` (step 12). The names a save or a rotation gives a
checkpoint on its way in or out carry the run, so a crash at any moment leaves
something its run knows as its own:

- ``ckpt-00000012.partial-<run>-<nonce>``: a save being written;
- ``ckpt-00000012.replaced-<run>-<nonce>``: an older copy of the same step,
  moved aside while the new one is renamed into place;
- ``ckpt-00000012.removing-<run>-<nonce>``: a checkpoint rotation is deleting.

A numbered directory without a manifest is torn (a save or a deletion that did
not finish): it is skipped, and blocks no run. No output may be written over a
checkpoint, nor where a save would put one (``checkpoint_problem``). A run owns its directory: every
manifest records the run's identity (``training.run``), and a run may not save
where another run's checkpoints or saves are (``owner_problem``), so rotation
only ever deletes the run's own checkpoints older than the one just written.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from mpizero import files
from mpizero.checkpoint import lock, manifest
from mpizero.checkpoint.manifest import MANIFEST
from mpizero.checkpoint.shards import file_name
from mpizero.errors import CheckpointError

NAME = re.compile(r"^ckpt-(\d{8,})")
MARKED = re.compile(r"^ckpt-\d{8,}\.(partial|replaced|removing)-([0-9a-f]{16})-[0-9a-f]+$")
PARTIAL, REPLACED, REMOVING = "partial", "replaced", "removing"


def checkpoint_name(step: int) -> str:
    """The name a save gives the checkpoint of ``step``."""
    return f"ckpt-{step:08d}"


def marked(path: str, marker: str, run: str) -> str:
    """``path`` renamed for a checkpoint on its way in or out (``PARTIAL``, ``REPLACED``, ``REMOVING``) of ``run``."""
    return f"{path}.{marker}-{run}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class Found:
    """A checkpoint in a directory: its step and run where known, and why it cannot be used (None if it can)."""

    path: str
    step: int | None
    run: str | None
    problem: str | None = None
    marker: str | None = None

    @property
    def complete(self) -> bool:
        return self.problem is None and self.marker in (None, REPLACED)


def catalog(directory: str) -> list[Found]:
    """Every checkpoint in ``directory``: each sub-directory holding a manifest, and each torn one."""
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    return [found for name in names if (found := _found(os.path.join(directory, name))) is not None]


def step_of(path: str) -> int | None:
    """The step of checkpoint ``path`` as its manifest gives it (not yet verified: for counting only), or None."""
    found = _found(path)
    return None if found is None else found.step


def _found(path: str) -> Found | None:
    name, manifest_path = os.path.basename(path), os.path.join(path, MANIFEST)
    numbered, mark = NAME.match(name), MARKED.match(name)
    step = int(numbered[1]) if numbered else None
    if mark and (mark[1] != REPLACED or not os.path.lexists(manifest_path)):
        return Found(path, step, mark[2], "torn: a save or a deletion that did not finish", mark[1])
    if os.path.lexists(manifest_path):
        return Found(path, *_step_and_run(manifest_path), marker=mark and mark[1])
    if numbered and os.path.isdir(path):
        return Found(path, step, None, "torn: no manifest, the save did not finish")
    return None


def _step_and_run(manifest_path: str) -> tuple[int | None, str | None, str | None]:
    """A manifest's step and run, read with the parser's limits but not yet verified (for listing only); and
    why it cannot be read (None if it can)."""
    try:
        training = manifest.load_json(manifest_path).get("training")
        step, run = training.get("step"), training.get("run")
    except CheckpointError as error:
        return None, None, str(error)
    except AttributeError:
        return None, None, f"{manifest_path}: not a manifest"
    return (step if type(step) is int else None), (run if isinstance(run, str) else None), None


def owner_problem(directory: str, run: str, continuing: bool) -> str | None:
    """Why run ``run`` may not save into ``directory`` (None if it may): the directory is a checkpoint, holds
    another run's checkpoints or saves, or, unless the run is ``continuing`` (resumed, or saving again), its
    own (a new run would replace them)."""
    if os.path.lexists(os.path.join(directory, MANIFEST)):
        return f"{directory} is a checkpoint itself: save into the directory that holds checkpoints"
    found = catalog(directory)
    others = [f for f in found if f.run != run and (f.run is not None or f.problem is None)]
    if others:
        shown = ", ".join(f"{os.path.basename(f.path)} (run {f.run or 'unknown'})" for f in others[:3])
        return (
            f"{directory} holds checkpoints of another run: {shown}; this run is {run}. "
            "Save into another directory, or continue that run with --resume"
        )
    ours = [f for f in found if f.run == run and f.complete and f.step is not None]
    if ours and not continuing:
        newest = max(ours, key=lambda f: f.step)
        return (
            f"{directory} holds this run's checkpoints up to step {newest.step} ({os.path.basename(newest.path)}): "
            f"continue it with --resume {directory}, or save into another directory"
        )
    return None


def rotate(directory: str, keep: int, run: str, written: str) -> None:
    """Delete run ``run``'s checkpoints older than ``written`` beyond the ``keep`` newest (``written`` counts),
    and its torn or moved-aside ones up to ``written``'s step; never a newer one, nor another run's."""
    found = catalog(directory)
    step = next(f.step for f in found if f.path == written)
    ours = [f for f in found if f.run == run and f.step is not None and f.path != written]
    older = sorted((f for f in ours if f.complete and f.marker is None and f.step < step), key=lambda f: f.step)
    stale = [f for f in ours if f.marker is not None and f.step <= step]
    for f in older[: max(len(older) - (keep - 1), 0)] + stale:
        _remove(f, run)


def _remove(found: Found, run: str) -> None:
    """Delete a checkpoint, first renamed as one being removed: a crash midway leaves a torn one of ``run``."""
    path = found.path
    if found.marker != REMOVING:
        parent = os.path.dirname(path)
        path = marked(os.path.join(parent, checkpoint_name(found.step)), REMOVING, run)
        os.replace(found.path, path)
    shutil.rmtree(path)


def save_problem(folder: str, step: int, ranks: int) -> str | None:
    """Why a save of ``step`` by ``ranks`` ranks into ``folder`` could not create its files (None if it could):
    tried for real with the longest names a save gives them (a name or path too long, a symlink loop, no
    permission), then removed with every directory the trial made."""
    made = _missing(os.path.abspath(folder))
    checkpoint = marked(os.path.join(folder, checkpoint_name(step)), REPLACED, "0" * 16)  # the longest marker
    try:
        os.makedirs(checkpoint)
        for path in (os.path.join(checkpoint, file_name(ranks - 1)), files.temporary_name(f"{checkpoint}/{MANIFEST}")):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.unlink(path)
    except OSError as error:
        return f"cannot create {error.filename}: {files.describe(error)}"
    finally:
        for trial in [checkpoint, *reversed(made)]:
            if os.path.isdir(trial):
                os.rmdir(trial)
    return None


def _missing(path: str) -> list[str]:
    """The directories on the way to ``path`` that do not exist yet, outermost first."""
    missing = []
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        missing.insert(0, path)
        path = os.path.dirname(path)
    return missing


def find_latest(directory: str) -> tuple[str | None, list[str]]:
    """Return the newest complete checkpoint under ``directory`` (or None) and a message per one skipped."""
    found = catalog(directory)
    skipped = [f"skipping {f.path} ({f.problem})" for f in found if f.problem]
    complete = [f for f in found if f.complete and f.step is not None]
    skipped += [f"skipping {f.path} (its manifest gives no step)" for f in found if f.complete and f.step is None]
    newest = max(complete, key=lambda f: (f.step, f.marker is None, f.path), default=None)
    return (newest.path if newest else None), skipped


def resolve(path: str) -> tuple[str, list[str]]:
    """A checkpoint itself (a directory holding a manifest), or the newest under a directory; plus skip messages."""
    if os.path.lexists(os.path.join(path, MANIFEST)):
        return path, []
    try:
        latest, skipped = find_latest(path)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot list it ({error.strerror or error})") from None
    if latest is None:
        reasons = "".join(f"; {message}" for message in skipped[:3])
        raise CheckpointError(f"{path}: no complete checkpoint found{reasons}")
    return latest, skipped


def resolve_agreed(collectives, path: str) -> tuple[str, list[str]]:
    """``resolve`` on rank 0, its answer on every rank (or the same CheckpointError on every rank)."""
    found = None
    if collectives.comm.Get_rank() == 0:
        try:
            found = resolve(path)
        except CheckpointError as error:
            found = str(error)
    found = collectives.bcast_object(found, "the checkpoint to load")
    if isinstance(found, str):
        raise CheckpointError(found)
    return found


def checkpoint_problem(path: str, places: Iterable[str]) -> str | None:
    """How writing ``path`` would overwrite a checkpoint (None if it would not): it is or lies inside one (a
    directory holding a manifest), or lies where a save into one of ``places`` puts one, or is its lock."""
    given, real = os.path.abspath(path), os.path.realpath(path)
    for folder in [*_self_and_ancestors(given), *_self_and_ancestors(real)]:  # through symlinks too
        if os.path.lexists(os.path.join(folder, MANIFEST)):
            where = "is" if folder in (given, real) else "lies inside"
            return f"{where} the checkpoint {_shown(folder, path)}"
    for place in places:
        root = os.path.realpath(place)
        first = os.path.relpath(real, root).split(os.sep)[0] if real.startswith(root.rstrip("/") + "/") else ""
        if NAME.match(first):
            return f"lies inside {os.path.join(place, first)}, where a save into {place} puts a checkpoint"
        if first == lock.LOCK:
            return f"is the lock file of the checkpoint directory {place}"
    return None


def _shown(folder: str, path: str) -> str:
    """``folder`` as the user would write it: relative to here if ``path`` was given relative and lies below."""
    relative = os.path.relpath(folder)
    return relative if not os.path.isabs(path) and not relative.startswith("..") else folder


def _self_and_ancestors(path: str) -> Iterator[str]:
    while True:
        yield path
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent
