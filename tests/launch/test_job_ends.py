"""Nothing waits unwatched: Ctrl-C on one rank, a rank that finishes early, and a slow rank at set-up each end
the whole job within seconds, with one line that names the rank."""

import os
import signal
import subprocess
import sys
import time

import pytest
from mpirun import rank_pids, run_mpi, start_mpi

TRAIN = ["-m", "mpizero", "train", "--steps", "100000", "--global-batch", "8", "--micro-batches", "2"]
WITHIN = 15.0  # seconds from the event to the end of the job; every watchdog here is 300 s or more


def end_of(proc: subprocess.Popen, since: float) -> tuple[float, str]:
    """Seconds from ``since`` until ``proc`` ended, and its stderr (or fail if it has not ended within WITHIN)."""
    try:
        _, err = proc.communicate(timeout=WITHIN)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"still running {WITHIN} s later") from None
    return time.monotonic() - since, err


def mpizero_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("mpizero")]


@pytest.mark.parametrize("stop_rank_0_first", [False, True], ids=["stepping", "blocked-in-mpi"])
def test_ctrl_c_on_one_rank_ends_every_rank_with_one_line(stop_rank_0_first):
    proc = start_mpi(2, [*TRAIN, "--log-every", "1", "--watchdog", "300"])
    try:
        assert "step" in proc.stdout.readline() + proc.stdout.readline()
        pids = rank_pids(proc)
        if stop_rank_0_first:  # rank 1 then waits inside an MPI call, where Python runs no signal handler
            os.kill(pids[0], signal.SIGSTOP)
            time.sleep(1.0)
        os.kill(pids[1], signal.SIGINT)
        seconds, err = end_of(proc, time.monotonic())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0 and seconds < WITHIN
    assert mpizero_lines(err) == ["mpizero: rank 1: interrupted (SIGINT); ending the job"], err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


@pytest.mark.parametrize("how", ["exit", "finalize", "raise"])
def test_a_rank_that_finishes_while_others_wait_ends_the_job_in_seconds(how):
    """Rank 1 leaves the training loop after step 1 (no join); the others wait in step 2 with a 600 s watchdog."""
    start = time.monotonic()
    done = run_mpi(3, ["tests/launch/finish_early.py", how], timeout=60)
    assert done.returncode != 0 and time.monotonic() - start < 30, done.stderr
    expected = "mpizero watchdog: rank 2: rank 1 finished (exited or called MPI_Finalize) while this rank waits in "
    assert [line for line in mpizero_lines(done.stderr) if line.startswith(expected)], done.stderr
    assert "must be made on every rank, not under `if rank == 0:`" in done.stderr, done.stderr  # names the fix


def test_ranks_that_finish_at_different_times_end_cleanly():
    """Rank 0 finishes 5 s after the others, which wait for it in exit-time clean-up: no false alarm."""
    done = run_mpi(3, ["tests/launch/finish_early.py", "staggered"], timeout=60)
    assert done.returncode == 0 and "finished" in done.stdout, done.stderr
    assert not mpizero_lines(done.stderr), done.stderr


def test_the_watchdog_runs_while_a_rank_waits_in_its_first_agreement():
    """mpi4py's first object all-reduce on a communicator holds the GIL while it waits; the watchdog must not."""
    start = time.monotonic()
    done = run_mpi(2, ["tests/launch/finish_early.py", "slow"], timeout=60)
    assert done.returncode != 0 and time.monotonic() - start < 30, done.stderr
    assert "mpizero watchdog: rank 0: waited 2." in done.stderr
    assert "s in allreduce of whether any rank's set-up differs (set-up); ending the job" in done.stderr


@pytest.mark.parametrize("n", [1, 3])
def test_a_process_that_makes_many_engines_shares_one_notice_and_keeps_no_idle_watchdog(n):
    """One notice per group of ranks (a rank ends once), no watchdog thread outlives its engine, and an engine's
    node-shared window is freed at the next engine's set-up: before, each of a hundred engines kept a thread
    polling and its window until exit, and each sent its own notice at exit, a second apiece."""
    out = run_mpi(n, ["-m", "mpi4py", "tests/launch/many_engines.py"], timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank "))
    watched = n > 1  # one rank without a time limit has nothing to watch
    last = "threads after 0; shared True; windows 1 per engine, 1 left"  # the last engine's, until exit
    expected = [f"rank {r}: watched while an engine lived {watched}, {last}" for r in range(n)]
    assert lines == expected, out.stdout


@pytest.mark.parametrize("how", ["finalized", "abort-never-returns"])
def test_ending_the_job_exits_with_its_status_whatever_mpi_can_still_do(how):
    """``end_job`` ends the process with its status after ``MPI_Finalize`` (no abort possible), and within its
    fallback time when the abort itself does not end it."""
    setup = {
        "finalized": "MPI.Finalize()",
        "abort-never-returns": "stuck = SimpleNamespace(Is_initialized=lambda: True, Is_finalized=lambda: False, "
        "Abort=lambda _: time.sleep(3600)); stuck.COMM_WORLD = ending.MPI = stuck; ending.ABORT_SECONDS = 0.5",
    }[how]
    imports = (
        "import time; from types import SimpleNamespace; from mpi4py import MPI; from mpizero.comm.job import ending"
    )
    code = f"{imports}; {setup}; ending.end_job(7)"
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 7 and time.monotonic() - start < 30, done.stderr
