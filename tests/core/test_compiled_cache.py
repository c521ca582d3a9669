"""The compiled-kernel cache trusts nothing by its name: a library cut short, patched or copied from another
kernel's name is built again, never loaded; a compiler that changes the bits is found out and NumPy used; the
fallback folder under $TMPDIR is used only if it is this user's own (issue 53, point 2)."""

import os
import shutil
import stat
from pathlib import Path

import pytest
from mpirun import run_python

from mpizero import compiled
from mpizero.core.reduce import kernels

needs_compiler = pytest.mark.skipif(
    not kernels.backend().startswith("compiled"), reason=f"no compiled kernel here: {kernels.backend()}"
)
# each kernel's backend, and an encode and an update whose bytes the probe compares with NumPy's
PROBE = """
import hashlib, numpy as np, mpizero
from mpizero.core.reduce import kernels
from mpizero.core.optim import update
from mpizero.torch import fingerprint
rng = np.random.default_rng(0)
x = (rng.standard_normal(10_000) * 2.0 ** rng.integers(-20, 20, 10_000)).astype(np.float32)
total = np.zeros(x.size, np.int64)
kernels.encode(total, x, 3, 0, 0x7F000000, True)
opt = mpizero.AdamW(lr=1e-3, weight_decay=0.1)
param, state = x.copy(), {name: np.zeros_like(x) for name in opt.state_names}
update.apply_step(opt.rule, opt.rule.hyper_type(**opt.defaults), 1, param, x * 0.5, state)
print(kernels.backend(), fingerprint._compiled() is not None)
print(hashlib.sha256(total.tobytes() + param.tobytes()).hexdigest())
"""


def probe(cache: Path, **env) -> tuple[str, str, str]:
    """Run PROBE with this cache folder: (backend line, digest line, stderr); it must exit 0."""
    done = run_python(["-c", PROBE], env={compiled.CACHE_ENV_VAR: str(cache), **env}, timeout=240)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    backend, digest = done.stdout.split("\n")[:2]
    return backend, digest, done.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, str]:
    """A cache filled by one run, and that run's digest."""
    cache = tmp_path_factory.mktemp("cache")
    backend, digest, _ = probe(cache)
    assert backend.startswith("compiled") and backend.endswith("True"), backend
    return cache, digest


def damaged_copy(cache: Path, tmp_path: Path, damage) -> Path:
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    for library in sorted(copy.glob("*.so")):
        damage(library, copy)
    return copy


def cut(library: Path, _) -> None:
    os.truncate(library, 4000)  # a cut library mapped by the loader ends the process with Bus error


def patched(library: Path, _) -> None:
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF
    library.write_bytes(bytes(data))


def foreign(library: Path, cache: Path) -> None:
    """Another kernel's library (and its record) under this one's name."""
    others = [other for other in sorted(cache.glob("*.so")) if other.name.split("-")[0] != library.name.split("-")[0]]
    shutil.copyfile(others[0], library)


def foreign_with_record(library: Path, cache: Path) -> None:
    others = [other for other in sorted(cache.glob("*.so")) if other.name.split("-")[0] != library.name.split("-")[0]]
    shutil.copyfile(others[0], library)
    shutil.copyfile(others[0].with_suffix(".json"), library.with_suffix(".json"))


@needs_compiler
@pytest.mark.parametrize("damage", [cut, patched, foreign, foreign_with_record], ids=lambda f: f.__name__)
def test_a_damaged_cached_library_is_built_again_never_loaded(reference, tmp_path, damage):
    cache, digest = reference
    damaged = damaged_copy(cache, tmp_path, damage)
    backend, again, stderr = probe(damaged)
    assert backend.startswith("compiled") and backend.endswith("True"), (backend, stderr)
    assert again == digest
    for library in damaged.glob("*.so"):  # rebuilt in place: the record describes the library again
        assert compiled._intact(library, compiled.json.loads(library.with_suffix(".json").read_bytes())["identity"])


def wrapper(tmp_path: Path, extra: str) -> str:
    """A compiler wrapper as sites write them: the system compiler with ``extra`` flags appended."""
    path = tmp_path / "cc-wrapper"
    path.write_text(f'#!/bin/sh\nexec {shutil.which("cc") or "gcc"} "$@" {extra}\n')
    path.chmod(0o755)
    return str(path)


@needs_compiler
def test_a_compiler_that_adds_fast_math_is_refused_and_numpy_gives_the_bytes(reference, tmp_path):
    _, digest = reference
    cc = wrapper(tmp_path, "-ffast-math -ffp-contract=fast")
    backend, again, stderr = probe(tmp_path / "cache", CC=cc)
    assert backend.startswith("numpy (") and "fast math is on" in backend, backend
    assert "did not compile, so NumPy evaluates it" in stderr and again == digest


@needs_compiler
def test_a_compiler_that_contracts_multiply_adds_is_found_by_the_self_test(reference, tmp_path):
    """``-ffp-contract=fast`` appended after ``-ffp-contract=off`` fuses the update's multiply-adds: the self-test
    finds other bits on its probe values, warns naming the compiler and flags, and NumPy's bytes come out."""
    _, digest = reference
    cc = wrapper(tmp_path, "-ffp-contract=fast")  # MZ_CLONES' x86-64-v3 and v4 loops have fused multiply-adds
    _, again, stderr = probe(tmp_path / "cache", CC=cc)
    assert again == digest
    if "gives other bits than NumPy's formula" not in stderr:  # no fused multiply-add on this CPU: nothing to find
        pytest.skip(f"{cc} fused nothing here: {stderr[-300:]}")
    assert cc in stderr and "-ffp-contract=off" in stderr, stderr


def test_a_shared_temporary_cache_folder_is_used_only_if_private(tmp_path):
    """Where the cache folder cannot be made, ``$TMPDIR/mpizero-UID`` is made 0700; one another user could write in
    is not used (the kernels fall back to NumPy, saying why)."""
    unmakeable = tmp_path / "a-file"
    unmakeable.write_text("")
    env = {compiled.CACHE_ENV_VAR: str(unmakeable / "cache"), "TMPDIR": str(tmp_path)}
    script = "from mpizero.core.reduce import kernels; print(kernels.backend())"
    done = run_python(["-c", script], env=env)
    folder = tmp_path / f"mpizero-{os.getuid()}"
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert done.stdout.startswith("compiled") or "no C compiler" in done.stdout, done.stdout
    shutil.rmtree(folder)
    folder.mkdir()
    folder.chmod(0o777)  # as another user could have made it, for anyone to plant a library in
    done = run_python(["-c", script], env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("numpy (") and "not a private folder" in done.stdout, done.stdout
    assert list(folder.iterdir()) == []
