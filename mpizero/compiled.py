"""C source compiled by the system compiler into a shared library, once per source, compiler and machine.

The host's kernels (the encode, the optimizer update) are generated C: each is compiled at first use (``cc``,
or ``$CC``) into a library cached under ``~/.cache/mpizero`` (``MPIZERO_CACHE_DIR``) and loaded with ctypes.
``FLAGS`` keep every float operation rounding on its own (``-ffp-contract=off``: no fused multiply-add; no
``-ffast-math``), so a kernel gives the bits NumPy gives for the same formula. Where no compiler works, or
``MPIZERO_HOST_KERNELS=numpy`` is set, ``kernel_library`` says why and the caller evaluates the formula with
NumPy. ``load`` compiles other C (its own flags, no header), such as the offload files' fault handler.

Nothing in the cache is trusted by its name alone. Each library has a record beside it (``.json``): the digest of
what it was built from (source, compiler and its version, flags, machine) and the size and sha256 of the
library's bytes, checked before it is loaded; a library cut short, patched, or copied from another kernel's name
is built again, never loaded (loading a cut library ends the process with ``Bus error``). A compiler that turns
fast math on anyway (a site wrapper appending ``-ffast-math``) is refused by the source itself (``HEADER``):
its libraries would also flush every subnormal the process computes, NumPy's included. What a compiler does
otherwise differently (``-ffp-contract=fast`` from a wrapper) each kernel's caller finds at first load by
running it on probe values against NumPy's formula (``self_tested``), and where the bits differ the kernel is not
used and a warning names the compiler and flags. The fallback cache folder under ``$TMPDIR`` is made 0700 and
used only if it is this user's own and no one else may write in it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import secrets
import shutil
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path

ENV_VAR = "MPIZERO_HOST_KERNELS"
CACHE_ENV_VAR = "MPIZERO_CACHE_DIR"
# -fno-fast-math: a compiler whose default is fast (Intel's icx) must round as IEEE says, too
FLAGS = "-O3 -std=c99 -fPIC -shared -fwrapv -fno-math-errno -fno-trapping-math -ffp-contract=off -fno-fast-math".split()
HEADER = """#ifdef __FAST_MATH__
#error "fast math is on (-ffast-math, or the compiler's default): it changes the bits"
#endif
#include <math.h>
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
    must be used (``MPIZERO_HOST_KERNELS=numpy``, no compiler, or it failed). A compiler that failed on this
    source is warned of, once a process: NumPy's evaluation is slower."""
    if os.environ.get(ENV_VAR) == "numpy":
        return None, f"numpy ({ENV_VAR}=numpy)"
    library, why = load(stem, HEADER + source, FLAGS)
    if library is None and why != NO_COMPILER:
        _warn_once(f"mpizero: the {stem} kernel did not compile, so NumPy evaluates it (slower): {why}")
    return library, f"compiled ({why})" if library is not None else f"numpy ({why})"


REFUSED: list[str] = []  # each kernel this process compiled and did not use, and why (``self_tested``)


def self_tested(library: ctypes.CDLL, stem: str, problem: str | None) -> ctypes.CDLL | None:
    """``library``, or None where its self-test found ``problem`` (its bits differ from NumPy's formula on the
    probe values): then a warning names the compiler and flags, the kernel is noted in ``REFUSED`` (``verify``
    fails on it), and the caller evaluates with NumPy."""
    if problem is None:
        return library
    REFUSED.append(f"{stem} ({problem})")
    compiler = _compiler()
    _warn_once(
        f"mpizero: the compiled {stem} kernel ({compiler} {' '.join(FLAGS)}) gives other bits than NumPy's formula "
        f"({problem}), so it is not used and NumPy evaluates it (slower): check what the compiler adds to its flags"
    )
    return None


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


NO_COMPILER = "no C compiler found"


def load(stem: str, source: str, flags: list[str]) -> tuple[ctypes.CDLL | None, str]:
    """The library ``stem`` compiled from ``source`` with ``flags``, and the compiler's name; or None and why not
    (no compiler, or it failed)."""
    compiler = _compiler()
    if compiler is None:
        return None, NO_COMPILER
    try:
        return _loaded(compiler, stem, source, tuple(flags)), Path(compiler).name
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        return None, f"{compiler} failed: {_first_error_line(str(error)) or type(error).__name__}"


def _compiler() -> str | None:
    """The C compiler: ``$CC``, else ``cc`` or ``gcc`` on the PATH (None if none)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _first_error_line(text: str) -> str:
    """What the compiler said from its first ``error`` on if it said one, else its first line (at most 160
    characters)."""
    lines = text.splitlines()
    line = next((line for line in lines if "error" in line), lines[0] if lines else "")
    return line[line.find("error") if "error" in line else 0 :][:160]


@functools.cache
def _loaded(compiler: str, stem: str, source: str, flags: tuple[str, ...]) -> ctypes.CDLL:
    return ctypes.CDLL(str(_compiled(compiler, stem, source, flags)))


def _compiled(compiler: str, stem: str, source: str, flags: tuple[str, ...]) -> Path:
    """The cached library for this source, flags, compiler and machine: compiled first (atomically) if missing or
    not the one its record describes (``_intact``)."""
    identity = "\n".join([source, compiler, _version(compiler), platform.machine(), *flags])
    digest = hashlib.sha256(identity.encode()).hexdigest()
    path = _cache_dir() / f"{stem}-{digest[:16]}.so"
    if _intact(path, digest):
        return path
    written = path.with_name(f"{path.stem}-{secrets.token_hex(4)}.c")
    partial = path.with_name(f"{path.stem}-{secrets.token_hex(4)}.so.partial")
    try:
        written.write_text(source)
        command = [compiler, *flags, str(written), "-o", str(partial), "-lm"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise OSError(f"exit {done.returncode}: {done.stderr.strip()}")
        built = partial.read_bytes()
        record = {"identity": digest, "size": len(built), "sha256": hashlib.sha256(built).hexdigest()}
        _write_atomically(_record_path(path), json.dumps(record).encode())
        os.replace(partial, path)  # atomic: ranks compiling at once each publish a whole library
    finally:
        written.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return path


def _record_path(library: Path) -> Path:
    return library.with_suffix(".json")


def _intact(path: Path, identity: str) -> bool:
    """Whether ``path`` is the library its record describes, built from ``identity``: the same size, then the
    same sha256 (read before anything maps it)."""
    try:
        with open(_record_path(path), "rb") as f:
            record = json.loads(f.read(4096))
        if not isinstance(record, dict) or record.get("identity") != identity:
            return False
        if path.stat().st_size != record.get("size"):
            return False
        return hashlib.sha256(path.read_bytes()).hexdigest() == record.get("sha256")
    except (OSError, ValueError):
        return False


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(f"{path.name}-{secrets.token_hex(4)}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


@functools.cache
def _version(compiler: str) -> str:
    """The compiler's first line of ``--version`` (on stdout, or stderr for some), asked once per process."""
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=True)
    lines = (done.stdout or done.stderr).splitlines()
    if not lines:
        raise ValueError(f"{compiler} --version printed nothing")
    return lines[0]


def _cache_dir() -> Path:
    """Where compiled kernels are kept: ``$MPIZERO_CACHE_DIR``, else ``$XDG_CACHE_HOME/mpizero`` or ``~/.cache``;
    where that cannot be made, ``$TMPDIR/mpizero-UID``, only if it is private (``_private_folder``)."""
    chosen = os.environ.get(CACHE_ENV_VAR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mpizero"
    )
    try:
        os.makedirs(chosen, exist_ok=True)
    except OSError:
        chosen = _private_folder(os.path.join(tempfile.gettempdir(), f"mpizero-{os.getuid()}"))
    return Path(chosen)


def _private_folder(path: str) -> str:
    """``path``, made 0700 if missing; an OSError unless it is a folder (not a link) this user owns that no one
    else may write in, since another user could plant a library in a shared temporary folder."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o022:
        mode = stat.filemode(found.st_mode)
        raise OSError(
            f"{path}: not a private folder of this user's (owner uid {found.st_uid}, mode {mode}): set "
            f"{CACHE_ENV_VAR} to a folder of your own"
        )
    return path
