"""SGLang 0.5.17 on quantized Qwen3-Next planes, on CPU.

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

MXFP4 experts: a tiny MXFP4 checkpoint through SGLang's loader and ``Mxfp4MoEMethod``'s bf16
upcast branch (the sm_90 default), with what this CPU build cannot run stood in for
(:func:`_load_mxfp4`): read in place as bf16, padded or any other MXFP4 state refused.
"""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")
pytest.importorskip("safetensors")

from mono_ext.engines.sglang import has_native_api  # noqa: E402

if has_native_api():
    pytest.skip("SGLang with the kernel-plugin API (0.5.23)", allow_module_level=True)

from mono_ext.core.refusal import Stage  # noqa: E402
from mono_ext.core.settings import Settings  # noqa: E402
from mono_ext.engines.sglang.flags import Monokernel  # noqa: E402
from mono_ext.engines.sglang.report import runner_report  # noqa: E402
from mono_ext.engines.sglang.serving import Serving  # noqa: E402
from mono_ext.engines.sglang.views import plane_view  # noqa: E402
from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from tests.engines._support.quant_common import (  # noqa: E402
    FP8_PLANES,
    assert_bound_planes_dequantize_to_the_checkpoint,
    assert_fp8_block_reasons,
    assert_fp8_block_views,
    dequantized_checkpoint,
    make_fp8_block_checkpoint,
)
from tests.engines._support.sglang_common import load  # noqa: E402

FP8 = torch.float8_e4m3fn
#: the whole-128-block tiny preset, with key heads of 64: SGLang's Fp8LinearMethod also refuses
#: a merged projection with a partition that is not a multiple of the block (in_proj_qkvz's
#: q/k keys: 2 heads x 64)
TINY_FP8 = {**get_preset("qwen3-next-tiny-fp8"), "linear_key_head_dim": 64}


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
    assert_fp8_block_views(gdn, attn, qkvz_rows=512)
    assert gdn["in_proj_qkvz"].kernel == "triton_w8a8_block_fp8_linear"
    # SGLang keeps the block size on the quant method, not the layer (the view found it)
    assert gdn["w13"].kernel.startswith("moe runner ")
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


def _k2_equals_the_reference_on(sv, ckpt, config, width=3):
    """Each layer's K2 of the reference backend, reading SGLang's bound planes (and scales,
    through the build key's formats), against the reference layer tail on ``ckpt`` (the
    checkpoint dequantized independently, fp32 planes): the same values, so the same outputs,
    bit for bit. Yields (binding, BoundLayer, reference weights, dims, the K2 inputs) per
    layer, for more launches."""
    from mono_ext.models.qwen3_next.dims import Dims
    from mono_ext.models.qwen3_next.launches import BoundLayer
    from mono_ext.models.qwen3_next.reference import attn_out_input, layer_tail
    from mono_ext.models.qwen3_next.reference import layer_weights_from_state_dict as weights_of

    launches = sv.launches[width]
    assert dict(launches.key.formats) == _formats(sv)
    dims = Dims.from_config(config)
    g = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16
    for b in sv.model.layers:
        p = f"model.layers.{b.index}."
        ref = weights_of({k[len(p) :]: v for k, v in ckpt.items() if k.startswith(p)}, dims)
        layer = BoundLayer(b.index, b.kind, b.planes)
        gdn = b.kind == "linear_attention"
        in_dim = dims.value_dim if gdn else dims.hq * dims.head_dim
        o_in = torch.randn(width, in_dim, generator=g).to(bf16)
        res = torch.randn(width, dims.hidden, generator=g).to(bf16)
        gate = None if gdn else torch.randn(width, in_dim, generator=g).to(bf16)
        h, r = torch.empty_like(res), torch.empty_like(res)
        launches.k2(layer, o_in, res, gate, hidden_out=h, residual_out=r)
        x = o_in if gdn else attn_out_input(o_in, gate)
        want = layer_tail(x, res, ref, dims, kind="gdn" if gdn else "attn")
        assert torch.equal(h, want.hidden_out.to(bf16)), b.index
        assert torch.equal(r, want.residual_out.to(bf16)), b.index
        yield b, layer, ref, dims, (o_in, res)


def test_reference_launches_on_the_bound_fp8_planes_equal_the_dequantized_checkpoint(fp8_fused):
    """K2 (every layer) and K1 (attention layer) of the reference backend on SGLang's fp8
    planes and scales equal the reference on the independently dequantized checkpoint."""
    from mono_ext.models.qwen3_next.reference import attn_front

    sv, _ = _serving(fp8_fused)
    assert not sv.accept_model(fp8_fused.model)
    assert "w13" in _formats(sv)
    ckpt = dequantized_checkpoint(fp8_fused.path)
    bf16 = torch.bfloat16
    for b, layer, ref, dims, (o_in, res) in _k2_equals_the_reference_on(sv, ckpt, TINY_FP8):
        if b.kind == "linear_attention":
            continue
        width, in_dim = o_in.shape
        pos = torch.tensor([0, 5, 17])
        outs = {
            "q": torch.empty(width, dims.hq * dims.head_dim, dtype=bf16),
            "k": torch.empty(width, dims.hkv * dims.head_dim, dtype=bf16),
            "v": torch.empty(width, dims.hkv * dims.head_dim, dtype=bf16),
            "gate": torch.empty(width, in_dim, dtype=bf16),
            "residual_out": torch.empty_like(res),
        }
        sv.launches[width].k1_attn(layer, o_in[:, : dims.hidden], res, pos, **outs)
        f = attn_front(o_in[:, : dims.hidden], res, ref["input_layernorm"], ref, dims, pos)
        assert torch.equal(outs["q"], f.q.reshape(width, -1).to(bf16))
        assert torch.equal(outs["gate"], f.gate.to(bf16))


def test_a_backend_that_reads_no_fp8_refuses_by_plane_in_the_vllm_adapters_words(fp8, monkeypatch):
    from mono_ext.models.qwen3_next.reference import backend as ref_backend

    monkeypatch.setattr(ref_backend.build, "plane_formats", frozenset({"bf16"}))
    sv, _ = _serving(fp8)
    refusal = sv.accept_model(fp8.model)
    message = refusal.message()
    assert message.startswith("mono_ext off: [model] ") and sv.off
    assert_fp8_block_reasons(message, "triton_w8a8_block_fp8_linear", "moe runner", qkvz_rows=512)
    assert "uses quant method" not in message
    assert "forward" not in fp8.model.__dict__  # refused: SGLang's own forward stays
    from mono_ext.engines.sglang.serving import SERVING_ATTR

    runner = type("Runner", (), {})()
    runner.__dict__[SERVING_ATTR] = sv
    report = runner_report(runner)
    assert report["state"] == "off" and report["refused_at"] == "model"
    assert report["plane_formats"]["w2"] == "fp8_block128"
    assert report["key_formats"] == {}


def test_the_reference_gets_fp8_formats_in_its_build_keys_and_report(fp8):
    from mono_ext.models.qwen3_next.reference.backend import build

    sv, _ = _serving(fp8)
    assert sv.spec.deployment.plane_formats == build.plane_formats
    assert not sv.accept_model(fp8.model)
    key, *_ = sv.spec.build_keys()
    formats = dict(key.formats)
    assert formats["w13"] == formats["in_proj_qkvz"] == "fp8_block128"
    assert "in_proj_ba" not in formats  # bf16 planes stay out of the key
    from mono_ext.engines.sglang.serving import SERVING_ATTR

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


# -- MXFP4 experts: SGLang's Mxfp4MoEMethod -------------------------------------------------
#: qwen3-next-tiny with I a multiple of 64 (Mxfp4MoEMethod.create_weights pads I to 64 wherever
#: triton_kernels is importable, as the upcast needs; the preset's own I = 32 is the padded case)
TINY_MXFP4 = {**get_preset("qwen3-next-tiny"), "moe_intermediate_size": 64}
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _to_mxfp4(w):
    """[N, K] -> (e2m1 codes uint8 [N, K/2], even element in the low nibble; e8m0 scales uint8
    [N, K/32]): the OCP MX layout of MXFP4 checkpoints, scale 2^ceil(log2(amax / 6))."""
    n, k = w.shape
    g = w.float().reshape(n, k // 32, 32)
    e = torch.ceil(torch.log2(g.abs().amax(-1, keepdim=True).clamp(min=2**-120) / 6.0))
    q = g / torch.exp2(e)
    mag = (q.abs().unsqueeze(-1) - torch.tensor(_E2M1)).abs().argmin(-1)
    code = (mag + 8 * (q < 0)).reshape(n, k).to(torch.uint8)
    return code[:, 0::2] | (code[:, 1::2] << 4), (e.reshape(n, k // 32) + 127).to(torch.uint8)


def _from_mxfp4(codes, scale, target_dtype=torch.float32, axis=-1):
    """Codes times 2^(scale - 127) per 32 along the last axis, exact. Called with the keywords
    of triton_kernels' ``upcast_from_mxfp`` (a GPU package), whose stand-in it is on CPU."""
    assert axis == -1
    table = torch.tensor(_E2M1 + tuple(-v for v in _E2M1))
    v = torch.stack([table[(codes & 15).long()], table[(codes >> 4).long()]], -1).flatten(-2)
    v = v * torch.exp2(scale.float() - 127).repeat_interleave(32, -1)
    return v.to(target_dtype).contiguous()


def _make_mxfp4_checkpoint(out, config):
    """A random checkpoint of ``config`` whose routed experts are MXFP4 (``<proj>.weight``
    codes, ``<proj>.weight_scale``), everything else bf16, ``quant_method: mxfp4``."""
    import json

    from safetensors.torch import load_file, save_file

    from mono_ext.tools.checkpoint import make_checkpoint

    make_checkpoint(out, config, seed=0)
    tensors = {}
    for name, t in load_file(str(out / "model.safetensors")).items():
        if ".mlp.experts." in name and name.endswith("_proj.weight"):
            tensors[name], tensors[name + "_scale"] = _to_mxfp4(t)
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def _dequantized_mxfp4(path):
    """The checkpoint with every MXFP4 weight replaced by its fp32 values, scales dropped."""
    from safetensors.torch import load_file

    sd = load_file(str(path / "model.safetensors"))
    return {
        k: _from_mxfp4(v, sd[k + "_scale"]) if k + "_scale" in sd else v
        for k, v in sd.items()
        if not k.endswith("_scale")
    }


def _load_mxfp4(path):
    """SGLang's loader on an MXFP4 checkpoint, through ``Mxfp4MoEMethod``'s upcast branch of
    ``process_weights_after_loading`` (``mxfp4._is_cpu`` off: the CUDA side), with what this CPU
    build lacks stood in for, and nothing else:

    - ``mxfp4`` is registered (``QUANTIZATION_METHODS``) on CUDA and CPU-AMX builds only;
    - ``Mxfp4Config.get_quant_method`` answers only the MoE layers off ROCm (LinearBase: None,
      which SGLang's linears assert on; RadixAttention / ParallelLMHead: NotImplementedError),
      so SGLang 0.5.17 cannot build Qwen3-Next from an MXFP4 checkpoint at all
      (docs/quantized_planes.md, section 3): the other layers get what they get on ROCm
      (UnquantizedLinearMethod) or no quant method;
    - the branch imports triton_kernels' ``upcast_from_mxfp`` (a GPU package): ``_from_mxfp4``
      stands in, and ``has_triton_kernels`` is on, as wherever that import works (I padded
      to 64 by ``create_weights``)."""
    import sys
    from types import ModuleType

    import sglang.srt.layers.quantization as sgl_quant
    import sglang.srt.layers.quantization.mxfp4 as sgl_mxfp4
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    moe_method = sgl_mxfp4.Mxfp4Config.get_quant_method

    def get_quant_method(self, layer, prefix):
        if isinstance(layer, FusedMoE):
            return moe_method(self, layer, prefix)
        return UnquantizedLinearMethod() if isinstance(layer, LinearBase) else None

    upcast = ModuleType("triton_kernels.numerics_details.mxfp")
    upcast.upcast_from_mxfp = _from_mxfp4
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sgl_quant.QUANTIZATION_METHODS, "mxfp4", sgl_mxfp4.Mxfp4Config)
        mp.setattr(sgl_mxfp4.Mxfp4Config, "get_quant_method", get_quant_method)
        mp.setattr(sgl_mxfp4, "_is_cpu", False)
        mp.setattr(sgl_mxfp4, "has_triton_kernels", True)
        for name in ("triton_kernels", "triton_kernels.numerics_details"):
            mp.setitem(sys.modules, name, ModuleType(name))
        mp.setitem(sys.modules, upcast.__name__, upcast)
        env = load(path, disable_cuda_graph=True)
    env.path = path
    return env


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    path = tmp_path_factory.mktemp("sgl_mxfp4") / "qwen3-next-tiny-mxfp4"
    return _load_mxfp4(_make_mxfp4_checkpoint(path, TINY_MXFP4))


def _refusal(env) -> str:
    sv, config = _serving(env)
    assert not config, config.message()
    refusal = sv.accept_model(env.model)
    assert refusal, "accepted"
    return refusal.message()


def test_mxfp4_experts_upcast_to_bf16_are_read_in_place_as_bf16(mxfp4, monkeypatch):
    """The upcast branch leaves bf16 w13 [E, 2I, H] / w2 [E, H, I] (I already a multiple of
    64), scales deleted, zero biases, and SGLang's Triton runner multiplies them as an
    unquantized MoE: read in place as bf16, with the reference and with the Triton builder's
    plane formats; no scale bound, no format in the build key."""
    from mono_ext.engines.sglang.views import model_view
    from mono_ext.models.qwen3_next.reference import backend as ref_backend
    from mono_ext.models.qwen3_next.spec import MXFP4_UPCAST
    from mono_ext.models.qwen3_next.triton.backend import build as triton_build

    assert mxfp4.mc.quantization == "mxfp4"
    e, i, h = (TINY_MXFP4[k] for k in ("num_experts", "moe_intermediate_size", "hidden_size"))
    experts = mxfp4.model.model.layers[0].mlp.experts
    qm = experts.quant_method
    assert type(qm).__name__ == "Mxfp4MoEMethod" and qm.runner.runner_backend.value == "triton"
    assert experts.w13_weight.dtype == torch.bfloat16 and experts.w13_weight.shape == (e, 2 * i, h)
    assert not hasattr(experts, "w13_weight_scale") and not experts.w13_weight_bias.any()
    for formats in (None, triton_build.plane_formats):
        if formats is not None:
            monkeypatch.setattr(ref_backend.build, "plane_formats", formats)
        sv, config = _serving(mxfp4)
        assert not config, config.message()  # mxfp4 is judged at the model stage
        refusal = sv.accept_model(mxfp4.model)
        assert not refusal, refusal.message()
        assert sv.spec.plane_formats["w13"] == sv.spec.plane_formats["w2"] == "bf16"
        assert dict(sv.spec.build_keys()[0].formats) == {}
    mv = model_view(sv.model, tp_size=1, tp_rank=0)
    for b, layer in zip(sv.model.layers, mv.layers, strict=True):
        ex = b.module.mlp.experts
        for plane, attr, shape in (("w13", "w13_weight", (e, 2 * i, h)), ("w2", "w2_weight",
                                   (e, h, i))):  # fmt: skip
            assert b.planes[plane].data_ptr() == getattr(ex, attr).data_ptr()  # in place
            view = layer.planes[plane]
            assert (view.quant, view.format, view.shape) == (MXFP4_UPCAST, "bf16", shape)
            assert plane + ".scale" not in b.planes
    assert_bound_planes_dequantize_to_the_checkpoint(
        [b.planes for b in sv.model.layers],
        {},
        _dequantized_mxfp4(mxfp4.path),
        TINY_MXFP4,
        {kind: () for kind in FP8_PLANES},
    )


def test_reference_k2_on_the_upcast_experts_equals_the_dequantized_checkpoint(mxfp4):
    sv, _ = _serving(mxfp4)
    assert not sv.accept_model(mxfp4.model)
    assert len(list(_k2_equals_the_reference_on(sv, _dequantized_mxfp4(mxfp4.path), TINY_MXFP4)))


def test_upcast_experts_padded_to_64_are_refused_as_padded(tmp_path):
    """I = 32: create_weights pads it to 64 (gate rows [0, 32), up rows [64, 96)), so the gate /
    up split is not where K2 reads it."""
    env = _load_mxfp4(_make_mxfp4_checkpoint(tmp_path / "padded", get_preset("qwen3-next-tiny")))
    assert env.model.model.layers[0].mlp.experts.w13_weight.shape == (8, 128, 64)
    message = _refusal(env)
    assert "layers 0-3: w13: bfloat16 [8, 128, 64]: storage padded beyond the logical shape" in (
        message
    )
    assert "layers 0-3: w2: bfloat16 [8, 64, 64]: storage padded beyond" in message
    assert "uses quant method" not in message


def _fresh_experts(**flags):
    """A FusedMoE of TINY_MXFP4's layers under Mxfp4MoEMethod before its
    ``process_weights_after_loading``: uint8 codes and e8m0 scales, with the method's flags of
    another branch set (the Marlin, FlashInfer and triton_kernels conversions need CUDA)."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config

    mod = FusedMoE(
        num_experts=TINY_MXFP4["num_experts"],
        top_k=TINY_MXFP4["num_experts_per_tok"],
        hidden_size=TINY_MXFP4["hidden_size"],
        intermediate_size=TINY_MXFP4["moe_intermediate_size"],
        layer_id=0,
        quant_config=Mxfp4Config(is_checkpoint_mxfp4_serialized=True),
        prefix="model.layers.0.mlp.experts",
    )
    for flag, value in flags.items():
        setattr(mod.quant_method, flag, value)
    return mod


@contextlib.contextmanager
def _swapped(module, name, value):
    """``module.name = value`` for the block (pytest's monkeypatch loses nn.Module children
    and parameters on undo)."""
    old = getattr(module, name, None)
    setattr(module, name, value)
    try:
        yield
    finally:
        if old is None:
            delattr(module, name)
        else:
            setattr(module, name, old)


def test_every_other_mxfp4_experts_state_is_refused_with_its_reason(mxfp4, monkeypatch):
    layer0 = mxfp4.model.model.layers[0]
    experts = layer0.mlp.experts
    # the upcast planes, but no Triton runner (e.g. --moe-runner-backend flashinfer_trtllm:
    # create_moe_runner builds none)
    with monkeypatch.context() as mp:
        mp.delattr(experts.quant_method, "runner")
        assert (
            "layer 0: w13 uses quant method 'Mxfp4MoEMethod (bf16 experts under MoE runner none:"
            " only the Triton MoE runner multiplies the upcast experts as plain bf16)'"
        ) in _refusal(mxfp4)
    with _swapped(experts, "w2_weight_scale", torch.ones(1, dtype=torch.uint8)):
        assert "(w2_weight still has its MXFP4 scale (the upcast deletes it))" in _refusal(mxfp4)
    bias = torch.nn.Parameter(experts.w2_weight_bias + 1, requires_grad=False)
    with _swapped(experts, "w2_weight_bias", bias):  # a bias SGLang's runner would add
        assert "layer 0: w2: bfloat16 [8, 64, 64]: has a bias (the kernels add none)" in (
            _refusal(mxfp4)
        )
    # the branches that keep MXFP4 codes, in layer 0's place
    for flags, needle in (
        ({"use_marlin": True}, "engine kernel marlin): repacked into Marlin's tiled layout"),
        (
            {"use_flashinfer": True, "_fi_kernel": "cutlass_sm90"},
            "engine kernel flashinfer_mxfp4): layout 'flashinfer_interleaved'",
        ),
    ):
        with _swapped(layer0.mlp, "experts", _fresh_experts(**flags)):
            message = _refusal(mxfp4)
        assert "layer 0: w13: mxfp4 (uint8 [8, 128, 64], uint8 scales [8, 128, 2], " in message
        assert needle in message, (needle, message)
    swizzled = _fresh_experts(use_triton_kernels=True)
    del swizzled.w13_weight, swizzled.w2_weight  # as SGLang does, keeping triton_kernels tensors
    swizzled.quant_method.w13_weight_triton_tensor = object()
    swizzled.quant_method.w2_weight_triton_tensor = object()
    with _swapped(layer0.mlp, "experts", swizzled):
        assert "swizzled by triton_kernels (matmul_ogs)" in _refusal(mxfp4)
    assert layer0.mlp.experts is experts and experts.w2_weight_bias is not bias
    assert not hasattr(experts, "w2_weight_scale")
