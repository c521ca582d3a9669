"""The checkpoint manifest: its format, its checksum and signature, and reading it back only once it is trustworthy.

A manifest is sealed with ``checksum``, the sha256 of its canonical JSON (keys
sorted, no spaces) without the ``checksum`` and ``signature`` fields. The
checksum catches accidents (a torn write, a flipped bit, a hand edit that did
not recompute it); anyone can recompute it, so it cannot catch a forgery. With
a key (``key``), the manifest also carries ``signature``, an HMAC-SHA256 of the
same canonical JSON under that key; loading with a key refuses a manifest that
is unsigned or signed under another key. The manifest lists every rank file's
digest (``shards``), so the signature covers the shards too.

``read`` trusts a manifest in this order: a regular file, its size and nesting
depth (bounded before the JSON is parsed), its format (this one or the previous,
read as this one: ``formats``), its checksum, its signature when there is a
key, then its structure (``structure.check``: field types, and a
partition rule that places every tensor exactly once). Its meaning (same
model, same optimizer, same data settings) is the loader's to check. Every
refusal is a ``CheckpointError`` naming the file and the field. ``write``
refuses what ``read`` would: a manifest is checked by the same parser before
it is written, and a caller's ``data`` before anything is (``data_problem``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

import numpy as np

from mpizero import files
from mpizero.checkpoint import formats, structure
from mpizero.errors import CheckpointError

FORMAT = formats.CURRENT  # what ``write`` writes; ``read`` also reads the previous one (``formats``)
MANIFEST = "manifest.json"
MAX_BYTES = 1 << 24  # about 80 bytes per rank: 330 KiB at 4096 ranks (``estimate --scale``), 16 MiB at 200,000
MAX_DEPTH = 16  # ``save`` writes 5 levels; json's parser recurses once per level
DATA_DEPTH = 2  # the levels above ``training.data``: a caller's data may nest MAX_DEPTH - DATA_DEPTH deep
SEALS = ("checksum", "signature")


def _canonical(manifest: dict) -> bytes:
    body = {key: value for key, value in manifest.items() if key not in SEALS}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def checksum(manifest: dict) -> str:
    """Return the sha256 of ``manifest``'s canonical JSON, its ``checksum`` and ``signature`` fields left out."""
    return hashlib.sha256(_canonical(manifest)).hexdigest()


def signature(manifest: dict, key: bytes) -> str:
    """Return the HMAC-SHA256 under ``key`` of ``manifest``'s canonical JSON (the seals left out)."""
    return hmac.new(key, _canonical(manifest), hashlib.sha256).hexdigest()


def write(directory: str, manifest: dict, key: bytes | None) -> None:
    """Seal ``manifest`` with its checksum (and signature, with a key), check that ``read`` would take it back,
    and write it atomically."""
    body = {"format": FORMAT, **manifest}
    sealed = {**body, "checksum": checksum(body), **({"signature": signature(body, key)} if key else {})}
    path = os.path.join(directory, MANIFEST)
    encoded = json.dumps(sealed, indent=1).encode()
    try:  # what ``read`` would refuse is never written
        parse(encoded, path)
        structure.check({k: v for k, v in sealed.items() if k != "signature"})
    except structure.Invalid as error:
        raise CheckpointError(f"{path}: cannot write it: field {error.field}: {error.problem}") from None
    except CheckpointError as error:
        raise CheckpointError(f"cannot write a manifest that could not be read back: {error}") from None
    files.write(path, lambda f: f.write(encoded))


def data_problem(data) -> str | None:
    """Why a caller's ``data`` could not be saved in a manifest and loaded back equal (None when it can)."""
    try:
        encoded = json.dumps(data, allow_nan=False)
    except (TypeError, ValueError) as error:
        return f"data must be JSON values: {error}"
    depth = nesting_depth(encoded.encode())
    if depth > MAX_DEPTH - DATA_DEPTH:
        return f"data nests {depth} levels deep; a checkpoint holds at most {MAX_DEPTH - DATA_DEPTH}"
    loaded = json.loads(encoded)
    if loaded != data:
        return f"data would load back as {loaded!r:.200}, not as given (JSON has lists, not tuples, and string keys)"
    return None


def load_json(manifest_path: str):
    """Parse an untrusted manifest file with limits on its size and nesting depth; raise CheckpointError."""
    try:
        data = files.read_regular(manifest_path, MAX_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path}: missing (not a checkpoint, or a torn save)") from None
    except files.NotRegular as error:
        raise CheckpointError(f"{manifest_path} {error}") from None
    except OSError as error:
        raise CheckpointError(f"{manifest_path}: unreadable ({error})") from None
    return parse(data, manifest_path)


def parse(data: bytes, manifest_path: str):
    """The JSON in ``data`` once its size and nesting depth are within the limits; raise CheckpointError."""
    if len(data) > MAX_BYTES:
        raise CheckpointError(f"{manifest_path}: larger than {MAX_BYTES:,} bytes, the most a manifest may be")
    depth = nesting_depth(data)
    if depth > MAX_DEPTH:
        raise CheckpointError(f"{manifest_path}: nested {depth} levels deep, more than the {MAX_DEPTH} allowed")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"{manifest_path}: unreadable ({error})") from None


def nesting_depth(data: bytes) -> int:
    """The deepest nesting of JSON arrays and objects in ``data``, brackets inside strings left out.

    Linear in the size, whatever the bytes: a quote preceded by an odd run of backslashes is escaped,
    and a bracket after an odd number of unescaped quotes is inside a string.
    """
    code = np.frombuffer(data, dtype=np.uint8)
    if not code.size:
        return 0
    index = np.arange(code.size, dtype=np.int32)
    backslash = code == ord("\\")
    last_other = np.maximum.accumulate(np.where(backslash, -1, index))  # the last non-backslash at or before i
    run = np.zeros(code.size, dtype=np.int32)  # backslashes right before i
    run[1:] = index[:-1] - last_other[:-1]
    quote = (code == ord('"')) & (run % 2 == 0)
    outside = np.cumsum(quote, dtype=np.int32) % 2 == 0
    step = np.isin(code, (ord("["), ord("{"))).astype(np.int8) - np.isin(code, (ord("]"), ord("}")))
    step[~outside] = 0
    return int(np.cumsum(step, dtype=np.int32).max(initial=0))


def read(path: str, key: bytes | None) -> dict:
    """Load checkpoint ``path``'s manifest; verify its limits, checksum, signature under ``key`` (if not None)
    and structure before returning."""
    manifest_path = os.path.join(path, MANIFEST)
    manifest = load_json(manifest_path)
    try:
        _check_seal(manifest, key)
        manifest = formats.as_current(manifest)
        structure.check({k: v for k, v in manifest.items() if k != "signature"})
    except structure.Invalid as error:
        raise CheckpointError(f"{manifest_path}: field {error.field}: {error.problem}") from None
    return manifest


def _check_seal(manifest, key: bytes | None) -> None:
    if not isinstance(manifest, dict):
        raise structure.Invalid("(top level)", f"must be a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") not in formats.READ:
        read = " and ".join(map(repr, formats.READ))
        raise structure.Invalid("format", f"{manifest.get('format')!r:.80}, this mpizero reads {read}")
    saved, computed = manifest.get("checksum"), checksum(manifest)
    if saved != computed:
        raise structure.Invalid(
            "checksum",
            f"{saved!r} does not match the content's sha256 {computed} (the manifest changed after the save)",
        )
    if key is None:
        return
    signed = manifest.get("signature")
    if signed is None:
        raise structure.Invalid("signature", "missing: the checkpoint is unsigned, and this run has a checkpoint key")
    if not isinstance(signed, str) or not signed.isascii() or not hmac.compare_digest(signed, signature(manifest, key)):
        raise structure.Invalid("signature", "does not match: signed under another key, or changed after the save")
