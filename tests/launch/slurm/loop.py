"""Submit ``sbatch launch/slurm.sbatch train`` N times in a row on a two-node test cluster, under CPU load.

Run from the repository root, as root, with the virtual environment active:

    PYTHONPATH=$PWD:$PWD/tests:$PWD/tests/launch python tests/launch/slurm/loop.py --jobs 20 --load 4

Prints one line per job (state, seconds, bitwise or not) and a summary; exits 1 if any job failed.
``--env KEY=VALUE`` (repeatable) adds to the jobs' environment, e.g. to try another MPICH netmod.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cluster.nodes import TCP_ENV, nodes
from mpirun import run_mpi_ok
from test_slurm import JOB_ENV, ROOT, TRAIN

from slurm.daemons import SlurmNode, slurm_cluster


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--load", type=int, default=4, help="busy processes running beside the jobs")
    parser.add_argument("--per-node", type=int, default=2)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the jobs")
    args = parser.parse_args()
    env = {**JOB_ENV, **TCP_ENV, **dict(kv.split("=", 1) for kv in args.env)}
    work = Path(tempfile.mkdtemp(prefix="mpizero-loop-"))
    run_mpi_ok(1, ["-m", "mpizero", *TRAIN, "--save-params", str(work / "ref.npy")])
    reference = (work / "ref.npy").read_bytes()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    failed = 0
    try:
        with nodes(2) as namespaces:
            wrap = [lambda argv, i=i: namespaces.command(i, argv) for i in range(2)]
            slurm_nodes = [SlurmNode(n.name, n.address, wrap[n.index]) for n in namespaces.nodes]
            with slurm_cluster(slurm_nodes) as cluster:
                for job in range(1, args.jobs + 1):
                    params = work / f"p{job}.npy"
                    sbatch = ["--nodes=2", f"--ntasks-per-node={args.per_node}", "launch/slurm.sbatch"]
                    start = time.monotonic()
                    try:
                        state, out = cluster.sbatch([*sbatch, *TRAIN, "--save-params", str(params)], 60, env, ROOT)
                    except AssertionError as hung:
                        state, out = "HUNG", str(hung)
                    bitwise = params.exists() and params.read_bytes() == reference
                    failed += not (state == "COMPLETED" and bitwise)
                    print(f"job {job:3d}: {state:10s} {time.monotonic() - start:5.1f} s  bitwise {bitwise}", flush=True)
                    if not (state == "COMPLETED" and bitwise):
                        print(out[-2000:], flush=True)
    finally:
        for hog in hogs:
            hog.kill()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.jobs - failed} of {args.jobs} jobs completed bitwise under {args.load} busy processes")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
