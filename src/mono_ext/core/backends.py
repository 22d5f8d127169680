"""Kernel backends as the core sees them: a name, where its code lives, whether it can run here.

A backend names provenance (``triton``, ``flydsl``, ``reference``); which
devices it runs on is what its ``probe`` answers. The core imports nothing of
a backend until it is picked: ``target`` is a lazy ``module:attr`` string.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KernelBackend",
    "BackendError",
    "select_backend",
    "load_target",
    "served_widths",
    "AUTO",
]

AUTO = "auto"


class BackendError(RuntimeError):
    """A named backend is unknown or cannot run on this machine."""


@dataclass(frozen=True)
class KernelBackend:
    name: str
    description: str
    target: str  # "module:attr" of the object that builds K1/K2 for a BuildKey
    probe: Callable[[], tuple[bool, str]]  # (usable here, why not / on what)
    auto_priority: int = 0  # auto picks the usable backend with the highest; <= 0: never auto
    testing_only: bool = False


def load_target(target: str) -> Any:
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise BackendError(f"backend target {target!r} is not 'module:attr'")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def select_backend(name: str, backends: Mapping[str, KernelBackend]) -> KernelBackend:
    """The backend to use for ``name`` (or ``auto``), or a BackendError saying why none.

    An explicitly named backend that cannot run here is an error, never a quiet
    switch to another one: the user asked for it by name.
    """
    if name == AUTO:
        tried = []
        for b in sorted(backends.values(), key=lambda b: -b.auto_priority):
            if b.auto_priority <= 0:
                continue
            ok, why = b.probe()
            if ok:
                return b
            tried.append(f"{b.name}: {why}")
        raise BackendError("no kernel backend can run here (" + "; ".join(tried or ["none"]) + ")")
    if name not in backends:
        raise BackendError(
            f"unknown kernel backend {name!r}; choose from {', '.join([AUTO, *sorted(backends)])}"
        )
    ok, why = backends[name].probe()
    if not ok:
        raise BackendError(f"kernel backend {name!r} cannot run here: {why}")
    return backends[name]


def served_widths(
    spec_widths: tuple[int, ...],
    builder: Any,
    backend: str,
    serve_unmeasured: bool,
    *,
    engine: str | None = None,
    device: str | None = None,
    quantization: str | None = None,
) -> tuple[tuple[int, ...], str | None]:
    """The widths a deployment routes to ``builder``: the spec's widths that the backend has
    been measured faster than ``engine``'s own decode step at on ``device`` with weights
    quantized by ``quantization`` (None: unquantized; the builder's ``measured_faster(engine,
    device, quantization)``, or its ``faster_widths`` for every engine, device and format),
    or every spec width under ``MONO_EXT_SERVE_UNMEASURED=1`` (tests and benchmarks). A builder
    with neither (the reference backend: CPU testing only) serves every width.
    Returns (widths, reason why none) so that a deployment with no width runs stock and says
    why, instead of making decode slower."""
    measured = getattr(builder, "measured_faster", None)
    faster = (
        measured(engine, device, quantization)[0]
        if measured is not None
        else getattr(builder, "faster_widths", None)
    )
    if faster is None or serve_unmeasured:
        return tuple(spec_widths), None
    widths = tuple(w for w in spec_widths if w in faster)
    if widths:
        return widths, None
    weights = f" ({quantization} weights)" if quantization is not None else ""
    where = f" with {engine} on {device or 'this machine'}{weights}" if measured is not None else ""
    return (), (
        f"kernel backend {backend!r} serves no width{where} yet: none has been measured faster "
        "than the engine's own decode step (docs/perf.md); MONO_EXT_SERVE_UNMEASURED=1 serves "
        "every width anyway (tests, benchmarks)"
    )


def served_source(
    builder: Any, engine: str | None, device: str | None, quantization: str | None = None
) -> str | None:
    """Where the widths ``builder`` serves by default for ``engine`` on ``device`` with
    ``quantization`` weights were measured (None: the builder records none)."""
    measured = getattr(builder, "measured_faster", None)
    return None if measured is None else measured(engine, device, quantization)[1]
