"""The disk tier at any world size: the same bytes as in memory, states on disk between steps, files removed.

Run: mpiexec -n N python -m mpi4py tests/core/check_offload.py DIR
Every rank runs every check (an assertion on any rank aborts the job); rank 0 prints ``digest D`` of the final
master params of an offloaded run (the same at any world size), then ``offload checks ok``.
"""

import functools
import gc
import itertools
import json
import os
import resource
import signal
import socket
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from expect import expect_error

from mpizero import SGD, Adam, DiskOffload, Reference, ZeroEngine, split_evenly
from mpizero.checkpoint import store
from mpizero.core import formulas, states
from mpizero.core.precision import PRECISIONS
from mpizero.core.states import offload_directory
from mpizero.training.mlp import MLP, regression_batch
from mpizero.training.model import forward_backward
from mpizero.training.trainer import Trainer

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
MODEL = MLP((7, 17, 11, 3))
GROUPS = [[name] for name in MODEL.init(1)]  # six groups, one per tensor
MICRO_BATCHES = 5
BASE = os.path.join(sys.argv[1], f"node-of-rank-{rank}")  # a directory per rank, as on nodes of their own
os.makedirs(BASE, exist_ok=True)


def engine_at(stage, optimizer, dtype="float32", disk=True, **settings):
    settings.update({"offload": DiskOffload(BASE)} if disk else {})
    return ZeroEngine(MODEL.init(1), optimizer, stage=stage, groups=GROUPS, param_dtype=dtype, **settings)


def train(engine, steps, first=1):
    mine = split_evenly(MICRO_BATCHES, size, rank)
    for step in range(first, first + steps):
        batches = [regression_batch(MODEL.widths, 1, step, m, 6) for m in range(MICRO_BATCHES)]
        with engine.gathered() as full:
            engine.step([forward_backward(MODEL, full, *batches[m])[1] for m in mine])


def partial_batch(step):
    """The trainer's micro-batch ``m`` of ``step``."""
    return functools.partial(regression_batch, MODEL.widths, 1, step, size=6)


def bytes_of(engine):
    return {name: a.tobytes() for name, a in engine.master_params().items()}


def check_the_same_bytes_as_in_memory_and_the_reference():
    for stage in range(4):
        for optimizer, dtype in ((SGD(lr=0.05, momentum=0.9), "float32"), (Adam(lr=1e-2), "float16")):
            offloaded, in_memory = engine_at(stage, optimizer, dtype), engine_at(stage, optimizer, dtype, disk=False)
            train(offloaded, 3)
            train(in_memory, 3)
            assert bytes_of(offloaded) == bytes_of(in_memory), (stage, optimizer, dtype)
            for group, twin in zip(offloaded.groups, in_memory.groups):
                for (what, start, a), (_, _, b) in zip(group.held_buffers(), twin.held_buffers()):
                    assert (start, np.asarray(a).tobytes()) == (start, np.asarray(b).tobytes()), (stage, what)
            if dtype == "float32":
                reference = Reference(MODEL.init(1), optimizer)
                for step in range(1, 4):
                    batches = [regression_batch(MODEL.widths, 1, step, m, 6) for m in range(MICRO_BATCHES)]
                    reference.step([forward_backward(MODEL, reference.params, *b)[1] for b in batches])
                assert bytes_of(offloaded) == {n: a.tobytes() for n, a in reference.params.items()}, stage


def check_states_live_on_disk_between_steps_and_one_group_in_memory_at_once():
    most, now = [0], [0]
    read, write = states.GroupFile.read, states.GroupFile.write

    def counted_read(self):
        now[0] += 1
        most[0] = max(most[0], now[0])
        return read(self)

    def counted_write(self, arrays):
        write(self, arrays)
        now[0] -= states.GRAD not in arrays  # the update's write-back, not the decoded grad shard's

    engine = engine_at(1, Adam(lr=1e-2))
    states.GroupFile.read, states.GroupFile.write = counted_read, counted_write
    try:
        train(engine, 2)
    finally:
        states.GroupFile.read, states.GroupFile.write = read, write
    assert most[0] == 1 < len(engine.groups), most
    held, setup = engine.memory(), formulas.formula_setup(engine)
    assert held["master"] == held["optimizer"] == 0 and held == formulas.engine_bytes(setup), held
    owned = sum(g.owned_range[1] - g.owned_range[0] for g in engine.groups)
    on_disk = sum(g.place.file.nbytes for g in engine.groups)
    assert on_disk == (3 * 4 + 8) * owned == formulas.offload_bytes(setup)["disk"]  # 2 moments, grad; sums
    assert engine.memory_report()["disk"] == on_disk
    assert held["grads"] == 0
    assert formulas.offload_bytes(setup)["in_memory_peak"] == max(
        g.place.file.nbytes - 8 * g.place.file.numel for g in engine.groups
    )
    peak, largest = engine.memory_report()["peak"], max(g.owned_range[1] - g.owned_range[0] for g in engine.groups)
    assert (peak["master"], peak["optimizer"]) == (0, 8 * largest), peak  # one group's, read in; the master: params
    finals, held = {}, [0]
    reduce_round = ZeroEngine.reduce_round

    def counted(self, index, *args, **kwargs):  # the most streamed sums in memory of groups not yet reducing
        reduce_round(self, index, *args, **kwargs)
        waiting = [g for i, g in enumerate(self.groups) if i not in self._tracker.started]
        held[0] = max(held[0], sum(g.gradients.reduced is not None for g in waiting))

    for disk in (True, False):  # the trainer's rounds at stage 3 (2-5 a step): offloaded, no owner sums kept either
        sharded = engine_at(3, Adam(lr=1e-2), disk=disk)
        ZeroEngine.reduce_round = counted if disk else reduce_round
        try:
            trainer = Trainer(MODEL, sharded, PRECISIONS["fp32"])
            for step in (1, 2, 3):
                trainer.step(partial_batch(step), MICRO_BATCHES)
        finally:
            ZeroEngine.reduce_round = reduce_round
        assert bool(sharded.collectives.sums) is not disk, disk
        finals[disk] = bytes_of(sharded)
    assert finals[True] == finals[False]
    assert held[0] == 1, held  # offloaded, the other groups' sums wait on disk between rounds
    directory = os.path.dirname(engine.groups[0].place.file.path)
    assert os.path.basename(directory).startswith(f"{states.owners_prefix()}{os.getpid()}-rank{rank:05d}-")
    assert sorted(os.listdir(directory)) == [
        offload_directory.MARKER,
        *(f"group{i:05d}.state" for i in range(len(GROUPS))),
    ]
    del engine
    gc.collect()
    assert not os.path.exists(directory)  # removed with its engine


def check_checkpoints_cross_between_offloaded_and_in_memory_runs(directory):
    for saver, loader in ((True, False), (False, True)):
        engine = engine_at(2, Adam(lr=1e-2), disk=saver)
        train(engine, 2)
        where = os.path.join(directory, f"ckpt-from-{'disk' if saver else 'memory'}")
        path = store.save(engine, where, {"step": 2, "optimizer_steps": 2, "skipped_steps": 0, "data": {}})
        train(engine, 2, first=3)
        resumed = engine_at(3, Adam(lr=1e-2), disk=loader)  # another stage as well
        training = store.load(resumed, path).training
        resumed.step_count, resumed.skipped_steps = training["optimizer_steps"], training["skipped_steps"]
        train(resumed, 2, first=3)
        assert bytes_of(resumed) == bytes_of(engine), (saver, loader)


def check_a_file_deleted_or_cut_on_one_rank_ends_the_step_on_every_rank():
    """With clipping too: the norm reads every grad shard on each rank alone, before the update agrees."""
    harms = ((os.remove, "was deleted while the run uses it"), (cut, "was cut to"))
    for (harm, words), clip in itertools.product(harms, (None, 1e-3)):
        engine = engine_at(2, Adam(lr=1e-2), clip_norm=clip)
        train(engine, 2)
        if rank == size - 1:
            harm(engine.groups[1].place.file.path)
        expect_error(
            functools.partial(train, engine, 1, first=3), "step 3", f"group00001.state {words}", "last checkpoint"
        )


def cut(path):
    os.truncate(path, os.path.getsize(path) // 2)


def check_a_file_cut_while_mapped_reads_zeros_and_is_one_agreed_error(directory):
    """The pages past the cut read zeros (not SIGBUS, which would end the rank without a word); whatever read them
    (parameters, a checkpoint save, the next step) ends on every rank, naming the file."""
    engine = engine_at(2, Adam(lr=1e-2))
    train(engine, 2)
    moment = next(iter(engine.groups[1].optimizer_state.values()))  # mapped (the master is the params: float32)
    if rank == size - 1:
        os.truncate(engine.groups[1].place.file.path, 0)
        assert not np.asarray(moment).any()
    words = "group00001.state was cut to 0 of its"
    expect_error(engine.master_params, "the offloaded states", words)
    state = {"step": 2, "optimizer_steps": 2, "skipped_steps": 0, "data": {}}
    expect_error(lambda: store.save(engine, os.path.join(directory, "cut"), state), "checkpoint save", words)
    expect_error(functools.partial(train, engine, 1, first=3), "step 3", words)


def check_a_disk_too_small_on_one_rank_is_one_agreed_error_at_set_up():
    """``posix_fallocate`` claims every block at set-up; a file-size limit stands in for a full disk."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if rank == size - 1:
        # room for the directory's marker (about 150 bytes), not for group 0's file (720 bytes and more at -n 1-4)
        resource.setrlimit(resource.RLIMIT_FSIZE, (400, limit[1]))
    try:
        expect_error(lambda: engine_at(2, Adam(lr=1e-2)), "offloading group 0", "File too large")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)


def check_a_killed_runs_directory_is_removed_by_the_next_engine():
    """Only a directory the killed run made is removed: its marker names it, and it holds nothing else."""
    dead = 2**22 + 12345  # above Linux's largest process id

    def made(name: str, pid: int, started, *others: str) -> str:
        path = os.path.join(BASE, name)
        os.makedirs(path)
        marker = {"host": socket.gethostname(), "pid_namespace": os.stat("/proc/self/ns/pid").st_ino, "pid": pid}
        Path(path, offload_directory.MARKER).write_text(json.dumps({**marker, "started": started, "token": "t"}))
        for other in ("group00000.state", *others):
            Path(path, other).touch()
        return path

    ours = f"{states.owners_prefix()}{dead}-rank{rank:05d}-"
    left = made(ours + "a", dead, 12345)
    holds_a_checkpoint = made(ours + "b", dead, 12345, "MANIFEST.json")
    running = made(
        f"{states.owners_prefix()}{os.getpid()}-rank{rank:05d}-c",
        os.getpid(),
        offload_directory._this_process()["started"],
    )
    unmarked = os.path.join(BASE, ours + "d")  # a checkpoint saved under such a name: a name alone is not enough
    os.makedirs(unmarked)
    Path(unmarked, "group00000.state").touch()
    other_host = os.path.join(BASE, f"{states.owners_prefix().rstrip('-')}9-{dead}-rank{rank:05d}-x")
    os.makedirs(other_host)  # another host's or namespace's, whose name begins as ours: never removed
    engine_at(0, SGD(lr=0.1))
    assert not os.path.exists(left)
    assert all(os.path.exists(p) for p in (holds_a_checkpoint, running, unmarked, other_host))


def check_a_directory_one_rank_cannot_use_is_one_agreed_error():
    a_file = os.path.join(BASE, "a-file")
    Path(a_file).touch()
    where = a_file if rank == size - 1 else os.path.join(BASE, "made-on-demand")

    def make():
        ZeroEngine(MODEL.init(1), SGD(lr=0.1), offload=DiskOffload(where))

    expect_error(make, f"rank {size - 1}", "a-file' is a file, not a directory")


if __name__ == "__main__":
    check_the_same_bytes_as_in_memory_and_the_reference()
    check_states_live_on_disk_between_steps_and_one_group_in_memory_at_once()
    check_checkpoints_cross_between_offloaded_and_in_memory_runs(sys.argv[1])
    check_a_directory_one_rank_cannot_use_is_one_agreed_error()
    check_a_file_deleted_or_cut_on_one_rank_ends_the_step_on_every_rank()
    check_a_file_cut_while_mapped_reads_zeros_and_is_one_agreed_error(sys.argv[1])
    check_a_disk_too_small_on_one_rank_is_one_agreed_error_at_set_up()
    check_a_killed_runs_directory_is_removed_by_the_next_engine()
    engine = engine_at(3, Adam(lr=1e-2))
    train(engine, 3)
    digest = engine.master_digest()
    if rank == 0:
        print(f"digest {digest}", flush=True)
        print("offload checks ok", flush=True)
