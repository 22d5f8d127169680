"""``--monokernel`` / ``--monokernel-backend`` for SGLang releases without a kernel-plugin API.

SGLang 0.5.17's ``ServerArgs`` is a fixed dataclass: a plugin cannot add a field to it. The
plugin adds the two flags to the parser (so ``--help`` lists them), takes their values out of
the parsed namespace (``python -m sglang.launch_server``) or out of ``Engine(...)``'s keyword
arguments, validates them in the launching process, and carries the result to the scheduler
and TP worker processes twice: recorded on the ``ServerArgs`` object (:data:`ATTR`, pickled
with it to every scheduler process) and in one environment variable, :data:`ENV`, which
child processes inherit when SGLang spawns them (for code that rebuilds a ``ServerArgs``).
Workers read them back with :func:`of`.

=====================================  =============================================
how it was started                     what happens
=====================================  =============================================
no flag                                :data:`ENV` is unset; mono_ext does nothing
``--monokernel``                       on, backend ``auto``
``--monokernel-backend NAME``          on, backend NAME (implies ``--monokernel``)
``Engine(monokernel=True,              same, for the offline engine (its ``ServerArgs``
monokernel_backend=NAME)``             takes the two arguments); a later ``Engine`` in
                                       the same process carries only its own flags
an unknown or unusable backend         one line naming it, exit status 2 (CLI) or
                                       :class:`FlagError` (``Engine``)
=====================================  =============================================

This module imports nothing of SGLang or torch; the backend check imports the registry only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ENV",
    "FLAG",
    "BACKEND_FLAG",
    "ENGINE_KWARGS",
    "FlagError",
    "Monokernel",
    "add_arguments",
    "from_values",
    "current",
    "export",
    "restore",
    "attach",
    "of",
]

#: The variable that carries the flags to SGLang's worker processes: the backend name.
ENV = "MONO_EXT_SGLANG_MONOKERNEL"
#: The flags are also recorded on the ``ServerArgs`` object they came with (pickled with it
#: to the scheduler processes); an object without the record defers to :data:`ENV`.
ATTR = "_mono_ext_monokernel"
FLAG = "--monokernel"
BACKEND_FLAG = "--monokernel-backend"
#: ``Engine(...)`` keyword arguments (ServerArgs field names would clash with a future SGLang).
ENGINE_KWARGS = ("monokernel", "monokernel_backend")

_HELP_ON = (
    "mono_ext: run each pure-decode step of 1-16 rows as two fused launches per decoder layer "
    "(K1, K2) on the model's own weights and caches; every other step, and any model or "
    "setting mono_ext does not serve (reasons logged), runs SGLang's forward. "
    "Backend: auto."
)


class FlagError(ValueError):
    """A malformed mono_ext flag, or a backend that cannot run here. ``str()`` is one line."""


@dataclass(frozen=True)
class Monokernel:
    """The validated flags: mono_ext is on with ``backend`` (``auto`` or a backend name)."""

    backend: str


def _backend_names() -> list[str]:
    from ...core import AUTO, get_registry

    return [AUTO, *sorted(get_registry().backends)]


def add_arguments(parser: Any) -> None:
    """Add the two flags to SGLang's argparse parser (idempotent)."""
    if any(FLAG in getattr(a, "option_strings", ()) for a in parser._actions):
        return
    group = parser.add_argument_group("mono_ext", "fused K1/K2 decode launches (mono_ext plugin)")
    group.add_argument(FLAG, action="store_true", default=None, help=_HELP_ON)
    try:
        names = ", ".join(_backend_names())
    except Exception as exc:  # a broken third-party plugin must not break --help
        names = f"unknown ({type(exc).__name__}: {exc})"
    group.add_argument(
        BACKEND_FLAG,
        default=None,
        metavar="NAME",
        help=f"mono_ext kernel backend: {names} (implies {FLAG}; default auto)",
    )


def from_values(monokernel: Any, backend: Any, *, check_backend: bool = True) -> Monokernel | None:
    """The validated flags from the parsed values (None: mono_ext is off).

    ``check_backend`` picks the backend now (``core.backends.select_backend``), so that an
    unknown name or one that cannot run on this machine stops the launch in one line.
    """
    if monokernel not in (None, True, False):
        raise FlagError(f"mono_ext: monokernel={monokernel!r} is not a boolean")
    if backend is not None:
        if not isinstance(backend, str) or not backend.strip():
            raise FlagError(f"mono_ext: {BACKEND_FLAG} needs a backend name, got {backend!r}")
        if monokernel is False:
            raise FlagError(
                f"mono_ext: monokernel=False contradicts monokernel_backend={backend!r}"
            )
    if not monokernel and backend is None:
        return None
    from ...core import AUTO

    name = (backend or AUTO).strip()
    if check_backend:
        from ...core import BackendError, PluginError, get_registry, select_backend

        try:
            select_backend(name, get_registry().backends)
        except (BackendError, PluginError) as exc:
            raise FlagError(f"mono_ext: {exc}") from None
    return Monokernel(backend=name)


def current(environ: Mapping[str, str] | None = None) -> Monokernel | None:
    """The flags this process was started with (None: mono_ext is off). Never raises for a
    missing variable; a malformed one raises :class:`FlagError`."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV)
    if raw is None:
        return None
    name = raw.strip()
    if not name:
        raise FlagError(f"mono_ext: {ENV}={raw!r} names no backend")
    return Monokernel(backend=name)


def export(flags: Monokernel | None, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Put ``flags`` into :data:`ENV` for child processes (unset when off); returns the
    previous value so a caller can restore it."""
    env = os.environ if environ is None else environ
    previous = env.get(ENV)
    if flags is None:
        env.pop(ENV, None)
    else:
        env[ENV] = flags.backend
    return previous


def restore(previous: str | None, environ: MutableMapping[str, str] | None = None) -> None:
    env = os.environ if environ is None else environ
    if previous is None:
        env.pop(ENV, None)
    else:
        env[ENV] = previous


def attach(server_args: Any, flags: Monokernel | None) -> None:
    """Record the flags on a ``ServerArgs`` (an underscore attribute: SGLang keeps its fields
    read-only after resolution, private attributes are allowed)."""
    object.__setattr__(server_args, ATTR, flags)


def of(server_args: Any, environ: Mapping[str, str] | None = None) -> Monokernel | None:
    """The flags of the deployment ``server_args`` describes (its record, else :data:`ENV`)."""
    if server_args is not None and ATTR in getattr(server_args, "__dict__", {}):
        return server_args.__dict__[ATTR]
    return current(environ)
