"""The structure a manifest must have before any value it points to is read.

Fields hold the types and ranges ``save`` writes; each rank's pieces tile its
rank file exactly, and all pieces together tile each tensor exactly (in bounds,
no overlap, no gap). A piece ``{name, start, stop, at}`` is elements
``[start, stop)`` of tensor ``name`` (flat, unpadded), stored at
``[at, at + stop - start)`` of its rank's file for every state.
"""

from __future__ import annotations

import math
import re

TOP_LEVEL = (
    "format",
    "checksum",
    "world_size",
    "stage",
    "optimizer",
    "states",
    "tensors",
    "pieces",
    "files",
    "training",
    "scales",
)
SHA256 = re.compile(r"^[0-9a-f]{64}$")
RUN = re.compile(r"^[0-9a-f]{16}$")


class Invalid(Exception):
    """A manifest field that is not what ``save`` writes."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


def file_name(rank: int, state: str) -> str:
    """The rank file holding ``state`` (``master`` or an optimizer state) of rank ``rank``'s pieces."""
    return f"rank{rank:05d}-{state}.npy"


def check(manifest: dict) -> None:
    """Raise ``Invalid`` naming the first field of ``manifest`` that breaks the structure."""
    _keys(manifest, "(top level)", TOP_LEVEL)
    world_size = _int(manifest["world_size"], "world_size", low=1)
    _int(manifest["stage"], "stage", high=3)
    _keys(manifest["optimizer"], "optimizer", ("type", "hyper"))
    _str(manifest["optimizer"]["type"], "optimizer.type")
    _dict(manifest["optimizer"]["hyper"], "optimizer.hyper")
    states = _names(manifest["states"], "states", lambda s: s, "")
    if states[:1] != ["master"]:
        raise Invalid("states", f"must start with 'master', got {states}")
    numels = _tensors(manifest["tensors"])
    lengths = _files(manifest["files"], world_size, states)
    pieces = _list(manifest["pieces"], "pieces", world_size)
    for rank, rank_pieces in enumerate(pieces):
        _check_pieces(rank_pieces, rank, numels)
    _tile_tensors(pieces, numels, manifest["tensors"])
    for rank, rank_pieces in enumerate(pieces):
        _tile_rank_file(rank_pieces, rank, lengths[rank])
    _training(manifest["training"])
    _scales(manifest["scales"], numels)


def _scales(scales, numels: dict[str, int]) -> None:
    """Each tensor's last true scale exponent (an integer, or null before any non-zero gradient)."""
    if sorted(_dict(scales, "scales")) != sorted(numels):
        raise Invalid("scales", f"must name every tensor once, got {sorted(scales)[:3]}...")
    for name, k in scales.items():
        if k is not None:
            _int(k, f"scales[{name!r}]", low=-(2**16), high=2**16)


def _tensors(tensors) -> dict[str, int]:
    for k, tensor in enumerate(_list(tensors, "tensors")):
        _keys(tensor, f"tensors[{k}]", ("name", "shape"))
        for d, size in enumerate(_list(tensor["shape"], f"tensors[{k}].shape")):
            _int(size, f"tensors[{k}].shape[{d}]")
    _names(tensors, "tensors", lambda t: t["name"], ".name")
    return {t["name"]: math.prod(t["shape"]) for t in tensors}


def _files(files, world_size: int, states: list[str]) -> list[int]:
    """Check every rank file's entry; return each rank's file length in elements."""
    expected = {file_name(r, s) for r in range(world_size) for s in states}
    _dict(files, "files")
    if set(files) != expected:
        odd = sorted(set(files) ^ expected)[:3]
        raise Invalid("files", f"must list exactly the {len(expected)} rank files, differs at {odd}")
    for name, meta in files.items():
        field = f"files[{name!r}]"
        _keys(meta, field, ("bytes", "sha256", "dtype", "shape"))
        _int(meta["bytes"], f"{field}.bytes")
        if not isinstance(meta["sha256"], str) or not SHA256.match(meta["sha256"]):
            raise Invalid(f"{field}.sha256", f"must be 64 lowercase hex digits, got {meta['sha256']!r}")
        if meta["dtype"] != "float32":
            raise Invalid(f"{field}.dtype", f"must be 'float32', got {meta['dtype']!r}")
        _int(_list(meta["shape"], f"{field}.shape", 1)[0], f"{field}.shape[0]")
    lengths = []
    for rank in range(world_size):
        shapes = {s: files[file_name(rank, s)]["shape"] for s in states}
        for state, shape in shapes.items():
            if shape != shapes["master"]:
                field = f"files[{file_name(rank, state)!r}].shape"
                raise Invalid(field, f"{shape}, but {file_name(rank, 'master')} has {shapes['master']}")
        lengths.append(shapes["master"][0])
    return lengths


def _check_pieces(rank_pieces, rank: int, numels: dict[str, int]) -> None:
    """Each piece names a tensor and lies inside it."""
    for i, piece in enumerate(_list(rank_pieces, f"pieces[{rank}]")):
        field = f"pieces[{rank}][{i}]"
        _keys(piece, field, ("name", "start", "stop", "at"))
        if piece["name"] not in numels:
            raise Invalid(f"{field}.name", f"{piece['name']!r} is not in tensors")
        start = _int(piece["start"], f"{field}.start")
        stop, numel = _int(piece["stop"], f"{field}.stop", low=start + 1), numels[piece["name"]]
        if stop > numel:
            raise Invalid(f"{field}.stop", f"{stop} is past the {numel} elements of {piece['name']!r}")
        _int(piece["at"], f"{field}.at")


def _tile_rank_file(rank_pieces: list, rank: int, length: int) -> None:
    """A rank's pieces fill its files in order, with no gap or overlap, and end at the files' length."""
    end = 0
    for i, piece in enumerate(rank_pieces):
        field, at = f"pieces[{rank}][{i}].at", piece["at"]
        if at != end:
            what = "leaves a gap after" if at > end else "overlaps"
            raise Invalid(field, f"{at} {what} the previous piece, which ends at {end} in rank {rank}'s files")
        end = at + piece["stop"] - piece["start"]
        if end > length:
            raise Invalid(field, f"piece ends at {end}, past the {length} elements of rank {rank}'s files")
    if end != length:
        raise Invalid(f"pieces[{rank}]", f"cover {end} of the {length} elements of rank {rank}'s files")


def _tile_tensors(pieces: list, numels: dict[str, int], tensors: list) -> None:
    """All ranks' pieces of each tensor cover ``[0, numel)`` once."""
    by_tensor: dict[str, list] = {name: [] for name in numels}
    for rank, rank_pieces in enumerate(pieces):
        for i, p in enumerate(rank_pieces):
            by_tensor[p["name"]].append((p["start"], p["stop"], f"pieces[{rank}][{i}]"))
    for k, (name, spans) in enumerate(by_tensor.items()):
        end, previous = 0, None
        for start, stop, field in sorted(spans):
            if start < end:
                raise Invalid(
                    f"{field}.start", f"elements [{start}, {min(stop, end)}) of {name!r} are also in {previous}"
                )
            if start > end:
                raise Invalid("pieces", f"elements [{end}, {start}) of {name!r} are in no piece")
            end, previous = stop, field
        if end != numels[name]:
            shape = tensors[k]["shape"]
            raise Invalid(
                f"tensors[{k}].shape", f"{shape} holds {numels[name]} elements, the pieces of {name!r} cover [0, {end})"
            )


def _training(training) -> None:
    _dict(training, "training")
    for name in ("step", "optimizer_steps", "skipped_steps"):
        _int(training.get(name), f"training.{name}")
    scale = training.get("loss_scale")
    if scale is not None:
        _list(scale, "training.loss_scale", 2)
        value = scale[0]
        if type(value) not in (int, float) or not (math.isfinite(value) and value > 0):
            raise Invalid("training.loss_scale[0]", f"must be a finite number > 0, got {value!r}")
        _int(scale[1], "training.loss_scale[1]")
    _dict(training.get("data"), "training.data")
    run = training.get("run")
    if not isinstance(run, str) or not RUN.match(run):
        raise Invalid("training.run", f"must be 16 lowercase hex digits (the run's identity), got {run!r}")


def _int(value, field: str, low: int = 0, high: float = math.inf) -> int:
    if type(value) is not int or not low <= value <= high:
        limits = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
        raise Invalid(field, f"must be an integer {limits}, got {value!r}")
    return value


def _str(value, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid(field, f"must be a non-empty string, got {value!r}")
    return value


def _dict(value, field: str) -> dict:
    if not isinstance(value, dict):
        raise Invalid(field, f"must be an object, got {value!r}")
    return value


def _keys(value, field: str, keys: tuple[str, ...]) -> dict:
    if set(_dict(value, field)) != set(keys):
        raise Invalid(field, f"must have exactly the keys {sorted(keys)}, got {sorted(value)}")
    return value


def _list(value, field: str, length: int | None = None) -> list:
    if not isinstance(value, list) or (length is not None and len(value) != length):
        wanted = "a list" if length is None else f"a list of {length}"
        raise Invalid(field, f"must be {wanted}, got {value!r:.80}")
    return value


def _names(items, field: str, name_of, suffix: str) -> list[str]:
    names = [_str(name_of(item), f"{field}[{k}]{suffix}") for k, item in enumerate(_list(items, field))]
    if len(set(names)) != len(names):
        raise Invalid(field, f"names must be unique, got {names}")
    return names
