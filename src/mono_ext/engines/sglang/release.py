"""FailStop's release at SGLang's own wait for a batch's results (``runtime.release``).

The router queues a :class:`~mono_ext.runtime.release.Ticket` per routed step right after
``ModelRunner.forward`` (:meth:`.dispatch.Router.after_forward`; nothing waits there). SGLang
0.5.17 and 0.5.23 then sample inside ``TpModelWorker.forward_batch_generation``, which returns
the batch's ``GenerationBatchResult``; the scheduler hands the result's tokens to requests in
``SchedulerBatchResultProcessor.process_batch_result_{decode,prefill,idle}``, whose first act is
to wait for the result's host copy (``copy_done``), under the overlap scheduler one iteration
later, after the next batch's forward was launched. So:

==========================================================  ======  ============================
target (sglang.srt.managers.)                               type    what mono_ext does
==========================================================  ======  ============================
tp_worker.TpModelWorker.forward_batch_generation            after   the result takes the tickets
                                                                    queued since the last result
                                                                    (this batch's steps)
scheduler_components.batch_result_processor.                before  waits on ``copy_done`` (the
SchedulerBatchResultProcessor.process_batch_result_*                wait SGLang makes next), then
                                                                    releases the result's
                                                                    tickets
==========================================================  ======  ============================

The result's copy is enqueued after sampling, which follows the step's health copy on the same
stream, so each release finds its copy landed. A failed step raises
:class:`~mono_ext.runtime.failstop.FailStopError` before SGLang reads the result's tokens: the
scheduler stops with it. Importing this module imports neither SGLang nor torch.
"""

from __future__ import annotations

from typing import Any

from ...runtime.release import ReleaseQueue

__all__ = [
    "TICKETS_ATTR",
    "WORKER_TARGET",
    "PROCESS_TARGETS",
    "pending",
    "after_forward_batch_generation",
    "before_process_batch_result",
]

#: Where a batch result keeps the tickets of its steps.
TICKETS_ATTR = "_mono_ext_tickets"

WORKER_TARGET = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"
_PROCESSOR = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor"
)
PROCESS_TARGETS = tuple(
    f"{_PROCESSOR}.process_batch_result_{kind}" for kind in ("decode", "prefill", "idle")
)

_PENDING = ReleaseQueue()


def pending() -> ReleaseQueue:
    """This process's queue of routed steps whose results SGLang has not processed yet."""
    return _PENDING


def after_forward_batch_generation(result: Any, *args: Any, **kwargs: Any) -> None:
    """The batch result takes the tickets queued by the steps of its forward."""
    if result is None or not len(_PENDING):
        return None
    tickets = _PENDING.take()
    try:
        setattr(result, TICKETS_ATTR, getattr(result, TICKETS_ATTR, ()) + tickets)
    except AttributeError:  # a result type that takes no attributes: release on the spot
        _PENDING.release(tickets)
    return None


def before_process_batch_result(processor: Any, batch: Any, result: Any, *a: Any, **kw: Any):
    """Before SGLang hands a result's tokens to its requests: wait for the result's copy as
    SGLang itself does next, then release the result's steps (raises for a failed one)."""
    tickets = vars(result).pop(TICKETS_ATTR, ()) if hasattr(result, "__dict__") else ()
    if tickets:
        done = getattr(result, "copy_done", None)
        if done is not None:
            done.synchronize()
        _PENDING.release(tickets)
    return None
