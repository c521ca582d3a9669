"""The checkpoint key: read without ever waiting, refused when empty, and the same on every rank.

The key is ``MPIZERO_CHECKPOINT_KEY``'s text, or the bytes of the file
``MPIZERO_CHECKPOINT_KEY_FILE`` names. Set and empty, either is refused: an
empty key would sign nothing. The file must be a regular file, checked before
it is opened (a FIFO or a terminal would block the read forever) and again on
the open descriptor. Ranks agree on the key's presence and a digest of it,
salted afresh by rank 0 for each comparison and compared in constant time,
before it is used, so every rank that has a key holds the one that signs and
checks (``agreed``); the engine's set-up signature carries ``compared`` too, so
ranks with different keys stop at set-up. An error names where each rank's key
came from (the variable, the file), never the key or any function of it.

It sits below ``checkpoint`` (which signs and checks with it) because the engine's set-up agrees on it too.
"""

from __future__ import annotations

import hmac
import os
import secrets

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


def source(environ=os.environ) -> str:
    """Where this rank's key comes from, in words that say nothing of the key itself."""
    if KEY_VARIABLE in environ:
        return f"a key from {KEY_VARIABLE}"
    if KEY_FILE_VARIABLE in environ:
        return f"a key from {KEY_FILE_VARIABLE}={environ[KEY_FILE_VARIABLE]}"
    return "none"


def compared(collectives, environ=os.environ) -> agree.Concealed | str:
    """This rank's key as ranks compare it (collective: rank 0 draws the salt): its source, shown, with a salted
    digest that is compared in constant time and never shown; ``none``; or why it cannot be used."""
    salt = collectives.bcast_object(secrets.token_bytes(16), "a salt to compare checkpoint keys by")
    try:
        key = read(environ)
    except CheckpointError as error:
        return f"unusable: {error}"
    return "none" if key is None else agree.Concealed(source(environ), hmac.digest(salt, key, "sha256"))


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
        agree.raise_unless_equal(collectives, {"the checkpoint key": compared(collectives, environ)})
    except agree.ZeroError as error:
        raise CheckpointError(str(error)) from None
    return key
