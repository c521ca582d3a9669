"""Parameter edits made outside the documented ways, refused at the next step on every rank, at every stage.

Between steps a sharded model's parameters change only through ``step()``,
``gathered(writeback=True)``, ``load_state_dict()`` and ``zero.load()``. Any
other edit (an in-place op under ``no_grad``, ``nn.init``, a write through
``.data`` or ``.detach()``, a new ``.data``) would be computed with at stages
0-2 and reach only the piece of the masters each rank owns at stages 1-2
(none at stage 0), and at stage 3 act on an empty placeholder; a
``requires_grad`` turned on or off would leave a parameter untrained, or
updated without the gradients it no longer gets. So the next ``step()`` refuses every
such edit with the same error on every rank, naming the parameters, and so
does every step after it until ``gathered()`` or a load shows the masters
again (a refused edit is still shown). An exception that leaves ``gathered()``
on some rank drops the block's edit there at once, at every stage, and that
rank's next steps are refused until the masters are shown again: it cannot
tell the others, which may have written theirs back.

What gives an edit away: the parameter's version counter (torch counts every
in-place op on it and on its detached aliases), the tensor its ``.data`` is,
its ``requires_grad``, and, where the module shows full parameters between steps
(stages 0-2), a fingerprint of their bytes, which a write through ``.data``
changes without counting, even one that only moves values. At stage 3 a
parameter between steps is an empty placeholder whose ``.data`` shares the
parameter's version counter (``params.counting_class``), so a write through
``.data``, which acts on no element there, is counted as an in-place op is.
"""

from __future__ import annotations

import torch

from mpizero.arrays import array_module, to_host

SHOWN = 5  # parameters named in a message, at most


class EditWatch:
    """What every parameter of a sharded model looks like after the bridge last set it; what changed since."""

    def __init__(self, model: torch.nn.Module, binder) -> None:
        """``binder`` shows the trainable parameters the engine owns (``params.Binder``; its ``params``)."""
        self.model, self.params, self.binder = model, binder.params, binder
        self.trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        self.seen: dict[str, tuple] = {}
        self.fingerprints: list[tuple[int, int]] = []
        self.refusal: str | None = None  # what the next steps refuse, until the masters are shown again

    def record(self) -> None:
        """Take what the parameters look like now (the masters, just shown) as what they should look like until
        the bridge sets them again; nothing is refused any more."""
        self.refusal = None
        self.seen = {name: _looks(p) for name, p in self.params.items()}
        self.fingerprints = fingerprints(self.binder.shown_buffers())

    def record_unless_refused(self) -> None:
        """``record`` after a step, unless that step refused an edit: the edit is still shown, so every later
        step refuses it too, until ``gathered()`` or a load shows the masters again."""
        if self.refusal is None:
            self.record()

    def refuse(self, why: str) -> None:
        """Refuse the next steps for ``why`` until the masters are shown again."""
        self.refusal = self.refusal or why

    def problem(self) -> str | None:
        """What the next step must refuse, in words (None if nothing): what changed since ``record``."""
        if self.refusal is None:
            self.refusal = self._changes()
        return self.refusal

    def _changes(self) -> str | None:
        if self.binder.edited_in_place:
            return (
                f"parameters {_names(sorted(set(self.binder.edited_in_place)))} were edited in place during a "
                "forward or backward at stage 3, where every rank reads the same node-shared parameters: the edit "
                "reached every rank's masters, unagreed; load a checkpoint or a state dict to go on (edit "
                "parameters inside `with zero.gathered(writeback=True):`)"
            )
        flipped = sorted(
            name for name, p in self.model.named_parameters() if p.requires_grad != (name in self.trainable)
        )
        if flipped:
            return (
                f"requires_grad of {_names(flipped)} changed after shard(): set requires_grad before shard() "
                "(a sharded model's trainable parameters are fixed when it is sharded)"
            )
        edited = [name for name, p in self.params.items() if _looks(p) != self.seen[name]]
        if edited:
            return _refusal(f"parameters {_names(edited)}")
        now = fingerprints(self.binder.shown_buffers())
        changed = [
            n for names, old, new in zip(self.binder.group_names(), self.fingerprints, now) if old != new for n in names
        ]
        if changed:
            return _refusal(f"one or more of the parameters {_names(changed)}")
        return None


DROP = "; `with zero.gathered(): pass` shows the masters again, dropping the edit"
GATHERED_RAISED = (
    "an exception left `zero.gathered()` on this rank, which dropped what the block edited without the other "
    "ranks (they may have written theirs back)" + DROP
)


def _refusal(what: str) -> str:
    return (
        f"{what} changed in place since the last step, outside the ways a sharded model's parameters change (such "
        "an edit reaches some copies of the parameters and not others, differently at each stage): edit "
        "parameters inside `with zero.gathered(writeback=True):`, or load them with model.load_state_dict()" + DROP
    )


def _looks(p: torch.nn.Parameter) -> tuple:
    """The parameter's version count, the memory its ``.data`` starts at, its shape and dtype."""
    return p._version, p.data.data_ptr(), tuple(p.shape), p.dtype


def _names(names: list[str]) -> str:
    shown = ", ".join(map(repr, names[:SHOWN]))
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


COLUMNS = 4093  # words per row of a fingerprint: a prime, so that no tensor's rows line up with its rows


def fingerprints(buffers: list) -> list[tuple[int, int]]:
    """Each flat float32 buffer's fingerprint: its 8-byte words summed, and summed weighted by their column in
    rows of ``COLUMNS`` (modulo 2**64), so that a write that only moves values (a weight transposed or its rows
    permuted through ``.data``) changes it as a write of other values does. One read of each buffer, on its
    device; one transfer back."""
    if not buffers:
        return []
    xp = array_module(buffers[0])
    weights = xp.arange(1, COLUMNS + 1, dtype=xp.uint64)
    sums = []
    for buffer in buffers:
        words = buffer.reshape(-1).view(xp.uint32)
        pairs = words[: words.size & ~1].view(xp.uint64)
        rows = pairs.size - pairs.size % COLUMNS
        columns = pairs[:rows].reshape(-1, COLUMNS).sum(axis=0, dtype=xp.uint64) if rows else xp.zeros_like(weights)
        columns[: pairs.size - rows] += pairs[rows:]
        odd = words[pairs.size * 2 :].astype(xp.uint64)  # the last float32 of an odd count, alone
        sums += [columns.sum(dtype=xp.uint64) + odd.sum(dtype=xp.uint64), (columns * weights).sum(dtype=xp.uint64)]
    flat = to_host(xp.stack(sums)).tolist()
    return list(zip(flat[::2], flat[1::2]))
