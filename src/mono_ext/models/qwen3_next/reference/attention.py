"""K1 for gated full-attention layers, plus a plain decode attention for tests.

``qkv_proj`` [(2*Hq + 2*Hkv) * D, H] is vLLM's merged QKVParallelLinear at TP = 1:
HF ``q_proj`` rows (per q head ``[q (D), gate (D)]``, because vLLM builds it with
``total_num_heads * (1 + attn_output_gate)`` heads and splits each head's 2*D in halves),
then ``k_proj`` rows, then ``v_proj`` rows.

RoPE is neox style (rotate-half) on the first ``rotary_dim = int(D * partial_rotary_factor)``
dims of each head, ``inv_freq = theta^(-2i / rotary_dim)``. Qwen3.5's interleaved M-RoPE
reduces to exactly this for text tokens, whose three position rows are equal.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mono_ext.models.qwen3_next.dims import Dims
from mono_ext.models.qwen3_next.reference.common import (
    add_gemma_rms_norm,
    f32,
    gemma_rms_norm,
)

__all__ = [
    "AttnFrontOut",
    "rope_cos_sin",
    "apply_neox_rope",
    "attn_front",
    "decode_attention",
    "attn_out_input",
]


class AttnFrontOut(NamedTuple):
    """K1 output of an attention layer (fp32): q [B, Hq, D], k / v [B, Hkv, D] (post norm and
    RoPE; what the engine writes to its KV cache), gate [B, Hq*D] (pre-sigmoid), residual_out."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gate: torch.Tensor
    residual_out: torch.Tensor


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, rotary_dim // 2] in fp32 (frequencies built in fp32 like HF and vLLM)."""
    inv_freq = 1.0 / (
        theta
        ** (
            torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device)
            / rotary_dim
        )
    )
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_neox_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """x [B, heads, D]; rotate-half on x[..., :rotary_dim], pass the rest through."""
    x = f32(x)
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


def attn_front(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    input_norm_w: torch.Tensor,
    weights: dict[str, torch.Tensor],
    dims: Dims,
    positions: torch.Tensor,
    *,
    eps: float | None = None,
) -> AttnFrontOut:
    """Attention layer front for one token per row: add + norm, qkv_proj, q/k Gemma norm,
    partial neox RoPE.

    Args:
        hidden, residual: [B, H] (residual may be None, as in ``gdn_front``).
        weights: ``qkv_proj`` [(2*Hq + 2*Hkv)*D, H], ``q_norm`` [D], ``k_norm`` [D].
        positions: [B] int token positions (0-based).
    """
    d = dims
    eps = d.eps if eps is None else eps
    x, residual_out = add_gemma_rms_norm(hidden, residual, input_norm_w, eps)
    qkv = x @ f32(weights["qkv_proj"]).t()
    bsz, hd = x.shape[0], d.head_dim
    q_gate, k, v = torch.split(qkv, [2 * d.hq * hd, d.hkv * hd, d.hkv * hd], dim=-1)
    q_gate = q_gate.reshape(bsz, d.hq, 2 * hd)
    q, gate = q_gate[..., :hd], q_gate[..., hd:].reshape(bsz, d.hq * hd)
    q = gemma_rms_norm(q, weights["q_norm"], eps)
    k = gemma_rms_norm(k.reshape(bsz, d.hkv, hd), weights["k_norm"], eps)
    cos, sin = rope_cos_sin(positions, d.rotary_dim, d.rope_theta)
    q = apply_neox_rope(q, cos, sin, d.rotary_dim)
    k = apply_neox_rope(k, cos, sin, d.rotary_dim)
    return AttnFrontOut(q, k, v.reshape(bsz, d.hkv, hd), gate, residual_out)


def decode_attention(
    q: torch.Tensor,
    k_hist: torch.Tensor,
    v_hist: torch.Tensor,
    lengths: torch.Tensor | None = None,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain softmax attention of one query per row over a contiguous history.

    Args:
        q: [B, Hq, D]; k_hist / v_hist: [B, T, Hkv, D], including the current token's k/v.
        lengths: [B] valid history length per row (default T); keys at t >= length are ignored.
        scale: default D^-0.5.

    Returns:
        [B, Hq*D] fp32 (rows with length 0 give zeros).
    """
    q, k_hist, v_hist = f32(q), f32(k_hist), f32(v_hist)
    bsz, hq, hd = q.shape
    t, hkv = k_hist.shape[1], k_hist.shape[2]
    scale = hd**-0.5 if scale is None else scale
    k = k_hist.repeat_interleave(hq // hkv, dim=2)  # q head h reads kv head h // (Hq/Hkv)
    v = v_hist.repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("bhd,bthd->bht", q, k) * scale
    if lengths is not None:
        mask = torch.arange(t, device=q.device)[None, :] >= lengths.to(q.device)[:, None]
        scores = scores.masked_fill(mask[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bht,bthd->bhd", p, v).reshape(bsz, hq * hd)


def attn_out_input(attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o_proj's input: attention output [B, Hq*D] times sigmoid(gate [B, Hq*D])."""
    return f32(attn) * torch.sigmoid(f32(gate))
