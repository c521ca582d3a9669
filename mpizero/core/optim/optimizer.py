"""What every optimizer of the engine is: an algorithm (``rule``), its defaults and parameter groups, as torch.optim's.

``params`` is None (one group of every tensor), a list of tensor names (one
group), or a list of dicts, each with ``"params"`` (tensor names) and any
hyper-parameters that differ from the defaults, as in
``torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-4)``.
``param_groups`` stays a list of plain dicts the caller may change between
steps (a learning-rate schedule): the engine reads it at every step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from mpizero.core.optim.hyper import as_dict


class Optimizer:
    """An algorithm (``rule``), its defaults, and parameter groups of tensor names."""

    rule = None  # the update formula and its hyper-parameters' type (``sgd.SGDRule``, ...)
    fixed: dict = {}  # hyper-parameters this class sets (AdamW: decoupled weight decay)
    documented = None  # torch's documented algorithm in float64, for verify's semantics check (``oracle``)
    torch_classes: tuple[str, ...] = ()  # the torch optimizers it stands for, by qualified name (the torch bridge)
    torch_counts_steps = False  # whether torch's state dict keeps a ``step`` per parameter
    verify_settings: dict = {}  # the hyper-parameters ``verify --optimizer`` trains with

    @classmethod
    def for_shapes(cls, shapes: dict, **defaults) -> Optimizer:
        """The optimizer with ``defaults`` for tensors of these ``shapes`` (by name), grouped as its recipes group
        them (one group here; Muon's splits off what is not a matrix): what ``verify`` and ``train`` build."""
        return cls(**defaults)

    @classmethod
    def states_per_element(cls) -> int:
        """The float32 states the engine keeps per element for this optimizer with its defaults, grouped as
        ``for_shapes`` groups a model of matrices and other tensors (each state spans every owned element)."""
        return len(cls.for_shapes({"matrix": (2, 2), "vector": (2,)}).state_names)

    @staticmethod
    def torch_refusal(torch_optimizer) -> str | None:
        """What a torch optimizer of a class in ``torch_classes`` sets outside its parameter groups that the engine
        cannot honour (None: nothing), so the bridge refuses it rather than ignore it."""
        return None

    def __init__(self, params: Iterable | None = None, **defaults) -> None:
        unknown = sorted(set(defaults) - set(self.hyper_names()))
        if unknown:
            raise ValueError(f"{type(self).__name__} has no hyper-parameter {unknown}; it takes {self.hyper_names()}")
        self.defaults = as_dict(self.rule.hyper_type(**{**self.fixed, **defaults}))
        self.param_groups = [self._group(g) for g in _groups(params)]

    @classmethod
    def hyper_names(cls) -> list[str]:
        """The hyper-parameters this optimizer takes (torch.optim's names)."""
        return [name for name in as_dict(cls.rule.hyper_type()) if name not in cls.fixed]

    @property
    def state_names(self) -> tuple[str, ...]:
        """The states kept per element by any group (momentum buffer, Adam's moments, AMSGrad's maximum)."""
        hypers = [self.rule.hyper_type(**{k: v for k, v in g.items() if k != "params"}) for g in self.param_groups]
        return tuple(dict.fromkeys(name for h in hypers for name in h.state_names))

    def _group(self, group: dict) -> dict:
        merged = {**self.defaults, **group}
        self.rule.hyper_type(**{k: v for k, v in merged.items() if k != "params"})  # check it now, as torch does
        return merged

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.defaults.items() if k not in self.fixed)
        return f"{type(self).__name__}({shown}, groups={len(self.param_groups)})"


def _groups(params) -> list[dict]:
    """``params`` as a list of group dicts, each with its ``"params"`` list of names (None: every tensor)."""
    if params is None:
        return [{"params": None}]
    if isinstance(params, (str, Mapping)) or not isinstance(params, Iterable):
        raise TypeError(f"params must be tensor names or a list of parameter groups (dicts), got {params!r}")
    listed = list(params)
    if listed and all(isinstance(g, Mapping) for g in listed):
        for g in listed:
            if "params" not in g:
                raise ValueError(f"a parameter group needs a 'params' list, got keys {sorted(g)}")
        return [{**g, "params": None if g["params"] is None else _names(g["params"])} for g in listed]
    return [{"params": _names(listed)}]


def _names(params) -> list[str]:
    names = [params] if isinstance(params, str) else list(params)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"the engine's parameter groups list tensor names, got {names[:3]!r}")
    return names
