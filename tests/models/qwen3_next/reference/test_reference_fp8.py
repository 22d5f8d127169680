"""The reference reads fp8 planes: dequantization of the engines' scales, the
``reference`` backend's launches on fp8 planes with their ``<plane>.scale``, and the spec
accepting fp8 (not mxfp4) planes for that backend."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from mono_ext.core import BuildKey, ConfigView, Deployment  # noqa: E402
from mono_ext.core.spec import BuildContext  # noqa: E402
from mono_ext.core.views import PlaneView, ScaleView  # noqa: E402
from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402
from mono_ext.models.qwen3_next.launches import BoundLayer  # noqa: E402
from mono_ext.models.qwen3_next.reference import (  # noqa: E402
    dequantize,
    dequantized_weights,
)
from mono_ext.models.qwen3_next.reference.backend import build  # noqa: E402
from mono_ext.models.qwen3_next.spec import Qwen3NextSpec  # noqa: E402

FP8 = torch.float8_e4m3fn
TINY_FP8 = get_preset("qwen3-next-tiny-fp8")


def _codes(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 64).to(FP8)


def _positive(*shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g) + 0.5


# -- dequantize ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (3, 256, 128)])
def test_block128_scales_cover_their_128x128_blocks_edges_cut(shape):
    w = _codes(*shape)
    *lead, n, k = shape
    nb, kb = -(-n // 128), -(-k // 128)
    s = _positive(*lead, nb, kb)
    got = dequantize(w, s, "fp8_block128")
    want = torch.empty(shape)
    for r in range(n):  # element by element: row r, column c reads block (r // 128, c // 128)
        for c0 in range(0, k, 128):
            want[..., r, c0 : c0 + 128] = (
                w[..., r, c0 : c0 + 128].float() * s[..., r // 128, c0 // 128, None]
            )
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_channel_and_tensor_scales_in_the_engines_shapes():
    w = _codes(4, 256, 128)
    rows = _positive(4, 256, 1)  # vLLM / SGLang keep [.., N, 1]
    want = w.float() * rows
    assert torch.equal(dequantize(w, rows, "fp8_channel"), want)
    assert torch.equal(dequantize(w, rows.reshape(4, 256), "fp8_channel"), want)  # [.., N]
    per_expert = _positive(4)
    assert torch.equal(
        dequantize(w, per_expert, "fp8_tensor"), w.float() * per_expert[:, None, None]
    )
    one = torch.tensor(0.25)  # a dense plane's one scale (0-dim, as vLLM keeps it)
    assert torch.equal(dequantize(w[0], one, "fp8_tensor"), w[0].float() * 0.25)


@pytest.mark.parametrize(
    "fmt,scale",
    [("fp8_block128", (2, 2)), ("fp8_channel", (128, 1)), ("fp8_tensor", (2,)), ("mxfp4", (1,))],
)
def test_a_scale_that_does_not_fit_the_format_raises(fmt, scale):
    with pytest.raises(ValueError):
        dequantize(_codes(256, 128), torch.ones(scale), fmt)


def test_dequantized_weights_follow_the_formats_and_refuse_silent_mistakes():
    w, s, norm = _codes(256, 128), _positive(2, 1), torch.ones(128, dtype=torch.bfloat16)
    weights = {"out_proj": w, "out_proj.scale": s, "post_attention_layernorm": norm}
    got = dequantized_weights(weights, {"out_proj": "fp8_block128"})
    assert set(got) == {"out_proj", "post_attention_layernorm"}  # no ".scale" keys left
    assert torch.equal(got["out_proj"], dequantize(w, s, "fp8_block128"))
    assert got["post_attention_layernorm"] is norm
    with pytest.raises(ValueError, match="out_proj.scale given for a plane read as bf16"):
        dequantized_weights({**weights, "out_proj": w.bfloat16()}, {})  # a scale not applied
    with pytest.raises(ValueError, match="read as bf16"):
        dequantized_weights({"out_proj": w}, {})  # raw codes would be read as values
    with pytest.raises(ValueError, match="no out_proj.scale was bound"):
        dequantized_weights({"out_proj": w}, {"out_proj": "fp8_block128"})


# -- the backend -----------------------------------------------------------------------------
def _tail_weights(dims, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, i, e = dims.hidden, dims.moe_inter, dims.experts
    shapes = {
        "out_proj": (h, dims.value_dim),
        "router": (e, h),
        "w13": (e, 2 * i, h),
        "w2": (e, h, i),
        "shared_gate_up": (2 * dims.shared_inter, h),
        "shared_down": (h, dims.shared_inter),
        "shared_expert_gate": (1, h),
    }
    w = {n: (torch.randn(*s, generator=g) * 0.05).to(dtype) for n, s in shapes.items()}
    w["post_attention_layernorm"] = (torch.randn(h, generator=g) * 0.1).to(dtype)
    return w


def _block_quantize(t):
    """Per 128x128 block (per expert), as the e2e checkpoints are made: codes and scales."""
    *lead, n, k = t.shape
    blocks = t.float().reshape(*lead, n // 128, 128, k // 128, 128)
    s = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-8) / 448.0
    q = (blocks / s[..., :, None, :, None]).to(FP8).reshape(t.shape)
    return q, s.contiguous()


def test_reference_k2_reads_fp8_planes_through_their_scales():
    """K2 on fp8 planes + scales equals K2 on the same values given as fp32 planes, and differs
    from reading the codes without their scales (the scales are applied, not ignored)."""
    dims = Dims.from_config(TINY_FP8)
    w = _tail_weights(dims)
    quantized = ("out_proj", "w13", "w2", "shared_gate_up", "shared_down")
    fmts = tuple(sorted((n, "fp8_block128") for n in quantized))
    fp8, values = dict(w), dict(w)
    for n in quantized:
        fp8[n], fp8[n + ".scale"] = _block_quantize(w[n])
        values[n] = dequantize(fp8[n], fp8[n + ".scale"], "fp8_block128")
    ctx = BuildContext(text_config=TINY_FP8)
    layouts = (("conv_layout", "time_chan"), ("qkvz_packing", "interleaved"), ("ssm_layout", "vk"))

    def k2(weights, formats):
        key = BuildKey("qwen3_next", "reference", 3, "bfloat16", 1, layouts, formats)
        g = torch.Generator().manual_seed(5)
        o_in = torch.randn(3, dims.value_dim, generator=g).bfloat16()
        res = torch.randn(3, dims.hidden, generator=g).bfloat16()
        h, r = torch.empty_like(res), torch.empty_like(res)
        layer = BoundLayer(0, "linear_attention", weights)
        build(key, ctx).k2(layer, o_in, res, None, hidden_out=h, residual_out=r)
        return h, r

    h_q, r_q = k2(fp8, fmts)
    h_v, r_v = k2(values, ())
    assert torch.equal(h_q, h_v) and torch.equal(r_q, r_v)
    codes = {n: (t.float() if n in quantized else t) for n, t in fp8.items() if "." not in n}
    h_c, _ = k2(codes, ())
    assert not torch.allclose(h_c.float(), h_v.float(), rtol=0.1, atol=0.1)


def test_builder_declares_fp8_and_the_spec_accepts_fp8_not_mxfp4_planes(views):
    assert build.plane_formats == {"bf16", "fp8_block128", "fp8_channel", "fp8_tensor"}
    spec = Qwen3NextSpec()
    cfg = ConfigView(TINY_FP8, quantization="fp8", reads_plane_formats=True)
    assert not spec.accept_config(cfg)
    spec.deploy(Deployment("reference", "bfloat16", 1, (1, 2), plane_formats=build.plane_formats))
    ideal, _ = views
    mv = ideal(spec.dims)
    layers = []
    for layer in mv.layers:
        planes = dict(layer.planes)
        for name in ("out_proj", "o_proj"):
            if name in planes:
                n, k = planes[name].shape
                scale = ScaleView((n // 128, k // 128), "float32", name="weight_scale_inv")
                planes[name] = dataclasses.replace(
                    planes[name],
                    dtype="float8_e4m3fn",
                    quant="Fp8LinearMethod",
                    format="fp8_block128",
                    scale=scale,
                    block=(128, 128),
                )
        e, n, k = planes["w13"].shape
        planes["w13"] = PlaneView(
            (e, n, k),
            "uint8",
            "Mxfp4MoEMethod",
            format="mxfp4",
            scale=ScaleView((e, n, k // 32), "uint8", name="w13_weight_scale"),
        )
        layers.append(dataclasses.replace(layer, planes=planes))
    reasons = spec.refuse_model(dataclasses.replace(mv, layers=tuple(layers))).reasons
    (why,) = reasons  # fp8 read; mxfp4 still refused, by plane
    assert (
        why.startswith("layers 0-3: w13: mxfp4 ") and "the reference backend's K2 does not" in why
    )
    mv_fp8 = dataclasses.replace(
        mv,
        layers=tuple(
            dataclasses.replace(lay, planes={**lay.planes, "w13": mv.layers[0].planes["w13"]})
            for lay in layers
        ),
    )
    assert not spec.refuse_model(mv_fp8)
    key = spec.build_key(1)
    assert dict(key.formats) == {"o_proj": "fp8_block128", "out_proj": "fp8_block128"}
