"""Which submodules form units, and which parameters each unit owns and needs.

Glossary:

- unit: a module whose parameters are gathered together just before its
  forward (and again for its backward) and freed after, at stage 3; one engine
  group per unit that owns parameters.
- owned parameters: those whose canonical name (the first name
  ``named_parameters`` gives a tied or shared parameter) lies in the unit and in
  no unit nested in it. Every trainable parameter is owned by exactly one unit.
- needed parameters: every trainable parameter the unit's own modules hold
  (nested units excluded), owned here or elsewhere (a tied weight): what must be
  gathered before the unit runs.
The model itself is the outermost unit when it holds parameters no other unit holds.
By default (``default_units``) the units are the model's repeated blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


@dataclass(frozen=True)
class Unit:
    """One unit: its module, qualified name, owned and needed parameter names (canonical)."""

    module: torch.nn.Module
    name: str
    owned: tuple[str, ...]
    needed: tuple[str, ...]


def default_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (``blocks``); for a model with none, each child holding parameters."""
    return list(blocks(model)) or [child for child in model.children() if _holds_parameters(child)]


def blocks(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Each child holding parameters of the outermost ``ModuleList``, ``ModuleDict`` and ``Sequential`` of
    repeated blocks under ``module``, as FSDP's transformer wrap policies wrap each layer: a block's own lists
    stay in it, since a block is gathered whole for its forward anyway."""
    for child in module.children():
        if isinstance(child, CONTAINERS) or _repeats(child):
            yield from _members(child)
        else:
            yield from blocks(child)


def _members(container: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """A container's children holding parameters, looking inside the containers among them (nanoGPT's
    ``ModuleDict(wte=..., h=ModuleList([...]), ln_f=...)``: a ``ModuleList`` has no forward to hook)."""
    for child in container.children():
        if isinstance(child, CONTAINERS):
            yield from _members(child)
        elif _holds_parameters(child):
            yield child


def _repeats(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a ``Sequential`` whose children holding parameters are two or more of one class."""
    if not isinstance(module, torch.nn.Sequential):
        return False
    kinds = [type(child) for child in module.children() if _holds_parameters(child)]
    return len(kinds) >= 2 and len(set(kinds)) == 1


def _holds_parameters(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def lopsided(units: Sequence[Unit], params: dict[str, torch.nn.Parameter]) -> str | None:
    """A warning if one unit owns more than half of the trainable elements (stage 3 then gathers most of the
    model at once), else None."""
    total = sum(p.numel() for p in params.values())
    for unit in units:
        owned = sum(params[name].numel() for name in unit.owned)
        if 2 * owned > total:
            return (
                f"stage 3 gathers each unit whole for its forward, and unit {unit.name!r} "
                f"({type(unit.module).__name__}) holds {owned} of the {total} parameters ({owned / total:.0%}), so "
                "little of the model stays sharded then: pass units= with smaller submodules (its repeated blocks, "
                "say)"
            )
    return None


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The trainable parameters by canonical name, in the model's order (tied ones once)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def plan_units(model: torch.nn.Module, modules: Sequence[torch.nn.Module]) -> list[Unit]:
    """The model (if it holds parameters no unit holds) and ``modules`` as units, in the model's order."""
    qualified = {id(m): name for name, m in model.named_modules()}
    unknown = [type(m).__name__ for m in modules if id(m) not in qualified]
    if unknown:
        raise ValueError(f"units must be submodules of the model, got {unknown}")
    canonical = {id(p): name for name, p in trainable(model).items()}
    chosen = {id(m) for m in modules}
    units = []
    for module in [model, *sorted(modules, key=lambda m: list(qualified).index(id(m)))]:
        prefix = f"{qualified[id(module)]}." if module is not model else ""
        held = [(name, p) for name, p in _own_params(module, prefix, chosen - {id(module)}) if id(p) in canonical]
        owned = tuple(name for name, p in held if canonical[id(p)] == name)
        needed = tuple(dict.fromkeys(canonical[id(p)] for _, p in held))
        if needed or module is not model:
            units.append(Unit(module, qualified[id(module)] or "<model>", owned, needed))
    return units


def _own_params(module: torch.nn.Module, prefix: str, stop: set[int]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Parameters under ``module`` by qualified name, not descending into modules in ``stop``."""
    for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
        yield prefix + name, p
    for name, child in module.named_children():
        if id(child) not in stop:
            yield from _own_params(child, f"{prefix}{name}.", stop)
