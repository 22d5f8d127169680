import math

import pytest
import torch

from mono_ext.core.numerics import CheckTracker, compare, metrics, parse_numerics

NUM = {"k2.hidden.cosine": 0.999, "k2.hidden.rel_l2": 1e-2, "k2.hidden.max_abs": 0.5}


def _pair(rows=8, cols=64, noise=1e-4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(rows, cols, generator=g)
    return ref + noise * torch.randn(rows, cols, generator=g), ref


def test_metrics_match_definitions():
    out, ref = _pair(noise=0.05)
    m = metrics(out, ref)
    assert m["rel_l2"] == pytest.approx(float((out - ref).norm() / ref.norm()), rel=1e-6)
    cos = float((out.flatten() @ ref.flatten()) / (out.norm() * ref.norm()))
    assert m["cosine"] == pytest.approx(cos, rel=1e-6)
    assert m["max_abs"] == pytest.approx(float((out - ref).abs().max()), rel=1e-6)


def test_close_passes_far_breaches_every_metric():
    out, ref = _pair(noise=1e-4)
    assert compare("k2", "hidden", out, ref, NUM) == []
    far = compare("k2", "hidden", -out, ref, NUM, where="layer 3")
    assert {b.name for b in far} == set(NUM)
    assert all(str(b).startswith("layer 3: k2.hidden.") for b in far)


def test_nan_always_breaches():
    out, ref = _pair()
    out[2, 5] = math.nan
    assert {b.name for b in compare("k2", "hidden", out, ref, NUM)} == set(NUM)


def test_bad_names_and_missing_thresholds():
    with pytest.raises(ValueError, match="<launch>.<output>.<metric>"):
        parse_numerics({"k2.hidden": 0.1})
    with pytest.raises(ValueError):
        parse_numerics({"k2.hidden.median": 0.1})
    with pytest.raises(KeyError, match="k1.out"):
        compare("k1", "out", *_pair(), NUM)


def test_tracker_skips_near_tie_rows_with_a_bounded_rate():
    out, ref = _pair(rows=10)
    out[3] = -ref[3]  # a row routed to other experts: wrong unless skipped
    skip = [i == 3 for i in range(10)]
    t = CheckTracker(NUM, max_skip_rate=0.2)
    assert t.check("k2", "hidden", out, ref, skip_rows=skip) == []
    assert t.rows_skipped == 1 and t.problems() == []
    assert t.check("k2", "hidden", out, ref) != []  # not skipped: breaches
    tight = CheckTracker(NUM, max_skip_rate=0.05)
    tight.check("k2", "hidden", out, ref, skip_rows=skip)
    assert any("near-tie" in p for p in tight.problems())
    with pytest.raises(ValueError, match="flags"):
        t.check("k2", "hidden", out, ref, skip_rows=[True])
