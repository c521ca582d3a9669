"""Progress of long loops: a line every few seconds on stderr, on rank 0 only, with an ETA.

``for step in progress(range(300), "train", show=comm.rank == 0): ...`` prints, once
``every`` seconds have passed since the start or the last line,
``train: 120/300 (40 %), 15 s, ETA 22 s``. Progress goes to stderr so that stdout stays
exactly what the program prints (tests compare it byte for byte), and a loop shorter than
``every`` seconds prints nothing. On a terminal the line is redrawn in place as a bar.
A line is written between iterations, so one iteration longer than ``every`` delays it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")

EVERY = 5.0  # seconds between lines
ETA_AFTER = 3  # iterations done before an ETA is shown: the first one includes warm-up
BAR = 20  # characters of the terminal bar


def duration(seconds: float) -> str:
    """Format seconds for a person: ``42 s``, ``3 min 05 s``, ``2 h 07 min``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Progress:
    """Count the iterations of a loop of ``total`` and report them every ``every`` seconds."""

    def __init__(
        self,
        total: int,
        what: str,
        *,
        show: bool = True,
        every: float = EVERY,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total < 0 or every <= 0:
            raise ValueError(f"progress needs total >= 0 and every > 0, got total {total}, every {every}")
        self.total, self.what, self.show, self.every = total, what, show, every
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.done = 0
        self.start = self.last = clock()
        self.first_done: float | None = None  # when the first iteration ended: the ETA's rate starts there
        self.drawn = False  # a terminal bar is on screen and needs its newline at the end

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more iterations done; write a line if ``every`` seconds have passed."""
        self.done += n
        now = self.clock()
        if self.first_done is None:
            self.first_done = now
        if self.show and now - self.last >= self.every:
            self.last = now
            self.write(self.line(now))

    def eta(self, now: float) -> float | None:
        """Seconds left at the mean pace since the first iteration, or None before ``ETA_AFTER`` iterations."""
        if self.done < max(ETA_AFTER, 2) or self.first_done is None or now <= self.first_done:
            return None
        return (self.total - self.done) * (now - self.first_done) / (self.done - 1)

    def line(self, now: float) -> str:
        """The report: ``what: done/total (percent), elapsed, ETA``."""
        percent = 100 * self.done // self.total if self.total else 100
        text = f"{self.what}: {self.done}/{self.total} ({percent} %), {duration(now - self.start)}"
        eta = self.eta(now)
        return text if eta is None else f"{text}, ETA {duration(eta)}"

    def write(self, text: str) -> None:
        if self.stream.isatty():
            filled = BAR * self.done // self.total if self.total else BAR
            self.stream.write(f"\r[{'#' * filled}{'.' * (BAR - filled)}] {text}\033[K")
            self.drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End a terminal bar's line, so what follows starts on a line of its own."""
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


def progress(iterable: Iterable[T], what: str, *, total: int | None = None, **settings) -> Iterator[T]:
    """Yield from ``iterable``, reporting progress as ``Progress(total, what, **settings)`` does.

    ``total`` defaults to ``len(iterable)``; ``show=comm.rank == 0`` keeps other ranks quiet.
    """
    counter = Progress(len(iterable) if total is None else total, what, **settings)
    try:
        for item in iterable:
            yield item
            counter.advance()
    finally:
        counter.close()
