"""The stand-in's ``cupy.cuda``: streams, events and the devices, keeping the order CuPy's would.

``MPIZERO_STANDIN_DEVICES`` says how many devices it has (default 1), so the choice of one device per local rank
runs on the CPU; ``Device(i).use()`` makes device ``i`` this thread's current one, as in CuPy.

Work on the stand-in runs at once, unless it runs late (``late``): then each stream's work waits in its queue, and
the orderings here (``synchronize``, events, ``wait_event``) are what make it run. Every kernel launch and copy is
counted on the stream current when it was issued, by stream pointer
(``LAUNCHES``), so a test can check that the engine queues its work where the caller's framework
queues its own (an external stream, as torch's current stream is to CuPy), and waits (``synchronize``) are
counted on the bus (``bus``).
"""

from __future__ import annotations

import itertools
import os
import threading
import types
from collections import Counter

from mpizero.standin import bus, late

DEVICES_ENV_VAR = "MPIZERO_STANDIN_DEVICES"
_pointers = itertools.count(0x1000)
LAUNCHES: Counter = Counter()  # stream pointer (0: the null stream) -> kernels and copies queued on it
_current = threading.local()


class Stream:
    """A queue of device work; ``with stream:`` (or ``use()``) makes it current for this thread, as in CuPy."""

    def __init__(self, null: bool = False, non_blocking: bool = False, ptr: int | None = None) -> None:
        self.ptr = 0 if null else next(_pointers) if ptr is None else ptr
        self.non_blocking = non_blocking
        self._outer: list[Stream] = []

    def __enter__(self) -> Stream:
        self._outer.append(get_current_stream())
        self.use()
        return self

    def __exit__(self, *exc) -> None:
        self._outer.pop().use()

    def use(self) -> Stream:
        _current.stream = self
        return self

    def record(self, event: Event | None = None) -> Event:
        """An event at this point of the stream's queue."""
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        """Order this stream's later work after ``event`` (no host wait)."""
        if event.stream is not None:
            late.wait(self.ptr, event.stream.ptr, event.position)

    @classmethod
    def from_external(cls, obj) -> ExternalStream:
        """The stream another library made, handed over by the CUDA stream protocol (``obj.__cuda_stream__()``:
        version, pointer), as CuPy 14 takes it."""
        version, ptr = obj.__cuda_stream__()
        if version != 0:
            raise TypeError(f"__cuda_stream__ version {version} is not supported (0 is)")
        return ExternalStream(ptr)

    def synchronize(self) -> None:
        """The host waits until this stream's queue is done."""
        bus.waited()
        late.run_all(self.ptr)

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and other.ptr == self.ptr

    def __hash__(self) -> int:
        return hash(self.ptr)


class ExternalStream(Stream):
    """A stream another library made (torch's ``cuda_stream``), known by its pointer (CuPy 13's way in;
    ``Stream.from_external`` is CuPy 14's)."""

    def __init__(self, ptr: int, device_id: int = -1) -> None:
        super().__init__(ptr=ptr)

    def __exit__(self, *exc) -> None:
        """Back to the library that owns the stream (torch, whose CPU work runs at once): what touches memory it
        shares runs now."""
        super().__exit__(*exc)
        late.run_shared(self.ptr)


class Event:
    """A point in a stream's queue."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        self.stream: Stream | None = None
        self.position = 0  # how much of the stream's queue comes before this event

    def record(self, stream: Stream | None = None) -> None:
        self.stream = get_current_stream() if stream is None else stream
        self.position = late.position(self.stream.ptr)

    def synchronize(self) -> None:
        """The host waits until the stream has reached this event."""
        bus.waited()
        if self.stream is not None:
            late.run_until(self.stream.ptr, self.position)


NULL = Stream(null=True)


def get_current_stream(device_id: int = -1) -> Stream:
    """This thread's current stream (the null stream until another is made current)."""
    return getattr(_current, "stream", NULL)


def launched(stream: Stream | None = None) -> int:
    """Count one kernel or copy on ``stream`` (default: the current one); return the stream's pointer."""
    ptr = (get_current_stream() if stream is None else stream).ptr
    LAUNCHES[ptr] += 1
    return ptr


def issue(run, touches: tuple = (), stream: Stream | None = None) -> None:
    """Launch ``run``, writing into existing memory (``touches``: the host arrays it reads and writes), on
    ``stream`` (default: the current one): counted, and run now or, running late, when due."""
    late.issue(launched(stream), run, touches)


def due(stream: Stream | None = None) -> Stream:
    """Run what is queued on ``stream`` (default: the current one), since later work on it runs now."""
    stream = get_current_stream() if stream is None else stream
    late.run_all(stream.ptr)
    return stream


class Device:
    """A device by its id (default: this thread's current one); ``use()`` or ``with`` makes it current."""

    def __init__(self, device: int | None = None) -> None:
        self.id = getattr(_current, "device", 0) if device is None else int(device)
        if not 0 <= self.id < _device_count():
            raise ValueError(f"the stand-in has {_device_count()} devices ({DEVICES_ENV_VAR}), not device {self.id}")
        self._outer: list[int] = []

    def use(self) -> None:
        _current.device = self.id

    def __enter__(self) -> Device:
        self._outer.append(getattr(_current, "device", 0))
        self.use()
        return self

    def __exit__(self, *exc) -> None:
        _current.device = self._outer.pop()


def _device_count() -> int:
    return int(os.environ.get(DEVICES_ENV_VAR, "1"))


runtime = types.SimpleNamespace(getDeviceCount=_device_count)
