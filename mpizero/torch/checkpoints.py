"""``zero.save`` and ``zero.load``: the engine's sharded checkpoint, plus what the torch side owns.

Besides the engine's state (fp32 masters, optimizer state, step counters, the
scales' history), a checkpoint holds the model's buffers and frozen parameters
(the same on every rank after each step; written once, ``replicated``), the
hyper-parameters of a ``torch.optim`` optimizer's groups as a scheduler left
them, and a learning-rate scheduler's ``state_dict()`` when one is given:
loading restores all of them (the saved values win, as
``optimizer.load_state_dict`` does), so a resumed run continues its schedule.
A run's identity is fixed when ``shard`` makes it and adopted from the
checkpoint a run continues, so a schedule that changes the learning rate every
step still saves into its own directory.
"""

from __future__ import annotations

import json

import torch

from mpizero.checkpoint import catalog, compat, store
from mpizero.comm import agree
from mpizero.core.optim.hyper import field_names
from mpizero.torch.optim_bridge import is_torch_optimizer
from mpizero.torch.tensors import from_host, host_copy, host_dtype


def run_identity(engine) -> str:
    """The identity of a run made now: its optimizer as built, and its tensors."""
    return compat.run_identity(compat.engine_settings(engine, {}))


def save(zero, directory: str, data: dict | None, keep: int | None, scheduler) -> str:
    """Write ``zero``'s checkpoint into ``directory`` (collective); return its path."""
    engine = zero.engine
    training = {
        "data": dict(data or {}),
        "step": engine.step_count + engine.skipped_steps,
        "optimizer_steps": engine.step_count,
        "skipped_steps": engine.skipped_steps,
        "run": zero.run,
        "optimizer_groups": _groups(zero.optimizer) if is_torch_optimizer(zero.optimizer) else None,
        "scheduler": None if scheduler is None else scheduler.state_dict(),
    }
    agree.raise_if_any(engine.collectives, _json_problem(training), "save")
    held = {name: host_copy(t) for name, t in whole_tensors(zero.model).items()}
    return store.save(engine, directory, training, keep, arrays=held)


def load(zero, path: str, overrides, scheduler) -> dict:
    """Restore ``zero`` from a checkpoint, or the newest under a directory (collective); return its training state."""
    engine = zero.engine
    path, _ = catalog.resolve_agreed(engine.collectives, path)
    restored = is_torch_optimizer(zero.optimizer)
    if restored:  # the saved hyper-parameters are set on the optimizer, so none of them is refused
        overrides = field_names(engine.bound.rule.hyper_type)
    loaded = store.load(engine, path, overrides, _api_override)
    training, tensors = loaded.training, whole_tensors(zero.model)
    problem = _arrays_problem(loaded.arrays, tensors, path)
    if scheduler is not None and training.get("scheduler") is None:
        problem = problem or f"{path} holds no scheduler state: it was saved without zero.save(..., scheduler=)"
    agree.raise_if_any(engine.collectives, problem, "load")
    with torch.no_grad():
        for name, tensor in tensors.items():
            tensor.copy_(from_host(loaded.arrays[name]))
    engine.step_count, engine.skipped_steps = training["optimizer_steps"], training["skipped_steps"]
    if restored and training.get("optimizer_groups") is not None:
        _restore_groups(zero.optimizer, training["optimizer_groups"])
    if scheduler is not None:
        scheduler.load_state_dict(training["scheduler"])
    zero.run = training["run"]
    zero.edits.loaded()
    zero.show_masters()
    return training


def whole_tensors(model) -> dict:
    """The tensors every rank holds whole, by checkpoint name: buffers and frozen parameters."""
    held = {f"buffer:{name}": b for name, b in model.named_buffers()}
    return held | {f"frozen:{name}": p for name, p in model.named_parameters() if not p.requires_grad}


def _arrays_problem(saved: dict, tensors: dict, path: str) -> str | None:
    """Why the checkpoint's buffers and frozen parameters do not fit this model (None when they do)."""
    if sorted(saved) != sorted(tensors):
        missing, extra = sorted(set(tensors) - set(saved))[:3], sorted(set(saved) - set(tensors))[:3]
        return f"{path}: other buffers or frozen parameters than the model's (missing {missing}, unknown {extra})"
    for name, tensor in tensors.items():
        found, wanted = saved[name], (host_dtype(tensor.dtype), list(tensor.shape))
        if (found.dtype, list(found.shape)) != wanted:
            return f"{path}: {name} is {found.dtype}{list(found.shape)}, the model's is {wanted[0]}{wanted[1]}"
    return None


def _groups(optimizer) -> list[dict]:
    """Each parameter group's values but its parameters, as JSON holds them (tensors as numbers)."""
    plain = lambda v: v.item() if hasattr(v, "item") else list(map(plain, v)) if isinstance(v, tuple) else v  # noqa: E731
    return [{k: plain(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _restore_groups(optimizer, saved: list[dict]) -> None:
    """Set each group's saved values on the optimizer (tuples stay tuples, as torch builds them)."""
    for group, values in zip(optimizer.param_groups, saved):
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in values.items()})


def _json_problem(training: dict) -> str | None:
    """Which part of the training state a checkpoint cannot hold (it must be JSON), or None."""
    for field in ("optimizer_groups", "scheduler", "data"):
        try:
            json.dumps(training[field], allow_nan=False)
        except (TypeError, ValueError) as error:
            return f"{field} cannot be stored in a checkpoint (JSON): {error}"
    return None


def _api_override(name: str) -> str:
    """How a torch-API user lets a recorded hyper-parameter of mpizero's own optimizers differ on load."""
    return f"pass zero.load(path, overrides=[{name!r}])"
