"""FailStop: the host side of bounded waits.

Right after each step's launches a copy of the rank's health block into pinned memory is
enqueued on the step's stream (:meth:`CudaHealthSource.copy`; inside a captured graph it is a
node of the graph, so a replay brings its own copy and the host issues none). After the step
the host only counts it (:meth:`FailStop.after_launch`). :meth:`FailStop.release` reads the
health as of a step's own copy or a later one; an engine adapter calls it where the engine
already waits for that step's sampled tokens, which the stream produces after the health copy,
so the copy has landed by then and neither the step nor its release asks the device anything
(``runtime.release``). An engine may await a step's tokens on another thread than the one that
launches the next step (vLLM's output thread), so a FailStop serialises its calls with a lock.
Every ``MONO_EXT_AGREE_EVERY`` steps the TP ranks exchange health summaries over the CPU
group and, if any rank saw a wait give up, *all* ranks raise :class:`FailStopError`
together, naming every wait. Between a local failure and that agreement, :meth:`release`
answers False for the failed step and every later one, so no tokens from a failed step
are returned; the sticky failed word makes those steps' launches return at once. After a
failure there is no fallback: every later call raises.

State machine (per rank)::

    OK --local record seen--> SUSPECT --agreement--> FAILED (raise on every rank)
    OK --agreement, a peer failed---------------------> FAILED
    world size 1: a local record goes straight to FAILED (nobody to agree with)

torch is imported lazily (CUDA source, distributed agreement), so the state machine runs on
a CPU-only box with a fake health source.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from mono_ext.runtime import health as _health
from mono_ext.runtime.health import HEALTH_WORDS, HealthSummary, decode_health

__all__ = [
    "CudaHealthSource",
    "FailStop",
    "FailStopError",
    "HealthSource",
    "ScriptedHealthSource",
    "VirtualFailStop",
    "agree_health",
]

OK, SUSPECT, FAILED = "ok", "suspect", "failed"
_HEALTHY = tuple(_health.health_init_words())  # a block no wait has failed in
_MAGIC = _HEALTHY[_health.H_MAGIC]  # as the words of a copy hold it
NameOf = Callable[[int, int], str]


class FailStopError(RuntimeError):
    """A device-side wait gave up; the engine must stop (no tokens, no fallback)."""

    def __init__(self, summaries: Sequence[HealthSummary], step: int | None, name_of=None):
        self.summaries = tuple(summaries)
        self.step = step
        bad = [s for s in self.summaries if not s.ok]
        where = f" at step {step}" if step is not None else ""
        body = "\n".join(s.describe(name_of) for s in bad) or "a peer rank left the agreement"
        super().__init__(
            f"mono_ext FailStop{where}: {len(bad)} rank(s) report device waits that gave up "
            f"(MONO_EXT_DEADLINE_S). The engine stops: no tokens from a failed step are "
            f"returned and there is no fallback after a failure.\n{body}"
        )

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        return tuple(s.rank for s in self.summaries if not s.ok)


class HealthSource(Protocol):
    def copy(self) -> None:
        """Enqueue the health block's copy on the current stream (capturable)."""

    def submit(self, step: int, copied: bool = False) -> None:
        """Mark ``step`` finished on the host; enqueue its copy first unless ``copied`` (the
        step's launches were followed by :meth:`copy` already, or its graph holds one)."""

    def ready(self, until_step: int | None = None) -> list[tuple[int, Sequence[int]]]:
        """Steps whose copies have landed, oldest first, with the words read. ``until_step``:
        the caller knows that step's copy and every earlier one have landed (the engine has
        awaited a later result of the step's stream); without it a source may know of none."""


class _Unanswered:
    """Steps submitted and not answered for yet, oldest first; past ``depth`` the oldest is
    dropped (a step nobody releases for ``depth`` steps has no tokens anyone awaits; a
    failure, sticky, still shows in every later read)."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._steps: collections.deque[int] = collections.deque(maxlen=depth)

    def add(self, step: int) -> None:
        self._steps.append(step)

    def take(self, until_step: int) -> list[int]:
        """Every kept step up to ``until_step``, oldest first, now answered for; or
        ``until_step`` alone when none is kept (answered already, or dropped): a release
        always gets an answer for its own step."""
        steps = []
        while self._steps and self._steps[0] <= until_step:
            steps.append(self._steps.popleft())
        return steps or [until_step]


class ScriptedHealthSource:
    """A host-side health block that a test or a dry run fails on purpose; every submitted
    copy is ready at the next poll. ``waits`` lists the steps a caller named as landed
    (``ready(until_step)``): each must be a point where the engine holds that step's tokens.
    With ``lagging`` it answers as :class:`CudaHealthSource` does (the same queue of unanswered
    steps): a copy lands only once a caller names its step or a later one (the device still
    runs the step until the engine awaits its tokens), and every step answered then reads the
    newest copy landed."""

    def __init__(
        self, index: int = 9, cta: int = 1, lagging: bool = False, depth: int = 64
    ) -> None:
        self.index, self.cta = index, cta  # word and CTA the failure record names
        self.lagging = lagging
        self.words = _health.health_init_words()
        self.pending: list[tuple[int, list[int]]] = []  # (step, its words), not lagging
        self._unanswered = _Unanswered(depth)  # lagging: the steps, as CudaHealthSource
        self._copies: dict[int, list[int]] = {}  # lagging: each step's words, as copied
        self.waits: list[int] = []

    def fail(self) -> None:
        """Record one wait that gave up: region 0, word ``index``, tag 5 wanted and 4 seen, by
        CTA ``cta`` of rank 0 at epoch 3, after 1 s (``runtime.health.RECORD_FIELDS``)."""
        self.words[_health.H_FAILED] += 1
        base = _health.H_RECORDS
        record = [0, self.index, 5, 4, self.cta, 0, 3, 10**6]
        self.words[base : base + _health.RECORD_WORDS] = record

    def copy(self) -> None:
        pass  # the block is host memory: a step's words are taken at submit

    def submit(self, step: int, copied: bool = False) -> None:
        if not self.lagging:
            self.pending.append((step, list(self.words)))
            return
        self._unanswered.add(step)
        self._copies[step] = list(self.words)

    def ready(self, until_step: int | None = None) -> list[tuple[int, Sequence[int]]]:
        if until_step is not None:
            self.waits.append(until_step)
        if not self.lagging:
            out, self.pending = self.pending, []
            return out
        if until_step is None:
            return []
        # the mirror as CudaHealthSource reads it: the newest copy landed by until_step's
        # (the initial block before any)
        landed = [s for s in self._copies if s <= until_step]
        if not landed:
            words = _health.health_init_words()
        else:
            newest = max(landed)
            words = self._copies[newest]
            for s in landed:
                if s < newest:
                    del self._copies[s]
        return [(step, words) for step in self._unanswered.take(until_step)]


class CudaHealthSource:
    """The health block mirrored into one pinned buffer by a copy on the step's stream, read
    only where the engine has waited for a later result of that stream; it asks the device
    nothing on the host's step path.

    A step's health copy is enqueued on the step's stream right after its launches (or is a
    node of the graph a replay runs), and the engine samples and copies the step's tokens to
    the host behind it on the same stream. When the engine's wait for those tokens returns,
    step n's copy has landed, so :meth:`ready` with ``until_step=n`` reads the mirror with no
    event, query or sync of its own: each of those costs a driver call, and each lets go of
    the GIL to whichever engine thread wants it (vLLM's output thread, SGLang's scheduler).
    Without ``until_step`` nothing is known to have landed and nothing is read.

    The failed count is sticky and only grows, so the mirror as of a copy that landed after
    step n's own copy still answers for step n: a failure it shows may belong to a later step,
    and then step n is withheld too, which stops the engine one step earlier, never later.
    A step is answered for once, the oldest first (``_Unanswered``, at most ``depth`` kept).
    ``health`` may be a CPU tensor (tests): its copy is then synchronous."""

    def __init__(self, health: Any, depth: int = 64):
        import torch

        if health.numel() != HEALTH_WORDS or health.dtype != torch.int32:
            raise ValueError(f"health block must be int32 [{HEALTH_WORDS}], got {health.shape}")
        self.health = health
        mirror = torch.tensor(_health.health_init_words(), dtype=torch.int32)
        self._mirror = mirror.pin_memory() if health.is_cuda else mirror
        self._words = self._mirror.numpy()  # a view: reads see each landed copy
        self._unanswered = _Unanswered(depth)

    def copy(self) -> None:
        self._mirror.copy_(self.health, non_blocking=True)

    def submit(self, step: int, copied: bool = False) -> None:
        if not copied:
            self.copy()
        self._unanswered.add(step)

    def ready(self, until_step: int | None = None) -> list[tuple[int, Sequence[int]]]:
        if until_step is None:
            return []
        steps = self._unanswered.take(until_step)
        words = self._snapshot()
        return [(step, words) for step in steps]

    def _snapshot(self) -> Sequence[int]:
        w = self._words
        if w[_health.H_FAILED] == 0 and w[_health.H_MAGIC] == _MAGIC:
            return _HEALTHY  # the common case, without copying the words out
        return w.tolist()


def agree_health(summary: HealthSummary, group: Any = None) -> list[HealthSummary]:
    """All-gather health summaries over a CPU (gloo) group; a no-op at world size 1."""
    if group is None:
        return [summary]
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1:
        return [summary]
    out: list[Any] = [None] * world
    try:
        dist.all_gather_object(out, summary, group=group)
    except Exception as e:  # a rank that already stopped breaks the collective
        raise FailStopError([summary], summary.step) from e
    return out


class FailStop:
    """One rank's FailStop. Call :meth:`after_launch` once per step, after the step's
    launches (after the graph replay), and :meth:`release` before returning its tokens."""

    def __init__(
        self,
        source: HealthSource,
        rank: int = 0,
        group: Any = None,
        agree_every: int | None = None,
        name_of: NameOf | None = None,
    ):
        if agree_every is None:
            from mono_ext.core.settings import load_settings

            agree_every = load_settings().agree_every
        if agree_every < 1:
            raise ValueError(f"agree_every must be >= 1, got {agree_every}")
        self.source = source
        self.rank = rank
        self.group = group
        self.agree_every = agree_every
        self.name_of = name_of
        self.world = 1
        if group is not None:
            import torch.distributed as dist

            self.world = dist.get_world_size(group)
        self.state = OK
        self.error: FailStopError | None = None
        self.first_failed_step: int | None = None
        self.last_seen_step: int | None = None
        self._local = HealthSummary(rank=rank, failed_waits=0)
        self._launches = 0
        self._lock = threading.RLock()

    # -- per step ---------------------------------------------------------------------------
    def after_launch(self, step: int, copied: bool = False) -> None:
        """``step``'s launches are enqueued. ``copied``: they were followed by the health
        copy already (on their stream, or as a node of the graph just replayed)."""
        with self._lock:
            self._raise_if_failed()
            self.source.submit(step, copied)
            self._launches += 1
            self._poll(None)  # the lock is held already
            agree = self._launches % self.agree_every == 0
        if agree:  # a collective: outside the lock, so a release on another thread goes on
            self.agree(step)

    def poll(self, until_step: int | None = None) -> str:
        """Read every health copy known to have landed (``until_step``: that step's and all
        before it, see :meth:`HealthSource.ready`). Never blocks."""
        with self._lock:
            return self._poll(until_step)

    def _poll(self, until_step: int | None) -> str:
        for step, words in self.source.ready(until_step):
            self.last_seen_step = step
            if words[_health.H_FAILED] == 0 and words[_health.H_MAGIC] == _MAGIC:
                continue  # the common case, without decoding the block
            summary = decode_health(words, self.rank, step)
            if not summary.ok and self.first_failed_step is None:
                self.first_failed_step = step
                self._local = summary
                self.state = SUSPECT
        if self.state == SUSPECT and self.world == 1:
            self.conclude([self._local], self.first_failed_step)
        return self.state

    def release(self, step: int) -> bool:
        """May the tokens of ``step`` be returned? False for a failed step and all after it.

        Reads that step's health copy; it was enqueued right after the step's launches, before
        sampling, so once the engine holds the tokens on the host it has landed: call it there.
        """
        with self._lock:
            self._raise_if_failed()
            self._poll(until_step=step)
            return self.first_failed_step is None or step < self.first_failed_step

    # -- agreement --------------------------------------------------------------------------
    def local_summary(self) -> HealthSummary:
        return self._local

    def agree(self, step: int | None = None) -> None:
        """Collective over the TP group: every rank raises if any rank failed."""
        self.conclude(agree_health(self._local, self.group), step)

    def conclude(self, summaries: Sequence[HealthSummary], step: int | None) -> None:
        if all(s.ok for s in summaries):
            return
        with self._lock:
            self.state = FAILED
            self.error = FailStopError(summaries, step, self.name_of)
        raise self.error

    def _raise_if_failed(self) -> None:
        if self.state == FAILED:
            raise self.error  # sticky: no fallback after a failure


class VirtualFailStop:
    """FailStop for virtual TP: ``world`` ranks in one process agree in-process.

    On a failure every rank's FailStop concludes FAILED (each would raise on its own); one
    :class:`FailStopError` naming every failed wait is raised to the caller.
    """

    def __init__(
        self, sources: Sequence[HealthSource], agree_every: int | None = None, name_of=None
    ):
        self.ranks = [
            FailStop(src, rank=r, agree_every=agree_every, name_of=name_of)
            for r, src in enumerate(sources)
        ]
        for fs in self.ranks:
            fs.world = len(self.ranks)  # agreement happens here, not per rank
        self.raised: list[int] = []

    @property
    def agree_every(self) -> int:
        return self.ranks[0].agree_every

    def after_launch(self, step: int) -> None:
        for fs in self.ranks:
            fs._raise_if_failed()
            fs.source.submit(step)
            fs._launches += 1
            fs.poll()
        if self.ranks[0]._launches % self.agree_every == 0:
            self.agree(step)

    def release(self, step: int) -> bool:
        return all([fs.release(step) for fs in self.ranks])

    def agree(self, step: int | None = None) -> None:
        summaries = [fs.local_summary() for fs in self.ranks]
        self.raised = []
        error = None
        for fs in self.ranks:
            try:
                fs.conclude(summaries, step)
            except FailStopError as e:
                self.raised.append(fs.rank)
                error = e
        if error is not None:
            raise error
