"""CudaHealthSource's host logic over a CPU health block: a step's words are read only where
the caller names the step as landed (the engine's token await), oldest step first, and a
failure the mirror shows withholds the oldest step not yet answered for."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mono_ext.runtime import health as h  # noqa: E402
from mono_ext.runtime.failstop import CudaHealthSource, FailStop, FailStopError  # noqa: E402


def _block() -> torch.Tensor:
    return torch.tensor(h.health_init_words(), dtype=torch.int32)


def _fail(block: torch.Tensor, index: int = 23) -> None:
    record = [2, index, 9, 8, 4, 0, 7, 10**6]  # region 2, word `index`, CTA 4 gave up
    block[h.H_RECORDS : h.H_RECORDS + h.RECORD_WORDS] = torch.tensor(record, dtype=torch.int32)
    block[h.H_FAILED] += 1


def test_nothing_is_read_until_a_step_is_named_landed():
    block = _block()
    source = CudaHealthSource(block)
    source.submit(1)
    source.submit(2, copied=True)
    _fail(block)  # the device block changed, but no copy of it was made since step 1's
    assert source.ready() == []
    landed = source.ready(until_step=1)
    assert [s for s, _ in landed] == [1] and landed[0][1][h.H_FAILED] == 0
    source.copy()  # a later copy (step 3's) landed before the engine awaited step 2
    (step, words), *rest = source.ready(until_step=2)
    assert step == 2 and rest == [] and words[h.H_FAILED] == 1


def test_every_earlier_unanswered_step_is_read_with_the_named_one():
    source = CudaHealthSource(_block())
    for step in (1, 2, 3):
        source.submit(step)
    assert [s for s, _ in source.ready(until_step=2)] == [1, 2]
    assert [s for s, _ in source.ready(until_step=3)] == [3]
    # a step already answered for (or dropped) is still read, never silently healthy
    assert [s for s, _ in source.ready(until_step=3)] == [3]


def test_unanswered_steps_past_depth_are_dropped_oldest_first():
    source = CudaHealthSource(_block(), depth=3)
    for step in range(1, 7):
        source.submit(step, copied=True)
    assert [s for s, _ in source.ready(until_step=6)] == [4, 5, 6]
    with pytest.raises(ValueError, match="depth"):
        CudaHealthSource(_block(), depth=0)


def test_a_bad_block_is_refused():
    with pytest.raises(ValueError, match="int32"):
        CudaHealthSource(torch.zeros(h.HEALTH_WORDS, dtype=torch.int64))


def test_failstop_over_it_raises_at_the_release_naming_the_wait():
    block = _block()
    fs = FailStop(CudaHealthSource(block), agree_every=1000, name_of=lambda r, i: f"r{r}[{i}]")
    fs.after_launch(1)
    assert fs.release(1)
    _fail(block)
    fs.after_launch(2)  # step 2's copy carries the failure; after_launch reads nothing
    assert fs.first_failed_step is None
    fs.after_launch(3)
    with pytest.raises(FailStopError, match=r"r2\[23\]"):
        fs.release(2)  # world 1: straight to FAILED, raised where the tokens are awaited
    assert fs.first_failed_step == 2
    with pytest.raises(FailStopError):  # sticky: step 3's tokens never go either
        fs.release(3)


@pytest.mark.parametrize("depth", [2, 64])
def test_the_lagging_scripted_source_answers_as_the_cuda_source_does(depth):
    """The CPU tests of the engines' release paths run on ScriptedHealthSource(lagging=True):
    for the same calls it must answer for the same steps as CudaHealthSource, and show a
    failure from the same step on when every copy lands by the next release."""
    from mono_ext.runtime.failstop import ScriptedHealthSource

    block = _block()
    cuda = CudaHealthSource(block, depth=depth)
    scripted = ScriptedHealthSource(lagging=True, depth=depth)
    # async scheduling: step n+1 is launched before step n's tokens are awaited; some steps
    # are released twice, one never (dropped past depth), and one poll names no step
    calls = [("submit", 0), ("submit", 1), ("ready", 0), ("submit", 2), ("ready", None),
             ("submit", 3), ("submit", 4), ("submit", 5), ("ready", 4), ("ready", 4),
             ("fail", None), ("submit", 6), ("ready", 6), ("submit", 7), ("ready", 7),
             ("ready", 9)]  # fmt: skip
    for op, step in calls:
        if op == "submit":
            cuda.submit(step)
            scripted.submit(step)
        elif op == "fail":
            _fail(block)
            scripted.fail()
        else:
            got_c = [(s, w[h.H_FAILED]) for s, w in cuda.ready(step)]
            got_s = [(s, w[h.H_FAILED]) for s, w in scripted.ready(step)]
            assert got_c == got_s, (op, step, got_c, got_s)
