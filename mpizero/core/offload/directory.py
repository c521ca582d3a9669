"""Each rank's own offload directory: made inside ``offload_dir``, removed with its engine or by the next one."""

from __future__ import annotations

import os
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

    Its name holds the host and the process id, so that a later engine on the same host removes the directories
    of processes that no longer run (a run killed with SIGKILL leaves its directory behind).
    """

    def __init__(self, base: str, rank: int, owner: object) -> None:
        host = socket.gethostname()
        _remove_left_behind(base, f"{PREFIX}{host}-")
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{host}-{os.getpid()}-rank{rank:05d}-", dir=base)
        weakref.finalize(owner, shutil.rmtree, self.path, ignore_errors=True)


def _remove_left_behind(base: str, ours: str) -> None:
    """Remove the offload directories in ``base`` named ``ours``PID-... whose process no longer runs."""
    for entry in os.scandir(base):
        pid = entry.name.removeprefix(ours).split("-", 1)[0]
        if entry.name.startswith(ours) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(entry.path, ignore_errors=True)
