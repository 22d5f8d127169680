"""Host time an engine adapter spends in its per-step hooks, as the engine's report shows it.

A mean over a short run is dominated by the first calls (pinned buffers, events, a graph's
first replay), so each hook also keeps its last ``window`` samples for a median and a p90:
those are what a long-running server pays per step. With ``profile`` the hooks also run under
one cProfile profiler (``MONO_EXT_PROFILE_HOST=1``), and the report lists the functions that
took the most time inside them: where a hook's time goes in the engine itself, whose other
threads and device calls a standalone benchmark does not reproduce. Profiling slows the hooks,
so their times are not comparable with an unprofiled run. This module imports neither torch
nor an engine.
"""

from __future__ import annotations

import collections
import cProfile
import pstats
import time
from collections.abc import Callable
from typing import Any

__all__ = ["HostTimer"]


class HostTimer:
    """``t = timer.start(); ...; timer.stop("hook", t)`` per call of a hook."""

    def __init__(self, window: int = 4096, profile: bool = False) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.total_ns: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._window = window
        self._recent: dict[str, collections.deque[int]] = {}
        self._profile = cProfile.Profile() if profile else None
        self._depth = 0  # hooks open (a hook may time a part of itself): profiled while > 0

    def start(self, profiled: bool = True) -> int:
        """The start of one call; ``profiled=False`` keeps it out of the profile (a hook that
        runs the layers themselves would hide the per-step work the profile is for)."""
        if self._profile is not None and profiled:
            if self._depth == 0:
                try:
                    self._profile.enable()
                except ValueError:  # another profiler is active: it wins, this one stops
                    self._profile = None
                    return time.perf_counter_ns()
            self._depth += 1
        return time.perf_counter_ns()

    def stop(self, hook: str, since_ns: int, profiled: bool = True) -> None:
        ns = time.perf_counter_ns() - since_ns
        if self._profile is not None and profiled and self._depth > 0:
            self._depth -= 1
            if self._depth == 0:
                self._profile.disable()
        self.total_ns[hook] += ns
        self.calls[hook] += 1
        recent = self._recent.get(hook)
        if recent is None:
            recent = self._recent[hook] = collections.deque(maxlen=self._window)
        recent.append(ns)

    def call(self, hook: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` timed as ``hook``; its result."""
        t = self.start()
        try:
            return fn(*args, **kwargs)
        finally:
            self.stop(hook, t)

    def timed(self, hook: str, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` timed as ``hook`` on each call."""
        return lambda: self.call(hook, fn)

    def report(self) -> dict[str, Any]:
        """Per hook: mean over every call, median and p90 over the recent ones (us), calls."""

        def pick(hook: str, q: float) -> float:
            xs = sorted(self._recent[hook])
            return round(xs[min(len(xs) - 1, int(q * len(xs)))] / 1e3, 2)

        hooks = sorted(self.calls)
        out: dict[str, Any] = {
            "host_us": {h: round(self.total_ns[h] / 1e3 / self.calls[h], 2) for h in hooks},
            "host_us_median": {h: pick(h, 0.5) for h in hooks},
            "host_us_p90": {h: pick(h, 0.9) for h in hooks},
            "host_calls": {h: self.calls[h] for h in hooks},
        }
        if self._profile is not None:
            out["host_profile"] = self.profile_rows()
        return out

    def profile_rows(self, limit: int = 25) -> list[dict[str, Any]]:
        """The profiled functions that took the most time of their own inside the hooks:
        ``function`` (file:line(name)), ``calls``, ``own_us`` and ``cum_us`` per call."""
        if self._profile is None:
            return []
        try:
            stats = pstats.Stats(self._profile).stats  # type: ignore[attr-defined]
        except TypeError:  # nothing profiled yet
            return []
        rows = []
        for (file, line, name), (_, calls, own, cum, _) in stats.items():
            rows.append(
                {
                    "function": f"{file}:{line}({name})",
                    "calls": calls,
                    "own_us": round(own / calls * 1e6, 2),
                    "cum_us": round(cum / calls * 1e6, 2),
                    "own_total_ms": round(own * 1e3, 3),
                }
            )
        rows.sort(key=lambda r: r["own_total_ms"], reverse=True)
        return rows[:limit]
