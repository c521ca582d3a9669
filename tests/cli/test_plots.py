"""The partition and memory figures are real PNGs, and owner colours sit where the partition says."""

import struct

import numpy as np
import pytest
from mpirun import run_python

from mpizero.core.partition import Partition
from mpizero.core.stages import sharding
from mpizero.training.trainer import DEFAULT_BUCKET_ELEMS

plot = pytest.importorskip("mpizero.cli.plot", reason="plot tests need matplotlib (the test extra installs it)")
pytest.importorskip("matplotlib", reason="plot tests need matplotlib (the test extra installs it)")


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def hex_rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))


@pytest.mark.parametrize("numel, ranks", [(8, 4), (8, 3), (3, 5)])
def test_partition_colours_follow_the_owner(tmp_path, numel, ranks):
    import matplotlib.image

    path = tmp_path / "partition.png"
    pixels = plot.partition_figure(numel, ranks, str(path))
    width, height = png_size(path)
    image = (matplotlib.image.imread(path)[:, :, :3] * 255).round().astype(int)
    assert image.shape[:2] == (height, width)
    partition = Partition(numel, ranks)
    for (stage, kind, index), (x, y) in pixels.items():
        sharded = getattr(sharding(stage), kind)
        expected = hex_rgb(plot.rank_colour(partition.owner(index)) if sharded else plot.REPLICATED)
        found = tuple(image[y, x])
        distance = np.abs(np.subtract(found, expected)).max()
        if index < numel:
            assert distance <= 2, (stage, kind, index, found, expected)
        else:  # padding is hatched: the centre is the fill blended towards white by the same amount in every channel
            blend = [(f - e) / (255 - e) for f, e in zip(found, expected)]
            assert max(blend) - min(blend) <= 0.05 and min(blend) >= -0.02, (stage, kind, index, found, expected)


def test_partition_png_has_the_expected_size(tmp_path):
    path = tmp_path / "p.png"
    plot.partition_figure(8, 4, str(path))
    assert png_size(path) == (600, 660)  # figsize (6, 6.6) inches at 100 dpi


def test_memory_png_from_the_estimator(tmp_path):
    path = tmp_path / "memory.png"
    done = run_python(["-m", "mpizero", "plot", "memory", "--model", "mlp", "--ranks", "4", "-o", str(path)])
    assert done.returncode == 0, done.stderr
    assert png_size(path) == (800, 450)


def test_missing_matplotlib_gives_a_clear_message(tmp_path):
    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.modules['matplotlib.backend_bases'] = None\n"
        "from mpizero.cli.main import main\n"
        f"sys.exit(main(['plot', 'partition', '-o', r'{tmp_path / 'x.png'}']))"
    )
    done = run_python(["-c", code], timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == 'mpizero: error: plotting needs matplotlib: pip install -e ".[plot]"'
    assert not (tmp_path / "x.png").exists()


def test_memory_prediction_does_not_depend_on_measuring(tmp_path, monkeypatch):
    from argparse import Namespace

    drawn = []
    monkeypatch.setattr(plot, "draw_bar", lambda ax, x, held, measured: drawn.append((measured, held)) or 1.0)
    monkeypatch.setattr(plot, "measured_bytes", lambda args, stage: {"params": 1})
    settings = dict(model="mlp", width=None, layers=2, heads=4, block_size=32, precision="fp32")
    settings.update(reduction="exact", optimizer="adamw", bucket_elems=DEFAULT_BUCKET_ELEMS, ranks=4, micro_batches=4)
    predicted = {}
    for measure in (False, True):
        plot.memory_figure(Namespace(measure=measure, **settings), str(tmp_path / f"m{measure}.png"))
        predicted[measure] = [held for was_measured, held in drawn if not was_measured]
        drawn.clear()
    assert predicted[False] == predicted[True] and len(predicted[False]) == 4
    arena = [held["arena"] for held in predicted[False]]
    assert arena[:2] == [0, 0] and arena[2] > 0 and all(held["comm"] == 0 for held in predicted[False][2:])
