"""The ``flydsl`` backend's :class:`~mono_ext.models.qwen3_next.launches.LaunchBuilder`.

What exists (compiled for gfx950 and checked in CI, never run on an MI355X here) and what does
not is stated in :data:`BUILT` and :data:`NOT_BUILT`. While anything a deployment needs is in
``NOT_BUILT``, :meth:`FlyDSLBuilder.refusals` names it, the plugin's probe reports the backend
unavailable with the same words, and ``__call__`` raises: no stub runs in place of a kernel.

No flydsl import at module import: refusals and the probe work on any machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...core.spec import BuildKey
from ...core.views import ConfigView
from .limits import GFX950, MAX_WIDTH

__all__ = ["BUILT", "NOT_BUILT", "FlyDSLBuilder", "build", "missing_reason"]

#: Pieces compiled for gfx950 in CI (``mono_ext.kernels.flydsl.sweep``).
BUILT: tuple[str, ...] = (
    "runtime primitives: tagged mailbox store and bounded wait (s_memrealtime deadline, health "
    "record, sticky failed word)",
    "one-shot peer-buffer all-reduce through a device table of peer addresses",
    "K1 (layer fronts), kernels/flydsl/k1.py: GDN (every engine layout) and attention "
    "fronts, widths 1..16, compiled and checked for gfx950; host-side tensor checks",
    "K2 (layer tail), kernels/flydsl/k2.py: GDN and attention (gated) layers, widths 1..16, "
    "compiled and checked for gfx950; host-side tensor checks and launch arguments",
)

#: Pieces a deployment needs that do not exist in FlyDSL yet (each one refuses the backend).
NOT_BUILT: tuple[str, ...] = (
    "K1 and K2 exist (compiled for gfx950 only) but their launch binding (workspaces, state "
    "and weight tables, RoPE table, HIP health polling for FailStop) is not written in FlyDSL "
    "yet",
    "HIP IPC peer buffers (runtime.peers opens CUDA IPC only) are not wired for ROCm yet",
)


def missing_reason() -> str | None:
    """One line naming everything not built, or None when the backend is complete."""
    if not NOT_BUILT:
        return None
    return "the FlyDSL backend is incomplete: " + "; ".join(NOT_BUILT)


class FlyDSLBuilder:
    """The backend's ``target``: ``build(key, ctx)`` -> launches of one build key."""

    def refusals(self, cfg: ConfigView, layouts: Mapping[str, str]) -> list[str]:
        reasons = list(NOT_BUILT)
        if cfg.dtype != "bfloat16":
            reasons.append(f"dtype {cfg.dtype}: the FlyDSL K1/K2 read and write bfloat16")
        if cfg.quantization is not None:
            reasons.append(f"quantization {cfg.quantization!r}: the FlyDSL K1/K2 read bf16 planes")
        if cfg.tp_size not in (1, 2, 4, 8):
            reasons.append(f"TP {cfg.tp_size}: the FlyDSL all-reduce is built for TP 1/2/4/8")
        return reasons

    def __call__(self, key: BuildKey, ctx: Any) -> Any:
        if not 1 <= key.width <= MAX_WIDTH:
            raise ValueError(f"{key.label()}: widths 1..{MAX_WIDTH} only")
        why = missing_reason()
        if why is not None:
            raise NotImplementedError(f"{key.label()}: {why}")
        raise NotImplementedError(f"{key.label()}: no {GFX950.arch} launch builder")


#: ``KernelBackend.target`` of the ``flydsl`` backend (``mono_ext.kernels.flydsl.backend:build``).
build = FlyDSLBuilder()
