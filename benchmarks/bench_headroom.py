"""What the exact reduction's headroom ``H`` costs: steps with kept elements, steps redone, step time.

Run: python benchmarks/bench_headroom.py [--ranks 2] [--steps 1000] [--headrooms 2 4 6 8 10] [--model mlp]
[train's own options, e.g. --width 64 --global-batch 8 --micro-batches 2]
Each headroom runs ``python -m mpizero train`` once (its defaults for any option not given) and the table gives what
``train`` prints: of all steps, those where some tensor had elements beyond the predicted range (kept in float32 and
sent by one more collective at that step), those redone because the prediction missed (``docs/bitwise.md``), and the
run's wall time (start-up included). The headroom also costs ``H`` bits of precision relative to the previous step's
largest gradient, which the table does not measure: that one is a formula.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

from mpizero.comm.job.launcher import python_under_mpiexec
from mpizero.progress import progress

PATTERNS = {
    "redone": r"redone \(scale prediction missed\): (\d+) of (\d+) steps",
    "kept": r"gradients kept beyond the predicted range: (\d+) of (\d+) steps",
}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--headrooms", type=int, nargs="+", default=[2, 4, 6, 8, 10])
    parser.add_argument("--model", default="mlp")
    return parser.parse_known_args()


def run(args, extra: list[str], headroom: int) -> dict:
    """Train once at ``headroom`` (``extra``: train's own options); return what train printed about kept and
    redone steps, and the wall time."""
    command = python_under_mpiexec(
        args.ranks, "-m", "mpizero", "train", "--model", args.model, "--steps", str(args.steps),
        "--scale-headroom", str(headroom), "--log-every", str(args.steps), *extra,
    )  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    found = {"seconds": time.perf_counter() - start}
    if done.returncode != 0:
        sys.exit(f"train failed at headroom {headroom}:\n{done.stdout}\n{done.stderr}")
    for key, pattern in PATTERNS.items():
        match = re.search(pattern, done.stdout)
        if match is None:
            sys.exit(f"train printed no line matching {pattern!r}:\n{done.stdout}")
        found[key] = float(match.group(1))
    return found


def main() -> None:
    args, extra = parse()
    rows = {}
    for headroom in progress(args.headrooms, "bench_headroom runs"):
        rows[headroom] = run(args, extra, headroom)
    print(" ".join(["train --model", args.model, "--steps", str(args.steps), *extra]) + f", {args.ranks} ranks")
    print(f"{'H':>3} {'steps with kept elements':>25} {'steps redone':>13} {'wall s':>7}")
    for headroom, row in rows.items():
        kept, redone = int(row["kept"]), int(row["redone"])
        shares = f"{kept:>15} ({kept / args.steps:6.1%}) {redone:>5} ({redone / args.steps:5.1%})"
        print(f"{headroom:>3} {shares} {row['seconds']:>7.1f}")


if __name__ == "__main__":
    main()
