"""Whether a checkpoint means the same run: same model, same optimizer and hyper-parameters, same settings.

The optimizer is recorded as its type name and its dataclass fields
(``{"type": "AdamW", "hyper": {"lr": 0.003, ...}}``); a run's other settings
that change its numbers (``train``: precision, clip norm, batch, seed, ...) as
``training.settings``. On resume any difference is refused, naming the field
and both values; a name the caller lists in ``overrides``
(``train --resume-override lr``) may differ, and the run's value is used. The
type is never overridden: another optimizer is refused.

A run's identity (``run_identity``) is a digest of those settings, taken when
the run starts and kept by every resumed continuation of it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection

from mpizero.errors import CheckpointError


def optimizer_record(engine) -> dict:
    """The optimizer's type name and each parameter group's tensors and hyper-parameters, as JSON stores them."""
    return json.loads(json.dumps(engine.bound.record()))


def tensor_list(engine) -> list[dict]:
    """Every tensor's name and shape, in the model's order."""
    return [{"name": name, "shape": list(shape)} for name, shape in engine.tensor_shapes().items()]


def state_names(engine) -> list[str]:
    """The states a checkpoint holds per tensor: the fp32 master weights, then each optimizer state."""
    return ["master", *engine.bound.state_names]


def cli_override(name: str) -> str:
    """How a command-line user changes a recorded setting on resume."""
    return f"pass --resume-override {name.replace('_', '-')}"


CLI_OVERRIDE = cli_override


def check(engine, manifest: dict, where: str, overrides: Collection[str] = (), how=CLI_OVERRIDE) -> None:
    """Raise CheckpointError (naming ``where`` and the field) unless ``manifest`` fits ``engine``'s run;
    ``how(name)`` says how the caller's user lets a setting named in ``overrides`` differ."""
    _check_model(tensor_list(engine), manifest["tensors"], where)
    check_optimizer(manifest["optimizer"], optimizer_record(engine), where, overrides, how)
    if manifest["states"] != state_names(engine):
        raise CheckpointError(
            f"{where}: field states: checkpoint {manifest['states']}, "
            f"this run {state_names(engine)} (another optimizer)"
        )


def run_identity(settings: dict) -> str:
    """The identity of a run with these settings: 16 hex digits of the sha256 of their canonical JSON."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def engine_settings(engine, training_state: dict) -> dict:
    """The settings a run's numbers depend on, as far as the engine and the caller's training state tell."""
    return {
        "optimizer": optimizer_record(engine),
        "tensors": tensor_list(engine),
        "data": training_state.get("data"),
    }


def check_settings(saved: dict, mine: dict, where: str, overrides: Collection[str] = ()) -> None:
    """Refuse any setting in ``mine`` that differs from the checkpoint's ``saved`` unless ``overrides`` names it."""
    for name in sorted(mine):
        if saved.get(name) != mine[name] and name not in overrides:
            flag = name.replace("_", "-")
            raise CheckpointError(
                f"{where}: field training.settings.{name}: checkpoint {saved.get(name)!r}, this run --{flag} "
                f"{mine[name]!r} (a resumed run must be the same run; to change it, pass --resume-override {flag})"
            )


def check_optimizer(saved: dict, mine: dict, where: str, overrides: Collection[str] = (), how=CLI_OVERRIDE) -> None:
    """Refuse another optimizer type or other parameter groups, and any hyper-parameter that differs unless
    ``overrides`` names it (``how(name)`` says how to name it)."""
    if saved["type"] != mine["type"]:
        raise CheckpointError(
            f"{where}: field optimizer.type: checkpoint {saved['type']}, this run {mine['type']} "
            "(another optimizer is refused)"
        )
    theirs_groups, our_groups = saved["groups"], mine["groups"]
    if [g["params"] for g in theirs_groups] != [g["params"] for g in our_groups]:
        sizes = [len(g["params"]) for g in theirs_groups], [len(g["params"]) for g in our_groups]
        raise CheckpointError(
            f"{where}: field optimizer.groups: the checkpoint's parameter groups hold other tensors "
            f"(tensors per group: checkpoint {sizes[0]}, this run {sizes[1]})"
        )
    for index, (theirs, ours) in enumerate(zip(theirs_groups, our_groups)):
        for name in sorted(set(theirs["hyper"]) | set(ours["hyper"])):
            old, new = theirs["hyper"].get(name), ours["hyper"].get(name)
            if old != new and name not in overrides:
                raise CheckpointError(
                    f"{where}: field optimizer.groups[{index}].hyper.{name}: checkpoint {old!r}, this run {new!r} "
                    f"(to change it on resume, {how(name)})"
                )


def _check_model(mine: list[dict], theirs: list[dict], where: str) -> None:
    saved = {t["name"]: t["shape"] for t in theirs}
    ours = {t["name"]: t["shape"] for t in mine}
    differ = sorted(n for n in set(saved) | set(ours) if saved.get(n) != ours.get(n))[:3]
    if differ:
        shown = ", ".join(f"{n}: checkpoint {saved.get(n)} vs model {ours.get(n)}" for n in differ)
        raise CheckpointError(f"{where}: field tensors: saved from another model ({shown})")
