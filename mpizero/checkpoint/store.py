"""Sharded checkpoints: each rank writes what it owns; a sealed manifest, written last, makes it whole.

Layout of one checkpoint, ``DIR/ckpt-00000012/``:

- ``rank00003.bin``: one file per rank (``shards``), every state of the
  elements that rank owned (padding stripped) and a digest per 16 KiB block.
- ``manifest.json`` (``manifest``): world size, stage, the optimizer's type
  and hyper-parameters, every tensor's name and shape, the partition rule
  (groups and alignment) from which every rank file's layout follows
  (``layout``), each rank file's digest, the training state with the run's
  identity, and the manifest's own checksum. Its size grows with the number
  of ranks by one digest each.

A run owns its checkpoint directory (``directory``): ``save`` refuses one
holding another run's checkpoints, and one that another process is saving
into (``lock``), so rotation can only ever delete the run's own checkpoints
older than the one just written. Files are written into
``ckpt-00000012.partial-<run>-<nonce>/``; the manifest is written last
(``files.write``), then the directory is renamed into place. The ranks agree
on the key first (``key``), so the key that signs and checks is every rank's.

Loading trusts the manifest's checksum, then its structure, then its meaning
(``compat``), before any value is read. Elements are found by tensor name and
index, so a checkpoint loads at any world size and stage (resharding), and a
rank reads only the blocks holding the elements it owns.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from mpizero import checkpoint_key, files
from mpizero.arrays import to_host, write
from mpizero.checkpoint import catalog, compat, lock, manifest, replicated, structure
from mpizero.checkpoint.manifest import MANIFEST
from mpizero.checkpoint.placement import SavedLayout
from mpizero.checkpoint.shards import BLOCK_BYTES, CheckpointReader, file_name, write_rank_file
from mpizero.comm import agree
from mpizero.core import faults
from mpizero.errors import CheckpointError


def save(
    engine, directory: str, training_state: dict, keep: int | None = None, block_bytes: int = BLOCK_BYTES, arrays=None
) -> str:
    """Write a checkpoint of ``engine`` into ``directory`` (collective); return its path.

    ``keep``: how many complete checkpoints to keep (>= 1; None keeps all). ``block_bytes``: the rank files'
    digest block (a power of two, 512 bytes to 1 GiB). ``training_state["data"]``: the caller's JSON values,
    refused unless they would load back equal. ``arrays``: host arrays every rank holds the same, by name (a
    torch model's buffers and frozen parameters), written once (``replicated``). A failed save raises the
    same CheckpointError on every rank and leaves nothing behind.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 (or None to keep every checkpoint), got {keep}")
    low, high = structure.BLOCK_BYTES_RANGE
    if not (low <= block_bytes <= high and block_bytes & (block_bytes - 1) == 0):
        raise ValueError(f"block_bytes must be a power of two in [{low}, {high}], got {block_bytes}")
    rank, collectives = engine.comm.Get_rank(), engine.collectives
    signing = checkpoint_key.agreed(collectives)
    _agreed(collectives, manifest.data_problem(training_state.get("data")), "checkpoint save")
    run = training_state.get("run") or compat.run_identity(compat.engine_settings(engine, training_state))
    training_state = {**training_state, "run": run}
    final = os.path.join(directory, catalog.checkpoint_name(int(training_state["step"])))
    partial = collectives.bcast_object(
        catalog.marked(final, catalog.PARTIAL, run) if rank == 0 else None, "the save directory"
    )
    problem = None
    if rank == 0:
        problem = _found(lambda: _claim_problem(directory, run, True)) or _attempt(lambda: os.makedirs(partial))
    _agree(collectives, problem, partial)
    digest: list = []
    problem = _attempt(lambda: digest.append(_write_rank_file(engine, partial, rank, block_bytes)))
    problem = engine.states_problem() or problem  # an offload file cut before or while it was saved: no checkpoint
    faults.maybe_kill("save", training_state["step"], rank)
    _agree(collectives, problem, partial)
    digests = collectives.gather_object(digest[0], "the rank files' digests")
    if rank == 0:
        record = {
            **engine_record(engine),
            "block_bytes": block_bytes,
            "files": digests,
            "training": training_state,
            "scales": engine.scale_state(),
        }
        problem = _attempt(
            lambda: _publish(
                {**record, "replicated": replicated.write(partial, arrays or {})}, partial, final, keep, signing
            )
        )
    _agree(collectives, problem, partial)
    return final


def engine_record(engine) -> dict:
    """The manifest's description of what ``engine`` saves: model, optimizer, states and partition rule."""
    record = {"stage": engine.config.stage, "optimizer": compat.optimizer_record(engine)}
    return {**record, **layout_record(SavedLayout.of_engine(engine), compat.state_names(engine), engine.config.align)}


def layout_record(layout: SavedLayout, states: list[str], align: int) -> dict:
    """The manifest's fields that say where every saved element lies: world size, states, tensors, partition."""
    return {
        "world_size": layout.world_size,
        "states": states,
        "tensors": [{"name": name, "shape": list(shape)} for name, shape in layout.shapes.items()],
        "partition": {"align": align, "groups": [list(g.names) for g in layout.layouts]},
    }


def _write_rank_file(engine, partial: str, rank: int, block_bytes: int) -> str:
    """Write this rank's file into ``partial``, every state of its shard in the layout's order; return its digest."""
    pieces = engine.shard_pieces()
    laid_out = [(name, run.start, run.stop) for name, run in SavedLayout.of_engine(engine).pieces(rank)]
    if laid_out != [(p.spec.name, p.start, p.stop) for p in pieces]:
        raise CheckpointError(f"rank {rank}: its shard is not the checkpoint layout's (a bug in mpizero)")
    path = os.path.join(partial, file_name(rank))
    rows = ([to_host(p.arrays[state]) for p in pieces] for state in compat.state_names(engine))
    try:
        with open(path, "wb") as f:
            digest = write_rank_file(f, rows, block_bytes)
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:  # a failed write() names no file: add it
        raise OSError(error.errno, error.strerror or str(error), path) from error
    return digest


def _publish(record: dict, partial: str, final: str, keep: int | None, signing: bytes | None) -> None:
    """Seal and write the manifest last, then move the checkpoint into place and rotate the run's old ones.

    A checkpoint of the same run and step already there is moved aside first, so a crash leaves one of them whole.
    """
    directory, run = os.path.dirname(final), record["training"]["run"]
    manifest.write(partial, record, signing)
    files.fsync_directory(partial)
    aside = catalog.marked(final, catalog.REPLACED, run) if os.path.exists(final) else None
    if aside:
        os.replace(final, aside)
    os.replace(partial, final)
    files.fsync_directory(directory)
    if aside:
        shutil.rmtree(aside)
    if keep is not None:
        catalog.rotate(directory, keep, run, final)


def _attempt(action) -> str | None:
    """Run ``action``; return None, or the OS error it raised as one line naming errno and file."""
    try:
        action()
    except OSError as error:
        return f"cannot write {describe(error)}"
    except CheckpointError as error:  # e.g. an unreadable key file: refused on every rank, not only here
        return str(error)
    return None


def _found(check) -> str | None:
    """``check()``'s problem, or the OS error it raised (a directory that cannot be listed) as one line."""
    try:
        return check()
    except OSError as error:
        return f"cannot read {describe(error)}"


def describe(error: OSError) -> str:
    """One line for an OS error: the file, the errno name and the message (``strerror`` may be None)."""
    return (f"{error.filename}: " if error.filename else "") + files.describe(error)


def _agree(collectives, problem: str | None, partial: str) -> None:
    """Raise the same CheckpointError on every rank if any rank has a problem; rank 0 removes the partial save."""
    try:
        _agreed(collectives, problem, "checkpoint save")
    except CheckpointError:
        if collectives.comm.Get_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise


def _agreed(collectives, problem: str | None, context: str) -> None:
    """Raise the same CheckpointError on every rank if any rank has a problem (collective)."""
    try:
        agree.raise_if_any(collectives, problem, context)
    except agree.ZeroError as error:
        raise CheckpointError(str(error)) from None


def _claim_problem(directory: str, run: str, continuing: bool) -> str | None:
    """Lock ``directory`` for run ``run`` unless another process holds it or it may not save there (``claim``)."""
    problem = lock.hold(directory, run) or catalog.owner_problem(directory, run, continuing)
    if problem:
        lock.release(directory)
    return problem


def claim(collectives, directory: str, run: str, continuing: bool) -> None:
    """Raise the same CheckpointError on every rank unless run ``run`` may save into ``directory``, and hold it for
    this run (collective): it is no checkpoint, holds no other run's checkpoints, nothing else is saving into it,
    and, unless the run is ``continuing``, it holds none of the run's own."""
    problem = _found(lambda: _claim_problem(directory, run, continuing)) if collectives.comm.Get_rank() == 0 else None
    _agreed(collectives, problem, "--checkpoint-dir")


@dataclass(frozen=True)
class Loaded:
    """What ``load`` restored: the saved training state, the bytes this rank read from rank files, and the arrays
    saved once for every rank (``save(arrays=)``), checked."""

    training: dict
    bytes_read: int
    arrays: dict


def load(engine, path: str, overrides: Collection[str] = (), how=compat.CLI_OVERRIDE) -> Loaded:
    """Fill ``engine``'s master and optimizer state from a checkpoint at any world size and stage (collective).

    Rank 0 reads the manifest and checks its checksum and structure once (one digest per rank); every
    rank gets it, checks it (``compat.check`` with ``overrides``) before it reads a value, then reads,
    state by state, only the blocks holding the elements it owns, each checked against its digest.
    Any problem raises the same error on every rank; ``how(name)`` tells the user how to let a recorded
    hyper-parameter differ (``--resume-override`` by default).
    """
    signing = checkpoint_key.agreed(engine.collectives)
    saved, problem, bytes_read, arrays = _manifest_from_rank_0(engine.collectives, path, signing), None, 0, {}
    try:
        compat.check(engine, saved, os.path.join(path, MANIFEST), overrides, how)
        with CheckpointReader(path, saved) as reader:
            reader.verify(reader.empty_files() if engine.comm.Get_rank() == 0 else ())
            pieces = engine.owned_pieces()
            for state in saved["states"]:
                hosts = [(piece, _host_buffer(piece.arrays[state])) for piece in pieces]
                reader.read(state, [(p.spec.name, p.start, p.stop, host) for p, host in hosts])
                for piece, host in hosts:
                    if host is not piece.arrays[state]:
                        write(piece.arrays[state], host)
            bytes_read = reader.bytes_read
        arrays = replicated.read(path, saved["replicated"])
    except CheckpointError as error:
        problem = str(error)
    except OSError as error:
        problem = f"{path}: {error}"
    _agreed(engine.collectives, problem, "cannot load checkpoint")
    engine.publish()
    engine.restore_scale_state(saved["scales"])
    return Loaded(saved["training"], bytes_read, arrays)


def _host_buffer(array):
    """``array`` itself if rank files can be read into it (a contiguous NumPy float32 array), else a host twin."""
    if isinstance(array, np.ndarray) and array.dtype == np.float32 and array.flags.c_contiguous:
        return array
    return np.empty(array.shape, dtype=np.float32)


def _manifest_from_rank_0(collectives, path: str, signing: bytes | None) -> dict:
    """The checkpoint's manifest, read and verified (under ``signing``, every rank's key) on rank 0 only and
    broadcast; or the same error everywhere."""
    found = None
    if collectives.comm.Get_rank() == 0:
        try:
            found = manifest.read(path, signing)
        except CheckpointError as error:
            found = str(error)
    found = collectives.bcast_object(found, "the checkpoint manifest")
    _agreed(collectives, found if isinstance(found, str) else None, "cannot load checkpoint")
    return found


def consolidate(path: str, output: str, include_optimizer: bool = False) -> list[str]:
    """Write every tensor's full fp32 parameters (and optionally optimizer state) by name to ``output`` (.npz).

    The manifest is verified (checksum, signature under this process's key, structure) before any value is
    read, and every block as it is read.
    """
    saved = manifest.read(path, checkpoint_key.read())
    states, tensors = saved["states"] if include_optimizer else ["master"], saved["tensors"]
    found = {}
    with CheckpointReader(path, saved) as reader:
        reader.verify(range(saved["world_size"]))  # every file's size first: shapes are not trusted to allocate
        for state in states:  # all of a state, then the next: each block is read once
            flats = {t["name"]: np.empty(math.prod(t["shape"]), np.float32) for t in tensors}
            reader.read(state, [(name, 0, flat.size, flat) for name, flat in flats.items()])
            found.update({(t["name"], state): flats[t["name"]].reshape(t["shape"]) for t in tensors})
    named = {(t["name"], s): t["name"] if s == "master" else f"{t['name']}/{s}" for t in tensors for s in states}
    arrays = {named[key]: found[key] for key in named}  # by tensor, then state
    files.write(output, lambda f: np.savez(f, **arrays))
    return list(arrays)
