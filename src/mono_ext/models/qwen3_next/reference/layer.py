"""One decoder layer's decode step composed from K1, the attention in between, and K2."""

from __future__ import annotations

import torch

from mono_ext.models.qwen3_next.dims import Dims
from mono_ext.models.qwen3_next.reference.attention import (
    attn_front,
    attn_out_input,
    decode_attention,
)
from mono_ext.models.qwen3_next.reference.gdn import gdn_front, valid_rows
from mono_ext.models.qwen3_next.reference.tail import TailOut, layer_tail

__all__ = ["decoder_layer_step"]


def decoder_layer_step(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    weights: dict[str, torch.Tensor],
    dims: Dims,
    *,
    kind: str,
    slots: torch.Tensor,
    positions: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    ssm_state: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    conv_layout: str = "time_chan",
    packing: str = "interleaved",
    null_slot: int | None = None,
    eps: float | None = None,
    ssm_layout: str = "vk",
) -> TailOut:
    """K1 -> (attention) -> K2 for one decode token per row.

    ``weights`` is the layer's dict (``input_layernorm`` plus the keys of ``gdn_front`` or
    ``attn_front`` and ``layer_tail``; see ``reference.convert``).

    kind "gdn": ``conv_state`` / ``ssm_state`` / ``slots`` as in ``gdn_front``.
    kind "attn": a contiguous per-slot KV cache stands in for the engine's paged one:
    ``k_cache`` / ``v_cache`` [slots, T_max, Hkv, D]; row i writes its k/v at
    ``[slots[i], positions[i]]`` and attends over ``[:positions[i] + 1]``. Padding rows
    (see ``gdn.valid_rows``) write nothing and get a zero attention output.
    """
    if kind == "gdn":
        front = gdn_front(
            hidden,
            residual,
            weights["input_layernorm"],
            weights,
            dims,
            conv_state,
            ssm_state,
            slots,
            conv_layout=conv_layout,
            packing=packing,
            eps=eps,
            null_slot=null_slot,
            ssm_layout=ssm_layout,
        )
        return layer_tail(front.o_in, front.residual_out, weights, dims, eps, kind="gdn")
    if kind != "attn":
        raise ValueError(f"kind must be 'gdn' or 'attn', got {kind!r}")
    f = attn_front(hidden, residual, weights["input_layernorm"], weights, dims, positions, eps=eps)
    ok = valid_rows(slots, null_slot)
    attn = torch.zeros_like(f.gate)
    if bool(ok.any()):
        idx, pos = slots[ok].long(), positions[ok].long()
        k_cache[idx, pos] = f.k[ok].to(k_cache.dtype)
        v_cache[idx, pos] = f.v[ok].to(v_cache.dtype)
        attn[ok] = decode_attention(f.q[ok], k_cache[idx], v_cache[idx], pos + 1)
    return layer_tail(attn_out_input(attn, f.gate), f.residual_out, weights, dims, eps, kind="attn")
