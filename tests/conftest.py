import compileall
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoint_runs import saved  # noqa: E402, F401  (a fixture: the checkpoint tests share one saved run)

# The suite runs up to 4 ranks on 2 cores. MPICH's ranks spin while they wait in a collective, taking the cores
# from the ranks that work; with heavy yield they sleep instead (docs/getting-started.md, "Oversubscribed runs").
# Every mpiexec the tests start inherits this; a value set outside the suite is kept.
os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")

# Every process the suite starts (some two thousand ranks and commands) imports mpizero from this checkout. Where
# PYTHONDONTWRITEBYTECODE is set (as on our machines) none of them caches the compiled modules, so each compiled
# them again: 0.2 s a process. Compile them once here; reading a compiled module needs no write (a read-only
# checkout is left as it is: compileall reports nothing, quiet).
for _folder in ("mpizero", "tests"):
    compileall.compile_dir(Path(__file__).resolve().parent.parent / _folder, quiet=2)

# Under ``mpiexec ... python -m pytest --with-mpi``: a failure on one rank ends every rank; rank 0 reports.
pytest_plugins = ["mpizero.testing"]
