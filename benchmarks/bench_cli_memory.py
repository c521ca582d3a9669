"""A rank's memory while ``python -m mpizero train`` runs: its share at the peak against what the engine accounts for.

Run: python benchmarks/bench_cli_memory.py [--ranks 4] [train's options; default: --stage 3 --steps 3
--width 4096 --layers 5, the 67M-parameter MLP]
Each rank runs ``train`` in-process beside a thread that reads ``/proc/self/smaps_rollup`` every 5 ms and keeps
the largest Pss (each page divided among the processes mapping it, so the node-shared blocks count once on the
host) and RSS (every rank's blocks this one maps, in full). The table sets the Pss peak of the steps beside the
engine's peak total (which counts the unit gradient the trainer hands in) plus the Pss before set-up plus
``ALLOWANCE``, the trainer's own (its activations): "over" is what that sum leaves unaccounted for. Linux only.
"""

from __future__ import annotations

import argparse
import atexit
import json
import runpy
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from mpizero.comm.job.launcher import python_under_mpiexec

ALLOWANCE = 96 << 20  # the trainer's own working memory the sum allows for (issue 38 pt 6): its activations
DEFAULT_TRAIN = ["--stage", "3", "--steps", "3", "--width", "4096", "--layers", "5"]
MIB = 1 << 20


def rollup() -> dict[str, int]:
    """This process's ``smaps_rollup`` sizes, in bytes."""
    sizes = {}
    with open("/proc/self/smaps_rollup") as rolled:
        for line in rolled:
            key, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                sizes[key] = int(rest.split()[0]) * 1024
    return sizes


def worker(out: str, train_args: list[str]) -> None:
    """Run ``train`` here while a thread keeps the Pss and RSS peaks; write them to ``out`` on exit, with the Pss
    peak as of each time ``train`` reads its peak RSS (before set-up, after the steps)."""
    from mpi4py import MPI

    from mpizero.cli import train

    peak = {"pss": 0, "rss": 0}
    pss_at_readings = []
    read_peak_rss = train.peak_rss_bytes

    def reading() -> int:
        pss_at_readings.append(max(peak["pss"], rollup()["Pss"]))
        return read_peak_rss()

    def sample() -> None:
        while True:
            sizes = rollup()
            peak["pss"], peak["rss"] = max(peak["pss"], sizes["Pss"]), max(peak["rss"], sizes["Rss"])
            time.sleep(0.005)

    def write() -> None:
        found = {**peak, "pss_at_readings": pss_at_readings}
        Path(out, f"rank{MPI.COMM_WORLD.Get_rank()}.json").write_text(json.dumps(found))

    train.peak_rss_bytes = reading
    threading.Thread(target=sample, daemon=True).start()
    atexit.register(write)
    sys.argv = ["mpizero", "train", *train_args]
    runpy.run_module("mpizero", run_name="__main__")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args, train_args = parser.parse_known_args()
    if args.worker:
        worker(args.worker, train_args)
        return
    train_args = train_args or DEFAULT_TRAIN
    with tempfile.TemporaryDirectory(prefix="bench_cli_memory.") as out:
        report = Path(out, "memory.json")
        command = python_under_mpiexec(args.ranks, __file__, "--worker", out, *train_args, "--memory-json", str(report))
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            sys.exit(f"train failed:\n{done.stdout}\n{done.stderr}")
        ranks = json.loads(report.read_text())["ranks"]
        peaks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    print(f"python -m mpizero train {' '.join(train_args)} at -n {args.ranks}; MiB a rank. Pss: each page divided")
    print("among its mappers; the steps: up to train's reading of peak RSS after them; the run: evaluation too.")
    print("rank  before set-up: RSS  Pss  engine peak  allowance  sum (Pss)  steps' peak Pss   over  run's peak Pss"
          "  peak RSS  others' blocks")  # fmt: skip
    for r, (row, peak) in enumerate(zip(ranks, peaks)):
        before_setup, after_steps = peak["pss_at_readings"]  # train reads its peak RSS twice (cli/train.py)
        total = before_setup + row["peak_total"] + ALLOWANCE
        print(
            f"{r:>4}  {row['rss_baseline'] / MIB:>18.1f}  {before_setup / MIB:>4.1f}  {row['peak_total'] / MIB:>11.1f}"
            f"  {ALLOWANCE / MIB:>9.0f}  {total / MIB:>9.1f}  {after_steps / MIB:>15.1f}"
            f"  {(after_steps - total) / MIB:>5.1f}  {peak['pss'] / MIB:>14.1f}  {peak['rss'] / MIB:>8.1f}"
            f"  {row['mapped'] / MIB:>14.1f}"
        )


if __name__ == "__main__":
    main()
