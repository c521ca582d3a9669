"""What crosses the stand-in's "bus": every copy between device and host, and every wait of the host on the device.

On a GPU each of these costs a transfer over PCIe and, when it blocks, drains the device's queue; on the stand-in
they cost nothing, so they are counted instead and tests pin how many a step may take (``COUNTS``):

- ``d2h``: device-to-host copies (``get``, and the implicit ones CuPy allows: ``float()``, ``int()``, ``bool()``,
  ``item()``, ``tolist()``, printing, pickling);
- ``h2d``: host-to-device copies (``set``, ``asarray`` of host data, host index arrays);
- ``sync``: waits of the host on the device (every blocking copy to the host, ``synchronize``);
- ``bytes``: bytes over the bus, both ways;
- ``device copy``: assignments between device arrays (``a[...] = b``), which never leave the device;
- ``alloc``: device allocations (every new device array that owns its memory: ``empty``, ``zeros``, a copy, the
  result of an operation without ``out``, a reduction's 0-d result), each a call into the memory pool on a GPU.
"""

from __future__ import annotations

from collections import Counter

COUNTS: Counter = Counter()


def copied(direction: str, nbytes: int, waits: bool) -> None:
    """Count one copy over the bus (``d2h`` or ``h2d``) of ``nbytes``; ``waits``: the host blocked until it was done."""
    COUNTS[direction] += 1
    COUNTS["bytes"] += int(nbytes)
    if waits:
        COUNTS["sync"] += 1


def waited() -> None:
    """Count one wait of the host on the device (``synchronize``)."""
    COUNTS["sync"] += 1


def allocated() -> None:
    """Count one device allocation."""
    COUNTS["alloc"] += 1
