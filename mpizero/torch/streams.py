"""The engine's device work queued on torch's current stream, so that the two are ordered without a wait.

CuPy queues each kernel and copy on its thread's current stream (the legacy null stream unless changed); torch
on its own current stream, which ``torch.cuda.stream(s)``, a per-thread default stream
(``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1`` on CuPy's side) or autograd's backward thread may make another.
Every way from torch into the engine, each hook and each method of ``ShardedModel`` that reaches the engine,
runs inside ``TorchStream``: CuPy's current stream there is an external stream over torch's current one, so the
engine's work lands in the same queue as the kernels that made its inputs and will read its outputs, as
FSDP's work runs on torch's streams. On the host nothing is queued and nothing changes.

The engine's own state (gradient shards, sums, masters) is written on whichever stream it was entered on, so when
torch's current stream differs from the last entry's (a user's ``torch.cuda.stream(s)`` around forward and
backward, then ``step()`` outside it), the new stream first waits for an event recorded on the last one: the
engine's work stays in the order it was issued, as FSDP's streams wait on each other's events. A model's forward
enters too (``order_forward``), so a forward on another stream than the last step's reads the parameters after the
step's update at every stage, not only at stage 3, whose gathers enter anyway.

A gradient autograd made on one stream and lent to the engine (``lend``: held past its hook, zero-copy) may be read
on another, where the engine is entered next, and torch's caching allocator hands a freed block at once to later work
on the stream that made it. While the engine has been entered on one stream only (the common loop) nothing is
recorded or watched per gradient: autograd records a gradient on the stream its hook runs on, the engine's. Once
it has been entered on a second stream, each gradient lent from then on is recorded (``Tensor.record_stream``) on
every stream the engine enters while it holds it; those lent before are covered by their hooks' streams, each of
which waits, at the end of every entry on another stream until the step that reads them is over, for an event
after that entry's work (``Entry``). A nested entry on another stream (a hook inside ``step(closure)``) ends with
the enclosing entry's stream waiting for it, so the engine's work keeps its order.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import numpy as np
import torch

STANDIN_TORCH_STREAM = 0x70C4  # what stands for torch's current stream where CPU tensors stand for CUDA ones


def torch_stream_pointer(device: torch.device) -> int:
    """The ``cudaStream_t`` torch queues on now, on ``device`` (on the stand-in: ``STANDIN_TORCH_STREAM``)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else STANDIN_TORCH_STREAM


class StreamPointer:
    """A ``cudaStream_t`` as the CUDA stream protocol hands it over (``__cuda_stream__``: version 0, the pointer)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.ptr


def external_stream(xp, ptr: int):
    """CuPy's stream over the stream ``ptr`` another library made: ``Stream.from_external`` where CuPy has it (14
    on, which deprecates ``ExternalStream``), ``ExternalStream`` before (CuPy 13)."""
    from_external = getattr(xp.cuda.Stream, "from_external", None)
    return from_external(StreamPointer(ptr)) if from_external else xp.cuda.ExternalStream(ptr)


class TorchStream:
    """``with torch_stream():`` makes CuPy's current stream torch's current one, where the engine is on a device."""

    def __init__(self, xp, device: torch.device) -> None:
        self.xp, self.device = xp, device
        self.last = None  # the stream the engine's latest work was queued on
        self.streams: dict[int, object] = {}  # CuPy's stream over each torch stream entered on, by pointer
        self.entered: list = []  # the streams of the entries open now, innermost last
        self.switched = False  # whether the engine has been entered on a second stream
        self.lent: dict[int, torch.Tensor] = {}  # since ``switched``: id of an array the engine holds -> its tensor
        self.lenders: dict[int, object] = {}  # the streams gradients were lent on before ``switched``, by pointer
        self.step_over = False  # a step ended: its outermost entry's end lets the lenders go

    def __call__(self):
        if self.xp is np:
            return contextlib.nullcontext()
        ptr = torch_stream_pointer(self.device)
        stream = self.streams.get(ptr)
        if stream is None:
            stream = self.streams[ptr] = external_stream(self.xp, ptr)
        return Entry(self, stream)

    def follow(self, stream) -> None:
        """Order ``stream``'s later work after the engine's latest work, if that was queued on another stream, and
        record every tracked lent tensor on it (torch's current stream: ``stream``)."""
        if self.last is not None and self.last.ptr != stream.ptr:
            stream.wait_event(self.last.record())
            self.switched = True
            for tensor in self.lent.values():
                record_stream(tensor, self.device)
        self.last = stream

    def lend(self, tensor: torch.Tensor, array):
        """``array`` (a zero-copy view of ``tensor``, which autograd made) as the engine may hold it past this entry
        (see the module's docstring). On the host: as is."""
        if self.xp is np:
            return array
        if not self.switched:
            here = self.entered[-1]  # the hook's entry
            self.lenders.setdefault(here.ptr, here)
            return array
        key = id(array)
        self.lent[key] = tensor
        weakref.finalize(array, self.lent.pop, key, None)
        record_stream(tensor, self.device)  # made on another stream than this entry's: read here too
        return array

    def left(self, stream) -> None:
        """The entry on ``stream`` ends: each lending stream other than it, and the enclosing entry's stream if
        another, waits for its work; after a step, the lenders are let go (the step read what they lent)."""
        self.entered.pop()
        outer = self.entered[-1] if self.entered else None
        waiting = [lender for key, lender in self.lenders.items() if key != stream.ptr]
        if outer is not None and outer.ptr != stream.ptr:
            waiting.append(outer)
            self.last = outer
        if waiting:
            done = stream.record()
            for other in waiting:
                other.wait_event(done)
        if outer is None and self.step_over:
            self.lenders.clear()
            self.step_over = False

    def order_forward(self, model: torch.nn.Module, outside_graphs) -> None:
        """Enter before each forward of ``model`` on a device (``outside_graphs``: the hook left out of compiled
        graphs), so that its stream waits for the engine's last work (a step's update) if that was on another."""
        if self.xp is not np:
            model.register_forward_pre_hook(outside_graphs(self.around(lambda module, args: None)))

    def around(self, hook):
        """``hook`` run on torch's current stream (for hooks torch calls: forward, backward, state dict)."""

        @functools.wraps(hook)
        def run(*args, **kwargs):
            with self():
                return hook(*args, **kwargs)

        return run


class Entry:
    """One entry of the engine on ``stream`` (``TorchStream``): it follows the engine's latest work in, and its end
    is ``TorchStream.left``'s."""

    def __init__(self, owner: TorchStream, stream) -> None:
        self.owner, self.stream = owner, stream

    def __enter__(self):
        self.owner.follow(self.stream)
        self.owner.entered.append(self.stream)
        return self.stream.__enter__()

    def __exit__(self, *exc) -> None:
        self.owner.left(self.stream)
        self.stream.__exit__(*exc)


def record_stream(tensor: torch.Tensor, device: torch.device) -> None:
    """Keep ``tensor``'s memory from reuse until torch's current stream's work queued so far is done (a CUDA tensor;
    the stand-in's CPU tensors run at once, and torch's CPU allocator reuses nothing early)."""
    if tensor.device.type == "cuda":
        tensor.record_stream(torch.cuda.current_stream(device))


def on_torch_stream(method):
    """A ``ShardedModel`` method that reaches the engine, run on torch's current stream (``TorchStream``)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.torch_stream():
            return method(self, *args, **kwargs)

    return run
