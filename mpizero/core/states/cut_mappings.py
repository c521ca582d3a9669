"""A mapped offload file cut short while the run maps it: the access reads zeros, and the cut is remembered.

Another process may truncate a rank's offload file at any moment. A read or
write of a mapped page past the new end then raises SIGBUS, which no Python
handler can turn into an exception (the faulting instruction would run again).
So a small C handler, compiled at first use (``mpizero.compiled``), covers the
mappings ``watch`` registers: a fault inside one maps zero pages over the rest
of it, marks it faulted and lets the access finish; ``Watch.faulted`` then
tells the file's ``check``, which the step, a save and a read of the states
agree on, so the run ends with one error naming the file on every rank. A fault
anywhere else takes the handler that was there before, as without this module.
Where no C compiler works, mappings are not covered (``available``).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import weakref

from mpizero import compiled

SLOTS = 1 << 16  # mappings covered at once
SOURCE = f"""#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define SLOTS {SLOTS}
static volatile uintptr_t starts[SLOTS], stops[SLOTS];
static volatile sig_atomic_t faulted[SLOTS];
static uintptr_t page;
static struct sigaction previous;

static void on_bus(int signal, siginfo_t *info, void *context) {{
    uintptr_t at = (uintptr_t)info->si_addr;
    for (int i = 0; i < SLOTS; i++) {{
        uintptr_t start = starts[i], stop = stops[i];
        if (at >= start && at < stop) {{
            uintptr_t from = at & ~(page - 1);
            void *zeros = mmap((void *)from, stop - from, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            if (zeros != MAP_FAILED) {{
                faulted[i] = 1;
                return;
            }}
            break;
        }}
    }}
    sigaction(SIGBUS, &previous, NULL); /* not a covered mapping: the access faults again, as before */
}}

int mz_cover(uintptr_t page_size) {{
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_bus;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    page = page_size;
    return sigaction(SIGBUS, &action, &previous);
}}

void mz_watch(int slot, uintptr_t start, uintptr_t length) {{
    faulted[slot] = 0;
    starts[slot] = start;
    stops[slot] = start + length;
}}

int mz_unwatch(int slot) {{
    stops[slot] = 0;
    starts[slot] = 0;
    return faulted[slot];
}}

int mz_faulted(int slot) {{
    return faulted[slot];
}}
"""


def available() -> str | None:
    """None where mapped offload files are covered; else why not (no working C compiler)."""
    return None if _handler() is not None else "SIGBUS on a cut offload file is not caught: no C compiler works"


class Watch:
    """The mappings of one file that the handler covers, and whether any of them faulted (it was cut)."""

    def __init__(self) -> None:
        self.slots: set[int] = set()
        self.ended_faulted = False  # a covered mapping that faulted and has since been unmapped

    def add(self, mapping: mmap.mmap) -> None:
        """Cover ``mapping`` until it is unmapped (a shared, writable mapping of the file)."""
        handler = _handler()
        if handler is None or not len(mapping) or not _free:
            return
        slot = _free.pop()
        view = ctypes.c_char.from_buffer(mapping)  # its address; released at once, so it may still be unmapped
        start = ctypes.addressof(view)
        del view
        handler.mz_watch(slot, start, len(mapping))
        self.slots.add(slot)
        weakref.finalize(mapping, self._end, handler, slot)

    def _end(self, handler, slot: int) -> None:
        self.ended_faulted |= bool(handler.mz_unwatch(slot))
        self.slots.discard(slot)
        _free.append(slot)

    def faulted(self) -> bool:
        """Whether an access to a covered mapping of the file faulted: the file was cut while mapped."""
        handler = _handler()
        return self.ended_faulted or any(handler.mz_faulted(slot) for slot in self.slots)


_free = list(range(SLOTS - 1, -1, -1))


@functools.cache
def _handler() -> ctypes.CDLL | None:
    """The handler's library, installed for this process, or None where it cannot be compiled or installed."""
    library = compiled.load("cut-mappings", SOURCE, ["-O2", "-std=c99", "-fPIC", "-shared"])[0]
    if library is None:
        return None
    library.mz_cover.argtypes = [ctypes.c_size_t]
    library.mz_watch.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t]
    library.mz_watch.restype = None
    library.mz_unwatch.argtypes = library.mz_faulted.argtypes = [ctypes.c_int]
    return library if library.mz_cover(mmap.PAGESIZE) == 0 else None
