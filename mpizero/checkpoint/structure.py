"""The structure a manifest must have before any value it points to is read.

Fields hold the types and ranges ``save`` writes. The partition rule must
place every tensor in exactly one group: then the layout derived from it
(``layout.SavedLayout``) puts every element of every tensor in exactly one
place of one rank file, by construction, so no per-piece record needs checking.
``files`` lists one digest per rank.
"""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np

TOP_LEVEL = (
    "format",
    "checksum",
    "world_size",
    "stage",
    "optimizer",
    "states",
    "tensors",
    "partition",
    "block_bytes",
    "files",
    "training",
    "scales",
    "replicated",
)
SHA256 = re.compile(r"^[0-9a-f]{64}$")
RUN = re.compile(r"^[0-9a-f]{16}$")
MAX_ALIGN = 1 << 30
BLOCK_BYTES_RANGE = (1 << 9, 1 << 30)
DTYPES = {  # what ``replicated`` arrays may hold (little-endian)
    name: np.dtype(name)
    for name in ("bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64")
} | {"bfloat16": np.dtype(ml_dtypes.bfloat16)}
REPLICATED_KEYS = ("name", "dtype", "shape", "offset", "sha256")


class Invalid(Exception):
    """A manifest field that is not what ``save`` writes."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


def check(manifest: dict) -> None:
    """Raise ``Invalid`` naming the first field of ``manifest`` that breaks the structure."""
    _keys(manifest, "(top level)", TOP_LEVEL)
    world_size = _int(manifest["world_size"], "world_size", low=1)
    _int(manifest["stage"], "stage", high=3)
    _keys(manifest["optimizer"], "optimizer", ("type", "groups"))
    _str(manifest["optimizer"]["type"], "optimizer.type")
    for index, group in enumerate(_list(manifest["optimizer"]["groups"], "optimizer.groups")):
        where = f"optimizer.groups[{index}]"
        _keys(group, where, ("params", "hyper"))
        _names(group["params"], f"{where}.params", lambda s: s, "")
        _dict(group["hyper"], f"{where}.hyper")
    states = _names(manifest["states"], "states", lambda s: s, "")
    if states[:1] != ["master"]:
        raise Invalid("states", f"must start with 'master', got {states}")
    numels = _tensors(manifest["tensors"])
    _partition(manifest["partition"], numels)
    block_bytes = _int(manifest["block_bytes"], "block_bytes", *BLOCK_BYTES_RANGE)
    if block_bytes & (block_bytes - 1):
        raise Invalid("block_bytes", f"must be a power of two, got {block_bytes}")
    for rank, digest in enumerate(_list(manifest["files"], "files", world_size)):
        if not isinstance(digest, str) or not SHA256.match(digest):
            raise Invalid(f"files[{rank}]", f"must be 64 lowercase hex digits, got {digest!r:.80}")
    _training(manifest["training"])
    _scales(manifest["scales"], numels)
    _replicated(manifest["replicated"])


def _partition(partition, numels: dict[str, int]) -> None:
    """The alignment, and groups that hold every tensor exactly once."""
    _keys(partition, "partition", ("align", "groups"))
    _int(partition["align"], "partition.align", low=1, high=MAX_ALIGN)
    placed: dict[str, str] = {}
    for g, group in enumerate(_list(partition["groups"], "partition.groups")):
        if not _list(group, f"partition.groups[{g}]"):
            raise Invalid(f"partition.groups[{g}]", "must name at least one tensor, got []")
        for k, name in enumerate(group):
            field = f"partition.groups[{g}][{k}]"
            if name not in numels:
                raise Invalid(field, f"{name!r:.80} is not in tensors")
            if name in placed:
                raise Invalid(field, f"{name!r} is also in {placed[name]}")
            placed[name] = field
    missing = [name for name in numels if name not in placed]
    if missing:
        raise Invalid("partition.groups", f"{len(missing)} tensors are in no group, e.g. {missing[0]!r}")


def _scales(scales, numels: dict[str, int]) -> None:
    """Each tensor's history: the last step's agreed maximum and count (``[float, int]``), or null before any
    non-zero gradient."""
    if sorted(_dict(scales, "scales")) != sorted(numels):
        raise Invalid("scales", f"must name every tensor once, got {sorted(scales)[:3]}...")
    for name, history in scales.items():
        if history is None:
            continue
        where = f"scales[{name!r}]"
        largest, _ = _list(history, where, 2)
        if not (isinstance(largest, float) and math.isfinite(largest) and largest > 0):
            raise Invalid(where, f"the maximum must be a positive finite number, got {largest!r}")
        _int(history[1], f"{where}[1]", low=1, high=2**40)


def _tensors(tensors) -> dict[str, int]:
    for k, tensor in enumerate(_list(tensors, "tensors")):
        _keys(tensor, f"tensors[{k}]", ("name", "shape"))
        for d, size in enumerate(_list(tensor["shape"], f"tensors[{k}].shape")):
            _int(size, f"tensors[{k}].shape[{d}]")
    for k, name in enumerate(_names(tensors, "tensors", lambda t: t["name"], ".name")):
        if not name.isprintable() or "/" in name:
            raise Invalid(
                f"tensors[{k}].name", f"{name!r:.80} must be printable, without '/' (consolidate's NAME/STATE)"
            )
    return {t["name"]: math.prod(t["shape"]) for t in tensors}


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
    if "settings" in training:
        _dict(training["settings"], "training.settings")
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


def replicated_nbytes(entry: dict) -> int:
    return math.prod(entry["shape"]) * DTYPES[entry["dtype"]].itemsize


def replicated_end(entries: list[dict]) -> int:
    """The size of ``replicated.bin``: its entries tile it."""
    return entries[-1]["offset"] + replicated_nbytes(entries[-1]) if entries else 0


def _replicated(entries) -> None:
    """Arrays saved once (``replicated``): known dtypes and shapes, unique names, tiling the file in order."""
    offset, names = 0, set()
    for k, entry in enumerate(_list(entries, "replicated")):
        field = f"replicated[{k}]"
        _keys(entry, field, REPLICATED_KEYS)
        _str(entry["name"], f"{field}.name")
        shape = _list(entry["shape"], f"{field}.shape")
        if len(shape) > 15:
            raise Invalid(f"{field}.shape", f"must have at most 15 sizes, got {len(shape)}")
        for n, size in enumerate(shape):
            _int(size, f"{field}.shape[{n}]", high=2**40)
        if entry["dtype"] not in DTYPES:
            raise Invalid(f"{field}.dtype", f"must be one of {sorted(DTYPES)}, got {entry['dtype']!r:.40}")
        if entry["offset"] != offset:
            raise Invalid(
                f"{field}.offset", f"must be {offset} (the arrays tile the file in order), got {entry['offset']!r:.40}"
            )
        if entry["name"] in names:
            raise Invalid(f"{field}.name", f"{entry['name']!r:.80} is listed twice")
        if not isinstance(entry["sha256"], str) or not SHA256.match(entry["sha256"]):
            raise Invalid(f"{field}.sha256", f"must be 64 lowercase hex digits, got {entry['sha256']!r:.80}")
        names.add(entry["name"])
        offset += replicated_nbytes(entry)
