"""No hangs: a rank stopped with SIGSTOP anywhere in a training job ends the whole job within the watchdog period.

The watchdog covers every collective because every collective goes through
``Collectives``; these tests stop one rank at different moments (stages 0-3,
with clipping, while loading data, while saving a checkpoint) and time the end.
"""

import os
import signal
import subprocess
import time

import pytest
from mpirun import rank_pids, start_mpi

WATCHDOG = 3.0
GRACE = 12.0  # process start-up is excluded; this covers the watchdog's poll, its report and mpiexec's clean-up


def stop_one_rank_and_time_the_end(args: list[str], delay: float) -> tuple[float, str]:
    """Start a 2-rank job, SIGSTOP rank 1 after ``delay`` s of stepping; return seconds until the job ended, stderr."""
    proc = start_mpi(2, ["-m", "mpizero", *args, "--watchdog", str(WATCHDOG)])
    try:
        assert "step" in proc.stdout.readline() + proc.stdout.readline()  # header, then the first step's line
        time.sleep(delay)
        pids = rank_pids(proc)
        assert set(pids) == {0, 1}, pids
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=WATCHDOG + GRACE)
        return time.monotonic() - stopped, err
    except subprocess.TimeoutExpired:
        raise AssertionError(f"hung: still running {WATCHDOG + GRACE} s after rank 1 was stopped") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


TRAIN = ["train", "--steps", "100000", "--global-batch", "8", "--micro-batches", "2", "--log-every", "1"]


@pytest.mark.parametrize(
    "stage, extra, delay",
    [
        (0, [], 0.3),
        (1, ["--model", "transformer", "--width", "32"], 0.7),
        (2, ["--reduction", "native"], 0.1),
        (3, ["--model", "transformer", "--width", "32"], 0.45),
        (2, ["--checkpoint-dir", "{tmp}", "--checkpoint-every", "1"], 0.2),
    ],
)
def test_a_stopped_rank_ends_the_job_within_the_watchdog_period(tmp_path, stage, extra, delay):
    extra = [str(tmp_path) if a == "{tmp}" else a for a in extra]
    seconds, err = stop_one_rank_and_time_the_end([*TRAIN, "--stage", str(stage), *extra], delay)
    assert "mpizero watchdog: rank 0: waited" in err and "ending the job" in err, err
    assert seconds < WATCHDOG + GRACE
