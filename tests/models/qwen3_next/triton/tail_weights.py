"""Random K2 (layer tail) planes for the Triton kernel tests: one recipe, every test module."""

from __future__ import annotations

import torch

from mono_ext.models.qwen3_next.dims import Dims


def random_tail_weights(dims: Dims, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Full (TP1) tail planes, bf16 on ``gen``'s device, scaled so activations and logits are
    O(1). Drawn in a fixed order from ``gen``, so a seed gives the same planes every time."""
    h, e, i, s = dims.hidden, dims.experts, dims.moe_inter, dims.shared_inter
    k_in = dims.hv * dims.dv

    def r(*shape, scale):
        return (torch.randn(*shape, generator=gen, device=gen.device) * scale).to(torch.bfloat16)

    return {
        "out_proj": r(h, k_in, scale=k_in**-0.5),
        "post_attention_layernorm": r(h, scale=0.1),
        # logits with std ~3 (x has rms ~1): routing about as decisive as a trained router;
        # with std 1 about 9% of rows are near ties (k-th and (k+1)-th within a bf16 step)
        "router": r(e, h, scale=3 * h**-0.5),
        "w13": r(e, 2 * i, h, scale=h**-0.5),
        "w2": r(e, h, i, scale=i**-0.5),
        "shared_gate_up": r(2 * s, h, scale=h**-0.5),
        "shared_down": r(h, s, scale=s**-0.5),
        "shared_expert_gate": r(1, h, scale=h**-0.5),
    }
