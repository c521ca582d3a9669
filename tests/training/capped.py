"""Run a script with this process's address space capped, so that it cannot hold more than the cap.

Run: mpiexec -n N python -m mpi4py tests/training/capped.py MIB script.py [args...]
The cap (RLIMIT_AS, in MiB) counts every mapping, including those made before
it: Python, NumPy and the MPI library take about 220 MiB of address space per
rank here before any training state. An allocation past the cap raises
MemoryError (the engine agrees on it at set-up, so every rank fails together).
"""

import resource
import runpy
import sys

cap = int(sys.argv[1]) * 2**20
resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
