"""benchmarks/ab_paired.py: arms paired with the base of the same pass, the combined CSV's
rep column, kinds kept apart, and a clear stop on input it cannot use."""

from __future__ import annotations

import csv
import importlib.util
import random
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "ab_paired.py"
_spec = importlib.util.spec_from_file_location("ab_paired", _PATH)
ab = importlib.util.module_from_spec(_spec)
sys.modules["ab_paired"] = ab  # its dataclass looks its module up while the class is made
_spec.loader.exec_module(ab)


def _write(path: Path, rows: list[dict]) -> str:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return str(path)


def _pass(drift: float, arms: dict[str, float], widths=(1, 16), kind=None) -> list[dict]:
    """One pass: every arm's time = its offset + 50 us * width ** 0.5 + the pass's drift."""
    rows = []
    for arm, off in arms.items():
        for w in widths:
            r = {"device": "d", "width": w, "arm": arm, "median_us": 50 * w**0.5 + off + drift}
            rows.append({"kind": kind, **r} if kind else r)
    return rows


def test_arms_are_paired_within_a_pass(tmp_path):
    """Drift between passes far larger than the arms' difference cancels in the pairs; the
    unpaired medians would not see it."""
    rng = random.Random(3)
    offsets = [-1.5, -0.5, -1.0, -2.0, -1.2]
    paths = []
    for i, off in enumerate(offsets):
        arms = {"k2": 0.0, "k2 x=1": off, "torch": 400.0}
        paths.append(_write(tmp_path / f"p{i}.csv", _pass(rng.uniform(-10, 10), arms)))
    passes = ab.read_passes(paths)
    table = ab.paired(passes, "k2")
    assert set(table) == {("", "k2 x=1")}  # the stock arm is not a k2 arm
    for w in (1, 16):
        p = table[("", "k2 x=1")][w]
        assert p.passes == 5
        assert p.median == pytest.approx(-1.2)
        assert (p.low, p.high) == (pytest.approx(-2.0), pytest.approx(-0.5))
    every = ab.paired(passes, "k2", prefix="")
    assert every[("", "torch")][1].median == pytest.approx(400.0)


def test_an_arm_missing_from_a_pass_counts_only_where_it_ran(tmp_path):
    p1 = _write(tmp_path / "a.csv", _pass(0.0, {"k2": 0.0, "k2 a": 1.0, "k2 b": 3.0}))
    p2 = _write(tmp_path / "b.csv", _pass(5.0, {"k2": 0.0, "k2 a": 2.0}))
    table = ab.paired(ab.read_passes([p1, p2]), "k2")
    assert table[("", "k2 a")][1].passes == 2
    assert table[("", "k2 a")][1].median == pytest.approx(1.5)
    assert table[("", "k2 b")][1].passes == 1


def test_kinds_pair_with_their_own_base(tmp_path):
    rows = _pass(0.0, {"k1": 0.0, "k1 y": 1.0}, kind="gdn")
    rows += _pass(0.0, {"k1": 100.0, "k1 y": 99.0}, kind="attn")
    passes = ab.read_passes([_write(tmp_path / "k1.csv", rows)])
    table = ab.paired(passes, "k1")
    assert table[("gdn", "k1 y")][16].median == pytest.approx(1.0)
    assert table[("attn", "k1 y")][16].median == pytest.approx(-1.0)
    md = ab.markdown(table, ab.base_medians(passes, "k1"), "k1")
    assert md.splitlines()[0].startswith("| kind | arm | passes | w1 | w16 |")
    assert "| attn | k1 y | 1 | -1.00 [-1.00, -1.00] |" in md


def test_main_writes_the_combined_csv_and_the_table(tmp_path):
    paths = [
        _write(tmp_path / f"p{i}.csv", _pass(float(i), {"k2": 0.0, "k2 z": -1.0})) for i in range(3)
    ]
    out, md = tmp_path / "all.csv", tmp_path / "ab.md"
    assert ab.main(["--base", "k2", "--csv-out", str(out), "--md-out", str(md), *paths]) == 0
    with open(out, newline="") as f:
        got = list(csv.DictReader(f))
    assert [r["rep"] for r in got] == ["1"] * 4 + ["2"] * 4 + ["3"] * 4
    assert list(got[0])[:2] == ["rep", "device"]
    text = md.read_text()
    assert "| arm | passes | w1 | w16 |" in text  # no kind column for bench_k2's CSVs
    assert "| k2 z | 3 | -1.00 [-1.00, -1.00] | -1.00 [-1.00, -1.00] |" in text


def test_unusable_input_stops_with_one_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit, match="not a benchmark CSV"):
        ab.read_passes([str(bad)])
    good = _write(tmp_path / "g.csv", _pass(0.0, {"k2": 0.0}))
    with pytest.raises(SystemExit, match="no pass has the base arm 'k2 q'"):
        ab.paired(ab.read_passes([good]), "k2 q")
