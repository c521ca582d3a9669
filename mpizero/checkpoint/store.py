"""Sharded checkpoints: each rank writes what it owns; a manifest, written last, makes it whole.

Layout of one checkpoint, ``DIR/ckpt-00000012/``:

- ``rank00003-master.npy``, ``rank00003-exp_avg.npy``, ...: one flat float32
  array per rank and state (fp32 master weights, then each optimizer state):
  the concatenation of the tensor pieces that rank owned, padding stripped.
- ``manifest.json``: world size, stage, every tensor's name and shape, which
  piece of which tensor each rank wrote, each file's size, dtype, shape and
  sha256, and the training state (step, skipped steps, loss scale).

Files are written into ``ckpt-00000012.partial-<nonce>/``; the manifest is
written last (temporary file, fsync, rename), then the directory is renamed
into place. A directory without a manifest is a torn save: ``find_latest``
skips it with a message. Pieces are per tensor, so a checkpoint loads at any
world size and stage (resharding), and ``.npy`` files load without pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass

import numpy as np

from mpizero.comm import agree
from mpizero.core import faults
from mpizero.core.arrays import to_host

FORMAT = "mpizero-checkpoint-1"
MANIFEST = "manifest.json"
NAME = re.compile(r"^ckpt-(\d{8})$")


class CheckpointError(agree.ZeroError):
    """A checkpoint that cannot be used, named with its file and the problem."""


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of tensor ``name`` (flat, unpadded), at ``[at, at + stop - start)`` in a rank file."""

    name: str
    start: int
    stop: int
    at: int


def rank_pieces(engine) -> list[tuple[Piece, object, int]]:
    """This rank's shard, tensor by tensor: ``(piece, group, index into the group's owned arrays)``."""
    pieces, at = [], 0
    for group in engine.groups:
        owned_start = group.owned_range[0]
        for _, spec, lo, hi in group.layout.overlaps(*group.partition.shard_range(group.rank)):
            pieces.append((Piece(spec.name, lo - spec.offset, hi - spec.offset, at), group, lo - owned_start))
            at += hi - lo
    return pieces


def state_names(engine) -> list[str]:
    return ["master", *engine.optimizer.state_names]


def _owned_array(group, state: str):
    return group.master_shard if state == "master" else group.optimizer_state[state]


def file_name(rank: int, state: str) -> str:
    return f"rank{rank:05d}-{state}.npy"


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_synced(path: str, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(engine, directory: str, training_state: dict, keep: int | None = None) -> str:
    """Write a checkpoint of ``engine`` into ``directory`` (collective); return its path."""
    comm, rank = engine.comm, engine.comm.Get_rank()
    step = int(training_state["step"])
    final = os.path.join(directory, f"ckpt-{step:08d}")
    collectives = engine.collectives
    partial = collectives.bcast_object(
        f"{final}.partial-{secrets.token_hex(4)}" if rank == 0 else None, "the save directory"
    )
    problem = None
    if rank == 0:
        try:
            os.makedirs(partial)
        except OSError as error:
            problem = f"cannot create {partial}: {error.strerror}"
    agree.raise_if_any(collectives, problem, "checkpoint save")
    pieces = rank_pieces(engine)
    files, problem = {}, None
    try:
        for state in state_names(engine):
            flat = np.empty(sum(p.stop - p.start for p, _, _ in pieces), dtype=np.float32)
            for piece, group, index in pieces:
                flat[piece.at : piece.at + piece.stop - piece.start] = to_host(
                    _owned_array(group, state)[index : index + piece.stop - piece.start]
                )
            path = os.path.join(partial, file_name(rank, state))
            _write_synced(path, lambda f, flat=flat: np.save(f, flat, allow_pickle=False))
            files[file_name(rank, state)] = {
                "bytes": os.path.getsize(path),
                "sha256": _sha256(path),
                "dtype": "float32",
                "shape": [int(flat.size)],
            }
    except OSError as error:
        problem = f"cannot write in {partial}: {error.strerror}"
    faults.maybe_kill("save", step, rank)
    agree.raise_if_any(collectives, problem, "checkpoint save")
    everyone = collectives.gather_object(([p.__dict__ for p, _, _ in pieces], files), "the checkpoint pieces")
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "world_size": comm.Get_size(),
            "stage": engine.config.stage,
            "optimizer": repr(engine.optimizer),
            "states": state_names(engine),
            "tensors": tensor_list(engine),
            "pieces": [rank_pieces_of for rank_pieces_of, _ in everyone],
            "files": {name: meta for _, rank_files in everyone for name, meta in rank_files.items()},
            "training": training_state,
        }
        tmp = os.path.join(partial, MANIFEST + ".tmp")
        _write_synced(tmp, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        os.replace(tmp, os.path.join(partial, MANIFEST))
        _fsync_dir(partial)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(directory)
        if keep is not None:
            _rotate(directory, keep)
    collectives.barrier("returning from the save")
    return final


def _rotate(directory: str, keep: int) -> None:
    """Delete the oldest complete checkpoints beyond ``keep``, and torn saves older than the newest."""
    names = os.listdir(directory)
    complete = sorted(n for n in names if NAME.match(n))
    stale = [n for n in names if ".partial-" in n and complete and n.split(".partial-")[0] <= complete[-1]]
    for name in complete[: max(len(complete) - keep, 0)] + stale:
        shutil.rmtree(os.path.join(directory, name))


def find_latest(directory: str) -> tuple[str | None, list[str]]:
    """Return the newest complete checkpoint under ``directory`` (or None) and a message per torn one."""
    if not os.path.isdir(directory):
        return None, []
    names = sorted(os.listdir(directory), reverse=True)
    torn = [
        f"skipping torn checkpoint {os.path.join(directory, n)} (no manifest: the save did not finish)"
        for n in names
        if ".partial-" in n or (NAME.match(n) and not _has_manifest(directory, n))
    ]
    complete = [n for n in names if NAME.match(n) and _has_manifest(directory, n)]
    return (os.path.join(directory, complete[0]) if complete else None), torn


def resolve(path: str) -> tuple[str, list[str]]:
    """A checkpoint itself, or the newest complete one under a directory; plus a message per torn one."""
    if NAME.match(os.path.basename(os.path.normpath(path))):
        return path, []
    latest, torn = find_latest(path)
    if latest is None:
        raise CheckpointError(f"{path}: no complete checkpoint found")
    return latest, torn


def _has_manifest(directory: str, name: str) -> bool:
    return os.path.isfile(os.path.join(directory, name, MANIFEST))


def read_manifest(path: str) -> dict:
    """Load and check a checkpoint's manifest; raise CheckpointError naming the file and the problem."""
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path}: missing (not a checkpoint, or a torn save)") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{manifest_path}: unreadable ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: not an {FORMAT} manifest")
    for rank in range(manifest["world_size"]):
        for state in manifest["states"]:
            if file_name(rank, state) not in manifest["files"]:
                raise CheckpointError(f"{manifest_path}: lists no file {file_name(rank, state)}")
    return manifest


def open_array(path: str, name: str, meta: dict, verify: bool = True) -> np.ndarray:
    """Memory-map one rank file after checking it against the manifest; never unpickle."""
    full = os.path.join(path, name)
    if not os.path.isfile(full):
        raise CheckpointError(f"{full}: missing")
    size = os.path.getsize(full)
    if size != meta["bytes"]:
        raise CheckpointError(f"{full}: {size} bytes, manifest says {meta['bytes']} (truncated or replaced)")
    if verify and _sha256(full) != meta["sha256"]:
        raise CheckpointError(f"{full}: checksum mismatch (the file changed after the save)")
    try:
        with open(full, "rb") as f:
            version = np.lib.format.read_magic(f)
            readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in readers:
                raise ValueError(f".npy format version {version} is not one mpizero writes")
            shape, _, dtype = readers[version](f)
    except ValueError as error:
        raise CheckpointError(f"{full}: not a readable .npy file ({error})") from None
    if dtype.hasobject:
        raise CheckpointError(f"{full}: holds Python objects that would need pickle to load; refusing")
    if dtype != np.float32 or list(shape) != meta["shape"]:
        raise CheckpointError(f"{full}: {dtype}{list(shape)}, manifest says float32{meta['shape']}")
    return np.load(full, mmap_mode="r", allow_pickle=False)


class PieceReader:
    """Read any range of any tensor's state from a checkpoint, touching only the files that hold it."""

    def __init__(self, path: str, manifest: dict) -> None:
        self.path, self.manifest = path, manifest
        self.pieces = {}
        for rank, rank_pieces_of in enumerate(manifest["pieces"]):
            for p in rank_pieces_of:
                self.pieces.setdefault(p["name"], []).append((rank, Piece(**p)))
        self.opened: dict[str, np.ndarray] = {}

    def read(self, state: str, name: str, start: int, stop: int, out) -> None:
        """Fill ``out`` (length stop - start) with elements ``[start, stop)`` of tensor ``name``'s ``state``."""
        filled = 0
        for rank, piece in self.pieces.get(name, []):
            lo, hi = max(start, piece.start), min(stop, piece.stop)
            if lo < hi:
                source = self._file(rank, state)
                out[lo - start : hi - start] = source[piece.at + lo - piece.start : piece.at + hi - piece.start]
                filled += hi - lo
        if filled != stop - start:
            raise CheckpointError(f"{self.path}: pieces of {name!r} cover {filled} of elements [{start}, {stop})")

    def _file(self, rank: int, state: str) -> np.ndarray:
        name = file_name(rank, state)
        if name not in self.opened:
            self.opened[name] = open_array(self.path, name, self.manifest["files"][name])
        return self.opened[name]


def load(engine, path: str) -> dict:
    """Fill ``engine``'s master and optimizer state from a checkpoint at any world size and stage (collective).

    Every rank checks what it reads; any problem raises the same CheckpointError on every rank.
    Returns the saved training state.
    """
    manifest, problem = None, None
    try:
        manifest = read_manifest(path)
        _check_compatible(engine, manifest, path)
        reader = PieceReader(path, manifest)
        for group in engine.groups:
            owned_start = group.owned_range[0]
            for _, spec, lo, hi in group.layout.overlaps(*group.owned_range):
                for state in state_names(engine):
                    target = _owned_array(group, state)[lo - owned_start : hi - owned_start]
                    host = np.empty(hi - lo, dtype=np.float32)
                    reader.read(state, spec.name, lo - spec.offset, hi - spec.offset, host)
                    target[...] = host
    except CheckpointError as error:
        problem = str(error)
    except OSError as error:
        problem = f"{path}: {error}"
    agree.raise_if_any(engine.collectives, problem, "cannot load checkpoint")
    for group in engine.groups:
        group.publish(engine.collectives)
    return manifest["training"]


def tensor_list(engine) -> list[dict]:
    """Every tensor's name and shape, in the model's order."""
    shapes = {s.name: list(s.shape) for g in engine.groups for s in g.layout.specs}
    return [{"name": name, "shape": shapes[name]} for name in engine.names]


def _check_compatible(engine, manifest: dict, path: str) -> None:
    mine = tensor_list(engine)
    if sorted(mine, key=lambda t: t["name"]) != sorted(manifest["tensors"], key=lambda t: t["name"]):
        theirs = {t["name"]: t["shape"] for t in manifest["tensors"]}
        ours = {t["name"]: t["shape"] for t in mine}
        differ = sorted(n for n in set(theirs) | set(ours) if theirs.get(n) != ours.get(n))[:3]
        shown = ", ".join(f"{n}: checkpoint {theirs.get(n)} vs model {ours.get(n)}" for n in differ)
        raise CheckpointError(f"{path}: saved from another model ({shown})")
    if manifest["states"] != state_names(engine):
        raise CheckpointError(
            f"{path}: optimizer states {manifest['states'][1:]}, this run has "
            f"{state_names(engine)[1:]} (another optimizer)"
        )


def consolidate(path: str, output: str, include_optimizer: bool = False) -> list[str]:
    """Write every tensor's full fp32 parameters (and optionally optimizer state) by name to ``output`` (.npz).

    Reads one tensor at a time through memory maps, so little beyond the output is held.
    """
    manifest = read_manifest(path)
    reader = PieceReader(path, manifest)
    arrays = {}
    states = manifest["states"] if include_optimizer else ["master"]
    for tensor in manifest["tensors"]:
        numel = int(np.prod(tensor["shape"], dtype=np.int64))
        for state in states:
            flat = np.empty(numel, dtype=np.float32)
            reader.read(state, tensor["name"], 0, numel, flat)
            key = tensor["name"] if state == "master" else f"{tensor['name']}/{state}"
            arrays[key] = flat.reshape(tensor["shape"])
    tmp = f"{output}.tmp-{os.getpid()}.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, output)
    return list(arrays)
