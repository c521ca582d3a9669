"""benchmarks/bench_peers.py at a tiny size: each kind of configuration runs and its table row matches its JSON
lines; a framework that is not installed is skipped with its reason; the bandwidth line measures something.
Nothing here depends on how fast anything ran."""

import json
import subprocess
import sys

import pytest
from mpirun import ROOT, run_python

BENCH = ROOT / "benchmarks" / "bench_peers.py"
sys.path.insert(0, str(BENCH.parent))
import roofline  # noqa: E402

NOT_INSTALLED = 'deepspeed is not installed (pip install -e ".[peers]" after the CPU build of torch)'
TINY = ["--ranks", "2", "--width", "32", "--layers", "2", "--batch", "8", "--steps", "3"]
# Runs the benchmark with some modules made unimportable, as if they were not installed (sys.argv[1]: their names)
HIDING = (
    "import runpy, sys; sys.modules.update(dict.fromkeys(sys.argv.pop(1).split(',')));"
    f"sys.path.insert(0, {str(BENCH.parent)!r}); runpy.run_path({str(BENCH)!r}, run_name='__main__')"
)


def bench(tmp_path, args: list[str], hide: tuple[str, ...] = ()) -> tuple[dict, list[dict], list[str]]:
    """Run the benchmark; return its table's rows by configuration (split on spaces), its JSON lines, and the
    roofline table's lines (none without ``--bandwidth``)."""
    results = tmp_path / "results.jsonl"
    python = [sys.executable, "-c", HIDING, ",".join(hide)] if hide else [sys.executable, str(BENCH)]
    done = subprocess.run(
        [*python, *TINY, *args, "--json", str(results)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    lines = done.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("configuration")) + 1
    end = next((i for i, line in enumerate(lines) if line.startswith("roofline:")), len(lines))
    rows = {line.split()[0]: line.split()[1:] for line in lines[start:end]}
    return rows, [json.loads(line) for line in results.read_text().splitlines()], lines[end:]


def check_runs(rows: dict, runs: list[dict], configs: list[str], counts: list[int]) -> None:
    """One JSON line per configuration and count, with every step timed, and the table showing its median."""
    assert [(r["config"], r["micro_batches"]) for r in runs] == [(c, k) for c in configs for k in counts]
    assert list(rows) == configs
    for run in runs:
        assert len(run["times"]) == 3 and min(run["times"]) > 0, run
        assert run["rss"] > run.get("above", 0) >= 0, run
        column = 2 * counts.index(run["micro_batches"])
        assert float(rows[run["config"]][column]) == round(run["median_ms"], 1), (rows, run)


def test_torch_ddp_and_mpizero_torch_at_two_micro_batch_counts(tmp_path):
    """One mpizero.torch stage: the harness runs every stage alike (the stage is an argument of shard())."""
    pytest.importorskip("torch", reason="needs the CPU build of torch (pip install torch==2.13.0)")
    configs = ["torch-ddp", "mpizero.torch-1"]
    bandwidth = ["--bandwidth", "--bandwidth-mib", "8"]
    rows, runs, roof = bench(tmp_path, ["--configs", *configs, "--micro-batches", "2", "1", *bandwidth])
    check_runs(rows, runs, configs, [2, 1])
    ddp = {r["micro_batches"]: r["median_ms"] for r in runs if r["config"] == "torch-ddp"}
    for run in runs:
        ratio = rows[run["config"]][2 * [2, 1].index(run["micro_batches"]) + 1]
        assert float(ratio) == round(run["median_ms"] / ddp[run["micro_batches"]], 2), (rows, run)
    assert rows["torch-ddp"][1] == rows["torch-ddp"][3] == "1.00"
    # the roofline: per count the bytes per parameter the model gives, their time at the measured rate, the ratio
    rate = float(roof[0].split(" GB/s per rank")[0].split()[-1]) * 1e9
    params = 2 * (32 * 32 + 32)
    by_config = {line.split()[0]: line.split()[1:] for line in roof[2:]}
    assert list(by_config) == configs, roof
    for run in runs:
        moved, floor, times = by_config[run["config"]][3 * [2, 1].index(run["micro_batches"]) :][:3]
        exact = roofline.step_bytes(run["config"], 2, run["micro_batches"])
        assert float(moved) == round(exact), (roof, run)
        assert float(floor) == pytest.approx(exact * params / rate * 1e3, rel=0.02), (roof, run)
        assert float(times) == pytest.approx(run["median_ms"] / float(floor), rel=0.02), (roof, run)
    assert roofline.step_bytes("torch-fsdp2", 2, 8) is None  # not modelled: no roofline row


def test_the_gpt_row_trains_transformers_gpt2_and_skips_the_engine_only_configurations(tmp_path):
    """The transformer row: mpizero.torch stage 3 (each block a unit) on a GPT-2 from a config (the peers' workers
    take the model from the same ``peers_models``); the NumPy engine's configurations say they train the MLP only."""
    pytest.importorskip("transformers", reason="the GPT row builds transformers' GPT-2 from a config")
    configs = ["mpizero.torch-3", "mpizero-2-exact"]
    gpt = ["--model", "gpt", "--seq", "16", "--micro-batches", "2", "--configs", *configs]
    rows, runs, _ = bench(tmp_path, gpt)
    check_runs({configs[0]: rows[configs[0]]}, runs[:1], configs[:1], [2])
    assert " ".join(rows["mpizero-2-exact"]) == "skipped: the engine-only configurations train the NumPy MLP only"


def test_deepspeed_stages_1_and_3_accumulate_and_step_once_per_step(tmp_path):
    """Stage 2 differs from 1 only in DeepSpeed's config value, which the worker writes for every stage alike."""
    pytest.importorskip("deepspeed", reason='needs DeepSpeed: pip install -e ".[peers]" after the CPU build of torch')
    configs = ["deepspeed-1", "deepspeed-3"]
    rows, runs, _ = bench(tmp_path, ["--configs", *configs, "--micro-batches", "2"])
    check_runs(rows, runs, configs, [2])
    assert [r["optimizer_steps"] for r in runs] == [3, 3], runs  # 2 micro-batches, 1 update: 3 steps
    assert all(row[1] == "-" for row in rows.values()), rows  # no DDP run: no ratio


def test_a_framework_not_installed_is_skipped_with_its_reason_and_the_rest_runs_and_is_drawn(tmp_path):
    chart = tmp_path / "chart.png"
    configs = ["--configs", "deepspeed-2", "mpizero-1-exact", "--micro-batches", "2", "--chart", str(chart)]
    rows, runs, _ = bench(tmp_path, configs, ("deepspeed",))
    assert " ".join(rows["deepspeed-2"]) == f"skipped: {NOT_INSTALLED}"
    assert runs[0] == {"config": "deepspeed-2", "skipped": NOT_INSTALLED}
    check_runs({"mpizero-1-exact": rows["mpizero-1-exact"]}, runs[1:], ["mpizero-1-exact"], [2])
    assert chart.read_bytes().startswith(b"\x89PNG")


def test_the_bandwidth_line_gives_copy_and_add_for_one_and_two_processes(tmp_path):
    done = run_python([str(BENCH), "--bandwidth", "--bandwidth-mib", "8", "--configs"])
    assert done.returncode == 0, done.stderr
    line = done.stdout.splitlines()[0]
    assert line.startswith("memory bandwidth (NumPy, two 8 MiB float64 arrays per process"), line
    rates = [float(word) for word, unit in zip(line.split(), line.split()[1:]) if unit.startswith("GB/s")]
    assert len(rates) == 4 and min(rates) > 0, line
