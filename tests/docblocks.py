"""The fenced code blocks of README.md and docs/*.md, each with the marker comment that says how it is checked.

Every block on the site has, on the line just above its opening fence, one marker:

- ``<!-- NAME -->``: a test reads the block by name (``named(NAME)``) and runs or compares it;
- ``<!-- file: PATH -->``: the block is exactly the file PATH, which a test runs;
- ``<!-- test: tests/FILE.py::TEST -->``: that test runs what the block shows (a cluster, SLURM, pip);
- ``<!-- run -->`` or ``<!-- run: N -->``: the Python block runs as shown, on one process or N ranks;
- ``<!-- console -->``: ``$ command`` lines, each followed by (part of) its output, run and compared;
- ``<!-- results: PATH -->``: a measured table, every line of which is in the recorded results file PATH.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from mpirun import ROOT

PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
FENCED = re.compile(r"(?:<!-- (?P<marker>[^\n]*?) -->\n)?```(?P<lang>\w*)\n(?P<text>.*?)^```$", re.S | re.M)
NAME = re.compile(r"[a-z][a-z0-9-]*")
KINDS = ("named", "file", "test", "run", "console", "results")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its marker (kind and argument) and its text."""

    page: Path
    line: int
    lang: str
    marker: str
    text: str

    @property
    def kind(self) -> str:
        kind = self.marker.split(":", 1)[0].strip()
        return kind if kind in KINDS or not NAME.fullmatch(self.marker) else "named"

    @property
    def argument(self) -> str:
        return self.marker if self.kind == "named" else self.marker.partition(":")[2].strip()

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    """Every fenced block of README.md and docs/*.md, in page order."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCED.finditer(text):
            line = text.count("\n", 0, m.start("lang")) + 1
            found.append(Block(page, line, m["lang"], m["marker"] or "", m["text"]))
    return found


def named(name: str) -> str:
    """The text of the one block marked ``<!-- name -->``."""
    matches = [b for b in blocks() if b.kind == "named" and b.argument == name]
    assert len(matches) == 1, f"expected one block marked <!-- {name} -->, found {[b.where for b in matches]}"
    return matches[0].text
