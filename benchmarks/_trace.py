"""Per-CTA trace stamps of a ``TRACE`` build (K1, K2) summarized (pure Python, no torch).

A trace build writes, per CTA, 16 words of %globaltimer nanoseconds, word ``i`` when all the
CTA's threads reached point ``i`` (``kernels.triton.primitives.stamp``). A word left at 0
was never reached by that CTA (a point only some CTAs have, such as the first S2 task's
words), so it counts for no statistic. Times are microseconds since the first CTA started
(the earliest point-0 stamp).
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["cta_times", "format_points", "trace_points"]


def _first_start(stamps: list[list[int]]) -> int:
    """The earliest start stamp (word 0) of any CTA: the zero of every time reported."""
    starts = [r[0] for r in stamps if r[0]]
    if not starts:
        raise ValueError("no CTA stamped its start: not a trace build, or it did not run")
    return min(starts)


def trace_points(stamps: list[list[int]], names: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per point of ``names`` (word i is point i): the CTAs that reached it and the min /
    median / max over them of microseconds since the first CTA started."""
    t0 = _first_start(stamps)
    out = []
    for i, name in enumerate(names):
        xs = sorted((r[i] - t0) / 1e3 for r in stamps if r[i])
        row: dict[str, Any] = {"point": name, "ctas": len(xs)}
        if xs:
            row.update(min_us=round(xs[0], 2), median_us=round(statistics.median(xs), 2),
                       max_us=round(xs[-1], 2))  # fmt: skip
        else:
            row.update(min_us=None, median_us=None, max_us=None)
        out.append(row)
    return out


def cta_times(stamps: list[list[int]], n_points: int) -> list[list[float | None]]:
    """Per CTA (in program id order), its first ``n_points`` stamps in microseconds since the
    first CTA started, None where it never reached the point: which CTAs a slow point belongs
    to, where the min / median / max of :func:`trace_points` cannot tell."""
    t0 = _first_start(stamps)
    return [
        [round((r[i] - t0) / 1e3, 2) if r[i] else None for i in range(n_points)] for r in stamps
    ]


def format_points(points: list[dict[str, Any]]) -> list[str]:
    """One line per point: index, name, min / median / max us, CTAs that reached it."""
    lines = []
    for i, p in enumerate(points):
        if p["ctas"]:
            t = f"{p['min_us']:7.1f} {p['median_us']:7.1f} {p['max_us']:7.1f}"
        else:
            t = f"{'-':>7} {'-':>7} {'-':>7}"
        lines.append(f"    {i:2d} {p['point']:<15} {t}  ({p['ctas']} CTAs)")
    return lines
