"""The ``reference`` kernel backend: the exact fp32 K1/K2 of this package behind the launch
interface (``models.qwen3_next.launches``), for CPU testing of engine adapters.

Each launch calls the reference function of its stage on the bound engine tensors and writes
the result, rounded once, into the caller's buffers in the engine's dtype; GDN states are
updated in place in the engine's own cache tensors. It allocates temporaries and reads device
values on the host (boolean row masks), so it is neither fast nor graph-capturable: testing
only, never picked by ``auto``.

Quantized planes (fp8 block-128 / per-channel / per-tensor, with their ``<plane>.scale``) are
dequantized to fp32 at every launch (``convert.dequantized_weights``, following the build
key's ``formats``), so the reference stays the fp32 oracle of what the engine's codes and
scales mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mono_ext.core.spec import BuildContext, BuildKey
from mono_ext.core.views import ConfigView
from mono_ext.models.qwen3_next.dims import Dims
from mono_ext.models.qwen3_next.launches import DEFAULT_LAYOUTS, LAYOUT_KEYS, BoundLayer
from mono_ext.models.qwen3_next.reference.attention import attn_front, attn_out_input
from mono_ext.models.qwen3_next.reference.convert import dequantized_weights
from mono_ext.models.qwen3_next.reference.gdn import gdn_front
from mono_ext.models.qwen3_next.reference.tail import layer_tail

__all__ = ["ReferenceLaunches", "ReferenceBuilder", "build"]


def _layouts(key: BuildKey) -> dict[str, str]:
    got = {**DEFAULT_LAYOUTS, **dict(key.layouts)}
    for name, allowed in LAYOUT_KEYS.items():
        if got[name] not in allowed:
            raise ValueError(f"{key.label()}: {name}={got[name]!r} is not one of {allowed}")
    return got


@dataclass
class ReferenceLaunches:
    """K1/K2 of one build key through the fp32 reference (TP = 1)."""

    key: BuildKey
    dims: Dims
    layouts: Mapping[str, str]
    null_slot: int | None = None

    def _weights(self, layer: BoundLayer) -> dict[str, torch.Tensor]:
        """The layer's planes, quantized ones dequantized to fp32 (per call: testing only)."""
        return dequantized_weights(layer.weights, dict(self.key.formats))

    def begin_step(self) -> None:
        """Nothing per step: the reference keeps no device state between launches."""

    def end_step(self, replayed: bool = False) -> None:
        """Nothing per step: the reference has no device waits to check."""

    def _check_rows(self, hidden: torch.Tensor) -> None:
        if hidden.shape[0] != self.key.width:
            raise ValueError(
                f"{self.key.label()}: got {hidden.shape[0]} rows, built for {self.key.width}"
            )

    def k1_gdn(
        self,
        layer: BoundLayer,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        slots: torch.Tensor,
        *,
        o_in: torch.Tensor,
        residual_out: torch.Tensor,
    ) -> None:
        self._check_rows(hidden)
        w = self._weights(layer)
        front = gdn_front(
            hidden,
            residual,
            w["input_layernorm"],
            w,
            self.dims,
            layer.conv_state,
            layer.ssm_state,
            slots,
            conv_layout=self.layouts["conv_layout"],
            packing=self.layouts["qkvz_packing"],
            null_slot=self.null_slot,
            ssm_layout=self.layouts["ssm_layout"],
        )
        o_in.copy_(front.o_in)
        residual_out.copy_(front.residual_out)

    def k1_attn(
        self,
        layer: BoundLayer,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        *,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        gate: torch.Tensor,
        residual_out: torch.Tensor,
    ) -> None:
        self._check_rows(hidden)
        w = self._weights(layer)
        front = attn_front(hidden, residual, w["input_layernorm"], w, self.dims, positions)
        rows = hidden.shape[0]
        q.copy_(front.q.reshape(rows, -1))
        k.copy_(front.k.reshape(rows, -1))
        v.copy_(front.v.reshape(rows, -1))
        gate.copy_(front.gate)
        residual_out.copy_(front.residual_out)

    def k2(
        self,
        layer: BoundLayer,
        o_in: torch.Tensor,
        residual: torch.Tensor,
        gate: torch.Tensor | None,
        *,
        hidden_out: torch.Tensor,
        residual_out: torch.Tensor,
    ) -> None:
        self._check_rows(o_in)
        x = o_in if gate is None else attn_out_input(o_in, gate)
        tail = layer_tail(
            x, residual, self._weights(layer), self.dims, kind="gdn" if layer.is_gdn else "attn"
        )
        hidden_out.copy_(tail.hidden_out)
        residual_out.copy_(tail.residual_out)


class ReferenceBuilder:
    """The backend's ``target``: ``build(key, ctx)`` -> :class:`ReferenceLaunches`."""

    #: matrix-plane formats the launches read (``Deployment.plane_formats``): fp8 planes are
    #: dequantized with their bound scales; mxfp4 is not read
    plane_formats = frozenset({"bf16", "fp8_block128", "fp8_channel", "fp8_tensor"})

    def refusals(self, cfg: ConfigView, layouts: Mapping[str, str]) -> list[str]:
        reasons = []
        if cfg.tp_size != 1:
            reasons.append(
                f"the reference backend runs TP 1 only (TP {cfg.tp_size}: its K2 has no "
                "all-reduce, so every rank would return a partial sum)"
            )
        for name, value in layouts.items():
            allowed = LAYOUT_KEYS.get(name)
            if allowed is not None and value not in allowed:
                reasons.append(f"the reference backend has no {name}={value!r} (has {allowed})")
        return reasons

    def __call__(self, key: BuildKey, ctx: BuildContext) -> ReferenceLaunches:
        if key.tp_size != 1:
            raise ValueError(f"{key.label()}: the reference backend runs TP 1 only")
        return ReferenceLaunches(
            key=key,
            dims=Dims.from_config(dict(ctx.text_config)),
            layouts=_layouts(key),
            null_slot=ctx.null_slot,
        )


#: ``KernelBackend.target`` of the ``reference`` backend (``mono_ext.models.qwen3_next.reference.backend:build``).
build = ReferenceBuilder()
