"""runtime.host_timer: the mean covers every call, the median and p90 only the recent ones."""

from __future__ import annotations

import pytest

from mono_ext.runtime import host_timer
from mono_ext.runtime.host_timer import HostTimer


def test_median_ignores_slow_first_calls(monkeypatch):
    now = {"t": 0}
    monkeypatch.setattr(host_timer.time, "perf_counter_ns", lambda: now["t"])
    timer = HostTimer(window=8)
    for ns in [5_000_000] * 2 + [10_000] * 7 + [30_000]:  # two 5 ms warm-ups, then ~10 us
        t = timer.start()
        now["t"] += ns
        timer.stop("after_forward", t)
    r = timer.report()
    assert r["host_calls"] == {"after_forward": 10}
    assert r["host_us"]["after_forward"] == pytest.approx((10e6 + 70_000 + 30_000) / 10 / 1e3)
    assert r["host_us_median"]["after_forward"] == 10.0  # the window holds the last 8 calls
    assert r["host_us_p90"]["after_forward"] == 30.0


def test_hooks_are_separate_and_window_must_be_positive():
    timer = HostTimer()
    timer.stop("release", timer.start())
    timer.stop("forward", timer.start())
    timer.stop("forward", timer.start())
    r = timer.report()
    assert r["host_calls"] == {"forward": 2, "release": 1}
    assert set(r["host_us_median"]) == {"forward", "release"}
    with pytest.raises(ValueError, match="window"):
        HostTimer(window=0)


def test_timed_counts_calls_that_raise():
    timer = HostTimer()

    def boom() -> None:
        raise RuntimeError("failed step")

    with pytest.raises(RuntimeError, match="failed step"):
        timer.timed("release", boom)()
    timer.timed("release", lambda: None)()
    assert timer.report()["host_calls"] == {"release": 2}


def _spin(n: int) -> int:
    return sum(i * i for i in range(n))


def test_profile_names_the_functions_inside_the_hooks():
    timer = HostTimer(profile=True)
    for _ in range(3):
        t = timer.start()
        inner = timer.start()  # a hook timing a part of itself: still one profile
        _spin(2000)
        timer.stop("after_step", inner)
        _spin(50)
        timer.stop("after_forward", t)
    _spin(10)  # outside every hook: not profiled
    t = timer.start(profiled=False)
    _spin(10)  # a hook kept out of the profile
    timer.stop("forward", t, profiled=False)
    rows = timer.report()["host_profile"]
    spin = [r for r in rows if r["function"].endswith("(_spin)")]
    assert len(spin) == 1 and spin[0]["calls"] == 6
    assert spin[0]["cum_us"] > 0 and rows == sorted(rows, key=lambda r: -r["own_total_ms"])


def test_no_profile_unless_asked():
    timer = HostTimer()
    timer.stop("release", timer.start())
    assert "host_profile" not in timer.report() and timer.profile_rows() == []


def test_call_returns_the_result_and_counts_the_call():
    timer = HostTimer()
    assert timer.call("after_step", lambda a, b=0: a + b, 2, b=3) == 5
    assert timer.report()["host_calls"] == {"after_step": 1}
