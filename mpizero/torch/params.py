"""What each torch parameter shows, and when: the engine's full params while in use, a safe placeholder between.

Glossary:

- full view: a torch parameter's ``.data`` while its group is gathered: a view
  of the group's full params (float32 params: the engine's own buffer; bfloat16
  or float16: a float32 copy, since the model computes in float32 on the
  rounded values, as the engine's precision policies say).
- placeholder: a parameter's ``.data`` while its group is sharded (stage 3,
  outside forward and backward): an empty tensor, as FSDP1 showed. Reading it
  is safe (``p.sum()`` is 0, ``print(p)`` shows ``tensor([])``), and using it
  in a computation with the parameter's real shape fails loudly; the values
  are read with ``gathered()`` or ``state_dict()``. While it shows the
  placeholder, a parameter's class is a subclass of its own
  (``counting_class``) whose ``.data`` is a detached alias sharing its version
  counter, so that a write through ``.data`` (``p.data.mul_(0.9)``), which
  would act on no element, is counted and refused at the next step
  (``edits``) instead of doing nothing unseen. Shown, it is its own class.

At stages 0-2 the full params live between steps and every parameter always
shows its full view. At stage 3 each group's full params exist only between
``acquire`` (or ``prefetch``) and the last ``release``; each gather is
announced first (``sync``), so ranks that do different things find out.

- kept gathered: with ``keep_gathered``, a group gathered for a pass (an
  evaluation's too) stays gathered and shown after its last release, until
  ``drop_kept_gathered``: before the step's update, and before any operation
  that reads or sets the params outside a pass (``sync.KEPT_THROUGH``). Every
  rank gathers and drops at the same announced calls, so every rank keeps the
  same groups and skips the same gathers. Its parameters count writes through
  ``.data`` as while read in place, and its bytes and tensors are noted when
  gathered and compared when dropped: an edit or a new ``.data`` reached this
  rank's later passes alone (``edited_kept_gathered``: the step refuses the
  gradients computed with it, ``edits``), or, read in place, every rank's
  masters (``edited_in_place``).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from mpizero.core.held import to_float32
from mpizero.torch.fingerprint import fingerprints
from mpizero.torch.sync import Operation
from mpizero.torch.tensors import FullParams, as_array, as_tensor

TORCH_DATA = torch.Tensor.data  # torch's own ``.data`` of every tensor: a fresh alias that counts no write


def _counted_data(param):
    """The placeholder as a detached alias that shares the parameter's version counter: writes through it count."""
    return param.detach()


def _set_data(param, value) -> None:
    """Torch's own ``.data =``."""
    TORCH_DATA.__set__(param, value)


@functools.cache
def counting_class(cls: type) -> type:
    """``cls`` (a parameter class) with a ``.data`` that counts writes: the class of its parameters while they show
    the placeholder (``_hide``; ``_show`` gives them their own back)."""
    attributes = {"data": property(_counted_data, _set_data), "shown_class": cls, "__module__": __name__}
    return type(f"Sharded{cls.__name__}", (cls,), attributes)


def own_class(param) -> type:
    """The parameter's own class, whether it shows the placeholder now or not."""
    return getattr(type(param), "shown_class", type(param))


class Binder:
    """Point each torch parameter at the engine's full params or a placeholder; at stage 3 gather them by group."""

    def __init__(
        self, engine, params: dict[str, torch.nn.Parameter], device: torch.device, announcer, keep_gathered=False
    ):
        """``keep_gathered``: keep stage 3's groups gathered through a step's passes (see kept gathered)."""
        self.engine, self.params, self.announcer = engine, params, announcer
        self.keep_gathered = keep_gathered
        self.zero_copy = np.dtype(engine.config.param_dtype) == np.float32
        self.sharded = engine.groups[0].plan.gathers_params
        self.holders = [0] * len(engine.groups)  # acquisitions not yet released, per group
        self.in_flight: set[int] = set()  # prefetched groups nobody has acquired yet
        self.in_place: dict[int, list[int]] = {}  # groups shown as the engine's shared params: each one's versions
        self.edited_in_place: list[str] = []  # parameters edited while shown so, until a load sets the masters
        self.kept_gathered: dict[int, tuple] = {}  # each such group's ``_signature`` as gathered
        self.edited_kept_gathered: list[str] = []  # their parameters found changed, until the step or zero_grad()
        self.buffers: list[FullParams] = []
        self.placeholder = torch.empty(0, dtype=torch.float32, device=device)
        if self.sharded or not self.zero_copy:
            for index, group in enumerate(engine.groups):
                self.buffers.append(FullParams(group.partition.padded_numel, group.xp, device))
                if self.sharded:
                    self._hide(index)
                else:
                    self.buffers[index].allocate()
                    self._show(index)
        self.refresh()

    def _show(self, index: int) -> None:
        """Make group ``index``'s parameters views of its (allocated) float32 buffer. Shown as the engine's
        shared params (read in place), or kept gathered, a write through ``.data`` is counted as while hidden; read
        in place, each parameter's version is noted, so that ``_hide`` finds any edit."""
        flat = self.buffers[index].tensor
        shared = index in self.in_place
        counted = shared or self.keep_gathered
        with torch.inference_mode(False):  # shown to every later pass: no inference tensor
            for spec in self.engine.groups[index].layout.specs:
                param = self.params[spec.name]
                param.__class__ = counting_class(own_class(param)) if counted else own_class(param)
                param.data = flat[spec.offset : spec.stop].view(spec.shape)
        if shared:
            self.in_place[index] = [self.params[name]._version for name in self.engine.groups[index].layout.names]

    def _hide(self, index: int) -> None:
        """Make group ``index``'s parameters the placeholder and free its full params; note the parameters edited
        in place while shown as the engine's shared params (the edit reached every rank's masters)."""
        names = self.engine.groups[index].layout.names
        versions = self.in_place.pop(index, None)
        if versions is not None:
            self.edited_in_place += [n for n, v in zip(names, versions) if self.params[n]._version != v]
        for name in names:
            param = self.params[name]
            param.data = self.placeholder
            param.__class__ = counting_class(own_class(param))
        self.buffers[index].free()

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
        """Write the param-dtype views, widened, into the group's float32 torch buffer."""
        flat = as_array(self.buffers[index].tensor)
        for spec in self.engine.groups[index].layout.specs:
            to_float32(views[spec.name].reshape(-1), out=flat[spec.offset : spec.stop])

    def prefetch(self, index: int, gather: Operation = Operation.GATHER) -> None:
        """Start gathering group ``index`` if nobody holds it (stage 3); ``acquire`` completes it. ``gather``: as
        what it is announced (``GATHER``, or ``EVAL_GATHER`` for a forward without gradients)."""
        if self.holders[index] or index in self.in_flight or index in self.kept_gathered:
            return
        self.announcer.announce(gather, index)
        blocking = self.announcer.others_joined  # the joined ranks' part ends at once: so does this rank's
        if self.zero_copy:
            self._gather_shown(index, blocking=blocking, private=False)
        else:
            self.engine.gather(index, blocking=blocking)
        self.in_flight.add(index)

    def acquire(self, index: int, gather: Operation = Operation.GATHER, private: bool = False) -> None:
        """Make group ``index``'s torch parameters hold the full values until the matching ``release``
        (``gather``: as ``prefetch``'s). ``private``: into a buffer of their own, even where the engine's full
        params are read in place, so that an edit the caller may make stays on this rank until it is agreed, and
        never kept gathered."""
        if self.holders[index] == 0 and index not in self.kept_gathered:
            if index not in self.in_flight:
                self.announcer.announce(gather, index)
            self._gather_and_show(index, private)
        self.holders[index] += 1

    def take_part(self, index: int) -> None:
        """As a rank that has left ``join()``, take part in the gather of group ``index`` that the others announced:
        kept gathered where they keep it, so that every rank keeps the same groups after the block; else freed at
        once."""
        if self.keep_gathered:
            self._gather_and_show(index, private=False)
        else:
            self.engine.gather(index)
            self.engine.release(index)

    def _gather_and_show(self, index: int, private: bool) -> None:
        """Finish gathering group ``index`` (its gather announced) and show it; keep it gathered if so asked."""
        if self.zero_copy:
            self._gather_shown(index, blocking=True, private=private)
        else:
            views = self.engine.gather(index)
            self.buffers[index].allocate()
            self._convert(index, views)
            self.engine.release(index)
        self.in_flight.discard(index)
        self._show(index)
        if self.keep_gathered and not private:
            self.kept_gathered[index] = self._signature(index)

    def _gather_shown(self, index: int, blocking: bool, private: bool) -> None:
        """Gather group ``index`` (float32) into the buffer its parameters show: the engine's full params where
        it reads them in place (a forward or backward: nothing is copied), else a buffer of their own."""
        if self.engine.groups[index].node_params is not None and not private:
            self.engine.gather(index, blocking=blocking)
            self.buffers[index].allocate(self.engine.full_params(index))
            self.in_place[index] = []
        else:
            self.engine.gather(index, blocking=blocking, out=self.buffers[index].allocate())

    def release(self, index: int) -> None:
        """Drop one hold on group ``index``; the last one frees its full params, unless they are kept gathered."""
        self.holders[index] -= 1
        if self.holders[index] == 0 and index not in self.kept_gathered:
            self._free(index)

    def end_prefetches(self) -> None:
        """Free groups prefetched but never used (the model took another path); where groups are kept gathered,
        keep them instead, as every rank that prefetched them does, whichever path its model took."""
        for index in sorted(self.in_flight):
            if self.holders[index]:
                continue
            if self.keep_gathered:
                self.acquire(index)  # completes the gather; the release keeps it
                self.release(index)
            else:
                self._free(index)
        self.in_flight.clear()

    def drop_kept_gathered(self) -> None:
        """Stop keeping groups gathered (every rank at the same call: ``sync.KEPT_THROUGH``, and before a step's
        update): free those nobody holds, and note the parameters of any whose bytes or tensors changed since
        gathered (bytes read in place: the edit is in every rank's masters)."""
        for index, (fingerprint, tensors) in sorted(self.kept_gathered.items()):
            names = self.engine.groups[index].layout.names
            now = self._signature(index)
            if now[0] != fingerprint and index in self.in_place:
                self.edited_in_place.extend(names)
            elif now != (fingerprint, tensors):
                self.edited_kept_gathered.extend(names)
            if self.holders[index] == 0:
                self._free(index)
        self.kept_gathered.clear()

    def _signature(self, index: int) -> tuple:
        """What group ``index``'s shown parameters look like: its buffer's fingerprint, and the memory each
        parameter's tensor starts at and its shape (a new ``.data`` changes them, not the buffer)."""
        params = [self.params[name] for name in self.engine.groups[index].layout.names]
        tensors = tuple((p.data_ptr(), tuple(p.shape)) for p in params)
        return fingerprints([as_array(self.buffers[index].tensor)])[0], tensors

    def _free(self, index: int) -> None:
        self.engine.release(index)  # first: MPI may still be writing into the buffer
        self._hide(index)

    def shown_buffers(self) -> list:
        """Per group, the flat float32 array its parameters are views of between steps (stages 0-2; none at 3)."""
        if self.sharded:
            return []
        if self.zero_copy:
            return [self.engine.full_params(index) for index in range(len(self.engine.groups))]
        return [as_array(buffer.tensor) for buffer in self.buffers]

    @property
    def shows_masters(self) -> bool:
        """Whether the module's tensors between steps hold the engine's masters themselves (float32 at stages 0-2:
        ``ShardPlan.master_is_params``; this rank's block of them at stages 1-2): an edit of them reaches the
        masters, which a load undoes, or an agreed writeback keeps (``edits``)."""
        return self.zero_copy and not self.sharded and self.engine.groups[0].shares_master

    def kept_copy(self) -> list:
        """Copies of the buffers the parameters show where those are the engine's own (stages 0-2, float32
        params), from which ``put_back`` undoes an edit; none where they show copies the engine never sees
        edited (stage 3's gathered buffers, bfloat16 and float16's float32 ones)."""
        return [buffer.copy() for buffer in self.shown_buffers()] if self.zero_copy and not self.sharded else []

    def put_back(self, kept: list) -> None:
        """Show the engine's parameters again, as ``kept`` (``kept_copy``) holds them: any edit is dropped,
        without a collective."""
        for buffer, values in zip(self.shown_buffers(), kept):
            buffer[...] = values
        self.refresh()

    def shown_pieces(self) -> list[tuple[bool, list[str], object]]:
        """The pieces of the shown buffers (``shown_buffers``) an edit is told apart in, group by group, each as
        (whether it holds this rank's masters, the parameters in it, the piece): where the module's tensors hold
        the masters (``shows_masters``), the owned range (all of it at stage 0, this rank's block at stages 1-2)
        and the rest; elsewhere the whole buffer."""
        return [
            (masters, names, buffer[lo:hi])
            for cuts, buffer in zip(self._cuts, self.shown_buffers())
            for masters, names, lo, hi in cuts
        ]

    @functools.cached_property
    def _cuts(self) -> list[list[tuple[bool, list[str], int, int | None]]]:
        """``shown_pieces``' cuts of each group's buffer: (holds masters, the parameters in it, start, stop)."""
        cuts = []
        for group in self.engine.groups:
            if not self.shows_masters:
                cuts.append([(False, group.layout.names, 0, None)])
                continue
            (start, stop), end = group.owned_range, group.partition.padded_numel
            ranges = [(False, 0, start), (True, start, stop), (False, stop, end)]
            cuts.append(
                [
                    (masters, [spec.name for _, spec, _, _ in group.layout.overlaps(lo, hi)], lo, hi)
                    for masters, lo, hi in ranges
                    if hi > lo
                ]
            )
        return cuts

    def full_tensors(self, index: int) -> dict[str, torch.Tensor]:
        """Group ``index``'s parameters as float32 torch tensors by name, while held (or at stages 0-2)."""
        return {name: self.params[name].data for name in self.engine.groups[index].layout.names}

    def torch_bytes(self) -> int:
        """Bytes of float32 torch buffers the engine does not count (converted copies of bf16/fp16 params)."""
        return 0 if self.zero_copy else sum(b.nbytes for b in self.buffers if b.allocated)
