"""Each rank's own offload directory inside ``DiskOffload.directory``: removed with its engine or by the next one."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import tempfile
import weakref

PREFIX = "mpizero-offload-"  # never a checkpoint's name
MARKER = ".mpizero-offload"  # what a rank's directory holds besides its group files: whose it is
GROUP_FILE = re.compile(r"group\d{5}\.state")


def rank_directory(config, device: str, rank: int, owner: object) -> tuple[RankDirectory | None, str | None]:
    """This rank's offload directory, made now for ``owner``, and None; or None and the problem (to be agreed)."""
    if config.offload is None:
        return None, None
    if device != "cpu":
        return None, f"DiskOffload keeps host arrays, but the parameters live on the {device} device"
    base = config.offload.directory
    try:
        os.makedirs(base, exist_ok=True)
        return RankDirectory(base, rank, owner), None
    except FileExistsError:
        return None, f"the offload directory {base!r} is a file, not a directory"
    except OSError as error:
        return None, f"the offload directory {base!r}: {error.strerror or error}"


class RankDirectory:
    """This rank's own directory inside ``base``, removed when ``owner`` is freed or the process exits.

    It holds a marker (``MARKER``) naming the host, the process-id namespace, the process id, the process's start
    time and a random token, so that a later engine that sees the same processes removes the directories of
    those that no longer run (a run killed with SIGKILL leaves its directory behind): only a directory whose
    marker says so, that holds nothing but the marker and group files, is ever removed; a name alone never is.
    """

    def __init__(self, base: str, rank: int, owner: object) -> None:
        _remove_left_behind(base)
        self.path = tempfile.mkdtemp(prefix=f"{owners_prefix()}{os.getpid()}-rank{rank:05d}-", dir=base)
        weakref.finalize(owner, shutil.rmtree, self.path, ignore_errors=True)
        marker = {**_this_process(), "token": secrets.token_hex(16)}
        with open(os.path.join(self.path, MARKER), "x") as file:
            json.dump(marker, file)


def owners_prefix() -> str:
    """``mpizero-offload-HOST-NAMESPACE-``: the start of the names of the directories that processes this one
    can see (the same host and process-id namespace) make."""
    return f"{PREFIX}{socket.gethostname()}-{_pid_namespace()}-"


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino if os.path.exists("/proc/self/ns/pid") else 0


def _this_process(pid: int | None = None) -> dict:
    """Who a process is, as a marker records it: host, process-id namespace, process id, start time (clock
    ticks after boot, ``/proc/PID/stat``'s 22nd field; None where it cannot be read: the process is gone)."""
    pid = os.getpid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/stat") as file:
            started = int(file.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        started = None
    return {"host": socket.gethostname(), "pid_namespace": _pid_namespace(), "pid": pid, "started": started}


def _remove_left_behind(base: str) -> None:
    """Remove the offload directories in ``base`` that a process this one can see made and that no longer runs
    (``left_behind``)."""
    for entry in os.scandir(base):
        if left_behind(entry):
            shutil.rmtree(entry.path, ignore_errors=True)


def left_behind(entry: os.DirEntry) -> bool:
    """Whether ``entry`` is an offload directory whose maker is gone: named as this host's and namespace's, a real
    directory (not a link), holding only group files and a marker that names the same host, namespace and process
    as the name, and that process no longer runs (or its id now belongs to a process started at another time)."""
    made_by = re.fullmatch(re.escape(owners_prefix()) + r"(\d+)-rank\d{5}-\w+", entry.name)
    if made_by is None or not entry.is_dir(follow_symlinks=False):
        return False
    try:
        names = os.listdir(entry.path)
        with open(os.path.join(entry.path, MARKER)) as file:
            marker = json.load(file)
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or any(name != MARKER and not GROUP_FILE.fullmatch(name) for name in names):
        return False
    now = _this_process(int(made_by[1]))
    same_maker = all(marker.get(key) == now[key] for key in ("host", "pid_namespace", "pid"))
    return same_maker and isinstance(marker.get("token"), str) and marker.get("started") != now["started"]
