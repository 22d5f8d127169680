"""The per-rank sizes every kernel backend builds the layer fronts (K1, GDN and attention) and
the layer tail (K2) for, taken from :class:`~mono_ext.models.qwen3_next.dims.Dims`, and the
limits every backend shares. Free of torch and of any kernel language, so that each backend's
``K1GdnShape``, ``K1AttnShape`` and ``K2Shape`` subclass them and add only their own limits
and derived sizes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mono_ext.models.qwen3_next.dims import GdnChannels

__all__ = ["AttnFrontShape", "GdnFrontShape", "TailShape", "kernel_shape_reasons"]


class _Refusable:
    def refusals(self) -> list[str]:
        return []

    def validate(self) -> None:
        bad = self.refusals()
        if bad:
            raise ValueError(f"{type(self).__name__} refused: " + "; ".join(bad))


@dataclass(frozen=True)
class GdnFrontShape(GdnChannels, _Refusable):
    """Per-rank sizes of one GDN layer front: ``hk`` key heads of ``dk``, ``hv`` value heads
    of ``dv`` (this rank's share under TP), a causal depthwise conv of ``conv_k`` taps over
    the q, k and v channels."""

    hidden: int
    hk: int
    hv: int
    dk: int
    dv: int
    conv_k: int
    eps: float

    @classmethod
    def from_dims(cls, dims: Any) -> GdnFrontShape:
        """From :class:`mono_ext.models.qwen3_next.dims.Dims` (per rank via ``tp``)."""
        return cls(hidden=dims.hidden, hk=dims.hk_r, hv=dims.hv_r, dk=dims.dk, dv=dims.dv,
                   conv_k=dims.conv_k, eps=dims.eps)  # fmt: skip

    @property
    def payload_words(self) -> int:
        """Words per row of the proj region K1's stages hand over: conv out, z, beta, g,
        rounded up to 16 (row offsets stay divisible by 16, which Triton vectorises on)."""
        n = self.conv_dim + self.value_dim + 2 * self.hv
        return -(-n // 16) * 16

    def refusals(self) -> list[str]:
        """What no backend's GDN front takes; a backend's subclass adds its own limits."""
        if self.hk < 1 or self.hv % self.hk:
            return [f"Hv={self.hv} is not a multiple of Hk={self.hk}"]
        return []


@dataclass(frozen=True)
class AttnFrontShape(_Refusable):
    """Per-rank sizes of one gated-attention layer front: ``hq`` query heads (each with its
    output gate) and ``hkv`` kv heads of ``head_dim``, partial rotary over ``rotary_dim``."""

    hidden: int
    hq: int
    hkv: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    eps: float

    @classmethod
    def from_dims(cls, dims: Any) -> AttnFrontShape:
        """From :class:`mono_ext.models.qwen3_next.dims.Dims` (per rank via ``tp``)."""
        return cls(hidden=dims.hidden, hq=dims.hq_r, hkv=dims.hkv_r, head_dim=dims.head_dim,
                   rotary_dim=dims.rotary_dim, rope_theta=float(dims.rope_theta),
                   eps=dims.eps)  # fmt: skip

    @property
    def qkv_rows(self) -> int:
        """qkv_proj rows: q and its gate per query head, k and v per kv head."""
        return (2 * self.hq + 2 * self.hkv) * self.head_dim

    def refusals(self) -> list[str]:
        """What no backend's attention front takes; a backend's subclass adds its own."""
        bad = []
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            bad.append(
                f"rotary_dim={self.rotary_dim} is not even and within head_dim {self.head_dim}"
            )
        if self.hq < 1 or self.hkv < 1 or self.hq % self.hkv:
            bad.append(f"hq={self.hq}, hkv={self.hkv}: need hkv >= 1 dividing hq")
        return bad


@dataclass(frozen=True)
class TailShape(_Refusable):
    """Per-rank sizes of one K2 build (``*_r``: this rank's share under TP ``tp``)."""

    hidden: int
    in_dim: int  # out_proj / o_proj input columns on this rank
    experts: int
    top_k: int
    moe_inter: int  # I_r
    shared_inter: int  # Is_r
    norm_topk: bool
    eps: float
    tp: int = 1

    @classmethod
    def from_dims(cls, dims: Any, kind: str = "gdn") -> TailShape:
        """From :class:`mono_ext.models.qwen3_next.dims.Dims` (already per rank via ``tp``);
        ``kind``: "gdn" (out_proj reads Hv*Dv) or "attn" (o_proj reads Hq*D)."""
        if kind == "gdn":
            in_dim = dims.hv_r * dims.dv
        elif kind == "attn":
            in_dim = dims.hq_r * dims.head_dim
        else:
            raise ValueError(f"kind must be 'gdn' or 'attn', got {kind!r}")
        return cls(
            hidden=dims.hidden,
            in_dim=in_dim,
            experts=dims.experts,
            top_k=dims.top_k,
            moe_inter=dims.moe_inter_r,
            shared_inter=dims.shared_inter_r,
            norm_topk=dims.norm_topk,
            eps=dims.eps,
            tp=dims.tp,
        )

    def refusals(self) -> list[str]:
        """What no backend's K2 takes; a backend's subclass adds its own limits."""
        bad = []
        if self.tp not in (1, 2, 4, 8):
            bad.append(f"tp={self.tp}: the in-kernel all-reduce needs a power-of-two world <= 8")
        if not 1 <= self.top_k <= min(self.experts, 10):
            bad.append(f"top_k={self.top_k} outside 1..min(experts, 10)")
        if self.experts > 512:
            bad.append(f"experts={self.experts} > 512")
        for name in ("hidden", "in_dim", "moe_inter", "shared_inter"):
            if getattr(self, name) < 1:
                bad.append(f"{name}={getattr(self, name)} must be >= 1")
        return bad

    def weight_shapes(self, kind: str) -> dict[str, tuple[int, ...]]:
        """The planes K2 reads, by reference key, with their per-rank shapes."""
        h = self.hidden
        return {
            "out_proj" if kind == "gdn" else "o_proj": (h, self.in_dim),
            "post_attention_layernorm": (h,),
            "router": (self.experts, h),
            "w13": (self.experts, 2 * self.moe_inter, h),
            "w2": (self.experts, h, self.moe_inter),
            "shared_gate_up": (2 * self.shared_inter, h),
            "shared_down": (h, self.shared_inter),
            "shared_expert_gate": (1, h),
        }

    def launch_tensors(
        self, kind: str, gated: bool, width: int, o_in: Any, residual: Any, weights: Any,
        out_hidden: Any, out_residual: Any, gate: Any = None,
    ) -> tuple[dict[str, tuple[Any, tuple[int, ...]]], list[str]]:  # fmt: skip
        """Every tensor one K2 launch of ``width`` rows reads or writes, with the shape it must
        have, and the reasons found before looking at any tensor (missing weights, a gate given
        to an ungated build or missing from a gated one). Each backend adds its own per-tensor
        checks (dtype, layout, alignment)."""
        tensors = {
            "o_in": (o_in, (width, self.in_dim)),
            "residual": (residual, (width, self.hidden)),
            "out_hidden": (out_hidden, (width, self.hidden)),
            "out_residual": (out_residual, (width, self.hidden)),
        }
        bad = []
        if gated:
            if gate is None:
                bad.append("missing gate (a gated build multiplies o_in by sigmoid(gate))")
            else:
                tensors["gate"] = (gate, (width, self.in_dim))
        elif gate is not None:
            bad.append("got a gate, but this build is not gated (o_in must be pre-gated)")
        for name, shp in self.weight_shapes(kind).items():
            t = weights.get(name)
            if t is None:
                bad.append(f"missing weight {name!r}")
            else:
                tensors[name] = (t, shp)
        return tensors, bad


def kernel_shape_reasons(
    text_config: Mapping[str, Any], tp: int, backend: str, gdn_front: Any, attn_front: Any,
    tail: Any,
) -> list[str]:  # fmt: skip
    """What a kernel backend's launches, built for this config's per-rank shapes, cannot read:
    the ``refusals()`` of its shape classes (``from_dims``: the GDN and attention fronts, the
    tail) for the layer kinds present, and dense-MLP layers (every K2 is a MoE tail)."""
    from .configs import is_moe_layer
    from .dims import Dims

    try:
        d = Dims.from_config(text_config, tp=tp)
    except (KeyError, TypeError, ValueError) as exc:
        return [f"the {backend} backend cannot read the config's sizes: {exc}"]
    shapes = []
    if "linear_attention" in d.kinds:
        shapes += [("K1 (GDN)", gdn_front.from_dims(d)), ("K2 (gdn)", tail.from_dims(d))]
    if "full_attention" in d.kinds:
        shapes += [("K1 (attention)", attn_front.from_dims(d)),
                   ("K2 (attn)", tail.from_dims(d, "attn"))]  # fmt: skip
    reasons = [f"{label}: {r}" for label, shape in shapes for r in shape.refusals()]
    dense = [i for i in range(d.num_layers) if not is_moe_layer(dict(text_config), i)]
    if dense:
        reasons.append(f"K2 has no dense-MLP tail; layers {dense[:8]} are dense")
    return reasons
