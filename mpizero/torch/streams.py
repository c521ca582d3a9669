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
engine's work stays in the order it was issued, as FSDP's streams wait on each other's events.
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


class TorchStream:
    """``with torch_stream():`` makes CuPy's current stream torch's current one, where the engine is on a device."""

    def __init__(self, xp, device: torch.device) -> None:
        self.xp, self.device = xp, device
        self.last = None  # the stream the engine was last entered on

    def __call__(self):
        if self.xp is np:
            return contextlib.nullcontext()
        stream = self.xp.cuda.ExternalStream(torch_stream_pointer(self.device))
        self.follow(stream)
        return stream

    def follow(self, stream) -> None:
        """Order ``stream``'s later work after the engine's work queued so far on the stream it was last entered on,
        if that was another."""
        if self.last is not None and self.last.ptr != stream.ptr:
            stream.wait_event(self.last.record())
        self.last = stream

    def around(self, hook):
        """``hook`` run on torch's current stream (for hooks torch calls: forward, backward, state dict)."""

        @functools.wraps(hook)
        def run(*args, **kwargs):
            with self():
                return hook(*args, **kwargs)

        return run


def on_torch_stream(method):
    """A ``ShardedModel`` method that reaches the engine, run on torch's current stream (``TorchStream``)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.torch_stream():
            return method(self, *args, **kwargs)

    return run
