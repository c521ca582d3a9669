"""Every CUDA source the engine hands CuPy compiles, with NVRTC and no GPU: the group encode in each form, the spill's
encode, the fingerprints, the segments' decode and rescale, and each optimizer's update with the decode inside it.

NVRTC comes from the ``kernels`` extra (``nvidia-cuda-nvrtc-cu12``; ``.ci/run`` installs it). A
``cupy.ElementwiseKernel`` body is compiled inside a wrapper written here the way CuPy's wraps one (arrays indexed
by ``i``, scalars by value): what CuPy adds around it is CuPy's, and only a GPU runs any of it
(``launch/gpu_check.sh``)."""

import ctypes
import functools
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from mpizero.core.optim import device_update
from mpizero.core.optim.adam import AdamHyper, AdamRule
from mpizero.core.optim.lion import LionHyper, LionRule
from mpizero.core.optim.sgd import SGDHyper, SGDRule
from mpizero.core.reduce import arithmetic, group_encode

C_TYPES = {"int64": "long long", "float64": "double", "float32": "float", "uint32": "unsigned int", "int32": "int"}
OPTIONS = ("--gpu-architecture=compute_70", "--fmad=false")


@functools.cache
def nvrtc():
    """NVRTC's library from the ``nvidia-cuda-nvrtc-cu12`` wheel, or None."""
    spec = importlib.util.find_spec("nvidia")
    roots = [] if spec is None or not spec.submodule_search_locations else list(spec.submodule_search_locations)
    found = [p for root in roots for p in sorted(Path(root).glob("cuda_nvrtc/lib/libnvrtc.so*"))]
    found = [p for p in found if ".alt." not in p.name]
    return ctypes.CDLL(str(found[0])) if found else None


def compile_cuda(source: str, name: str) -> tuple[int, str]:
    """NVRTC's result code and log for ``source``."""
    lib, program = nvrtc(), ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None) == 0
    options = (ctypes.c_char_p * len(OPTIONS))(*[o.encode() for o in OPTIONS])
    code = lib.nvrtcCompileProgram(program, len(OPTIONS), options)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(program, log)
    lib.nvrtcDestroyProgram(ctypes.byref(program))
    return code, log.value.decode(errors="replace")


def elementwise(inputs: str, outputs: str, body: str, arrays_in: tuple[str, ...]) -> str:
    """An ElementwiseKernel's body in a kernel as CuPy wraps one: ``arrays_in`` and the outputs indexed by ``i``."""
    params, bind = [], []
    for param in filter(None, (p.strip() for p in inputs.split(","))):
        kind, name = param.split()
        if name in arrays_in:
            params.append(f"const {C_TYPES[kind]}* {name}_")
            bind.append(f"const {C_TYPES[kind]} {name} = {name}_[i];")
        else:
            params.append(f"{C_TYPES[kind]} {name}")
    for param in filter(None, (p.strip() for p in outputs.split(","))):
        kind, name = param.split()
        params.append(f"{C_TYPES[kind]}* {name}_")
        bind.append(f"{C_TYPES[kind]}& {name} = {name}_[i];")
    return (
        f'extern "C" __global__ void kernel({", ".join(params)}, long long n) {{\n'
        "    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n    if (i >= n) return;\n"
        f"    {' '.join(bind)}\n    {body}\n}}\n"
    )


def fingerprint_sources() -> list[tuple[str, str]]:
    """The edit watch's (``mpizero.torch``: none without torch)."""
    if importlib.util.find_spec("torch") is None:
        return []
    from mpizero.torch import fingerprint

    return [(f"fingerprints {n}", fingerprint.device_source(n)) for n in (1, 32)]


def raw_sources() -> list[tuple[str, str]]:
    sources = [("spill", group_encode.SPILL_SOURCE), *fingerprint_sources()]
    for tensors in (1, 3, group_encode.MAX_TENSORS):
        forms = [(False, False, False), (False, False, True), (True, False, True), (False, True, True)]
        for pair, wire, assign in forms:
            name = f"group encode {tensors} pair={pair} wire={wire} assign={assign}"
            sources.append((name, group_encode.cuda_source(tensors, pair, wire, assign)))
    return sources


def elementwise_sources() -> list[tuple[str, str]]:
    sources = []
    for count in (0, 2, arithmetic.MAX_SEGMENTS):
        inputs = ", ".join(filter(None, ["int64 total", arithmetic.segment_params(count)]))
        body = f"{arithmetic.segment_pick(count)} {arithmetic.decoded_statement('out')}"
        sources.append((f"segments decode {count}", elementwise(inputs, "float32 out", body, ("total",))))
    for count in (1, arithmetic.MAX_SEGMENTS):
        body = arithmetic.rescaled_statement(count, "total")
        sources.append(
            (f"segments rescale {count}", elementwise(arithmetic.rescale_params(count), "int64 total", body, ()))
        )
    rules = [
        (AdamRule, AdamHyper(lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True), ["exp_avg", "exp_avg_sq"]),
        (SGDRule, SGDHyper(lr=0.1, momentum=0.9), ["momentum_buffer"]),
        (LionRule, LionHyper(lr=1e-4), ["exp_avg"]),
    ]
    for rule, hyper, states in rules:
        constants = {k: v if isinstance(v, bool) else np.float32(v) for k, v in rule.constants(hyper, 3).items()}
        for count in (None, 2):
            decoding = None if count is None else arithmetic.Decoding(np.zeros(8, np.int64), ((0, 3, 2.0), (4, 7, 8.0)))
            inputs, outputs, body = device_update.kernel_source(rule, hyper, constants, states, decoding)
            arrays = ("grad",) if decoding is None else ("total",)
            name = f"{rule.name} update{'' if decoding is None else ' decoding'}"
            sources.append((name, elementwise(inputs, outputs, body, arrays)))
    return sources


SOURCES = raw_sources() + elementwise_sources()


@pytest.mark.parametrize("name, source", SOURCES, ids=[name for name, _ in SOURCES])
def test_the_cuda_source_compiles(name, source):
    if nvrtc() is None:
        pytest.skip("NVRTC is not installed (pip install -e '.[kernels]'): the CUDA sources are not compiled here")
    code, log = compile_cuda(source, name)
    assert code == 0, f"{name}:\n{log}\n{source}"
