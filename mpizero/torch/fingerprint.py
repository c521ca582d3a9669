"""A fingerprint of a flat parameter buffer: what gives away a write through ``.data`` that torch does not count.

Each buffer's 8-byte words are summed three ways modulo 2**64: plainly, weighted by their column in rows of
``COLUMNS`` words, and weighted by their row, so that a write that only moves values (a weight transposed, its
rows permuted, two words swapped) changes the fingerprint as a write of other values does. Blind spot: the sums
are linear modulo 2**64, so changes of 2**63 (the sign of the upper float32 of a word flipped) cancel in pairs
whose weights have the same parity. On the host one compiled pass reads each buffer once (``SOURCE``); on a
device one launch for all (``device_source``; on the stand-in, the formula evaluated by NumPy in that launch)
into one small array made once and read back once; where nothing compiles NumPy evaluates the same sums
(``_by_formula``: two passes).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from mpizero import compiled
from mpizero.arrays import array_module, is_standin, to_host

COLUMNS = 4093  # words per row: a prime, so that no tensor's rows line up with its rows

SOURCE = f"""MZ_CLONES
void mz_fingerprint(const uint32_t *floats, size_t count, uint64_t *out) {{
    size_t words = count / 2;  /* 8-byte words: two float32s each, the first the lower half */
    uint64_t total = 0, by_column = 0, by_row = 0, row = 1;
    for (size_t lo = 0; lo < words; lo += {COLUMNS}, row++) {{  /* a row stays in cache while it is weighed */
        size_t width = words - lo < {COLUMNS} ? words - lo : {COLUMNS};
        const uint32_t *x = floats + 2 * lo;
        uint64_t sum = 0, weighted = 0;
        for (size_t column = 0; column < width; column++) {{
            uint64_t word = (uint64_t) x[2 * column] | ((uint64_t) x[2 * column + 1] << 32);
            sum += word;
            weighted += word * (uint64_t) (column + 1);
        }}
        total += sum;
        by_column += weighted;
        by_row += sum * row;
    }}
    if (count & 1) {{  /* the last float32 of an odd count, alone: in the row after the whole ones */
        uint64_t odd = floats[count - 1];
        total += odd;
        by_row += odd * (uint64_t) (words / {COLUMNS} + 1);
    }}
    out[0] = total;
    out[1] = by_column;
    out[2] = by_row;
}}
"""  # unsigned sums wrap around 2**64, as NumPy's uint64 arrays do


def fingerprints(buffers: list) -> list[tuple[int, int, int]]:
    """Each flat float32 buffer's fingerprint (the module's three sums): compiled on the host, one pass each;
    on a device by formula, with one transfer back for all."""
    if not buffers:
        return []
    xp = array_module(buffers[0])
    if xp is not np:
        return _on_device(xp, buffers)
    kernel = _compiled()
    if kernel is None:
        return _by_formula(buffers)
    return [_one_pass(kernel, buffer) for buffer in buffers]


class StepFingerprints:
    """The edit watch's fingerprints on a device, read back with the engine's device stats (``DeviceStats.attach``):
    those recorded after an update, and those of the step's check, both in the step's one copy back instead of a
    copy each."""

    def __init__(self, stats, pieces: int) -> None:
        self.stats, self.pieces = stats, pieces
        self.now = stats.attach(3 * pieces)
        self.recorded = stats.attach(3 * pieces)
        self.checking = False  # the step's check was launched: its sums come back with the step's stats

    def record(self, buffers: list) -> None:
        """Launch the sums of ``buffers`` (the shown pieces after an update) into the recorded words."""
        view = self.stats.attached(self.recorded)
        view.fill(0)
        self._launch(buffers, view)
        self.checking = False

    def check(self, buffers: list) -> None:
        """Launch the sums of ``buffers`` now into the check's words (zeroed first)."""
        view = self.stats.attached(self.now)
        view.fill(0)
        self._launch(buffers, view)
        self.checking = True

    def _launch(self, buffers: list, view) -> None:
        if len(buffers) != self.pieces:
            raise AssertionError(f"{len(buffers)} shown pieces, {self.pieces} attached")
        kernel, out = _device_kernel(self.stats.xp), view.view(np.uint64)
        for first in range(0, len(buffers), MAX_BUFFERS):
            kernel([b.reshape(-1) for b in buffers[first : first + MAX_BUFFERS]], out[3 * first :])
        self.stats.written()

    def recorded_sums(self) -> list[tuple[int, int, int]]:
        return _triples(self.stats.attached_host(self.recorded))

    def checked_sums(self) -> list[tuple[int, int, int]]:
        return _triples(self.stats.attached_host(self.now))


def _triples(words: np.ndarray) -> list[tuple[int, int, int]]:
    flat = words.view(np.uint64).tolist()
    return list(zip(flat[::3], flat[1::3], flat[2::3]))


def _on_device(xp, buffers: list) -> list[tuple[int, int, int]]:
    """Every device buffer's sums in one launch per ``MAX_BUFFERS``, into one array made once per count (zeroed by
    one more launch), and one transfer back."""
    out = _sums_array(xp, len(buffers), getattr(buffers[0], "device", None))
    out.fill(0)
    kernel = _device_kernel(xp)
    for first in range(0, len(buffers), MAX_BUFFERS):
        kernel([b.reshape(-1) for b in buffers[first : first + MAX_BUFFERS]], out[3 * first :])
    flat = to_host(out).tolist()
    return list(zip(flat[::3], flat[1::3], flat[2::3]))


MAX_BUFFERS = 32  # buffers one launch takes (a pointer and a count each)
_SUMS: dict = {}  # (array module, device, buffers) -> the device array their sums go to, made once


def _sums_array(xp, count: int, device):
    """The device array of ``count`` buffers' sums on ``device``, made at first use: a step allocates nothing."""
    key = (xp, getattr(device, "id", None), count)
    if key not in _SUMS:
        _SUMS[key] = xp.empty(3 * count, dtype=np.uint64)
    return _SUMS[key]


@functools.cache
def _device_kernel(xp):
    """``kernel(buffers, out)``: each buffer's three sums added into ``out`` (three uint64 each), one launch."""
    if is_standin(xp):

        def launch(buffers, out) -> None:
            def body(*arrays):
                *hosts, sums = arrays
                for index, buffer in enumerate(hosts):
                    sums[3 * index : 3 * index + 3] += np.array(_by_formula([buffer])[0], dtype=np.uint64)

            body.__name__ = "mz_fingerprints"
            params = ", ".join(f"T buffer{i}" for i in range(len(buffers)))
            xp.kernel(body, params, "uint64 out")(*buffers, out)

        return launch

    @functools.cache
    def compiled(count: int):
        return xp.RawKernel(device_source(count), "mz_fingerprints")

    def launch(buffers, out) -> None:
        words = [b.size * b.itemsize // 4 for b in buffers]
        blocks = [max(1, -(-w // (2 * TILE))) for w in words]
        args = [out]
        for buffer, count, block in zip(buffers, words, blocks):
            args += [buffer, np.int64(count), np.int64(block)]
        compiled(len(buffers))((sum(blocks),), (THREADS,), tuple(args))

    return launch


THREADS = 256
TILE = 16 * THREADS  # 8-byte words one block sums


def device_source(count: int) -> str:
    """The CUDA source summing ``count`` buffers: each buffer's words split in tiles, a block a tile, each block's
    sums added into its buffer's three (modulo 2**64: any order gives the same)."""
    params = ", ".join(f"const unsigned int* f{i}, long long count{i}, long long blocks{i}" for i in range(count))
    pick = " else ".join(
        f"if (b < (seen += blocks{i})) {{ t = {i}; floats = f{i}; count = count{i}; b -= seen - blocks{i}; }}"
        for i in range(count)
    )
    return f"""
extern "C" __global__ void mz_fingerprints(unsigned long long* out, {params}) {{
    __shared__ unsigned long long sums[3][{THREADS}];
    long long b = blockIdx.x, seen = 0, count = 0;
    int t = 0;
    const unsigned int* floats = 0;
    {pick}
    long long words = count / 2;
    unsigned long long total = 0, by_column = 0, by_row = 0;
    long long end = (b + 1) * {TILE} < words ? (b + 1) * {TILE} : words;
    for (long long p = b * {TILE} + threadIdx.x; p < end; p += blockDim.x) {{
        unsigned long long word = (unsigned long long)floats[2 * p] | ((unsigned long long)floats[2 * p + 1] << 32);
        total += word;
        by_column += word * (unsigned long long)(p % {COLUMNS} + 1);
        by_row += word * (unsigned long long)(p / {COLUMNS} + 1);
    }}
    if (b == 0 && threadIdx.x == 0 && (count & 1)) {{  /* the last float32 of an odd count, alone */
        unsigned long long odd = floats[count - 1];
        total += odd;
        by_row += odd * (unsigned long long)(words / {COLUMNS} + 1);
    }}
    sums[0][threadIdx.x] = total;
    sums[1][threadIdx.x] = by_column;
    sums[2][threadIdx.x] = by_row;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {{
        if (threadIdx.x < s)
            for (int i = 0; i < 3; i++) sums[i][threadIdx.x] += sums[i][threadIdx.x + s];
        __syncthreads();
    }}
    if (threadIdx.x == 0)
        for (int i = 0; i < 3; i++) atomicAdd(&out[3 * t + i], sums[i][0]);
}}
"""


def _one_pass(kernel, buffer: np.ndarray) -> tuple[int, int, int]:
    floats = np.ascontiguousarray(buffer).reshape(-1).view(np.uint32)
    out = np.empty(3, dtype=np.uint64)
    kernel(floats.ctypes.data, floats.size, out.ctypes.data)
    return tuple(out.tolist())


def _by_formula(buffers: list) -> list[tuple[int, int, int]]:
    """The three sums with the buffers' array module: each buffer read twice on its device; one transfer back."""
    xp = array_module(buffers[0])
    weights = xp.arange(1, COLUMNS + 1, dtype=xp.uint64)
    sums = []
    for buffer in buffers:
        if _address(buffer) % 8:  # a piece of a buffer: its 8-byte words must be aligned on a device
            buffer = buffer.copy()
        words = buffer.reshape(-1).view(xp.uint32)
        pairs = words[: words.size & ~1].view(xp.uint64)
        whole = pairs.size - pairs.size % COLUMNS  # the words in whole rows
        matrix = pairs[:whole].reshape(-1, COLUMNS)
        columns = matrix.sum(axis=0, dtype=xp.uint64)
        columns[: pairs.size - whole] += pairs[whole:]
        odd = words[pairs.size * 2 :].astype(xp.uint64)  # the last float32 of an odd count, alone
        last = xp.concatenate([pairs[whole:], odd])  # the partial row after the whole ones: the next row's weight
        by_row = xp.concatenate([matrix.sum(axis=1, dtype=xp.uint64), last.sum(dtype=xp.uint64, keepdims=True)])
        sums += [  # wrapping around 2**64 in arrays (NumPy warns of it in scalars)
            xp.concatenate([columns, odd]).sum(dtype=xp.uint64, keepdims=True),
            (columns * weights).sum(dtype=xp.uint64, keepdims=True),
            (by_row * xp.arange(1, by_row.size + 1, dtype=xp.uint64)).sum(dtype=xp.uint64, keepdims=True),
        ]
    flat = to_host(xp.concatenate(sums)).tolist()
    return list(zip(flat[::3], flat[1::3], flat[2::3]))


def _address(array) -> int:
    """Where ``array``'s first element lies, on the host or a device."""
    interface = getattr(array, "__cuda_array_interface__", None) or array.__array_interface__
    return interface["data"][0]


@functools.cache
def _compiled():
    """``mz_fingerprint``, typed, or None where nothing compiles (or ``MPIZERO_HOST_KERNELS=numpy``)."""
    library = compiled.kernel_library("fingerprint", SOURCE)[0]
    if library is None:
        return None
    library.mz_fingerprint.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    library.mz_fingerprint.restype = None
    probe = np.random.default_rng(0).integers(0, 2**32, 2 * COLUMNS + 3, dtype=np.uint32).view(np.float32)
    same = _one_pass(library.mz_fingerprint, probe) == _by_formula([probe])[0]
    return compiled.self_tested(library.mz_fingerprint, "fingerprint", None if same else "the sums of a probe buffer")
