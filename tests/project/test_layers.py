"""Imports run downward: the communication layer knows nothing of the engine above it, and the lowest modules
(errors, array helpers) nothing of either."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mpizero"
ABOVE = {  # a module's path under mpizero/: the mpizero modules it must not import
    "comm": ("mpizero.core", "mpizero.torch", "mpizero.training", "mpizero.checkpoint", "mpizero.cli"),
    "errors.py": ("mpizero.",),
    "libc.py": ("mpizero.",),
    "arrays.py": ("mpizero.comm", "mpizero.core", "mpizero.torch", "mpizero.training", "mpizero.checkpoint"),
}


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("where", sorted(ABOVE))
def test_a_layer_imports_nothing_above_it(where):
    files = sorted((PACKAGE / where).rglob("*.py")) if (PACKAGE / where).is_dir() else [PACKAGE / where]
    assert files
    wrong = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in files
        for name in imported(path)
        if name.startswith(ABOVE[where]) and name != "mpizero.errors"
    }
    assert not wrong, sorted(wrong)
