"""One run at a time in a checkpoint directory: a lock, held by the saving process until it exits.

Two runs saving into one directory would rename their checkpoints over each
other's (two copies of one command both write ``ckpt-00000002``). Rank 0 of a
run takes an exclusive ``flock`` on ``DIR/.mpizero-lock`` before its first save
and writes who holds it (run, host, process, since when) into it, so a second
run is refused with that. The kernel drops the lock when the process ends,
however it ends; a clean exit also removes the file. Where the file system
has no locks, runs are not kept apart.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import stat
import time

LOCK = ".mpizero-lock"
_held: dict[str, int] = {}  # the directory's real path -> the locked descriptor of its lock file


def hold(directory: str, run: str) -> str | None:
    """Lock ``directory`` (made if missing) for this process and run ``run`` until it exits; or say who holds it."""
    real = os.path.realpath(directory)
    if real in _held:
        return None
    os.makedirs(real, exist_ok=True)
    path = os.path.join(real, LOCK)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return f"{directory}: {LOCK} is not a regular file: remove it"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            return _held_by_another(directory, path) if error.errno in (errno.EAGAIN, errno.EACCES) else None
        if _still_there(fd, path):  # not removed by a holder's exit between our open and our lock
            break
        os.close(fd)
    _record(fd, run)
    if not _held:
        atexit.register(_release_all)
    _held[real] = fd
    return None


def release(directory: str) -> None:
    """Give up this process's lock on ``directory`` (if it holds it), removing the lock file."""
    real = os.path.realpath(directory)
    if real in _held:
        _release(_held.pop(real), os.path.join(real, LOCK))


def _release_all() -> None:
    for real in list(_held):
        release(real)


def _still_there(fd: int, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _record(fd: int, run: str) -> None:
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    holder = {"run": run, "host": socket.gethostname(), "pid": os.getpid(), "since": since}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)


def _held_by_another(directory: str, path: str) -> str:
    try:
        with open(path, "rb") as f:
            holder = json.loads(f.read(4096))
        who = f"run {holder['run']}, process {holder['pid']} on {holder['host']}, since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        who = "a process that has not yet said which"
    return (
        f"{directory} is in use by another run ({who}): two runs saving into one directory would replace each "
        "other's checkpoints. Wait for it to end, or save into another directory"
    )


def _release(fd: int, path: str) -> None:
    """Remove the lock file while still holding it (a run waiting for it then makes a new one), then unlock."""
    if _still_there(fd, path):
        os.unlink(path)
    os.close(fd)
