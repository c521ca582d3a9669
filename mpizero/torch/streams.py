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
on the stream that made it. So an entry on a stream other than one that lent gradients ends with each lending stream
waiting for the entry's work (an event, no host wait): whatever torch queues there afterwards, on memory the entry
freed, runs after the entry has read it. Where the engine is entered on one stream only (the common loop) nothing is
recorded, joined or watched per gradient; autograd itself records a gradient on the stream its hook runs on.
"""

from __future__ import annotations

import contextlib
import functools

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
        self.last = None  # the stream the engine was last entered on
        self.streams: dict[int, object] = {}  # CuPy's stream over each torch stream entered on, by pointer
        self.lenders: dict[int, object] = {}  # the streams gradients were lent to the engine on, by pointer

    def __call__(self):
        if self.xp is np:
            return contextlib.nullcontext()
        ptr = torch_stream_pointer(self.device)
        stream = self.streams.get(ptr)
        if stream is None:
            stream = self.streams[ptr] = external_stream(self.xp, ptr)
        self.follow(stream)
        self.last = stream
        others = [lender for key, lender in self.lenders.items() if key != ptr]
        return JoinedEntry(stream, others) if others else stream

    def follow(self, stream) -> None:
        """Order ``stream``'s later work after the engine's work queued so far on the stream it was last entered on,
        if that was another (torch's current stream: ``stream``)."""
        if self.last is not None and self.last.ptr != stream.ptr:
            stream.wait_event(self.last.record())

    def lend(self, array):
        """``array`` (a zero-copy view of a tensor autograd made) as the engine may hold it past this entry: its
        stream is one that later entries on other streams join (``JoinedEntry``). On the host: as is."""
        if self.xp is not np and self.last.ptr not in self.lenders:
            self.lenders[self.last.ptr] = self.last
        return array

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


class JoinedEntry:
    """An entry on ``stream`` whose end makes each of ``lenders`` wait for the entry's work, so that memory of a
    gradient lent there and freed here goes back to its stream only after this entry has read it (what
    ``Tensor.record_stream`` on each lent gradient would ensure, at one event an entry)."""

    def __init__(self, stream, lenders: list) -> None:
        self.stream, self.lenders = stream, lenders

    def __enter__(self):
        return self.stream.__enter__()

    def __exit__(self, *exc) -> None:
        done = self.stream.record()
        for lender in self.lenders:
            lender.wait_event(done)
        self.stream.__exit__(*exc)


def on_torch_stream(method):
    """A ``ShardedModel`` method that reaches the engine, run on torch's current stream (``TorchStream``)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.torch_stream():
            return method(self, *args, **kwargs)

    return run
