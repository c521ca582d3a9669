"""An engine built from a ShardedInit equals one built from full arrays of the same values, at any world size.

Run: mpiexec -n N python -m mpi4py tests/core/check_sharded_init.py
Every rank runs every check; an assertion on any rank aborts the job. Prints one
``stage S initial <digest> trained <digest>`` line per stage, which the caller
compares across world sizes, then ``sharded init checks ok``.
"""

import sys
from functools import partial
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from expect import expect_error  # noqa: E402

from mpizero import Adam, Reference, ShardedInit, ZeroEngine, philox_normal, split_evenly
from mpizero.core.stages import STAGES
from mpizero.training.mlp import MLP, regression_batch
from mpizero.training.model import forward_backward, param_shapes

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
MODEL = MLP((7, 17, 11, 3))
SHAPES = param_shapes(MODEL)
GROUPS = [["l0.w", "l0.b"], ["l1.w", "l1.b", "l2.w"], ["l2.b"]]
MICRO_BATCHES, STEPS = 5, 3
INIT = philox_normal(SHAPES, seed=3, std={n: 0.3 if len(s) == 2 else 0.05 for n, s in SHAPES.items()})
FULL = {name: INIT.fill(name, 0, int(np.prod(shape))).reshape(shape) for name, shape in SHAPES.items()}


class Recording:
    """``INIT.fill``, recording every range asked for."""

    def __init__(self):
        self.asked = []

    def __call__(self, name, start, stop):
        self.asked.append((name, start, stop))
        return INIT.fill(name, start, stop)


def train(engine, steps=STEPS):
    mine = split_evenly(MICRO_BATCHES, size, rank)
    for step in range(1, steps + 1):
        batches = [regression_batch(MODEL.widths, 1, step, m, 6) for m in range(MICRO_BATCHES)]
        with engine.gathered() as full:
            params = {k: v.astype(np.float32) for k, v in full.items()}  # computed in float32 (as the trainer does)
            engine.step([forward_backward(MODEL, params, *batches[m])[1] for m in mine])


def reference_params(steps=STEPS):
    reference = Reference(FULL, Adam(lr=1e-2))
    for step in range(1, steps + 1):
        batches = [regression_batch(MODEL.widths, 1, step, m, 6) for m in range(MICRO_BATCHES)]
        reference.step([forward_backward(MODEL, reference.params, *b)[1] for b in batches])
    return reference.params


def same_bytes(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes() for k in a)


def check_identity_with_full_arrays():
    expected = reference_params()
    for stage in STAGES:
        fill = Recording()
        sharded = ZeroEngine(ShardedInit(SHAPES, fill, INIT.identity), Adam(lr=1e-2), groups=GROUPS, stage=stage)
        arrays = ZeroEngine(FULL, Adam(lr=1e-2), groups=GROUPS, stage=stage)
        group_ranges = [g.plan.params_range for g in sharded.groups]
        asked = sum(stop - start for _, start, stop in fill.asked)
        held = sum(
            min(stop, g.layout.numel) - min(start, g.layout.numel)
            for g, (start, stop) in zip(sharded.groups, group_ranges)
        )
        assert asked == held, (stage, asked, held)  # only what this rank holds: its shard at stage 3
        if stage == 3 and size > 1:
            assert asked < sum(v.size for v in FULL.values())
        assert sharded.initial_digest == arrays.initial_digest, stage
        assert same_bytes(sharded.master_params(), arrays.master_params()), stage
        assert same_bytes(sharded.master_params(), FULL), stage
        train(sharded)
        train(arrays)
        assert same_bytes(sharded.master_params(), arrays.master_params()), stage
        assert same_bytes(sharded.master_params(), expected), stage
        with sharded.gathered() as full:
            assert same_bytes(full, expected), stage
        trained = sharded.master_digest()
        assert trained == arrays.master_digest() != sharded.initial_digest
        if rank == 0:
            print(f"stage {stage} initial {sharded.initial_digest} trained {trained}", flush=True)


def check_identity_in_bf16():
    for stage in (1, 3):
        sharded = ZeroEngine(INIT, Adam(lr=1e-2), groups=GROUPS, stage=stage, param_dtype="bfloat16")
        arrays = ZeroEngine(FULL, Adam(lr=1e-2), groups=GROUPS, stage=stage, param_dtype="bfloat16")
        for engine in (sharded, arrays):
            train(engine, steps=2)
        with sharded.gathered() as a, arrays.gathered() as b:
            assert same_bytes(a, b) and next(iter(a.values())).dtype.name == "bfloat16", stage
        assert same_bytes(sharded.master_params(), arrays.master_params()), stage


def broken(on_rank, answer):
    """``INIT.fill``, except on rank ``on_rank`` (None: every rank), where ``answer(n)`` replaces the values."""

    def fill(name, start, stop):
        if on_rank is None or rank == on_rank:
            return answer(stop - start)
        return INIT.fill(name, start, stop)

    return ShardedInit(SHAPES, fill, INIT.identity)


def build(init, stage):
    return ZeroEngine(init, Adam(lr=1e-2), groups=GROUPS, stage=stage)


def check_bad_fill_fails_on_every_rank():
    last = size - 1
    for stage in (0, 3):
        short = broken(last, lambda n: np.zeros(n - 1, np.float32))
        expect_error(partial(build, short, stage), "bad initial values", f"rank {last}: fill(", "expected [")
        wide = broken(None, lambda n: np.zeros(n, np.float64))
        expect_error(partial(build, wide, stage), "rank", "returned dtype float64, expected float32")
        failing = broken(0, lambda n: 1 / 0)
        expect_error(partial(build, failing, stage), "rank 0: fill('l0.w', 0,", "raised ZeroDivisionError")
    if size > 1:
        by_rank = broken(last, lambda n: np.full(n, 0.5, np.float32))  # every rank fills everything at stage 1
        expect_error(lambda: ZeroEngine(by_rank, Adam(lr=1e-2), stage=1), "the initial parameter values fill made")
        other = ShardedInit(SHAPES, INIT.fill, INIT.identity + ("?" if rank == last else ""))
        expect_error(lambda: ZeroEngine(other, Adam(lr=1e-2), stage=3), "ranks disagree on the initializer")
    expect_error(lambda: ZeroEngine(INIT, Adam(lr=1e-2), groups=[["l0.w"]]), "groups must list every parameter")
    ZeroEngine(INIT, Adam(lr=1e-2), stage=3)  # still usable after agreed errors


check_identity_with_full_arrays()
check_identity_in_bf16()
check_bad_fill_fails_on_every_rank()
if rank == 0:
    print("sharded init checks ok")
