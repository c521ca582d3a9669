"""The README's script is the file the tests run, and it trains to the right answer."""

import re

import pytest
from mpirun import ROOT, WORLD_SIZES, run_mpi_ok


def test_readme_shows_exactly_the_quickstart_script():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- quickstart -->\n```python\n(.*?)```", readme, re.S).group(1)
    assert block == (ROOT / "examples" / "quickstart.py").read_text()
    assert len(block.splitlines()) <= 30


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_quickstart_trains_at_any_world_size(n):
    out = run_mpi_ok(n, ["examples/quickstart.py"])
    assert "w [ 2.  -1.   0.5] b [0.3]" in out
    shard_bytes = 4 * -(-4 // n)  # stage 3: rank 0 keeps only its shard of the 4 float32 parameters
    assert f"'params': {shard_bytes}," in out


def test_ruff_is_clean():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "mpizero", "tests", "examples", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
