"""The one deployment lifecycle both engine adapters call: three refusal stages, the builds,
the driver.

=========  ================================  ===========================================
stage      when (the adapter calls it)       what is decided (every reason, ranks agree)
=========  ================================  ===========================================
config     before the weights load           the model spec for the config, its config
                                             refusals, the engine's own (settings,
                                             features), the backend's; the served widths;
                                             on acceptance the spec is deployed
model      after load                        the engine's planes bound in place (the
                                             adapter's view), against the spec; then every
                                             build key is built, and the ranks agree on
                                             that too
caches     once the caches exist             the engine's caches bound in place, against
                                             the spec; then the adapter makes the driver
=========  ================================  ===========================================

Each stage is guarded: an exception on one rank becomes a reason of that rank
(``internal error in the <stage> stage: ...``), so its peers never wait in the agreement for a
rank that left it, and every rank refuses together with every reason. A refused deployment
logs one line on rank 0 (``mono_ext off: [stage] ...``) unless the engine raises it itself
(``announce=False``), and stays off for the whole model.

An adapter translates its engine's objects into the views and callables a stage takes, and
holds no stage logic of its own. This module imports neither torch nor an engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from ..core.backends import (
    BackendError,
    KernelBackend,
    load_target,
    select_backend,
    served_source,
    served_widths,
)
from ..core.refusal import Refusal, Stage, agree
from ..core.registry import PluginError, get_registry
from ..core.settings import Settings, SettingsError, load_settings
from ..core.spec import Deployment, ModelSpec
from ..core.views import CacheView, ConfigView, ModelView

__all__ = ["Lifecycle", "device_name", "guarded"]

log = logging.getLogger("mono_ext.serve")


def device_name() -> str | None:
    """The current accelerator's name as torch reports it (``NVIDIA H200``), or None."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def guarded(stage: Stage, fn: Callable[[], list[str]]) -> list[str]:
    """``fn()``'s reasons, or one reason naming the exception it raised (logged with its
    traceback): one rank's surprise must still reach the agreement."""
    try:
        return list(fn())
    except Exception as exc:
        log.exception("mono_ext: error during the %s stage", stage.value)
        return [f"internal error in the {stage.value} stage: {type(exc).__name__}: {exc}"]


class Lifecycle:
    """One model's mono_ext deployment on one rank (see the module doc).

    ``backend``: the name the user asked for (``auto`` or a backend's name; resolved in the
    config stage, a failure there is a reason) or an already resolved
    :class:`~mono_ext.core.backends.KernelBackend`. ``settings``: the settings in force, or
    None to load them in the config stage (a malformed value is then a reason).
    ``group``: the TP ranks' CPU process group (None: one process). ``engine`` and
    ``device`` (the device's name, None without one) pick the widths the backend serves by
    default (``core.backends.served_widths``).
    """

    def __init__(
        self,
        backend: str | KernelBackend,
        *,
        group: Any = None,
        tp_size: int = 1,
        tp_rank: int = 0,
        settings: Settings | None = None,
        announce: bool = True,
        engine: str | None = None,
        device: str | None = None,
    ) -> None:
        self.engine, self.device = engine, device
        self.requested_name = backend if isinstance(backend, str) else backend.name
        self.group = group
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.announce = announce
        self._settings_given = settings is not None
        self.settings: Settings = settings or Settings()
        self.refusal: Refusal | None = None  # the stage that turned mono_ext off
        self.stage: Stage | None = None  # last stage accepted
        self.spec: ModelSpec | Any = None
        self.backend: KernelBackend | None = backend if isinstance(backend, KernelBackend) else None
        self.builder: Any = None
        self.cfg: ConfigView | None = None
        self.layouts: dict[str, str] = {}
        self.launches: dict[int, Any] = {}
        self.driver: Any = None

    # -- state -------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.refusal is None and self.stage is Stage.CACHES

    @property
    def off(self) -> bool:
        return self.refusal is not None

    @property
    def dims(self) -> Any:
        return self.spec.dims

    def decide(self, stage: Stage, reasons: list[str]) -> Refusal:
        """The ranks' agreement on ``stage``: off for good on any reason of any rank."""
        refusal = agree(Refusal.of(stage, reasons), self.group)
        if refusal:
            self.refusal = refusal
            if self.announce and self.tp_rank == 0:
                log.warning("%s", refusal.message())
        else:
            self.stage = stage
        return refusal

    # -- stage 1: config ---------------------------------------------------------------
    def config_stage(
        self,
        cfg: Callable[[], ConfigView],
        layouts: Callable[[ConfigView], Mapping[str, str]],
        engine_reasons: Callable[[ConfigView, Settings, KernelBackend | None], list[str]],
    ) -> Refusal:
        """Everything knowable before the weights load: ``cfg()`` the engine's config as a
        view, ``layouts(cfg)`` its layout tags, ``engine_reasons(cfg, settings, backend)`` what
        the engine's own settings refuse (``backend``: None until the stage resolves it). On acceptance the spec is deployed.
        """
        return self.decide(
            Stage.CONFIG,
            guarded(Stage.CONFIG, lambda: self._config_reasons(cfg, layouts, engine_reasons)),
        )

    def _config_reasons(self, cfg_of, layouts_of, engine_reasons) -> list[str]:
        reasons: list[str] = []
        if not self._settings_given:
            try:
                self.settings = load_settings()
            except SettingsError as exc:
                reasons.append(str(exc))
        try:
            registry = get_registry()
        except PluginError as exc:
            return [*reasons, str(exc)]
        cfg = self.cfg = cfg_of()
        spec_cls = registry.spec_for(cfg)
        if spec_cls is None:
            return [
                *reasons,
                f"no mono_ext model spec serves {list(cfg.architectures)} "
                f"(specs: {', '.join(sorted(registry.specs)) or 'none'})",
            ]
        spec = self.spec = spec_cls()
        accept = getattr(spec, "accept_config", spec.refuse_config)
        reasons += list(accept(cfg).reasons)
        reasons += list(engine_reasons(cfg, self.settings, self.backend))
        try:
            if self.backend is None:
                self.backend = select_backend(self.requested_name, registry.backends)
            self.builder = load_target(self.backend.target)
        except (BackendError, ImportError, AttributeError) as exc:
            return [*reasons, f"kernel backend {self.requested_name!r}: {exc}"]
        self.layouts = dict(layouts_of(cfg))
        refusals = getattr(self.builder, "refusals", None)
        if refusals is not None:
            reasons += list(refusals(cfg, self.layouts))
        widths, none_why = served_widths(
            spec.widths,
            self.builder,
            self.backend.name,
            self.settings.serve_unmeasured,
            engine=self.engine,
            device=self.device,
            quantization=cfg.quantization,
        )
        reasons += [none_why] if none_why else []
        if not reasons:
            self._announce_widths(widths, cfg.quantization)
            spec.deploy(
                Deployment(
                    backend=self.backend.name,
                    dtype=cfg.dtype,
                    tp_size=cfg.tp_size,
                    widths=widths,
                    layouts=self.layouts,
                    # plane formats the backend reads (its builder's ``plane_formats``; bf16
                    # when it declares none): the model stage refuses any other format by
                    # name, and an accepted one goes into every build key
                    plane_formats=frozenset(getattr(self.builder, "plane_formats", ("bf16",))),
                )
            )
        return reasons

    def _announce_widths(self, widths: tuple[int, ...], quantization: str | None) -> None:
        if self.tp_rank != 0:
            return
        source = served_source(self.builder, self.engine, self.device, quantization)
        if self.settings.serve_unmeasured:
            why = "MONO_EXT_SERVE_UNMEASURED=1: every width, measured faster or not"
        elif source is not None:
            why = f"measured faster than {self.engine}'s own decode step: {source}"
        else:
            why = "the backend records no measurements"
        log.info(
            "mono_ext: backend %s serves widths %s on %s (%s)",
            self.backend.name,
            ",".join(map(str, widths)),
            self.device or "this machine",
            why,
        )

    # -- stage 2: model ----------------------------------------------------------------
    def model_stage(
        self,
        bind: Callable[[], tuple[ModelView, list[str]]],
        context: Callable[[], Any],
    ) -> Refusal:
        """``bind()`` binds the engine's planes in place: (the model's view, the binding's own
        reasons), checked against the spec; then ``context()`` (a
        ``core.spec.BuildContext``) and every build key is built. Ranks agree on both."""
        if self.off:
            return self.refusal

        def reasons() -> list[str]:
            view, bad = bind()
            return [*bad, *self.spec.refuse_model(view).reasons]

        refusal = self.decide(Stage.MODEL, guarded(Stage.MODEL, reasons))
        if refusal:
            return refusal

        def build() -> list[str]:
            ctx = context()
            self.launches = {key.width: self.builder(key, ctx) for key in self.spec.build_keys()}
            return []

        # building is per rank and may fail on one: agree on that too before anyone routes
        return self.decide(Stage.MODEL, guarded(Stage.MODEL, build))

    # -- stage 3: caches ---------------------------------------------------------------
    def caches_stage(
        self,
        bind: Callable[[], tuple[CacheView, list[str]]],
        driver: Callable[[], Any],
    ) -> Refusal:
        """``bind()`` binds the engine's caches in place: (their view, the binding's own
        reasons, e.g. a state dtype the launches were not built for), checked against the
        spec; then ``driver()`` makes the per-step driver (``self.driver``)."""
        if self.off:
            return self.refusal

        def reasons() -> list[str]:
            view, bad = bind()
            bad = [*bad, *self.spec.refuse_caches(view).reasons]
            if not bad:
                self.driver = driver()
            return bad

        return self.decide(Stage.CACHES, guarded(Stage.CACHES, reasons))
