"""In an SGLang 0.5.17 scheduler: make mono_ext's device waits give up mid-decode, on cue.

Loaded through ``ServerArgs.forward_hooks`` (``hook_factory="sglang_fault_hook:factory"``):
SGLang calls the factory once per scheduler, after CUDA-graph capture and before the first
request, from ``register_forward_hooks(model, specs)``; the factory takes that ``model`` from
its caller's frame and wraps the instance method ``after_forward`` of mono_ext's router on it
(:mod:`mono_ext.engines.sglang.dispatch`: runs after every ``ModelRunner.forward``, before
SGLang samples the step). Once the file ``config["arm"]`` exists (the runner creates it after
its reference pass), the wrapper counts decode steps that replayed a routed graph; after
``config["healthy_steps"]`` of them it sets every mono_ext runtime's wait deadline
(``CTRL_DEADLINE_NS`` of the device control block, on the current stream) to 1 ns, so the
kernels' next waits give up as a stalled wait does when its deadline passes. It writes to
``config["record"]`` (JSON, rewritten at each event): the injection time and step, and the
FailStopError text and time when mono_ext raises one (the scheduler then dies; SGLang takes
its parent down with it, so a file is the only way out). FailStop raises where a step is
released: at SGLang's processing of the batch result (:mod:`mono_ext.engines.sglang.release`,
whose queue's ``release`` the factory wraps on the instance), or in ``after_forward`` (the
queue's bound, and agreement between ranks), so both are wrapped.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _write(path: str, rec: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, path)


def _shrink_deadlines(router: Any) -> int:
    import torch

    from mono_ext.runtime.health import CTRL_DEADLINE_NS

    launches = router.serving.driver.launches
    runtimes = {id(x.runtime): x.runtime for x in launches.values()}
    with torch.inference_mode():
        for rt in runtimes.values():
            rt.state.ctrl[CTRL_DEADLINE_NS : CTRL_DEADLINE_NS + 1].fill_(1)
    return len(runtimes)


def _recording(fn, rec: dict[str, Any], path: str, router: Any):
    """``fn`` that writes the first exception it raises to the record, then re-raises."""

    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if rec.get("error") is None:
                rec.update(error=f"{type(e).__name__}: {e}", error_at=time.time())
                rec["report_replayed_steps"] = router.replayed_steps
                _write(path, rec)
            raise

    return call


def factory(config: dict[str, Any]):
    from mono_ext.engines.sglang.dispatch import router_of
    from mono_ext.engines.sglang.release import pending

    model = sys._getframe(1).f_locals.get("model")
    router = router_of(model)
    rec: dict[str, Any] = {"armed": False, "injected_at": None, "error": None}
    if router is None:
        rec["error_setup"] = "no mono_ext router on the model (flag off or refused)"
        _write(config["record"], rec)
        return lambda module, args, output: None
    original = _recording(router.after_forward, rec, config["record"], router)
    queue = pending()
    queue.release = _recording(queue.release, rec, config["record"], router)
    state = {"replays": 0}

    def after_forward(forward_batch, output, graph_runner):
        before = router.replayed_steps
        original(forward_batch, output, graph_runner)
        if not rec["armed"] and os.path.exists(config["arm"]):
            rec["armed"] = True
            rec["replays_before_arm"] = router.replayed_steps
            _write(config["record"], rec)
        if rec["armed"] and rec["injected_at"] is None and router.replayed_steps > before:
            state["replays"] += 1
            if state["replays"] == int(config["healthy_steps"]):
                rec.update(
                    injected_at=time.time(),
                    runtimes=_shrink_deadlines(router),
                    injected_after_replays=router.replayed_steps,
                    queued=router.queued,
                    released=router.released,
                )
                _write(config["record"], rec)

    router.after_forward = after_forward
    _write(config["record"], rec)
    return lambda module, args, output: None
