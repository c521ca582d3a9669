"""The documentation site builds in strict mode, and every code block on it (and in the README) is run or checked.

How each block is checked is written above it (``tests/docblocks.py`` lists the markers). Blocks that run
MPI run under ``tests/mpirun.py``'s mpiexec with a timeout.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from docblocks import KINDS, blocks
from mpirun import ROOT, run_mpi_ok

TESTS = sorted((ROOT / "tests").rglob("*.py"))
# Numbers that differ from run to run, masked in a console block and in the output it is compared with.
VOLATILE = [(re.compile(r"peak RSS [\d.]+ MiB"), "peak RSS # MiB"), (re.compile(r"MPI: .*"), "MPI: (the library)")]


def of_kind(*kinds: str) -> list:
    return [pytest.param(b, id=b.where) for b in blocks() if b.kind in kinds]


def source_of_tests(but: Path | None = None) -> str:
    return "\n".join(path.read_text() for path in TESTS if path != but)


def test_the_site_builds_in_strict_mode(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "api" / "index.html").read_text().count('id="mpizero.ZeroEngine.step"') == 1


def test_a_broken_link_fails_the_strict_build(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# x\n\n[gone](nowhere.md)\n")
    (tmp_path / "mkdocs.yml").write_text("site_name: x\nstrict: true\nnav:\n  - index.md\n")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode != 0 and "nowhere.md" in done.stderr, done.stderr


def test_every_block_says_how_the_suite_checks_it():
    unmarked = [f"{b.where} ({b.marker or 'no marker'})" for b in blocks() if b.kind not in KINDS]
    assert not unmarked, f"each block needs one of the markers in tests/docblocks.py: {unmarked}"


@pytest.mark.parametrize("block", of_kind("named"))
def test_a_test_reads_each_named_block(block):
    text = source_of_tests(but=ROOT / "tests" / "docblocks.py")
    assert f'"{block.argument}"' in text or f"<!-- {block.argument} -->" in text, f"{block.where}: no test reads it"


@pytest.mark.parametrize("block", of_kind("file"))
def test_file_blocks_are_the_files_the_suite_runs(block):
    assert block.text == (ROOT / block.argument).read_text(), f"{block.where} differs from {block.argument}"
    assert f'"{block.argument}"' in source_of_tests(), f"no test runs {block.argument}"


@pytest.mark.parametrize("block", of_kind("test"))
def test_the_named_test_exists(block):
    path, _, name = block.argument.partition("::")
    assert f"def {name}(" in (ROOT / path).read_text(), f"{block.where}: no test {block.argument}"


@pytest.mark.parametrize("block", of_kind("results"))
def test_measured_tables_are_the_recorded_results(block):
    recorded = {line.rstrip() for line in (ROOT / block.argument).read_text().splitlines()}
    missing = [line for line in block.text.splitlines() if line.rstrip() not in recorded]
    assert not missing, f"{block.where}: not in {block.argument}: {missing}"


@pytest.mark.parametrize("block", of_kind("run"))
def test_python_blocks_run(block, tmp_path):
    if re.search(r"^(import|from) torch", block.text, re.M) and importlib.util.find_spec("torch") is None:
        pytest.skip(f"{block.where} needs torch: install the CPU build of torch (docs/getting-started.md)")
    script = tmp_path / "block.py"
    script.write_text(block.text)
    ranks = int(block.argument or 1)
    run_mpi_ok(ranks, ["-m", "mpi4py", str(script)], timeout=120, env={"PYTHONPATH": str(ROOT)})


def commands_and_output(text: str) -> list[tuple[str, list[str]]]:
    """Split a console block into ``(command, shown output lines)``; a command goes on after a trailing ``\\``."""
    pairs, lines = [], text.splitlines()
    while lines:
        line = lines.pop(0)
        assert line.startswith("$ "), f"a console block starts each command with '$ ', got {line!r}"
        command = line[2:]
        while command.endswith("\\"):
            command = command[:-1] + lines.pop(0)
        shown = []
        while lines and not lines[0].startswith("$ "):
            shown.append(lines.pop(0))
        pairs.append((command, shown))
    return pairs


def masked(line: str) -> str:
    for pattern, mask in VOLATILE:
        line = pattern.sub(mask, line)
    return line.rstrip()


@pytest.mark.parametrize("block", of_kind("console"))
def test_console_blocks_print_what_they_show(block, tmp_path):
    bin_dir = str(Path(sys.executable).parent)  # this Python, and the mpiexec and scripts beside it
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
    }
    for command, shown in commands_and_output(block.text):
        done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, f"{block.where}: {command}\n{done.stdout}\n{done.stderr}"
        printed = [masked(line) for line in done.stdout.splitlines()]
        rest = iter(printed)  # the shown lines, in order, among the printed ones
        missing = [line for line in shown if masked(line) not in rest]
        assert not missing, f"{block.where}: {command} did not print {missing}; it printed:\n{done.stdout}"


def test_mpi4py_loads_the_library_it_is_told():
    """The site-MPI lines of docs/clusters.md: MPI4PY_LIBMPI names the library file, MPI4PY_MPIABI its ABI."""
    library = Path(sys.executable).parent.parent / "lib" / "libmpi.so.12"
    if not library.exists():
        pytest.skip(f"no MPICH library at {library} (the mpich wheel installs it there)")
    show = [sys.executable, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"]
    told = subprocess.run(show, env={**os.environ, "MPI4PY_LIBMPI": str(library)}, capture_output=True, text=True)
    assert told.returncode == 0 and told.stdout.startswith("MPICH Version:"), told.stdout + told.stderr
    abi = subprocess.run(show, env={**os.environ, "MPI4PY_MPIABI": "openmpi"}, capture_output=True, text=True)
    assert "Open MPI" in abi.stdout or "libmpi.so.40" in abi.stderr, abi.stderr  # Open MPI's library is sought
