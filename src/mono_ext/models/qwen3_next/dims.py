"""Per-rank shapes of the Qwen3-Next / Qwen3.5-MoE family, derived from a config.

Shapes are derived, never hard-coded to one checkpoint: the real 80B-A3B and
the tiny test configs go through the same arithmetic. TP sharding follows the
engines: column-parallel planes split their output rows, row-parallel planes
their input columns, KV heads are replicated when TP exceeds their count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .configs import family, layer_types, rope_params

__all__ = ["Dims", "GdnChannels", "text_config"]


def text_config(cfg: Any) -> dict[str, Any]:
    """The text model's config as a plain dict, from a (possibly multimodal-wrapped) config
    dict or an HF config object.

    Qwen3.5-MoE checkpoints wrap the text config as ``text_config`` of a
    ``Qwen3_5MoeForConditionalGeneration`` config; the outer architectures are kept.
    """
    if not isinstance(cfg, Mapping):  # an HF PretrainedConfig
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        out = text.to_dict()
        out.setdefault("architectures", list(getattr(cfg, "architectures", None) or ()))
        return out
    if "text_config" in cfg and isinstance(cfg["text_config"], Mapping):
        inner = dict(cfg["text_config"])
        inner.setdefault("architectures", list(cfg.get("architectures") or ()))
        if "architectures" in cfg:
            inner["architectures"] = list(cfg["architectures"])
        return inner
    return dict(cfg)


class GdnChannels:
    """A GDN layer's channel counts from the class's own ``hk``, ``hv``, ``dk``, ``dv``: the
    whole model's in :class:`Dims`, one rank's in a front shape (``shapes.GdnFrontShape``)."""

    hk: int
    hv: int
    dk: int
    dv: int

    @property
    def key_dim(self) -> int:
        """q (and k) channels: Hk * Dk."""
        return self.hk * self.dk

    @property
    def value_dim(self) -> int:
        """v (and z) channels: Hv * Dv, out_proj's input."""
        return self.hv * self.dv

    @property
    def conv_dim(self) -> int:
        """Conv channels: q, k, v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def qkvz_rows(self) -> int:
        """Rows of ``in_proj_qkvz``: q, k, v, z."""
        return 2 * self.key_dim + 2 * self.value_dim

    @property
    def ratio(self) -> int:
        """Value heads per key head, Hv // Hk (the same per rank: TP splits both)."""
        return self.hv // self.hk


@dataclass(frozen=True)
class Dims(GdnChannels):
    """Whole-model and per-rank sizes (``*_r`` are this rank's share; the GDN channel counts
    of :class:`GdnChannels` are the whole model's)."""

    family: str
    hidden: int
    num_layers: int
    kinds: tuple[str, ...]
    eps: float
    # GDN
    hk: int
    hv: int
    dk: int
    dv: int
    conv_k: int
    # attention
    hq: int
    hkv: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # MoE
    experts: int
    top_k: int
    moe_inter: int
    shared_inter: int
    norm_topk: bool
    tp: int
    dense_inter: int = 0  # intermediate_size of dense-MLP layers

    @classmethod
    def from_config(cls, cfg: Any, tp: int = 1) -> Dims:
        """From a text config dict, a wrapped (``text_config``) dict or an HF config object;
        the one place a config's sizes are read."""
        cfg = text_config(cfg)
        theta, factor = rope_params(dict(cfg))
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        fam = family(dict(cfg))
        return cls(
            family=fam,
            hidden=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            kinds=tuple(layer_types(dict(cfg))),
            eps=float(cfg.get("rms_norm_eps", 1e-6)),
            hk=int(cfg["linear_num_key_heads"]),
            hv=int(cfg["linear_num_value_heads"]),
            dk=int(cfg["linear_key_head_dim"]),
            dv=int(cfg["linear_value_head_dim"]),
            conv_k=int(cfg.get("linear_conv_kernel_dim", 4)),
            hq=int(cfg["num_attention_heads"]),
            hkv=int(cfg["num_key_value_heads"]),
            head_dim=head_dim,
            rotary_dim=int(head_dim * factor),
            rope_theta=theta,
            experts=int(cfg.get("num_experts", 0)),
            top_k=int(cfg.get("num_experts_per_tok", 0)),
            moe_inter=int(cfg.get("moe_intermediate_size", 0)),
            shared_inter=int(cfg.get("shared_expert_intermediate_size", 0)),
            # Qwen3.5-MoE has no such key: its router always renormalises the top-k.
            norm_topk=bool(cfg.get("norm_topk_prob", True)) or fam == "qwen3_5_moe",
            tp=tp,
            dense_inter=int(cfg.get("intermediate_size") or 0),
        )

    # -- per-rank shares (valid only when the divisibility refusals passed) ---
    @property
    def hk_r(self) -> int:
        return self.hk // self.tp

    @property
    def hv_r(self) -> int:
        return self.hv // self.tp

    @property
    def hq_r(self) -> int:
        return self.hq // self.tp

    @property
    def hkv_r(self) -> int:
        return max(1, self.hkv // self.tp)

    @property
    def conv_dim_r(self) -> int:
        return self.conv_dim // self.tp

    @property
    def moe_inter_r(self) -> int:
        return self.moe_inter // self.tp

    @property
    def shared_inter_r(self) -> int:
        return self.shared_inter // self.tp

    def planes(self, kind: str) -> dict[str, tuple[int, ...]]:
        """Expected per-rank shape of every plane a layer of ``kind`` holds."""
        h = self.hidden
        common = {
            "input_layernorm": (h,),
            "post_attention_layernorm": (h,),
            "router": (self.experts, h),
            "w13": (self.experts, 2 * self.moe_inter_r, h),
            "w2": (self.experts, h, self.moe_inter_r),
            "shared_gate_up": (2 * self.shared_inter_r, h),
            "shared_down": (h, self.shared_inter_r),
            "shared_expert_gate": (1, h),
        }
        if kind == "linear_attention":
            return {
                **common,
                "in_proj_qkvz": (self.qkvz_rows // self.tp, h),
                "in_proj_ba": (2 * self.hv_r, h),
                "conv1d": (self.conv_dim_r, 1, self.conv_k),  # engines keep nn.Conv1d's [C, 1, K]
                "A_log": (self.hv_r,),
                "dt_bias": (self.hv_r,),
                "norm": (self.dv,),
                "out_proj": (h, self.hv_r * self.dv),
            }
        if kind == "full_attention":
            q = 2 * self.hq_r * self.head_dim  # q carries the output gate
            kv = self.hkv_r * self.head_dim
            return {
                **common,
                "qkv_proj": (q + 2 * kv, h),
                "q_norm": (self.head_dim,),
                "k_norm": (self.head_dim,),
                "o_proj": (h, self.hq_r * self.head_dim),
            }
        raise ValueError(f"unknown layer kind {kind!r}")
