"""Peak RSS growth while one stage 3 engine is built, from a ShardedInit or from full arrays.

Run: mpiexec -n N python -m mpi4py tests/core/setup_memory.py sharded|arrays
Rank 0 prints one JSON line per rank: the model's fp32 bytes, the growth of the
process's peak RSS from before the initial values exist to after the engine's
set-up, and ``engine.memory()``. The model is 16 tensors of 1M parameters.
"""

import json
import sys

from mpizero import Adam, ZeroEngine, philox_normal
from mpizero.core.memory import peak_rss_bytes

SHAPES = {f"t{i}": (1024, 1024) for i in range(16)}
GROUPS = [[f"t{i}" for i in range(j, j + 4)] for j in range(0, 16, 4)]

init = philox_normal(SHAPES, seed=0)
before = peak_rss_bytes()
source = init if sys.argv[1] == "sharded" else {n: init.fill(n, 0, 1 << 20).reshape(s) for n, s in SHAPES.items()}
engine = ZeroEngine(source, Adam(lr=1e-3), groups=GROUPS, stage=3)
row = {"model_bytes": 4 * 16 << 20, "growth": peak_rss_bytes() - before, "engine": engine.memory()}
for line in engine.collectives.gather_object(row, "set-up memory") or ():
    print(json.dumps(line), flush=True)
