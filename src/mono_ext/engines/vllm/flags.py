"""``--monokernel-backend``: the CLI flag, the ``LLM(...)`` / ``EngineArgs`` option, and how it
reaches every process.

vLLM 0.26 has no CLI hook for plugins, so :func:`install` wraps four ``EngineArgs`` members in
the processes that parse arguments (never anything that runs a step):

- ``add_cli_args``: adds the ``mono-ext`` argument group (``vllm serve --help=mono-ext``);
- ``from_cli_args`` and ``__init__`` (``EngineArgs`` and ``AsyncEngineArgs``): take the value
  (``--monokernel-backend X``, ``LLM(..., monokernel_backend=X)``) into ``additional_config``;
- ``create_engine_config``: when ``additional_config["monokernel_backend"]`` is set (by the
  above or given directly), resolves it to one usable backend (a bad value stops start-up
  with one line) and sets ``model_class_overrides`` to mono_ext's replacement classes, which
  vLLM registers in every process that resolves a model class.

Without the flag these wrappers return what vLLM's own members return, untouched: the
``VllmConfig`` (and so the compile-cache hash), the model registry and the model classes are
vLLM's. ``LLM(..., monokernel_backend=X)`` needs vLLM's plugins loaded in the calling process
first (the first ``EngineArgs``/``LLM`` of a process loads them; before that, vLLM's dataclass
rejects the keyword); ``additional_config={"monokernel_backend": X}`` works everywhere.
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Mapping
from typing import Any

from ...core.backends import AUTO, BackendError, KernelBackend, select_backend
from ...core.registry import get_registry
from .version import version_problem

__all__ = [
    "KEY",
    "OPTION",
    "MODEL_CLASSES",
    "FlagError",
    "requested",
    "resolve",
    "add_flag",
    "install",
    "HELP",
]

log = logging.getLogger("mono_ext.vllm")

_MODEL = "mono_ext.engines.vllm.model"

#: vLLM architecture -> mono_ext's replacement class (same name, subclass of vLLM's own): what
#: the flag puts into ``model_class_overrides``.
MODEL_CLASSES: dict[str, str] = {
    "Qwen3NextForCausalLM": f"{_MODEL}:MonoQwen3NextForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": f"{_MODEL}:MonoQwen3_5MoeForConditionalGeneration",
}

KEY = "monokernel_backend"  # the additional_config key every process reads
OPTION = "--monokernel-backend"
GROUP = "mono-ext"  # argparse group title: ``--help=mono-ext`` (vLLM lowers and maps _ to -)
_MARK = "__mono_ext_wrapped__"

HELP = (
    "Run every pure-decode step of 1-16 rows of a supported hybrid Gated-DeltaNet + MoE model "
    "(Qwen3-Next, Qwen3.5-MoE) as two fused launches per decoder layer (mono_ext); every "
    "other step runs vLLM's own forward. 'auto' picks the fastest backend usable on this "
    "machine; 'triton': NVIDIA Hopper (sm_90); 'reference': exact fp32 torch, for CPU testing "
    "only (slow, eager). A model mono_ext does not serve runs vLLM's own forward (logged); a "
    "deployment mono_ext refuses logs 'mono_ext off: <every reason>' and runs stock. Reaches "
    "every process as additional_config['monokernel_backend']."
)


class FlagError(ValueError):
    """A --monokernel-backend value that cannot be used (malformed, unknown, unavailable).

    ``detail`` is the reason alone (what argparse prints after the option's name)."""

    def __init__(self, detail: str, value: Any = None) -> None:
        self.detail = detail
        super().__init__(f"mono_ext: {OPTION} {value!r}: {detail}")


def choices() -> tuple[str, ...]:
    return (AUTO, *sorted(get_registry().backends))


def requested(additional_config: Any) -> Any:
    """The raw flag value in a ``VllmConfig.additional_config`` (None when absent)."""
    if isinstance(additional_config, Mapping):
        return additional_config.get(KEY)
    return None


def resolve(value: Any) -> KernelBackend:
    """The backend a flag value names, or FlagError with one line saying why none."""
    if not isinstance(value, str) or not value or value != value.strip():
        raise FlagError(f"malformed value: give one of {', '.join(choices())}", value)
    problem = version_problem()
    if problem is not None:
        raise FlagError(problem, value)
    try:
        return select_backend(value, get_registry().backends)
    except BackendError as exc:
        raise FlagError(str(exc), value) from None


def _argparse_type(value: str) -> str:
    try:
        return resolve(value).name
    except FlagError as exc:
        raise argparse.ArgumentTypeError(f"mono_ext: {exc.detail}") from None


def add_flag(parser: Any) -> Any:
    """Add the mono-ext group to an argparse parser (idempotent)."""
    if OPTION in getattr(parser, "_option_string_actions", {}):
        return parser
    group = parser.add_argument_group(
        GROUP, "Fused K1/K2 decode launches for hybrid GDN + MoE models (mono_ext plugin)."
    )
    group.add_argument(
        OPTION,
        dest=KEY,
        default=None,
        type=_argparse_type,
        metavar="{" + ",".join(choices()) + "}",
        help=HELP,
    )
    return parser


def _set_requested(engine_args: Any, value: Any) -> None:
    extra = dict(engine_args.additional_config or {})
    if KEY in extra and extra[KEY] != value:
        raise FlagError(
            f"given twice with different values ({extra[KEY]!r} in additional_config, "
            f"{value!r} as the option)",
            value,
        )
    extra[KEY] = value
    engine_args.additional_config = extra


def _activate(engine_args: Any, create: Any, args: tuple, kwargs: dict) -> Any:
    """create_engine_config with the flag on: one backend, the replacement classes, a log line."""
    value = requested(engine_args.additional_config)
    backend = resolve(value)
    engine_args.additional_config = {**engine_args.additional_config, KEY: backend.name}
    overrides = dict(engine_args.model_class_overrides or {})
    theirs = {a for a, t in MODEL_CLASSES.items() if overrides.get(a, t) != t}
    overrides.update({a: t for a, t in MODEL_CLASSES.items() if a not in theirs})
    engine_args.model_class_overrides = overrides
    config = create(engine_args, *args, **kwargs)
    archs = list(config.model_config.architectures)
    served = [a for a in archs if a in MODEL_CLASSES]
    if not served:
        log.warning(
            "mono_ext off: [config] %s %s given, but no mono_ext model class serves %s "
            "(served: %s); vLLM runs its own forward",
            OPTION,
            value,
            archs,
            ", ".join(sorted(MODEL_CLASSES)),
        )
    elif set(served) & theirs:
        log.warning(
            "mono_ext off: [config] model_class_overrides already replaces %s with %s; "
            "vLLM runs that class",
            served,
            {a: overrides[a] for a in served},
        )
    else:
        if backend.testing_only:
            log.warning(
                "mono_ext: backend %s is for testing only (%s)", backend.name, backend.description
            )
        picked = backend.name if value == backend.name else f"{value} -> {backend.name}"
        log.info(
            "mono_ext: %s %s for %s; config, model and cache checks run in each worker",
            OPTION,
            picked,
            served,
        )
    return config


def install() -> None:
    """Wrap the EngineArgs members above (idempotent; every process may call it)."""
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    if getattr(EngineArgs, _MARK, False):
        return

    add_orig = EngineArgs.add_cli_args

    @functools.wraps(add_orig)
    def add_cli_args(parser, *args, **kwargs):
        return add_flag(add_orig(parser, *args, **kwargs))

    from_orig = EngineArgs.from_cli_args.__func__

    @functools.wraps(from_orig)
    def from_cli_args(cls, args):
        engine_args = from_orig(cls, args)
        value = getattr(args, KEY, None)
        if value is not None:
            _set_requested(engine_args, value)
        return engine_args

    def wrap_init(init):
        @functools.wraps(init)
        def __init__(self, *args, monokernel_backend=None, **kwargs):
            init(self, *args, **kwargs)
            if monokernel_backend is not None:
                _set_requested(self, monokernel_backend)

        return __init__

    create_orig = EngineArgs.create_engine_config

    @functools.wraps(create_orig)
    def create_engine_config(self, *args, **kwargs):
        if requested(self.additional_config) is None:
            return create_orig(self, *args, **kwargs)
        return _activate(self, create_orig, args, kwargs)

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config
    for cls in (EngineArgs, AsyncEngineArgs):
        if "__init__" in vars(cls):
            cls.__init__ = wrap_init(vars(cls)["__init__"])
    setattr(EngineArgs, _MARK, True)
