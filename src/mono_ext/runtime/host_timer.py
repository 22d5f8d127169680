"""Host time an engine adapter spends in its per-step hooks, as the engine's report shows it.

A mean over a short run is dominated by the first calls (pinned buffers, events, a graph's
first replay), so each hook also keeps its last ``window`` samples for a median and a p90:
those are what a long-running server pays per step. This module imports neither torch nor an
engine.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

__all__ = ["HostTimer"]


class HostTimer:
    """``t = timer.start(); ...; timer.stop("hook", t)`` per call of a hook."""

    def __init__(self, window: int = 4096) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.total_ns: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._window = window
        self._recent: dict[str, collections.deque[int]] = {}

    @staticmethod
    def start() -> int:
        return time.perf_counter_ns()

    def stop(self, hook: str, since_ns: int) -> None:
        ns = time.perf_counter_ns() - since_ns
        self.total_ns[hook] += ns
        self.calls[hook] += 1
        recent = self._recent.get(hook)
        if recent is None:
            recent = self._recent[hook] = collections.deque(maxlen=self._window)
        recent.append(ns)

    def timed(self, hook: str, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` timed as ``hook`` on each call."""

        def call() -> None:
            t = self.start()
            try:
                fn()
            finally:
                self.stop(hook, t)

        return call

    def report(self) -> dict[str, Any]:
        """Per hook: mean over every call, median and p90 over the recent ones (us), calls."""

        def pick(hook: str, q: float) -> float:
            xs = sorted(self._recent[hook])
            return round(xs[min(len(xs) - 1, int(q * len(xs)))] / 1e3, 2)

        hooks = sorted(self.calls)
        return {
            "host_us": {h: round(self.total_ns[h] / 1e3 / self.calls[h], 2) for h in hooks},
            "host_us_median": {h: pick(h, 0.5) for h in hooks},
            "host_us_p90": {h: pick(h, 0.9) for h in hooks},
            "host_calls": {h: self.calls[h] for h in hooks},
        }
