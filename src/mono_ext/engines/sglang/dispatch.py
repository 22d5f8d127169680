"""The dispatching forward: pure-decode steps of a served width run K1/K2, all others stock.

:class:`Router` replaces the model object's ``forward`` on the instance (the class is left
alone). SGLang calls ``model.forward(input_ids, positions, forward_batch, ...)`` from its
eager runner and while capturing each decode CUDA graph, so a captured graph records
whichever path :meth:`Router.plan` chose for its batch size; replays repeat it. ``plan``
reads host facts only (mode, rows, tokens per row, which optional inputs are given).

A routed step, in SGLang's own objects (no math here):

1. ``text_model.embed_tokens(input_ids)``;
2. the engine-neutral driver (``models.qwen3_next.driver``) runs K1 -> attention -> K2 for
   every layer, the attention being the layer's own ``RadixAttention`` (it writes the KV
   cache), the GDN slots those SGLang's own kernels would read (:func:`.qwen3_next.step_slots`);
   then SGLang's own prefix-cache state tracking, where the step asks for it;
3. ``text_model.norm(hidden, residual)`` and ``logits_processor(..., lm_head, ...)``.

After the decode graphs are captured, :class:`CaptureCheck` (a ``capture_tail_hooks``
entry) refuses a deployment none of whose graphs routes to the kernels.

FailStop, without a host wait: SGLang samples a step's tokens after ``ModelRunner.forward``
returns (the logits come out of the forward, replayed graph or not). An after-hook on
``ModelRunner.forward`` (:mod:`.hooks`) calls :meth:`Router.after_forward`: an eager routed step
(its forward ran here: its health copy followed its launches, and ``end_step`` ran) gets its release
ticket; a decode step that replayed a graph without entering the router
(``ModelRunnerOutput.can_run_graph``: only a replay sets it for a decode step) is looked up by
the graph's padded batch size (``decode_cuda_graph_runner.bs``) in the plans recorded at capture
(:meth:`Router.note`), and a routed one gets ``end_step`` (once) and its ticket. Tickets are
released where SGLang awaits the batch's results (:mod:`.release`): a failed device wait raises
:class:`~mono_ext.runtime.failstop.FailStopError` there, before any of the step's tokens reach a
request. On SGLang 0.5.23 SGLang's own dispatch calls the spec's ``plan`` and ``forward``
instead of :meth:`Router.__call__` (:mod:`.native_api`); they feed the same router.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from ...core.spec import Step
from ...runtime.device import is_capturing
from ...runtime.host_timer import HostTimer
from ...runtime.release import Ticket
from . import release
from .qwen3_next import step_slots
from .views import step_view

__all__ = [
    "plan_step",
    "Router",
    "CaptureCheck",
    "install",
    "attach",
    "uninstall",
    "ROUTED_ATTR",
]

log = logging.getLogger("mono_ext.sglang")

#: Attribute on the model object holding its router (in ``__dict__``, not a submodule).
ROUTED_ATTR = "_mono_ext_router"

# Optional inputs of the served models' forwards that a routed step cannot honour.
_STOCK_IF_GIVEN = ("inputs_embeds", "input_embeds", "pp_proxy_tensors", "input_deepstack_embeds")


def _attn_backend(fallback: Any) -> Any:
    try:
        from sglang.srt.model_executor.forward_context import get_attn_backend, has_forward_context
    except ImportError:  # pragma: no cover - every supported SGLang has it
        return fallback
    return get_attn_backend() if has_forward_context() else fallback


def _is_decode(forward_batch: Any) -> bool:
    mode = getattr(forward_batch, "forward_mode", None)
    return mode is not None and bool(mode.is_decode())


def plan_step(spec: Any, forward_batch: Any, args: tuple, kwargs: dict) -> Step | None:
    """The spec's plan for a model forward's step; None (stock) when the call carries inputs a
    routed step cannot honour (extra positional arguments, embeddings, pipeline tensors)."""
    if args or kwargs.get("get_embedding"):
        return None
    if any(kwargs.get(k) is not None for k in _STOCK_IF_GIVEN):
        return None
    return spec.plan(step_view(forward_batch))


class Router:
    """Routes one model's steps. ``serving`` is a :class:`.serving.Serving` past its model
    stage; steps route once it is active (0.5.17: installed after the cache stage; 0.5.23:
    made at the build, the cache stage runs at the first routed forward)."""

    def __init__(self, serving: Any, original: Callable[..., Any], *, attn_backend: Any = None):
        self.serving = serving
        self.original = original
        self.attn_backend = attn_backend  # used when no forward context is set
        self.captured: dict[int, Step | None] = {}  # batch size -> plan chosen while capturing
        self.routed_steps = 0  # routed forwards that ran here (eager and captures)
        self.replayed_steps = 0  # replays of routed graphs, checked in after_forward
        self.replayed: dict[int, int] = {}  # those replays by the graph's (padded) batch size
        self.queued = 0  # routed steps handed to the release queue
        self.released = 0  # of those, steps whose tokens FailStop let go at SGLang's await
        self.stock_decode = 0  # decode steps (eager or replayed) that ran SGLang's forward
        # host time per hook: after_forward (every step; after_step: the driver's part of it),
        # release (at SGLang's token await)
        self.host = HostTimer(profile=serving.settings.profile_host)
        self.capturing: Callable[[], bool] = is_capturing
        # the last forward that entered the router, until after_forward takes it
        self._pending: tuple[str, Step | None] | None = None
        bound = serving.model
        self._outer, self._text = bound.outer, bound.text
        self._attn = {b.index: b.module.attn for b in bound.layers if b.kind == "full_attention"}
        self._gdn = [b.index for b in bound.layers if b.kind == "linear_attention"]

    # -- deciding ------------------------------------------------------------------------
    def plan(self, forward_batch: Any, *args: Any, **kwargs: Any) -> Step | None:
        """The fused step for this batch, or None for SGLang's forward (host facts only)."""
        if not self.serving.active:
            return None
        return plan_step(self.serving.spec, forward_batch, args, kwargs)

    def __call__(self, input_ids, positions, forward_batch, *args, **kwargs):
        step = self.plan(forward_batch, *args, **kwargs)
        self.note(forward_batch, step)
        if step is None:
            return self.original(input_ids, positions, forward_batch, *args, **kwargs)
        return self.run(step, input_ids, positions, forward_batch)

    def note(self, forward_batch: Any, step: Step | None) -> None:
        """Record a model forward that reached mono_ext's dispatch with plan ``step`` (None:
        SGLang's forward), for :meth:`after_forward`. While a decode CUDA graph is captured:
        the plan of its batch size, which every replay of it runs (a capture itself runs
        nothing; other graphs, e.g. prefill ones, are never routed); otherwise the step that
        this forward runs in Python."""
        if self.capturing():
            if _is_decode(forward_batch):
                self.captured[int(forward_batch.batch_size)] = step
            self._pending = None
        else:
            self._pending = ("stock" if step is None else "eager", step)

    def after_forward(self, forward_batch: Any, output: Any, graph_runner: Any) -> None:
        """After ``ModelRunner.forward`` and before SGLang samples the step (see the module
        doc): queues the routed step's release ticket; never waits for the device. Raises
        FailStopError where a device wait is already known to have given up."""
        driver = self.serving.driver
        if driver is None:
            self._pending = None
            return
        t = self.host.start()
        try:
            self._after_forward(driver, forward_batch, output, graph_runner)
        finally:
            self.host.stop("after_forward", t)

    def _after_forward(self, driver: Any, forward_batch: Any, output: Any, graph_runner: Any):
        pending, self._pending = self._pending, None
        # SGLang's own answer: a decode step with can_run_graph replayed a decode graph (an
        # eager decode returns False), whatever a forward outside ModelRunner.forward (a
        # warmup) left pending
        if not getattr(output, "can_run_graph", False) or not _is_decode(forward_batch):
            if pending is not None:
                kind, step = pending
                if kind == "eager":
                    self._queue(
                        self.host.call("after_step", driver.after_step, step, replayed=False)
                    )
                elif kind == "stock" and _is_decode(forward_batch):
                    self.stock_decode += 1
            return
        bs = getattr(graph_runner, "bs", None)
        step = None if bs is None else self.captured.get(int(bs))
        if step is None:
            self.stock_decode += 1
            return
        ticket = self.host.call("after_step", driver.after_step, step, replayed=True)
        if ticket is not None:
            self.replayed_steps += 1
            self.replayed[int(bs)] = self.replayed.get(int(bs), 0) + 1
            self._queue(ticket)

    def _queue(self, ticket: Ticket | None) -> None:
        if ticket is not None:
            self.queued += 1
            release.pending().add(ticket.then(self._released).timed(self.host))

    def _released(self) -> None:
        self.released += 1

    # -- running ---------------------------------------------------------------------------
    def positions_of(self, positions: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        """What the model's forward feeds its rotary embedding (M-RoPE: the 3-row positions)."""
        if getattr(self._outer, "is_mrope_enabled", False):
            mrope = getattr(forward_batch, "mrope_positions", None)
            if mrope is not None:
                return mrope
        return positions

    def run(self, step: Step, input_ids, positions, forward_batch) -> Any:
        from ...models.qwen3_next.driver import StepInputs

        rows = step.width
        driver = self.serving.driver
        backend = _attn_backend(self.attn_backend)
        capturing = self.capturing()
        if not capturing:
            self.serving.recheck_caches()
        with torch.no_grad():
            model_pos = self.positions_of(positions, forward_batch)
            # Text tokens of an M-RoPE model have equal rows; K1 takes the temporal one.
            pos = model_pos[0] if model_pos.dim() == 2 else model_pos
            slots = step_slots(
                forward_batch,
                rows,
                attn_backend=backend,
                req_to_token_pool=getattr(self.serving, "req_to_token_pool", None),
                capturing=capturing,
            )
            hidden = self._text.embed_tokens(input_ids)
            if driver.stock is not None:
                driver.stock.bind_step(forward_batch, model_pos)

            def attend(index: int, q, k, v):
                return self._attn[index](q, k, v, forward_batch)

            # SGLang keeps one slot table for every GDN layer (one MambaPool index per request).
            inputs = StepInputs(hidden=hidden, positions=pos, slots=dict.fromkeys(self._gdn, slots))
            hidden, residual = driver.run(step, inputs, attend)
            self._track_states(backend, forward_batch, slots)
            hidden, _ = self._text.norm(hidden, residual)
            self.routed_steps += 1
            return self._outer.logits_processor(
                input_ids, hidden, self._outer.lm_head, forward_batch
            )

    def _track_states(self, backend: Any, forward_batch: Any, slots: torch.Tensor) -> None:
        """What SGLang's GDN decode does after each layer's update when its prefix cache keeps
        mamba states (``--mamba-radix-cache-strategy extra_buffer``): copy the rows' states
        to their track slots. SGLang's own copy, called per GDN layer as its decode calls it
        (it fuses them into one launch at the last layer); a no-op without a track mask."""
        if getattr(forward_batch, "mamba_track_mask", None) is None:
            return
        linear = getattr(backend, "linear_attn_backend", None)
        track = getattr(linear, "_track_mamba_state_decode", None)
        if track is None:
            raise RuntimeError(
                "mono_ext: SGLang asks this decode step to keep GDN states for its prefix "
                "cache (mamba_track_mask), but its linear-attention backend "
                f"{type(linear).__name__} has no _track_mamba_state_decode; the cache would "
                "keep stale states"
            )
        caches = self.serving.caches
        for i in self._gdn:
            track(forward_batch, caches.conv[i], caches.ssm[i], slots, i)


def install(model: Any, router: Router) -> None:
    """Put the router in front of ``model.forward`` (an instance attribute; signature kept for
    SGLang's runners, which inspect the forward's parameters)."""
    original = router.original

    @functools.wraps(original)
    def forward(input_ids, positions, forward_batch, *args, **kwargs):
        return router(input_ids, positions, forward_batch, *args, **kwargs)

    attach(model, router)
    model.forward = forward


def attach(model: Any, router: Router) -> None:
    """Keep ``router`` on ``model`` for the after-hook on ``ModelRunner.forward`` and the
    report (what :func:`install` does besides replacing the forward; SGLang 0.5.23 replaces
    it itself)."""
    model.__dict__[ROUTED_ATTR] = router


def uninstall(model: Any) -> None:
    """Back to the class's forward: the model is stock again."""
    model.__dict__.pop("forward", None)
    model.__dict__.pop(ROUTED_ATTR, None)


def router_of(model: Any) -> Router | None:
    return getattr(model, "__dict__", {}).get(ROUTED_ATTR)


class CaptureCheck:
    """A ``ModelRunner.capture_tail_hooks`` entry: once every decode graph of the runner is
    captured, log which batch sizes run the kernels and refuse loudly when none does."""

    def __init__(self, router: Router, *, name: str = "mono_ext") -> None:
        self.router = router
        self.name = name
        self.done = False

    def __call__(self, runner: Any, out: Any, forward_batch: Any, num_tokens: int) -> None:
        if self.done:
            return
        wanted = set(getattr(runner, "capture_bs", ()) or ())
        captured = self.router.captured
        if not wanted or not wanted <= set(captured):
            return
        self.done = True
        routed = sorted(bs for bs, step in captured.items() if step is not None)
        if not routed:
            raise RuntimeError(
                f"{self.name}: none of the {len(captured)} captured decode graphs (batch sizes "
                f"{sorted(captured)}) runs the K1/K2 launches; decode would silently stay on "
                "SGLang's forward. Capture batch sizes within the served widths "
                f"{list(self.router.serving.spec.deployment.widths)} (--cuda-graph-bs) or "
                "turn --monokernel off"
            )
        log.info(
            "%s: decode graphs of batch sizes %s (%d of %d) run K1/K2 (%s); every other step "
            "runs SGLang's forward",
            self.name,
            routed,
            len(routed),
            len(captured),
            self.router.serving.backend.name,
        )
