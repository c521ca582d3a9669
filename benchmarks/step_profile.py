"""Where a step's time goes on one rank: ``bench_peers.py --profile``'s table.

cProfile over the timed steps after warm-up; each function's own time is charged to an area (an ``mpizero``
package, torch, NumPy, MPI, transformers, the rest), so what is compute (torch's kernels, the update and encode
kernels) and what is per-step overhead (Python per tensor, small messages, agreements) can be read apart.
"""

from __future__ import annotations

import cProfile
import pstats
from collections import defaultdict

AREAS = (  # (what a function's file or name contains, its area), first match wins
    ("mpi4py", "MPI (mpi4py)"),
    ("/mpizero/", "mpizero."),
    ("/torch/", "torch"),
    ("torch._C", "torch"),
    ("/numpy/", "numpy"),
    ("numpy.", "numpy"),
    ("/transformers/", "transformers"),
)


def area(filename: str, name: str) -> str:
    """The area a function belongs to: ``mpizero.<package>``, torch, numpy, MPI, transformers or other."""
    where = f"{filename} {name}"
    for marker, label in AREAS:
        if marker in where:
            if label == "mpizero.":
                return label + filename.split("/mpizero/", 1)[1].split("/")[0].removesuffix(".py")
            return label
    return "other (Python, builtins)"


def table(profile: cProfile.Profile, steps: int, top: int, rank: int = 0) -> str:
    """Own time per step by area, then the ``top`` functions by own time, in ms per step, of rank ``rank``."""
    stats = pstats.Stats(profile).stats
    by_area: dict[str, float] = defaultdict(float)
    rows = []
    for (filename, line, name), (_, calls, own, _, _) in stats.items():
        by_area[area(filename, name)] += own
        rows.append((own, calls, f"{filename.rsplit('/', 2)[-1] if filename != '~' else ''}:{line} {name}"))
    total = sum(by_area.values())
    lines = [f"profile of rank {rank}, {steps} steps: {total / steps * 1e3:.1f} ms a step", "own ms/step  area"]
    lines += [f"{t / steps * 1e3:>11.1f}  {a}" for a, t in sorted(by_area.items(), key=lambda kv: -kv[1])]
    lines += ["own ms/step  calls/step  function"]
    for own, calls, where in sorted(rows, reverse=True)[:top]:
        lines.append(f"{own / steps * 1e3:>11.2f}  {calls / steps:>10.0f}  {where}")
    return "\n".join(lines)
