"""python -m mpizero check MODULE:FUNCTION: your own torch model, sharded and as a single-rank reference, bit for bit.

FUNCTION (in MODULE, an importable module or a .py file) takes no arguments and returns a fresh
``mpizero.torch.Recipe``: the model, its torch.optim optimizer (and scheduler), the step's micro-batches and the
loss. Every rank trains it sharded at this world size and, in the same job, as the plain single-rank reference;
after every step the masters, the optimizer state and the buffers must have the same raw bytes. Prints one line
per stage: "bitwise" or the first MISMATCH (step, state, tensor, index, both values). Needs torch.
Run: mpiexec -n 4 python -m mpizero check examples/gpt2_recipe.py:recipe --steps 2
"""

from __future__ import annotations

import importlib
import importlib.util
import os

from mpizero.errors import ZeroError

OUTPUTS: dict = {}
OUTPUT_DIRS: dict = {}
WORK_DIRS: dict[str, str] = {}
INPUTS: dict = {}


def add_arguments(parser) -> None:
    parser.add_argument("recipe", help="MODULE:FUNCTION, a function returning a mpizero.torch.Recipe")
    parser.add_argument("--steps", type=int, default=3, help="steps to train and compare")
    parser.add_argument("--stage", default="all", choices=["0", "1", "2", "3", "all"], help="ZeRO stage, or all")
    parser.add_argument("--seed", type=int, default=0, help="what micro_batch() keys randomness to")


def check(args, world_size: int) -> None:
    if args.steps < 1:
        raise ZeroError(f"--steps must be >= 1, got {args.steps}")
    if ":" not in args.recipe:
        raise ZeroError(f"the recipe must be MODULE:FUNCTION, got {args.recipe!r}")


def load(spec: str):
    """The function ``spec`` names: MODULE:FUNCTION, MODULE a dotted name or a path to a .py file."""
    module_name, _, function = spec.rpartition(":")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            found = importlib.util.spec_from_file_location(
                os.path.splitext(os.path.basename(module_name))[0], module_name
            )
            if found is None:
                raise ImportError(f"no such file {module_name}")
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except (ImportError, FileNotFoundError) as error:
        raise ZeroError(f"cannot import {module_name!r}: {error}") from None
    if not callable(getattr(module, function, None)):
        raise ZeroError(f"{module_name!r} has no function {function!r}")
    return getattr(module, function)


def run(args, comm) -> int:
    try:
        from mpizero.torch.recipe_check import check as check_recipe
    except ImportError as error:
        raise ZeroError(f"check needs torch ({error}): pip install torch") from None
    make_recipe = load(args.recipe)
    stages = [0, 1, 2, 3] if args.stage == "all" else [int(args.stage)]
    failed = False
    for stage in stages:
        report = check_recipe(make_recipe, steps=args.steps, stage=stage, comm=comm, seed=args.seed)
        failed |= not report.bitwise
        if comm.Get_rank() == 0:
            print(f"stage {stage}  ranks {comm.Get_size()}  {report}", flush=True)
    return 1 if failed else 0
