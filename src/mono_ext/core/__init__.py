"""Engine-neutral, backend-neutral core. Imports on a CPU-only machine without torch."""

from .backends import AUTO, BackendError, KernelBackend, select_backend
from .numerics import Breach, CheckTracker, compare, metrics
from .refusal import OFF_PREFIX, Refusal, Stage, agree
from .registry import PluginError, Registry, get_registry, reset_registry
from .settings import Settings, SettingsError, load_settings
from .spec import BuildKey, Deployment, ModelSpec, Step
from .views import (
    CacheTensorView,
    CacheView,
    ConfigView,
    LayerCacheView,
    LayerView,
    ModelView,
    PlaneView,
    StepView,
)

__all__ = [
    "AUTO",
    "BackendError",
    "Breach",
    "BuildKey",
    "CacheTensorView",
    "CacheView",
    "CheckTracker",
    "ConfigView",
    "Deployment",
    "KernelBackend",
    "LayerCacheView",
    "LayerView",
    "ModelSpec",
    "ModelView",
    "OFF_PREFIX",
    "PlaneView",
    "PluginError",
    "Refusal",
    "Registry",
    "Settings",
    "SettingsError",
    "Stage",
    "Step",
    "StepView",
    "agree",
    "compare",
    "get_registry",
    "load_settings",
    "metrics",
    "reset_registry",
    "select_backend",
]
