"""``python -m mpizero plot {partition,memory}``: the partition figure and the memory-per-rank chart.

Run: ``python -m mpizero plot partition --ranks 4 --params 8 -o partition.png``
and ``python -m mpizero plot memory --model mlp --ranks 4 --measure -o memory.png``.
Needs matplotlib (``pip install -e ".[plot]"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import tempfile

from mpizero.cli.estimate import model_setups
from mpizero.comm.launcher import python_under_mpiexec
from mpizero.core import formulas
from mpizero.core.partition import Partition
from mpizero.core.stages import STAGES, sharding

ROWS = (("parameters", "params"), ("gradients", "grads"), ("optimizer state", "optimizer"))
REPLICATED = "#b0b0b0"
DPI = 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("figure", choices=["partition", "memory"])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--params", type=int, default=8, help="partition: parameters in the flat buffer")
    parser.add_argument("--model", default="mlp", choices=["mlp", "transformer"], help="memory: the model")
    parser.add_argument("--measure", action="store_true", help="memory: also run each stage under mpiexec")
    parser.add_argument("-o", "--output", required=True)
    for flag, default in (("--width", None), ("--layers", 2), ("--heads", 4), ("--block-size", 32)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--reduction", default="exact")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--bucket-elems", type=int, default=1 << 21)
    parser.add_argument("--micro-batches", type=int, default=4)


def pyplot():
    """Import matplotlib's pyplot headless, or exit with a message saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('plotting needs matplotlib: pip install -e ".[plot]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def rank_colour(rank: int) -> str:
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
    return palette[rank % len(palette)]


def run(args, comm) -> int:
    if comm.Get_rank() != 0:
        return 0
    if args.ranks < 1 or args.params < 1:
        raise SystemExit(f"--ranks and --params must be >= 1, got {args.ranks} and {args.params}")
    if args.figure == "partition":
        partition_figure(args.params, args.ranks, args.output)
    else:
        memory_figure(args, args.output)
    print(f"wrote {args.output}")
    return 0


def partition_figure(numel: int, ranks: int, path: str) -> dict:
    """Draw which rank owns each element per stage and state; return each cell's centre in PNG pixels."""
    plt = pyplot()
    partition = Partition(numel, ranks)
    stages = [s for s in STAGES if s > 0]
    fig, axes = plt.subplots(len(stages), 1, figsize=(max(6, 0.5 * partition.padded_numel + 2), 2.2 * len(stages)))
    centres = {}
    for ax, stage in zip(axes, stages):
        plan = sharding(stage)
        for row, (_, kind) in enumerate(ROWS):
            sharded = plan.shards(kind)
            y = len(ROWS) - 1 - row
            for i in range(partition.padded_numel):
                padding = i >= numel
                colour = rank_colour(partition.owner(i)) if sharded else REPLICATED
                ax.add_patch(
                    plt.Rectangle((i, y), 1, 1, facecolor=colour, edgecolor="white", hatch="xx" if padding else None)
                )
                centres[(stage, kind, i)] = (i + 0.5, y + 0.5)
        ax.set_xlim(0, partition.padded_numel)
        ax.set_ylim(0, len(ROWS))
        ax.set_yticks([len(ROWS) - 0.5 - r for r in range(len(ROWS))], [label for label, _ in ROWS])
        ax.set_xticks([i + 0.5 for i in range(partition.padded_numel)], range(partition.padded_numel))
        ax.set_title(f"Stage {stage}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=rank_colour(r)) for r in range(ranks)]
    handles += [plt.Rectangle((0, 0), 1, 1, color=REPLICATED), plt.Rectangle((0, 0), 1, 1, fill=False, hatch="xx")]
    labels = [f"rank {r}" for r in range(ranks)] + ["replicated", "padding"]
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6))
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.canvas.draw()
    height = fig.get_size_inches()[1] * DPI
    pixels = {}
    for (stage, kind, i), xy in centres.items():
        x, y = axes[stages.index(stage)].transData.transform(xy)
        pixels[(stage, kind, i)] = (int(round(x)), int(round(height - y)))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return pixels


def measured_bytes(args, stage: int) -> dict:
    """Run two training steps of ``stage`` under mpiexec and return rank 0's memory report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "memory.json")
        command = python_under_mpiexec(args.ranks, "-m", "mpizero", "train")
        command += ["--model", args.model, "--stage", str(stage), "--steps", "2"]
        command += ["--micro-batches", str(max(args.micro_batches, args.ranks)), "--memory-json", report]
        command += ["--global-batch", str(16 * max(args.micro_batches, args.ranks)), "--log-every", "1000"]
        subprocess.run(command, check=True, capture_output=True, timeout=600)
        with open(report) as f:
            return json.load(f)


def memory_figure(args, path: str) -> None:
    """Bars per stage: predicted bytes by kind, and beside them the measured ones if asked."""
    plt = pyplot()
    kinds = ("params", "grads", "master", "optimizer", "comm")
    colours = dict(zip(kinds, ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for stage, setup in model_setups(args):
        if args.measure:  # the measured run is on this host, so stages 2-3 use the shared arena
            setup = dataclasses.replace(setup, shared_arena=True)
        columns = [("predicted", formulas.engine_bytes(setup))]
        if args.measure:
            columns.append(("measured", measured_bytes(args, stage)["now"]))
        for offset, (label, held) in enumerate(columns):
            x, bottom = stage + (offset - 0.5 * (len(columns) - 1)) * 0.38, 0.0
            for kind in kinds:
                ax.bar(
                    x,
                    held[kind] / 1024,
                    0.34,
                    bottom=bottom,
                    color=colours[kind],
                    edgecolor="black",
                    hatch="//" if label == "measured" else None,
                )
                bottom += held[kind] / 1024
            ax.text(x, bottom, label[0], ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(STAGES), [f"stage {s}" for s in STAGES])
    ax.set_ylabel("KiB per rank")
    ax.set_title(f"{args.model}, {args.ranks} ranks, {args.precision}, {args.reduction}: p = predicted, m = measured")
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in kinds], kinds)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
