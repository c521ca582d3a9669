"""An install that fits the machine: no torch in the test extra, a ``mpizero`` command, CI as the README says."""

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from docblocks import blocks
from mpirun import ROOT


def extras() -> dict[str, list[str]]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return {name: value.split() for name, value in config["options.extras_require"].items()}


def resolved(extra: str) -> set[str]:
    """The requirements ``pip install -e .[extra]`` asks for, following ``mpizero[...]`` to other extras."""
    found = set()
    for requirement in extras()[extra]:
        if requirement.startswith("mpizero["):
            for inner in requirement[len("mpizero[") : -1].split(","):
                found |= resolved(inner)
        else:
            found.add(requirement)
    return found


def names(extra: str) -> set[str]:
    """The distributions ``pip install -e .[extra]`` asks for, without versions or extras."""
    return {r.split(">")[0].split("=")[0].split("[")[0] for r in resolved(extra)}


def test_the_test_extra_brings_no_torch_but_the_docs_tools():
    assert "torch" not in names("test") and {"mkdocs", "mkdocstrings", "pytest"} <= names("test"), names("test")


def test_the_peers_extra_brings_torch_and_deepspeed():
    assert {"torch", "deepspeed"} <= names("peers"), names("peers")


HIDE_TORCH = "import sys; sys.modules['torch'] = None; import pytest; sys.exit(pytest.main(sys.argv[1:]))"


def without_torch(*args: str) -> subprocess.CompletedProcess:
    """Run pytest with ``import torch`` failing, as on a machine without torch."""
    command = [sys.executable, "-c", HIDE_TORCH, "-p", "no:cacheprovider", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_every_test_module_imports_without_torch():
    done = without_torch("-q", "--collect-only")
    assert done.returncode == 0 and " error" not in done.stdout, done.stdout[-3000:] + done.stderr


def test_the_torch_tests_skip_and_say_why_without_torch():
    torch_files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "torch_bridge").glob("test_*.py"))
    done = without_torch("-q", "-rs", *torch_files)
    assert done.returncode in (0, 5), done.stdout + done.stderr  # 5: every test skipped, none collected
    for name in torch_files:
        assert f"SKIPPED [1] {name}" in done.stdout, done.stdout
    assert done.stdout.count("mpizero.torch needs torch") == len(torch_files), done.stdout


def test_ci_installs_cpu_torch_first_builds_the_docs_and_ends_with_the_readme_test_command():
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    torch, install = lines.index('pip install "torch==2.13.0"'), lines.index('pip install -e ".[mpich,test]"')
    assert torch < install < lines.index("mkdocs build --strict --quiet --site-dir .ci/site")
    assert torch < lines.index('pip install -e ".[peers]"')  # DeepSpeed's torch requirement finds the CPU build
    assert lines[-1] == "python -m pytest"


def test_the_console_script_is_declared():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert config["options.entry_points"]["console_scripts"].split() == ["mpizero", "=", "mpizero.cli.main:main"]


def readme_block(test: str) -> str:
    """The README's block whose marker names ``test`` (in this file)."""
    marker = f"test: tests/project/test_install.py::{test}"
    return next(b for b in blocks() if b.page.name == "README.md" and b.marker == marker).text.strip()


def test_the_readme_clones_into_a_fresh_virtual_environment(tmp_path):
    """The clone and venv lines, the URL being this repository: a clone has what the install command needs, and
    the activated environment is the clone's own (``.ci/run`` then installs into a fresh one, in a fresh clone)."""
    clone = readme_block("test_the_readme_clones_into_a_fresh_virtual_environment").replace("URL", str(ROOT))
    script = f"{clone}\npython -c 'import sys; print(sys.prefix)'\ntest -f setup.cfg && test -d mpizero\n"
    done = subprocess.run(["bash", "-euc", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == str(tmp_path / "mpizero" / ".venv"), done.stdout


def test_the_main_job_runs_as_the_readme_shows():
    first = readme_block("test_the_main_job_runs_as_the_readme_shows")
    install, main_job = first.split(" && ")
    assert install in (ROOT / ".ci" / "run").read_text().splitlines()
    assert main_job == "mpiexec -n 4 mpizero verify"
    bin_dir = Path(sys.executable).parent
    if shutil.which("mpizero", path=str(bin_dir)) is None:
        pytest.skip(f"no mpizero script in {bin_dir}: install the package (pip install -e .) to create it")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", "-c", main_job], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    verdicts = [line for line in done.stdout.splitlines() if line.startswith("stage ")]
    assert len(verdicts) == 4 and all(": bitwise;" in line for line in verdicts), done.stdout
