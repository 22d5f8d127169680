"""The FlyDSL K2 (layer tail) for gfx950: what a CPU can check. The hand-off program (checked
by runtime.layout), the host-side tensor checks and launch arguments, and the compiled ISA
(clean metadata; MFMA, the bounded spin on s_memrealtime, the health atomic, scope-correct
tagged stores). Its numerics need an MI355X (the Buildkite MI355 step); none ran here."""

import re
from dataclasses import replace

import pytest
import torch

from mono_ext.kernels.flydsl.limits import BLOCK, GFX950
from mono_ext.models.qwen3_next.flydsl.k2 import (
    QWEN3_NEXT_80B,
    RT_ENTRIES,
    WEIGHT_ENTRIES,
    K2Build,
    K2Shape,
    build_k2,
    k2_program,
)
from mono_ext.runtime.layout import HandoffError, Stage, check_handoffs, plan_layout

SMALL = K2Shape(hidden=64, in_dim=32, experts=4, top_k=2, moe_inter=64, shared_inter=64,
                norm_topk=True, eps=1e-6)  # fmt: skip


def _body(isa: str, name: str) -> str:
    m = re.search(rf"^{name}:\n(.*?)\ts_endpgm", isa, re.S | re.M)
    assert m, f"no body for {name}"
    return m.group(1)


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("width", [1, 16])
def test_program_hand_offs_check_and_size_per_width(tp, width):
    s = replace(QWEN3_NEXT_80B["gdn"], tp=tp)
    prog = k2_program(s, width)
    lay = plan_layout(prog, tp)
    names = [st.name for st in prog.stages]
    assert names[:5] == ["out_proj", "residual", "norm_router", "topk_gate_up", "down"]
    assert (names[-1] == "moe_out") == (tp > 1)
    assert lay.region("p1").peer == (tp > 1)
    assert lay.region("resid").words == width * s.hidden
    assert lay.region("logits").words == width * s.experts
    assert lay.region("act").words == (width * s.top_k + width) * s.act_words
    assert lay.region("ids").words == width * s.top_k
    # a program whose down stage waited before anyone wrote the activations is refused
    bad = replace(prog, stages=(Stage("down", [*prog.stages[4].ops]), *prog.stages[:4]))
    with pytest.raises(HandoffError, match="act"):
        check_handoffs(bad)


def test_shape_and_width_refusals():
    with pytest.raises(ValueError, match="hidden=100"):
        K2Build(replace(SMALL, hidden=100), 1)
    with pytest.raises(ValueError, match="tp=3"):
        K2Build(replace(SMALL, tp=3), 1)
    with pytest.raises(ValueError, match="widths 1..16"):
        K2Build(SMALL, 17)
    with pytest.raises(ValueError, match="kind"):
        K2Build(SMALL, 1, kind="mlp")


def _tensors(b: K2Build):
    s, w = b.shape, b.width
    bf = dict(dtype=torch.bfloat16)
    weights = {k: torch.zeros(shp, **bf) for k, shp in b.weight_shapes().items()}
    acts = dict(
        o_in=torch.zeros(w, s.in_dim, **bf),
        residual=torch.zeros(w, s.hidden, **bf),
        out_hidden=torch.zeros(w, s.hidden, **bf),
        out_residual=torch.zeros(w, s.hidden, **bf),
    )
    return acts, weights


def test_host_checks_name_every_mismatch():
    b = K2Build(SMALL, 3, kind="attn")
    acts, weights = _tensors(b)
    gate = torch.zeros_like(acts["o_in"])
    assert b.check(**acts, weights=weights, gate=gate) == []
    assert any("missing gate" in r for r in b.check(**acts, weights=weights))
    weights["w2"] = torch.zeros(4, 64, 32, dtype=torch.bfloat16)
    acts["o_in"] = torch.zeros(2, 32, dtype=torch.float32)  # wrong width and dtype
    del weights["router"]
    reasons = b.check(**acts, weights=weights, gate=gate)
    assert any("w2 is (4, 64, 32)" in r for r in reasons)
    assert any("o_in is (2, 32), expected (3, 32)" in r for r in reasons)
    assert any("o_in is torch.float32" in r for r in reasons)
    assert any("missing weight 'router'" in r for r in reasons)
    gdn = K2Build(SMALL, 3, kind="gdn")
    acts, weights = _tensors(gdn)
    assert any("not gated" in r for r in gdn.check(**acts, weights=weights, gate=gate))


def test_tables_and_launch_arguments():
    b = K2Build(replace(SMALL, tp=2), 2)
    acts, weights = _tensors(b)
    wt = b.weight_table(weights)
    assert len(wt) == len(WEIGHT_ENTRIES) and wt[3] == weights["w13"].data_ptr()
    with pytest.raises(ValueError, match="missing weight 'w2'"):
        b.weight_table({k: v for k, v in weights.items() if k != "w2"})
    scratch = torch.zeros(b.layout.scratch_words, dtype=torch.int64)
    xs = torch.zeros(b.xs_bytes, dtype=torch.uint8)
    ctrl = torch.zeros(4, dtype=torch.int64)
    health = torch.zeros(64, dtype=torch.int32)
    kw = dict(scratch=scratch, xs=xs, ctrl=ctrl, health=health)
    with pytest.raises(ValueError, match="needs the peer table"):
        b.runtime_table(**kw)
    with pytest.raises(ValueError, match="scratch holds fewer"):
        b.runtime_table(**{**kw, "scratch": scratch[:1]}, peers=ctrl)
    rt = b.runtime_table(**kw, peers=torch.zeros(2, dtype=torch.int64))
    assert len(rt) == len(RT_ENTRIES) and rt[1] == xs.data_ptr()
    wtab, rtab = torch.tensor(wt), torch.tensor(rt)
    del acts["out_hidden"], acts["out_residual"]
    outs = dict(out_hidden=torch.zeros(2, 64, dtype=torch.bfloat16),
                out_residual=torch.zeros(2, 64, dtype=torch.bfloat16))  # fmt: skip
    args = b.args(**acts, **outs, wtab=wtab, rtab=rtab, layer=3, layers_per_step=48)
    assert len(args) == 9 and args[-2:] == (3, 48) and args[5] == wtab.data_ptr()
    with pytest.raises(ValueError, match="layer 48 outside"):
        b.args(**acts, **outs, wtab=wtab, rtab=rtab, layer=48, layers_per_step=48)
    with pytest.raises(ValueError, match="rtab must be 5 int64"):
        b.args(**acts, **outs, wtab=wtab, rtab=wtab)
    with pytest.raises(ValueError, match="gate must be given exactly"):
        b.args(**acts, **outs, wtab=wtab, rtab=rtab, gate=acts["o_in"])


@pytest.mark.parametrize("kind", ["gdn", "attn"])
def test_k2_isa_has_the_protocol_and_mfma(kind):
    c = build_k2(kind, 2).check()
    (k,) = c.kernels
    assert k.workgroup_size == BLOCK and c.grid == GFX950.cus and k.ctas_per_cu() >= 1
    body = _body(c.isa[k.name], k.name)
    assert "v_mfma_f32_16x16x16_bf16" in body  # out_proj and the shared expert on MFMA
    assert "s_memrealtime" in body  # bounded waits: deadlines on the constant clock
    assert re.search(r"s_cbranch_execnz", body)  # spin loops
    assert len(re.findall(r"global_load_dwordx2 .* sc0 sc1", body)) >= 3  # uncached re-loads
    assert "global_atomic_add" in body  # a give-up bumps the sticky failed word
    assert re.search(r"global_store_dwordx2 .* sc1$", body, re.M)  # agent-scope tagged stores
    assert "s_barrier" in body and "v_exp_f32" in body  # block reductions; softmax / SiLU


def test_k2_tp_build_pushes_peer_regions_only():
    s = replace(QWEN3_NEXT_80B["gdn"], tp=2, in_dim=2048, moe_inter=256, shared_inter=256)
    c = build_k2("gdn", 1, shape=s).check()
    (k,) = c.kernels
    stores = re.findall(r"global_store_dwordx2 .*", _body(c.isa[k.name], k.name))
    system = [st for st in stores if st.endswith("sc0 sc1")]  # peer pushes write through
    agent = [st for st in stores if st.endswith(" sc1") and not st.endswith("sc0 sc1")]
    # p1 and p4 are pushed to both ranks (system scope); resid, logits, act and ids stay
    # local (agent scope): a local region pushed to peers would land at the wrong offsets
    assert system and agent
