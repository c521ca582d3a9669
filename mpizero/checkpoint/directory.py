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
not finish): it is skipped, and blocks no run. A run owns its directory: every
manifest records the run's identity (``training.run``), and a run may not save
where another run's checkpoints or saves are (``owner_problem``), so rotation
only ever deletes the run's own checkpoints older than the one just written.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from dataclasses import dataclass

from mpizero.checkpoint import manifest
from mpizero.checkpoint.manifest import MANIFEST, CheckpointError

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
