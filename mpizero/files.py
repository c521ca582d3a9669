"""Files in and out: outputs written whole or not at all, never over an input, another output, or something
not a file; inputs read only once they are known to be regular files.

``write`` is the one way mpizero writes an output file (``--save-params``,
``--memory-json``, consolidate's ``.npz``, plots, checkpoint manifests): into
a temporary file beside the target, fsynced, then renamed into place, so a
reader sees the old file or the new one, never a part. ``output_problems``
(which tries to create each output's temporary file: ``creation_problem``),
``directory_problems`` and ``space_problems`` are the checks made before any
work, each problem one line naming the flag and the path. ``read_regular``
reads a file that a FIFO or a device in its place would make wait forever
(a key file, a manifest).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable
from typing import BinaryIO

from mpizero.errors import ZeroError

SYSTEM_TREES = ("/proc", "/sys", "/dev")  # kernel interfaces and devices: never a place for mpizero's output


class OutputError(ZeroError):
    """An output that must not be written: not a regular file, or gone from under us."""


def write(path: str, fill: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` atomically: ``fill(f)`` writes a temporary file beside it, which is fsynced and renamed."""
    problem = _not_a_regular_file(path)
    if problem:
        raise OutputError(f"{path} {problem}: refusing to replace it")
    folder = os.path.dirname(os.path.abspath(path))
    tmp = temporary_name(path)
    try:
        with open(tmp, "xb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):  # the write failed part-way: leave nothing behind
            os.unlink(tmp)
        raise
    fsync_directory(folder)


def temporary_name(path: str) -> str:
    """The temporary file ``write`` fills beside ``path`` before it renames it into place."""
    return f"{path}.tmp-{os.getpid()}-{secrets.token_hex(3)}"


def creation_problem(path: str) -> OSError | None:
    """Why the temporary file ``write`` will use for ``path`` cannot be created (None if it can): a name or
    path too long, a symlink loop, no permission, a read-only file system. Tried for real, then removed."""
    tmp = temporary_name(path)
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as error:
        return error
    os.unlink(tmp)
    return None


def fsync_directory(path: str) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _not_a_regular_file(path: str) -> str | None:
    """What ``path`` is if it exists and is not a regular file (a directory, a device, a FIFO), else None."""
    try:
        kind = _kind(os.stat(path).st_mode)
    except FileNotFoundError:
        return None
    return f"is {kind}, not a file" if kind else None


def _kind(mode: int) -> str | None:
    """What a file of ``mode`` is, unless it is a regular file: ``a FIFO``, ``a directory``, ..."""
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    kinds.update({stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket"})
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


class NotRegular(OSError):
    """A file to read that is not a regular file: refused before a read of it could wait forever."""


def read_regular(path: str, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``path``, once it is known to be a regular file: checked before it is opened
    (reading a FIFO or a terminal can wait forever), opened without blocking, and checked again once open."""
    _refuse_unless_regular(os.stat(path).st_mode)
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
        _refuse_unless_regular(os.fstat(f.fileno()).st_mode)  # replaced since it was checked
        return f.read(limit)


def _refuse_unless_regular(mode: int) -> None:
    kind = _kind(mode)
    if kind:
        raise NotRegular(f"is {kind}, not a regular file: refused without reading it (a read could wait forever)")


def _in_system_tree(path: str) -> str | None:
    real = os.path.realpath(path)
    return next((tree for tree in SYSTEM_TREES if real == tree or real.startswith(tree + "/")), None)


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file: the same real path, or the same inode (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return False


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def output_problems(outputs: dict[str, str], inputs: dict[str, str], directories: dict[str, str]) -> list[str]:
    """Why the output files ``{flag: path}`` could not be written, or would clobber an input or each other.

    ``inputs`` (``{flag: path}``): files or checkpoint directories the command reads; an output may be
    neither one of them nor inside one. ``directories``: output directories, which no output file may be.
    """
    problems = [p for flag, path in outputs.items() if (p := _output_problem(flag, path))]
    for flag, path in outputs.items():
        for in_flag, source in inputs.items():
            if _inside(path, source):
                where = "is" if os.path.realpath(path) == os.path.realpath(source) else "lies inside"
                problems.append(f"{flag} {path} {where} the input {in_flag} {source}: it would be overwritten")
    for flag, path in outputs.items():
        for dir_flag, folder in directories.items():
            if os.path.realpath(path) == os.path.realpath(folder):
                problems.append(f"{flag} {path} is also {dir_flag}: a file cannot be the directory too")
    named = list(outputs.items())
    for i, (flag, path) in enumerate(named):
        for other_flag, other in named[i + 1 :]:
            if _same_file(path, other):
                problems.append(
                    f"{flag} {path} and {other_flag} {other} are the same file: one would replace the other"
                )
    return problems


def _output_problem(flag: str, path: str) -> str | None:
    tree = _in_system_tree(path)
    if tree:
        return f"{flag} {path} is under {tree}: not a place for output"
    try:
        kind = _not_a_regular_file(path)
    except OSError as error:  # a name too long to look up, a symlink loop
        return f"{flag} {path}: {describe(error)}"
    if kind:
        return f"{flag} {path} {kind}"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{flag} {path}: directory {folder} does not exist"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{flag} {path} is not writable"
    error = creation_problem(path)
    return f"{flag} {path}: cannot create its temporary file {error.filename}: {describe(error)}" if error else None


def describe(error: OSError) -> str:
    """An OS error as its errno's name and message, e.g. ``ENAMETOOLONG (File name too long)``."""
    name = errno.errorcode.get(error.errno) if error.errno else None
    text = error.strerror or str(error)
    return f"{name} ({text})" if name else text


def directory_problems(flag: str, path: str) -> list[str]:
    """Why ``path`` could not be (or be made) a writable directory for output."""
    tree = _in_system_tree(path)
    if tree:
        return [f"{flag} {path} is under {tree}: not a place for output"]
    existing = _existing(path)
    if not os.path.isdir(existing):
        what = "is" if existing == os.path.abspath(path) else f"lies under {existing}, which is"
        return [f"{flag} {path} {what} a file, not a directory"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"{flag} {path}: {existing} is not writable"]
    return []


def space_problems(needs: list[tuple[str, str, int]]) -> list[str]:
    """Whether each file system has room for everything that will be written on it together: ``(flag, path,
    bytes)`` of each writer (the ranks of one host each name their own offload files)."""
    parts: dict[int, dict[str, int]] = {}
    free: dict[int, int] = {}
    for flag, path, nbytes in needs:
        device, info = _file_system(path)
        free[device] = info.f_bavail * info.f_frsize
        named = parts.setdefault(device, {})
        named[f"{flag} {path}"] = named.get(f"{flag} {path}", 0) + nbytes
    return [
        f"not enough free space for {' and '.join(f'{name} ({n:,} bytes)' for name, n in named.items())} on one "
        f"file system: about {sum(named.values()):,} bytes needed together, {free[device]:,} free"
        for device, named in parts.items()
        if sum(named.values()) > free[device]
    ]


def _file_system(path: str) -> tuple[int, os.statvfs_result]:
    """The device and ``statvfs`` of the file system ``path`` is (or would be made) on, from its nearest existing
    ancestor, looked up again if that vanishes meanwhile (another rank's trial save makes and removes folders)."""
    while True:
        existing = _existing(path)
        try:
            return os.stat(existing).st_dev, os.statvfs(existing)
        except FileNotFoundError:
            continue


def _existing(path: str) -> str:
    """``path``, or its nearest ancestor that exists (where it would be made)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return existing
