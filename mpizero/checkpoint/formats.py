"""Manifests of the previous format read as the current one, so that a run resumes across an upgrade.

Format 5 (``mpizero-checkpoint-5``) differs from 6 in the manifest only; its rank files are laid out alike. Read
as format 6:

- ``optimizer``: 5 held one ``hyper`` for every tensor; 6 holds parameter groups, so it becomes one group of
  every tensor, in the manifest's order, its hyper-parameters completed with the optimizer's defaults for the
  fields 5 did not record (``amsgrad``, ``maximize``, ...: 5's optimizers had none of them).
- ``scales``: 5 kept each tensor's last scale exponent, 6 the last step's agreed maximum and count, which the
  exponent does not give back; each is read as no history, so the first step after the resume predicts no
  scale, as a run's first step does. That changes no byte: a prediction decides only whether the step holds
  or redoes its gradients.
- ``replicated``: none (5 saved no arrays once).

A format-5 manifest's checksum and signature are checked as written, before it is read as format 6.
"""

from __future__ import annotations

from mpizero.checkpoint.structure import Invalid
from mpizero.core.optim import OPTIMIZERS
from mpizero.core.optim.hyper import as_dict

CURRENT = "mpizero-checkpoint-6"
PREVIOUS = "mpizero-checkpoint-5"
READ = (PREVIOUS, CURRENT)


def as_current(manifest: dict) -> dict:
    """``manifest`` (sealed, of a format in ``READ``) as a format-6 one; raise ``Invalid`` naming the field."""
    if manifest["format"] == CURRENT:
        return manifest
    return {
        **manifest,
        "format": CURRENT,
        "optimizer": _optimizer(manifest.get("optimizer"), manifest.get("tensors")),
        "scales": {name: None for name in (manifest.get("scales") or {})},
        "replicated": [],
    }


def _optimizer(saved, tensors) -> dict:
    """Format 5's ``{"type", "hyper"}`` as format 6's ``{"type", "groups"}``: one group of every tensor."""
    if not isinstance(saved, dict) or sorted(saved) != ["hyper", "type"] or not isinstance(saved["hyper"], dict):
        raise Invalid("optimizer", f"a format-5 optimizer is {{type, hyper}}, got {str(saved)[:80]}")
    kind = next((o for o in OPTIMIZERS.values() if o.__name__ == saved["type"]), None)
    if kind is None:
        raise Invalid("optimizer.type", f"{saved['type']!r:.40} is none of {[o.__name__ for o in OPTIMIZERS.values()]}")
    defaults = kind().defaults
    try:
        hyper = as_dict(kind.rule.hyper_type(**{**defaults, **saved["hyper"]}))
    except (TypeError, ValueError) as error:
        raise Invalid("optimizer.hyper", str(error)[:200]) from None
    if not isinstance(tensors, list) or not all(isinstance(t, dict) and "name" in t for t in tensors):
        raise Invalid("tensors", "must be a list of tensors with names")
    return {"type": saved["type"], "groups": [{"params": [t["name"] for t in tensors], "hyper": hyper}]}
