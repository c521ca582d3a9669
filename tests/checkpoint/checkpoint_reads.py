"""A rank loading a checkpoint reads only the blocks holding the elements it owns, and the loaded state is exact.

Run: mpiexec -n N python -m mpi4py tests/checkpoint/checkpoint_reads.py save DIR
     mpiexec -n M python -m mpi4py tests/checkpoint/checkpoint_reads.py load DIR STAGE
     mpiexec -n N python -m mpi4py tests/checkpoint/checkpoint_reads.py padding save|load DIR
``save``: a stage 3 engine trains 2 steps with AdamW and saves with 512-byte digest blocks into DIR; prints
``digest D``. ``load``: an engine at STAGE loads DIR and trains no step; every rank checks what it read; rank 0
prints ``rank R read B of T`` for each rank and ``digest D`` (the master digest, the same at any world size).
``padding``: 3 elements, so at 4 ranks the last rank's file is empty; ``load`` prints ``loaded`` or the
agreed ``refused: ...`` on rank 0.
"""

import sys

import numpy as np
from mpi4py import MPI

from mpizero import AdamW, ZeroEngine
from mpizero.checkpoint import manifest, store
from mpizero.checkpoint.catalog import resolve
from mpizero.checkpoint.placement import SavedLayout
from mpizero.checkpoint.shards import DIGEST, blocks, bytes_to_read

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
SHAPES = {"embed": (97, 13), "w1": (13, 71), "b1": (71,), "w2": (71, 13), "b2": (13,), "head": (13, 5)}
GROUPS = [["embed"], ["w1", "b1", "w2", "b2"], ["head"]]
BLOCK = 512


def engine_at(stage: int, seed: int) -> ZeroEngine:
    rng = np.random.default_rng(seed)
    params = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    return ZeroEngine(params, AdamW(lr=1e-2), groups=GROUPS, stage=stage)


def save(directory: str) -> None:
    engine = engine_at(3, seed=1)
    for step in range(2):
        rng = np.random.default_rng([step, rank])
        engine.step([{name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}])
    training = {"step": 2, "optimizer_steps": 2, "skipped_steps": 0, "loss_scale": None, "data": {}}
    store.save(engine, directory, training, block_bytes=BLOCK)
    digest = engine.master_digest()
    if rank == 0:
        print(f"digest {digest}", flush=True)


def load(directory: str, stage: int) -> None:
    engine = engine_at(stage, seed=2)  # other values: every one must come from the checkpoint
    path, _ = resolve(directory)
    loaded = store.load(engine, path)
    saved = manifest.read(path, None)
    layout = SavedLayout.of_manifest(saved)
    owned = [(p.spec.name, p.start, p.stop) for p in engine.owned_pieces()]
    states = len(saved["states"])
    assert loaded.bytes_read == bytes_to_read(layout, owned, states, BLOCK), (loaded.bytes_read, owned)
    runs = [run for name, start, stop in owned for run in layout.runs(name, start, stop)]
    needed = 4 * states * sum(run.stop - run.start for run in runs)
    files = {run.rank for run in runs}
    tables = sum(blocks(4 * states * layout.rank_length(r), BLOCK) * DIGEST for r in files)
    assert needed <= loaded.bytes_read <= needed + tables + 2 * BLOCK * states * len(runs), (loaded.bytes_read, needed)
    total = sum(4 * states * layout.rank_length(r) for r in range(saved["world_size"]))
    everyone, digest = comm.gather(loaded.bytes_read), engine.master_digest()
    if rank == 0:
        print("".join(f"rank {r} read {read} of {total}\n" for r, read in enumerate(everyone)), end="")
        print(f"digest {digest}", flush=True)


def padding(action: str, directory: str) -> None:
    """Save 3 elements (the last of 4 ranks owns only padding), or load them and print what happened."""
    params = {"a": np.arange(2, dtype=np.float32), "b": np.ones(1, dtype=np.float32)}
    engine = ZeroEngine(params, AdamW(lr=1e-2), stage=1)
    training = {"step": 1, "optimizer_steps": 1, "skipped_steps": 0, "loss_scale": None, "data": {}}
    if action == "save":
        store.save(engine, directory, training)
        return
    try:
        store.load(engine, resolve(directory)[0])
        outcome = "loaded"
    except store.CheckpointError as error:
        outcome = f"refused: {error}"
    if rank == 0:
        print(outcome, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "padding":
        padding(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "save":
        save(sys.argv[2])
    else:
        load(sys.argv[2], int(sys.argv[3]))
