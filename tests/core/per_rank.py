"""Run a program with this rank's own environment and mpizero code: for tests of ranks that differ.

Run: mpiexec -n N python tests/core/per_rank.py RANKS.json -m mpizero train ...
     mpiexec -n N python tests/core/per_rank.py RANKS.json script.py ARGS...
RANKS.json maps a rank ("1") to {"env": {NAME: VALUE, or null to unset}, "path": DIR}; DIR goes first on
sys.path, so that rank imports the mpizero found there. Ranks not named run unchanged.
"""

import json
import os
import runpy
import sys

with open(sys.argv[1]) as f:
    mine = json.load(f).get(os.environ.get("PMI_RANK", "0"), {})
for name, value in mine.get("env", {}).items():
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
if "path" in mine:
    sys.path.insert(0, mine["path"])
if sys.argv[2] == "-m":
    sys.argv = sys.argv[3:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
