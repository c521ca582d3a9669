"""The checkpoint key: read without ever waiting, refused when empty, and the same on every rank.

The key is ``MPIZERO_CHECKPOINT_KEY``'s text, or the bytes of the file
``MPIZERO_CHECKPOINT_KEY_FILE`` names. Set and empty, either is refused: an
empty key would sign nothing. The file must be a regular file, checked before
it is opened (a FIFO or a terminal would block the read forever) and again on
the open descriptor. Ranks agree on the key's presence and a digest of it
(never the key itself) before it is used, so every rank that has a key holds
the one that signs and checks (``agree``); the engine's set-up signature
carries ``described`` too, so ranks with different keys stop at set-up.
"""

from __future__ import annotations

import hashlib
import os

from mpizero import files
from mpizero.comm import agree
from mpizero.errors import CheckpointError

KEY_VARIABLE, KEY_FILE_VARIABLE = "MPIZERO_CHECKPOINT_KEY", "MPIZERO_CHECKPOINT_KEY_FILE"
MAX_KEY_BYTES = 1 << 16


def read(environ=os.environ) -> bytes | None:
    """The key ``environ`` names, or None when it names none; raise CheckpointError if it cannot be used."""
    if KEY_VARIABLE in environ:
        if not environ[KEY_VARIABLE]:
            raise CheckpointError(f"{KEY_VARIABLE} is set but empty: set the key, or unset the variable")
        return environ[KEY_VARIABLE].encode()
    path = environ.get(KEY_FILE_VARIABLE)
    if path is None:
        return None
    try:
        key = files.read_regular(path, MAX_KEY_BYTES)
    except files.NotRegular as error:
        raise CheckpointError(f"{KEY_FILE_VARIABLE}={path} {error}") from None
    except OSError as error:
        raise CheckpointError(f"{KEY_FILE_VARIABLE}={path}: cannot read the key ({error.strerror})") from None
    if not key:
        raise CheckpointError(f"{KEY_FILE_VARIABLE}={path}: the key file is empty")
    return key


def fingerprint(key: bytes | None) -> str:
    """What ranks compare: ``none``, or 16 hex digits of a digest of the key (which does not reveal it)."""
    return "none" if key is None else "sha256 " + hashlib.sha256(b"mpizero checkpoint key\0" + key).hexdigest()[:16]


def described(environ=os.environ) -> str:
    """This rank's key as other ranks may see it: ``none``, a digest of it, or why it cannot be used."""
    try:
        return fingerprint(read(environ))
    except CheckpointError as error:
        return f"unusable: {error}"


def agreed(collectives, environ=os.environ) -> bytes | None:
    """Every rank's key, once every rank could read its own and all are the same (collective); else the same
    CheckpointError on every rank, naming the ranks."""
    key, problem = None, None
    try:
        key = read(environ)
    except CheckpointError as error:
        problem = str(error)
    try:
        agree.raise_if_any(collectives, problem, "the checkpoint key")
        agree.raise_unless_equal(collectives, {"the checkpoint key": fingerprint(key)})
    except agree.ZeroError as error:
        raise CheckpointError(str(error)) from None
    return key
