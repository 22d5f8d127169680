"""What mono_ext did in a vLLM worker, for tests and operators.

``LLM(...).collective_rpc(worker_report)`` returns one dict per worker. This module imports
nothing heavy, so asking a stock engine what it ran does not load mono_ext's model code.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .flags import MODEL_CLASSES
from .plugin import loads

__all__ = ["worker_report"]


def _unwrap(model: Any) -> Any:
    unwrap = getattr(model, "unwrap", None)  # vLLM's CUDAGraphWrapper
    return unwrap() if callable(unwrap) else model


def worker_report(worker: Any) -> dict[str, Any]:
    """The worker's model class, registry entries, plugin loads, loaded mono_ext modules, and,
    for a mono_ext model, its dispatch state (stages, refusals, routed steps, check mode)."""
    from vllm.model_executor.models.registry import ModelRegistry

    model = _unwrap(worker.model_runner.model)
    registry = {}
    for arch in MODEL_CLASSES:
        entry = ModelRegistry.models.get(arch)
        registry[arch] = (
            None
            if entry is None
            else f"{getattr(entry, 'module_name', '?')}:{getattr(entry, 'class_name', '?')}"
        )
    out: dict[str, Any] = {
        "pid": os.getpid(),
        "plugin_loads": loads(),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "registry": registry,
        "mono_ext_modules": sorted(m for m in sys.modules if m.startswith("mono_ext")),
    }
    mono = getattr(model, "mono", None)
    if mono is not None and hasattr(mono, "report"):
        out.update(mono.report())
    return out
