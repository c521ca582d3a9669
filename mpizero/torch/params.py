"""Torch parameters that show the engine's full params: bound once, gathered and freed by group at stage 3.

At stages 0-2 the full params live between steps: with float32 params each
torch parameter is a view of the engine's buffer (updates land in place);
with bfloat16 or float16 params it is a float32 copy refreshed after each
update (the model computes in float32 on the rounded values, as the engine's
precision policies say). At stage 3 each group has a ``FullParams`` buffer the
torch parameters view; the engine all-gathers straight into it (float32), or
into its own buffer that is then converted, and the storage is freed on release.
"""

from __future__ import annotations

import numpy as np
import torch

from mpizero.torch.tensors import FullParams, as_tensor, raw_array


class Binder:
    """Point each torch parameter at the engine's full params; at stage 3 gather and free them by group."""

    def __init__(self, engine, params: dict[str, torch.nn.Parameter], device: torch.device) -> None:
        self.engine, self.params = engine, params
        self.zero_copy = np.dtype(engine.config.param_dtype) == np.float32
        self.sharded = engine.groups[0].plan.gathers_params
        self.holders = [0] * len(engine.groups)  # acquisitions not yet released, per group
        self.in_flight: set[int] = set()  # prefetched groups nobody has acquired yet
        self.buffers: list[FullParams] = []
        if self.sharded or not self.zero_copy:
            for group in engine.groups:
                buffer = FullParams(group.partition.padded_numel, device)
                for spec in group.layout.specs:
                    params[spec.name].data = buffer.tensor[spec.offset : spec.stop].view(spec.shape)
                self.buffers.append(buffer)
                if self.sharded:
                    buffer.free()
        self.refresh()

    def refresh(self) -> None:
        """Make the torch parameters show the engine's current parameters (stages 0-2; stage 3 gathers on use)."""
        if self.sharded:
            return
        for index in range(len(self.engine.groups)):
            views = self.engine.gather(index)
            if self.zero_copy:
                for name, view in views.items():
                    self.params[name].data = as_tensor(view)
            else:
                self._convert(index, views)

    def _convert(self, index: int, views: dict) -> None:
        """Write the param-dtype views into the group's float32 torch buffer."""
        flat = raw_array(self.buffers[index].tensor)
        for spec in self.engine.groups[index].layout.specs:
            flat[spec.offset : spec.stop] = views[spec.name].reshape(-1)

    def prefetch(self, index: int) -> None:
        """Start gathering group ``index`` if nobody holds it (stage 3); ``acquire`` completes it."""
        if self.holders[index] or index in self.in_flight:
            return
        out = self.buffers[index].allocate() if self.zero_copy else None
        self.engine.gather(index, blocking=False, out=out)
        self.in_flight.add(index)

    def acquire(self, index: int) -> None:
        """Make group ``index``'s torch parameters hold the full values until the matching ``release``."""
        if self.holders[index] == 0:
            if self.zero_copy:
                self.engine.gather(index, out=self.buffers[index].allocate())
            else:
                views = self.engine.gather(index)
                self.buffers[index].allocate()
                self._convert(index, views)
                self.engine.release(index)
            self.in_flight.discard(index)
        self.holders[index] += 1

    def release(self, index: int) -> None:
        """Drop one hold on group ``index``; the last one frees its full params."""
        self.holders[index] -= 1
        if self.holders[index] == 0:
            self._free(index)

    def drop_prefetched(self) -> None:
        """Free groups prefetched but never used (the model took another path)."""
        for index in sorted(self.in_flight):
            if self.holders[index] == 0:
                self._free(index)
        self.in_flight.clear()

    def _free(self, index: int) -> None:
        self.engine.release(index)  # first: MPI may still be writing into the buffer
        self.buffers[index].free()

    def torch_bytes(self) -> int:
        """Bytes of float32 torch buffers the engine does not count (converted copies of bf16/fp16 params)."""
        return 0 if self.zero_copy else sum(b.nbytes for b in self.buffers if b.allocated)
