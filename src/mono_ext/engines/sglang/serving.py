"""One model's mono_ext deployment on one SGLang rank: three refusal stages, build, driver.

Shared by both ways SGLang reaches mono_ext (the 0.5.17 hooks in :mod:`.plugin` and the
0.5.23 kernel-plugin API in :mod:`.v0523`):

=========  ================================  ===========================================
stage      when                              what is checked (every reason, ranks agree)
=========  ================================  ===========================================
config     before the weights load           the spec's config refusals, the backend's,
                                             SGLang settings (:func:`.views.engine_reasons`)
model      after load                        every plane bound in place (:mod:`.binding`),
                                             its format derived from the module
                                             (:func:`.views.plane_view`), against the
                                             spec; then every width is built
caches     once the pools exist (0.5.17:     GDN states / KV buffers bound in place
           after the attention backends;     against the spec
           0.5.23: the first routed step)
=========  ================================  ===========================================

A stage that refuses turns mono_ext off for the whole model on every rank and logs one line
naming every reason (``mono_ext off: [stage] ...``). An unexpected error inside a stage is a
reason too (never an exception on one rank while its peers wait in the agreement).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ...core.backends import (
    BackendError,
    KernelBackend,
    load_target,
    select_backend,
    served_widths,
)
from ...core.refusal import Refusal, Stage, agree
from ...core.registry import PluginError, get_registry
from ...core.settings import Settings, SettingsError, load_settings
from ...core.spec import Deployment, ModelSpec
from ...core.views import ConfigView
from .binding import CacheBinding, ModelBinding, bind_caches, bind_model
from .flags import Monokernel
from .views import (
    LAYOUTS,
    build_extra,
    cache_view,
    config_view,
    engine_reasons,
    features_of,
    model_view,
    state_dtype_reasons,
)

__all__ = ["Serving", "FAMILY_PACKING", "SERVING_ATTR"]

log = logging.getLogger("mono_ext.sglang")

#: Where the :class:`Serving` of a deployment is kept: on the ``ModelRunner`` (0.5.17) or on
#: the model object (0.5.23, whose spec callbacks get only the model).
SERVING_ATTR = "_mono_ext_serving"

#: How SGLang holds in_proj_qkvz per model family (checked again per module at the model stage).
FAMILY_PACKING = {"qwen3_next": "interleaved", "qwen3_5_moe": "contiguous"}


def _family(cfg: ConfigView) -> str | None:
    from ...models.qwen3_next.configs import family

    try:
        return family(dict(cfg.hf_config))
    except ValueError:
        return None


def _guarded(stage: Stage, fn: Callable[[], list[str]]) -> list[str]:
    try:
        return fn()
    except Exception as exc:  # one rank's surprise must still reach the agreement
        log.exception("mono_ext: error during the %s stage", stage.value)
        return [f"internal error in the {stage.value} stage: {type(exc).__name__}: {exc}"]


class Serving:
    """mono_ext for one loaded model on one rank. ``active`` is True only after every stage
    accepted; ``router`` (set by the installer) routes steps once active."""

    def __init__(
        self,
        flags: Monokernel,
        *,
        group: Any = None,
        tp_size: int = 1,
        tp_rank: int = 0,
        engine_version: str = "",
        settings: Settings | None = None,
        announce: bool = True,
    ) -> None:
        self.flags = flags
        self.announce = announce  # log "mono_ext off: ..." (False where the engine raises it)
        self.group = group  # CPU process group of the TP ranks (None: one process)
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.engine_version = engine_version
        self._settings = settings
        self.refusal: Refusal | None = None  # the stage that turned mono_ext off
        self.stage: Stage | None = None  # last stage accepted
        self.spec: ModelSpec | Any = None
        self.backend: KernelBackend | None = None
        self.builder: Any = None
        self.cfg: ConfigView | None = None
        self.model: ModelBinding | None = None
        self.caches: CacheBinding | None = None
        self.launches: dict[int, Any] = {}
        self.build_extra: dict[str, Any] = {}
        self.driver: Any = None
        self._hf_config: Any = None
        self._server_args: Any = None
        self.settings: Settings = settings or Settings()

    # -- common ------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.refusal is None and self.stage is Stage.CACHES

    @property
    def off(self) -> bool:
        return self.refusal is not None

    def _decide(self, stage: Stage, reasons: list[str]) -> Refusal:
        refusal = agree(Refusal.of(stage, reasons), self.group)
        if refusal:
            self.refusal = refusal
            if self.announce and self.tp_rank == 0:
                log.warning("%s", refusal.message())
        else:
            self.stage = stage
        return refusal

    @property
    def dims(self) -> Any:
        return self.spec.dims

    # -- stage 1: config ---------------------------------------------------------------
    def accept_config(
        self,
        hf_config: Any,
        server_args: Any,
        *,
        dtype: Any,
        quantization: str | None,
    ) -> Refusal:
        """Everything knowable before the weights load; on acceptance the spec is deployed."""
        self._hf_config, self._server_args = hf_config, server_args  # for the build's extra
        return self._decide(
            Stage.CONFIG,
            _guarded(
                Stage.CONFIG,
                lambda: self._config_reasons(hf_config, server_args, dtype, quantization),
            ),
        )

    def _config_reasons(self, hf_config, server_args, dtype, quantization) -> list[str]:
        reasons: list[str] = []
        if self._settings is None:
            try:
                self.settings = load_settings()
            except SettingsError as exc:
                reasons.append(str(exc))
        try:
            registry = get_registry()
        except PluginError as exc:
            return [*reasons, str(exc)]
        cfg = config_view(
            hf_config,
            tp_size=self.tp_size,
            dtype=dtype,
            quantization=quantization,
            features=features_of(server_args),
            engine_version=self.engine_version,
        )
        self.cfg = cfg
        spec_cls = registry.spec_for(cfg)
        if spec_cls is None:
            return [
                *reasons,
                f"no mono_ext model spec serves {list(cfg.architectures)} "
                f"(specs: {', '.join(sorted(registry.specs)) or 'none'})",
            ]
        spec = spec_cls()
        self.spec = spec
        accept = getattr(spec, "accept_config", spec.refuse_config)
        reasons += list(accept(cfg).reasons)
        reasons += engine_reasons(server_args, check_mode=self.settings.check)
        try:
            self.backend = select_backend(self.flags.backend, registry.backends)
            self.builder = load_target(self.backend.target)
        except (BackendError, ImportError, AttributeError) as exc:
            return [*reasons, f"kernel backend {self.flags.backend!r}: {exc}"]
        layouts = {**LAYOUTS, "qkvz_packing": FAMILY_PACKING.get(_family(cfg), "unknown")}
        refusals = getattr(self.builder, "refusals", None)
        if refusals is not None:
            reasons += list(refusals(cfg, layouts))
        widths, none_why = served_widths(
            spec.widths, self.builder, self.backend.name, self.settings.serve_unmeasured
        )
        reasons += [none_why] if none_why else []
        if not reasons:
            spec.deploy(
                Deployment(
                    backend=self.backend.name,
                    dtype=cfg.dtype,
                    tp_size=cfg.tp_size,
                    widths=widths,
                    layouts=layouts,
                    # plane formats the backend reads (its builder's ``plane_formats``; bf16
                    # when it declares none): the model stage refuses any other format by
                    # name, and an accepted one goes into every build key
                    plane_formats=frozenset(getattr(self.builder, "plane_formats", ("bf16",))),
                )
            )
        return reasons

    # -- stage 2: model ----------------------------------------------------------------
    def accept_model(self, model: Any) -> Refusal:
        """Bind every plane in place, check it against the spec, then build every width."""
        if self.off:
            return self.refusal
        refusal = self._decide(
            Stage.MODEL, _guarded(Stage.MODEL, lambda: self._model_reasons(model))
        )
        if refusal:
            return refusal
        # Building is per rank and may fail on one: agree on that too before anyone routes.
        return self._decide(Stage.MODEL, _guarded(Stage.MODEL, self._build))

    def _model_reasons(self, model: Any) -> list[str]:
        bound = bind_model(model, num_experts=self.dims.experts)
        self.model = bound
        reasons = list(bound.reasons)
        if "forward" in getattr(model, "__dict__", {}):
            reasons.append("the model's forward is already replaced on this instance")
        view = model_view(bound, tp_size=self.tp_size, tp_rank=self.tp_rank)
        reasons += list(self.spec.refuse_model(view).reasons)
        return reasons

    def _device(self) -> Any:
        return self.model.text.embed_tokens.weight.device

    def _build(self) -> list[str]:
        from ...models.qwen3_next.launches import BuildContext

        planes = {b.index: b.planes for b in self.model.layers}
        self.build_extra = build_extra(self._hf_config, self._server_args, planes)
        ctx = BuildContext(
            text_config=self.cfg.hf_config,
            device=str(self._device()),
            null_slot=None,  # SGLang pads with slot -1
            tp_rank=self.tp_rank,
            extra=self.build_extra,
        )
        self.launches = {key.width: self.builder(key, ctx) for key in self.spec.build_keys()}
        return []

    # -- stage 3: caches ---------------------------------------------------------------
    def accept_caches(self, req_to_token_pool: Any, token_to_kv_pool: Any) -> Refusal:
        """Bind the GDN states and KV buffers in place, check them, and make the driver."""
        if self.off:
            return self.refusal
        return self._decide(
            Stage.CACHES,
            _guarded(
                Stage.CACHES, lambda: self._cache_reasons(req_to_token_pool, token_to_kv_pool)
            ),
        )

    def kinds(self) -> dict[int, str]:
        return {b.index: b.kind for b in self.model.layers}

    def _cache_reasons(self, req_to_token_pool: Any, token_to_kv_pool: Any) -> list[str]:
        caches = bind_caches(req_to_token_pool, token_to_kv_pool, self.kinds())
        reasons = list(caches.reasons)
        reasons += list(self.spec.refuse_caches(cache_view(caches, self.kinds())).reasons)
        reasons += state_dtype_reasons(caches, self.build_extra)
        if reasons:
            return reasons
        self.caches = caches
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.driver = self._make_driver()
        return []

    def _make_driver(self) -> Any:
        import torch

        from ...models.qwen3_next.decode import DecodeDriver
        from ...models.qwen3_next.launches import BoundLayer
        from .check import SglangStockLayers

        layers = [
            BoundLayer(
                index=b.index,
                kind=b.kind,
                weights=b.planes,
                conv_state=self.caches.conv.get(b.index),
                ssm_state=self.caches.ssm.get(b.index),
            )
            for b in self.model.layers
        ]
        stock = None
        if self.settings.check:
            stock = SglangStockLayers(self.model.text.layers, tp_size=self.tp_size)
        return DecodeDriver(
            layers,
            self.launches,
            self.dims,
            dtype=getattr(torch, self.cfg.dtype),
            device=self._device(),
            null_slot=None,
            numerics=self.spec.NUMERICS,
            stock=stock,
        )

    def recheck_caches(self) -> None:
        """Raise when SGLang reallocated a bound GDN state since the cache stage."""
        now = bind_caches(self.req_to_token_pool, self.token_to_kv_pool, self.kinds())
        if not self.caches.same_as(now):
            raise RuntimeError(
                "mono_ext: SGLang reallocated a GDN state after it was bound; the launches would "
                "read and write freed memory"
            )
