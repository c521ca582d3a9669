"""C source compiled by the system compiler into a shared library, once per source, compiler and machine.

The host's kernels (the encode, the optimizer update) are generated C: each is compiled at first use (``cc``,
or ``$CC``) into a library cached under ``~/.cache/mpizero`` (``MPIZERO_CACHE_DIR``) and loaded with ctypes.
``FLAGS`` keep every float operation rounding on its own (``-ffp-contract=off``: no fused multiply-add; no
``-ffast-math``), so a kernel gives the bits NumPy gives for the same formula. Where no compiler works, or
``MPIZERO_HOST_KERNELS=numpy`` is set, ``kernel_library`` says why and the caller evaluates the formula with
NumPy. ``load`` compiles other C (its own flags, no header), such as the offload files' fault handler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

ENV_VAR = "MPIZERO_HOST_KERNELS"
CACHE_ENV_VAR = "MPIZERO_CACHE_DIR"
# -fno-fast-math: a compiler whose default is fast (Intel's icx) must round as IEEE says, too
FLAGS = "-O3 -std=c99 -fPIC -shared -fwrapv -fno-math-errno -fno-trapping-math -ffp-contract=off -fno-fast-math".split()
HEADER = """#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define MZ_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MZ_CLONES
#endif
"""  # MZ_CLONES: the x86-64-v4 (AVX-512) or v3 loop is picked at load time where the CPU has it


def kernel_library(stem: str, source: str) -> tuple[ctypes.CDLL | None, str]:
    """A host kernel's library: ``HEADER + source`` with ``FLAGS``, and a description; or None and why NumPy
    must be used (``MPIZERO_HOST_KERNELS=numpy``, no compiler, or it failed)."""
    if os.environ.get(ENV_VAR) == "numpy":
        return None, f"numpy ({ENV_VAR}=numpy)"
    library, why = load(stem, HEADER + source, FLAGS)
    return library, f"compiled ({why})" if library is not None else f"numpy ({why})"


def load(stem: str, source: str, flags: list[str]) -> tuple[ctypes.CDLL | None, str]:
    """The library ``stem`` compiled from ``source`` with ``flags``, and the compiler's name; or None and why not
    (no compiler, or it failed)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler found"
    try:
        return _loaded(compiler, stem, source, tuple(flags)), Path(compiler).name
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        return None, f"{compiler} failed: {(str(error).splitlines() or [type(error).__name__])[0][:120]}"


@functools.cache
def _loaded(compiler: str, stem: str, source: str, flags: tuple[str, ...]) -> ctypes.CDLL:
    return ctypes.CDLL(str(_compiled(compiler, stem, source, flags)))


def _compiled(compiler: str, stem: str, source: str, flags: tuple[str, ...]) -> Path:
    """The cached library for this source, flags, compiler and machine, compiled first if missing (atomically)."""
    identity = "\n".join([source, compiler, _version(compiler), platform.machine(), *flags])
    path = _cache_dir() / f"{stem}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.so"
    if path.exists():
        return path
    written = path.with_name(f"{path.stem}-{secrets.token_hex(4)}.c")
    partial = path.with_name(f"{path.stem}-{secrets.token_hex(4)}.so.partial")
    try:
        written.write_text(source)
        command = [compiler, *flags, str(written), "-o", str(partial), "-lm"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise OSError(f"exit {done.returncode}: {done.stderr.strip()}")
        os.replace(partial, path)  # atomic: ranks compiling at once each publish a whole library
    finally:
        written.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return path


@functools.cache
def _version(compiler: str) -> str:
    """The compiler's first line of ``--version`` (on stdout, or stderr for some), asked once per process."""
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=True)
    lines = (done.stdout or done.stderr).splitlines()
    if not lines:
        raise ValueError(f"{compiler} --version printed nothing")
    return lines[0]


def _cache_dir() -> Path:
    """Where compiled kernels are kept: ``$MPIZERO_CACHE_DIR``, else ``$XDG_CACHE_HOME/mpizero`` or ``~/.cache``."""
    chosen = os.environ.get(CACHE_ENV_VAR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mpizero"
    )
    try:
        os.makedirs(chosen, exist_ok=True)
    except OSError:
        chosen = os.path.join(tempfile.gettempdir(), f"mpizero-{os.getuid()}")
        os.makedirs(chosen, exist_ok=True)
    return Path(chosen)
