"""Check mode (``MONO_EXT_CHECK=1``): SGLang's own layer code, piece by piece, next to each
launch (the driver's ``StockLayers``).

Every method calls the engine's modules on copies of its inputs (SGLang's fused add + norm
writes its arguments in place); none computes anything itself. The pieces:

==============  ===============================================================
front_norm      ``layer.input_layernorm(hidden[, residual])``
gdn_mixer       ``layer.linear_attn(x, forward_batch)``; the value returned is
                what entered ``out_proj`` (a forward pre-hook records it)
attn_qkv        ``layer.forward_prepare_native(positions, x)`` with the step's own
                positions (M-RoPE models: ``forward_batch.mrope_positions``)
out_proj        ``out_proj`` / ``o_proj``, then SGLang's TP all-reduce (TP > 1)
tail            ``layer.post_attention_layernorm(y, residual)`` then ``layer.mlp``
==============  ===============================================================
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SglangStockLayers"]


class SglangStockLayers:
    """The engine's layer code for one model; :meth:`bind_step` before each checked step."""

    def __init__(self, layers: Any, *, tp_size: int = 1) -> None:
        self.layers = layers
        self.tp_size = tp_size
        self.forward_batch: Any = None
        self.positions: torch.Tensor | None = None

    def bind_step(self, forward_batch: Any, positions: torch.Tensor) -> None:
        """The step the next calls belong to; ``positions`` as the model's forward got them."""
        self.forward_batch = forward_batch
        self.positions = positions

    def front_norm(self, index, hidden, residual):
        norm = self.layers[index].input_layernorm
        if residual is None:
            return norm(hidden.clone()), hidden
        x, r = norm(hidden.clone(), residual.clone())
        return x, r

    def gdn_mixer(self, index, x):
        la = self.layers[index].linear_attn
        seen: list[torch.Tensor] = []
        handle = la.out_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        try:
            la(x.clone(), self.forward_batch)
        finally:
            handle.remove()
        if len(seen) != 1:
            raise RuntimeError(f"layer {index}: out_proj ran {len(seen)} times in the GDN mixer")
        return seen[0]

    def attn_qkv(self, index, x, positions):
        layer = self.layers[index]
        pos = self.positions if self.positions is not None else positions
        q, k, v, gate = layer.forward_prepare_native(positions=pos, hidden_states=x.clone())
        return q, k, v, gate

    def out_proj(self, index, o_in):
        layer = self.layers[index]
        proj = layer.linear_attn.out_proj if hasattr(layer, "linear_attn") else layer.o_proj
        y, _ = proj(o_in.clone())
        if self.tp_size > 1:
            from sglang.srt.distributed import tensor_model_parallel_all_reduce

            y = tensor_model_parallel_all_reduce(y)
        return y

    def tail(self, index, y, residual):
        layer = self.layers[index]
        x, r = layer.post_attention_layernorm(y.clone(), residual.clone())
        return layer.mlp(x, self.forward_batch), r
