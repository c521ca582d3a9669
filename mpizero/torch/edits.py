"""Parameter edits made outside the documented ways, refused at the next step on every rank, at every stage.

Between steps a sharded model's parameters change only through ``step()``,
``gathered(writeback=True)``, ``load_state_dict()`` and ``zero.load()``. Any
other edit (an in-place op under ``no_grad``, ``nn.init``, a write through
``.data`` or ``.detach()``, a new ``.data``) would be computed with at stages
0-2 and, in float32, reach this rank's masters there (the module's tensors
hold them: all of them at stage 0, this rank's block at stages 1-2), and at
stage 3 act on an empty placeholder; a
``requires_grad`` turned on or off would leave a parameter untrained, or
updated without the gradients it no longer gets. So the next ``step()`` refuses every
such edit with the same error on every rank, naming the parameters, and so
does every step after it until ``gathered()`` or a load shows the masters
again (a refused edit is still shown; gradients computed with it before
``gathered()`` dropped it are refused too). An edit that reached the masters
themselves, stages 0-2's in float32 (the module's tensors hold the masters) or
stage 3's inside a forward, only a load undoes, or, at stages 0-2, a writeback
every rank agrees on; until then, at stages 0-2, whatever reads the masters out or
shows them (``gathered()``, ``state_dict()``, ``master_params()``, ``save()``)
refuses it too. An exception that leaves ``gathered()`` on some rank drops the
block's edit there at once, at every stage, and that rank's next steps are
refused until the masters are shown again: it cannot tell the others, which
may have written theirs back.

What gives an edit away: the tensor its ``.data`` is, its ``requires_grad``,
and, where the module shows full parameters between steps (stages 0-2), a
fingerprint of their bytes, which a write through ``.data`` changes without
torch counting it, even one that only moves values: there an in-place op that
leaves every byte as it was (``p.mul_(1.0)``) is no edit. At stage 3 a
parameter between steps is an empty placeholder with no bytes to compare, so
its version counter (torch counts every in-place op on it and on its detached
aliases) tells instead; its ``.data`` shares that counter
(``params.counting_class``), so a write through ``.data``, which acts on no
element there, is counted as an in-place op is.
"""

from __future__ import annotations

import torch

from mpizero.torch.fingerprint import StepFingerprints, fingerprints

SHOWN = 5  # parameters named in a message, at most


class EditWatch:
    """What every parameter of a sharded model looks like after the bridge last set it; what changed since.

    What it refuses, and until when: ``refusal``, an edit still shown, until the masters are shown again (a
    ``record``); ``in_masters``, an edit of the masters themselves (stages 0-2 in float32), until a load or an agreed
    writeback, and no ``record`` is taken meanwhile; ``spoiled``, this step's gradients, computed with an edit
    that ``gathered()`` dropped, until the step or ``zero_grad()`` drops them. Each open ``gathered()`` block
    keeps a copy of the shown buffers as last recorded (``open_block``), which a dropped edit shows again.
    """

    def __init__(self, model: torch.nn.Module, binder, device_stats=None) -> None:
        """``binder`` shows the trainable parameters the engine owns (``params.Binder``; its ``params``);
        ``device_stats``: the engine's on a device, which the fingerprints come back with (``StepFingerprints``)."""
        self.model, self.params, self.binder = model, binder.params, binder
        pieces = len(binder.shown_pieces())
        self.step_fingerprints = None if device_stats is None or not pieces else StepFingerprints(device_stats, pieces)
        self.trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        self.seen: dict[str, tuple] = {}
        # one for each of ``Binder.shown_pieces``; None on a device, where ``step_fingerprints`` holds them
        self.fingerprints: list[tuple[int, int, int]] | None = []
        self.refusal: str | None = None
        self.in_masters: str | None = None
        self.spoiled: str | None = None
        self.checked = False  # whether this step's check ran (``problem``)
        self.blocks: list[list] = []  # each open ``gathered()`` block's copy of the shown buffers

    def record(self) -> None:
        """Take what the parameters look like now (the masters, just shown) as what they should look like until
        the bridge sets them again; nothing is refused any more, unless an edit reached the masters themselves
        (then nothing is taken: what they hold now is not the masters the other ranks hold)."""
        if self.in_masters is not None:
            self.refusal = self.in_masters
            return
        self.refusal = None
        self.seen = {name: _looks(p) for name, p in self.params.items()}
        pieces = [piece for _, _, piece in self.binder.shown_pieces()]
        if self.step_fingerprints is not None:  # read back with the next step's stats, or when first needed
            self.step_fingerprints.record(pieces)
            self.fingerprints = None
        else:
            self.fingerprints = fingerprints(pieces)
        for copy in self.blocks:  # a step or a load inside the block: what it drops an edit back to
            copy[:] = self.binder.kept_copy()

    def after_step(self) -> None:
        """``record`` after a step whose check ran and found nothing to refuse. A refused edit is still shown, so
        every later step refuses it too, until ``gathered()`` or a load shows the masters again; a step that
        raised before its check changed nothing, and leaves the record as it was. The step's gradients are gone."""
        if self.checked and self.refusal is None:
            self.record()
        self.checked, self.spoiled = False, None

    def open_block(self) -> None:
        """A ``gathered()`` block begins: keep a copy of the shown buffers (none where the engine never sees
        them edited: ``Binder.kept_copy``). Inside another block, where the module's tensors are the masters,
        the enclosing block's copy: what the inner one drops goes back to the masters as recorded, the
        enclosing block's edit with it (as publishing the masters drops it where the params are a copy of them),
        never to one rank's edit."""
        nested = self.blocks and self.binder.shows_masters
        self.blocks.append([copy.copy() for copy in self.blocks[-1]] if nested else self.binder.kept_copy())

    def close_block(self) -> list:
        """The innermost ``gathered()`` block ends: its copy (``Binder.put_back`` takes it)."""
        return self.blocks.pop()

    def loaded(self) -> None:
        """The masters were set anew (a load): an edit that had reached them is gone."""
        self.binder.edited_in_place.clear()
        self.in_masters = None

    def written_back(self) -> None:
        """Every rank wrote back the same parameters (``gathered(writeback=True)``): they are the masters now,
        an edit of the masters made before the block included."""
        self.in_masters = None

    def gradients_dropped(self) -> None:
        """This step's gradients were dropped (``zero_grad()``): none computed with an edit are left."""
        self.spoiled = None
        self.binder.edited_kept_gathered.clear()

    def spoil_gradients(self, edit: str) -> None:
        """``gathered()`` dropped ``edit`` (``unseen_edit``), which this step's backward passes computed with:
        the step refuses their gradients."""
        self.spoiled = (
            "this step's backward passes ran with an edit that `zero.gathered()` then dropped, so their gradients "
            f"are refused, and dropped with the step: run them again (the edit: {edit.removesuffix(DROP)})"
        )

    def refuse(self, why: str) -> None:
        """Refuse the next steps for ``why`` until the masters are shown again."""
        self.refusal = self.refusal or why

    def check_with_step(self) -> bool:
        """On a device, launch the step's check of the fingerprints, which comes back with the step's device stats;
        return whether it did (else ``problem`` reads them at once)."""
        if self.step_fingerprints is None or self.refusal is not None:
            return False
        self.step_fingerprints.check([piece for _, _, piece in self.binder.shown_pieces()])
        return True

    def end_check(self) -> None:
        """The step's check is over (used, or the step raised): later checks read the fingerprints anew."""
        if self.step_fingerprints is not None:
            self.step_fingerprints.checking = False

    def problem(self) -> str | None:
        """What the next step must refuse, in words (None if nothing): what changed since ``record``, and this
        step's gradients if computed with an edit of params stage 3 kept gathered (``Binder.edited_kept_gathered``)."""
        self.checked = True
        if self.binder.edited_kept_gathered:
            self.spoiled = self.spoiled or KEPT_EDIT.format(_names(sorted(set(self.binder.edited_kept_gathered))))
            self.binder.edited_kept_gathered.clear()
        if self.refusal is None:
            self.refusal = self.unseen_edit()
        return self.refusal or self.spoiled

    def masters_edited(self, changed: list[str] | None = None) -> str | None:
        """Where the module's tensors hold the masters themselves (``Binder.shows_masters``: stages 0-2 in float32),
        whether the bytes that hold this rank's masters changed since ``record``, in words (None if not, and
        elsewhere). Outside a ``gathered()`` block such an edit is kept until a load or an agreed writeback
        (``in_masters``): showing the masters again cannot drop it. Inside one, the block's end drops or writes
        back what it finds. ``changed``: the parameters whose masters' bytes changed, if already fingerprinted."""
        if self.in_masters is not None or not self.binder.shows_masters:
            return self.in_masters
        changed = self._changed()[0] if changed is None else changed
        if not changed:
            return None
        edit = (
            f"{self._which(changed)} {CHANGED}; at stages 0-2 in float32 the parameters hold the masters, so the "
            "edit reached this rank's masters (perhaps not the other ranks'), and `zero.gathered()` cannot drop it: "
            "load a checkpoint or a state dict, or, if every rank made the same edit, keep it with `with "
            "zero.gathered(writeback=True): pass`"
        )
        if not self.blocks:
            self.in_masters = edit
        return edit

    def unseen_edit(self) -> str | None:
        """What changed since ``record`` outside the ways a sharded model's parameters change, in words (None if
        nothing)."""
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
        in_masters, elsewhere = self._changed()
        in_masters = self.masters_edited(in_masters)
        if in_masters:
            return in_masters
        bytes_shown = 0 if self.binder.sharded else 1  # where fingerprints tell, the version count does not
        edited = [name for name, p in self.params.items() if _looks(p)[bytes_shown:] != self.seen[name][bytes_shown:]]
        if edited:  # the masters' bytes are as recorded: a new .data, or at stage 3 an in-place op
            return _refusal(f"parameters {_names(edited)}")
        if elsewhere:
            return _refusal(self._which(elsewhere))
        return None

    def _which(self, changed: list[str]) -> str:
        """The parameters of pieces whose bytes changed, in words: those torch counted an in-place op on, if any,
        else every one in those pieces."""
        counted = [name for name in changed if _looks(self.params[name]) != self.seen[name]]
        return f"parameters {_names(counted)}" if counted else f"one or more of the parameters {_names(changed)}"

    def _changed(self) -> tuple[list[str], list[str]]:
        """The parameters in shown pieces (``Binder.shown_pieces``) whose fingerprint changed since ``record``: in
        those holding this rank's masters, and elsewhere (each buffer read once)."""
        pieces = self.binder.shown_pieces()
        step = self.step_fingerprints
        now = step.checked_sums() if step is not None and step.checking else fingerprints([p for _, _, p in pieces])
        recorded = self.fingerprints if self.fingerprints is not None else step.recorded_sums()
        in_masters: list[str] = []
        elsewhere: list[str] = []
        for (masters, names, _), before, after in zip(pieces, recorded, now):
            if before != after:
                changed = in_masters if masters else elsewhere
                changed.extend(name for name in names if name not in changed)
        return in_masters, elsewhere


CHANGED = "changed in place since the last step, outside the ways a sharded model's parameters change"
DROP = "; `with zero.gathered(): pass` shows the masters again, dropping the edit"
KEPT_EDIT = (
    "one or more of the parameters {} changed (in place, or given a new .data) while stage 3 kept them gathered "
    "(keep_gathered=True), so this rank's later passes ran with the edit and the other ranks' without it: this "
    "step's gradients are refused, and dropped with the step (the edit went with the gathered params); edit "
    "parameters between steps inside `with zero.gathered(writeback=True):`"
)
GATHERED_RAISED = (
    "an exception left `zero.gathered()` on this rank, which dropped what the block edited without the other "
    "ranks (they may have written theirs back)" + DROP
)


def _refusal(what: str) -> str:
    return (
        f"{what} {CHANGED} (such an edit reaches some copies of the parameters and not others, differently at "
        "each stage): edit parameters inside `with zero.gathered(writeback=True):`, or load them with "
        "model.load_state_dict()" + DROP
    )


def _looks(p: torch.nn.Parameter) -> tuple:
    """The parameter's version count, the memory its ``.data`` starts at, its shape and dtype."""
    return p._version, p.data.data_ptr(), tuple(p.shape), p.dtype


def _names(names: list[str]) -> str:
    shown = ", ".join(map(repr, names[:SHOWN]))
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
