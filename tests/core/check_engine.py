"""Engine checks that hold at any world size. Run: mpiexec -n N python -m mpi4py tests/core/check_engine.py

Every rank runs every check; an assertion on any rank aborts the job (python -m mpi4py).
Prints ``digest <hex>`` of the final master parameters, so the caller can compare runs
at different world sizes, then ``engine checks ok``.
"""

import hashlib
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from expect import expect_error

from mpizero import SGD, Adam, Reference, ZeroEngine, split_evenly, standin
from mpizero.comm import collectives
from mpizero.comm.collectives import Collectives
from mpizero.comm.cuda_aware import cuda_aware
from mpizero.comm.transports.pieces import reduce_scatter_in_pieces
from mpizero.training.mlp import MLP, regression_batch
from mpizero.training.model import forward_backward

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
MODEL = MLP((7, 17, 11, 3))
GROUPS = [["l0.w", "l0.b"], ["l1.w", "l1.b", "l2.w"], ["l2.b"]]
MICRO_BATCHES = 5  # uneven over 2, 3 and 4 ranks


def train(stage, optimizer, reduction="exact", steps=4):
    params = MODEL.init(1)
    engine = ZeroEngine(params, optimizer, comm=comm, stage=stage, reduction=reduction, groups=GROUPS)
    reference = Reference(params, optimizer, reduction=reduction)
    mine = split_evenly(MICRO_BATCHES, size, rank)
    for step in range(1, steps + 1):
        batches = [regression_batch(MODEL.widths, 1, step, m, 6) for m in range(MICRO_BATCHES)]
        with engine.gathered() as full:
            engine.step([forward_backward(MODEL, full, *batches[m])[1] for m in mine])
        reference.step([forward_backward(MODEL, reference.params, *b)[1] for b in batches])
    return engine, reference


def check_bitwise_against_reference():
    for stage in range(4):
        for optimizer in (SGD(lr=0.05, momentum=0.9), Adam(lr=1e-2)):
            engine, reference = train(stage, optimizer)
            master = engine.master_params()
            for name, value in reference.params.items():
                assert master[name].tobytes() == value.tobytes(), (stage, optimizer, name)
            with engine.gathered() as full:
                for name, value in reference.params.items():
                    assert np.asarray(full[name]).tobytes() == value.tobytes(), (stage, name)


def check_native_is_close_not_claimed_bitwise():
    engine, reference = train(2, Adam(lr=1e-2), reduction="native")
    assert not engine.reduction.bitwise
    master = engine.master_params()
    for name, value in reference.params.items():
        assert np.max(np.abs(master[name] - value)) <= 1e-4 * np.max(np.abs(value)), name


def check_memory_by_stage():
    for stage in range(4):
        engine, _ = train(stage, Adam(lr=1e-2), steps=2)  # the first step only measures: the second streams
        padded = [g.partition.padded_numel for g in engine.groups]
        shard = [g.partition.shard_numel for g in engine.groups]
        owned = padded if stage == 0 else shard
        held = engine.memory()
        assert held["params"] == 4 * sum(shard if stage == 3 else padded), (stage, held)
        # float32: the master is the params, counted there: the full params at stage 0, the param shard at 1-3
        assert held["master"] == 0, (stage, held)
        # stage 0 with every rank on one host: the averaged grads are node-shared, each rank holds its block
        shared_grads = stage == 0 and engine.collectives.shared
        assert held["grads"] == 4 * sum(shard if shared_grads else owned), (stage, held)
        assert [g.gradients.grad_blocks is not None for g in engine.groups] == [shared_grads] * len(engine.groups)
        if shared_grads:
            assert all(g.grad_shard is g.gradients.grad_blocks.whole for g in engine.groups)
        assert all(g.master_shard is (g.full_params if stage == 0 else g.param_shard) for g in engine.groups), stage
        assert held["optimizer"] == 2 * 4 * sum(owned)
        arena = 8 * max(padded) if engine.collectives.shared else 0  # stages 2-3: the one shared bucket buffer
        assert held["comm"] == (8 * sum(padded) if stage < 2 else arena), (stage, held)
        # stage 3 with every rank on one host reads the full params in place: nothing is gathered, and the views
        # are of the node-shared blocks each rank's update writes its param shard into
        in_place = stage == 3 and engine.collectives.shared
        assert [g.node_params is not None for g in engine.groups] == [in_place] * len(engine.groups), stage
        with engine.gathered() as full:
            assert engine.memory()["gathered"] == (4 * sum(padded) if stage == 3 and not in_place else 0)
            if in_place:
                whole = [g.node_params.whole for g in engine.groups]
                assert all(any(np.shares_memory(view, w) for w in whole) for view in full.values())
        assert engine.memory() == held


def check_groups_past_the_window_cap_keep_their_own_grads():
    """Past ``MAX_BLOCK_WINDOWS`` groups (MPICH runs out of windows a process: one a group segfaulted at 1,100 at
    stage 0) each rank sums and decodes every gradient itself, as off one host: no node-shared grads, same bytes."""
    digests, cap = [], collectives.MAX_BLOCK_WINDOWS
    try:
        for most in (cap, len(GROUPS) - 1):
            collectives.MAX_BLOCK_WINDOWS = most
            engine, _ = train(0, Adam(lr=1e-2), steps=2)
            shared = engine.collectives.shared and most >= len(GROUPS)
            assert [g.gradients.grad_blocks is not None for g in engine.groups] == [shared] * len(GROUPS), most
            digests.append(b"".join(v.tobytes() for v in engine.master_params().values()))
    finally:
        collectives.MAX_BLOCK_WINDOWS = cap
    assert digests[0] == digests[1]


def check_bad_gradients_fail_on_every_rank():
    params = MODEL.init(1)
    engine = ZeroEngine(params, SGD(lr=0.1), comm=comm, stage=2)
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    bad = dict(grads, **{"l1.w": np.zeros((3, 3), np.float32)}) if rank == size - 1 else grads
    expect_error(lambda: engine.step(bad), f"rank {size - 1}", "'l1.w'", "expected float32[17, 11]")
    nan = dict(grads, **{"l0.b": np.full(17, np.nan, np.float32)}) if rank == size - 1 else grads
    expect_error(lambda: engine.step(nan), "non-finite", f"ranks [{size - 1}]")
    expect_error(lambda: engine.step([]), "no rank handed in any gradients")
    engine.step(grads)  # the engine is still usable after agreed errors


def check_host_gradients_for_a_device_engine_fail_on_every_rank():
    """CuPy's kernels refuse host arrays; the engine refuses them at the door instead, on every rank."""
    params = {name: standin.asarray(value) for name, value in MODEL.init(1).items()}
    engine = ZeroEngine(params, SGD(lr=0.1), comm=comm, stage=3)
    grads = {k: standin.zeros_like(v) for k, v in params.items()}
    host = dict(grads, **{"l1.w": np.zeros((17, 11), np.float32)}) if rank == size - 1 else grads
    expect_error(lambda: engine.step(host), f"rank {size - 1}", "'l1.w' is a numpy.ndarray", "mpizero.standin arrays")
    engine.step(grads)


def check_disagreement_at_setup_fails_on_every_rank():
    if size == 1:
        return
    params = MODEL.init(1)
    if rank == size - 1:
        params["l2.b"] = np.zeros(4, np.float32)
    expect_error(
        lambda: ZeroEngine(params, SGD(lr=0.1), comm=comm), "ranks disagree on the parameter count", f"[{size - 1}]"
    )
    expect_error(lambda: ZeroEngine(MODEL.init(1), SGD(lr=0.1), comm=comm, stage=1 + (rank == 0)), "on the settings")
    params = MODEL.init(1)
    if rank == 0:
        params["l0.b"][0] = 1.0
    expect_error(lambda: ZeroEngine(params, SGD(lr=0.1), comm=comm), "initial parameter values")
    expect_error(lambda: ZeroEngine({"w": np.zeros(3)}, SGD(lr=0.1), comm=comm), "must be float32")


def check_host_staging():
    # the stand-in is staged on purpose: say so, or the CUDA-awareness probe warns on a CPU-only machine
    os.environ["MPIZERO_CUDA_AWARE"] = "0"
    cuda_aware.cache_clear()
    coll = Collectives(comm)
    send = np.arange(4 * size, dtype=np.int64) * (rank + 1)
    expected = np.empty(4, np.int64)
    comm.Reduce_scatter_block(send, expected)
    recv = standin.ndarray(np.zeros(4, np.int64))
    coll.reduce_scatter(standin.ndarray(send), recv)
    assert recv.get().tolist() == expected.tolist()  # after the copies back (the stand-in runs late)
    full = np.zeros(3 * size, np.float32)
    full[3 * rank : 3 * rank + 3] = rank
    device_full = standin.ndarray(full.copy())
    coll.allgather_in_place(device_full)
    assert device_full.get().tolist() == np.repeat(np.arange(size), 3).tolist()
    assert coll.traffic.calls - Counter(agreement=coll.traffic.calls["agreement"]) == {
        "reduce_scatter": 1,
        "allgather": 1,
    }


def check_shared_arena_reduce_scatter():
    coll = Collectives(comm)
    rng = np.random.default_rng(rank)
    for block in (1, 7, 1000, 40000):
        values = rng.integers(-(2**50), 2**50, size * block)
        expected = np.empty(block, np.int64)
        comm.Reduce_scatter_block(values, expected)
        arena = coll.shared_buffer(values.size, np.int64)
        arena[...] = values
        got = np.empty(block, np.int64)
        coll.reduce_scatter(arena, got)
        assert got.tobytes() == expected.tobytes(), block
        coll.reduce_scatter_add(arena, got)  # straight from the arena (at one rank: through a temporary block)
        coll.reduce_scatter_add(values, got)  # a private buffer: through a temporary block
        assert got.tobytes() == (3 * expected).tobytes(), block
    assert coll.shared  # mpiexec on one host: every rank shares the node
    coll.arenas["bucket"].free()


def check_reduce_scatter_in_pieces():
    rng = np.random.default_rng(rank)
    for block in (1, 7, 1000):
        send = rng.integers(-(2**50), 2**50, size * block)
        whole, pieces = np.empty(block, np.int64), np.empty(block, np.int64)
        comm.Reduce_scatter_block(send, whole)
        reduce_scatter_in_pieces(comm, send, pieces, piece_bytes=8 * size * 3)
        assert whole.tobytes() == pieces.tobytes(), block


check_reduce_scatter_in_pieces()
check_shared_arena_reduce_scatter()
check_bitwise_against_reference()
check_native_is_close_not_claimed_bitwise()
check_memory_by_stage()
check_groups_past_the_window_cap_keep_their_own_grads()
check_bad_gradients_fail_on_every_rank()
check_host_gradients_for_a_device_engine_fail_on_every_rank()
check_disagreement_at_setup_fails_on_every_rank()
check_host_staging()
engine, _ = train(3, Adam(lr=1e-2), steps=3)
digest = hashlib.sha256(b"".join(v.tobytes() for v in engine.master_params().values())).hexdigest()
if rank == 0:
    print("digest", digest)
    print("engine checks ok")
