"""A group's encode on a device in one launch a pass: every tensor's sum, maxima, left-out count and spill.

Glossary:

- device stats: one int64 buffer for the whole engine (``DeviceStats``), zeroed once a step and read back at the
  step's first agreement, in one copy (again at a later group's agreement only where passes encoded since:
  ``last_backward()``, or rounds reduced during backward). Each group's view holds, per tensor, the largest
  magnitude's float32 bits seen this step (a maximum), the count of elements left out (a sum), then the group's
  spill count. Integer maximum and
  addition do not depend on their order, so the atomics that fold them on a GPU cannot change a bit.
- spill: where a pass puts the elements it leaves out of a tensor that has a prediction (beyond its cap, or not
  finite), as (position in the group's padded buffer, float32 value), so that no backward waits to learn whether
  it must hold its gradients. A fixed number of slots a group (``spill_slots``), made once; the spill count goes on
  past them, so an overflowing spill is seen at the step's one read-back and the step must run again. At the end
  of the step the spilled elements are encoded at the chosen scales (``Spill.encode_into``): their integers are the
  ones the host's kept elements give, and int64 addition is exact in any order, so the bits are the host's.
- unspilled: a tensor with no prediction (a run's first step) leaves every element out; those are held whole by
  the caller's way (``gradients.Keep``), never spilled.

The encode itself is ``arithmetic``'s formula: the CUDA source spells it with ``C_OPS`` and the stand-in evaluates
it with ``NUMPY_OPS``, so the two cannot drift.
"""

from __future__ import annotations

import functools

import numpy as np

from mpizero.arrays import is_standin, to_host
from mpizero.core.reduce import arithmetic

TILE = 4096  # elements of one tensor a CUDA block encodes (256 threads x 16)
THREADS = 256
MAX_TENSORS = 32  # tensors one launch takes (each is a handful of kernel arguments; CUDA allows 4 KiB of them)


def spill_slots(padded_numel: int) -> int:
    """The spill's slots for a group of ``padded_numel`` elements: 1/64 of them, at least 4096 (12 bytes each)."""
    return max(4096, padded_numel // 64)


class DeviceStats:
    """The engine's device stats (see the glossary): one buffer, a view a group, and the words callers attach
    (``attach``), all read back in one copy."""

    def __init__(self, xp, tensor_counts: list[int]) -> None:
        self.xp = xp
        sizes = [2 * n + 1 for n in tensor_counts]
        starts = np.cumsum([0, *sizes]).tolist()
        self.spans = list(zip(starts[:-1], starts[1:]))
        self.attached_spans: list[tuple[int, int]] = []
        self.stats_words = starts[-1]  # what ``clear`` zeroes: the groups' stats (attachments are their callers')
        self._make(self.stats_words)

    def _make(self, words: int) -> None:
        self.buffer = self.xp.zeros(words, dtype=np.int64)
        self.views = [self.buffer[a:b] for a, b in self.spans]
        self.read: np.ndarray | None = None  # the last read-back, while nothing was written since

    def attach(self, words: int) -> int:
        """Room for ``words`` int64 of a caller's (the torch bridge's edit watch), read back in the same copy as the
        groups' stats, written (and zeroed) by the caller alone. At set-up only (the buffer is made anew); return
        its handle for ``attached`` and ``attached_host``."""
        start = self.buffer.size
        self.attached_spans.append((start, start + words))
        self._make(start + words)
        return len(self.attached_spans) - 1

    def attached(self, handle: int):
        """An attachment's device view (written by the caller's kernels: call ``written`` after)."""
        start, stop = self.attached_spans[handle]
        return self.buffer[start:stop]

    def attached_host(self, handle: int) -> np.ndarray:
        """An attachment's words as last read back (read back now if written since)."""
        start, stop = self.attached_spans[handle]
        return self.host()[start:stop]

    def clear(self) -> None:
        """A step (or a pass run again) begins: every maximum, count and spill count back to 0 (one launch)."""
        self.buffer[: self.stats_words].fill(0)
        self.read = None

    def written(self) -> None:
        """A kernel wrote into the buffer: the next ``host`` reads it again."""
        self.read = None

    def host(self) -> np.ndarray:
        """The whole buffer on the host: one copy, the step's one wait, unless nothing was written since."""
        if self.read is None:
            self.read = to_host(self.buffer)
        return self.read

    def of_group(self, index: int) -> np.ndarray:
        """Group ``index``'s stats as last read back."""
        start, stop = self.spans[index]
        return self.host()[start:stop]


class Spill:
    """Group ``index``'s spill on a device, and its view of the engine's device stats."""

    def __init__(self, device: DeviceStats, index: int, tensors: int, padded_numel: int) -> None:
        self.device, self.index, self.tensors = device, index, tensors
        self.slots = spill_slots(padded_numel)
        self.positions = device.xp.empty(self.slots, dtype=np.int64)
        self.values = device.xp.empty(self.slots, dtype=np.float32)

    @property
    def stats(self):
        """This group's view of the device stats."""
        return self.device.views[self.index]

    @property
    def nbytes(self) -> int:
        """The spill's bytes and its group's device stats'."""
        return int(self.positions.nbytes + self.values.nbytes + self.stats.nbytes)

    def spilled(self) -> int:
        """How many elements this step's passes spilled so far (past ``slots``: the spill overflowed)."""
        return int(self.device.of_group(self.index)[2 * self.tensors])

    def encode_into(self, local, offsets: list[int], chosen: list[int]) -> None:
        """Add the spilled elements into ``local`` (the group's padded int64 buffer) at the chosen scale of the
        tensor each lies in (``offsets``: each tensor's first position)."""
        count = self.spilled()
        if count > self.slots:
            raise AssertionError(f"an overflowed spill ({count} of {self.slots} slots) reached the step's sum")
        if count:
            kernels(self.device.xp).spill(self.positions[:count], self.values[:count], offsets, chosen, local)


def encode_group(total, tensors: list, assign: bool, numel: int, spill: Spill) -> None:
    """Encode one or two contributions of every tensor into ``total`` (the group's padded buffer: int64, or float32
    for a round's wire) in one launch per ``MAX_TENSORS`` tensors, folding their maxima and left-out counts into
    the group's device stats and their left-out elements into its spill. ``tensors``: per tensor
    ``(index, offset, pieces, k, cap_bits, spills)``, ``pieces`` one flat float32 array per contribution (two only
    into an int64 sum: a float32 wire holds one). With ``assign`` the padding ``[numel, total.size)`` is zeroed
    too."""
    if total.dtype == np.float32 and any(len(t[2]) > 1 for t in tensors):
        raise ValueError("a float32 wire buffer holds one contribution: it is written, never added to")
    launch = kernels(spill.device.xp).encode
    spill.device.written()
    for first in range(0, max(len(tensors), 1), MAX_TENSORS):
        chunk = tensors[first : first + MAX_TENSORS]
        pad = assign and first + MAX_TENSORS >= len(tensors)
        launch(total, chunk, assign, numel if pad else total.size, spill)


@functools.cache
def kernels(xp):
    """The group kernels of ``xp``: NumPy bodies on the stand-in, CUDA on CuPy."""
    return _standin_kernels(xp) if is_standin(xp) else _cuda_kernels(xp)


def _standin_kernels(xp):
    """The stand-in's: one launch each (``xp.kernel``), evaluating ``arithmetic``'s formula with NumPy."""
    from types import SimpleNamespace

    def encode(total, chunk, assign: bool, pad_from: int, spill: Spill) -> None:
        pieces = [p for _, _, ps, _, _, _ in chunk for p in ps]
        params = ", ".join(f"float32 x{i}" for i in range(len(pieces)))
        wire = total.dtype == np.float32

        def body(*arrays):
            *xs, total_h, stats_h, positions_h, values_h = arrays
            n = spill.tensors
            found = iter(xs)
            for index, offset, ps, k, cap, spills in chunk:
                ops = arithmetic.numpy_ops(int(k))
                for number, _ in enumerate(ps):
                    x = next(found)
                    bits = x.view(np.uint32) & np.uint32(0x7FFFFFFF)
                    inside = bits < np.uint32(cap)
                    kept_in = np.where(inside, x, np.float32(0))
                    view = total_h[offset : offset + x.size]
                    if wire:
                        view[...] = arithmetic.rounded(ops, kept_in, int(k))
                    else:
                        start = np.int64(0) if assign and number == 0 else view
                        view[...] = arithmetic.encode(ops, start, kept_in, int(k))
                    stats_h[index] = max(int(stats_h[index]), int(bits.max(initial=0)))
                    left = np.flatnonzero(~inside)
                    stats_h[n + index] += left.size
                    if spills and left.size:
                        slot = int(stats_h[2 * n])
                        room = max(0, min(left.size, spill.slots - slot))
                        positions_h[slot : slot + room] = offset + left[:room]
                        values_h[slot : slot + room] = x[left[:room]]
                        stats_h[2 * n] += left.size
            if pad_from < total_h.size:
                total_h[pad_from:] = 0

        body.__name__ = "mz_group_encode"
        in_params = params + (", " if params else "")
        kernel = xp.kernel(body, f"{in_params}", f"{total.dtype} total, int64 stats, int64 positions, float32 values")
        kernel(*pieces, total, spill.stats, spill.positions, spill.values)

    def spill_into(positions, values, offsets: list[int], chosen: list[int], local) -> None:
        starts = np.asarray(offsets, dtype=np.int64)

        def body(positions_h, values_h, local_h):
            tensor = np.searchsorted(starts, positions_h, side="right") - 1
            for index in np.unique(tensor).tolist():
                mine = tensor == index
                k = int(chosen[index])
                rounded = arithmetic.encode(arithmetic.numpy_ops(k), np.int64(0), values_h[mine], k)
                np.add.at(local_h, positions_h[mine], rounded)  # integer adds: exact in any order

        body.__name__ = "mz_spill_encode"
        xp.kernel(body, "int64 positions, float32 values", "int64 local")(positions, values, local)

    return SimpleNamespace(encode=encode, spill=spill_into)


def _cuda_kernels(cupy):
    """CuPy's: a ``RawKernel`` per (tensors in a launch, contributions, wire, assign), compiled on first use."""
    from types import SimpleNamespace

    @functools.cache
    def compiled(tensors: int, pair: bool, wire: bool, assign: bool):
        source = cuda_source(tensors, pair, wire, assign)
        return cupy.RawKernel(source, "mz_group_encode", options=("--fmad=false",))

    def encode(total, chunk, assign: bool, pad_from: int, spill: Spill) -> None:
        pair = len(chunk[0][2]) == 2 if chunk else False
        blocks = [-(-p[0].size // TILE) for _, _, p, _, _, _ in chunk]
        pad_blocks = -(-(total.size - pad_from) // TILE)
        grid = sum(blocks) + pad_blocks
        if grid == 0:
            return
        args = [
            total,
            spill.stats,
            spill.positions,
            spill.values,
            np.int64(spill.slots),
            np.int64(spill.tensors),
            np.int64(pad_from),
            np.int64(total.size),
        ]
        for (index, offset, pieces, k, cap, spills), count in zip(chunk, blocks):
            args += [
                *pieces,
                np.int64(index),
                np.int64(offset),
                np.int64(pieces[0].size),
                np.int64(count),
                np.int32(k),
                np.uint32(cap),
                np.int32(spills),
            ]
        wire = total.dtype == np.float32
        compiled(len(chunk), pair, wire, assign)((grid,), (THREADS,), tuple(args))

    @functools.cache
    def spill_kernel():
        return cupy.RawKernel(SPILL_SOURCE, "mz_spill_encode", options=("--fmad=false",))

    def spill_into(positions, values, offsets: list[int], chosen: list[int], local) -> None:
        table = cupy.asarray(np.asarray([*offsets, 1 << 62], dtype=np.int64))
        ks = cupy.asarray(np.asarray(chosen, dtype=np.int32))
        n = positions.size
        spill_kernel()(
            (-(-n // THREADS),), (THREADS,), (positions, values, np.int64(n), table, ks, np.int64(len(offsets)), local)
        )

    return SimpleNamespace(encode=encode, spill=spill_into)


def cuda_source(tensors: int, pair: bool, wire: bool, assign: bool) -> str:
    """The CUDA source of one group-encode launch over ``tensors`` tensors (see ``encode_group``)."""
    names = ["x", "y"][: 2 if pair else 1]
    per_tensor = ", ".join(
        ", ".join(
            [
                *(f"const float* {c}{t}" for c in names),
                f"long long index{t}",
                f"long long off{t}",
                f"long long size{t}",
                f"long long blocks{t}",
                f"int k{t}",
                f"unsigned int cap{t}",
                f"int spills{t}",
            ]
        )
        for t in range(tensors)
    )
    pick = "\n".join(
        f"    {'if' if t == 0 else 'else if'} (b < (seen += blocks{t})) {{ t = {t}; "
        + " ".join(f"{c} = {c}{t};" for c in names)
        + f" index = index{t}; off = off{t}; size = size{t}; k = k{t}; cap = cap{t}; spills = spills{t};"
        + f" b -= seen - blocks{t}; }}"
        for t in range(tensors)
    )
    target = "float" if wire else "long long"
    per_element = []
    for number, c in enumerate(names):
        value = f"{c}[i]"
        if wire:
            statement = f"total[off + i] = {arithmetic.rounded(arithmetic.C_OPS, 'inside ? v : 0.0f', 'k')};"
        else:
            start = "0" if assign and number == 0 else "total[off + i]"
            statement = f"total[off + i] = {arithmetic.encode(arithmetic.C_OPS, start, 'inside ? v : 0.0f', 'k')};"
        per_element.append(
            f"""        {{
            float v = {value};
            unsigned int bits = __float_as_uint(v) & 0x7fffffffu;
            bool inside = bits < cap;
            top = bits > top ? bits : top;
            outside += !inside;
            {statement}
            if (!inside && spills) {{
                unsigned long long slot = atomicAdd((unsigned long long*)&stats[2 * tensors_all], 1ull);
                if (slot < (unsigned long long)slots) {{ positions[slot] = off + i; values[slot] = v; }}
            }}
        }}"""
        )
    body = "\n".join(per_element)
    pointers = " ".join(f"const float* {c} = 0;" for c in names)
    return f"""
extern "C" __global__ void mz_group_encode({target}* total, long long* stats, long long* positions, float* values,
        long long slots, long long tensors_all, long long pad_from, long long padded,
        {per_tensor}) {{
    __shared__ unsigned int tops[{THREADS}];
    __shared__ unsigned long long outs[{THREADS}];
    long long b = blockIdx.x, seen = 0;
    int t = -1, k = 0, spills = 0;
    unsigned int cap = 0;
    long long index = 0, off = 0, size = 0;
    {pointers}
{pick}
    if (t < 0) {{  // a padding block: zero it where the launch assigns
        long long start = pad_from + (b - seen) * {TILE};
        for (long long j = start + threadIdx.x; j < padded && j < start + {TILE}; j += blockDim.x) total[j] = 0;
        return;
    }}
    unsigned int top = 0;
    unsigned long long outside = 0;
    long long begin = b * {TILE};
    long long end = begin + {TILE} < size ? begin + {TILE} : size;
    for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {{
{body}
    }}
    tops[threadIdx.x] = top;
    outs[threadIdx.x] = outside;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {{
        if (threadIdx.x < s) {{
            tops[threadIdx.x] = tops[threadIdx.x + s] > tops[threadIdx.x] ? tops[threadIdx.x + s] : tops[threadIdx.x];
            outs[threadIdx.x] += outs[threadIdx.x + s];
        }}
        __syncthreads();
    }}
    if (threadIdx.x == 0) {{
        atomicMax((unsigned long long*)&stats[index], (unsigned long long)tops[0]);
        atomicAdd((unsigned long long*)&stats[tensors_all + index], outs[0]);
    }}
}}
"""


SPILL_SOURCE = f"""
extern "C" __global__ void mz_spill_encode(const long long* positions, const float* values, long long n,
        const long long* offsets, const int* ks, long long tensors, long long* local) {{
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    long long p = positions[i];
    int t = 0;
    while (t + 1 < tensors && offsets[t + 1] <= p) t++;
    int k = ks[t];
    float v = values[i];
    long long rounded = {arithmetic.encode(arithmetic.C_OPS, "0", "v", "k")};
    atomicAdd((unsigned long long*)&local[p], (unsigned long long)rounded);  /* integers: exact in any order */
}}
"""
