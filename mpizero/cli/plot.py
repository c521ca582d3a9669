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

from mpizero import files
from mpizero.cli import options
from mpizero.comm.job.launcher import python_under_mpiexec
from mpizero.core import formulas
from mpizero.core.partition import Partition
from mpizero.core.stages import STAGES, sharding
from mpizero.errors import ZeroError

OUTPUTS = {"output": "-o/--output"}
INPUTS: dict[str, str] = {}
OUTPUT_DIRS: dict[str, str] = {}
WORK_DIRS: dict[str, str] = {}
ROWS = (("parameters", "params"), ("gradients", "grads"), ("optimizer state", "optimizer"))
KINDS = ("params", "grads", "master", "optimizer", "comm")
COLOURS = dict(zip(KINDS, ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")))
ARENA = "#d9c8ea"  # the shared arena: a lighter ``comm``
REPLICATED = "#b0b0b0"
DPI = 100
MAX_PARTITION_PARAMS = 64  # one cell per parameter: beyond this the figure is too wide to read


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("figure", choices=list(FIGURES), help="which figure to draw")
    parser.add_argument(
        "-o", "--output", required=True, type=options.path, help="the image file to write (.png, .pdf, .svg, ...)"
    )
    options.add(parser, "ranks")
    parser.add_argument(
        "--params",
        type=options.whole(1, MAX_PARTITION_PARAMS),
        default=8,
        help="partition: parameters in the flat buffer",
    )
    parser.add_argument("--measure", action="store_true", help="memory: also run two steps per stage under mpiexec")
    options.add(parser, *options.MODEL_SETTINGS)
    options.add(parser, "micro_batches", help="memory: micro-batches per step, all ranks")


def check(args, world_size: int) -> None:
    """Raise a ZeroError unless matplotlib can write the output format for a model that can exist."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ZeroError('plotting needs matplotlib: pip install -e ".[plot]"') from None
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = os.path.splitext(args.output)[1][1:].lower()
    if suffix not in formats:
        raise ZeroError(f"-o/--output {args.output} must end in an image format: {', '.join(sorted(formats))}")
    if args.figure == "memory":
        options.raise_problems(options.model_problems(args))


def pyplot():
    """Import matplotlib's pyplot headless."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def rank_colour(rank: int) -> str:
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
    return palette[rank % len(palette)]


def run(args, comm) -> int:
    if comm.Get_rank() != 0:
        return 0
    FIGURES[args.figure](args)
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
    axes[-1].set_xlabel("element of the flat parameter buffer")
    handles = [plt.Rectangle((0, 0), 1, 1, color=rank_colour(r)) for r in range(ranks)]
    handles += [plt.Rectangle((0, 0), 1, 1, color=REPLICATED), plt.Rectangle((0, 0), 1, 1, fill=False, hatch="xx")]
    labels = [f"rank {r}" for r in range(ranks)] + ["replicated", "padding"]
    columns = 4
    legend_rows = -(-len(labels) // columns)
    fig.legend(handles, labels, loc="lower center", ncol=columns, frameon=False)
    fig.tight_layout(rect=(0, 0.3 * legend_rows / fig.get_size_inches()[1], 1, 1))
    fig.canvas.draw()
    height = fig.get_size_inches()[1] * DPI
    pixels = {}
    for (stage, kind, i), xy in centres.items():
        x, y = axes[stages.index(stage)].transData.transform(xy)
        pixels[(stage, kind, i)] = (int(round(x)), int(round(height - y)))
    save(fig, path)
    plt.close(fig)
    return pixels


def measured_bytes(args, stage: int) -> dict:
    """Run two training steps of ``stage`` under mpiexec on this host; return rank 0's memory held after them."""
    micro_batches = max(args.micro_batches, args.ranks)
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "memory.json")
        command = python_under_mpiexec(args.ranks, "-m", "mpizero", "train", "--stage", str(stage), "--steps", "2")
        for name in options.MODEL_SETTINGS:
            value = getattr(args, name)
            if value is not None:
                command += [f"--{name.replace('_', '-')}", str(value)]
        command += ["--micro-batches", str(micro_batches), "--global-batch", str(16 * micro_batches)]
        command += ["--log-every", "1000", "--memory-json", report]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise ZeroError(f"measuring stage {stage} failed (exit {done.returncode}): {last}")
        with open(report) as f:
            return json.load(f)["now"]


def predicted_bytes(setup: formulas.Setup) -> dict:
    """Bytes per rank by kind as ``estimate`` predicts them with every rank on one host, as ``--measure`` runs
    them (stage 0's averaged grads node-shared: a block a rank), the shared accumulators that adds apart."""
    held = formulas.engine_bytes(setup)
    one_host = formulas.engine_bytes(dataclasses.replace(setup, shared_memory=True))
    return {**{kind: one_host[kind] for kind in KINDS}, "comm": held["comm"], "arena": one_host["comm"] - held["comm"]}


def draw_bar(ax, x: float, held: dict, measured: bool) -> float:
    """Stack one bar of KiB by kind at ``x``; return its top."""
    bottom = 0.0
    for kind in (*KINDS, "arena"):
        if kind in held:
            colour = ARENA if kind == "arena" else COLOURS[kind]
            ax.bar(
                x,
                held[kind] / 1024,
                0.34,
                bottom=bottom,
                color=colour,
                edgecolor="black",
                hatch="//" if measured else None,
            )
            bottom += held[kind] / 1024
    return bottom


def memory_figure(args, path: str) -> None:
    """Bars per stage: predicted bytes by kind (the shared arena on top), and the measured ones if asked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for stage, setup in options.model_setups(args):
        columns = [("p", predicted_bytes(setup))]
        if args.measure:
            columns.append(("m", measured_bytes(args, stage)))
        for offset, (label, held) in enumerate(columns):
            x = stage + (offset - 0.5 * (len(columns) - 1)) * 0.38
            top = draw_bar(ax, x, held, measured=label == "m")
            if args.measure:
                ax.text(x, top, label, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(STAGES), [f"stage {s}" for s in STAGES])
    ax.set_ylim(0, ax.get_ylim()[1] * 1.06)  # room for the p and m labels
    ax.set_ylabel("KiB per rank")
    measured = "; p = predicted, m = measured here (hatched)" if args.measure else ": predicted"
    ax.set_title(f"{args.model}, {args.ranks} ranks, {args.precision}, {args.reduction}{measured}")
    names = [*KINDS, "comm: shared arena\n(all ranks on one host)"]
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=c) for c in (*COLOURS.values(), ARENA)], names)
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)


def save(fig, path: str) -> None:
    """Write the figure atomically, in the format its file name's suffix names."""
    suffix = os.path.splitext(path)[1][1:].lower()
    files.write(path, lambda f: fig.savefig(f, dpi=DPI, format=suffix))


FIGURES = {
    "partition": lambda args: partition_figure(args.params, args.ranks, args.output),
    "memory": lambda args: memory_figure(args, args.output),
}
