"""K2, the layer tail: output projection, residual add + post-attention norm, then the
sparse MoE block (router, routed experts, gated shared expert) or a dense MLP.

Expert weights are in vLLM FusedMoE layout after loading (unquantised): ``w13`` [E, 2I, H]
holds each expert's gate_proj rows then up_proj rows (HF ``experts.gate_up_proj`` has the
same layout), ``w2`` [E, H, I]. The shared expert's ``gate_up`` [2*Is, H] is vLLM's
MergedColumnParallelLinear of gate_proj then up_proj.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mono_ext.models.qwen3_next.dims import Dims
from mono_ext.models.qwen3_next.reference.common import bf16_ulp, f32, gemma_rms_norm
from mono_ext.models.qwen3_next.reference.convert import quantize_activations

__all__ = ["TailOut", "route", "moe_forward", "dense_mlp", "layer_tail"]


@dataclass
class TailOut:
    """K2 output, fp32 (routing fields None for dense-MLP layers).

    hidden_out [B, H]: the MLP/MoE output, the next layer's ``hidden``.
    residual_out [B, H]: residual + o_proj(o_in), the next layer's ``residual``.
    topk_ids [B, k] int64 and topk_weights [B, k] fp32, in descending probability order.
    near_tie [B] bool: see ``route``.
    """

    hidden_out: torch.Tensor
    residual_out: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    near_tie: torch.Tensor | None = None

    @property
    def layer_output(self) -> torch.Tensor:
        """hidden_out + residual_out: what HF's decoder layer returns."""
        return self.hidden_out + self.residual_out


def route(
    x: torch.Tensor, router_w: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax top-k router in fp32.

    Returns (topk_ids [B, k], topk_weights [B, k], near_tie [B]). With p the softmax
    probabilities sorted descending, ``near_tie`` is ``p[k-1] - p[k] <= ulp_bf16(p[k-1])``
    where ulp_bf16(y) = 2^(floor(log2 y) - 7) is the bf16 spacing at y: a bf16 engine could
    pick the (k+1)-th expert instead of the k-th. Always False when k == E.
    """
    probs = torch.softmax(f32(x) @ f32(router_w).t(), dim=-1)
    n_exp = probs.shape[-1]
    top = torch.topk(probs, min(top_k + 1, n_exp), dim=-1)
    ids, w = top.indices[:, :top_k], top.values[:, :top_k]
    if top_k < n_exp:
        pk, pk1 = top.values[:, top_k - 1], top.values[:, top_k]
        near_tie = (pk - pk1) <= bf16_ulp(pk)
    else:
        near_tie = torch.zeros(probs.shape[0], dtype=torch.bool, device=probs.device)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, w, near_tie


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for gate_up [..., 2I, H] (gate rows first)."""
    gu = torch.einsum("bh,bih->bi", x, gate_up) if gate_up.dim() == 3 else x @ gate_up.t()
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def _a8(x: torch.Tensor, plane: str, a8_planes: frozenset[str]) -> torch.Tensor:
    """The activations plane ``plane`` multiplies: where the build quantizes them
    (``a8_planes``) the bf16 values it holds (K2 keeps its normed rows and expert activations
    in bf16, as the engines do) quantized to e4m3 per 128 columns, else as they are. The bf16
    rounding is kept because an e4m3 step is 2^-3 of a value: a code flipped by it would
    cost more than the whole bf16 error budget."""
    if plane not in a8_planes:
        return x
    return quantize_activations(x.to(torch.bfloat16))


def moe_forward(
    x: torch.Tensor,
    weights: dict[str, torch.Tensor],
    dims: Dims,
    a8_planes: frozenset[str] = frozenset(),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MoE block on normed input x [B, H]. Returns (out, ids, weights, near_tie).
    ``a8_planes``: the fp8 planes whose inputs are quantized to e4m3 first (vLLM's fp8 MoE)."""
    x = f32(x)
    ids, tw, near_tie = route(x, weights["router"], dims.top_k, dims.norm_topk)
    w13, w2 = weights["w13"], weights["w2"]
    out = torch.zeros_like(x)
    x13 = _a8(x, "w13", a8_planes)
    for j in range(ids.shape[1]):  # one gathered expert per row at a time bounds memory
        e = ids[:, j]
        h = _swiglu(x13, f32(w13[e]))
        if "w2" in a8_planes:  # K2 weights the activations before down, then quantizes them
            out += torch.einsum(
                "bi,bhi->bh", _a8(tw[:, j : j + 1] * h, "w2", a8_planes), f32(w2[e])
            )
        else:
            out += tw[:, j : j + 1] * torch.einsum("bi,bhi->bh", h, f32(w2[e]))
    if "shared_gate_up" in weights:
        hs = _swiglu(_a8(x, "shared_gate_up", a8_planes), f32(weights["shared_gate_up"]))
        gate = torch.sigmoid(x @ f32(weights["shared_expert_gate"]).t())
        if "shared_down" in a8_planes:
            out += _a8(gate * hs, "shared_down", a8_planes) @ f32(weights["shared_down"]).t()
        else:
            out += gate * (hs @ f32(weights["shared_down"]).t())
    return out, ids, tw, near_tie


def dense_mlp(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """Dense SwiGLU MLP: ``gate_up`` [2I, H] (gate rows first), ``down`` [H, I]."""
    return _swiglu(f32(x), f32(weights["gate_up"])) @ f32(weights["down"]).t()


def layer_tail(
    o_in: torch.Tensor,
    residual: torch.Tensor,
    weights: dict[str, torch.Tensor],
    dims: Dims,
    eps: float | None = None,
    *,
    kind: str = "gdn",
    a8_planes: frozenset[str] = frozenset(),
) -> TailOut:
    """K2 for one decode token per row, TP = 1 (the TP all-reduces are sums of rank partials).

    Args:
        o_in: [B, in] output projection input (GDN: [B, Hv*Dv]; attention: [B, Hq*D]
            already multiplied by sigmoid(gate)).
        residual: [B, H] the front's residual_out.
        weights: ``out_proj`` (kind "gdn") or ``o_proj`` (kind "attn") [H, in];
            ``post_attention_layernorm`` [H] (Gemma style); then either the MoE set
            ``router`` [E, H], ``w13`` [E, 2I, H], ``w2`` [E, H, I], optional shared expert
            ``shared_gate_up`` [2*Is, H], ``shared_down`` [H, Is], ``shared_expert_gate`` [1, H];
            or the dense set ``gate_up`` [2I, H], ``down`` [H, I] (mlp_only_layers /
            decoder_sparse_step layers of Qwen3-Next).
        a8_planes: expert planes (``w13``, ``w2``, ``shared_gate_up``, ``shared_down``) whose
            inputs are quantized to e4m3 per 128 columns before the product, as vLLM's fp8 MoE
            does and a K2 build with ``fp8_activations`` does.
    """
    if kind not in ("gdn", "attn"):
        raise ValueError(f"kind must be 'gdn' or 'attn', got {kind!r}")
    eps = dims.eps if eps is None else eps
    w_o = weights["out_proj" if kind == "gdn" else "o_proj"]
    residual_out = f32(residual) + f32(o_in) @ f32(w_o).t()
    x = gemma_rms_norm(residual_out, weights["post_attention_layernorm"], eps)
    if "router" in weights:
        out, ids, tw, near_tie = moe_forward(x, weights, dims, a8_planes)
        return TailOut(out, residual_out, ids, tw, near_tie)
    return TailOut(dense_mlp(x, weights), residual_out)
