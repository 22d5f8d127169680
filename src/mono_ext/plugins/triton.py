"""Entry-point plugin (group ``mono_ext``) registering the ``triton`` backend (NVIDIA sm_90).

Its target is :data:`mono_ext.models.qwen3_next.triton.backend.build` (K1/K2 behind the launch interface;
a whole-model decode step through it is checked on the H200 by
``tests/models/qwen3_next/triton/test_triton_backend.py``). The probe says usable where triton imports and an
sm_90 device is visible; what a deployment needs beyond that is the builder's ``refusals``.
"""

from ..core.backends import KernelBackend
from ..core.hookspecs import hookimpl


def _probe() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return False, f"device is sm_{major}{minor}; the Triton backend is verified on sm_90 only"
    return True, f"{torch.cuda.get_device_name()} (sm_90)"


@hookimpl
def mono_ext_kernel_backends():
    return [
        KernelBackend(
            name="triton",
            description="persistent Triton K1/K2 launches (NVIDIA Hopper, sm_90)",
            target="mono_ext.models.qwen3_next.triton.backend:build",
            probe=_probe,
            auto_priority=10,
        )
    ]
