"""Arrays every rank holds whole (a torch model's buffers and frozen parameters): one file, each array checked.

``replicated.bin`` holds the arrays' raw bytes one after another, in name order;
the manifest's ``replicated`` lists each array's name, dtype, shape, offset and
sha256. Rank 0 writes the file. A load checks the entries' structure (they tile
the file exactly, with known dtypes), the file's size, and each array's digest
before trusting its bytes.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from mpizero.checkpoint import structure
from mpizero.errors import CheckpointError

FILE = "replicated.bin"


def write(directory: str, arrays: dict[str, np.ndarray]) -> list[dict]:
    """Write ``arrays`` (little-endian host arrays of ``DTYPES``) into ``directory``; return their manifest entries."""
    entries, offset = [], 0
    if not arrays:
        return entries
    with open(os.path.join(directory, FILE), "wb") as f:
        for name in sorted(arrays):
            data = np.array(arrays[name], order="C", copy=True)  # ascontiguousarray would make a 0-d array 1-d
            raw = data.reshape(-1).view(np.uint8).tobytes()
            f.write(raw)
            entries.append(
                {
                    "name": name,
                    "dtype": data.dtype.name,
                    "shape": list(data.shape),
                    "offset": offset,
                    "sha256": hashlib.sha256(raw).hexdigest(),
                }
            )
            offset += len(raw)
        f.flush()
        os.fsync(f.fileno())
    return entries


def read(path: str, entries: list[dict]) -> dict[str, np.ndarray]:
    """The arrays of checkpoint ``path``, each checked against its entry; raise CheckpointError."""
    if not entries:
        return {}
    where = os.path.join(path, FILE)
    try:
        with open(where, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != structure.replicated_end(entries):
                raise CheckpointError(f"{where}: {size} bytes, the manifest lists {structure.replicated_end(entries)}")
            found = {}
            for entry in entries:
                raw = f.read(structure.replicated_nbytes(entry))
                if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
                    raise CheckpointError(f"{where}: {entry['name']!r} does not match its digest")
                found[entry["name"]] = (
                    np.frombuffer(raw, structure.DTYPES[entry["dtype"]]).reshape(entry["shape"]).copy()
                )
    except OSError as error:
        raise CheckpointError(f"{where}: unreadable ({error})") from None
    return found
