"""Gradient accumulation costs no per-micro-batch memory, and the engine's accounting explains the process's."""

import json

import numpy as np
import pytest
from mpirun import run_mpi_ok

from mpizero import SGD, ZeroEngine

MIB = 2**20
# 12.7M parameters; the same global batch of 32 sequences as 2 or 16 micro-batches over 2 ranks
MODEL = ["--model", "transformer", "--width", "512", "--layers", "4", "--block-size", "16", "--global-batch", "32"]
MARGIN = 256 * MIB  # besides the engine's buffers: activations, the shared arena's other segments, allocator slack


def memory_report(tmp_path, micro_batches: int) -> dict:
    path = tmp_path / f"memory-{micro_batches}.json"
    args = ["-m", "mpizero", "train", *MODEL, "--micro-batches", str(micro_batches), "--stage", "3", "--steps", "2"]
    run_mpi_ok(2, [*args, "--memory-json", str(path), "--log-every", "100"], timeout=240)
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("accumulation")
    return {per_rank: memory_report(tmp_path, 2 * per_rank) for per_rank in (1, 8)}


def test_eight_micro_batches_per_rank_need_no_more_memory_than_one(reports):
    assert reports[8]["rss_steps"] <= 1.10 * reports[1]["rss_steps"], {k: r["rss_steps"] for k, r in reports.items()}


@pytest.mark.parametrize("per_rank", [1, 8])
def test_the_engines_peak_explains_the_process_memory_above_the_baseline(reports, per_rank):
    report = reports[per_rank]
    beyond_baseline = report["rss_steps"] - report["rss_baseline"]
    assert report["peak_total"] <= beyond_baseline <= report["peak_total"] + MARGIN, report


@pytest.mark.parametrize("stage", range(4))
def test_the_peak_counts_a_contribution_while_it_is_handed_in(stage):
    """The caller's gradients are alive while the engine reads them (the layer-wise trainer's unit gradient, which
    the engine's peak left to the allowance before: issue 38 pt 6): the peak's grads count them."""
    grads = {"w": np.full((64, 32), 0.5, np.float32)}
    engine = ZeroEngine({"w": np.ones((64, 32), np.float32)}, SGD(lr=0.1), stage=stage)
    engine.step(grads)  # the first step measures the scales
    engine.memory_log.peak = dict.fromkeys(engine.memory_log.peak, 0)  # the second step's peak alone
    held = engine.memory()["grads"]
    engine.accumulate(grads, keep="reference", can_redo=True)
    engine.step()
    assert engine.memory_report()["peak"]["grads"] >= held + grads["w"].nbytes
    engine.memory_log.peak = dict.fromkeys(engine.memory_log.peak, 0)  # ... and one handed to step() itself
    engine.step([grads, grads])
    assert engine.memory_report()["peak"]["grads"] >= held + 2 * grads["w"].nbytes
