"""mono_ext through SGLang 0.5.23's native kernel-plugin API.

SGLang 0.5.23 (``sglang.kernels.plugin_kernels``) defines the contract and runs the checks,
the build and the dispatch itself (``sglang.srt.kernel_plugins.<hw>.binding``); a plugin
registers *specs* lazily, as ``"module:attribute"`` paths per HF architecture, from a
``sglang.srt.plugins`` entry point. What this module maps, from our ModelSpec and registry:

=====================  ==========================================  ==========================
0.5.23 contract        NVIDIA ``MegakernelSpec``                   AMD ``MonoSpec``
                       (``--enable-nvidia-megakernel``)            (``--enable-amd-monokernel``)
=====================  ==========================================  ==========================
entry point            ``nvidia_megakernel`` (required name)       same entry point
registration           ``nvidia.spec.register(architecture, path)``  ``amd.spec.register(backend=
                                                                   "amd", ...)``
requirements           isas of the backend, TP sizes, dtypes,      per-ISA DeviceLimits (widths,
                       whole decode graphs or none                 TP sizes), dtypes
accepted features      none (every refused-by-default feature      none
                       stays refused)
numerics               TOLERANCE, our NUMERICS                     TOLERANCE, NUMERICS as
                                                                   bounds (rel_l2 -> rel)
widths                 ``max_rows`` = 16; build returns the        ``widths`` per ISA
                       widths it built
config checks          ``config_disable_reasons``: the spec's      same
                       config refusals, the backend's, SGLang
                       settings (:class:`.serving.Serving`)
model checks           ``model_disable_reasons``: planes bound     same (with ``copies``)
                       in place against the spec
plan / forward         :class:`Built` (``plan`` from host facts;   ``forward(plan, ...)``
                       ``forward`` runs the step through the       (:class:`BuiltMono`)
                       shared :class:`.dispatch.Router`)
FailStop               the after-hook on ``ModelRunner.forward``   same
                       (:mod:`.hooks`), as on 0.5.17
=====================  ==========================================  ==========================

The cache stage (GDN states from ``MambaPool``, KV buffers) runs at the first routed
forward, when the pools exist; a refusal there raises, as SGLang's own checks do.

FailStop. 0.5.23's binding has no call after a step: ``_Dispatch`` (``sglang.srt.
kernel_plugins.nvidia.binding``) wraps ``model.forward`` only, so a decode-graph replay
never reaches the plugin. Every decode step still comes back to Python in
``ModelRunner.forward`` before it is sampled (``ModelRunner._forward_raw`` returns
``decode_cuda_graph_runner.execute``'s logits as ``ModelRunnerOutput(can_run_graph=True)``;
``TpModelWorker.forward_batch_generation`` samples after it returns), exactly as on 0.5.17.
So :func:`register` also puts 0.5.17's after-hook on ``ModelRunner.forward`` (and the report
RPC) through ``HookRegistry``, which 0.5.23's ``load_plugins`` applies right after running
this entry point. The build makes the :class:`.dispatch.Router` and keeps it on the model
(:func:`.dispatch.attach`); ``plan`` records each decision (:meth:`.dispatch.Router.note`:
the plan of every captured decode graph, or the eager step), ``forward`` runs it, and the
hook releases each routed step, eager or replayed, or raises
:class:`~mono_ext.runtime.failstop.FailStopError` before SGLang samples it. The model stage
refuses a process where the hook is not applied.

The spec objects are built on first access (module ``__getattr__``), so importing this
module on an older SGLang costs nothing and :func:`register` does nothing there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from . import hooks as _hooks
from .flags import Monokernel

__all__ = [
    "API_VERSION",
    "ENTRY_POINT",
    "ARCHITECTURES",
    "ISAS",
    "Built",
    "BuiltMono",
    "failstop_reasons",
    "megakernel_spec",
    "mono_spec",
    "register",
]

log = logging.getLogger("mono_ext.sglang")

#: The MEGAKERNEL_API_VERSION / MONOKERNEL_API_VERSION this module is written against.
API_VERSION = 1
ENTRY_POINT = "nvidia_megakernel"
#: HF architectures SGLang serves with the modules :mod:`.qwen3_next` reads.
ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5MoeForConditionalGeneration")
#: Backend -> the device ISAs its kernels are built and verified for (0.5.23 matches these
#: against the GPU it finds). ``reference`` is the fp32 CPU backend, listed for testing only.
ISAS: dict[str, tuple[str, ...]] = {
    "triton": ("sm_90",),
    "flydsl": ("gfx950",),
    "reference": ("sm_90",),
}
_AMD_BACKENDS = ("flydsl",)


def _spec_class() -> Any:
    from ...models.qwen3_next.spec import Qwen3NextSpec

    return Qwen3NextSpec


def _server_args() -> Any:
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:  # the loader also runs without a published server (tools, tests)
        return SimpleNamespace()


def _tp() -> tuple[int, int]:
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        return int(p.tp_size), int(p.tp_rank)
    except Exception:
        return 1, 0


def _resolved_dtype(cfg: Any, hf_config: Any) -> str:
    dtype = str(getattr(cfg, "dtype", "auto") or "auto")
    if dtype != "auto":
        return dtype
    text = getattr(hf_config, "text_config", None) or hf_config
    return str(getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or "bfloat16")


def _serving(backend: str, *, tp_size: int, tp_rank: int) -> Any:
    from .serving import Serving

    # group=None: SGLang itself gathers every rank's reasons and raises on all of them.
    return Serving(Monokernel(backend), tp_size=tp_size, tp_rank=tp_rank, announce=False)


# -- the checks ---------------------------------------------------------------------------
def _config_reasons(backend: str, cfg: Any, hf_config: Any) -> list[str]:
    serving = _serving(backend, tp_size=int(getattr(cfg, "tp_size", 1) or 1), tp_rank=0)
    refusal = serving.accept_config(
        hf_config,
        cfg,
        dtype=_resolved_dtype(cfg, hf_config),
        quantization=getattr(cfg, "quantization", None),
    )
    return list(refusal.reasons)


def failstop_reasons() -> list[str]:
    """Why FailStop would not see this process's steps: a hook of it (``ModelRunner.forward``,
    the batch result, the result processor) is not applied (e.g. ``load_plugins`` did not run
    this entry point here), so a step whose device wait gave up could return tokens."""
    return [
        f"mono_ext's FailStop hook on {target} is not applied in this process "
        f"(pid {os.getpid()}): a decode step whose device wait gave up could return tokens"
        for target in _hooks.failstop_hooks_applied()
    ]


def _model_reasons(backend: str, model: Any, hf_config: Any) -> list[str]:
    tp_size, tp_rank = _tp()
    serving = _serving(backend, tp_size=tp_size, tp_rank=tp_rank)
    sa = _server_args()
    weight = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
    refusal = serving.accept_config(
        hf_config,
        sa,
        dtype=weight.dtype if weight is not None else _resolved_dtype(sa, hf_config),
        quantization=getattr(sa, "quantization", None),
    )
    if not refusal:
        refusal = serving.accept_model(model)
    from .serving import SERVING_ATTR

    model.__dict__[SERVING_ATTR] = serving
    return list(refusal.reasons) + failstop_reasons()


# -- the built object -------------------------------------------------------------------------
class Built:
    """What a spec's build returns (0.5.23's ``BuiltMegakernel`` / ``BuiltMonokernels``).

    ``router`` (made here, kept on the model for the FailStop hook) records every plan and
    runs the routed steps; the cache stage runs at the first routed forward."""

    def __init__(
        self, serving: Any, widths: tuple[int, ...], model: Any, *, step_type: Any = None
    ) -> None:
        from .dispatch import Router, attach

        self.serving = serving
        self.widths = widths
        self.draft_sampler = None
        self._step_type = step_type  # nvidia Step; None for the AMD contract
        # SGLang's dispatch calls the model's own forward for stock steps, not the router
        self.router = Router(serving, None)
        attach(model, self.router)
        self._caches = False  # the cache stage accepted

    def summary(self) -> str:
        s = self.serving
        lay = ", ".join(f"{k}={v}" for k, v in sorted(s.spec.deployment.layouts.items()))
        return f"mono_ext {s.spec.name} on backend {s.backend.name} ({lay})"

    def _plan(self, forward_batch: Any, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        """The core step for this forward, or None (stock)."""
        from .dispatch import plan_step

        step = plan_step(self.serving.spec, forward_batch, args, dict(kwargs))
        return None if step is None or step.width not in self.widths else step

    def plan(self, input_ids: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        step = self._plan(forward_batch, args, kwargs)
        # SGLang calls plan once per model forward, capture or eager: the FailStop record
        self.router.note(forward_batch, step)
        return None if step is None else self._step_type(mode="decode", rows=step.width)

    def _ready(self, original: Any = None) -> Any:
        """The router, after the cache stage (at the first routed forward: the pools exist)."""
        if not self._caches:
            from sglang.srt.model_executor.forward_context import get_attn_backend

            backend = get_attn_backend()
            kv_pool = getattr(backend, "token_to_kv_pool", None)
            if kv_pool is None:
                kv_pool = backend.full_attn_backend.token_to_kv_pool
            refusal = self.serving.accept_caches(backend.req_to_token_pool, kv_pool)
            if refusal:
                raise ValueError(refusal.message())
            self.router.attn_backend = backend
            self._caches = True
        if original is not None:
            self.router.original = original
        return self.router

    def forward(self, step: Any, original: Any, input_ids, positions, forward_batch, *a, **k):
        from ...core.spec import Step as CoreStep

        router = self._ready(original)
        core = CoreStep(width=int(step.rows), key=self.serving.spec.build_key(int(step.rows)))
        return router.run(core, input_ids, positions, forward_batch)


class BuiltMono(Built):
    """The AMD contract: ``forward(plan, *args, **kwargs)`` (the plan holds the graph key),
    called for served keys only (no ``plan`` call): the FailStop record is made here."""

    def forward(self, plan: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        from ...core.spec import Step as CoreStep

        input_ids, positions, forward_batch = _model_args(args, kwargs)
        router = self._ready()
        rows = int(plan.key.rows)
        core = CoreStep(width=rows, key=self.serving.spec.build_key(rows))
        router.note(forward_batch, core)
        return router.run(core, input_ids, positions, forward_batch)


def _model_args(args: tuple, kwargs: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    names = ("input_ids", "positions", "forward_batch")
    vals = list(args[:3]) + [kwargs[n] for n in names[len(args[:3]) :]]
    return vals[0], vals[1], vals[2]


def _build(backend: str, model: Any, hf_config: Any, ctx: Any, *, amd: bool = False) -> Built:
    from .serving import SERVING_ATTR

    serving = model.__dict__.get(SERVING_ATTR)
    if serving is None or serving.off or serving.stage is None:
        raise ValueError("mono_ext: build before model_disable_reasons accepted the model")
    widths = tuple(w for w in ctx.widths if w in serving.launches)
    if amd:
        return BuiltMono(serving, widths, model)
    from sglang.kernels.plugin_kernels.nvidia.spec import Step

    return Built(serving, widths, model, step_type=Step)


# -- spec objects ---------------------------------------------------------------------------
def megakernel_spec(backend: str = "auto") -> Any:
    """Our ModelSpec as 0.5.23's NVIDIA ``MegakernelSpec`` for ``backend``."""
    from sglang.kernels.plugin_kernels.nvidia import spec as nv

    from ...models.qwen3_next.spec import LIMITS

    cls = _spec_class()
    names = _nvidia_backends() if backend == "auto" else (backend,)
    isas = frozenset(isa for b in names for isa in ISAS.get(b, ()) if not isa.startswith("gfx"))
    return nv.MegakernelSpec(
        name=f"mono_ext.{cls.name}",
        requires=nv.Requirements(
            isas=isas,
            tp_sizes=frozenset(LIMITS["tp_sizes"]),
            dtypes=frozenset(LIMITS["dtypes"]),
            decode_graph_backends=frozenset({"full", "disabled"}),
        ),
        features=frozenset(),
        numerics=nv.Numerics(kind=nv.NumericsKind.TOLERANCE, tolerances=dict(cls.NUMERICS)),
        max_rows=max(cls.widths),
        build=lambda model, hf, ctx: _build(backend, model, hf, ctx),
        api_version=API_VERSION,
        model_disable_reasons=lambda model, hf: _model_reasons(backend, model, hf),
        config_disable_reasons=lambda cfg, hf: _config_reasons(backend, cfg, hf),
    )


def _amd_bounds(numerics: Mapping[str, float]) -> dict[str, float]:
    # 0.5.23's AMD metrics are max_abs, rel and cosine; our rel_l2 is its rel.
    return {n.replace(".rel_l2", ".rel"): v for n, v in numerics.items()}


def mono_spec(backend: str = "flydsl") -> Any:
    """Our ModelSpec as 0.5.23's AMD ``MonoSpec`` for ``backend``."""
    from sglang.kernels.plugin_kernels.amd import spec as amd

    from ...models.qwen3_next.spec import LIMITS

    cls = _spec_class()
    limits = amd.DeviceLimits(
        widths=tuple(cls.widths), tp_sizes=tuple(LIMITS["tp_sizes"]), resident_blocks=0
    )
    return amd.MonoSpec(
        name=f"mono_ext.{cls.name}",
        devices={isa: limits for isa in ISAS.get(backend, ())},
        features=frozenset(),
        requires=amd.Requirements(dtypes=frozenset(LIMITS["dtypes"])),
        numerics=amd.Numerics(kind=amd.NumericsKind.TOLERANCE, bounds=_amd_bounds(cls.NUMERICS)),
        model_disable_reasons=lambda model, hf, copies: _model_reasons(backend, model, hf),
        build=lambda model, hf, ctx: _build(backend, model, hf, ctx, amd=True),
        api_version=API_VERSION,
        config_disable_reasons=lambda cfg, hf: _config_reasons(backend, cfg, hf),
    )


def _nvidia_backends() -> tuple[str, ...]:
    """Registered, auto-selectable backends with an NVIDIA ISA."""
    from ...core.registry import get_registry

    backends = get_registry().backends
    return tuple(
        n
        for n, b in backends.items()
        if b.auto_priority > 0 and any(i.startswith("sm_") for i in ISAS.get(n, ()))
    )


_LAZY = {"MEGAKERNEL_SPEC": megakernel_spec, "MONO_SPEC": mono_spec}


def __getattr__(name: str) -> Any:
    """``MEGAKERNEL_SPEC`` / ``MONO_SPEC``: built on first access, then kept."""
    if name in _LAZY:
        value = _LAZY[name]()
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_registered = False


def register() -> None:
    """The ``nvidia_megakernel`` entry point: register our specs with 0.5.23's registries.
    Does nothing on an SGLang without the API (0.5.17: see :mod:`.plugin`)."""
    global _registered
    if _registered:
        return
    try:
        from sglang.kernels.plugin_kernels.nvidia import spec as nv
    except ImportError:
        return
    for arch in ARCHITECTURES:
        nv.register(architecture=arch, path=f"{__name__}:MEGAKERNEL_SPEC")
    # FailStop after every step and the report RPC, as on 0.5.17 (see the module doc)
    _hooks.register(_hooks.RUNTIME_HOOKS)
    try:
        from sglang.kernels.plugin_kernels.amd import spec as amd

        from ...core.registry import get_registry

        if any(b in get_registry().backends for b in _AMD_BACKENDS):
            for arch in ARCHITECTURES:
                amd.register(backend=amd.BACKEND, architecture=arch, path=f"{__name__}:MONO_SPEC")
    except ImportError:  # pragma: no cover - 0.5.23 ships both
        pass
    _registered = True
