"""``runtime.release``: tickets of fused steps wait for the engine's own await of their tokens.

The tickets here release through a real :class:`FailStop` over the scripted health source, in
the order an async-scheduling engine produces them: step n+1 runs (and queues) before the
engine awaits step n's tokens.
"""

from __future__ import annotations

import threading

import pytest

from mono_ext.runtime.failstop import FailStop, FailStopError, ScriptedHealthSource
from mono_ext.runtime.host_timer import HostTimer
from mono_ext.runtime.release import ReleaseQueue, Ticket


class Steps:
    """A persistent backend's end of a step and its release, over a real FailStop."""

    def __init__(self, lagging: bool = True) -> None:
        self.source = ScriptedHealthSource(lagging=lagging)
        self.failstop = FailStop(self.source, agree_every=16)
        self.n = 0
        self.released: list[int] = []

    def run(self) -> Ticket:
        self.n += 1
        self.failstop.after_launch(self.n)
        number = self.n

        def release() -> None:
            if not self.failstop.release(number):
                raise FailStopError([self.failstop.local_summary()], number)
            self.released.append(number)

        return Ticket(release, 1, number)


def test_an_output_object_carries_exactly_the_steps_queued_before_it():
    steps, q = Steps(), ReleaseQueue()
    q.add(steps.run())
    out1 = q.take()  # step 1's output object is made (sample_tokens)
    q.add(steps.run())  # step 2's forward runs before step 1's tokens are awaited
    q.release(out1)
    assert steps.released == [1] and steps.source.waits == [1], "step 2 must not be waited for"
    out2 = q.take()
    q.release(out2)
    assert steps.released == [1, 2] and len(q) == 0 and q.released == 2


def test_a_failed_step_raises_at_its_await_and_no_later_ticket_is_released():
    steps, q = Steps(), ReleaseQueue()
    q.add(steps.run())
    q.release(q.take())
    steps.source.fail()  # step 2's wait gives up; its copy lands only at its await
    q.add(steps.run())
    q.add(steps.run())  # step 3 ran too (its launches bail at once on the sticky word)
    assert steps.failstop.first_failed_step is None
    with pytest.raises(FailStopError, match="gave up"):
        q.release(q.take())
    assert steps.released == [1] and q.released == 1
    with pytest.raises(FailStopError):  # sticky: nothing after it is released either
        steps.run()


def test_tickets_nobody_takes_are_released_once_past_the_bound():
    steps, q = Steps(lagging=False), ReleaseQueue(max_outstanding=2)
    for _ in range(5):  # warm-up steps whose outputs the engine never awaits
        q.add(steps.run())
    assert steps.released == [1, 2, 3] and q.overdue == 3 and len(q) == 2
    q.release_all()
    assert steps.released == [1, 2, 3, 4, 5] and len(q) == 0


def test_a_failed_overdue_ticket_raises_from_add():
    steps, q = Steps(lagging=False), ReleaseQueue(max_outstanding=1)
    q.add(steps.run())
    steps.source.fail()
    with pytest.raises(FailStopError):  # world 1: step 2's own end_step already sees it
        q.add(steps.run())


def test_then_runs_after_a_successful_release_only():
    seen: list[str] = []

    def ok() -> None:
        seen.append("ok")

    def bad() -> None:
        raise FailStopError([], 7)

    Ticket(ok, 1).then(lambda: seen.append("after")).release()
    with pytest.raises(FailStopError):
        Ticket(bad, 1).then(lambda: seen.append("never")).release()
    assert seen == ["ok", "after"]


def test_queue_and_take_from_two_threads_lose_no_ticket():
    q = ReleaseQueue(max_outstanding=10**6)
    done: list[int] = []
    lock = threading.Lock()

    def ticket(i: int) -> Ticket:
        def release() -> None:
            with lock:
                done.append(i)

        return Ticket(release, 1, i)

    def producer() -> None:
        for i in range(2000):
            q.add(ticket(i))

    t = threading.Thread(target=producer)
    t.start()
    while t.is_alive():
        q.release(q.take())
    t.join()
    q.release_all()
    assert sorted(done) == list(range(2000))
    assert done == sorted(done), "tickets are released oldest first"


def test_max_outstanding_must_be_positive():
    with pytest.raises(ValueError, match="max_outstanding"):
        ReleaseQueue(0)


def test_a_timed_ticket_counts_its_release_even_when_it_raises():
    timer = HostTimer()
    Ticket(lambda: None, 1).timed(timer).release()

    def bad() -> None:
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        Ticket(bad, 2, what="s").timed(timer).release()
    assert timer.report()["host_calls"] == {"release": 2}


def test_wrappers_keep_their_order_and_leave_the_original_ticket_alone():
    """then() twice runs both afters in order after the check; timed() before or after then()
    times the whole release once; the ticket wrapped is not changed by its wrappers."""
    seen: list[str] = []
    timer = HostTimer()
    base = Ticket(lambda: seen.append("check"), 3, what="step")
    wrapped = base.then(lambda: seen.append("a")).timed(timer).then(lambda: seen.append("b"))
    assert (wrapped.width, wrapped.what) == (3, "step")
    wrapped.release()
    assert seen == ["check", "a", "b"]
    assert timer.report()["host_calls"] == {"release": 1}
    seen.clear()
    base.release()
    assert seen == ["check"] and timer.report()["host_calls"] == {"release": 1}
