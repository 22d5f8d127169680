"""benchmarks/_trace.py: per-CTA trace stamps of a TRACE build summarized."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "_trace.py"
_spec = importlib.util.spec_from_file_location("_trace", _PATH)
trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace)

NAMES = ("start", "mid", "only some", "end")


def _cta(*ns):
    return [*ns, *[0] * (16 - len(ns))]


def test_times_from_the_first_start_over_the_ctas_that_stamped():
    # three CTAs; the second starts 1 us late; only the third reaches "only some"
    stamps = [
        _cta(10_000, 12_000, 0, 20_000),
        _cta(11_000, 15_000, 0, 21_000),
        _cta(10_500, 13_000, 16_500, 30_000),
    ]
    pts = trace.trace_points(stamps, NAMES)
    assert [p["point"] for p in pts] == list(NAMES)
    assert pts[0] == {"point": "start", "ctas": 3, "min_us": 0.0, "median_us": 0.5, "max_us": 1.0}
    assert (pts[1]["min_us"], pts[1]["median_us"], pts[1]["max_us"]) == (2.0, 3.0, 5.0)
    assert pts[2] == {"point": "only some", "ctas": 1, "min_us": 6.5, "median_us": 6.5,
                      "max_us": 6.5}  # fmt: skip
    assert pts[3]["max_us"] == 20.0
    lines = trace.format_points(pts)
    assert len(lines) == 4 and "(1 CTAs)" in lines[2] and "only some" in lines[2]


def test_a_point_no_cta_reached_has_no_times():
    pts = trace.trace_points([_cta(5, 0, 0, 9)], NAMES)
    assert pts[1] == {"point": "mid", "ctas": 0, "min_us": None, "median_us": None,
                      "max_us": None}  # fmt: skip
    assert "-" in trace.format_points(pts)[1]


def test_no_start_stamp_is_an_error():
    with pytest.raises(ValueError, match="no CTA stamped its start"):
        trace.trace_points([_cta()] * 4, NAMES)
    with pytest.raises(ValueError, match="no CTA stamped its start"):
        trace.cta_times([_cta()] * 4, len(NAMES))


def test_cta_times_keep_each_cta_in_program_order():
    stamps = [_cta(10_000, 12_000, 0, 20_000), _cta(11_000, 15_000, 0, 21_500)]
    assert trace.cta_times(stamps, 4) == [[0.0, 2.0, None, 10.0], [1.0, 5.0, None, 11.5]]
