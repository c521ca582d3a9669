"""The stand-in running late: device work waits in its stream's queue until something makes it due, as on a GPU.

On a GPU the host only queues kernels and copies; they run later, in stream order, and the host sees their results
after a wait. Run at once, the stand-in would hide every missing wait. Running late (the default;
``MPIZERO_STANDIN_LATE=0`` runs everything at once, and ``running(on)`` switches inside a block), work that writes
into memory that already exists (kernels, ``a[...] = b``, ``fill``, ufuncs with ``out=``, ``set``,
``get(blocking=False)`` into pinned memory) waits in the queue of the stream it was issued on, and runs when due:

- its stream is synchronised, or an event recorded after it is (``Stream.synchronize``, ``Event.synchronize``);
- a stream that waits on such an event (``wait_event``) runs past the wait;
- later work on its stream runs now: anything that makes a new array (the stand-in cannot know its shape before it
  runs), or a read by the host (blocking ``get``, ``float()``, printing);
- another library resumes on its stream (torch, whose CPU work runs at once, leaving an ``ExternalStream``): what
  touches memory that library shares runs then (``shared``).

MPI handed a device pointer (``__cuda_array_interface__``, or DLPack as mpi4py takes it) makes nothing due, so a
missing sync before CUDA-aware MPI shows as stale bytes. ``empty`` and ``empty_pinned`` hold a garbage pattern (every
byte 0xFF: NaN in floats, -1 in integers), so a read before a write shows too. Queues are kept by stream pointer, as
an ``ExternalStream`` over a pointer is that stream.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections import defaultdict, deque

import numpy as np

ENV_VAR = "MPIZERO_STANDIN_LATE"
GARBAGE = 0xFF
ON = [os.environ.get(ENV_VAR, "1") != "0"]  # a list, so ``late()`` can switch it for a test
SHARED = weakref.WeakValueDictionary()  # id -> memory another library sees (DLPack, either way)
PINNED = weakref.WeakValueDictionary()  # id -> page-locked host memory (``empty_pinned``)


class Queue:
    """One stream's work not yet run: ``(run, touched memory)``, or ``(None, (stream, position))`` for a wait."""

    def __init__(self) -> None:
        self.items: deque = deque()
        self.issued = 0  # everything ever queued; ``done`` of them have run

    @property
    def done(self) -> int:
        return self.issued - len(self.items)


QUEUES: dict[int, Queue] = defaultdict(Queue)


@contextlib.contextmanager
def running(on: bool = True):
    """Run the stand-in late (or not) inside the block; whatever is still queued at its end runs then."""
    was, ON[0] = ON[0], on
    try:
        yield
    finally:
        for ptr in list(QUEUES):
            run_all(ptr)
        ON[0] = was


def root(host: np.ndarray) -> np.ndarray:
    """The array that owns ``host``'s memory (views lead to it)."""
    while isinstance(host.base, np.ndarray):
        host = host.base
    return host


def issue(ptr: int, run, touches: tuple = ()) -> None:
    """Queue ``run`` on stream ``ptr``, touching the memory of host arrays ``touches``; at once unless late."""
    if not ON[0]:
        run()
        return
    _append(ptr, (run, tuple(root(t) for t in touches)))


def position(ptr: int) -> int:
    """Where stream ``ptr``'s queue stands now (what an event recorded now waits for)."""
    return QUEUES[ptr].issued


def wait(ptr: int, on: int, at: int) -> None:
    """Stream ``ptr``'s later work waits until stream ``on`` has run ``at`` items."""
    if ON[0] and at > QUEUES[on].done:
        _append(ptr, (None, (on, at)))


def _append(ptr: int, item: tuple) -> None:
    queue = QUEUES[ptr]
    queue.items.append(item)
    queue.issued += 1


def run_until(ptr: int, at: int) -> None:
    """Run stream ``ptr``'s queue until ``at`` items have run (the streams it waits on as far as it waits)."""
    queue = QUEUES[ptr]
    while queue.done < at:
        run, detail = queue.items.popleft()
        if run is None:
            run_until(*detail)
        else:
            run()


def run_all(ptr: int) -> None:
    """Run everything queued on stream ``ptr``."""
    run_until(ptr, QUEUES[ptr].issued)


def run_shared(ptr: int) -> None:
    """Run stream ``ptr``'s queue through its last item touching memory another library shares."""
    queue = QUEUES[ptr]
    last = max((i for i, (_, touched) in enumerate(queue.items) if any(shared(t) for t in touched)), default=-1)
    run_until(ptr, queue.done + last + 1)


def share(host: np.ndarray) -> None:
    """Another library sees ``host``'s memory (DLPack)."""
    owner = root(host)
    SHARED[id(owner)] = owner


def shared(owner: np.ndarray) -> bool:
    return SHARED.get(id(owner)) is owner


def pin(host: np.ndarray) -> np.ndarray:
    """``host`` is page-locked: copies to and from it run with their stream, not when issued."""
    owner = root(host)
    PINNED[id(owner)] = owner
    return host


def pinned(host: np.ndarray) -> bool:
    owner = root(host)
    return PINNED.get(id(owner)) is owner


def garbage(host: np.ndarray) -> np.ndarray:
    """``host`` as uninitialised memory is, running late: every byte ``GARBAGE``."""
    if ON[0]:
        (host if host.flags.c_contiguous else host.T).view(np.uint8).fill(GARBAGE)
    return host
