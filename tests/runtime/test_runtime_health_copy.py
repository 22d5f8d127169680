"""Who enqueues a step's health copy (runtime.persistent), on CPU with a recording source.

The copy belongs on the step's stream right after its last launch: inside a capture it becomes
a node of the graph, so a replayed step must not get a second one from the host, while a step
whose launches were not followed by one (a caller that only calls ``end_step``) must get it at
``end_step``, or FailStop would read a block older than the step.
"""

from mono_ext.runtime.failstop import FailStop
from mono_ext.runtime.persistent import PersistentLaunches, PersistentRuntime


class RecordingSource:
    def __init__(self):
        self.events = []  # ("copy", capturing) and ("submit", step, copied)
        self.capturing = False

    def copy(self):
        self.events.append(("copy", self.capturing))

    def submit(self, step, copied=False):
        self.events.append(("submit", step, copied))

    def ready(self, until_step=None):
        return []


class Runtime(PersistentRuntime):
    def __init__(self, source):
        self.source = source
        self.failstop = FailStop(source, agree_every=1000)
        self.steps = 0

    def capturing(self):
        return self.source.capturing


def _launches():
    src = RecordingSource()
    launches = PersistentLaunches()
    launches.runtime = Runtime(src)
    return launches, src


def test_an_eager_step_with_its_copy_gets_no_second_one():
    launches, src = _launches()
    launches.health_copy()
    assert launches.end_step() == 1
    assert src.events == [("copy", False), ("submit", 1, True)]
    assert launches.end_step() == 2  # the next eager step made no copy of its own
    assert src.events[-1] == ("submit", 2, False)


def test_replays_of_a_graph_holding_the_copy_get_none_from_the_host():
    launches, src = _launches()
    src.capturing = True
    launches.health_copy()  # recorded into the graph
    assert launches.end_step(replayed=True) is None  # nothing while capturing
    src.capturing = False
    src.events.clear()
    assert [launches.end_step(replayed=True) for _ in range(3)] == [1, 2, 3]
    assert src.events == [("submit", n, True) for n in (1, 2, 3)]


def test_replays_of_a_graph_without_the_copy_get_it_at_end_step():
    launches, src = _launches()
    assert launches.end_step(replayed=True) == 1
    assert src.events == [("submit", 1, False)]  # the source copies before marking the step


def test_an_eager_step_after_captures_still_needs_its_own_copy():
    launches, src = _launches()
    src.capturing = True
    launches.health_copy()
    src.capturing = False
    assert launches.end_step() == 1  # eager, launches not followed by a copy
    assert src.events[-1] == ("submit", 1, False)
