"""The run-time hooks both ways SGLang reaches mono_ext register (``HookRegistry``).

:mod:`.plugin` (0.5.17, ``--monokernel``) and :mod:`.native_api` (0.5.23's kernel-plugin API)
install the dispatching forward differently, but on both every decode step comes back to
Python in ``ModelRunner.forward`` before SGLang samples it (a decode-graph replay too:
``ModelRunner._forward_raw`` returns ``decode_cuda_graph_runner.execute``'s logits in a
``ModelRunnerOutput(can_run_graph=True)``; ``TpModelWorker.forward_batch_generation`` then
samples), and every batch's tokens reach requests through the scheduler's result processor.
So both register the same hooks:

======================================================  ======  ===============================
target (sglang.srt.)                                    type    what mono_ext does
======================================================  ======  ===============================
model_executor.model_runner.ModelRunner.forward         after   FailStop: queues a release
                                                                ticket for each routed step
                                                                (eager or graph replay), no
                                                                wait (:meth:`.dispatch.Router.
                                                                after_forward`)
managers.tp_worker.TpModelWorker.                       after   the batch result takes its
forward_batch_generation                                        steps' tickets (:mod:`.release`)
managers.scheduler_components.batch_result_processor.   before  releases them where SGLang
SchedulerBatchResultProcessor.process_batch_result_*            awaits the result's tokens;
                                                                raises for a failed step
managers.scheduler.Scheduler.handle_rpc_request         around  answers ``Engine.collective_
                                                                rpc("mono_ext_report", path=
                                                                ...)`` (:mod:`.report`)
======================================================  ======  ===============================

Both return at once for a model mono_ext does not route. Importing this module imports
neither SGLang nor torch.
"""

from __future__ import annotations

import functools
from typing import Any

from . import release as _release

__all__ = [
    "FORWARD_TARGET",
    "RPC_TARGET",
    "RUNTIME_HOOKS",
    "after_forward",
    "around_handle_rpc_request",
    "register",
    "applied",
]

FORWARD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
RPC_TARGET = "sglang.srt.managers.scheduler.Scheduler.handle_rpc_request"


def after_forward(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """After ``ModelRunner.forward`` (``result`` is its ``ModelRunnerOutput``) and before
    SGLang samples the step: FailStop for the router on ``runner.model``, if any. Raises
    :class:`~mono_ext.runtime.failstop.FailStopError` where a device wait of the step gave up;
    keeps SGLang's result."""
    from .dispatch import router_of

    router = router_of(getattr(runner, "model", None))
    if router is None:
        return None
    forward_batch = args[0] if args else kwargs.get("forward_batch")
    router.after_forward(forward_batch, result, getattr(runner, "decode_cuda_graph_runner", None))
    return None


def around_handle_rpc_request(original: Any, scheduler: Any, recv_req: Any, *a, **kw) -> Any:
    """SGLang's RPC calls the scheduler method named by the request: give the scheduler
    :func:`.report.write_report` under that name when it is asked for, then let SGLang run it
    (its reply and TP barrier unchanged)."""
    from .report import REPORT_RPC, write_report

    if getattr(recv_req, "method", None) == REPORT_RPC and REPORT_RPC not in vars(scheduler):
        scheduler.__dict__[REPORT_RPC] = functools.partial(write_report, scheduler)
    return original(scheduler, recv_req, *a, **kw)


#: (target, hook type name, hook), as :mod:`.plugin`'s ``HOOKS``.
RUNTIME_HOOKS: tuple[tuple[str, str, Any], ...] = (
    (FORWARD_TARGET, "AFTER", after_forward),
    (_release.WORKER_TARGET, "AFTER", _release.after_forward_batch_generation),
    *((t, "BEFORE", _release.before_process_batch_result) for t in _release.PROCESS_TARGETS),
    (RPC_TARGET, "AROUND", around_handle_rpc_request),
)


def failstop_hooks_applied() -> list[str]:
    """The FailStop targets whose hook is not applied in this process (empty: all are)."""
    return [t for t, _, hook in RUNTIME_HOOKS if t != RPC_TARGET and not applied(t, hook)]


def register(hooks: tuple[tuple[str, str, Any], ...]) -> None:
    """Register ``hooks`` with SGLang's ``HookRegistry`` (``load_plugins`` applies them once
    every plugin ran)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, kind, hook in hooks:
        HookRegistry.register(target, hook, getattr(HookType, kind))


def applied(target: str, hook: Any) -> bool:
    """Whether ``HookRegistry`` has put ``hook`` on ``target`` in this process (registered,
    and the target patched). False where the registry cannot say (another SGLang)."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry
    except ImportError:
        return False
    hooks = getattr(HookRegistry, "_hooks", {}).get(target, ())
    patched = getattr(HookRegistry, "_patched", ())
    return target in patched and any(h is hook for _, h, *_ in hooks)
