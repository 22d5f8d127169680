"""Entry-point plugin (group ``mono_ext``) registering the ``reference`` backend.

The reference backend runs the exact fp32 torch semantics of K1/K2 in place of
the fused launches. It is for CPU testing of adapters and for bisecting; it is
never picked by ``auto`` and is far slower than the engine's own forward.
"""

from ..core.backends import KernelBackend
from ..core.hookspecs import hookimpl


def _probe() -> tuple[bool, str]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False, "torch is not installed"
    return True, "any device (testing only: slow fp32 torch)"


@hookimpl
def mono_ext_kernel_backends():
    return [
        KernelBackend(
            name="reference",
            description="exact fp32 torch semantics of K1/K2; CPU testing only, slow",
            target="mono_ext.models.qwen3_next.reference.backend:build",
            probe=_probe,
            auto_priority=0,
            testing_only=True,
        )
    ]
