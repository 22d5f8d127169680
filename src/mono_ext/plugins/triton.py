"""Entry-point plugin (group ``mono_ext``) registering the ``triton`` backend (NVIDIA sm_90)."""

from ..core.backends import KernelBackend
from ..core.hookspecs import hookimpl

# Flipped to True by the change that lands the K1/K2 launches (issues 4 and 5);
# until then the probe says so instead of letting a deployment pick it.
LAYER_KERNELS_BUILT = False


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
    if not LAYER_KERNELS_BUILT:
        return False, "the K1/K2 Triton launches are not built yet"
    return True, f"{torch.cuda.get_device_name()} (sm_90)"


@hookimpl
def mono_ext_kernel_backends():
    return [
        KernelBackend(
            name="triton",
            description="persistent Triton K1/K2 launches (NVIDIA Hopper, sm_90)",
            target="mono_ext.kernels.triton",
            probe=_probe,
            auto_priority=10,
        )
    ]
