"""A fault-injection hook for tests: ``MPIZERO_KILL_AT=POINT:STEP:RANK`` kills that rank with SIGKILL.

Points: ``save`` (after the rank wrote its checkpoint files, before the
manifest), ``step`` (at the start of a training step) and ``update`` (in the
update, after its first group: offloaded states half written). Unset in normal
use.
"""

from __future__ import annotations

import os
import signal

ENV_VAR = "MPIZERO_KILL_AT"


def maybe_kill(point: str, step: int, rank: int) -> None:
    """Kill this process, as ``kill -9`` would, if the environment asks for this point, step and rank."""
    if os.environ.get(ENV_VAR) == f"{point}:{step}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)
