"""Entry-point plugin (group ``mono_ext``) registering the ``flydsl`` backend (AMD gfx950).

Its target is :data:`mono_ext.models.qwen3_next.flydsl.backend.build`. The probe says usable only on a
ROCm device whose architecture is gfx950 (MI350X/MI355X) with flydsl installed, and only once
every piece a deployment needs is built (``backend.NOT_BUILT`` empty); otherwise it names why.
Its ``auto_priority`` is above the Triton backend's, so ``auto`` takes FlyDSL on gfx950 (where
Triton's probe refuses) and Triton on sm_90 (where this probe refuses).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.backends import KernelBackend
from ..core.hookspecs import hookimpl

ARCH = "gfx950"
AUTO_PRIORITY = 20  # the Triton backend's is 10


@dataclass(frozen=True)
class DeviceFacts:
    """What the probe needs to know about the visible device (``None`` fields: unknown)."""

    torch: bool  # torch imports
    device: bool  # torch sees a GPU (CUDA or ROCm)
    hip: str | None = None  # torch.version.hip when torch is a ROCm build
    arch: str | None = None  # gcnArchName without feature flags, e.g. "gfx950"
    name: str = ""
    flydsl: bool = False  # flydsl is importable


def device_facts() -> DeviceFacts:
    import importlib.util

    flydsl = importlib.util.find_spec("flydsl") is not None
    try:
        import torch
    except ImportError:
        return DeviceFacts(torch=False, device=False, flydsl=flydsl)
    if not torch.cuda.is_available():
        return DeviceFacts(torch=True, device=False, flydsl=flydsl)
    hip = getattr(torch.version, "hip", None)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if hip:
        arch = str(getattr(props, "gcnArchName", "") or "").split(":")[0] or None
    else:
        arch = f"sm_{props.major}{props.minor}"
    return DeviceFacts(True, True, hip, arch, str(props.name), flydsl)


def probe_facts(facts: DeviceFacts, missing: str | None) -> tuple[bool, str]:
    """The probe's answer for ``facts``; ``missing`` is the backend's not-built reason."""
    if not facts.torch:
        return False, "torch is not installed"
    if not facts.device:
        return False, "no GPU is visible (the FlyDSL backend runs on AMD gfx950)"
    if not facts.hip:
        return (
            False,
            f"device is {facts.arch or 'an NVIDIA GPU'} (CUDA); FlyDSL runs on ROCm gfx950",
        )
    if facts.arch != ARCH:
        return False, f"ROCm device is {facts.arch or 'of unknown architecture'}; built for {ARCH}"
    if not facts.flydsl:
        return False, "flydsl is not installed (pip install 'mono-ext[flydsl]')"
    if missing:
        return False, missing
    return True, f"{facts.name} ({ARCH}, HIP {facts.hip})"


def _probe() -> tuple[bool, str]:
    from ..models.qwen3_next.flydsl.backend import missing_reason

    return probe_facts(device_facts(), missing_reason())


@hookimpl
def mono_ext_kernel_backends():
    return [
        KernelBackend(
            name="flydsl",
            description="persistent FlyDSL K1/K2 launches (AMD Instinct MI355X, gfx950)",
            target="mono_ext.models.qwen3_next.flydsl.backend:build",
            probe=_probe,
            auto_priority=AUTO_PRIORITY,
        )
    ]
