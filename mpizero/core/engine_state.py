"""The engine's training state read and written by tensor piece (checkpoints), and its reports: bytes held, the
master parameters and their digest (``ZeroEngine``'s part that checkpoints, checks and the command line call)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mpizero.core import build
from mpizero.core.group import StatePiece
from mpizero.core.memory import KINDS, peak_rss_bytes


class StateAccess:
    """``ZeroEngine``'s state by tensor piece and its reports (a part of the engine: it uses its groups,
    collectives, scales and memory log)."""

    def scale_state(self) -> dict[str, list | None]:
        """Each tensor's history (the last step's agreed maximum and count), from which the next step's scale is
        predicted (for checkpoints)."""
        return {name: self.scales.saved(name) for name in self.names}

    def restore_scale_state(self, state: Mapping[str, list | None]) -> None:
        """Continue predicting scales from a saved ``scale_state()``."""
        self.scales.restore({name: state.get(name) for name in self.names})

    @property
    def redone_steps(self) -> int:
        """Steps that ran twice because their scale prediction missed (``scales``)."""
        return self.scales.redone_steps

    # Training state by tensor piece (checkpoints) -------------------------

    def shard_pieces(self) -> list[StatePiece]:
        """This rank's shard of the training state, padding stripped: each element is in exactly one rank's pieces."""
        return [piece for g in self.groups for piece in g.state_pieces(*g.plan.shard_range)]

    def owned_pieces(self) -> list[StatePiece]:
        """All training state this rank updates (everything at stage 0): what a load must fill."""
        return [piece for g in self.groups for piece in g.state_pieces(*g.plan.owned_range)]

    def states_problem(self) -> str | None:
        """Why the states this rank read may be wrong (an offload file deleted or cut since it was made), or None."""
        return next((problem for g in self.groups if (problem := g.place.problem())), None)

    def set_state(self, index: int, name: str, values: Mapping) -> None:
        """Set group ``index``'s state ``name`` (``master`` or an optimizer state) from full float32 host tensors
        by name (no communication).

        After setting masters, call ``publish`` once every group is set, with every group released, so all ranks
        compute with them.
        """
        self.groups[index].set_state(name, values)

    def publish(self) -> None:
        """Make the parameters every rank computes with equal to the master again (after the state was set)."""
        for group in self.groups:
            group.publish(self.collectives)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's shape by name, in the model's order."""
        shapes = {s.name: s.shape for g in self.groups for s in g.layout.specs}
        return {name: shapes[name] for name in self.names}

    # Reports --------------------------------------------------------------

    def master_params(self) -> dict[str, np.ndarray]:
        """Return the full float32 master parameters by name on every rank (host arrays)."""
        result = {}
        for index in range(len(self.groups)):
            result.update(self.state_group(index, "master"))
        return {name: result[name] for name in self.names}

    def state_group(self, index: int, name: str) -> dict[str, np.ndarray]:
        """Return group ``index``'s state ``name`` of every tensor, whole, by tensor name, on every rank (host
        arrays; collective)."""
        return self.groups[index].full_state(self.collectives, name)

    def master_digest(self) -> str:
        """A digest of the fp32 master params, the same at any world size (collective: each rank digests its shard)."""
        return build.master_digest(self.groups, self.collectives)

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind (``memory.KINDS``), read from the buffers themselves."""
        total = dict.fromkeys(KINDS, 0)
        for group in self.groups:
            for kind, nbytes in group.memory().items():
                total[kind] += nbytes
        total["comm"] += self.collectives.held_bytes
        return total

    def memory_report(self) -> dict:
        """Bytes held now and at the peak so far, by kind (the peak's grads count a contribution as it is handed
        in: the caller's arrays, alive while the engine reads them); the peak total; the process's peak RSS; the other
        ranks' shared pages that RSS counts during a step (``Collectives.mapped_bytes``); and the bytes this rank
        keeps on disk (``states``; 0 in memory)."""
        log = self.memory_log
        return {
            "now": self.memory(),
            "peak": dict(log.peak),
            "peak_total": log.peak_total,
            "rss": peak_rss_bytes(),
            "mapped": self.collectives.mapped_bytes,
            "disk": sum(g.place.disk_bytes for g in self.groups),
        }
