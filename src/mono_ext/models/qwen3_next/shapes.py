"""The per-rank sizes every kernel backend builds the layer tail (K2) for, taken from
:class:`~mono_ext.models.qwen3_next.dims.Dims`, and the limits every backend shares. Free of
torch and of any kernel language, so that each backend's ``K2Shape`` subclasses it and adds
only its own limits and derived sizes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TailShape"]


@dataclass(frozen=True)
class TailShape:
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

    def validate(self) -> None:
        bad = self.refusals()
        if bad:
            raise ValueError(f"{type(self).__name__} refused: " + "; ".join(bad))
