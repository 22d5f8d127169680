"""HF checkpoint / module tensors -> the engine layouts the reference (and K1/K2) read.

Mirrors what vLLM 0.26 holds after ``load_weights`` at TP = 1 (unquantised):

==========================  =====================================================
engine key                  HF source (names relative to ``model.layers.{i}.``)
==========================  =====================================================
input_layernorm             input_layernorm.weight
post_attention_layernorm    post_attention_layernorm.weight
in_proj_qkvz                Qwen3-Next: linear_attn.in_proj_qkvz.weight (interleaved);
                            Qwen3.5: cat(in_proj_qkv, in_proj_z) (contiguous)
in_proj_ba                  Qwen3-Next: linear_attn.in_proj_ba.weight (interleaved);
                            Qwen3.5: cat(in_proj_b, in_proj_a) (contiguous)
conv1d                      linear_attn.conv1d.weight [C, 1, K] (kept 3-D, like vLLM)
A_log, dt_bias, norm        linear_attn.A_log, .dt_bias, .norm.weight
out_proj                    linear_attn.out_proj.weight
qkv_proj                    cat(self_attn.q_proj, k_proj, v_proj)
q_norm, k_norm, o_proj      self_attn.q_norm.weight, k_norm.weight, o_proj.weight
router                      mlp.gate.weight
w13                         mlp.experts.gate_up_proj, or stack of
                            cat(experts.{e}.gate_proj, experts.{e}.up_proj)
w2                          mlp.experts.down_proj, or stack of experts.{e}.down_proj
shared_gate_up              cat(mlp.shared_expert.gate_proj, up_proj)
shared_down                 mlp.shared_expert.down_proj.weight
shared_expert_gate          mlp.shared_expert_gate.weight
gate_up, down               dense MLP: cat(mlp.gate_proj, mlp.up_proj), mlp.down_proj
==========================  =====================================================

A ``packing`` different from the source's repacks in_proj_qkvz / in_proj_ba.

Quantized planes as the engines bind them (``BoundLayer.weights``: the fp8 plane, and its fp32
scale under ``"<plane>.scale"``) become fp32 values with :func:`dequantized_weights`; the
reference then computes with those exactly as with bf16 planes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mono_ext.core.views import SCALE_SUFFIX, scale_key
from mono_ext.models.qwen3_next.dims import Dims
from mono_ext.models.qwen3_next.reference.gdn import pack_ba, pack_qkvz, repack_ba, repack_qkvz

__all__ = [
    "layer_weights_from_state_dict",
    "layer_weights_from_hf",
    "gdn_state_from_hf",
    "conv_state_to_layout",
    "dequantize",
    "dequantized_weights",
    "quantize",
    "quantize_activations",
    "quantized_weights",
    "FP8_BLOCK",
    "FP8_MAX",
]

#: rows and columns one fp8 block-128 scale covers
FP8_BLOCK = 128
#: the largest finite float8_e4m3fn value
FP8_MAX = 448.0


def _get(sd: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return sd[name]
    except KeyError:
        raise KeyError(f"missing tensor {name!r}") from None


def _experts(sd: Mapping[str, torch.Tensor], dims: Dims) -> dict[str, torch.Tensor]:
    if "mlp.experts.gate_up_proj" in sd:
        return {"w13": sd["mlp.experts.gate_up_proj"], "w2": sd["mlp.experts.down_proj"]}
    w13, w2 = [], []
    for e in range(dims.experts):
        p = f"mlp.experts.{e}."
        w13.append(torch.cat([_get(sd, p + "gate_proj.weight"), _get(sd, p + "up_proj.weight")]))
        w2.append(_get(sd, p + "down_proj.weight"))
    return {"w13": torch.stack(w13), "w2": torch.stack(w2)}


def layer_weights_from_state_dict(
    sd: Mapping[str, torch.Tensor],
    dims: Dims,
    *,
    packing: str | None = None,
) -> dict[str, torch.Tensor]:
    """Engine-layout dict for one decoder layer from its HF tensors (names relative to the
    layer, e.g. ``linear_attn.A_log``). ``packing`` None keeps the source's packing
    (interleaved for Qwen3-Next, contiguous for Qwen3.5). Tensors keep their dtype."""
    w: dict[str, torch.Tensor] = {
        "input_layernorm": _get(sd, "input_layernorm.weight"),
        "post_attention_layernorm": _get(sd, "post_attention_layernorm.weight"),
    }
    if "linear_attn.A_log" in sd:
        la = "linear_attn."
        if la + "in_proj_qkvz.weight" in sd:
            src = "interleaved"
            qkvz, ba = sd[la + "in_proj_qkvz.weight"], _get(sd, la + "in_proj_ba.weight")
        else:
            src = "contiguous"
            qkv = _get(sd, la + "in_proj_qkv.weight")
            q, k, v = torch.split(qkv, [dims.key_dim, dims.key_dim, dims.value_dim])
            qkvz = pack_qkvz(q, k, v, _get(sd, la + "in_proj_z.weight"), dims, src)
            ba = pack_ba(
                _get(sd, la + "in_proj_b.weight"), _get(sd, la + "in_proj_a.weight"), dims, src
            )
        dst = packing or src
        if dst != src:
            qkvz, ba = repack_qkvz(qkvz, dims, src, dst), repack_ba(ba, dims, src, dst)
        w.update(
            in_proj_qkvz=qkvz,
            in_proj_ba=ba,
            conv1d=_get(sd, la + "conv1d.weight"),
            A_log=_get(sd, la + "A_log"),
            dt_bias=_get(sd, la + "dt_bias"),
            norm=_get(sd, la + "norm.weight"),
            out_proj=_get(sd, la + "out_proj.weight"),
        )
    else:
        sa = "self_attn."
        w["qkv_proj"] = torch.cat(
            [_get(sd, sa + p + "_proj.weight") for p in ("q", "k", "v")], dim=0
        )
        w.update(
            q_norm=_get(sd, sa + "q_norm.weight"),
            k_norm=_get(sd, sa + "k_norm.weight"),
            o_proj=_get(sd, sa + "o_proj.weight"),
        )
    if "mlp.gate.weight" in sd:
        w["router"] = sd["mlp.gate.weight"]
        w.update(_experts(sd, dims))
        if "mlp.shared_expert.gate_proj.weight" in sd:
            se = "mlp.shared_expert."
            w["shared_gate_up"] = torch.cat(
                [sd[se + "gate_proj.weight"], _get(sd, se + "up_proj.weight")], dim=0
            )
            w["shared_down"] = _get(sd, se + "down_proj.weight")
            w["shared_expert_gate"] = _get(sd, "mlp.shared_expert_gate.weight")
    else:
        w["gate_up"] = torch.cat(
            [_get(sd, "mlp.gate_proj.weight"), _get(sd, "mlp.up_proj.weight")], dim=0
        )
        w["down"] = _get(sd, "mlp.down_proj.weight")
    return w


def layer_weights_from_hf(
    layer: torch.nn.Module, dims: Dims, *, packing: str | None = None
) -> dict[str, torch.Tensor]:
    """Same as ``layer_weights_from_state_dict`` for an HF decoder-layer module (detached)."""
    sd = {k: v.detach() for k, v in layer.state_dict().items()}
    return layer_weights_from_state_dict(sd, dims, packing=packing)


def conv_state_to_layout(state_cd: torch.Tensor, conv_layout: str) -> torch.Tensor:
    """[n, conv_dim, K-1] -> ``conv_layout`` ("time_chan": [n, K-1, conv_dim]; "chan_time": as
    is)."""
    return state_cd.transpose(-1, -2) if conv_layout == "time_chan" else state_cd


def gdn_state_from_hf(
    conv_hf: torch.Tensor,
    recurrent_hf: torch.Tensor,
    dims: Dims,
    conv_layout: str = "time_chan",
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF cache tensors -> engine layouts.

    HF keeps the last K conv inputs ([B, conv_dim, K]); the engines keep the last K-1 (the
    oldest one no longer reaches the kernel). HF's recurrent state is [B, Hv, Dk, Dv]; the
    engines' is [B, Hv, Dv, Dk]. Returned tensors are new (contiguous) copies.
    """
    conv = conv_hf[..., -(dims.conv_k - 1) :]
    return (
        conv_state_to_layout(conv, conv_layout).contiguous(),
        recurrent_hf.transpose(-1, -2).contiguous(),
    )


def dequantize(w: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values of a quantized plane ``w`` [.., N, K] (per expert for [E, N, K]): codes times
    scale, the scale taken as the engines keep it for ``fmt`` (``core.views.PLANE_FORMATS``):

    - ``fp8_block128``: [.., ceil(N/128), ceil(K/128)], one per 128x128 block (edge blocks cut);
    - ``fp8_channel``: one per row, [.., N] or [.., N, 1];
    - ``fp8_tensor``: one per plane (per expert: [E]).

    Raises ValueError when the scale does not hold that many values.
    """
    *lead, n, k = w.shape
    try:
        if fmt == "fp8_block128":
            nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
            s = scale.reshape(*lead, nb, kb)
            s = s.repeat_interleave(FP8_BLOCK, -2)[..., :n, :]
            s = s.repeat_interleave(FP8_BLOCK, -1)[..., :k]
        elif fmt == "fp8_channel":
            s = scale.reshape(*lead, n, 1)
        elif fmt == "fp8_tensor":
            s = scale.reshape(*lead, 1, 1)
        else:
            raise ValueError(f"the reference does not read {fmt!r} planes")
    except RuntimeError as exc:  # reshape: the scale holds another number of values
        raise ValueError(
            f"{fmt} scale {tuple(scale.shape)} does not fit a {tuple(w.shape)} plane"
        ) from exc
    return w.float() * s.float()


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """Activations [.., K] as an fp8 block-128 GEMM with e4m3 activations multiplies them, back
    in fp32: per row and 128 columns (the last group cut), ``scale = max(amax, 1e-10) / 448``
    and ``x / scale`` rounded to e4m3 (nearest even, saturating), times the scale. What vLLM's
    per-token-group quantization hands its fp8 GEMMs; ``kernels.triton.planes.qdot_a8`` the
    same, division for division."""
    x = x.float()
    k = x.shape[-1]
    groups = -(-k // FP8_BLOCK)
    pad = groups * FP8_BLOCK - k
    g = torch.nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], groups, FP8_BLOCK)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-10) / FP8_MAX
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(*x.shape[:-1], groups * FP8_BLOCK)[..., :k]


def dequantized_weights(
    weights: Mapping[str, torch.Tensor], formats: Mapping[str, str]
) -> dict[str, torch.Tensor]:
    """``weights`` with each plane that ``formats`` (plane -> format, e.g. a build key's
    ``formats``) names as quantized replaced by its fp32 :func:`dequantize` values, and the
    ``.scale`` entries dropped. A quantized plane without its scale, a scale without a
    quantized format, or an fp8 plane the formats call bf16 raise ValueError: computing with
    raw codes or ignoring a scale would be silently wrong."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name.endswith(SCALE_SUFFIX):
            if formats.get(name.removesuffix(SCALE_SUFFIX), "bf16") == "bf16":
                raise ValueError(f"{name} given for a plane read as bf16")
            continue
        fmt = formats.get(name, "bf16")
        if fmt == "bf16":
            if t.dtype.is_floating_point and t.element_size() == 1:
                raise ValueError(f"{name} is {t.dtype} but read as bf16 (no format given)")
            out[name] = t
            continue
        scale = weights.get(scale_key(name))
        if scale is None:
            raise ValueError(f"{name} is {fmt} but no {scale_key(name)} was bound")
        out[name] = dequantize(t, scale, fmt)
    return out


def quantize(
    w: torch.Tensor, fmt: str, *, jitter: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3fn codes, fp32 scale) of plane ``w`` [.., N, K] in ``fmt``, the scale shaped as the
    engines keep it (:func:`dequantize`'s inverse up to fp8 rounding): each block's / row's /
    plane's amax over 448, as checkpoint makers do (edge blocks cover what is left).
    ``jitter``: each scale times a random factor in [1, 8) from that generator (tests: a scale
    read for the wrong block or row is then visibly wrong)."""
    x = w.float()
    *lead, n, k = x.shape
    if fmt == "fp8_block128":
        nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
        pad = x.new_zeros(*lead, nb * FP8_BLOCK, kb * FP8_BLOCK)
        pad[..., :n, :k] = x.abs()
        amax = pad.reshape(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK).amax(dim=(-3, -1))
    elif fmt == "fp8_channel":
        amax = x.abs().amax(-1, keepdim=True)  # [.., N, 1]
    elif fmt == "fp8_tensor":
        amax = x.abs().amax(dim=(-2, -1))  # [..]: one per plane (per expert)
    else:
        raise ValueError(f"no fp8 quantization {fmt!r}")
    scale = amax.clamp_min(1e-12) / FP8_MAX
    if jitter is not None:
        scale = scale * (1.0 + 7.0 * torch.rand(scale.shape, generator=jitter, device=x.device))
    scale = scale.contiguous()
    codes = (x / dequantize(torch.ones_like(x), scale, fmt)).to(torch.float8_e4m3fn)
    return codes, scale


def quantized_weights(
    weights: Mapping[str, torch.Tensor],
    formats: Mapping[str, str],
    *,
    jitter: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """``weights`` with each plane ``formats`` names as fp8 replaced by its codes and its scale
    added under ``"<plane>.scale"``, as the engines bind them (:func:`dequantized_weights`
    gives the values the reference computes with)."""
    out = dict(weights)
    for name, fmt in formats.items():
        if fmt != "bf16":
            out[name], out[scale_key(name)] = quantize(weights[name], fmt, jitter=jitter)
    return out
