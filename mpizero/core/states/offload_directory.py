"""Each rank's own offload directory: made inside ``offload_dir``, removed with its engine or by the next one."""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import weakref

OFFLOADS = (None, "disk")
PREFIX = "mpizero-offload-"  # never a checkpoint's name


def rank_directory(config, device: str, rank: int, owner: object) -> tuple[RankDirectory | None, str | None]:
    """This rank's offload directory, made now for ``owner``, and None; or None and the problem (to be agreed)."""
    if config.offload is None:
        return None, None
    if device != "cpu":
        return None, f"offload={config.offload!r} keeps host arrays, but the parameters live on the {device} device"
    try:
        os.makedirs(config.offload_dir, exist_ok=True)
        return RankDirectory(config.offload_dir, rank, owner), None
    except FileExistsError:
        return None, f"offload_dir {config.offload_dir!r} is a file, not a directory"
    except OSError as error:
        return None, f"offload_dir {config.offload_dir!r}: {error.strerror or error}"


class RankDirectory:
    """This rank's own directory inside ``base``, removed when ``owner`` is freed or the process exits.

    Its name holds the host, the process-id namespace and the process id (``owners_prefix``), so that a later
    engine that sees the same processes removes the directories of those that no longer run (a run killed with
    SIGKILL leaves its directory behind), and never another host's or container's.
    """

    def __init__(self, base: str, rank: int, owner: object) -> None:
        _remove_left_behind(base)
        self.path = tempfile.mkdtemp(prefix=f"{owners_prefix()}{os.getpid()}-rank{rank:05d}-", dir=base)
        weakref.finalize(owner, shutil.rmtree, self.path, ignore_errors=True)


def owners_prefix() -> str:
    """``mpizero-offload-HOST-NAMESPACE-``: the start of the names of the directories that processes this one
    can see (the same host and process-id namespace) make."""
    namespace = os.stat("/proc/self/ns/pid").st_ino if os.path.exists("/proc/self/ns/pid") else 0
    return f"{PREFIX}{socket.gethostname()}-{namespace}-"


def _remove_left_behind(base: str) -> None:
    """Remove the offload directories in ``base`` that processes this one can see made, and that no longer run."""
    named = re.compile(re.escape(owners_prefix()) + r"(\d+)-rank\d{5}-")
    for entry in os.scandir(base):
        made_by = named.match(entry.name)
        if made_by and not os.path.exists(f"/proc/{made_by[1]}"):
            shutil.rmtree(entry.path, ignore_errors=True)
