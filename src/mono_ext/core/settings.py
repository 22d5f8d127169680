"""Run-time settings read from the environment.

Every variable is validated when read; a bad value raises :class:`SettingsError`
naming the variable, the value seen and what is accepted, so a typo in a
deployment stops the server at start-up instead of silently using a default.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Settings", "SettingsError", "load_settings", "ENV_VARS"]

#: name -> (default, one-line description); the README table is written from this.
ENV_VARS: dict[str, tuple[str, str]] = {
    "MONO_EXT_CHECK": (
        "0",
        "1 runs the engine's own layer code next to every launch and compares (eager only)",
    ),
    "MONO_EXT_DEADLINE_S": (
        "10",
        "seconds a device-side wait may spin before it gives up and FailStop trips",
    ),
    "MONO_EXT_AGREE_EVERY": (
        "16",
        "steps between TP-rank agreements on the health words",
    ),
    "MONO_EXT_SERVE_UNMEASURED": (
        "0",
        "1 serves widths a backend has not been measured faster than stock at (tests, benchmarks)",
    ),
    "MONO_EXT_PROFILE_HOST": (
        "0",
        "1 runs mono_ext's per-step hooks under cProfile; the engine report lists the slowest",
    ),
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class SettingsError(ValueError):
    """A MONO_EXT_* environment variable holds a value that cannot be used."""


@dataclass(frozen=True)
class Settings:
    check: bool = False
    deadline_s: float = 10.0
    agree_every: int = 16
    serve_unmeasured: bool = False
    profile_host: bool = False


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, ENV_VARS[name][0]).strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise SettingsError(f"{name}={env[name]!r} is not a switch: use 1/0 (or true/false, on/off)")


def _positive_float(env: Mapping[str, str], name: str, upper: float) -> float:
    raw = env.get(name, ENV_VARS[name][0]).strip()
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a number of seconds") from None
    if not math.isfinite(value) or not 0 < value <= upper:
        raise SettingsError(f"{name}={raw!r} is out of range: give seconds in (0, {upper:g}]")
    return value


def _positive_int(env: Mapping[str, str], name: str, upper: int) -> int:
    raw = env.get(name, ENV_VARS[name][0]).strip()
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a whole number") from None
    if not 1 <= value <= upper:
        raise SettingsError(f"{name}={raw!r} is out of range: give a whole number in [1, {upper}]")
    return value


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read and validate every MONO_EXT_* variable (``os.environ`` by default)."""
    env = os.environ if environ is None else environ
    return Settings(
        check=_flag(env, "MONO_EXT_CHECK"),
        # An hour is far past any sane step; a larger value is almost surely a unit mistake.
        deadline_s=_positive_float(env, "MONO_EXT_DEADLINE_S", upper=3600.0),
        agree_every=_positive_int(env, "MONO_EXT_AGREE_EVERY", upper=1_000_000),
        serve_unmeasured=_flag(env, "MONO_EXT_SERVE_UNMEASURED"),
        profile_host=_flag(env, "MONO_EXT_PROFILE_HOST"),
    )
