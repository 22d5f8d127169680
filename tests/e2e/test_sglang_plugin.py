"""mono_ext as an SGLang 0.5.17 plugin, through SGLang's own entry points (sglang test venv).

SGLang's ``load_plugins()`` finds mono_ext by its ``sglang.srt.plugins`` entry point and
applies the hooks; then, in fresh processes as a deployment would run them:

- ``python -m sglang.launch_server --help`` lists ``--monokernel`` and
  ``--monokernel-backend`` with the registered backends;
- a malformed or unusable backend stops the launcher with one ``mono_ext:`` line, exit 2;
- ``prepare_server_args`` (what ``launch_server`` runs) takes the flags and carries them to a
  process started the way SGLang starts its schedulers (multiprocessing ``spawn``); without
  the flags nothing is carried;
- ``Engine(monokernel=..., monokernel_backend=...)``: the hook takes the two arguments out
  of ``ServerArgs``'s way and carries them only while the engine starts its processes.

The launcher processes start concurrently (each imports SGLang: several seconds apiece).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

pytest.importorskip("sglang")

from mono_ext.engines.sglang import flags, has_native_api  # noqa: E402

if has_native_api():
    pytest.skip(
        "SGLang with the kernel-plugin API: see test_sglang_v0523.py", allow_module_level=True
    )

from mono_ext.engines.sglang import plugin  # noqa: E402

TIMEOUT_S = 240
_SCRIPT = textwrap.dedent("""
    import io, json, os, sys, contextlib, multiprocessing as mp

    def child(q):
        from mono_ext.engines.sglang import flags
        q.put(None if flags.current() is None else flags.current().backend)

    def spawned():
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        got = q.get(timeout=120)
        p.join()
        return got

    if __name__ == "__main__":
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        load_plugins()
        from mono_ext.engines.sglang import plugin
        plugin.register()  # re-entrant: nothing registered twice
        from sglang.srt.server_args import prepare_server_args
        base = ["--model-path", sys.argv[1], "--device", "cpu", "--disable-radix-cache"]
        out = {
            "patched": sorted(t for t, *_ in plugin.HOOKS if t in HookRegistry._patched),
            "hook_counts": [len(HookRegistry._hooks[t]) for t, *_ in plugin.HOOKS],
        }
        prepare_server_args(base)
        out["off_env"] = os.environ.get("MONO_EXT_SGLANG_MONOKERNEL")
        out["off_child"] = spawned()
        prepare_server_args(base + ["--monokernel-backend", "reference"])
        out["on_env"] = os.environ.get("MONO_EXT_SGLANG_MONOKERNEL")
        out["on_child"] = spawned()
        print("RESULT " + json.dumps(out))
    """)


def _launch(*args, env=None):
    full = {k: v for k, v in os.environ.items() if k != flags.ENV}  # never inherited from here
    return subprocess.Popen(
        [sys.executable, "-W", "ignore", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**full, **(env or {})},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from mono_ext.tools.checkpoint import make_checkpoint

    tmp = tmp_path_factory.mktemp("plugin")
    ckpt = str(make_checkpoint(tmp / "ckpt", "qwen3-next-tiny"))
    script = tmp / "carry.py"
    script.write_text(_SCRIPT)
    base = ["-m", "sglang.launch_server", "--model-path", ckpt, "--device", "cpu"]
    procs = {
        "help": _launch("-m", "sglang.launch_server", "--help"),
        "unknown": _launch(*base, "--monokernel-backend", "nope"),
        "empty": _launch(*base, "--monokernel-backend", " "),
        "unusable": _launch(*base, "--monokernel", env={"CUDA_VISIBLE_DEVICES": ""}),
        "carry": _launch(str(script), ckpt),
    }
    out = {}
    for name, p in procs.items():
        try:
            o, e = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
        out[name] = (p.returncode, o, e)
    return out


def _mono_lines(text):
    return [ln for ln in text.splitlines() if ln.startswith("mono_ext")]


def test_entry_point_is_declared_for_sglang():
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps["mono_ext"] == "mono_ext.engines.sglang.plugin:register"
    assert eps["nvidia_megakernel"] == "mono_ext.engines.sglang.v0523:register"


def test_help_lists_both_flags(runs):
    rc, out, err = runs["help"]
    assert rc == 0, err[-2000:]
    assert "--monokernel " in out and "--monokernel-backend NAME" in out
    assert "auto, reference, triton" in out.replace("\n", " ").replace("  ", " ")


@pytest.mark.parametrize(
    "run,needle",
    [
        ("unknown", "mono_ext: unknown kernel backend 'nope'; choose from auto, reference, triton"),
        ("empty", "mono_ext: --monokernel-backend needs a backend name"),
        ("unusable", "mono_ext: no kernel backend can run here (triton: "),
    ],
)
def test_bad_flags_stop_the_launcher_with_one_line(runs, run, needle):
    rc, _, err = runs[run]
    assert rc == 2, err[-2000:]
    lines = _mono_lines(err)
    assert len(lines) == 1 and lines[0].startswith(needle), err[-2000:]
    assert "Traceback" not in err


def test_flags_reach_spawned_workers_through_the_real_plugin_loader(runs):
    rc, out, err = runs["carry"]
    assert rc == 0, err[-3000:]
    res = json.loads(out.split("RESULT ", 1)[1])
    assert res["patched"] == sorted(t for t, *_ in plugin.HOOKS)
    assert res["hook_counts"] == [1] * len(plugin.HOOKS)
    assert res["off_env"] is None and res["off_child"] is None
    assert res["on_env"] == "reference" and res["on_child"] == "reference"


# -- Engine(...) keyword arguments (the hook alone: a real Engine needs a GPU) ------------------
def test_engine_kwargs_are_taken_validated_and_carried_only_during_start(monkeypatch):
    monkeypatch.delenv(flags.ENV, raising=False)
    seen = {}

    def original(engine, **kwargs):
        seen.update(kwargs=kwargs, env=os.environ.get(flags.ENV))

    plugin._around_engine_init(original, object(), model_path="m", monokernel_backend="reference")
    assert seen == {"kwargs": {"model_path": "m"}, "env": "reference"}
    assert flags.ENV not in os.environ  # restored once the engine's processes started
    plugin._around_engine_init(original, object(), model_path="m")
    assert seen["env"] is None  # no argument: nothing carried


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"monokernel_backend": "nope"}, "unknown kernel backend 'nope'"),
        ({"monokernel": False, "monokernel_backend": "reference"}, "contradicts"),
        ({"monokernel": "yes"}, "is not a boolean"),
    ],
)
def test_engine_kwargs_errors_are_one_line_before_anything_starts(kwargs, needle):
    def original(engine, **kw):
        raise AssertionError("the engine must not start")

    with pytest.raises(flags.FlagError) as info:
        plugin._around_engine_init(original, object(), model_path="m", **kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_bad_check_setting_stops_the_launch(monkeypatch):
    monkeypatch.setenv("MONO_EXT_CHECK", "maybe")
    with pytest.raises(flags.FlagError, match="MONO_EXT_CHECK='maybe' is not a switch"):
        plugin._around_engine_init(lambda e, **k: None, object(), monokernel_backend="reference")
