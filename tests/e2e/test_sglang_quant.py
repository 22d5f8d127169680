"""SGLang 0.5.17 on quantized Qwen3-Next planes, on CPU (issue 9, the spec side).

A tiny FP8 block-128 checkpoint (the official Qwen3-Next FP8 format: e4m3fn weights, fp32
``weight_scale_inv`` per 128x128 block, ``modules_to_not_convert`` keeping in_proj_ba, the
router and shared_expert_gate bf16) is loaded by SGLang's own loader into SGLang's own
classes (``Fp8LinearMethod``, ``Fp8MoEMethod``). SGLang's CPU branch of
``process_weights_after_loading`` needs AMX kernels (sgl-kernel), so the load takes the
CUDA branch (``fp8._is_cpu`` off while loading): on sm_90 that branch leaves the weights and
scales as loaded (the DeepGEMM UE8M0 requant is Blackwell-only), which is what is checked.
The adapter must derive every plane's format from the modules and refuse at the model stage
with one reason per plane, in the vLLM adapter's words. Per-tensor / per-channel fp8 is
checked on SGLang's own ``ReplicatedLinear`` with an ``Fp8Config`` without blocks, whose
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

from _quant_common import assert_fp8_block_reasons, make_fp8_block_checkpoint  # noqa: E402
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


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    import sglang.srt.layers.quantization.fp8 as sgl_fp8

    path = make_fp8_block_checkpoint(
        tmp_path_factory.mktemp("sgl_fp8") / "qwen3-next-tiny-fp8", TINY_FP8
    )
    saved = sgl_fp8._is_cpu
    sgl_fp8._is_cpu = False  # the CUDA branch of process_weights_after_loading (docstring)
    try:
        return load(path, disable_cuda_graph=True)
    finally:
        sgl_fp8._is_cpu = saved


def _serving(env, backend="reference"):
    sv = Serving(Monokernel(backend), settings=Settings())
    mc = env.mc
    config = sv.accept_config(mc.hf_config, env.sa, dtype=mc.dtype, quantization=mc.quantization)
    return sv, config


def test_fp8_reaches_the_model_stage_and_formats_come_from_sglangs_modules(fp8):
    assert fp8.mc.quantization == "fp8"
    sv, config = _serving(fp8)
    assert not config, config.message()  # the config stage defers fp8 to the model stage
    assert sv.cfg.reads_plane_formats and sv.cfg.engine == "sglang"
    refusal = sv.accept_model(fp8.model)
    assert refusal.stage is Stage.MODEL
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

    mv = model_view(sv.model, tp_size=1, tp_rank=0)
    gdn, attn = mv.layers[0].planes, mv.layers[3].planes
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


def test_fp8_deployment_is_refused_by_plane_in_the_vllm_adapters_words(fp8):
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


def test_a_backend_that_reads_fp8_block_gets_formats_in_its_build_keys(fp8, monkeypatch):
    from mono_ext.reference import backend as ref_backend

    # a builder declaring what it reads (no backend reads fp8 yet: only the key is checked)
    monkeypatch.setattr(
        ref_backend.build, "plane_formats", frozenset({"bf16", "fp8_block128"}), raising=False
    )
    sv, _ = _serving(fp8)
    assert sv.spec.deployment.plane_formats == frozenset({"bf16", "fp8_block128"})
    refusal = sv._decide(Stage.MODEL, sv._model_reasons(fp8.model))
    assert not refusal, refusal.message()
    key, *_ = sv.spec.build_keys()
    formats = dict(key.formats)
    assert formats["w13"] == formats["in_proj_qkvz"] == "fp8_block128"
    assert "in_proj_ba" not in formats  # bf16 planes stay out of the key


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
