"""The model-spec contract every supported model family implements.

A spec decides, from views only, whether mono_ext may serve a deployment
(three refusal stages) and, once per step on the host, whether that step runs
the fused launches (``plan``). It knows nothing of engines or kernel backends.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from .refusal import Refusal
from .views import CacheView, ConfigView, ModelView, StepView

__all__ = ["BuildContext", "BuildKey", "Step", "Deployment", "ModelSpec", "DEFAULT_WIDTHS"]

DEFAULT_WIDTHS: tuple[int, ...] = tuple(range(1, 17))


@dataclass(frozen=True)
class BuildKey:
    """Everything a compiled K1/K2 pair depends on, besides kernel sources.

    ``layouts`` holds the layout tags of the engine's tensors (conv-state order, qkvz
    packing, ...), sorted so equal deployments give equal keys. ``formats`` holds the matrix planes whose
    format (``core.views.PLANE_FORMATS``) is not bf16, as sorted (plane, format) pairs: a
    build that reads fp8 or mxfp4 planes is a different build from the bf16 one, and an
    all-bf16 build has none (so its digest does not depend on formats at all).
    """

    spec: str
    backend: str
    width: int
    dtype: str
    tp_size: int
    layouts: tuple[tuple[str, str], ...] = ()
    formats: tuple[tuple[str, str], ...] = ()

    def digest(self, sources: str = "") -> str:
        """A stable sha256 hex digest; ``sources`` is where a backend mixes in its kernel sources."""
        fields = asdict(self)
        if not self.formats:
            del fields["formats"]  # all-bf16 builds keep the digests they always had
        blob = json.dumps(fields, sort_keys=True) + sources
        return hashlib.sha256(blob.encode()).hexdigest()

    def label(self) -> str:
        lay = ",".join(f"{k}={v}" for k, v in self.layouts)
        fmt = ",".join(f"{k}={v}" for k, v in self.formats)
        return (
            f"{self.spec}/{self.backend}/w{self.width}/{self.dtype}/tp{self.tp_size}"
            + (f"/{lay}" if lay else "")
            + (f"/formats:{fmt}" if fmt else "")
        )


@dataclass(frozen=True)
class BuildContext:
    """What a backend's builder may know besides the key: the model's text config, the device,
    the engine's padding convention and rank, and backend-specific extras."""

    text_config: Mapping[str, Any]  # HF-style text config
    device: str = "cpu"
    null_slot: int | None = None  # the engine's padding slot (vLLM 0.26: 0), or None
    tp_rank: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)  # backend-specific, e.g. peers


@dataclass(frozen=True)
class Step:
    """A decision to run the fused launches for one step."""

    width: int  # rows, each a single decode token
    key: BuildKey


@dataclass(frozen=True)
class Deployment:
    """Facts fixed once a deployment's config is accepted; plan() reads only these."""

    backend: str
    dtype: str
    tp_size: int
    widths: tuple[int, ...]
    layouts: Mapping[str, str] = field(default_factory=dict)
    # matrix plane -> format (core.views.PLANE_FORMATS), known once the model stage accepts;
    # bf16 planes may be left out
    formats: Mapping[str, str] = field(default_factory=dict)
    # the plane formats the deployed backend reads (its builder's ``plane_formats``)
    plane_formats: frozenset[str] = frozenset({"bf16"})


class ModelSpec(ABC):
    """One model family. Subclasses set the class attributes and the refusals.

    ``NUMERICS`` maps ``<launch>.<output>.<metric>`` (metric: ``cosine`` is a
    lower bound; ``rel_l2`` and ``max_abs`` are upper bounds) to thresholds.
    """

    name: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]
    NUMERICS: ClassVar[Mapping[str, float]]
    widths: ClassVar[tuple[int, ...]] = DEFAULT_WIDTHS

    def __init__(self) -> None:
        self.deployment: Deployment | None = None

    # -- which deployments ---------------------------------------------------
    def serves(self, cfg: ConfigView) -> bool:
        """True when the config names one of this spec's architectures."""
        return any(a in self.architectures for a in cfg.architectures)

    @abstractmethod
    def refuse_config(self, cfg: ConfigView) -> Refusal:
        """Every reason this config cannot be served (before weights load)."""

    @abstractmethod
    def refuse_model(self, model: ModelView) -> Refusal:
        """Every reason the loaded modules cannot be read in place."""

    @abstractmethod
    def refuse_caches(self, caches: CacheView) -> Refusal:
        """Every reason the bound caches cannot be read/written in place."""

    # -- per step --------------------------------------------------------------
    def deploy(self, deployment: Deployment) -> None:
        unknown = set(deployment.widths) - set(self.widths)
        if unknown:
            raise ValueError(f"{self.name}: widths {sorted(unknown)} are not served by this spec")
        self.deployment = deployment

    def build_key(self, width: int) -> BuildKey:
        d = self._deployed()
        return BuildKey(
            spec=self.name,
            backend=d.backend,
            width=width,
            dtype=d.dtype,
            tp_size=d.tp_size,
            layouts=tuple(sorted(d.layouts.items())),
            formats=tuple(sorted((p, f) for p, f in d.formats.items() if f != "bf16")),
        )

    def build_keys(self) -> list[BuildKey]:
        """Every key this deployment compiles at start-up (one per served width)."""
        return [self.build_key(w) for w in self._deployed().widths]

    def plan(self, step: StepView) -> Step | None:
        """The fused launches for a pure decode step of a served width, else None.

        Pure host facts only, so capture and replay of a graph agree.
        """
        d = self._deployed()
        if step.mode != "decode" or step.tokens_per_row != 1 or step.rows not in d.widths:
            return None
        return Step(width=step.rows, key=self.build_key(step.rows))

    def _deployed(self) -> Deployment:
        if self.deployment is None:
            raise RuntimeError(f"{self.name}: plan() before deploy(); accept the config first")
        return self.deployment
