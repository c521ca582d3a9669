"""Whether a checkpoint means the same run: same model, same optimizer and hyper-parameters.

The optimizer is recorded as its type name and its dataclass fields
(``{"type": "AdamW", "hyper": {"lr": 0.003, ...}}``). On resume any difference
is refused, naming the field and both values; a hyper-parameter the caller
names in ``overrides`` (``train --resume-override lr``) may differ, and the
run's value is used. The type is never overridden: another optimizer is refused.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection

from mpizero.checkpoint.manifest import CheckpointError


def optimizer_record(optimizer) -> dict:
    """The optimizer's type name and hyper-parameters, as JSON stores them (tuples become lists)."""
    hyper = {f.name: getattr(optimizer, f.name) for f in dataclasses.fields(optimizer)}
    return json.loads(json.dumps({"type": type(optimizer).__name__, "hyper": hyper}))


def tensor_list(engine) -> list[dict]:
    """Every tensor's name and shape, in the model's order."""
    return [{"name": name, "shape": list(shape)} for name, shape in engine.tensor_shapes().items()]


def state_names(engine) -> list[str]:
    """The states a checkpoint holds per tensor: the fp32 master weights, then each optimizer state."""
    return ["master", *engine.optimizer.state_names]


def check(engine, manifest: dict, where: str, overrides: Collection[str] = ()) -> None:
    """Raise CheckpointError (naming ``where`` and the field) unless ``manifest`` fits ``engine``'s run."""
    _check_model(tensor_list(engine), manifest["tensors"], where)
    check_optimizer(manifest["optimizer"], optimizer_record(engine.optimizer), where, overrides)
    if manifest["states"] != state_names(engine):
        raise CheckpointError(
            f"{where}: field states: checkpoint {manifest['states']}, "
            f"this run {state_names(engine)} (another optimizer)"
        )


def check_optimizer(saved: dict, mine: dict, where: str, overrides: Collection[str] = ()) -> None:
    """Refuse another optimizer type, and any hyper-parameter that differs unless ``overrides`` names it."""
    unknown = sorted(set(overrides) - set(mine["hyper"]))
    if unknown:
        raise CheckpointError(
            f"--resume-override names {unknown}, not hyper-parameters of {mine['type']} ({sorted(mine['hyper'])})"
        )
    if saved["type"] != mine["type"]:
        raise CheckpointError(
            f"{where}: field optimizer.type: checkpoint {saved['type']}, this run {mine['type']} "
            "(another optimizer is refused)"
        )
    for name in sorted(set(saved["hyper"]) | set(mine["hyper"])):
        theirs, ours = saved["hyper"].get(name), mine["hyper"].get(name)
        if theirs != ours and name not in overrides:
            raise CheckpointError(
                f"{where}: field optimizer.hyper.{name}: checkpoint {theirs!r}, this run {ours!r} "
                f"(to change it on resume, pass --resume-override {name})"
            )


def _check_model(mine: list[dict], theirs: list[dict], where: str) -> None:
    saved = {t["name"]: t["shape"] for t in theirs}
    ours = {t["name"]: t["shape"] for t in mine}
    differ = sorted(n for n in set(saved) | set(ours) if saved.get(n) != ours.get(n))[:3]
    if differ:
        shown = ", ".join(f"{n}: checkpoint {saved.get(n)} vs model {ours.get(n)}" for n in differ)
        raise CheckpointError(f"{where}: field tensors: saved from another model ({shown})")
