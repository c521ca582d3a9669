"""Reduce-scatter, all-gather and all-reduce on NumPy or CuPy buffers, blocking or not.

How each call's bytes travel is asked of one object, ``transports.Router``: at
one rank nothing moves; device buffers go straight to MPI when it is CUDA-aware
(see ``cuda_aware``) and are staged through host memory otherwise; host buffers
go out of a node-shared window or by MPI. 2-byte floats (bfloat16,
float16), which MPI has no type for, travel as uint16: the bytes are the same.
Every call is counted in a ``Traffic`` log, so communication volume is
measured, not assumed; on several nodes, the bytes that leave the node are
counted apart. Host reduce-scatters and all-gathers go in two levels where
``paths`` settles ``two-level`` (see ``hierarchical``).

The cross-rank contract of each call: the buffers have the same dtype and
length on every rank, and every rank makes the same calls in the same order.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys

import numpy as np
from mpi4py import MPI

from mpizero.arrays import array_module
from mpizero.comm import agree, cuda_aware, paths, windows
from mpizero.comm.hierarchical import TwoLevel
from mpizero.comm.job import identity
from mpizero.comm.job.ranks import world_ranks
from mpizero.comm.job.watchdog import Watchdog
from mpizero.comm.pending import Pending
from mpizero.comm.shared import NodeBlocks, OwnerSums, SharedArena, address_space_limit, window_room_problem
from mpizero.comm.traffic import Traffic
from mpizero.comm.transports import STAGING_ENV_VAR, Router, device_path

# The most node-shared windows one ``node_blocks`` call makes (one a group): MPICH holds about 2,040 windows a process
# (measured: stage 0, an arena and a grads window a group, failed at 1,100 groups), and stage 0 keeps an arena a group
# besides; past it each rank keeps its own buffers, as off one host.
MAX_BLOCK_WINDOWS = 512
WIRE_VIEWS = {"bfloat16": np.uint16, "float16": np.uint16}


class Collectives:
    """The engine's collectives on one communicator, with staging and counting."""

    def __init__(self, comm: MPI.Comm, watchdog_seconds: float | None = None, on_device: bool = False) -> None:
        """Settle and agree the communication paths (collective: every rank builds its Collectives together)."""
        self.comm = comm
        self.alone = comm.Get_size() == 1  # control messages then make no MPI call (``_control``)
        self.traffic = Traffic()
        self.watchdog = Watchdog(watchdog_seconds, comm)
        with self.watchdog.waiting("set-up: splitting ranks by node"):
            self.node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.arenas: dict = {}  # key -> SharedArena; "bucket" is the one stages 2-3 share
        self.sums: dict = {}  # key -> OwnerSums: a group's round-by-round sum, on one host
        self.node_windows: list[NodeBlocks] = []  # on one host: stage 3's full params, stage 0's averaged grads
        self.scratches: dict = {}  # key -> a device buffer blocking calls borrow (``scratch``)
        self.paths = self._settle_paths(on_device)
        levels = TwoLevel(comm, self.node, self.watchdog) if self.paths.two_level else None
        self.transports = Router(comm, self.paths, levels)
        windows.free_orphans(self, world_ranks(comm))  # the windows of engines gone on every one of these ranks

    def _settle_paths(self, on_device: bool) -> paths.CommPaths:
        asked = {v: os.environ.get(v) for v in (paths.ENV_VAR, cuda_aware.ENV_VAR, STAGING_ENV_VAR)}
        environment = {f"the environment's {v}": value for v, value in asked.items()}
        agree.raise_unless_equal(self, {**identity.fields(), **environment})
        leader = self.node.Get_rank() == 0
        sizes = self.allgather_object(self.node.Get_size() if leader else 0, "the ranks per node")
        per_node = tuple(n for n in sizes if n)
        requested = paths.requested_reduce_scatter()
        device = device_path(on_device)
        library = " ".join(MPI.Get_library_version().splitlines()[0].split())
        path = paths.settle_reduce_scatter(requested, len(per_node), on_device, per_node)
        return paths.CommPaths(path, device, len(per_node), library, per_node)

    @property
    def shared(self) -> bool:
        """Whether gradients may be encoded into a node-shared arena and reduced from there."""
        return self.paths.reduce_scatter in paths.ON_ARENA

    def shared_buffer(self, numel: int, dtype, key="bucket") -> np.ndarray:
        """Arena ``key`` as ``numel`` elements (collective when made or grown); reduce it with ``reduce_scatter``.

        If the shared memory behind the arena has too little room (agreed on every rank), the job falls
        back to MPI's reduce-scatter for good, says so once, and this returns a private buffer.
        """
        if key not in self.arenas:
            self.arenas[key] = SharedArena(self.comm, self.node, self.watchdog)
        arena = self.arenas[key]
        nbytes = numel * np.dtype(dtype).itemsize
        if nbytes > arena.nbytes and not self._room_for(nbytes - arena.nbytes):
            return np.empty(numel, dtype)
        return arena.buffer(numel, dtype)

    def _room_for(self, more_bytes: int) -> bool:
        """Agree whether a node-shared window can grow by ``more_bytes`` per rank (``window_room_problem`` on
        every rank); if not, fall back to MPI's reduce-scatter for good and say why, once."""
        problem = window_room_problem(more_bytes * self.node.Get_size())
        said = agree.said_by_any(self, problem, "room for the shared-memory arena")
        if said is None:
            return True
        self.paths = self.paths.without_shared()
        if self.comm.Get_rank() == 0:
            print(
                f"mpizero: no room for the shared-memory reduce-scatter ({said}): using MPI's reduce-scatter instead",
                file=sys.stderr,
                flush=True,
            )
        return False

    def owner_sums(self, key, numel: int, dtype):
        """The node-shared accumulators ``key`` (``OwnerSums``, ``numel`` elements per rank), made at first use
        (collective then), or None unless on ``one_host`` with ``_room_to_map``."""
        if not self.one_host:
            return None
        if key not in self.sums and self._room_to_map(numel * np.dtype(dtype).itemsize):
            with self.watchdog.waiting("set-up of owner sums"):
                self.sums[key] = OwnerSums(self.node, self.watchdog, numel, dtype)
        return self.sums.get(key)

    def node_blocks(self, numels: list[int], dtype, what: str) -> list[NodeBlocks] | None:
        """For each of ``numels``, node-shared blocks of that many elements per rank whose ``whole`` is every
        rank's blocks in one array (collective: a few agreements however many), for buffers every rank reads in
        place (``what``: stage 3's full params, stage 0's averaged grads); None unless on ``one_host``, for at
        most ``MAX_BLOCK_WINDOWS`` groups, no rank has an address-space limit, the shared memory has room for all,
        and the MPI library laid every rank's blocks out one after another (MPI's default)."""
        if not self.one_host or len(numels) > MAX_BLOCK_WINDOWS or self._address_space_limited:
            return None
        problem = window_room_problem(sum(numels) * np.dtype(dtype).itemsize * self.node.Get_size())
        if agree.said_by_any(self, problem, f"room for node-shared {what}") is not None:
            return None  # each rank keeps its own as before; the gradients' shared paths stay as they are
        with self.watchdog.waiting(f"set-up of node-shared {what}"):
            made = [NodeBlocks(self.node, self.watchdog, numel, dtype, what) for numel in numels]
        if self.allreduce_value(any(b.whole is None for b in made), MPI.LOR, f"whether shared {what} are split"):
            for blocks in made:
                blocks.free()
            return None
        self.node_windows.extend(made)
        return made

    @property
    def one_host(self) -> bool:
        """Whether every rank shares this host's memory, and node-shared blocks may be summed or read there."""
        return self.shared and not self.paths.two_level and self.node.Get_size() == self.comm.Get_size()

    def _room_to_map(self, nbytes: int) -> bool:
        """Whether node-shared blocks of ``nbytes`` per rank, each mapped by every rank, may be made (collective
        and agreed): no rank has an address-space limit (each maps every rank's blocks: at stage 3 that is more
        than its shards), and the shared memory has room."""
        return not self._address_space_limited and self._room_for(nbytes)

    def read_in_place(self, blocks: NodeBlocks, full_bytes: int) -> None:
        """Wait until every rank's writes to ``blocks`` are done (collective), counted as an all-gather of
        ``full_bytes``: what full params read in place replace."""
        self.traffic.record("allgather", full_bytes, self.comm.Get_size(), self.paths.nodes)
        with self.traffic.timed("allgather"):
            blocks.synchronize("shared params (every rank's writes done)")

    def decoded_in_place(self, blocks: NodeBlocks) -> None:
        """Wait until every rank has written its block of ``blocks``, node-shared averaged grads (collective): the
        end of the all-reduce each rank began by reducing its own block (``reduce_scatter`` counted as the
        all-reduce), so nothing more is counted."""
        with self.traffic.timed("allreduce"):
            blocks.synchronize(f"shared {blocks.what} (every rank's block written)")

    def end_reads_in_place(self, blocks: NodeBlocks) -> None:
        """Wait until every rank has done reading ``blocks`` in place (collective), before this rank writes its own
        block: the barrier an update of params read in place begins with, and a clipping of shared grads."""
        blocks.synchronize(f"shared {blocks.what} (every rank's reads done)")

    @functools.cached_property
    def _address_space_limited(self) -> bool:
        """Whether any rank runs under an address-space limit below the host's memory (``RLIMIT_AS``; collective
        at first use): one that high cannot be reached by mappings of memory that exists."""
        limit = address_space_limit()
        limited = limit is not None and limit < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return self.allreduce_value(limited, MPI.LOR, "whether any rank has an address-space limit")

    def push_reduce(self, sums, add_block, full_bytes: int) -> None:
        """Sum one round into every rank's accumulator (``OwnerSums.push``), counted as a reduce-scatter of a
        buffer of ``full_bytes``."""
        self.traffic.record("reduce_scatter", full_bytes, self.comm.Get_size(), self.paths.nodes)
        with self.traffic.timed("reduce_scatter"):
            sums.push(add_block)

    @property
    def held_bytes(self) -> int:
        """Bytes this rank's collectives hold between calls: the arena stages 2-3 share (0 if none), its
        accumulator of each group's owner sums, and the device scratch buffers (``scratch``)."""
        bucket = self.arenas["bucket"].nbytes if "bucket" in self.arenas else 0
        scratch = sum(int(held.nbytes) for held in self.scratches.values())
        return bucket + scratch + sum(sums.own.nbytes for sums in self.sums.values())

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the other ranks' owner sums this rank maps during a step (``OwnerSums.unmap_others`` drops
        them after each step) and of their blocks read in place (params, averaged grads): in its RSS, not its
        memory (the pages are theirs, counted once on the host)."""
        return sum(blocks.others_bytes for blocks in [*self.sums.values(), *self.node_windows])

    def agree(self, local: np.ndarray) -> np.ndarray:
        """Reduce a small float64 vector of per-rank facts: entry 0 summed (a count), the rest maxed (flags, maxima).

        One all-reduce whose size does not depend on the number of ranks; NaN in any rank's entry stays NaN.
        """
        return self._allreduce_small(local, _sum_first_max_rest(), "agreement")

    # Small control messages: Python objects and scalars, counted as ``agreement`` traffic.

    def allgather_object(self, value, what: str) -> list:
        """Every rank's ``value``, in rank order, on every rank."""
        return self._control(f"allgather of {what}", value, lambda: self.comm.allgather(value), [value], gathers=True)

    def bcast_object(self, value, what: str, root: int = 0):
        """Rank ``root``'s ``value`` on every rank."""
        return self._control(f"bcast of {what}", value, lambda: self.comm.bcast(value, root=root), value)

    def gather_object(self, value, what: str, root: int = 0) -> list | None:
        """Every rank's ``value`` in rank order on ``root``; None elsewhere."""
        gather = functools.partial(self.comm.gather, value, root=root)
        return self._control(f"gather of {what}", value, gather, [value], gathers=True)

    def allreduce_value(self, value, op: MPI.Op, what: str):
        """``op`` (``MPI.MAX``, ``MPI.SUM``, ``MPI.LAND``, ...) over every rank's Python scalar.

        mpi4py's object all-reduce holds the GIL while it waits, which would stop the watchdog's thread;
        so the wait is a nonblocking barrier's, after which every rank is there and the all-reduce is quick.
        """
        return self._control(f"allreduce of {what}", value, lambda: self._allreduce_object(value, op), value)

    def _allreduce_object(self, value, op: MPI.Op):
        self.comm.Ibarrier().Wait()
        return self.comm.allreduce(value, op=op)

    def allreduce_array(self, send: np.ndarray, op: MPI.Op, what: str) -> np.ndarray:
        """``op`` over every rank's small host array (a control message: counted as agreement)."""
        return self._allreduce_small(send, op, f"allreduce of {what}")

    def _allreduce_small(self, send: np.ndarray, op: MPI.Op, waiting_in: str) -> np.ndarray:
        self.traffic.record_control(send.nbytes, send.nbytes)
        if self.alone:  # any reduction over one rank is its own value
            return send.copy()
        recv = np.empty_like(send)
        with self.watchdog.waiting(waiting_in), self.traffic.timed("agreement"):
            self.comm.Allreduce(send, recv, op=op)
        return recv

    def barrier(self, what: str) -> None:
        """Wait until every rank has reached this point."""
        self._control(f"barrier before {what}", None, self.comm.Barrier, None)

    def _control(self, op: str, value, call, alone, gathers: bool = False):
        """Count a control call and make it (``call``), or at one rank return what it would (``alone``) with no
        MPI call."""
        payload = len(pickle.dumps(value))
        self.traffic.record_control(payload, payload * (self.comm.Get_size() if gathers else 1))
        if self.alone:
            return alone
        with self.watchdog.waiting(op), self.traffic.timed("agreement"):
            return call()

    def reduce_scatter(self, send, recv, blocking: bool = True, counted_as: str = "reduce_scatter") -> Pending:
        """Sum ``send`` (world_size * len(recv) elements) over ranks; keep this rank's block.

        A ``send`` from ``shared_buffer`` is summed straight from shared memory; other large host
        buffers go in pieces (``reduce_scatter``); both blocking, as measured faster than one call.
        """
        return self._run("reduce_scatter", send.nbytes, send, recv, blocking, counted_as)

    def scratch(self, xp, numel: int, dtype, key: str):
        """``numel`` elements of ``dtype`` for one blocking call's use (``key``: what for): on a device a view of one
        buffer made at the largest size asked and kept, so that no round allocates (every transport is done with
        it, and ordered after the kernels queued before, when a blocking call returns); on the host a new array."""
        if xp is np:
            return np.empty(numel, dtype=dtype)
        nbytes = numel * np.dtype(dtype).itemsize
        held = self.scratches.get(key)
        if held is None or held.nbytes < nbytes:
            held = self.scratches[key] = xp.empty(nbytes, dtype=np.uint8)
        return held[:nbytes].view(dtype)

    def reduce_scatter_add(self, send, total) -> None:
        """Add this rank's block of the sum of ``send`` over ranks into ``total`` (blocking; a ``reduce_scatter``)."""
        block = self.scratch(array_module(total), total.size, total.dtype, "round sum")
        self.reduce_scatter(send, block)
        total += block

    def allreduce(self, send, recv, blocking: bool = True, counted_as: str = "allreduce") -> Pending:
        """Sum ``send`` over ranks into ``recv`` on every rank; a ``send`` from ``shared_buffer`` is summed
        straight from shared memory (blocking), each rank adding every segment."""
        return self._run("allreduce", send.nbytes, send, recv, blocking, counted_as)

    def alltoall(self, send, recv, counted_as: str = "alltoall") -> None:
        """Send block r of ``send`` (world_size equal blocks) to rank r, whose ``recv`` holds every rank's block
        for it in rank order (blocking): a reduce-scatter whose sum the receiver makes itself is counted as one
        (``counted_as``), with the bytes that travel."""
        self._run("alltoall", send.nbytes, send, recv, True, counted_as)

    def allgather(self, send, recv, blocking: bool = True, counted_as: str = "allgather") -> Pending:
        """Concatenate every rank's ``send`` into ``recv`` in rank order; counted under ``counted_as``."""
        return self._run("allgather", recv.nbytes, send, recv, blocking, counted_as)

    def allgather_in_place(self, full) -> Pending:
        """All-gather into ``full``, whose block for this rank already holds its shard."""
        return self._run("allgather", full.nbytes, None, full, True)

    def _run(self, op: str, full_bytes: int, send, recv, blocking: bool, counted_as: str | None = None) -> Pending:
        """Count the call under ``counted_as`` (default ``op``), start it on wire views by the transport the
        router chooses, and wait if blocking."""
        counted_as = counted_as or op
        arena = next((a for a in self.arenas.values() if a.owns(send)), None) if send is not None else None
        transport = self.transports.route(op, send, recv, arena, self.paths)
        self.traffic.record(counted_as, full_bytes, self.comm.Get_size(), self.paths.nodes, transport.two_level)
        with self.watchdog.waiting(counted_as), self.traffic.timed(counted_as):
            pending = getattr(transport, op)(_wire(send), _wire(recv), blocking)
        self.traffic.staged[counted_as] += pending.staged
        pending.op, pending.watchdog, pending.traffic = counted_as, self.watchdog, self.traffic
        if blocking:
            pending.wait()
        return pending


def _wire(a):
    """View 2-byte floats as uint16 for MPI; return other buffers unchanged."""
    if a is None or a.dtype.name not in WIRE_VIEWS:
        return a
    return a.view(WIRE_VIEWS[a.dtype.name])


@functools.cache
def _sum_first_max_rest() -> MPI.Op:
    """An MPI reduction on float64 vectors: entry 0 added, the others the maximum (NaN wins)."""

    def combine(incoming, inout, datatype) -> None:
        a, b = np.frombuffer(incoming, np.float64), np.frombuffer(inout, np.float64)
        b[0] += a[0]
        np.maximum(a[1:], b[1:], out=b[1:])

    return MPI.Op.Create(combine, commute=True)
