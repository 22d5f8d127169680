"""benchmarks/bench_host.py on the CPU (the scripted health source): every part of a replayed
step is timed, the file carries its provenance, and the profile is a second pass that names
the driver's and FailStop's functions."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(_BENCH))  # the script imports its sibling _provenance
    try:
        spec = importlib.util.spec_from_file_location("bench_host", _BENCH / "bench_host.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(_BENCH))


def test_parts_provenance_and_profile(bench, tmp_path):
    out, prof = tmp_path / "host.json", tmp_path / "host_profile.txt"
    assert bench.main(["--steps", "200", "--json", str(out), "--profile", str(prof)]) == 0
    data = json.loads(out.read_text())
    assert data["steps"] == 200 and data["device"].startswith("cpu")
    assert {"date", "commit", "command", "torch"} <= set(data)
    assert set(data["median_us"]) == {"after_step", "queue", "release", "total"}
    assert all(v > 0 for v in data["median_us"].values())
    assert data["median_us"]["total"] >= data["median_us"]["after_step"]
    assert data["call_median_us"] == {}  # device calls are timed on CUDA only
    text = prof.read_text()
    assert "driver.py" in text and "(after_step)" in text and "(after_launch)" in text


def test_run_steps_releases_every_step_but_the_last(bench):
    parts = bench.run_steps(_Driver(), step=None, replay=None, sync=None, n=5)
    assert [len(parts[k]) for k in ("after_step", "queue", "release", "total")] == [5, 5, 4, 4]


def test_engine_work_runs_before_every_step_and_is_recorded(bench, tmp_path):
    calls: list[int] = []
    parts = bench.run_steps(_Driver(), None, None, None, n=6, between=lambda: calls.append(1))
    assert len(calls) == 6 and len(parts["total"]) == 5
    out = tmp_path / "host.json"
    assert bench.main(["--steps", "50", "--engine-work", "100", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["engine_work"] == 100


class _Driver:
    """A driver whose tickets release at once."""

    def after_step(self, step, replayed):
        from mono_ext.runtime.release import Ticket

        return Ticket(lambda: None, 4, step)
