"""C source compiled by the system C compiler into a shared library, once, and cached for every later process.

A library is compiled at first use (``$CC``, else ``cc`` or ``gcc``) under
``~/.cache/mpizero`` (``$MPIZERO_CACHE_DIR``, or ``$XDG_CACHE_HOME/mpizero``),
named by a digest of its source, flags, compiler and machine, and published
by an atomic rename, so ranks that compile at once each load a whole library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

CACHE_ENV_VAR = "MPIZERO_CACHE_DIR"


def load(name: str, source: str, flags: list[str]) -> tuple[ctypes.CDLL | None, str]:
    """The library ``name`` compiled from ``source`` with ``flags``, and the compiler's name; or None and why not
    (no compiler, or it failed)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler found"
    try:
        return ctypes.CDLL(str(_compiled(name, source, flags, compiler))), Path(compiler).name
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"{compiler} failed: {str(error).splitlines()[0][:120]}"


def _compiled(name: str, source: str, flags: list[str], compiler: str) -> Path:
    """The cached library for this source, compiler and machine, compiled first if missing (atomically)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=True)
    identity = "\n".join([source, compiler, version.stdout.splitlines()[0], platform.machine(), *flags])
    path = _cache_dir() / f"{name}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.so"
    if path.exists():
        return path
    written = path.with_name(f"{path.stem}-{secrets.token_hex(4)}.c")
    partial = path.with_name(f"{path.stem}-{secrets.token_hex(4)}.so.partial")
    try:
        written.write_text(source)
        done = subprocess.run(
            [compiler, *flags, str(written), "-o", str(partial), "-lm"], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            raise OSError(f"exit {done.returncode}: {done.stderr.strip()}")
        os.replace(partial, path)  # atomic: ranks compiling at once each publish a whole library
    finally:
        written.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return path


def _cache_dir() -> Path:
    """Where compiled libraries are kept: ``$MPIZERO_CACHE_DIR``, else ``$XDG_CACHE_HOME/mpizero`` or ``~/.cache``."""
    chosen = os.environ.get(CACHE_ENV_VAR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mpizero"
    )
    try:
        os.makedirs(chosen, exist_ok=True)
    except OSError:
        chosen = os.path.join(tempfile.gettempdir(), f"mpizero-{os.getuid()}")
        os.makedirs(chosen, exist_ok=True)
    return Path(chosen)
