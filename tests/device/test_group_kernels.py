"""A group's device kernels on the stand-in against the host's per-tensor kernels, byte for byte: the encode with
its maxima, counts and spill (``group_encode``), the decode of every segment in one launch (``arithmetic``) and
their rescale (``exact``)."""

import math

import numpy as np
import pytest

from mpizero import standin
from mpizero.arrays import to_host
from mpizero.core.reduce import arithmetic, exact, group_encode, kernels
from mpizero.standin import cuda

SIZES = [5, 0, 4097, 33, 1]  # an empty tensor, one over a tile, odd sizes
CAPS = [0x3F000000, 0x3F800000, 0x3E000000, 0x40000000, 0x7F800000]  # 0.5, 1, 0.125, 2, every finite value


def contributions(seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    made = []
    for _ in range(2):
        tensors = [(rng.standard_normal(n) * rng.choice([0.01, 1.0, 100.0])).astype(np.float32) for n in SIZES]
        tensors[2][7] = np.float32(-0.0)
        made.append(tensors)
    return made


def launches() -> int:
    return sum(cuda.LAUNCHES.values())


@pytest.mark.parametrize("pair", [False, True], ids=["one", "pair"])
@pytest.mark.parametrize("assign", [False, True], ids=["add", "assign"])
def test_the_group_encode_gives_each_tensors_kernel_bytes_maxima_counts_and_spill(pair, assign):
    offsets = np.cumsum([0, *SIZES]).tolist()
    numel, padded = offsets[-1], offsets[-1] + 7
    made = contributions(1)[: 2 if pair else 1]
    ks = [30, 20, 33, 0, 10]
    rng = np.random.default_rng(2)
    start = rng.integers(-(2**40), 2**40, padded).astype(np.int64)
    host = start.copy()
    expected_top, expected_out, left = [0] * len(SIZES), [0] * len(SIZES), []
    for index, (offset, k, cap) in enumerate(zip(offsets, ks, CAPS)):
        for number, tensors in enumerate(made):
            x = tensors[index]
            top, out = kernels.numpy_encode(host[offset : offset + x.size], x, k, 0, cap, assign and number == 0)
            expected_top[index], expected_out[index] = max(expected_top[index], top), expected_out[index] + out
            outside = np.flatnonzero((x.view(np.uint32) & 0x7FFFFFFF) >= cap)
            left += [(offset + int(i), x[i].tobytes()) for i in outside]
    if assign:
        host[numel:] = 0
    stats = group_encode.DeviceStats(standin, [len(SIZES)])
    spill = group_encode.Spill(stats, 0, len(SIZES), 1 << 20)  # 16384 slots: room for every one
    total = standin.asarray(start)
    pieces = [[standin.asarray(t[i]) for t in made] for i in range(len(SIZES))]
    tensors = [  # as the layout's overlaps give them: an empty tensor is left out, the others keep their index
        (i, o, p, k, cap, True) for i, (o, p, k, cap) in enumerate(zip(offsets, pieces, ks, CAPS)) if SIZES[i]
    ]
    before = launches()
    group_encode.encode_group(total, tensors, assign, numel, spill)
    assert launches() - before == 1
    assert to_host(total).tobytes() == host.tobytes()
    row = stats.of_group(0)
    n = len(SIZES)
    assert row[:n].tolist() == expected_top and row[n : 2 * n].tolist() == expected_out
    count = int(row[2 * n])
    spilled = sorted(
        zip(to_host(spill.positions)[:count].tolist(), [v.tobytes() for v in to_host(spill.values)[:count]])
    )
    assert count == len(left) > 0 and spilled == sorted(left)


def test_a_spilled_element_is_encoded_at_its_tensors_chosen_scale_as_the_host_keeps_it():
    offsets, chosen = [0, 10, 30], [12, 5, 40]
    values = np.array([3.5, -1e4, 2.75, 7e-3], dtype=np.float32)
    positions = np.array([2, 10, 29, 31], dtype=np.int64)
    expected = np.zeros(40, dtype=np.int64)
    for p, v in zip(positions, values):
        tensor = np.searchsorted(offsets, p, side="right") - 1
        exact_k = chosen[tensor]
        expected[p] += np.int64(np.rint(np.float64(v) * 2.0**exact_k))
    stats = group_encode.DeviceStats(standin, [3])
    spill = group_encode.Spill(stats, 0, 3, 40)
    spill.positions[:4] = standin.asarray(positions)
    spill.values[:4] = standin.asarray(values)
    stats.buffer[6:7] = standin.asarray(np.array([4], dtype=np.int64))
    stats.written()
    local = standin.zeros(40, dtype=np.int64)
    spill.encode_into(local, offsets, chosen)
    assert to_host(local).tolist() == expected.tolist()


@pytest.mark.parametrize("segments", [0, 3, 40])  # 40: two launches of 32 and 8
def test_the_decode_of_every_segment_in_one_launch_gives_each_tensors_bytes_and_zero_padding(segments):
    rng = np.random.default_rng(segments)
    bounds, position = [], 3  # a gap before the first, between some and after the last
    for _ in range(segments):
        size = int(rng.integers(1, 9))
        bounds.append((position, position + size, math.ldexp(float(rng.integers(1, 9)), int(rng.integers(-5, 40)))))
        position += size + int(rng.integers(0, 2))
    total = rng.integers(-(2**50), 2**50, position + 4).astype(np.int64)
    expected = np.zeros(total.size, dtype=np.float32)
    for lo, hi, divisor in bounds:
        exact.numpy_decode(total[lo:hi], divisor, expected[lo:hi])
    out = standin.asarray(np.full(total.size, 9.0, dtype=np.float32))
    on_device = standin.asarray(total)
    before = launches()
    arithmetic.device_decode_segments(standin, on_device, bounds, out)
    assert launches() - before == max(1, -(-segments // arithmetic.MAX_SEGMENTS))
    assert to_host(out).tobytes() == expected.tobytes()


@pytest.mark.parametrize("segments", [0, 3, 40])  # 40: two launches of 32 and 8 (if they all move)
def test_the_rescale_of_every_segment_in_one_launch_gives_each_tensors_bytes(segments):
    """A step whose chosen scales differ from the prediction brings each segment's sum to its scale: one launch a
    group (``exact.rescale_segments``), not the eight array operations of ``exact.rescale`` a tensor."""
    rng = np.random.default_rng(segments)
    bounds, position = [], 3
    for _ in range(segments):
        size = int(rng.integers(1, 9))
        bounds.append((position, position + size, int(rng.choice([0, 1, 2, 13, 40, 63, 64, 70]))))
        position += size + int(rng.integers(0, 2))
    total = rng.integers(-(2**62), 2**62, position + 4).astype(np.int64)
    expected = total.copy()
    for lo, hi, shift in bounds:
        exact.rescale(expected[lo:hi], shift)
    on_device = standin.asarray(total)
    before = launches()
    exact.rescale_segments(on_device, bounds)
    moved = sum(shift > 0 for _, _, shift in bounds)
    assert launches() - before == -(-moved // arithmetic.MAX_SEGMENTS)
    assert to_host(on_device).tobytes() == expected.tobytes()


def test_the_cuda_rescale_formula_is_the_hosts_bit_for_bit(tmp_path):
    """The rescale's C statement (``arithmetic.rescaled_statement``, what the device kernel runs), compiled by the
    host's C compiler, gives ``exact.rescale``'s integers at every shift: ties either way, negatives, the
    extremes (NVRTC compiles the same statement in ``test_cuda_sources.py``)."""
    import ctypes
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler on this machine")
    source = tmp_path / "rescale.c"
    body = arithmetic.rescaled_statement(3, "t")  # the shift picked from three segments' bounds, as on a device
    params = ", ".join(f"long long lo{s}, long long hi{s}, long long s{s}" for s in range(3))
    source.write_text(
        f"void run(long long* total, long long n, {params}) {{\n"
        f"  for (long long i = 0; i < n; i++) {{ long long t = total[i]; {body} total[i] = t; }}\n}}\n"
    )
    library = tmp_path / "rescale.so"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    run = ctypes.CDLL(str(library)).run
    rng = np.random.default_rng(0)
    for shift in range(0, 71):
        half = 1 << max(shift - 1, 0)
        values = [0, 1, -1, 2**62, -(2**62), half, -half, 3 * half, -3 * half, half + 1, -half - 1]
        values += rng.integers(-(2**62), 2**62, 200).tolist()
        total = np.array([v for v in values if -(2**63) <= v < 2**63], dtype=np.int64)
        third = total.size // 3  # the first third at no segment, the second at ``shift``, the rest at 70 - shift
        bounds = [(2 * third, total.size, 70 - shift), (third, 2 * third, shift), (0, 0, 5)]
        expected = total.copy()
        for lo, hi, moved in bounds:
            exact.rescale(expected[lo:hi], moved)
        args = [ctypes.c_longlong(v) for v in (total.size, *(v for bound in bounds for v in bound))]
        run(total.ctypes.data_as(ctypes.POINTER(ctypes.c_longlong)), *args)
        assert total.tolist() == expected.tolist(), shift
