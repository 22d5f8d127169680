"""Entry-point plugin (group ``mono_ext``) registering the ``triton`` backend (NVIDIA sm_90).

Its target is :data:`mono_ext.kernels.triton.backend.build` (K1/K2 behind the launch interface;
a whole-model decode step through it is checked on the H200 by
``tests/kernels/test_triton_backend.py``). The probe says usable where triton imports and an
sm_90 device is visible; what a deployment needs beyond that is the builder's ``refusals``.
"""

from ..core.backends import KernelBackend
from ..core.hookspecs import hookimpl

# Engines release every step through FailStop before sampling it, graph replays included:
# vLLM 0.26 in the replacement classes' compute_logits, SGLang 0.5.17 in an after-hook on
# ModelRunner.forward (both through DecodeDriver.after_step; SGLang 0.5.23's kernel-plugin path
# still refuses this backend). Tested on CPU with fake health words (tests/unit,
# tests/e2e/test_*_failstop.py); tests/e2e/test_vllm_gpu.py is the H200 engine run. With this
# False no deployment may pick the backend (by name or through auto).
ENGINE_FAILSTOP_WIRED = True


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
    if not ENGINE_FAILSTOP_WIRED:
        return False, (
            "not yet enabled in engines: FailStop is not polled after CUDA-graph replays, so a "
            "failed step could return tokens"
        )
    return True, f"{torch.cuda.get_device_name()} (sm_90)"


@hookimpl
def mono_ext_kernel_backends():
    return [
        KernelBackend(
            name="triton",
            description="persistent Triton K1/K2 launches (NVIDIA Hopper, sm_90)",
            target="mono_ext.kernels.triton.backend:build",
            probe=_probe,
            auto_priority=10,
        )
    ]
