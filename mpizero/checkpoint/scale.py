"""What one checkpoint costs at any number of ranks, worked out by the code a save and a load run.

``estimate --scale`` prints it for models too big to save here; ``tests/comm/test_scale.py`` pins it to a real
save and resume. The layout (``layout``), the manifest's fields (``store.layout_record``) and the reader's
block reads (``shards.bytes_to_read``) are the ones a checkpoint uses, not a model of them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from mpizero.checkpoint import manifest, store
from mpizero.checkpoint.placement import SavedLayout
from mpizero.checkpoint.shards import BLOCK_BYTES, bytes_to_read, file_bytes
from mpizero.core.optim import AdamW
from mpizero.core.optim.hyper import as_dict

ADAMW_HYPER = as_dict(AdamW().rule.hyper_type(**AdamW().defaults))


def one_save(
    shapes: Mapping[str, Sequence[int]],
    groups: Sequence[Sequence[str]],
    states: list[str],
    ranks: int,
    reshard_to: int,
    align: int = 1,
    block_bytes: int = BLOCK_BYTES,
) -> dict[str, int]:
    """Files per save, rank 0's file, the manifest's bytes, and what rank 0 of ``reshard_to`` ranks needs and reads.

    The manifest is counted with an empty ``training`` field (a run's settings add about 1 KiB).
    """
    source, target = SavedLayout(shapes, groups, align, ranks), SavedLayout(shapes, groups, align, reshard_to)
    names = [name for group in groups for name in group]
    record = {
        "format": manifest.FORMAT,
        "stage": 3,
        "optimizer": {"type": "AdamW", "groups": [{"params": names, "hyper": ADAMW_HYPER}]},
        **store.layout_record(source, states, align),
        "block_bytes": block_bytes,
        "files": ["0" * 64] * ranks,
        "training": {},
        "scales": dict.fromkeys(shapes, [0.001953125, 8]),
        "replicated": [],
        "checksum": "0" * 64,
    }
    owned = [(name, run.start, run.stop) for name, run in target.pieces(0)]
    return {
        "files": ranks + 1,
        "rank file": file_bytes(source.rank_length(0), len(states), block_bytes),
        "manifest": len(json.dumps(record, indent=1)),
        "reshard needs": 4 * len(states) * target.rank_length(0),
        "reshard reads": bytes_to_read(source, owned, len(states), block_bytes),
    }
