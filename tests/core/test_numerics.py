import math
import random

import pytest
import torch

from mono_ext.core.numerics import (
    CheckTracker,
    GreedyAgreement,
    compare,
    greedy_agreement,
    metrics,
    parse_numerics,
    same_context_kl,
    topk_kl,
)

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


# --- greedy agreement of two engine runs (flag off / on) -----------------------------------

VOCAB, TOPK, STEPS, TIE = 512, 10, 24, 0.02


def _topk(logits: list[float], k: int = TOPK, key=str) -> dict:
    """The top-k logprobs (full-vocabulary log-softmax) of ``logits``, as an engine returns them."""
    top = max(logits)
    lse = top + math.log(sum(math.exp(x - top) for x in logits))
    best = sorted(range(len(logits)), key=lambda t: -logits[t])[:k]
    return {key(t): logits[t] - lse for t in best}


def _near_uniform(rng: random.Random) -> list[float]:
    # a random tiny model's logits: small, so the top tokens are close to each other
    return [rng.gauss(0.0, 0.05) for _ in range(VOCAB)]


def _runs(seed: int, flip_at: int | None = None, gap: float = 4e-4, key_on=str):
    """Two runs of one request: ``on`` sees ``off``'s logits plus ~1e-4 of rounding noise. With
    ``flip_at``, the top two tokens there are ``gap`` apart and swapped in ``on`` (each run then
    continues its own text: unrelated logits after the flip)."""
    rng = random.Random(seed)
    toks_off, toks_on, lps_off, lps_on = [], [], [], []
    for i in range(STEPS):
        off = _near_uniform(rng)
        if flip_at is not None and i > flip_at:
            # a different context: other probabilities for off's top tokens
            top = set(sorted(range(VOCAB), key=lambda t: -off[t])[:TOPK])
            on = [x + rng.uniform(0.0, 0.5) if t in top else x for t, x in enumerate(off)]
        else:
            on = [x + rng.gauss(0.0, 1e-4) for x in off]
        a = max(range(VOCAB), key=lambda t: off[t])
        if i == flip_at:
            b = sorted(range(VOCAB), key=lambda t: -off[t])[1]
            off[a] = off[b] + gap  # off: a first, b (still second) `gap` below
            on = list(off)
            on[a], on[b] = off[b], off[a]  # on: the same two, swapped
        else:
            # keep the noise from flipping a pick by accident away from the intended flip
            off[a] += 0.01
            on[a] = off[a]
        toks_off.append(max(range(VOCAB), key=lambda t: off[t]))
        toks_on.append(max(range(VOCAB), key=lambda t: on[t]))
        lps_off.append(_topk(off))
        lps_on.append(_topk(on, key=key_on))
    return toks_off, toks_on, lps_off, lps_on


def _flat(pairs) -> list[float]:
    return [x for pair in pairs for x in pair]


def test_greedy_agreement_exact():
    t_off, t_on, lp_off, lp_on = _runs(seed=1)
    assert t_off == t_on and len(set(t_off)) > STEPS // 2  # varied tokens, all equal
    g = greedy_agreement(t_off, t_on, lp_off, lp_on, TIE)
    assert isinstance(g, GreedyAgreement)
    assert g.exact and g.ok and not g.near_tie and g.divergence is None
    assert (g.length, g.agreeing, g.same_context) == (STEPS, STEPS, STEPS)
    assert g.margin_off is None and g.margin_on is None
    assert g.describe() == f"exact over {STEPS} positions"


def test_greedy_agreement_accepts_a_near_tie_flip():
    t_off, t_on, lp_off, lp_on = _runs(seed=2, flip_at=9, gap=4e-4)
    assert t_off[:9] == t_on[:9] and t_off[9] != t_on[9]
    g = greedy_agreement(t_off, t_on, lp_off, lp_on, TIE)
    assert g.ok and g.near_tie and not g.exact
    assert (g.divergence, g.agreeing, g.same_context) == (9, 9, 10)
    assert (g.token_off, g.token_on) == (t_off[9], t_on[9])
    assert g.margin_off == pytest.approx(4e-4, abs=1e-9)
    assert g.margin_on == pytest.approx(4e-4, abs=1e-9)
    assert "step 9/24" in g.describe() and "near tie" in g.describe()
    # the same flip with a tolerance below its margin is a real divergence
    tight = greedy_agreement(t_off, t_on, lp_off, lp_on, 1e-4)
    assert not tight.ok and "margin" in tight.reason


def test_greedy_agreement_rejects_a_large_margin_flip():
    t_off, t_on, lp_off, lp_on = _runs(seed=3, flip_at=5, gap=0.08)
    g = greedy_agreement(t_off, t_on, lp_off, lp_on, TIE)
    assert not g.ok and not g.near_tie and g.divergence == 5
    assert g.margin_off == pytest.approx(0.08) and g.margin_on == pytest.approx(0.08)
    assert "off margin" in g.reason and "on margin" in g.reason
    assert "real divergence" in g.describe() and "step 5" in g.describe()


def test_greedy_agreement_rejects_a_negative_margin():
    # "on" reports logprobs that rank "off"'s token first, yet picked another one
    t_off, t_on, lp_off, lp_on = _runs(seed=4, flip_at=7, gap=3e-3)
    lp_on = [dict(d) for d in lp_on]
    lp_on[7] = dict(lp_off[7])  # on's logprobs as off's: its own pick is 3e-3 below
    g = greedy_agreement(t_off, t_on, lp_off, lp_on, TIE)
    assert g.margin_on == pytest.approx(-3e-3, abs=1e-9) and not g.ok
    assert "on margin" in g.reason


def test_greedy_agreement_rejects_a_pick_missing_from_a_top_k():
    t_off, t_on, lp_off, lp_on = _runs(seed=5, flip_at=12, gap=2e-4)
    lp_off = [dict(d) for d in lp_off]
    del lp_off[12][str(t_on[12])]  # on's pick not in off's top-k (e.g. a smaller k)
    g = greedy_agreement(t_off, t_on, lp_off, lp_on, TIE)
    assert not g.ok and g.margin_off is None and g.margin_on == pytest.approx(2e-4, abs=1e-9)
    assert f"{t_on[12]} (on's pick) not in off's top-{TOPK - 1}" in g.reason
    assert "n/a" in g.describe()


def test_greedy_agreement_int_and_str_keys():
    t_off, t_on, lp_off, lp_on = _runs(seed=6, flip_at=3, gap=1e-3, key_on=int)
    assert all(isinstance(k, str) for k in lp_off[3]) and all(isinstance(k, int) for k in lp_on[3])
    g = greedy_agreement([str(t) for t in t_off], t_on, lp_off, lp_on, TIE)
    assert g.ok and g.near_tie and g.divergence == 3
    assert g.margin_off == pytest.approx(1e-3, abs=1e-9) and g.margin_on == pytest.approx(
        1e-3, abs=1e-9
    )
    # the KL sees the shared tokens whatever the key type (plain topk_kl would share none)
    mixed = same_context_kl(lp_off, lp_on, g)
    assert topk_kl(lp_off[0], lp_on[0])[1] == 0.0
    assert all(mass > 0.0 for _, mass in mixed)
    same = same_context_kl(lp_off, [{str(t): v for t, v in d.items()} for d in lp_on], g)
    assert _flat(mixed) == pytest.approx(_flat(same))


def test_same_context_kl_leaves_out_positions_after_the_divergence():
    t_off, t_on, lp_off, lp_on = _runs(seed=7, flip_at=15, gap=5e-4)
    g = greedy_agreement(t_off, t_on, lp_off, lp_on, TIE)
    assert g.ok and g.same_context == 16
    kls = same_context_kl(lp_off, lp_on, g, start=1)  # decode positions 1..15
    assert len(kls) == 15
    assert _flat(kls) == pytest.approx(_flat(topk_kl(lp_off[i], lp_on[i]) for i in range(1, 16)))
    kept = max(kl for kl, _ in kls)
    assert 0.0 < kept < 1e-5  # the same context: only rounding noise (and the flip's swap)
    after = [topk_kl(lp_off[i], lp_on[i])[0] for i in range(16, STEPS)]
    assert min(after) > 100 * kept  # different contexts: excluded, they would swamp the mean
    exact = greedy_agreement(t_off[:15], t_on[:15], lp_off[:15], lp_on[:15], TIE)
    assert len(same_context_kl(lp_off, lp_on, exact, start=1)) == 14
    with pytest.raises(ValueError, match="logprob positions"):
        same_context_kl(lp_off[:10], lp_on, g)


def test_greedy_agreement_bad_inputs():
    t_off, t_on, lp_off, lp_on = _runs(seed=8)
    with pytest.raises(ValueError, match="token counts"):
        greedy_agreement(t_off, t_on[:-1], lp_off, lp_on, TIE)
    with pytest.raises(ValueError, match="on: 23 logprob positions"):
        greedy_agreement(t_off, t_on, lp_off, lp_on[:-1], TIE)
    with pytest.raises(ValueError, match="tie_nats"):
        greedy_agreement(t_off, t_on, lp_off, lp_on, -0.1)
