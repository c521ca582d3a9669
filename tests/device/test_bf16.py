"""bfloat16 parameters on a device, held as 16-bit words (``mpizero.core.held``): our kernels round and widen as the
host's ml_dtypes does, bit for bit, and the engine, the CLI and the torch bridge on the stand-in give the host's
bytes."""

import hashlib
import warnings

import numpy as np
import pytest
from mpirun import run_mpi_ok

from mpizero import Adam, ZeroEngine, compiled, standin
from mpizero.arrays import to_host
from mpizero.core import held

EDGES = [  # float32 bit patterns where rounding to bfloat16 can go wrong
    0x00000000, 0x80000000,  # signed zeros
    0x3F808000, 0x3F818000, 0xBF808000, 0x3F808001, 0x3F807FFF,  # halfway (even, odd, negative), just over, under
    0x00000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x807F8000, 0x00800000,  # subnormals and the smallest normal
    0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000,  # the largest finite: below halfway, and what rounds to inf
    0x7F800000, 0xFF800000,  # infinities
    0x7F800001, 0x7FC00000, 0xFFC00001, 0x7F812345, 0xFFFFFFFF, 0x7FBFFFFF,  # NaNs, signalling and quiet, both signs
]  # fmt: skip


def hosts_words(bits: np.ndarray) -> np.ndarray:
    """ml_dtypes' bfloat16 of float32 bit patterns, as words: the host's rounding, the one to match."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NaN's cast warns
        return bits.view(np.float32).astype(held.BFLOAT16).view(np.uint16)


def patterns() -> np.ndarray:
    random = np.random.default_rng(0).integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([np.array(EDGES, np.uint32), random])


@pytest.mark.parametrize("xp", [np, standin], ids=["host", "standin"])
def test_rounding_gives_the_hosts_words_on_edge_values(xp):
    bits = patterns()
    words = held.to_held(xp.asarray(bits.view(np.float32)), held.WORD)
    assert np.array_equal(to_host(words), hosts_words(bits))
    infinities_and_nans = to_host(words)[len(EDGES) - 8 : len(EDGES)].tolist()
    assert infinities_and_nans == [0x7F80, 0xFF80, 0x7FC0, 0x7FC0, 0xFFC0, 0x7FC0, 0xFFC0, 0x7FC0]


@pytest.mark.parametrize("xp", [np, standin], ids=["host", "standin"])
def test_widening_is_exact_for_every_word(xp):
    words = np.arange(1 << 16, dtype=np.uint16)
    wide = to_host(held.to_float32(xp.asarray(words)))
    assert np.array_equal(wide.view(np.uint32), words.view(held.BFLOAT16).astype(np.float32).view(np.uint32))


C_HARNESS = """#include <string.h>
static unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
static float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
void mz_round(const float *in, unsigned short *out, long n) {
  for (long i = 0; i < n; i++) { float x = in[i]; unsigned short words; ROUND out[i] = words; }
}
void mz_widen(const unsigned short *in, float *out, long n) {
  for (long i = 0; i < n; i++) { unsigned short words = in[i]; float x; WIDEN out[i] = x; }
}
"""


def test_the_cuda_source_compiled_for_the_host_gives_the_same_bits():
    """The device kernels' C, with CUDA's two bit casts spelled for a host compiler: what the GPU would run."""
    import ctypes

    source = C_HARNESS.replace("ROUND", held.ROUND_SOURCE).replace("WIDEN", held.WIDEN_SOURCE)
    library, why = compiled.load("test_bf16_words", source, ["-O2", "-fPIC", "-shared"])
    if library is None:
        pytest.skip(f"no host C compiler to build the kernels' C with: {why}")
    bits, words = patterns(), np.arange(1 << 16, dtype=np.uint16)
    rounded, wide = np.empty(bits.size, np.uint16), np.empty(words.size, np.float32)
    library.mz_round(ctypes.c_void_p(bits.ctypes.data), ctypes.c_void_p(rounded.ctypes.data), ctypes.c_long(bits.size))
    library.mz_widen(ctypes.c_void_p(words.ctypes.data), ctypes.c_void_p(wide.ctypes.data), ctypes.c_long(words.size))
    assert np.array_equal(rounded, hosts_words(bits))
    assert np.array_equal(wide.view(np.uint32), words.astype(np.uint32) << 16)


def test_the_standin_holds_no_bfloat16():
    with pytest.raises(TypeError, match="holds no bfloat16"):
        standin.zeros(4, held.BFLOAT16)
    with pytest.raises(TypeError, match="holds no bfloat16"):
        standin.ones(4, np.float32).astype(held.BFLOAT16)


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_engine_on_the_standin_holds_words_with_the_hosts_bytes(stage):
    rng = np.random.default_rng(stage)
    params = {"w": rng.standard_normal((7, 5)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    grads = [{n: rng.standard_normal(p.shape).astype(np.float32) for n, p in params.items()} for _ in range(3)]
    results = {}
    for xp in (np, standin):
        on_xp = {n: xp.asarray(p) for n, p in params.items()}
        engine = ZeroEngine(on_xp, Adam(lr=1e-2), stage=stage, param_dtype="bfloat16")
        for step in grads:
            engine.step({n: xp.asarray(g) for n, g in step.items()})
        with engine.gathered() as full:
            assert all(p.dtype == held.held_dtype(xp, "bfloat16") for p in full.values())
            results[xp] = {
                n: (held.on_host(p).tobytes(), held.on_host(held.to_float32(p)).tobytes()) for n, p in full.items()
            }
    assert results[standin] == results[np]


TRAIN = "-m mpizero train --model mlp --precision bf16 --steps 2 --global-batch 16 --micro-batches 4 --log-every 2"


def test_train_on_the_standin_saves_the_hosts_bytes(tmp_path):
    """``train --precision bf16`` at -n 2: the stand-in's device path at stages 1 and 3, the host's at 1."""
    digests = {}
    for device, stage in [("cpu", 1), ("standin", 1), ("standin", 3)]:
        path = tmp_path / f"{device}-{stage}.npy"
        run_mpi_ok(
            2, [*TRAIN.split(), "--device", device, "--stage", str(stage), "--save-params", str(path)], timeout=180
        )
        digests[device, stage] = hashlib.sha256(path.read_bytes()).hexdigest()
    assert len(set(digests.values())) == 1, digests


def test_verify_on_the_standin_is_bitwise_at_every_stage():
    out = run_mpi_ok(2, ["-m", "mpizero", "verify", "--device", "standin", "--precision", "bf16", "--steps", "3"])
    assert out.count(": bitwise;") == 4 and "bf16" in out, out
