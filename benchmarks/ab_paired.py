"""Paired A/B over repeated passes of a kernel benchmark (not a test).

    python benchmarks/ab_paired.py --base k2 --csv-out all.csv --md-out ab.md p1.csv p2.csv ...

Each input is the CSV of one pass: one process of ``bench_k2.py --csv`` or ``bench_k1.py
--results-csv`` timing several arms in turn. A few microseconds separate two K2 builds, and
separate processes on one card drift by about as much, so an arm is compared with the base
arm of the same pass only: for every arm and width, the differences ``arm - base`` (us, of
``median_us``) over the passes that hold both, as their median, smallest and largest.
Alternate the arms' order between passes (``--variants`` reversed), so that no arm always
runs first.

Writes every row of every pass into one CSV with a ``rep`` column (the pass's place in the
argument list, from 1) and prints (or writes) the table as markdown. Rows are keyed by
``kind`` where the CSV has one (bench_k1: ``gdn`` / ``attn``), ``arm`` and ``width``.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _csv_rows import write_rows  # noqa: E402

__all__ = ["Paired", "combine", "markdown", "paired", "read_passes"]


@dataclass(frozen=True)
class Paired:
    """One arm's differences from the base at one width (us; negative = faster)."""

    median: float
    low: float
    high: float
    passes: int


def read_passes(paths: Sequence[str]) -> list[list[dict]]:
    passes = []
    for p in paths:
        with open(p, newline="") as f:
            rows = list(csv.DictReader(f))
        if not rows or not {"arm", "width", "median_us"} <= rows[0].keys():
            raise SystemExit(f"{p}: not a benchmark CSV (needs arm, width and median_us columns)")
        passes.append(rows)
    return passes


def combine(passes: Sequence[Sequence[dict]]) -> list[dict]:
    """Every row of every pass, with ``rep`` first (1 = the first pass)."""
    return [{"rep": i, **r} for i, rows in enumerate(passes, 1) for r in rows]


def _key(row: dict) -> tuple[str, str]:
    return row.get("kind", ""), row["arm"]


def paired(
    passes: Sequence[Sequence[dict]], base: str, prefix: str | None = None
) -> dict[tuple[str, str], dict[int, Paired]]:
    """``{(kind, arm): {width: Paired}}`` for every arm but ``base`` whose name starts with
    ``prefix`` (default: the base's first word), against ``base`` of the same kind and pass."""
    prefix = base.split()[0] if prefix is None else prefix
    diffs: dict[tuple[str, str], dict[int, list[float]]] = {}
    seen_base = False
    for rows in passes:
        by = {(_key(r), int(r["width"])): float(r["median_us"]) for r in rows}
        for ((kind, arm), w), us in by.items():
            if arm == base:
                seen_base = True
                continue
            ref = by.get(((kind, base), w))
            if ref is not None and arm.startswith(prefix):
                diffs.setdefault((kind, arm), {}).setdefault(w, []).append(us - ref)
    if not seen_base:
        raise SystemExit(f"no pass has the base arm {base!r}")
    return {
        k: {w: Paired(statistics.median(d), min(d), max(d), len(d)) for w, d in sorted(v.items())}
        for k, v in diffs.items()
    }


def base_medians(
    passes: Sequence[Sequence[dict]], base: str
) -> dict[tuple[str, int], tuple[float, int]]:
    """The base arm's median time over the passes and how many passes hold it, per (kind,
    width)."""
    got: dict[tuple[str, int], list[float]] = {}
    for rows in passes:
        for r in rows:
            if r["arm"] == base:
                got.setdefault((r.get("kind", ""), int(r["width"])), []).append(
                    float(r["median_us"])
                )
    return {k: (statistics.median(v), len(v)) for k, v in sorted(got.items())}


def markdown(
    table: dict[tuple[str, str], dict[int, Paired]],
    base_us: dict[tuple[str, int], tuple[float, int]],
    base: str,
) -> str:
    """The base's median times, then each arm's differences, per kind; the kind column only
    where the passes name kinds (bench_k1)."""
    widths = sorted({w for v in table.values() for w in v} | {w for _, w in base_us})
    kinds = sorted({k for k, _ in base_us} | {k for k, _ in table})
    show_kind = kinds != [""]
    lead = "| kind " if show_kind else ""
    lines = [
        lead + "| arm | passes | " + " | ".join(f"w{w}" for w in widths) + " |",
        "|" + "---|" * (2 + show_kind + len(widths)),
    ]
    for kind in kinds:
        lead = f"| {kind} " if show_kind else ""
        cells = [f"{base_us[(kind, w)][0]:.2f}" if (kind, w) in base_us else "-" for w in widths]
        n = max((c for (k, _), (_, c) in base_us.items() if k == kind), default=0)
        lines.append(lead + f"| {base} (us) | {n} | " + " | ".join(cells) + " |")
        for (k, arm), v in sorted(table.items()):
            if k == kind:
                n = max(p.passes for p in v.values())
                cells = [_cell(v.get(w)) for w in widths]
                lines.append(lead + f"| {arm} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(p: Paired | None) -> str:
    if p is None:
        return "-"
    return f"{p.median:+.2f} [{p.low:+.2f}, {p.high:+.2f}]"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("passes", nargs="+", help="one CSV per pass, in the order they ran")
    ap.add_argument("--base", default="k2", help="the arm every other arm is paired with")
    ap.add_argument("--prefix", default=None, help="compare arms starting with this (default: "
                    "the base's first word; '' for every arm)")  # fmt: skip
    ap.add_argument("--csv-out", default=None, help="every row of every pass, with a rep column")
    ap.add_argument("--md-out", default=None, help="write the table here instead of stdout")
    args = ap.parse_args(argv)
    passes = read_passes(args.passes)
    table = paired(passes, args.base, args.prefix)
    text = (
        f"Differences from `{args.base}` of the same pass, us: median [smallest, largest] over "
        f"the passes holding both (negative = faster); the {args.base} row is its median time.\n\n"
        + markdown(table, base_medians(passes, args.base), args.base)
    )
    if args.csv_out:
        write_rows(args.csv_out, combine(passes))
    if args.md_out:
        with open(args.md_out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
