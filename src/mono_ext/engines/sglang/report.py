"""What mono_ext did in an SGLang scheduler (0.5.17 and 0.5.23), for tests and operators.

``Engine.collective_rpc("mono_ext_report", path=DIR)`` makes every scheduler process write
``DIR/mono_ext_report.tp<rank>.json`` (:func:`runner_report` of its model runner): SGLang's
RPC calls a scheduler method by name, and the around-hook of :mod:`.hooks` (registered by
:mod:`.plugin` on 0.5.17, by :mod:`.native_api` on 0.5.23) puts this one on the scheduler the
first time it is asked for. ``collective_rpc`` returns nothing, hence the files.

Nothing here imports SGLang or torch.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ...core.views import SCALE_SUFFIX

__all__ = ["REPORT_RPC", "runner_report", "write_report"]

#: The method name to pass to ``Engine.collective_rpc``.
REPORT_RPC = "mono_ext_report"


def _failstop(driver: Any) -> dict[str, Any] | None:
    """The FailStop of a backend whose launches share one runtime (the triton backend)."""
    for launches in getattr(driver, "launches", {}).values():
        runtime = getattr(launches, "runtime", None)
        fs = getattr(runtime, "failstop", None)
        if fs is not None:
            return {
                "state": str(fs.state),
                "steps": getattr(runtime, "steps", None),
                "last_seen_step": fs.last_seen_step,
                "first_failed_step": fs.first_failed_step,
            }
    return None


def _serving_of(runner: Any) -> Any:
    """The deployment: on the runner (0.5.17's hooks) or on its model (0.5.23's spec)."""
    from .serving import SERVING_ATTR

    for holder in (runner, getattr(runner, "model", None)):
        serving = getattr(holder, "__dict__", {}).get(SERVING_ATTR)
        if serving is not None:
            return serving
    return None


def _tp_rank(scheduler: Any) -> int:
    """0.5.17's scheduler has ``tp_rank``; 0.5.23 publishes it in its runtime context."""
    rank = getattr(scheduler, "tp_rank", None)
    if rank is None:
        try:
            from sglang.srt.runtime_context import get_parallel

            rank = get_parallel().tp_rank
        except Exception:  # no published context: one process
            rank = 0
    return int(rank or 0)


def runner_report(runner: Any) -> dict[str, Any]:
    """One rank's mono_ext state: ``state`` None (flag off), "off" (refused), "on" or
    "pending" (stages left); refusals; served widths; the plan recorded per captured decode
    graph; routed, replayed (by graph batch size), released and stock decode steps."""
    from .dispatch import router_of

    serving = _serving_of(runner)
    out: dict[str, Any] = {"pid": os.getpid(), "state": None}
    if serving is None:
        return out
    refusal = serving.refusal
    spec = serving.spec
    deployment = getattr(spec, "deployment", None)
    launches = serving.launches
    out.update(
        state="off" if serving.off else "on" if serving.active else "pending",
        backend=getattr(serving.backend, "name", None),
        stage=None if serving.stage is None else serving.stage.value,
        refusals=[] if refusal is None else list(refusal.reasons),
        refused_at=None if refusal is None else refusal.stage.value,
        widths=None if deployment is None else list(deployment.widths),
        plane_formats=dict(getattr(spec, "plane_formats", None) or {}),
        # quantized planes' formats in the build keys, and the engine scales bound for them
        key_formats=dict(next(iter(launches.values())).key.formats) if launches else {},
        scales_bound=sum(
            k.endswith(SCALE_SUFFIX) for b in getattr(serving.model, "layers", ()) for k in b.planes
        ),
        build_extra={k: str(v) for k, v in serving.build_extra.items()},
    )
    router = router_of(getattr(runner, "model", None))
    if router is not None:
        out.update(
            captured={
                str(bs): None if step is None else step.width
                for bs, step in sorted(router.captured.items())
            },
            routed=router.routed_steps,
            replayed={str(bs): n for bs, n in sorted(router.replayed.items())},
            replayed_steps=router.replayed_steps,
            queued=router.queued,
            released=router.released,
            stock_decode=router.stock_decode,
            **router.host.report(),
            failstop=_failstop(serving.driver),
        )
    return out


def write_report(scheduler: Any, path: str) -> None:
    """The RPC: write this scheduler's :func:`runner_report` under the folder ``path``."""
    rank = _tp_rank(scheduler)
    report = runner_report(scheduler.tp_worker.model_runner)
    report["tp_rank"] = rank
    with open(os.path.join(path, f"{REPORT_RPC}.tp{rank}.json"), "w") as f:
        json.dump(report, f, default=str)
