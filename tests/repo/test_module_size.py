"""No module of the package is longer than a reader can hold: at most 800 lines each
(DESIGN.md's layout; a module past it holds more than one concern and is split by role)."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "mono_ext"
MAX_LINES = 800


def test_every_module_is_at_most_800_lines():
    sizes = {f: len(f.read_text().splitlines()) for f in SRC.rglob("*.py")}
    assert len(sizes) > 50, f"found only {len(sizes)} modules under {SRC}"
    long = {str(f.relative_to(SRC)): n for f, n in sizes.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
