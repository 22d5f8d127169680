"""One model's mono_ext deployment on one SGLang rank: the lifecycle of
:mod:`mono_ext.serve.lifecycle` over SGLang's objects.

Shared by both ways SGLang reaches mono_ext (the 0.5.17 hooks in :mod:`.plugin` and the
0.5.23 kernel-plugin API in :mod:`.native_api`). What each stage reads here:

=========  ================================  ===========================================
stage      when                              SGLang's objects, as views
=========  ================================  ===========================================
config     before the weights load           the HF config and server arguments
                                             (:func:`.views.config_view`; SGLang settings:
                                             :func:`.views.engine_reasons`)
model      after load                        every plane bound in place (:mod:`.qwen3_next`),
                                             its format derived from the module
                                             (:func:`.views.plane_view`); then every width
                                             is built
caches     once the pools exist (0.5.17:     GDN states / KV buffers bound in place
           after the attention backends;
           0.5.23: the first routed step)
=========  ================================  ===========================================
"""

from __future__ import annotations

import logging
from typing import Any

from ...core.refusal import Refusal
from ...core.settings import Settings
from ...core.views import ConfigView
from ...serve.lifecycle import Lifecycle, device_name
from .flags import Monokernel
from .qwen3_next import CacheBinding, ModelBinding, bind_caches, bind_model
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


class Serving(Lifecycle):
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
        super().__init__(
            flags.backend,
            group=group,
            tp_size=tp_size,
            tp_rank=tp_rank,
            settings=settings,
            announce=announce,  # False where the engine raises the refusal itself
            engine="sglang",
            device=device_name(),
        )
        self.flags = flags
        self.engine_version = engine_version
        self.model: ModelBinding | None = None
        self.caches: CacheBinding | None = None
        self.build_extra: dict[str, Any] = {}
        self._hf_config: Any = None
        self._server_args: Any = None

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

        def cfg() -> ConfigView:
            return config_view(
                hf_config,
                tp_size=self.tp_size,
                dtype=dtype,
                quantization=quantization,
                features=features_of(server_args),
                engine_version=self.engine_version,
            )

        def layouts(cfg: ConfigView) -> dict[str, str]:
            return {**LAYOUTS, "qkvz_packing": FAMILY_PACKING.get(_family(cfg), "unknown")}

        return self.config_stage(
            cfg,
            layouts,
            lambda _cfg, settings, _b: engine_reasons(server_args, check_mode=settings.check),
        )

    # -- stage 2: model ----------------------------------------------------------------
    def accept_model(self, model: Any) -> Refusal:
        """Bind every plane in place, check it against the spec, then build every width."""
        return self.model_stage(lambda: self._bind_model(model), self._build_context)

    def _bind_model(self, model: Any) -> tuple[Any, list[str]]:
        bound = bind_model(model, num_experts=self.dims.experts)
        self.model = bound
        reasons = list(bound.reasons)
        if "forward" in getattr(model, "__dict__", {}):
            reasons.append("the model's forward is already replaced on this instance")
        return model_view(bound, tp_size=self.tp_size, tp_rank=self.tp_rank), reasons

    def _device(self) -> Any:
        return self.model.text.embed_tokens.weight.device

    def _build_context(self) -> Any:
        from ...core.spec import BuildContext

        planes = {b.index: b.planes for b in self.model.layers}
        self.build_extra = build_extra(self._hf_config, self._server_args, planes)
        return BuildContext(
            text_config=self.cfg.hf_config,
            device=str(self._device()),
            null_slot=None,  # SGLang pads with slot -1
            tp_rank=self.tp_rank,
            extra=self.build_extra,
        )

    # -- stage 3: caches ---------------------------------------------------------------
    def accept_caches(self, req_to_token_pool: Any, token_to_kv_pool: Any) -> Refusal:
        """Bind the GDN states and KV buffers in place, check them, and make the driver."""
        return self.caches_stage(
            lambda: self._bind_caches(req_to_token_pool, token_to_kv_pool), self._make_driver
        )

    def kinds(self) -> dict[int, str]:
        return {b.index: b.kind for b in self.model.layers}

    def _bind_caches(self, req_to_token_pool: Any, token_to_kv_pool: Any) -> tuple[Any, list]:
        caches = bind_caches(req_to_token_pool, token_to_kv_pool, self.kinds())
        reasons = [*caches.reasons, *state_dtype_reasons(caches, self.build_extra)]
        self.caches = caches
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        return cache_view(caches, self.kinds()), reasons

    def _make_driver(self) -> Any:
        import torch

        from ...models.qwen3_next.driver import DecodeDriver
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
