"""The plugin registry: model specs and kernel backends found through entry points.

Order of work (as in pluggy's own examples): add the hook specs, load every
entry point of group ``mono_ext`` (ours are declared in pyproject.toml like any
third party's), then collect. Errors name the distribution that caused them.
"""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .backends import KernelBackend
from .spec import ModelSpec
from .views import ConfigView

__all__ = ["PluginError", "Registry", "get_registry", "reset_registry", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "mono_ext"


class PluginError(RuntimeError):
    """A mono_ext plugin failed to load or clashes with another."""


def _dist_label(ep: md.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "an unknown distribution"


@dataclass
class Registry:
    specs: dict[str, type[ModelSpec]] = field(default_factory=dict)
    backends: dict[str, KernelBackend] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)  # "spec:NAME"/"backend:NAME" -> dist

    def spec_for(self, cfg: ConfigView) -> type[ModelSpec] | None:
        """The spec serving ``cfg``'s architecture, or None."""
        for cls in self.specs.values():
            if any(a in cls.architectures for a in cfg.architectures):
                return cls
        return None


def _add(reg: Registry, kind: str, name: str, obj: Any, origin: str) -> None:
    table = reg.specs if kind == "spec" else reg.backends
    key = f"{kind}:{name}"
    if name in table:
        raise PluginError(
            f"mono_ext {kind} {name!r} is provided twice: by {reg.origins[key]} and by {origin}; "
            "uninstall one of them"
        )
    table[name] = obj
    reg.origins[key] = origin


def build_registry(entry_points: list[md.EntryPoint] | None = None) -> Registry:
    """Load plugins from ``entry_points`` (default: every installed ``mono_ext`` entry point)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    eps = list(md.entry_points(group=ENTRY_POINT_GROUP)) if entry_points is None else entry_points
    origin_of: dict[int, str] = {}
    for ep in eps:
        origin = f"entry point {ep.name!r} of {_dist_label(ep)}"
        try:
            plugin = ep.load()
        except Exception as exc:
            raise PluginError(
                f"mono_ext plugin {origin} failed to import ({ep.value}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        try:
            pm.register(plugin, name=f"{ep.name}@{_dist_label(ep)}")
        except ValueError as exc:
            raise PluginError(f"mono_ext plugin {origin} registered twice: {exc}") from exc
        origin_of[id(plugin)] = origin
    try:
        pm.check_pending()  # a hookimpl with no matching spec is a plugin bug: say so now
    except pluggy.PluginValidationError as exc:
        origin = origin_of.get(id(exc.plugin), str(exc.plugin))
        raise PluginError(f"mono_ext plugin {origin}: {exc}") from exc

    reg = Registry()
    for impl in pm.hook.mono_ext_model_specs.get_hookimpls():
        origin = origin_of.get(id(impl.plugin), impl.plugin_name)
        for cls in impl.function() or []:
            if not (isinstance(cls, type) and issubclass(cls, ModelSpec)):
                raise PluginError(f"{origin} returned {cls!r}, not a ModelSpec subclass")
            _add(reg, "spec", cls.name, cls, origin)
    for impl in pm.hook.mono_ext_kernel_backends.get_hookimpls():
        origin = origin_of.get(id(impl.plugin), impl.plugin_name)
        for backend in impl.function() or []:
            if not isinstance(backend, KernelBackend):
                raise PluginError(f"{origin} returned {backend!r}, not a KernelBackend")
            _add(reg, "backend", backend.name, backend, origin)
    return reg


_REGISTRY: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = build_registry()
    return _REGISTRY


def reset_registry() -> None:
    """Forget the cached registry (tests install plugins at run time)."""
    global _REGISTRY
    _REGISTRY = None
