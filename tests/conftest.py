import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoint_runs import saved  # noqa: E402, F401  (a fixture: the checkpoint tests share one saved run)

# Under ``mpiexec ... python -m pytest --with-mpi``: a failure on one rank ends every rank; rank 0 reports.
pytest_plugins = ["mpizero.testing"]
