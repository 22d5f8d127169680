"""mono_ext as an SGLang general plugin (entry point ``mono_ext`` in ``sglang.srt.plugins``).

SGLang calls :func:`register` through ``load_plugins()`` in the launcher, in ``Engine`` and in
every scheduler / TP worker process. On an SGLang with the native kernel-plugin API (0.5.23:
``sglang.kernels.plugin_kernels``) this entry point does nothing and :mod:`.native_api` registers
through that API instead. Otherwise (0.5.17) it registers these hooks (``HookRegistry``):

======================================================  ======  ===============================
target (sglang.srt.)                                    type    what mono_ext does
======================================================  ======  ===============================
server_args.ServerArgs.add_cli_args                     after   adds --monokernel,
                                                                --monokernel-backend (--help)
server_args.ServerArgs.from_cli_args                    around  validates them (one line, exit
                                                                2 on error), exports them to
                                                                the worker processes
server_args.ServerArgs.__init__                         around  the same for ``ServerArgs(...,
                                                                monokernel=..., monokernel_
                                                                backend=...)``, which
                                                                ``Engine(**kwargs)`` builds
entrypoints.engine.Engine.__init__                      around  scopes the carried flags to
                                                                the engine being started
model_executor.model_runner.ModelRunner.load_model      around  config stage before the weights
                                                                load; model stage, build and
                                                                the dispatching forward after
                                                                (draft workers are skipped)
model_executor.model_runner.ModelRunner                 after   cache stage (MambaPool states,
.init_attention_backends                                        KV buffers) and the check after
                                                                decode CUDA-graph capture
model_executor.model_runner.ModelRunner.forward         after   FailStop: releases each routed
                                                                step (eager or graph replay)
                                                                before SGLang samples it
managers.scheduler.Scheduler.handle_rpc_request         around  answers ``Engine.collective_
                                                                rpc("mono_ext_report", path=
                                                                ...)`` (:mod:`.report`)
======================================================  ======  ===============================

The last two (:mod:`.hooks`) are the ones :mod:`.native_api` registers on 0.5.23 as well.

With the flag off every hook returns at once and the model keeps SGLang's own forward.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from . import flags as _flags
from . import has_native_api
from . import hooks as _hooks

__all__ = ["register", "HOOKS", "has_native_api"]

log = logging.getLogger("mono_ext.sglang")

_registered = False


# -- flags ---------------------------------------------------------------------------------
def _after_add_cli_args(result: Any, parser: Any, *args: Any, **kwargs: Any) -> None:
    _flags.add_arguments(parser)


def _around_from_cli_args(original: Any, cls: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
    try:
        on = _flags.from_values(
            getattr(args, "monokernel", None), getattr(args, "monokernel_backend", None)
        )
        _check_settings()
    except _flags.FlagError as exc:
        print(str(exc), file=sys.stderr)
        raise SystemExit(2) from None
    server_args = original(cls, args, *rest, **kwargs)
    _flags.attach(server_args, on)
    _flags.export(on)  # this process is the server: its children inherit the variable
    return server_args


def _check_settings() -> None:
    from ...core.settings import SettingsError, load_settings

    try:
        load_settings()
    except SettingsError as exc:
        raise _flags.FlagError(f"mono_ext: {exc}") from None


def _around_server_args_init(original: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """``ServerArgs(..., monokernel=..., monokernel_backend=...)``, which is what
    ``Engine(**kwargs)`` builds (after it loaded the plugins, so even the first Engine of a
    process gets here): take the two arguments out, validate, record and export them."""
    given = {k: kwargs.pop(k) for k in _flags.ENGINE_KWARGS if k in kwargs}
    if given:
        on = _flags.from_values(given.get("monokernel"), given.get("monokernel_backend"))
        _check_settings()
    original(server_args, *args, **kwargs)
    if given:
        _flags.attach(server_args, on)
        _flags.export(on)


def _around_engine_init(original: Any, engine: Any, *args: Any, **kwargs: Any) -> Any:
    """Scope :data:`.flags.ENV` to this engine's start: its workers inherit its own flags
    (from ``server_args=`` or its keyword arguments), never an earlier engine's."""
    previous = _flags.export(None)
    server_args = kwargs.get("server_args")
    if server_args is not None:
        _flags.export(_flags.of(server_args, {}))
    try:
        return original(engine, *args, **kwargs)  # ServerArgs(**kwargs) exports its flags
    finally:
        _flags.restore(previous)


# -- model runner ----------------------------------------------------------------------------
def _engine_version() -> str:
    try:
        import sglang

        return str(sglang.__version__)
    except Exception:  # pragma: no cover
        return ""


def _tp_group() -> tuple[Any, int, int]:
    from sglang.srt.distributed import get_tp_group

    g = get_tp_group()
    return g.cpu_group, g.world_size, g.rank_in_group


def serving_of(runner: Any) -> Any:
    from .serving import SERVING_ATTR

    return getattr(runner, "__dict__", {}).get(SERVING_ATTR)


def _around_load_model(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        on = _flags.of(getattr(runner, "server_args", None))
    except _flags.FlagError as exc:
        log.error("%s; running SGLang's forward", exc)
        on = None
    if on is None or getattr(runner, "is_draft_worker", False):
        return original(runner, *args, **kwargs)
    from .serving import SERVING_ATTR, Serving

    group, tp_size, tp_rank = _tp_group()
    serving = Serving(
        on, group=group, tp_size=tp_size, tp_rank=tp_rank, engine_version=_engine_version()
    )
    runner.__dict__[SERVING_ATTR] = serving
    mc = runner.model_config
    serving.accept_config(
        mc.hf_config, runner.server_args, dtype=mc.dtype, quantization=mc.quantization
    )
    out = original(runner, *args, **kwargs)
    if not serving.off:
        serving.accept_model(runner.model)
    return out


def _after_init_attention_backends(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    serving = serving_of(runner)
    if serving is None or serving.off or serving.active:
        return
    from .dispatch import CaptureCheck, Router, install

    refusal = serving.accept_caches(runner.req_to_token_pool, runner.token_to_kv_pool)
    if refusal:
        return
    router = Router(serving, runner.model.forward, attn_backend=runner.attn_backend)
    install(runner.model, router)
    runner.capture_tail_hooks.append(CaptureCheck(router))
    if serving.tp_rank == 0:
        log.info(
            "mono_ext on: %s with backend %s, widths %s; other steps run SGLang's forward",
            serving.spec.name,
            serving.backend.name,
            list(serving.spec.deployment.widths),
        )


# The run-time hooks are shared with 0.5.23's kernel-plugin path (:mod:`.hooks`).
_after_forward = _hooks.after_forward
_around_handle_rpc_request = _hooks.around_handle_rpc_request


_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
#: (target, hook type name, hook) in registration order.
HOOKS: tuple[tuple[str, str, Any], ...] = (
    ("sglang.srt.server_args.ServerArgs.add_cli_args", "AFTER", _after_add_cli_args),
    ("sglang.srt.server_args.ServerArgs.from_cli_args", "AROUND", _around_from_cli_args),
    ("sglang.srt.server_args.ServerArgs.__init__", "AROUND", _around_server_args_init),
    ("sglang.srt.entrypoints.engine.Engine.__init__", "AROUND", _around_engine_init),
    (f"{_MR}.load_model", "AROUND", _around_load_model),
    (f"{_MR}.init_attention_backends", "AFTER", _after_init_attention_backends),
    *_hooks.RUNTIME_HOOKS,
)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (re-entrant: hooks are registered once)."""
    global _registered
    if _registered:
        return
    if has_native_api():
        log.info(
            "mono_ext: this SGLang has the kernel-plugin API; mono_ext registers through it "
            "(--enable-nvidia-megakernel), not through --monokernel"
        )
        _registered = True
        return
    _hooks.register(HOOKS)
    _registered = True
