"""What every rank must run alike: the same mpizero version and the same mpizero code.

Ranks that import different code (a changed file on one node, another
checkout first on one rank's ``PYTHONPATH``) would compute different bytes
without any error. ``Collectives`` agrees these fields when it is built, so
such ranks stop at set-up, named. The code's digest covers every ``.py`` file
of the package, by path and content.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import metadata
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2]  # mpizero/, above comm/job/


@functools.cache
def code_digest() -> str:
    """The sha256 of every ``.py`` file of the mpizero package on this rank, by relative path and content."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def version() -> str:
    """The installed mpizero version, or ``unknown`` where the package is not installed."""
    try:
        return metadata.version("mpizero")
    except metadata.PackageNotFoundError:
        return "unknown"


def fields() -> dict[str, str]:
    """The fields ranks agree on, by the name an error shows."""
    return {"the mpizero version": version(), "the mpizero code": f"sha256 {code_digest()[:16]}"}
