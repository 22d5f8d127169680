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
                       ``forward`` runs the step through the
                       shared :class:`.dispatch.Router`)
=====================  ==========================================  ==========================

The cache stage (GDN states from ``MambaPool``, KV buffers) runs at the first routed
forward, when the pools exist; a refusal there raises, as SGLang's own checks do.

The spec objects are built on first access (module ``__getattr__``), so importing this
module on an older SGLang costs nothing and :func:`register` does nothing there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from .flags import Monokernel

__all__ = [
    "API_VERSION",
    "ENTRY_POINT",
    "ARCHITECTURES",
    "ISAS",
    "Built",
    "megakernel_spec",
    "mono_spec",
    "register",
]

log = logging.getLogger("mono_ext.sglang")

#: The MEGAKERNEL_API_VERSION / MONOKERNEL_API_VERSION this module is written against.
API_VERSION = 1
ENTRY_POINT = "nvidia_megakernel"
#: HF architectures SGLang serves with the modules :mod:`.binding` reads.
ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5MoeForConditionalGeneration")
#: Backend -> the device ISAs its kernels are built and verified for (0.5.23 matches these
#: against the GPU it finds). ``reference`` is the fp32 CPU backend, listed for testing only.
ISAS: dict[str, tuple[str, ...]] = {
    "triton": ("sm_90",),
    "flydsl": ("gfx950",),
    "reference": ("sm_90",),
}
_AMD_BACKENDS = ("flydsl",)
_SERVING_ATTR = "_mono_ext_serving"


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
    reasons = list(refusal.reasons)
    chosen = serving.backend
    if chosen is not None and not chosen.testing_only:
        reasons.append(
            f"backend {chosen.name}: through SGLang 0.5.23's kernel-plugin API mono_ext does not "
            "yet check FailStop after decode-graph replays (0.5.17's --monokernel does), so a "
            "failed step could return tokens"
        )
    return reasons


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
    model.__dict__[_SERVING_ATTR] = serving
    return list(refusal.reasons)


# -- the built object -------------------------------------------------------------------------
class Built:
    """What a spec's build returns (0.5.23's ``BuiltMegakernel`` / ``BuiltMonokernels``)."""

    def __init__(self, serving: Any, widths: tuple[int, ...], *, step_type: Any = None) -> None:
        self.serving = serving
        self.widths = widths
        self.draft_sampler = None
        self._step_type = step_type  # nvidia Step; None for the AMD contract
        self.router: Any = None

    def summary(self) -> str:
        s = self.serving
        lay = ", ".join(f"{k}={v}" for k, v in sorted(s.spec.deployment.layouts.items()))
        return f"mono_ext {s.spec.name} on backend {s.backend.name} ({lay})"

    def plan(self, input_ids: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        from .dispatch import plan_step

        step = plan_step(self.serving.spec, forward_batch, args, kwargs)
        if step is None or step.width not in self.widths:
            return None
        return self._step_type(mode="decode", rows=step.width)

    def _router(self, original: Any) -> Any:
        if self.router is None:
            from sglang.srt.model_executor.forward_context import get_attn_backend

            from .dispatch import Router

            backend = get_attn_backend()
            kv_pool = getattr(backend, "token_to_kv_pool", None)
            if kv_pool is None:
                kv_pool = backend.full_attn_backend.token_to_kv_pool
            refusal = self.serving.accept_caches(backend.req_to_token_pool, kv_pool)
            if refusal:
                raise ValueError(refusal.message())
            self.router = Router(self.serving, original, attn_backend=backend)
        return self.router

    def forward(self, step: Any, original: Any, input_ids, positions, forward_batch, *a, **k):
        from ...core.spec import Step as CoreStep

        router = self._router(original)
        core = CoreStep(width=int(step.rows), key=self.serving.spec.build_key(int(step.rows)))
        return router.run(core, input_ids, positions, forward_batch)


class BuiltMono(Built):
    """The AMD contract: ``forward(plan, *args, **kwargs)`` (the plan holds the graph key)."""

    def forward(self, plan: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        from ...core.spec import Step as CoreStep

        input_ids, positions, forward_batch = _model_args(args, kwargs)
        router = self._router(None)
        rows = int(plan.key.rows)
        core = CoreStep(width=rows, key=self.serving.spec.build_key(rows))
        return router.run(core, input_ids, positions, forward_batch)


def _model_args(args: tuple, kwargs: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    names = ("input_ids", "positions", "forward_batch")
    vals = list(args[:3]) + [kwargs[n] for n in names[len(args[:3]) :]]
    return vals[0], vals[1], vals[2]


def _build(backend: str, model: Any, hf_config: Any, ctx: Any, *, amd: bool = False) -> Built:
    serving = model.__dict__.get(_SERVING_ATTR)
    if serving is None or serving.off or serving.stage is None:
        raise ValueError("mono_ext: build before model_disable_reasons accepted the model")
    widths = tuple(w for w in ctx.widths if w in serving.launches)
    if amd:
        return BuiltMono(serving, widths)
    from sglang.kernels.plugin_kernels.nvidia.spec import Step

    return Built(serving, widths, step_type=Step)


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
    try:
        from sglang.kernels.plugin_kernels.amd import spec as amd

        from ...core.registry import get_registry

        if any(b in get_registry().backends for b in _AMD_BACKENDS):
            for arch in ARCHITECTURES:
                amd.register(backend=amd.BACKEND, architecture=arch, path=f"{__name__}:MONO_SPEC")
    except ImportError:  # pragma: no cover - 0.5.23 ships both
        pass
    _registered = True
