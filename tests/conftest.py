import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoint_runs import saved  # noqa: E402, F401  (a fixture: the checkpoint tests share one saved run)

# The suite runs up to 4 ranks on 2 cores. MPICH's ranks spin while they wait in a collective, taking the cores
# from the ranks that work; with heavy yield they sleep instead (docs/getting-started.md, "Oversubscribed runs").
# Every mpiexec the tests start inherits this; a value set outside the suite is kept.
os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")

# Under ``mpiexec ... python -m pytest --with-mpi``: a failure on one rank ends every rank; rank 0 reports.
pytest_plugins = ["mpizero.testing"]
