"""GPU runtime shared by every kernel backend: scratch and mailbox layout, health words and
FailStop, peer buffers (CUDA IPC and virtual TP), build keys and the residency check.

Importing this package pulls in neither torch nor triton; the pieces that need them import
them when used.
"""

from mono_ext.runtime.build_cache import BuildCache, NotBuiltError, ResidencyError
from mono_ext.runtime.failstop import FailStop, FailStopError, VirtualFailStop
from mono_ext.runtime.health import HealthSummary, WaitRecord, decode_health
from mono_ext.runtime.layout import (
    HandoffError,
    Layout,
    Program,
    Region,
    Stage,
    allreduce,
    check_handoffs,
    plan_layout,
    push,
    wait,
    write,
)

__all__ = [
    "BuildCache",
    "FailStop",
    "FailStopError",
    "HandoffError",
    "HealthSummary",
    "Layout",
    "NotBuiltError",
    "Program",
    "Region",
    "ResidencyError",
    "Stage",
    "VirtualFailStop",
    "WaitRecord",
    "allreduce",
    "check_handoffs",
    "decode_health",
    "plan_layout",
    "push",
    "wait",
    "write",
]
