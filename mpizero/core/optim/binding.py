"""An optimizer bound to an engine's tensors: each tensor's parameter group, and each step's hyper-parameters.

Glossary:

- parameter group: one entry of the optimizer's ``param_groups`` (a dict with
  ``"params"`` and hyper-parameters), as in torch.optim. Every tensor of the
  engine is in exactly one (a group whose ``"params"`` is None takes every
  tensor no other group lists).
- snapshot: the hyper-parameters of every group read at one step, checked
  (``hyper``): what that step's update uses, and what ranks agree on.
- structure: which tensors each group holds, and which states (momentum
  buffer, AMSGrad's maximum) each group keeps; fixed when the engine is made.

Any optimizer with ``rule`` and ``param_groups`` binds: the engine's own
(``optimizers``) and ``mpizero.torch``'s view of a ``torch.optim`` optimizer.
"""

from __future__ import annotations

import hashlib

from mpizero.core.optim.hyper import as_dict, field_names

DIGEST_BITS = 52  # a digest exact in a float64, so ranks can agree on it in a max-reduction


class BoundOptimizer:
    """Which group each tensor is in, the states each group keeps, and the hyper-parameters read at each step."""

    def __init__(self, optimizer, shapes: dict) -> None:
        """``shapes``: each tensor's shape by its name, in the engine's order."""
        self.optimizer, self.rule, self.names = optimizer, optimizer.rule, list(shapes)
        self.members = self._members(optimizer.param_groups)
        self.group_of = {name: g for g, members in enumerate(self.members) for name in members}
        first = self.read()
        self._check_whole(first, shapes)
        self.group_states = [h.state_names for h in first]
        self.state_names = tuple(dict.fromkeys(s for states in self.group_states for s in states))
        self.initial = first

    @property
    def type_name(self) -> str:
        """The optimizer's class name, as a checkpoint records it (``AdamW``, ``SGD``, ...)."""
        return getattr(self.optimizer, "type_name", type(self.optimizer).__name__)

    def _members(self, groups) -> list[tuple[str, ...]]:
        """Each group's tensor names; every tensor in exactly one group (raise ValueError naming what is not)."""
        listed = [g["params"] for g in groups]
        if not listed:
            raise ValueError("the optimizer has no parameter groups")
        named = [n for members in listed if members is not None for n in members]
        unknown = sorted(set(named) - set(self.names))
        twice = sorted({n for n in named if named.count(n) > 1})
        if unknown or twice:
            raise ValueError(f"parameter groups name unknown tensors {unknown[:3]} or name tensors twice {twice[:3]}")
        if sum(members is None for members in listed) > 1:
            raise ValueError("only one parameter group may take every remaining tensor (params=None)")
        rest = tuple(n for n in self.names if n not in set(named))
        members = [rest if m is None else tuple(m) for m in listed]
        missing = [n for n in self.names if n not in {x for m in members for x in m}]
        if missing:
            raise ValueError(f"tensors {missing[:5]} are in no parameter group of the optimizer")
        return members

    def _check_whole(self, hyper: tuple, shapes: dict) -> None:
        """Raise ValueError naming a tensor of a whole-matrix group (Muon's) that is not a 2-D matrix."""
        for g, (h, members) in enumerate(zip(hyper, self.members)):
            flat = [n for n in members if self.rule.whole(h) and len(shapes[n]) != 2]
            if flat:
                raise ValueError(
                    f"parameter group {g}: {self.rule.name} orthogonalises 2-D matrices; {flat[0]!r} has shape "
                    f"{list(shapes[flat[0]])}: put it in a parameter group with use_muon=False"
                )

    def read(self) -> tuple:
        """Every group's hyper-parameters now, checked: a ValueError names the group and the field."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self.members):
            raise ValueError(
                f"the optimizer has {len(groups)} parameter groups; it had {len(self.members)} when the engine was "
                "made (a group added after it is not trained: give the optimizer every group before)"
            )
        return tuple(self._hyper(g, group) for g, group in enumerate(groups))

    def _hyper(self, g: int, group) -> object:
        known = field_names(self.rule.hyper_type)
        if group.get("differentiable"):
            raise ValueError(
                f"parameter group {g}: differentiable=True is not supported (updates run outside autograd)"
            )
        try:
            return self.rule.hyper_type(**{k: _number(group[k]) for k in known if k in group})
        except (ValueError, TypeError) as error:
            raise ValueError(f"parameter group {g}: {error}") from None

    def snapshot(self) -> tuple:
        """This step's hyper-parameters: ``read``, plus checks that the structure fixed at set-up is unchanged."""
        hyper = self.read()
        for g, (h, group) in enumerate(zip(hyper, self.optimizer.param_groups)):
            if group["params"] is not None and tuple(group["params"]) != self.members[g]:
                raise ValueError(f"parameter group {g} changed its parameters after the engine was made")
            if h.state_names != self.group_states[g]:
                raise ValueError(
                    f"parameter group {g} now needs states {list(h.state_names)}, it had {list(self.group_states[g])} "
                    "(momentum turned on or off, or amsgrad changed, after the engine was made)"
                )
        return hyper

    def record(self, hyper: tuple | None = None) -> dict:
        """The optimizer as a checkpoint records it: type, and each group's tensors and hyper-parameters."""
        hyper = self.initial if hyper is None else hyper
        groups = [{"params": list(m), "hyper": as_dict(h)} for m, h in zip(self.members, hyper)]
        return {"type": self.type_name, "groups": groups}

    def describe(self) -> str:
        """One line for the set-up signature: type, group sizes and initial hyper-parameters."""
        return repr(self.record())


def digest(hyper: tuple) -> int:
    """A ``DIGEST_BITS``-bit digest of a snapshot: equal on two ranks exactly when their snapshots are."""
    text = repr([as_dict(h) for h in hyper]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> (64 - DIGEST_BITS)


def _number(value):
    """A hyper-parameter as a plain Python value (a torch or NumPy scalar, or a pair of them, as numbers)."""
    if isinstance(value, (tuple, list)):
        return tuple(_number(v) for v in value)
    return value.item() if hasattr(value, "item") and not isinstance(value, (bool, int, float)) else value
