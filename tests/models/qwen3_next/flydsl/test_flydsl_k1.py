"""The FlyDSL K1 for gfx950 (GDN and attention fronts). CPU checks: the hand-off programs,
shape and layout refusals, host-side tensor and state checks, and the compiled ISA (MFMA,
bounded waits on s_memrealtime, the health atomic). No numerics ran here (no MI355X)."""

import re
from dataclasses import replace

import pytest
import torch

from mono_ext.models.qwen3_next.flydsl import backend
from mono_ext.models.qwen3_next.flydsl.k1 import (
    QWEN3_NEXT_80B_ATTN,
    QWEN3_NEXT_80B_GDN,
    K1AttnBuild,
    K1GdnBuild,
    build_k1_attn,
    build_k1_gdn,
    k1_attn_program,
    k1_gdn_program,
)
from mono_ext.runtime.layout import HandoffError, Stage, check_handoffs, plan_layout


def _body(isa: str, name: str) -> str:
    m = re.search(rf"^{name}:\n(.*?)\ts_endpgm", isa, re.S | re.M)
    assert m, f"no body for {name}"
    return m.group(1)


def test_backend_status_says_nothing_ran_on_gfx950():
    assert backend.NOT_BUILT == () and backend.missing_reason() is None
    assert any("launch binding" in r and "never ran" in r for r in backend.WRITTEN)
    assert backend.build.faster_widths == frozenset()  # serves no width until measured


@pytest.mark.parametrize("width", [1, 16])
def test_program_and_sizes(width):
    s = QWEN3_NEXT_80B_ATTN
    prog = k1_attn_program(s, width)
    lay = plan_layout(prog)
    assert lay.region("qk").words == width * (s.hq + s.hkv) * s.head_dim
    with pytest.raises(HandoffError):
        check_handoffs(replace(prog, stages=(Stage("norm_rope", [*prog.stages[1].ops]),)))


def test_refusals():
    s = QWEN3_NEXT_80B_ATTN
    with pytest.raises(ValueError, match="head_dim=96"):
        K1AttnBuild(replace(s, head_dim=96, rotary_dim=32), 1)
    with pytest.raises(ValueError, match="rotary_dim=300"):
        K1AttnBuild(replace(s, rotary_dim=300), 1)
    with pytest.raises(ValueError, match="hq=3"):
        K1AttnBuild(replace(s, hq=3), 1)
    with pytest.raises(ValueError, match="widths 1..16"):
        K1AttnBuild(s, 0)


def test_host_checks():
    s = replace(QWEN3_NEXT_80B_ATTN, hidden=64, hq=2, hkv=1, head_dim=64, rotary_dim=16)
    b = K1AttnBuild(s, 2)
    bf = dict(dtype=torch.bfloat16)
    weights = {n: torch.zeros(shp, **bf) for n, shp in b.weight_shapes().items()}
    t = dict(
        hidden=torch.zeros(2, 64, **bf),
        residual=None,
        residual_out=torch.zeros(2, 64, **bf),
        positions=torch.zeros(2, dtype=torch.int64),
        q=torch.zeros(2, 128, **bf),
        gate=torch.zeros(2, 128, **bf),
        k=torch.zeros(2, 64, **bf),
        v=torch.zeros(2, 64, **bf),
    )
    assert b.check(**t, weights=weights) == []
    t["positions"] = torch.zeros(2, dtype=torch.int32)
    t["k"] = torch.zeros(2, 128, **bf)
    del weights["q_norm"]
    reasons = b.check(**t, weights=weights)
    assert "positions must be int64 [2]" in reasons
    assert any("k is (2, 128), expected (2, 64)" in r for r in reasons)
    assert "missing weight 'q_norm'" in reasons


def test_isa_has_mfma_and_bounded_waits():
    c = build_k1_attn(4).check()
    (k,) = c.kernels
    body = _body(c.isa[k.name], k.name)
    assert "v_mfma_f32_16x16x16_bf16" in body
    assert "s_memrealtime" in body and "global_atomic_add" in body
    assert len(re.findall(r"global_load_dwordx2 .* sc0 sc1", body)) >= 2
    assert re.search(r"global_store_dwordx2 .* sc1$", body, re.M)


SMALL_GDN = replace(QWEN3_NEXT_80B_GDN, hidden=64, hk=1, hv=2, dk=128, dv=128)


@pytest.mark.parametrize("width", [1, 16])
def test_gdn_program_and_payload(width):
    s = QWEN3_NEXT_80B_GDN
    lay = plan_layout(k1_gdn_program(s, width))
    assert s.conv_dim == 2 * 16 * 128 + 32 * 128 and s.qkvz_rows == s.conv_dim + 32 * 128
    assert lay.region("proj").words == width * (s.conv_dim + 32 * 128 + 2 * 32)


def test_gdn_refusals():
    with pytest.raises(ValueError, match="Hv=3 is not a multiple of Hk=2"):
        K1GdnBuild(replace(SMALL_GDN, hk=2, hv=3), 1)
    with pytest.raises(ValueError, match="dv=96"):
        K1GdnBuild(replace(SMALL_GDN, dv=96), 1)
    with pytest.raises(ValueError, match="packing='zz'"):
        K1GdnBuild(SMALL_GDN, 1, packing="zz")
    with pytest.raises(ValueError, match="widths 1..16"):
        K1GdnBuild(SMALL_GDN, 17)


def test_gdn_host_and_state_checks():
    b = K1GdnBuild(SMALL_GDN, 2, conv_layout="chan_time", ssm_layout="kv")
    s = SMALL_GDN
    bf = dict(dtype=torch.bfloat16)
    weights = {n: torch.zeros(shp, **bf) for n, shp in b.weight_shapes().items()}
    weights["A_log"] = torch.zeros(s.hv)
    weights["conv1d"] = torch.zeros(s.conv_dim, 1, s.conv_k, **bf)
    t = dict(
        hidden=torch.zeros(2, 64, **bf),
        residual=torch.zeros(2, 64, **bf),
        residual_out=torch.zeros(2, 64, **bf),
        slots=torch.zeros(2, dtype=torch.int32),
        o_in=torch.zeros(2, s.hv * s.dv, **bf),
    )
    assert b.check(**t, weights=weights) == []
    weights["A_log"] = torch.zeros(s.hv, **bf)
    t["slots"] = torch.zeros(2, dtype=torch.int64)
    reasons = b.check(**t, weights=weights)
    assert "slots must be int32 [2]" in reasons and any("A_log must be" in r for r in reasons)
    conv = torch.zeros(5, s.conv_dim, s.conv_k - 1, **bf)  # chan_time [S, C, K-1]
    ssm = torch.zeros(5, s.hv, s.dv, s.dk)
    tab = b.state_table(conv, ssm)
    assert tab == [conv.data_ptr(), conv.stride(0), ssm.data_ptr(), ssm.stride(0)]
    with pytest.raises(ValueError, match="conv_state slots must be contiguous"):
        b.state_table(conv.transpose(1, 2), ssm)  # a time_chan state for a chan_time build
    with pytest.raises(ValueError, match="ssm_state is torch.bfloat16"):
        b.state_table(conv, ssm.to(torch.bfloat16))


@pytest.mark.parametrize(
    "layouts",
    [
        {},
        dict(packing="contiguous", conv_layout="chan_time", ssm_layout="kv", state_dtype="bfloat16",
             dt_bias_dtype="float32"),
    ],
)  # fmt: skip
def test_gdn_isa_every_layout_family(layouts):
    c = build_k1_gdn(3, **layouts).check()
    (k,) = c.kernels
    body = _body(c.isa[k.name], k.name)
    assert "v_mfma_f32_16x16x16_bf16" in body
    assert "s_memrealtime" in body and "global_atomic_add" in body
    assert len(re.findall(r"global_load_dwordx2 .* sc0 sc1", body)) >= 2
    assert "v_exp_f32" in body and "v_log_f32" in body  # decay, softplus
