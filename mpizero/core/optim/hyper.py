"""Checks every algorithm's hyper-parameters use (under torch.optim's names), whenever they are read.

A parameter group's hyper-parameters are read again at every step (a learning-rate
schedule changes them), so the checks run there, and a bad value (a schedule that
made ``lr`` negative) names the group, the field and the value.
"""

from __future__ import annotations

import math
from dataclasses import fields


def check(name: str, value, low: float, high: float = math.inf, closed_high: bool = False) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = number and math.isfinite(value) and (low <= value < high or (closed_high and value == high))
    if not ok:
        upper = "]" if closed_high else ")"
        raise ValueError(f"{name} must be in [{low}, {high}{upper}, got {value!r}")


def flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_betas(hyper, closed_high: bool = False) -> None:
    """Check ``hyper.betas`` is a pair of numbers in [0, 1) (or [0, 1]) and store it as a tuple."""
    if not (isinstance(hyper.betas, (tuple, list)) and len(hyper.betas) == 2):
        raise ValueError(f"betas must be a pair of numbers, got {hyper.betas!r}")
    object.__setattr__(hyper, "betas", tuple(hyper.betas))
    check("betas[0]", hyper.betas[0], 0.0, 1.0, closed_high)
    check("betas[1]", hyper.betas[1], 0.0, 1.0, closed_high)


def field_names(hyper_type) -> tuple[str, ...]:
    """The hyper-parameter names of ``hyper_type``, in its order."""
    return tuple(f.name for f in fields(hyper_type))


def as_dict(hyper) -> dict:
    """The hyper-parameters by name (tuples as lists: what JSON holds)."""
    values = {name: getattr(hyper, name) for name in field_names(type(hyper))}
    return {name: list(v) if isinstance(v, tuple) else v for name, v in values.items()}
