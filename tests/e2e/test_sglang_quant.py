"""SGLang 0.5.17 on quantized Qwen3-Next planes, on CPU (issue 9).

A tiny FP8 block-128 checkpoint (the official Qwen3-Next FP8 format: e4m3fn weights, fp32
``weight_scale_inv`` per 128x128 block, ``modules_to_not_convert`` keeping in_proj_ba, the
router and shared_expert_gate bf16) is loaded by SGLang's own loader into SGLang's own
classes (``Fp8LinearMethod``, ``Fp8MoEMethod``). SGLang's CPU branch of
``process_weights_after_loading`` needs AMX kernels (sgl-kernel), so the load takes the
CUDA branch (``fp8._is_cpu`` off while loading): on sm_90 that branch leaves the weights and
scales as loaded (the DeepGEMM UE8M0 requant is Blackwell-only), which is what is checked.
SGLang's forward does not run on CPU, so the binding is checked instead of a served run: the
adapter derives every plane's format from the modules; with the ``reference`` backend (which
reads fp8) the model stage accepts, each fp8 plane is bound with SGLang's own scale tensor as
``<plane>.scale`` (the same storage, sliced like the plane: routed experts ``[:E]``, the fused
shared-expert slot ``[E]``), the bound planes dequantize to exactly the checkpoint's values,
and the reference launches computed from them equal the reference on the checkpoint
dequantized independently. A backend that reads no fp8 planes still gets one reason per plane,
in the vLLM adapter's words. Per-tensor / per-channel fp8 is checked on SGLang's own
``ReplicatedLinear`` with an ``Fp8Config`` without blocks, whose
``process_weights_after_loading`` leaves a (K, N) ``weight.t()`` view (read as the [N, K]
storage it views).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")
pytest.importorskip("safetensors")

from mono_ext.engines.sglang import has_native_api  # noqa: E402

if has_native_api():
    pytest.skip("SGLang with the kernel-plugin API (0.5.23)", allow_module_level=True)

from _quant_common import (  # noqa: E402
    FP8_PLANES,
    assert_bound_planes_dequantize_to_the_checkpoint,
    assert_fp8_block_reasons,
    dequantized_checkpoint,
    make_fp8_block_checkpoint,
)
from _sglang_common import load  # noqa: E402

from mono_ext.core.refusal import Stage  # noqa: E402
from mono_ext.core.settings import Settings  # noqa: E402
from mono_ext.engines.sglang.flags import Monokernel  # noqa: E402
from mono_ext.engines.sglang.report import runner_report  # noqa: E402
from mono_ext.engines.sglang.serving import Serving  # noqa: E402
from mono_ext.engines.sglang.views import plane_view  # noqa: E402
from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402

FP8 = torch.float8_e4m3fn
#: qwen3-next-tiny grown to whole 128-blocks: SGLang's Fp8LinearMethod refuses a merged
#: projection with a partition that is not a multiple of the block (in_proj_qkvz's q/k keys:
#: 2 heads x 64), and its fp8 block MoE an intermediate size that is not
TINY_FP8 = {
    **get_preset("qwen3-next-tiny"),
    "hidden_size": 128,
    "head_dim": 64,
    "linear_key_head_dim": 64,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "num_experts": 4,
}


def _load_fp8(path, *, fused: bool):
    import sglang.srt.layers.quantization.fp8 as sgl_fp8

    saved = sgl_fp8._is_cpu
    sgl_fp8._is_cpu = False  # the CUDA branch of process_weights_after_loading (docstring)
    try:
        env = load(path, fused=fused, disable_cuda_graph=True)
    finally:
        sgl_fp8._is_cpu = saved
    env.path = path
    return env


@pytest.fixture(scope="module")
def fp8_path(tmp_path_factory):
    return make_fp8_block_checkpoint(
        tmp_path_factory.mktemp("sgl_fp8") / "qwen3-next-tiny-fp8", TINY_FP8
    )


@pytest.fixture(scope="module")
def fp8(fp8_path):
    return _load_fp8(fp8_path, fused=False)


@pytest.fixture(scope="module")
def fp8_fused(fp8_path):
    """Built as on CUDA: SGLang fuses the shared expert into the experts as slot E."""
    return _load_fp8(fp8_path, fused=True)


def _serving(env, backend="reference"):
    sv = Serving(Monokernel(backend), settings=Settings())
    mc = env.mc
    config = sv.accept_config(mc.hf_config, env.sa, dtype=mc.dtype, quantization=mc.quantization)
    return sv, config


def _formats(sv) -> dict[str, str]:
    return {p: f for p, f in sv.spec.plane_formats.items() if f != "bf16"}


def test_fp8_planes_are_accepted_and_formats_come_from_sglangs_modules(fp8):
    assert fp8.mc.quantization == "fp8"
    sv, config = _serving(fp8)
    assert not config, config.message()  # the config stage defers fp8 to the model stage
    assert sv.cfg.reads_plane_formats and sv.cfg.engine == "sglang"
    refusal = sv.accept_model(fp8.model)
    assert not refusal, refusal.message()  # the reference reads fp8 planes
    assert sv.stage is Stage.MODEL and sv.launches
    layer0 = fp8.model.model.layers[0]
    la, experts = layer0.linear_attn, layer0.mlp.experts
    assert type(la.in_proj_qkvz.quant_method).__name__ == "Fp8LinearMethod"
    assert type(experts.quant_method).__name__ == "Fp8MoEMethod"
    b = sv.model.layers[0]
    # the bound planes are SGLang's own fp8 storages, [N, K] row-major
    assert b.planes["in_proj_qkvz"].data_ptr() == la.in_proj_qkvz.weight.data_ptr()
    assert b.planes["w13"].data_ptr() == experts.w13_weight.data_ptr()
    assert b.planes["in_proj_qkvz"].dtype == FP8
    from mono_ext.engines.sglang.views import model_view

    mv = model_view(sv.model, tp_size=1, tp_rank=0)  # again: the bound scales are no planes
    gdn, attn = mv.layers[0].planes, mv.layers[3].planes
    assert not [p for layer in mv.layers for p in layer.planes if p.endswith(".scale")]
    qkvz = gdn["in_proj_qkvz"]
    assert (qkvz.format, qkvz.dtype, qkvz.shape, qkvz.layout) == (
        "fp8_block128",
        "float8_e4m3fn",
        (512, 128),
        "row_major",
    )
    assert (qkvz.scale.name, qkvz.scale.shape, qkvz.scale.dtype) == (
        "weight_scale_inv",
        (4, 1),
        "float32",
    )
    assert qkvz.block == (128, 128)  # SGLang keeps it on the quant method, not the layer
    assert qkvz.kernel == "triton_w8a8_block_fp8_linear"
    assert attn["qkv_proj"].scale.shape == (6, 1) and attn["o_proj"].shape == (128, 256)
    w13, w2 = gdn["w13"], gdn["w2"]
    assert (w13.format, w13.shape, w13.scale.name, w13.scale.shape) == (
        "fp8_block128",
        (4, 256, 128),
        "w13_weight_scale_inv",
        (4, 2, 1),
    )
    assert w2.shape == (4, 128, 128) and w2.scale.shape == (4, 1, 1)
    assert w13.kernel.startswith("moe runner ")
    for bf16 in ("in_proj_ba", "router", "shared_expert_gate"):  # modules_to_not_convert
        assert gdn[bf16].format == "bf16" and gdn[bf16].dtype == "bfloat16", bf16
    assert sv.spec.plane_formats["out_proj"] == "fp8_block128"
    assert sv.spec.plane_formats["in_proj_ba"] == "bf16"


def test_each_fp8_plane_is_bound_with_sglangs_own_scale(fp8):
    sv, _ = _serving(fp8)
    assert not sv.accept_model(fp8.model)
    for b in sv.model.layers:
        mod = b.module
        owners = {
            "w13": (mod.mlp.experts, "w13_weight_scale_inv"),
            "w2": (mod.mlp.experts, "w2_weight_scale_inv"),
            "shared_gate_up": (mod.mlp.shared_expert.gate_up_proj, "weight_scale_inv"),
            "shared_down": (mod.mlp.shared_expert.down_proj, "weight_scale_inv"),
        }
        if b.kind == "linear_attention":
            owners["in_proj_qkvz"] = (mod.linear_attn.in_proj_qkvz, "weight_scale_inv")
            owners["out_proj"] = (mod.linear_attn.out_proj, "weight_scale_inv")
        else:
            owners["qkv_proj"] = (mod.qkv_proj, "weight_scale_inv")
            owners["o_proj"] = (mod.o_proj, "weight_scale_inv")
        assert set(owners) == set(FP8_PLANES[b.kind])
        assert {p for p in b.planes if p.endswith(".scale")} == {f"{p}.scale" for p in owners}
        for plane, (owner, attr) in owners.items():
            s, engine = b.planes[plane + ".scale"], getattr(owner, attr)
            assert s.data_ptr() == engine.data_ptr(), (b.index, plane)  # in place, no copy
            assert s.shape == engine.shape and s.dtype == torch.float32, (b.index, plane)
    assert_bound_planes_dequantize_to_the_checkpoint(
        [b.planes for b in sv.model.layers],
        _formats(sv),
        dequantized_checkpoint(fp8.path),
        TINY_FP8,
        FP8_PLANES,
    )


def test_the_fused_shared_expert_slots_scale_is_sliced_like_its_planes(fp8_fused):
    sv, _ = _serving(fp8_fused)
    assert not sv.accept_model(fp8_fused.model)
    e = TINY_FP8["num_experts"]
    for b in sv.model.layers:
        experts = b.module.mlp.experts
        assert b.facts["shared_expert"] == "fused_slot"
        assert experts.w13_weight_scale_inv.shape == (e + 1, 2, 1)
        for plane, attr, want in (
            ("w13", "w13_weight_scale_inv", (e, 2, 1)),
            ("w2", "w2_weight_scale_inv", (e, 1, 1)),
        ):
            s = b.planes[plane + ".scale"]  # experts [:E]
            assert s.data_ptr() == getattr(experts, attr).data_ptr() and s.shape == want
        for plane, attr, want in (
            ("shared_gate_up", "w13_weight_scale_inv", (2, 1)),
            ("shared_down", "w2_weight_scale_inv", (1, 1)),
        ):
            s = b.planes[plane + ".scale"]  # slot [E]
            assert s.data_ptr() == getattr(experts, attr)[e].data_ptr() and s.shape == want
    assert_bound_planes_dequantize_to_the_checkpoint(
        [b.planes for b in sv.model.layers],
        _formats(sv),
        dequantized_checkpoint(fp8_fused.path),
        TINY_FP8,
        FP8_PLANES,
    )


def test_reference_launches_on_the_bound_fp8_planes_equal_the_dequantized_checkpoint(fp8_fused):
    """K1 (attention layer) and K2 (every layer) of the reference backend, reading SGLang's
    fp8 planes and scales through the build key's formats, against the reference functions
    on the checkpoint dequantized independently (fp32 planes): the same values, so the same
    outputs, bit for bit."""
    from mono_ext.models.qwen3_next.launches import BoundLayer
    from mono_ext.reference import (
        ModelDims,
        attn_front,
        attn_out_input,
        layer_tail,
        layer_weights_from_state_dict,
    )

    sv, _ = _serving(fp8_fused)
    assert not sv.accept_model(fp8_fused.model)
    width = 3
    launches = sv.launches[width]
    assert dict(launches.key.formats) == _formats(sv) and "w13" in _formats(sv)
    dims = ModelDims.from_config(TINY_FP8)
    ckpt = dequantized_checkpoint(fp8_fused.path)
    g = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16
    for b in sv.model.layers:
        p = f"model.layers.{b.index}."
        ref = layer_weights_from_state_dict(
            {k[len(p) :]: v for k, v in ckpt.items() if k.startswith(p)}, dims
        )
        layer = BoundLayer(b.index, b.kind, b.planes)
        gdn = b.kind == "linear_attention"
        in_dim = dims.value_dim if gdn else dims.num_heads * dims.head_dim
        o_in = torch.randn(width, in_dim, generator=g).to(bf16)
        res = torch.randn(width, dims.hidden, generator=g).to(bf16)
        gate = None if gdn else torch.randn(width, in_dim, generator=g).to(bf16)
        h, r = torch.empty_like(res), torch.empty_like(res)
        launches.k2(layer, o_in, res, gate, hidden_out=h, residual_out=r)
        x = o_in if gdn else attn_out_input(o_in, gate)
        want = layer_tail(x, res, ref, dims, kind="gdn" if gdn else "attn")
        assert torch.equal(h, want.hidden_out.to(bf16)), b.index
        assert torch.equal(r, want.residual_out.to(bf16)), b.index
        if gdn:
            continue
        pos = torch.tensor([0, 5, 17])
        outs = {
            "q": torch.empty(width, dims.num_heads * dims.head_dim, dtype=bf16),
            "k": torch.empty(width, dims.num_kv_heads * dims.head_dim, dtype=bf16),
            "v": torch.empty(width, dims.num_kv_heads * dims.head_dim, dtype=bf16),
            "gate": torch.empty(width, in_dim, dtype=bf16),
            "residual_out": torch.empty_like(res),
        }
        launches.k1_attn(layer, o_in[:, : dims.hidden], res, pos, **outs)
        f = attn_front(o_in[:, : dims.hidden], res, ref["input_layernorm"], ref, dims, pos)
        assert torch.equal(outs["q"], f.q.reshape(width, -1).to(bf16))
        assert torch.equal(outs["gate"], f.gate.to(bf16))


def test_a_backend_that_reads_no_fp8_refuses_by_plane_in_the_vllm_adapters_words(fp8, monkeypatch):
    from mono_ext.reference import backend as ref_backend

    monkeypatch.setattr(ref_backend.build, "plane_formats", frozenset({"bf16"}))
    sv, _ = _serving(fp8)
    refusal = sv.accept_model(fp8.model)
    message = refusal.message()
    assert message.startswith("mono_ext off: [model] ") and sv.off
    assert_fp8_block_reasons(message, "triton_w8a8_block_fp8_linear", "moe runner", qkvz_rows=512)
    assert "uses quant method" not in message
    assert "forward" not in fp8.model.__dict__  # refused: SGLang's own forward stays
    from mono_ext.engines.sglang.hooks import SERVING_ATTR

    runner = type("Runner", (), {})()
    runner.__dict__[SERVING_ATTR] = sv
    report = runner_report(runner)
    assert report["state"] == "off" and report["refused_at"] == "model"
    assert report["plane_formats"]["w2"] == "fp8_block128"
    assert report["key_formats"] == {}


def test_the_reference_gets_fp8_formats_in_its_build_keys_and_report(fp8):
    from mono_ext.reference.backend import build

    sv, _ = _serving(fp8)
    assert sv.spec.deployment.plane_formats == build.plane_formats
    assert not sv.accept_model(fp8.model)
    key, *_ = sv.spec.build_keys()
    formats = dict(key.formats)
    assert formats["w13"] == formats["in_proj_qkvz"] == "fp8_block128"
    assert "in_proj_ba" not in formats  # bf16 planes stay out of the key
    from mono_ext.engines.sglang.hooks import SERVING_ATTR

    runner = type("Runner", (), {})()
    runner.__dict__[SERVING_ATTR] = sv
    report = runner_report(runner)
    assert report["key_formats"] == formats
    kinds = TINY_FP8["layer_types"]
    assert report["scales_bound"] == sum(len(FP8_PLANES[k]) for k in kinds)


# -- per-tensor / per-channel: SGLang's Fp8LinearMethod without blocks ----------------------
def _fp8_linear(n, k, *, cutlass: bool, monkeypatch=None):
    import sglang.srt.layers.quantization.fp8 as sgl_fp8
    from sglang.srt.layers.linear import ReplicatedLinear
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    if monkeypatch is not None:
        # per-tensor: SGLang re-quantizes the fused shards to their max scale with an
        # sgl-kernel op (absent on CPU); for one shard that is the identity
        monkeypatch.setattr(
            sgl_fp8,
            "requantize_with_max_scale",
            lambda weight, weight_scale, **_: (weight_scale.max(), weight),
        )

    cfg = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic")
    layer = ReplicatedLinear(k, n, bias=False, quant_config=cfg, prefix="x")
    w = torch.randn(n, k)
    scale = w.abs().amax() / 448.0
    layer.weight.data.copy_((w / scale).to(FP8))
    layer.weight_scale.data.fill_(float(scale))
    layer.quant_method.cutlass_fp8_supported = cutlass  # per-channel on sm_90 (cutlass)
    storage = layer.weight.data_ptr()
    layer.quant_method.process_weights_after_loading(layer)
    return layer, storage


@pytest.mark.parametrize("cutlass", [False, True])
@pytest.mark.parametrize("n", [128, 256])  # square and not: the (K, N) view decides
def test_per_tensor_and_per_channel_fp8_read_through_sglangs_transposed_view(
    fp8, n, cutlass, monkeypatch
):
    layer, storage = _fp8_linear(n, 128, cutlass=cutlass, monkeypatch=monkeypatch)
    assert tuple(layer.weight.shape) == (128, n) and not layer.weight.is_contiguous()
    view, bound = plane_view(
        "out_proj", layer.weight.detach(), "Fp8LinearMethod", (layer, "weight", None)
    )
    fmt, scale = ("fp8_channel", (n, 1)) if cutlass else ("fp8_tensor", ())
    assert (view.format, view.shape, view.layout) == (fmt, (n, 128), "row_major")
    assert view.scale.name == "weight_scale" and view.scale.shape == scale
    assert bound.shape == (n, 128) and bound.is_contiguous() and bound.data_ptr() == storage
    assert view.kernel == "apply_fp8_linear (" + ("cutlass)" if cutlass else "torch._scaled_mm)")


def test_marlin_and_amx_packed_fp8_planes_are_refused_by_layout(fp8):
    layer, _ = _fp8_linear(128, 128, cutlass=True)
    layer.quant_method.use_marlin = True
    view, bound = plane_view("o_proj", layer.weight, "Fp8LinearMethod", (layer, "weight", None))
    assert (view.layout, bound) == ("marlin", None)
    layer.quant_method.use_marlin = False
    layer.use_intel_amx_backend = True
    view, bound = plane_view("o_proj", layer.weight, "Fp8LinearMethod", (layer, "weight", None))
    assert (view.layout, view.kernel, bound) == ("amx_packed", "intel_amx", None)
