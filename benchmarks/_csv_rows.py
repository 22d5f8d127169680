"""One CSV from rows that need not share their keys: every key any row has, in the order
the rows first name them (a row without a key leaves its cell empty)."""

from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path

__all__ = ["write_rows"]


def write_rows(path: str | Path, rows: Iterable[dict]) -> None:
    rows = list(rows)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
