"""The host side every persistent-launch backend shares: one deployment's per-step hooks.

A backend's runtime (the Triton one, the FlyDSL one) holds what every launch of one deployment
on one device shares. This module holds the part that is the same for every backend, as a base
class the backend's runtime subclasses and a base for its per-key launches:

| hook          | where                      | what                                              |
|---------------|----------------------------|---------------------------------------------------|
| begin_step    | device, on the step stream | sticky error first (no step runs after a failure),|
|               | (captured with the step)   | the build cache sealed, the step epoch bumped     |
| health_copy   | device, on the step stream | the health block's copy for FailStop, right after |
|               | (captured with the step)   | the step's last launch                            |
| end_step      | host, after the launches   | the step counted and marked for FailStop (its     |
|               | (after each graph replay)  | copy enqueued here only if health_copy did not    |
|               |                            | run for it); returns the step's number; nothing   |
|               |                            | while a graph is captured                         |
| release(n)    | host, where the engine     | FailStop's word on step ``n``'s tokens            |
|               | awaits step n's tokens     | (``runtime.release``)                             |

A subclass provides ``state`` (``peers.RankState``), ``failstop`` (``failstop.FailStop``),
``cache`` (``build_cache.BuildCache``) and ``steps`` (finished steps, FailStop's numbering),
and may override :meth:`PersistentRuntime.capturing`. torch is imported only by
:meth:`PersistentRuntime.capturing`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .device import is_capturing

__all__ = ["PersistentLaunches", "PersistentRuntime", "runtime_key", "wait_namer"]


class PersistentRuntime:
    """The per-step hooks of one deployment's runtime (see the module doc)."""

    state: Any
    failstop: Any
    cache: Any
    steps: int
    _copied = False  # health_copy ran since the last eager end_step
    _graphs_copy = False  # graphs captured here hold the health copy

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA/HIP graph (never, on a build of
        torch without either)."""
        return is_capturing()

    def begin_step(self) -> None:
        if self.failstop.error is not None:
            raise self.failstop.error  # sticky: no step runs after a failure
        self.cache.seal()  # start-up is over: a key not built by now never will be
        self.state.bump_epoch()

    def health_copy(self) -> None:
        """On the step's stream, after its last launch: the copy FailStop reads. Called inside
        a capture it becomes part of the graph, so each replay brings its own copy."""
        self.failstop.source.copy()
        if self.capturing():
            self._graphs_copy = True
        else:
            self._copied = True

    def end_step(self, replayed: bool = False) -> int | None:
        """After a step's launches (``replayed``: after a replay of a captured graph)."""
        if self.capturing():
            return None  # the engine calls end_step after each replay instead
        copied = self._graphs_copy if replayed else self._copied
        self._copied = False
        self.steps += 1
        self.failstop.after_launch(self.steps, copied)
        return self.steps

    def release(self, step: int | None = None) -> bool:
        """May the tokens of ``step`` (default: the last finished one) be returned?"""
        return self.failstop.release(self.steps if step is None else step)


class PersistentLaunches:
    """The per-step hooks of one build key's launches: its runtime's, and the row check."""

    key: Any  # core.spec.BuildKey
    runtime: PersistentRuntime

    def begin_step(self) -> None:
        self.runtime.begin_step()

    def health_copy(self) -> None:
        self.runtime.health_copy()

    def end_step(self, replayed: bool = False) -> int | None:
        return self.runtime.end_step(replayed)

    def release(self, step: int | None = None) -> bool:
        return self.runtime.release(step)

    def _rows(self, x: Any) -> None:
        if x.shape[0] != self.key.width:
            raise ValueError(
                f"{self.key.label()}: got {x.shape[0]} rows, built for {self.key.width}"
            )


def wait_namer(layouts: Sequence[Any]):
    """``name_of(region, index)`` for FailStop's messages. Health records carry (region id,
    index) but not which launch's program wrote them: every candidate is named."""

    def name_of(region: int, index: int) -> str:
        names = [
            lay.describe(region, index) for lay in layouts if 0 <= region < len(lay.program.regions)
        ]
        return " or ".join(names) or f"region#{region}[{index}]"

    return name_of


def runtime_key(key: Any, ctx: Any) -> tuple:
    """What the build keys of one runtime share: everything of the key but its width, and the
    build context (a ``BuildKey`` and a ``BuildContext``)."""

    def frozen(m: Mapping[str, Any]) -> str:
        return json.dumps({k: repr(v) for k, v in m.items()}, sort_keys=True)

    return (
        str(ctx.device),
        ctx.tp_rank,
        ctx.null_slot,
        key.spec,
        key.dtype,
        key.tp_size,
        key.layouts,
        key.formats,
        frozen(ctx.text_config),
        frozen(ctx.extra),
    )
