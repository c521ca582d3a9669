"""A deliberately wrong device kernel (MUTANT: the update or the group decode flips the lowest bit of every value it
writes, on the stand-in) under ``verify --device standin``, against the reference on the device, then ``--against cpu``.

Run: mpiexec -n N python -m mpi4py tests/device/check_against_cpu.py MUTANT
"""

import sys

import numpy as np

from mpizero.cli.main import main
from mpizero.core.optim import device_update
from mpizero.core.reduce import arithmetic

mutant = sys.argv[1]
update, decode = device_update._numpy_body, arithmetic.device_decode_segments


def flipped_update(ops, rule, hyper, constants, states, decoding, first, *rest):
    update(ops, rule, hyper, constants, states, decoding, first, *rest)
    rest[-1 - len(states)].view(np.uint32)[...] ^= np.uint32(1)  # the param, as the kernel wrote it


def flipped_decode(cupy, total, segments, out):
    decode(cupy, total, segments, out)
    out[...] = (out.view(cupy.uint32) ^ np.uint32(1)).view(np.float32)


if mutant == "update":
    device_update._numpy_body = flipped_update
else:
    arithmetic.device_decode_segments = flipped_decode
flags = ["verify", "--device", "standin", "--stage", "3", "--steps", "2"]
print(f"exit on the device: {main(flags)}", flush=True)
print(f"exit against cpu: {main([*flags, '--against', 'cpu'])}", flush=True)
