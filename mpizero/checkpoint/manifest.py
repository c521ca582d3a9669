"""The checkpoint manifest: its format, its checksum, and reading it back only once it is trustworthy.

A manifest is sealed with ``checksum``, the sha256 of its canonical JSON (keys
sorted, no spaces) without the ``checksum`` field. ``read`` trusts a manifest in
this order: its checksum, then its structure (``structure.check``: field types,
and pieces that tile every tensor and every rank file exactly). Its meaning
(same model, same optimizer, same data settings) is the loader's to check.
Every refusal is a ``CheckpointError`` naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import os

from mpizero.checkpoint import structure
from mpizero.comm.agree import ZeroError

FORMAT = "mpizero-checkpoint-3"
MANIFEST = "manifest.json"


class CheckpointError(ZeroError):
    """A checkpoint that cannot be used, named with its file and the problem."""


def checksum(manifest: dict) -> str:
    """Return the sha256 of ``manifest``'s canonical JSON, its ``checksum`` field left out."""
    body = {key: value for key, value in manifest.items() if key != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write(directory: str, manifest: dict) -> None:
    """Seal ``manifest`` with its checksum and write it atomically (temporary file, fsync, rename)."""
    body = {"format": FORMAT, **manifest}
    sealed = {**body, "checksum": checksum(body)}
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "wb") as f:
        f.write(json.dumps(sealed, indent=1).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST))


def read(path: str) -> dict:
    """Load checkpoint ``path``'s manifest; verify its checksum, then its structure, before returning it."""
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path}: missing (not a checkpoint, or a torn save)") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{manifest_path}: unreadable ({error})") from None
    try:
        _check_seal(manifest)
        structure.check(manifest)
    except structure.Invalid as error:
        raise CheckpointError(f"{manifest_path}: field {error.field}: {error.problem}") from None
    return manifest


def _check_seal(manifest) -> None:
    if not isinstance(manifest, dict):
        raise structure.Invalid("(top level)", f"must be a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        raise structure.Invalid("format", f"{manifest.get('format')!r}, this mpizero reads {FORMAT!r}")
    saved, computed = manifest.get("checksum"), checksum(manifest)
    if saved != computed:
        raise structure.Invalid(
            "checksum",
            f"{saved!r} does not match the content's sha256 {computed} (the manifest changed after the save)",
        )
