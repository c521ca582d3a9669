"""The package's rooms and floors (``docs/architecture.md``): every import runs down, every room is placed.

A room is a top-level module of ``mpizero``, one of its packages, a package inside ``core``, or ``comm.job``.
An import from one room to another must go to a lower floor, so no cycle can form and each room can be read
knowing only those below it. A new room fails here until it is given a floor (and a row in the page).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mpizero"
FLOORS = {
    "mpizero.errors": 0,
    "mpizero.libc": 0,
    "mpizero.compiler": 0,
    "mpizero.progress": 0,
    "mpizero.standin": 0,
    "mpizero.arrays": 1,
    "mpizero.files": 1,
    "mpizero.heap": 1,
    "mpizero.comm.job": 2,
    "mpizero.comm": 3,
    "mpizero.testing": 3,
    "mpizero.checkpoint_key": 4,
    "mpizero.core.optim": 4,
    "mpizero.core.reduce": 4,
    "mpizero.core.states": 4,
    "mpizero.core": 5,
    "mpizero": 6,
    "mpizero.checkpoint": 6,
    "mpizero.training": 7,
    "mpizero.torch": 7,
    "mpizero.cli": 8,
    "mpizero.__main__": 9,
}


def room(module: str) -> str:
    """The room ``module`` (dotted) belongs to: a package inside ``core``, ``comm.job``, or the top-level module
    or package (``comm.transports`` is part of ``comm``: it moves bytes with ``comm``'s buffers and windows)."""
    parts = module.split(".")
    inside_core = len(parts) >= 3 and parts[1] == "core" and (PACKAGE / "core" / parts[2]).is_dir()
    if inside_core or parts[1:3] == ["comm", "job"]:
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def imported(path: Path) -> set[str]:
    """The ``mpizero`` modules (or packages) a file imports, anywhere in it, each as specific as can be told."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "mpizero"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mpizero":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                is_module = (ROOT / full.replace(".", "/")).with_suffix(".py").exists()
                found.add(full if is_module or (ROOT / full.replace(".", "/")).is_dir() else node.module)
    return found


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def arrows() -> list[tuple[str, str, str]]:
    """``(from room, to room, file)`` for every import between two rooms."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = room(module_of(path))
        name = str(path.relative_to(ROOT))
        found += [(here, room(target), name) for target in imported(path) if room(target) != here]
    return found


def test_every_room_has_a_floor():
    rooms = {room(module_of(path)) for path in PACKAGE.rglob("*.py")}
    assert rooms == set(FLOORS), f"unplaced: {sorted(rooms - set(FLOORS))}, gone: {sorted(set(FLOORS) - rooms)}"


def test_every_import_runs_down():
    upward = [(a, b, f) for a, b, f in arrows() if FLOORS[b] >= FLOORS[a]]
    assert not upward, "imports that do not run down: " + "; ".join(f"{f}: {a} -> {b}" for a, b, f in upward)


def test_the_picture_is_the_floors_the_test_holds():
    page = (ROOT / "docs" / "architecture.md").read_text()
    drawn = {}
    for line in page.splitlines():
        if line.startswith("floor "):
            _, floor, *rooms = line.split()
            drawn.update({name if name == "mpizero" else f"mpizero.{name}": int(floor) for name in rooms})
    assert drawn == FLOORS


def test_the_architecture_page_names_every_room():
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [name for name in FLOORS if f"`{name.removeprefix('mpizero.') or 'mpizero'}" not in page]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_every_module_name_occurs_once():
    """A file name says where a thing is: no two modules of the package share one (``__init__`` aside)."""
    names = [p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts]
    assert sorted({n for n in names if names.count(n) > 1}) == []
