"""Where a fused step's tokens are let go: at the engine's own wait for them.

A step that ran fused launches ends with its health copy enqueued on the step's stream
(``FailStop.after_launch``); the engine then samples on the same stream and copies the sampled
token ids to the host, and the host waits for that copy before it hands the tokens to any
request. That wait is the one place where the health copy is known to have landed without a
wait of mono_ext's own, so the step's release (``FailStop.release``) is read there: an engine
adapter queues a :class:`Ticket` per step right after the forward and releases it from a hook
on the engine's token-await point. A failed step raises there, before its tokens reach a
request; the error stops the engine, so no later step's tokens are returned either.

The engine may run the next step's forward before it waits for this step's tokens (vLLM's
async scheduling, SGLang's overlap scheduler), so tickets are handed to the engine's per-step
output object when it is made (:meth:`ReleaseQueue.take`) and released when that object's
tokens are awaited; a release never waits for a step whose tokens the engine has not awaited
yet. Tickets nobody takes (steps whose outputs the engine never returns, such as its warm-up
runs) are released once more than ``max_outstanding`` are queued: by then their copies have
long landed.

This module imports neither torch nor an engine.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["ReleaseQueue", "Ticket"]


class Ticket:
    """One step whose tokens wait for FailStop. ``release()`` raises (FailStopError or a
    subclass) where the step's device waits gave up; it returns once the tokens may go.

    Made once per decode step on the engine's host path, so the wrappers :meth:`then` and
    :meth:`timed` add fields to one new ticket rather than a closure around the old one.
    """

    __slots__ = ("_check", "width", "what", "_after", "_timer", "_hook")

    def __init__(
        self,
        release: Callable[[], None],
        width: int,
        what: Any = None,  # the planned step, for messages and tests
        _after: tuple[Callable[[], None], ...] = (),
        _timer: Any = None,
        _hook: str = "release",
    ) -> None:
        self._check = release
        self.width = width
        self.what = what
        self._after = _after
        self._timer = _timer
        self._hook = _hook

    def release(self) -> None:
        if self._timer is None:
            self._release()
        else:
            self._timer.call(self._hook, self._release)

    def _release(self) -> None:
        self._check()
        for after in self._after:
            after()

    def then(self, after: Callable[[], None]) -> Ticket:
        """This ticket, with ``after()`` run once its release let the tokens go."""
        return Ticket(
            self._check, self.width, self.what, (*self._after, after), self._timer, self._hook
        )

    def timed(self, timer: Any, hook: str = "release") -> Ticket:
        """This ticket, its release timed as ``hook`` by ``timer`` (a
        :class:`~mono_ext.runtime.host_timer.HostTimer`)."""
        return Ticket(self._check, self.width, self.what, self._after, timer, hook)


class ReleaseQueue:
    """Tickets of steps that ran, oldest first, until the engine awaits their tokens.

    Thread-safe: an engine may queue on its scheduling thread and await tokens on another.
    """

    def __init__(self, max_outstanding: int = 4) -> None:
        if max_outstanding < 1:
            raise ValueError(f"max_outstanding must be >= 1, got {max_outstanding}")
        self.max_outstanding = max_outstanding
        self._queue: collections.deque[Ticket] = collections.deque()
        self._lock = threading.Lock()
        self.released = 0  # tickets released, at the token await or as overdue
        self.overdue = 0  # of those, released because nobody took them in time

    def __len__(self) -> int:
        with self._lock:
            return len(self._queue)

    def add(self, ticket: Ticket) -> None:
        """Queue a step that just ran; release the oldest untaken ones past the bound."""
        with self._lock:
            self._queue.append(ticket)
            overdue = []
            while len(self._queue) > self.max_outstanding:
                overdue.append(self._queue.popleft())
        if overdue:
            self.overdue += len(overdue)
            self.release(overdue)

    def take(self) -> tuple[Ticket, ...]:
        """Every queued ticket, removed: the steps whose tokens the output object being made
        carries (the caller releases them where those tokens are awaited)."""
        with self._lock:
            out = tuple(self._queue)
            self._queue.clear()
        return out

    def release(self, tickets: Iterable[Ticket]) -> None:
        """Release ``tickets`` in order; the first failed step raises (the rest stay unreleased:
        the engine stops)."""
        for ticket in tickets:
            ticket.release()
            self.released += 1

    def release_all(self) -> None:
        """Release every queued ticket (an engine path that awaits all its steps at once)."""
        self.release(self.take())
