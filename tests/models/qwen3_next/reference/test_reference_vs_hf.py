"""The fp32 K1/K2 reference against transformers' own Qwen3-Next / Qwen3.5-MoE modules.

A tiny HF model (random, well-conditioned weights) prefills a few tokens with a cache, then
decodes. Each decode step, every layer's HF input is fed to the reference, whose outputs and
in-place states must match HF's within rel_l2 < 1e-5. The reference carries its own engine-
layout state pools from step to step (seeded once from HF after the prefill).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mono_ext.models.qwen3_next.configs import get_preset, layer_types  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402
from mono_ext.models.qwen3_next.reference import (  # noqa: E402
    attn_front,
    attn_out_input,
    decode_attention,
    decoder_layer_step,
    gdn_front,
    gdn_state_from_hf,
    layer_tail,
    layer_weights_from_hf,
    rel_l2,
    repack_ba,
    repack_qkvz,
)

TOL = 1e-5
CONFIGS = ["qwen3-next-tiny", "qwen3-next-tiny-b", "qwen3.5-moe-tiny", "qwen3.5-moe-tiny-b"]


def _hf_config(name: str):
    cfg = get_preset(name)
    mt = cfg.pop("model_type")
    hf = transformers.AutoConfig.for_model(mt, **cfg)
    hf._attn_implementation = "sdpa"  # causal prefill without building a mask
    return hf


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded, well-conditioned values for every parameter (HF's init leaves norms at 0)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(shape, std):
        return torch.randn(shape, generator=g) * std

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 15 + 1))
            elif name.endswith("dt_bias"):
                p.copy_(1 + rnd(p.shape, 0.3))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + rnd(p.shape, 0.2))
            elif "norm" in name:
                p.copy_(rnd(p.shape, 0.2))  # Gemma-style: applied as 1 + w
            elif "conv1d" in name:
                p.copy_(rnd(p.shape, 0.3))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(rnd(p.shape, 0.3))  # spread router probabilities
            elif "embed_tokens" in name:
                p.copy_(rnd(p.shape, 1.0))
            else:
                p.copy_(rnd(p.shape, 1.0 / math.sqrt(p.shape[-1])))


def _build(name: str, seed: int = 0):
    hf_cfg = _hf_config(name)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32)
    model.eval()
    _randomize(model, seed)
    return model, hf_cfg


class _Recorder:
    """Records each decoder layer's input/output and the K1 outputs (o_proj/out_proj input)."""

    def __init__(self, layers):
        self.inp, self.out, self.o_in, self.router = {}, {}, {}, {}
        self.handles = []
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._post(i)))
            proj = layer.linear_attn.out_proj if hasattr(layer, "linear_attn") else None
            proj = proj if proj is not None else layer.self_attn.o_proj
            self.handles.append(proj.register_forward_pre_hook(self._oin(i)))
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):
                self.handles.append(layer.mlp.gate.register_forward_hook(self._route(i)))

    def _pre(self, i):
        def hook(mod, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            self.inp[i] = h.detach().clone()

        return hook

    def _post(self, i):
        def hook(mod, args, out):
            self.out[i] = (out[0] if isinstance(out, tuple) else out).detach().clone()

        return hook

    def _oin(self, i):
        def hook(mod, args):
            self.o_in[i] = args[0].detach().clone()

        return hook

    def _route(self, i):
        def hook(mod, args, out):
            self.router[i] = (out[1].detach().clone(), out[2].detach().clone())

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def _run_case(name: str, *, conv_layout: str, packing: str | None, seed: int, steps: int = 2):
    torch.manual_seed(seed + 1)
    model, hf_cfg = _build(name, seed)
    dims = Dims.from_config(hf_cfg)
    kinds = layer_types(get_preset(name))
    layers = model.model.layers
    bsz, t0 = 3, 5
    n_slots = bsz + 4
    null_slot = 0 if conv_layout == "time_chan" else None
    g = torch.Generator().manual_seed(seed + 2)
    slots = torch.randperm(n_slots - 1, generator=g)[:bsz] + 1  # slot 0 stays the null slot

    ids = torch.randint(0, hf_cfg.vocab_size, (bsz, t0), generator=g)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values

    weights, pools, kv = {}, {}, {}
    for i, kind in enumerate(kinds):
        weights[i] = layer_weights_from_hf(layers[i], dims, packing=packing)
        if kind == "linear_attention":
            lc = cache.layers[i]
            conv, ssm = gdn_state_from_hf(
                lc.conv_states[0], lc.recurrent_states[0], dims, conv_layout
            )
            conv_pool = torch.randn(n_slots, *conv.shape[1:], generator=g)
            ssm_pool = torch.randn(n_slots, *ssm.shape[1:], generator=g)
            conv_pool[slots], ssm_pool[slots] = conv, ssm
            pools[i] = (conv_pool, ssm_pool)
        else:
            keys, values = cache.layers[i].keys, cache.layers[i].values  # [B, Hkv, T, D]
            kc = torch.randn(n_slots, t0 + steps, dims.hkv, dims.head_dim, generator=g)
            vc = torch.randn_like(kc)
            kc[slots, :t0], vc[slots, :t0] = keys.transpose(1, 2), values.transpose(1, 2)
            kv[i] = (kc, vc)

    pkg = packing or ("interleaved" if hf_cfg.model_type == "qwen3_next" else "contiguous")
    rec = _Recorder(layers)
    try:
        for step in range(steps):
            nxt = torch.randint(0, hf_cfg.vocab_size, (bsz, 1), generator=g)
            with torch.no_grad():
                model(input_ids=nxt, past_key_values=cache, use_cache=True)
            pos = torch.full((bsz,), t0 + step, dtype=torch.long)
            for i, kind in enumerate(kinds):
                h = rec.inp[i][:, 0]
                r = torch.randn(h.shape, generator=g)  # split the stream into hidden + residual
                w = weights[i]
                if kind == "linear_attention":
                    conv_pool, ssm_pool = pools[i]
                    before = (conv_pool.clone(), ssm_pool.clone())
                    front = gdn_front(
                        h - r, r, w["input_layernorm"], w, dims, conv_pool, ssm_pool, slots,
                        conv_layout=conv_layout, packing=pkg, null_slot=null_slot,
                    )  # fmt: skip
                    tail = layer_tail(front.o_in, front.residual_out, w, dims, kind="gdn")
                    lc = cache.layers[i]
                    conv_hf, ssm_hf = gdn_state_from_hf(
                        lc.conv_states[0], lc.recurrent_states[0], dims, conv_layout
                    )
                    assert rel_l2(conv_pool[slots], conv_hf) < TOL
                    assert rel_l2(ssm_pool[slots], ssm_hf) < TOL
                    others = torch.ones(n_slots, dtype=torch.bool)
                    others[slots] = False
                    assert torch.equal(conv_pool[others], before[0][others])
                    assert torch.equal(ssm_pool[others], before[1][others])
                    o_in = front.o_in
                else:
                    kc, vc = kv[i]
                    f = attn_front(h - r, r, w["input_layernorm"], w, dims, pos)
                    kc[slots, pos], vc[slots, pos] = f.k, f.v
                    attn = decode_attention(f.q, kc[slots], vc[slots], pos + 1)
                    o_in = attn_out_input(attn, f.gate)
                    tail = layer_tail(o_in, f.residual_out, w, dims, kind="attn")
                    hf_k = cache.layers[i].keys[:, :, -1]
                    hf_v = cache.layers[i].values[:, :, -1]
                    assert rel_l2(f.k, hf_k) < TOL and rel_l2(f.v, hf_v) < TOL
                assert rel_l2(o_in, rec.o_in[i][:, 0]) < TOL, (name, step, i, "o_in")
                assert rel_l2(tail.layer_output, rec.out[i][:, 0]) < TOL, (name, step, i)
                if i in rec.router:
                    hf_w, hf_ids = rec.router[i]
                    assert torch.equal(tail.topk_ids, hf_ids)
                    assert rel_l2(tail.topk_weights, hf_w) < TOL
                    assert tail.near_tie.dtype == torch.bool and tail.near_tie.shape == (bsz,)
    finally:
        rec.remove()


@pytest.mark.parametrize("name", CONFIGS)
def test_decode_steps_match_hf(name):
    _run_case(name, conv_layout="time_chan", packing=None, seed=11)


@pytest.mark.parametrize("name", ["qwen3-next-tiny", "qwen3.5-moe-tiny-b"])
def test_other_packing_and_chan_time_conv_layout_match_hf(name):
    # Qwen3-Next weights repacked contiguous, Qwen3.5 weights interleaved: the packing is a
    # pure layout choice, and the chan_time conv layout (slot, C, K-1) with -1 padding works.
    other = "contiguous" if name.startswith("qwen3-next") else "interleaved"
    _run_case(name, conv_layout="chan_time", packing=other, seed=5)


def test_dense_mlp_layers_match_hf():
    _run_case("qwen3-next-tiny-dense-mlp", conv_layout="time_chan", packing=None, seed=3, steps=1)


def test_moe_block_alone_matches_hf():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    hf_cfg = _hf_config("qwen3-next-tiny-b")  # norm_topk_prob False
    dims = Dims.from_config(hf_cfg)
    torch.manual_seed(0)
    block = Qwen3NextSparseMoeBlock(hf_cfg).eval()
    _randomize(block, 7)
    x = torch.randn(9, dims.hidden)
    sd = {"mlp." + k: v for k, v in block.state_dict().items()}
    from mono_ext.models.qwen3_next.reference.convert import _experts
    from mono_ext.models.qwen3_next.reference.tail import moe_forward

    w = {
        "router": sd["mlp.gate.weight"],
        **_experts(sd, dims),
        "shared_gate_up": torch.cat(
            [sd["mlp.shared_expert.gate_proj.weight"], sd["mlp.shared_expert.up_proj.weight"]]
        ),
        "shared_down": sd["mlp.shared_expert.down_proj.weight"],
        "shared_expert_gate": sd["mlp.shared_expert_gate.weight"],
    }
    with torch.no_grad():
        ref_hf = block(x[None])[0]
    out, ids, tw, _ = moe_forward(x, w, dims)
    assert rel_l2(out, ref_hf) < TOL
    assert ids.shape == (9, 3) and not torch.allclose(tw.sum(-1), torch.ones(9))


def _gdn_setup(name="qwen3-next-tiny", seed=0, ssm_dtype=torch.float32):
    model, hf_cfg = _build(name, seed)
    dims = Dims.from_config(hf_cfg)
    w = layer_weights_from_hf(model.model.layers[0], dims)
    g = torch.Generator().manual_seed(seed)
    n_slots = 6
    conv = torch.randn(n_slots, dims.conv_k - 1, dims.conv_dim, generator=g)
    ssm = torch.randn(n_slots, dims.hv, dims.dv, dims.dk, generator=g).to(ssm_dtype)
    h = torch.randn(4, dims.hidden, generator=g)
    return dims, w, conv, ssm, h


def test_padding_rows_leave_states_bit_untouched():
    dims, w, conv, ssm, h = _gdn_setup()
    conv0, ssm0 = conv.clone(), ssm.clone()
    # vLLM pads with its null slot (0 here); SGLang with -1. Rows 1 and 3 are padding.
    slots = torch.tensor([2, 0, 5, -1])
    front = gdn_front(h, None, w["input_layernorm"], w, dims, conv, ssm, slots, null_slot=0)
    assert torch.equal(front.o_in[1], torch.zeros(dims.value_dim))
    assert torch.equal(front.o_in[3], torch.zeros(dims.value_dim))
    assert front.o_in[0].abs().sum() > 0 and front.o_in[2].abs().sum() > 0
    untouched = torch.tensor([0, 1, 3, 4])
    assert torch.equal(conv[untouched], conv0[untouched])
    assert torch.equal(ssm[untouched], ssm0[untouched])
    assert not torch.equal(conv[2], conv0[2]) and not torch.equal(ssm[5], ssm0[5])
    # every padding row: nothing read or written, and the valid rows do not depend on them
    conv2, ssm2 = conv0.clone(), ssm0.clone()
    conv2[0], ssm2[0] = float("nan"), float("nan")  # poisoned null slot must never be read
    f2 = gdn_front(h, None, w["input_layernorm"], w, dims, conv2, ssm2, slots, null_slot=0)
    assert torch.equal(f2.o_in, front.o_in)
    assert torch.isnan(conv2[0]).all() and torch.isnan(ssm2[0]).all()


def test_bf16_state_path():
    dims, w, conv, ssm32, h = _gdn_setup()
    ssm16 = ssm32.to(torch.bfloat16)
    conv16 = conv.to(torch.bfloat16)
    slots = torch.tensor([1, 4, 2, 3])
    ref_in = ssm16.float()  # same starting values for both runs
    f32_out = gdn_front(
        h, None, w["input_layernorm"], w, dims, conv16.float(), ref_in, slots, null_slot=0
    )
    f16_out = gdn_front(h, None, w["input_layernorm"], w, dims, conv16, ssm16, slots, null_slot=0)
    assert ssm16.dtype == torch.bfloat16 and conv16.dtype == torch.bfloat16
    # math is fp32 either way; only the stored state is rounded to bf16
    assert rel_l2(f16_out.o_in, f32_out.o_in) < TOL
    assert torch.equal(ssm16[slots], ref_in[slots].to(torch.bfloat16))
    assert torch.equal(conv16[slots], conv16.float()[slots].to(torch.bfloat16))


def test_conv_layouts_and_packings_agree_exactly():
    dims, w, conv, ssm, h = _gdn_setup("qwen3.5-moe-tiny-b")
    slots = torch.tensor([3, 1, 5, 2])
    res = torch.randn(h.shape)
    a_conv, a_ssm = conv.clone(), ssm.clone()
    a = decoder_layer_step(
        h, res, w, dims, kind="gdn", slots=slots, conv_state=a_conv, ssm_state=a_ssm,
        conv_layout="time_chan", packing="contiguous", null_slot=0,
    )  # fmt: skip
    w2 = dict(w)
    w2["in_proj_qkvz"] = repack_qkvz(w["in_proj_qkvz"], dims, "contiguous", "interleaved")
    w2["in_proj_ba"] = repack_ba(w["in_proj_ba"], dims, "contiguous", "interleaved")
    b_conv, b_ssm = conv.transpose(1, 2).contiguous(), ssm.clone()
    b = decoder_layer_step(
        h, res, w2, dims, kind="gdn", slots=slots, conv_state=b_conv, ssm_state=b_ssm,
        conv_layout="chan_time", packing="interleaved",
    )  # fmt: skip
    assert torch.equal(a.layer_output, b.layer_output)
    assert torch.equal(a_conv, b_conv.transpose(1, 2))
    assert torch.equal(a_ssm, b_ssm)
    back = repack_qkvz(w2["in_proj_qkvz"], dims, "interleaved", "contiguous")
    assert torch.equal(back, w["in_proj_qkvz"])
