"""Whether a CUDA graph is being captured, the one question the host asks torch's CUDA API on
every step, asked cheaply.

``torch.cuda.is_available()`` counts the devices through the driver on every call: 16-19 us per
call in the H200's VM (docs/perf.md, host time), paid on each step's host path. Whether there is
a device is asked once per process. Torch is imported inside the functions: the module loads on
a box without it.
"""

from __future__ import annotations

import functools

__all__ = ["has_cuda", "is_capturing"]


@functools.cache
def has_cuda() -> bool:
    """Whether torch sees a CUDA (or HIP) device; asked once per process."""
    import torch

    return torch.cuda.is_available()


def is_capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream (False without CUDA)."""
    if not has_cuda():
        return False
    import torch

    return torch.cuda.is_current_stream_capturing()
