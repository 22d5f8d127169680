"""The ``vllm.general_plugins`` entry point: :func:`register`.

vLLM calls it once in every process it starts (the API server or ``LLM`` process, the engine
core, each worker, the model-inspection subprocess) and possibly more than once; it is
re-entrant. It imports no torch model code and patches nothing that runs a step: it wraps the
argument surface (``flags.install``) and records that it ran. The replacement model classes
(``flags.MODEL_CLASSES``) reach a process only through ``model_class_overrides``, which
``flags`` sets when the flag is on.
"""

from __future__ import annotations

import logging
import os

from .version import version_problem

__all__ = ["register", "loads"]

log = logging.getLogger("mono_ext.vllm")

_LOADS: list[int] = []


def loads() -> list[int]:
    """Process ids in which this process's ``register`` ran (evidence for tests and doctor)."""
    return list(_LOADS)


def _share_vllm_logging() -> None:
    # mono_ext's loggers print through vLLM's handler and level, so their lines carry vLLM's
    # format and process prefix and follow VLLM_LOGGING_LEVEL.
    ours, theirs = logging.getLogger("mono_ext"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def register() -> None:
    """Entry point of group ``vllm.general_plugins`` (name ``mono_ext``)."""
    first = not _LOADS
    _LOADS.append(os.getpid())
    if not first:
        return
    _share_vllm_logging()
    from .flags import install

    install()
    problem = version_problem()
    if problem is not None:
        log.warning("mono_ext: %s; --monokernel-backend will refuse to start", problem)
    else:
        log.info("mono_ext: vLLM plugin loaded (pid %d)", os.getpid())
