"""The SGLang adapter on real SGLang 0.5.17 model objects, on CPU (the sglang test venv).

Tiny Qwen3-Next and Qwen3.5-MoE checkpoints (``mono_ext.tools.checkpoint``, random weights)
are loaded by SGLang's own loader into SGLang's own classes; GDN states and KV buffers are
SGLang's ``HybridReqToTokenPool`` / ``HybridLinearKVPool``. Checked here:

- binding: every plane the adapter binds is the engine's tensor (same storage) and equals
  the reference's engine-layout conversion of the checkpoint (both qkvz packings, the fused
  shared-expert slot);
- the three refusal stages accept these models and refuse, with every reason, what they
  cannot serve (then the model keeps SGLang's forward);
- dispatch on real ``ForwardBatch`` objects: DECODE of 1..16 rows routes, EXTEND, MIXED,
  TARGET_VERIFY, IDLE and wider steps run SGLang's forward; a routed step (reference
  backend) gives the logits and GDN states of an independent oracle built from the
  checkpoint, never touches a padded row's state, for both slot sources;
- the check after CUDA-graph capture, and check mode's calls into SGLang's layer code.

SGLang's own GDN/MoE/attention kernels do not run on CPU: the engine attention here is a
plain stand-in registered as the step's attention backend, and only the parts of check mode
whose SGLang code runs on CPU are compared. Run: tools/test.sh, or
``.venvs/sglang/bin/python -m pytest -m sglang tests``.
"""

from __future__ import annotations

import logging
import socket
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")
pytest.importorskip("safetensors")

from mono_ext.engines.sglang import has_native_api  # noqa: E402

if has_native_api():
    pytest.skip(
        "SGLang with the kernel-plugin API: see test_sglang_native_api.py", allow_module_level=True
    )


from mono_ext.core.refusal import Refusal, Stage  # noqa: E402
from mono_ext.core.settings import Settings  # noqa: E402
from mono_ext.engines.sglang import serving as serving_mod  # noqa: E402
from mono_ext.engines.sglang.dispatch import (  # noqa: E402
    CaptureCheck,
    Router,
    install,
    router_of,
    uninstall,
)
from mono_ext.engines.sglang.flags import Monokernel  # noqa: E402
from mono_ext.engines.sglang.qwen3_next import bind_caches, step_slots  # noqa: E402
from mono_ext.engines.sglang.serving import Serving  # noqa: E402
from mono_ext.engines.sglang.views import step_view  # noqa: E402
from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402
from mono_ext.models.qwen3_next.reference import (  # noqa: E402
    attn_front,
    decode_attention,
    decoder_layer_step,
    layer_weights_from_state_dict,
    rel_l2,
)
from mono_ext.models.qwen3_next.reference.common import gemma_rms_norm  # noqa: E402
from mono_ext.tools.checkpoint import make_checkpoint  # noqa: E402
from tests.engines._support.sglang_common import (  # noqa: E402
    BF16,
    SLOTS,
    Spy,
)
from tests.engines._support.sglang_common import active as _active  # noqa: E402
from tests.engines._support.sglang_common import batch as _batch  # noqa: E402
from tests.engines._support.sglang_common import load_with_tensors as _load  # noqa: E402
from tests.engines._support.sglang_common import pools as _pools  # noqa: E402
from tests.engines._support.sglang_common import serving as _serving  # noqa: E402

TOL = 3e-2  # launches round every output to bf16; the oracle stays fp32


# -- building SGLang objects on CPU (_support/sglang_common: shared with the other suites) ----
@pytest.fixture(scope="module")
def qn(tmp_path_factory):
    return _load(make_checkpoint(tmp_path_factory.mktemp("qn"), "qwen3-next-tiny"))


@pytest.fixture(scope="module")
def q35(tmp_path_factory):
    return _load(make_checkpoint(tmp_path_factory.mktemp("q35"), "qwen3.5-moe-tiny"))


@pytest.fixture(scope="module")
def qn_fused(tmp_path_factory):
    cfg = get_preset("qwen3-next-tiny")
    cfg["shared_expert_intermediate_size"] = cfg["moe_intermediate_size"]  # SGLang fuses then
    return _load(make_checkpoint(tmp_path_factory.mktemp("qnf"), cfg), fused=True)


@pytest.fixture
def cleanup():
    models = []
    yield models.append
    for m in models:
        uninstall(m)


# -- binding ----------------------------------------------------------------------------------
def _storage_of(model):
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


@pytest.mark.parametrize("which", ["qn", "q35", "qn_fused"])
def test_planes_are_the_engine_tensors_and_equal_the_reference_view(which, request):
    env = request.getfixturevalue(which)
    sv = _serving(env)
    assert not sv.off, sv.refusal.message()
    dims = Dims.from_config(env.mc.hf_config.to_dict())
    prefix = "model.language_model." if which == "q35" else "model."
    storages = _storage_of(env.model)
    packing = "contiguous" if which == "q35" else "interleaved"
    for b in sv.model.layers:
        p = f"{prefix}layers.{b.index}."
        sd = {k[len(p) :]: v for k, v in env.sd.items() if k.startswith(p)}
        ref = layer_weights_from_state_dict(sd, dims)
        assert set(b.planes) == set(ref), b.index
        for name, t in b.planes.items():
            assert t.untyped_storage().data_ptr() in storages, f"layer {b.index} {name} is a copy"
            assert t.dtype == ref[name].dtype, (b.index, name)
            assert torch.equal(t, ref[name]), f"layer {b.index}: {name} differs from the reference"
        if b.kind == "linear_attention":
            assert b.facts["qkvz_packing"] == packing
        want = "fused_slot" if which == "qn_fused" else "module"
        assert b.facts["shared_expert"] == want
    if which == "qn_fused":
        experts = sv.model.layers[0].module.mlp.experts
        assert experts.w13_weight.shape[0] == dims.experts + 1  # SGLang's extra slot
        assert sv.model.layers[0].module.mlp.shared_expert is None


def test_caches_are_the_mamba_pool_tensors(qn):
    sv, rp, kvp = _active(qn)
    for i, conv in sv.caches.conv.items():
        state = rp.mamba2_layer_cache(i)
        for got, want in ((conv, state.conv[0]), (sv.caches.ssm[i], state.temporal)):
            assert got.data_ptr() == want.data_ptr() and got.shape == want.shape
        assert tuple(conv.shape[1:]) == (sv.dims.conv_dim_r, sv.dims.conv_k - 1)  # chan_time layout
    for i, k in sv.caches.kv.items():
        assert k.data_ptr() == kvp.get_key_buffer(i).data_ptr()
    assert sv.caches.num_slots == SLOTS
    assert sv.spec.deployment.layouts == {
        "conv_layout": "chan_time",
        "ssm_layout": "vk",
        "qkvz_packing": "interleaved",
    }


# -- refusals -----------------------------------------------------------------------------------
def test_config_stage_names_every_reason_and_model_stays_stock(qn):
    mc = qn.mc
    sa = SimpleNamespace(
        speculative_algorithm="EAGLE",
        enable_lora=True,
        ep_size=2,
        enable_torch_compile=True,
        nnodes=2,
        enable_linear_replayssm=True,
        expert_distribution_recorder_mode="stat",
        cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(backend="breakable")),
    )
    sv = Serving(Monokernel("reference"), settings=Settings())
    # fp8 / compressed-tensors / mxfp4 go on to the model stage (judged plane by plane:
    # test_sglang_quant.py); a quant method mono_ext does not recognise stops here
    refusal = sv.accept_config(mc.hf_config, sa, dtype=torch.float16, quantization="awq")
    assert refusal.stage is Stage.CONFIG and sv.off
    text = refusal.message()
    assert text.startswith("mono_ext off: [config] ")
    for needle in (
        "spec_decode is on",
        "lora is on",
        "expert_parallel is on",
        "piecewise_graphs_only is on",
        "dtype float16",
        "quantization 'awq' is not one mono_ext recognises",
        "--enable-torch-compile",
        "multi-node tensor parallelism",
        "--enable-linear-replayssm",
        "expert distribution recorder",
    ):
        assert needle in text, needle
    # later stages do nothing once refused; the model keeps SGLang's forward
    assert sv.accept_model(qn.model) is refusal
    assert "forward" not in qn.model.__dict__


def test_unsupported_architecture_is_a_config_reason():
    sv = Serving(Monokernel("reference"), settings=Settings())
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}
    refusal = sv.accept_config(llama, SimpleNamespace(), dtype=BF16, quantization=None)
    assert refusal.message() == (
        "mono_ext off: [config] no mono_ext model spec serves ['LlamaForCausalLM'] "
        "(specs: qwen3_next)"
    )


def test_config_stage_refuses_unavailable_backend_and_check_mode_under_graphs(qn):
    mc = qn.mc
    graphs = SimpleNamespace(
        cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(backend="full"))
    )
    sv = Serving(Monokernel("triton"), settings=Settings(check=True))
    refusal = sv.accept_config(mc.hf_config, graphs, dtype=mc.dtype, quantization=None)
    assert "kernel backend 'triton' cannot run here" in refusal.message()
    assert "MONO_EXT_CHECK=1" in refusal.message()


def test_model_stage_refuses_quantized_unknown_packing_and_unreadable_fused_slot(qn_fused):
    model = qn_fused.model
    layers = model.model.layers
    la, mlp = layers[0].linear_attn, layers[1].mlp
    saved = (la.out_proj.quant_method, type(la), mlp.num_fused_shared_experts)

    class Fp8LinearMethod:
        pass

    class OtherGatedDeltaNet(type(la)):
        pass

    la.out_proj.quant_method = Fp8LinearMethod()
    la.__class__ = OtherGatedDeltaNet
    mlp.num_fused_shared_experts = 2  # a slot layout the binding cannot read in place
    try:
        sv = _serving(qn_fused)
    finally:
        la.out_proj.quant_method, la.__class__, mlp.num_fused_shared_experts = saved
    text = sv.refusal.message()
    assert sv.refusal.stage is Stage.MODEL
    assert "layer 0: out_proj uses quant method 'Fp8LinearMethod'" in text
    assert "OtherGatedDeltaNet has no known in_proj_qkvz packing" in text
    assert "needs --disable-shared-experts-fusion" in text


def test_cache_stage_refuses_strided_states_and_fp8_kv(qn):
    sv = _serving(qn)
    rp, _ = _pools(qn.mc)
    _, kv8 = _pools(qn.mc, kv_dtype=torch.float8_e4m3fn)

    class StridedPool:  # slots interleaved with other data, as envelope layouts do
        mamba_pool = rp.mamba_pool

        def mamba2_layer_cache(self, i):
            s = rp.mamba2_layer_cache(i)
            conv = torch.zeros(s.conv[0].shape[0] * 2, *s.conv[0].shape[1:], dtype=BF16)[::2]
            return SimpleNamespace(conv=[conv], temporal=s.temporal)

    refusal = sv.accept_caches(StridedPool(), kv8)
    text = refusal.message()
    assert refusal.stage is Stage.CACHES
    assert "conv_state slots are not dense" in text
    assert "kv_cache is float8_e4m3fn" in text
    assert not sv.active


def test_every_stage_goes_through_rank_agreement(qn, monkeypatch):
    seen = []

    def fake_agree(refusal, group=None):
        seen.append((refusal.stage, group))
        extra = ("ranks 1: caches differ on a peer",) if refusal.stage is Stage.CACHES else ()
        return Refusal.of(refusal.stage, refusal.reasons + extra)

    from mono_ext.serve import lifecycle

    monkeypatch.setattr(lifecycle, "agree", fake_agree)  # the stages' one agreement
    sv = Serving(Monokernel("reference"), group="tp-cpu-group", settings=Settings())
    mc = qn.mc
    sv.accept_config(mc.hf_config, qn.sa, dtype=mc.dtype, quantization=None)
    sv.accept_model(qn.model)
    refusal = sv.accept_caches(*_pools(mc))
    assert [s for s, _ in seen] == [Stage.CONFIG, Stage.MODEL, Stage.MODEL, Stage.CACHES]
    assert {g for _, g in seen} == {"tp-cpu-group"}
    assert "ranks 1: caches differ on a peer" in refusal.message() and not sv.active


def test_an_internal_error_is_a_reason_not_a_crash(qn, monkeypatch):
    def boom(*a, **k):
        raise KeyError("w13_weight")

    monkeypatch.setattr(serving_mod, "bind_model", boom)
    sv = _serving(qn)
    assert "internal error in the model stage: KeyError" in sv.refusal.message()


# -- dispatch ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode,bs,tokens,routed",
    [
        ("DECODE", 1, 1, True),
        ("DECODE", 4, 1, True),
        ("DECODE", 16, 1, True),
        ("DECODE", 17, 1, False),
        ("EXTEND", 4, 3, False),
        ("MIXED", 4, 2, False),
        ("TARGET_VERIFY", 4, 4, False),
        ("IDLE", 1, 0, False),
    ],
)
def test_plan_routes_only_pure_decode_of_served_widths(qn, mode, bs, tokens, routed):
    sv, *_ = _active(qn)
    router = Router(sv, Spy())
    fb = _batch(mode, bs, tokens_per_row=tokens)
    step = router.plan(fb)
    assert (step is not None) == routed, step_view(fb)
    if routed:
        assert step.width == bs and step.key.width == bs and step.key.backend == "reference"


def test_stock_steps_call_sglangs_forward_and_routed_ones_do_not(qn, cleanup):
    sv, rp, kvp = _active(qn)
    spy = Spy()
    router = Router(sv, spy, attn_backend=FakeAttention(rp, kvp))
    install(qn.model, router)
    cleanup(qn.model)
    assert router_of(qn.model) is router
    fb = _batch("EXTEND", 2, tokens_per_row=3)
    assert qn.model.forward(fb.input_ids, torch.zeros(6, dtype=torch.long), fb) == "stock"
    # embeddings given: a routed step would ignore them, so SGLang's forward runs
    dec = _batch("DECODE", 2)
    out = qn.model.forward(dec.input_ids, torch.zeros(2), dec, inputs_embeds=torch.zeros(2, 64))
    assert out == "stock"
    assert spy.calls == [("EXTEND", 2), ("DECODE", 2)]
    uninstall(qn.model)
    assert "forward" not in qn.model.__dict__ and router_of(qn.model) is None


# -- a routed step against an independent oracle -------------------------------------------------
class FakeAttention:
    """The step's attention backend on CPU: SGLang's decode attention kernels need CUDA, so
    this writes k/v into SGLang's KV pool at ``out_cache_loc`` and attends over the request's
    tokens (``req_to_token``) in plain fp32. ``slots`` play ``mamba_cache_indices``."""

    def __init__(self, rp, kvp, slots=None):
        self.req_to_token_pool, self.token_to_kv_pool = rp, kvp
        meta = None if slots is None else SimpleNamespace(mamba_cache_indices=slots)
        self.linear_attn_backend = SimpleNamespace(forward_metadata=meta)

    def forward(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        kb = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        vb = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        hkv, d = kb.shape[1], kb.shape[2]
        kb[fb.out_cache_loc] = k.reshape(-1, hkv, d).to(kb.dtype)
        vb[fb.out_cache_loc] = v.reshape(-1, hkv, d).to(vb.dtype)
        out = torch.zeros(q.shape[0], layer.tp_q_head_num * d, dtype=q.dtype)
        for i in range(q.shape[0]):
            locs = self.req_to_token_pool.req_to_token[fb.req_pool_indices[i], : fb.seq_lens[i]]
            qi = q[i].reshape(1, layer.tp_q_head_num, d)
            o = decode_attention(
                qi, kb[locs.long()][None], vb[locs.long()][None], scale=layer.scaling
            )
            out[i] = o[0].to(q.dtype)
        return out


def _oracle_weights(env, prefix):
    dims = Dims.from_config(env.mc.hf_config.to_dict())
    per_layer = []
    for i, kind in enumerate(env.mc.hf_text_config.layers_block_type):
        p = f"{prefix}layers.{i}."
        sd = {k[len(p) :]: v for k, v in env.sd.items() if k.startswith(p)}
        per_layer.append(
            (
                "gdn" if kind == "linear_attention" else "attn",
                layer_weights_from_state_dict(sd, dims),
            )
        )
    return dims, per_layer


@pytest.mark.parametrize("which", ["qn", "q35"])
@pytest.mark.parametrize("slot_source", ["backend_metadata", "pool"])
def test_routed_steps_match_the_oracle_and_spare_padded_rows(which, slot_source, request, cleanup):
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    env = request.getfixturevalue(which)
    sv, rp, kvp = _active(env)
    prefix = "model.language_model." if which == "q35" else "model."
    dims, layers = _oracle_weights(env, prefix)
    g = torch.Generator().manual_seed(7)
    pool = rp.mamba_pool.mamba_cache
    for c in pool.conv:
        c.copy_(0.3 * torch.randn(c.shape, generator=g))
    pool.temporal.copy_(0.1 * torch.randn(pool.temporal.shape, generator=g))
    full = kvp.full_kv_pool
    for buf in (*full.k_buffer, *full.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=g))
    # three requests padded to a batch of four (SGLang pads decode batches to graph sizes)
    bs, real, hist = 4, 3, [5, 2, 7]
    reqs = torch.tensor([1, 3, 5, 0])
    mslots = torch.tensor([2, 6, 4, -1], dtype=torch.int32)
    for r, s in zip(reqs[:real].tolist(), mslots[:real].tolist(), strict=True):
        rp.req_index_to_mamba_index_mapping[r] = s
    loc, first = 10, {}
    for r, n in zip(reqs[:real].tolist(), hist, strict=True):
        rp.req_to_token[r, : n + 2] = torch.arange(loc, loc + n + 2)
        first[r] = loc
        loc += n + 2
    # oracle state: copies of the pool, contiguous KV history per row
    conv0 = {i: t.clone() for i, t in sv.caches.conv.items()}
    ssm0 = {i: t.clone() for i, t in sv.caches.ssm.items()}
    tmax = max(hist) + 2
    kc, vc = {}, {}
    for i, kind in enumerate(env.mc.hf_text_config.layers_block_type):
        if kind == "attention":
            kb, vb = kvp.get_key_buffer(i), kvp.get_value_buffer(i)
            kc[i] = torch.zeros(bs, tmax, *kb.shape[1:])
            vc[i] = torch.zeros(bs, tmax, *vb.shape[1:])
            for row, (r, n) in enumerate(zip(reqs[:real].tolist(), hist, strict=True)):
                kc[i][row, :n] = kb[first[r] : first[r] + n].float()
                vc[i][row, :n] = vb[first[r] : first[r] + n].float()
    attn_rows = torch.tensor([0, 1, 2, -1])
    backend = FakeAttention(rp, kvp, mslots if slot_source == "backend_metadata" else None)
    router = Router(sv, Spy(), attn_backend=backend)
    install(env.model, router)
    cleanup(env.model)
    norm_w = env.sd[f"{prefix}norm.weight"]
    lm_head = env.sd["lm_head.weight"]
    untouched = [s for s in range(SLOTS + 1) if s not in mslots[:real].tolist()]
    before = {
        i: (c[untouched].clone(), sv.caches.ssm[i][untouched].clone())
        for i, c in sv.caches.conv.items()
    }
    for step in range(2):
        lens = torch.tensor([n + 1 + step for n in hist] + [1])
        pos = lens - 1
        out_loc = torch.tensor(
            [first[r] + n + step for r, n in zip(reqs[:real].tolist(), hist, strict=True)] + [0]
        )
        ids = torch.randint(0, env.mc.hf_text_config.vocab_size, (bs,), generator=g)
        fb = _batch(
            "DECODE", bs, ids=ids, req_pool_indices=reqs, seq_lens=lens, out_cache_loc=out_loc
        )
        fb.mrope_positions = pos.expand(3, bs).clone()
        if slot_source == "pool":
            fb._original_batch_size = real
        with forward_context(ForwardContext(attn_backend=backend)):
            logits = env.model.forward(ids, pos, fb).next_token_logits
        # oracle: the reference layer by layer from the checkpoint's own tensors
        hidden = env.sd[f"{prefix}embed_tokens.weight"][ids].float()
        residual = None
        for i, (kind, w) in enumerate(layers):
            tail = decoder_layer_step(
                hidden,
                residual,
                w,
                dims,
                kind=kind,
                slots=mslots if kind == "gdn" else attn_rows,
                positions=pos,
                conv_state=conv0.get(i),
                ssm_state=ssm0.get(i),
                k_cache=kc.get(i),
                v_cache=vc.get(i),
                conv_layout="chan_time",
                packing="contiguous" if which == "q35" else "interleaved",
            )
            hidden, residual = tail.hidden_out, tail.residual_out
        want = gemma_rms_norm(hidden + residual, norm_w, dims.eps) @ lm_head.float().t()
        assert rel_l2(logits[:real].float(), want[:real]) < TOL, step
        for i in sv.caches.conv:
            got_c, got_s = sv.caches.conv[i], sv.caches.ssm[i]
            idx = mslots[:real].long()
            assert rel_l2(got_c[idx].float(), conv0[i][idx].float()) < TOL
            assert rel_l2(got_s[idx].float(), ssm0[i][idx].float()) < TOL
            assert torch.equal(got_c[untouched], before[i][0]), "a padded row touched a state"
            assert torch.equal(got_s[untouched], before[i][1]), "a padded row touched a state"
    assert router.routed_steps == 2 and router.original.calls == []


def test_routed_step_keeps_prefix_cache_states_through_sglangs_own_copy(qn, cleanup):
    """With SGLang's mamba radix cache (extra_buffer) a decode step also copies states to
    track slots; the routed step asks SGLang's backend to do it for every GDN layer."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    sv, rp, kvp = _active(qn)
    slots = torch.tensor([1, 2, -1], dtype=torch.int32)
    backend = FakeAttention(rp, kvp, slots)
    calls = []
    backend.linear_attn_backend._track_mamba_state_decode = lambda *a: calls.append(a)
    router = Router(sv, Spy(), attn_backend=backend)
    install(qn.model, router)
    cleanup(qn.model)
    fb = _batch("DECODE", 3, req_pool_indices=torch.arange(3))
    fb.mamba_track_mask = torch.tensor([True, False, False])
    with forward_context(ForwardContext(attn_backend=backend)):
        qn.model.forward(fb.input_ids, torch.zeros(3, dtype=torch.long), fb)
    gdn = [b.index for b in sv.model.layers if b.kind == "linear_attention"]
    assert [c[4] for c in calls] == gdn
    for fb_seen, conv, ssm, idx, i in calls:
        assert fb_seen is fb and torch.equal(idx, slots)
        assert conv.data_ptr() == sv.caches.conv[i].data_ptr()
        assert ssm.data_ptr() == sv.caches.ssm[i].data_ptr()
    del backend.linear_attn_backend._track_mamba_state_decode
    with (
        pytest.raises(RuntimeError, match="mamba_track_mask"),
        forward_context(ForwardContext(attn_backend=backend)),
    ):
        qn.model.forward(fb.input_ids, torch.zeros(3, dtype=torch.long), fb)


def test_pool_slot_source_pads_with_minus_one_and_refuses_under_capture(qn):
    _, rp, kvp = _active(qn)
    rp.req_index_to_mamba_index_mapping[3] = 5
    fb = _batch("DECODE", 3, req_pool_indices=torch.tensor([3, 3, 0]))
    fb._original_batch_size = 1
    slots = step_slots(fb, 3, attn_backend=FakeAttention(rp, kvp))
    assert slots.tolist() == [5, -1, -1]
    with pytest.raises(RuntimeError, match="padded rows would be unknown"):
        step_slots(fb, 3, attn_backend=FakeAttention(rp, kvp), capturing=True)
    meta = FakeAttention(rp, kvp, torch.tensor([4, -1, -1, -1], dtype=torch.int32))
    assert step_slots(fb, 3, attn_backend=meta).tolist() == [4, -1, -1]


def test_reallocated_pool_is_caught_before_a_routed_step(qn):
    sv, rp, kvp = _active(qn)
    sv.recheck_caches()  # unchanged: fine
    i = next(iter(sv.caches.conv))
    rp.mamba_pool.mamba_cache.conv[0] = rp.mamba_pool.mamba_cache.conv[0].clone()
    assert bind_caches(rp, kvp, sv.kinds()).conv[i].data_ptr() != sv.caches.conv[i].data_ptr()
    with pytest.raises(RuntimeError, match="reallocated"):
        sv.recheck_caches()


# -- after CUDA-graph capture --------------------------------------------------------------------
def test_capture_check_logs_routed_graphs_and_refuses_when_none_routes(qn, caplog):
    sv, rp, kvp = _active(qn)
    spy = Spy()
    router = Router(sv, spy, attn_backend=FakeAttention(rp, kvp, torch.full((32,), -1)))
    router.capturing = lambda: True  # what torch.cuda reports while SGLang captures
    runner = SimpleNamespace(capture_bs=[1, 2, 4, 24])
    check = CaptureCheck(router)
    for bs in runner.capture_bs:
        fb = _batch("DECODE", bs)
        router.captured[bs] = router.plan(fb)  # the record __call__ makes while capturing
        check(runner, None, fb, bs)
    with caplog.at_level(logging.INFO, logger="mono_ext.sglang"):
        check.done = False
        check(runner, None, fb, 24)
    assert "batch sizes [1, 2, 4] (3 of 4) run K1/K2" in caplog.text
    wide = SimpleNamespace(capture_bs=[24, 32])
    router.captured.clear()
    for bs in wide.capture_bs:
        router(torch.zeros(bs, dtype=torch.long), torch.zeros(bs), _batch("DECODE", bs))
    assert spy.calls == [("DECODE", 24), ("DECODE", 32)]
    with pytest.raises(RuntimeError, match="none of the 2 captured decode graphs"):
        CaptureCheck(router)(wide, None, _batch("DECODE", 32), 32)


# -- check mode ---------------------------------------------------------------------------------
def test_check_mode_drives_sglangs_own_layer_code(q35):
    """Check mode's stock side is SGLang's modules: the pieces whose SGLang code runs on CPU
    (norms, the attention front with M-RoPE positions, o_proj) agree with the reference
    within NUMERICS; SGLang's GDN and MoE forwards need CUDA kernels (GPU runs check them)."""
    sv, rp, kvp = _active(q35, check=True)
    stock = sv.driver.stock
    assert stock is not None and sv.driver.checking
    attn_i = next(b.index for b in sv.model.layers if b.kind == "full_attention")
    w = sv.model.layers[attn_i].planes
    dims = Dims.from_config(q35.mc.hf_config.to_dict())
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, dims.hidden, generator=g).to(BF16)
    residual = torch.randn(3, dims.hidden, generator=g).to(BF16)
    pos = torch.tensor([4, 9, 17])
    stock.bind_step(_batch("DECODE", 3), pos.expand(3, 3).clone())
    x, r = stock.front_norm(attn_i, hidden, residual)
    res_before = residual.clone()
    q, k, v, gate = stock.attn_qkv(attn_i, x, pos)
    assert torch.equal(residual, res_before), "stock code wrote the driver's tensors"
    ref = attn_front(hidden, residual, w["input_layernorm"], w, dims, pos)
    assert rel_l2(r.float(), ref.residual_out) < 2**-8
    for got, want in ((q, ref.q), (k, ref.k), (v, ref.v), (gate, ref.gate)):
        assert rel_l2(got.float().reshape(want.shape), want) < 1e-2
    o = torch.randn(3, dims.hq * dims.head_dim, generator=g).to(BF16)
    y = stock.out_proj(attn_i, o)
    assert rel_l2(y.float(), o.float() @ w["o_proj"].float().t()) < 1e-2


# -- the ModelRunner hooks (the runner itself needs a GPU: its parts are given here) ------------
def test_model_runner_hooks_serve_flagged_runs_only(qn, monkeypatch, caplog, cleanup):
    from mono_ext.engines.sglang import flags, plugin

    model = qn.model
    cleanup(model)

    def load(runner):
        runner.model = model

    def runner(**kw):
        parts = dict(model_config=qn.mc, server_args=qn.sa, is_draft_worker=False)
        return SimpleNamespace(**{**parts, **kw}, capture_tail_hooks=[])

    # flag off, a draft worker, a malformed carrier: SGLang's forward, nothing attached
    for env, draft in ((None, False), ("reference", True)):
        monkeypatch.delenv(flags.ENV, raising=False)
        if env:
            monkeypatch.setenv(flags.ENV, env)
        r = runner(is_draft_worker=draft)
        plugin._around_load_model(load, r)
        assert plugin.serving_of(r) is None and "forward" not in model.__dict__
    monkeypatch.setenv(flags.ENV, " ")
    with caplog.at_level(logging.ERROR, logger="mono_ext.sglang"):
        plugin._around_load_model(load, runner())
    assert "names no backend" in caplog.text and "forward" not in model.__dict__
    # an unsupported setting: stock, every reason logged once
    monkeypatch.setenv(flags.ENV, "reference")
    r = runner()
    r.server_args = SimpleNamespace(enable_torch_compile=True, ep_size=2)
    with caplog.at_level(logging.WARNING, logger="mono_ext.sglang"):
        plugin._around_load_model(load, r)
        plugin._after_init_attention_backends(None, r)
    assert plugin.serving_of(r).off and "forward" not in model.__dict__
    assert "mono_ext off: [config] expert_parallel is on" in caplog.text
    assert "--enable-torch-compile" in caplog.text
    # flagged and served: config + model at load, caches + router + capture check after
    r = runner()
    plugin._around_load_model(load, r)
    sv = plugin.serving_of(r)
    assert sv.stage is Stage.MODEL and not sv.active and "forward" not in model.__dict__
    r.req_to_token_pool, r.token_to_kv_pool = _pools(qn.mc)
    r.attn_backend = FakeAttention(r.req_to_token_pool, r.token_to_kv_pool)
    plugin._after_init_attention_backends(None, r)
    assert sv.active and router_of(model).serving is sv
    assert [type(h) for h in r.capture_tail_hooks] == [CaptureCheck]


class CpuStock:
    """Check mode's stock side with SGLang's own norm / attention-front / o_proj code; SGLang's
    GDN and MoE forwards need CUDA kernels, so zeros stand in for those two (their
    comparisons are not asserted)."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def gdn_mixer(self, index, x):
        la = self.real.layers[index].linear_attn
        return torch.zeros(x.shape[0], la.out_proj.weight.shape[1], dtype=x.dtype)

    def tail(self, index, y, residual):
        return torch.zeros_like(y), y + residual


@pytest.mark.parametrize("broken", [False, True])
def test_check_mode_on_a_routed_step_compares_with_sglangs_code(q35, broken, caplog, cleanup):
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    sv, rp, kvp = _active(q35, check=True)
    real = sv.driver.stock
    sv.driver.stock = CpuStock(real)
    attn_i = next(b.index for b in sv.model.layers if b.kind == "full_attention")
    backend = FakeAttention(rp, kvp, torch.tensor([1, 2, -1], dtype=torch.int32))
    router = Router(sv, Spy(), attn_backend=backend)
    install(q35.model, router)
    cleanup(q35.model)
    rp.req_to_token[:3, :1] = torch.arange(3)[:, None]
    fb = _batch("DECODE", 3, ids=torch.tensor([5, 6, 7]), req_pool_indices=torch.arange(3))
    pos = torch.tensor([0, 0, 0])
    fb.mrope_positions = pos.expand(3, 3).clone()
    q_norm = q35.model.model.layers[attn_i].q_norm
    saved = q_norm.variance_epsilon
    if broken:  # SGLang's own q norm (its eps, not a bound plane) disagrees with the launch
        q_norm.variance_epsilon = 10.0
    try:
        with (
            caplog.at_level(logging.WARNING, logger="mono_ext.decode"),
            forward_context(ForwardContext(attn_backend=backend)),
        ):
            q35.model.forward(fb.input_ids, pos, fb)
    finally:
        q_norm.variance_epsilon = saved
    assert real.positions.shape == (3, 3)  # the model's own (M-RoPE) positions reached it
    tracker = sv.driver.tracker
    attn_front = [
        b for b in tracker.breaches if b.where == f"layer {attn_i}" and b.name.startswith("k1.")
    ]
    assert tracker.checks > 0
    if broken:
        assert any(b.name.startswith("k1.q.") for b in attn_front), tracker.breaches
        assert f"layer {attn_i}: k1.q." in caplog.text
    else:
        assert attn_front == [], attn_front


_TWO_RANKS = """
import json, os, sys, types
import torch.distributed as dist
import torch.multiprocessing as mp

def rank(r, port, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    from mono_ext.core.settings import Settings
    from mono_ext.engines.sglang.flags import Monokernel
    from mono_ext.engines.sglang.serving import Serving
    from mono_ext.models.qwen3_next.configs import get_preset
    sv = Serving(Monokernel("reference"), group=dist.group.WORLD, tp_rank=r, settings=Settings())
    sa = types.SimpleNamespace(enable_torch_compile=(r == 1))  # only rank 1 has a reason
    refusal = sv.accept_config(get_preset("qwen3-next-tiny"), sa, dtype="bfloat16", quantization=None)
    q.put((r, refusal.message(), sv.off))
    # leave together, through os._exit: gloo's teardown at exit can abort the process
    # ("terminate called without an active exception"; tests/_support/gloo.py)
    dist.barrier()
    os._exit(0)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.spawn(rank, args=(int(sys.argv[1]), q), nprocs=2)
    print(json.dumps(sorted([q.get(), q.get()])))
"""


def test_ranks_agree_over_a_real_gloo_group(tmp_path):
    import json
    import subprocess
    import sys

    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run(
        [sys.executable, str(script), str(port)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])  # [[rank, message, off], ...]
    assert [r for r, _, _ in got] == [0, 1]
    assert len({m for _, m, _ in got}) == 1 and all(off for *_, off in got)
    assert got[0][1].startswith("mono_ext off: [config] ranks 1: --enable-torch-compile")
