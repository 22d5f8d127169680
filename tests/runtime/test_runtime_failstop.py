"""FailStop state machine with a fake health word, and agreement over a gloo world of 2 (CPU)."""

import os
import tempfile
from pathlib import Path

import pytest

from mono_ext.runtime import health as h
from mono_ext.runtime.failstop import (
    FAILED,
    OK,
    SUSPECT,
    FailStop,
    FailStopError,
    VirtualFailStop,
    agree_health,
)
from tests._support.gloo import leave


class FakeSource:
    """A health block the test sets; copies 'land' after ``lag`` further submits."""

    def __init__(self, lag: int = 0):
        self.words = h.health_init_words()
        self.lag = lag
        self.pending = []

    def fail(self, region=0, index=17, cta=2, rank=0):
        self.words[h.H_FAILED] += 1
        base = h.H_RECORDS
        self.words[base : base + h.RECORD_WORDS] = [region, index, 5, 4, cta, rank, 3, 10**6]

    def copy(self):
        pass

    def submit(self, step, copied=False):
        self.pending.append((step, list(self.words)))

    def ready(self, until_step=None):
        n = len(self.pending) - self.lag
        if until_step is not None:
            n = max(n, next((i + 1 for i, (s, _) in enumerate(self.pending) if s == until_step), 0))
        out, self.pending = self.pending[:n], self.pending[n:]
        return out


def names(region, index):
    return f"k2.ar_o[{index}]"


def test_healthy_steps_release_tokens():
    fs = FailStop(FakeSource(), agree_every=4)
    for step in range(1, 10):
        fs.after_launch(step)
        assert fs.release(step)
    assert fs.state == OK


def test_world_one_raises_on_first_failed_step_naming_the_wait():
    src = FakeSource()
    fs = FailStop(src, agree_every=16, name_of=names)
    fs.after_launch(1)
    assert fs.release(1)
    src.fail()
    with pytest.raises(FailStopError, match=r"k2\.ar_o\[17\]") as e:
        fs.after_launch(2)
    assert e.value.step == 2 and fs.state == FAILED
    with pytest.raises(FailStopError):  # sticky, no fallback
        fs.release(3)


def test_one_step_late_read_still_withholds_the_failed_step():
    src = FakeSource(lag=1)  # graphs: the copy of step s lands during step s + 1
    fs = FailStop(src, agree_every=16)
    fs.world = 2  # pretend a TP peer exists, so nothing raises before the agreement
    fs.after_launch(1)
    src.fail()
    fs.after_launch(2)
    assert fs.state == OK  # step 2's copy has not landed yet
    assert fs.release(1)
    assert not fs.release(2)  # reading it (the engine synced for tokens) shows the failure
    assert fs.state == SUSPECT and fs.first_failed_step == 2
    fs.after_launch(3)
    assert not fs.release(3)  # and every later step


def test_agreement_every_n_steps_raises_on_all_virtual_ranks_together():
    srcs = [FakeSource() for _ in range(4)]
    vfs = VirtualFailStop(srcs, agree_every=4, name_of=names)
    vfs.after_launch(1)
    srcs[2].fail(rank=2)
    vfs.after_launch(2)
    vfs.after_launch(3)  # no raise between agreements
    assert not vfs.release(3)
    with pytest.raises(FailStopError) as e:
        vfs.after_launch(4)
    assert vfs.raised == [0, 1, 2, 3]
    assert e.value.failed_ranks == (2,)
    assert all(fs.state == FAILED for fs in vfs.ranks)
    with pytest.raises(FailStopError):
        vfs.after_launch(5)


def test_agree_every_comes_from_settings(monkeypatch):
    monkeypatch.setenv("MONO_EXT_AGREE_EVERY", "3")
    assert FailStop(FakeSource()).agree_every == 3


def test_agree_health_world_one_is_a_no_op():
    s = h.HealthSummary(rank=0, failed_waits=0)
    assert agree_health(s, None) == [s]


def _gloo_worker(rank, init_file, out_dir):
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    src = FakeSource()
    fs = FailStop(src, rank=rank, group=dist.group.WORLD, agree_every=4, name_of=names)
    raised_at = message = None
    try:
        for step in range(1, 9):
            if rank == 1 and step == 2:
                src.fail(rank=1)
            fs.after_launch(step)
            fs.release(step)
    except FailStopError as e:
        raised_at, message = step, str(e)
    with open(os.path.join(out_dir, f"r{rank}.json"), "w") as f:
        json.dump({"raised_at": raised_at, "message": message, "state": fs.state}, f)
    leave(dist)


def test_gloo_world_of_two_raises_together():
    import json

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_gloo_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        res = [json.loads(Path(tmp, f"r{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert r["raised_at"] == 4, res  # the first agreement after the failure, on both
        assert r["state"] == FAILED
        assert "rank 1: 1 wait(s) gave up" in r["message"] and "k2.ar_o[17]" in r["message"]
