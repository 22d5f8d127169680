"""The per-rank sizes both kernel backends build K1 from (``models.qwen3_next.shapes``): one
definition, so that the Triton and FlyDSL fronts cannot disagree on a size, each backend
adding only its own limits. Plain Python: no kernel language is imported (FlyDSL's limits load
only inside its ``refusals``)."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from mono_ext.models.qwen3_next.configs import PRESETS, get_preset
from mono_ext.models.qwen3_next.dims import Dims
from mono_ext.models.qwen3_next.shapes import AttnFrontShape, GdnFrontShape

triton_plan = pytest.importorskip("mono_ext.models.qwen3_next.triton.k1_plan")


def _fly():
    return pytest.importorskip("mono_ext.models.qwen3_next.flydsl.k1")


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_both_backends_take_the_same_sizes_from_dims(preset, tp):
    d = Dims.from_config(get_preset(preset), tp=tp)
    fly = _fly()
    for base, tri, fl in (
        (GdnFrontShape, triton_plan.K1GdnShape, fly.K1GdnShape),
        (AttnFrontShape, triton_plan.K1AttnShape, fly.K1AttnShape),
    ):
        a, b, want = tri.from_dims(d), fl.from_dims(d), base.from_dims(d)
        assert isinstance(a, base) and isinstance(b, base)
        for f in fields(base):
            assert getattr(a, f.name) == getattr(b, f.name) == getattr(want, f.name), f.name
    g = GdnFrontShape.from_dims(d)
    assert (g.hk, g.hv, g.conv_k) == (d.hk_r, d.hv_r, d.conv_k)
    assert g.conv_dim == 2 * d.hk_r * d.dk + d.hv_r * d.dv
    assert g.qkvz_rows == g.conv_dim + d.hv_r * d.dv
    # conv out and z (the qkvz rows), beta and g per value head, rounded up to 16
    assert g.payload_words == -(-(g.qkvz_rows + 2 * d.hv_r) // 16) * 16


def test_payload_words_round_up_to_16():
    s = GdnFrontShape(hidden=64, hk=1, hv=3, dk=16, dv=16, conv_k=4, eps=1e-6)
    # conv 2*16 + 48 = 80, z 48, beta and g 3 each: 134 words -> 144
    assert s.payload_words == 144


def test_shared_refusals_reach_every_backend():
    fly = _fly()
    gdn = GdnFrontShape(hidden=2048, hk=2, hv=3, dk=128, dv=128, conv_k=4, eps=1e-6)
    attn = AttnFrontShape(hidden=2048, hq=3, hkv=2, head_dim=256, rotary_dim=63,
                          rope_theta=1e7, eps=1e-6)  # fmt: skip
    for cls in (triton_plan.K1GdnShape, fly.K1GdnShape):
        s = cls(**{f.name: getattr(gdn, f.name) for f in fields(gdn)})
        assert "Hv=3 is not a multiple of Hk=2" in s.refusals()
        with pytest.raises(ValueError, match=f"{cls.__name__} refused: Hv=3"):
            s.validate()
    for cls in (triton_plan.K1AttnShape, fly.K1AttnShape):
        s = cls(**{f.name: getattr(attn, f.name) for f in fields(attn)})
        bad = s.refusals()
        assert "rotary_dim=63 is not even and within head_dim 256" in bad
        assert "hq=3, hkv=2: need hkv >= 1 dividing hq" in bad


def test_backend_limits_stay_their_own():
    fly = _fly()
    d = Dims.from_config(get_preset("qwen3-next-80b-a3b"), tp=1)
    # a 32-wide head: the Triton K1 tiles it, the FlyDSL K1 spreads heads over 64-lane waves
    assert (
        replace(triton_plan.K1AttnShape.from_dims(d), head_dim=32, rotary_dim=16).refusals() == []
    )
    b = replace(fly.K1AttnShape.from_dims(d), head_dim=32, rotary_dim=16)
    assert b.refusals() == [
        "head_dim=32: the FlyDSL K1 spreads a head over a wave (multiple of 64)"
    ]
    # a 3-tap conv: only the Triton K1 is built for 4 taps
    g = triton_plan.K1GdnShape.from_dims(d)
    assert "conv kernel 3: K1 is built for 4" in replace(g, conv_k=3).refusals()
    assert not any("conv" in r for r in replace(fly.K1GdnShape.from_dims(d), conv_k=3).refusals())
    assert triton_plan.K1GdnShape.from_dims(d).refusals() == []
    assert fly.K1GdnShape.from_dims(d).refusals() == []
