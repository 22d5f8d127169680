"""mono_ext as an SGLang 0.5.17 plugin, through SGLang's own entry points (sglang test venv).

SGLang's ``load_plugins()`` finds mono_ext by its ``sglang.srt.plugins`` entry point and
applies the hooks; then, in fresh processes as a deployment would run them:

- ``python -m sglang.launch_server --help`` lists ``--monokernel`` and
  ``--monokernel-backend`` with the registered backends;
- a malformed or unusable backend stops the launcher with one ``mono_ext:`` line, exit 2;
- ``prepare_server_args`` (what ``launch_server`` runs) takes the flags and carries them to a
  process started the way SGLang starts its schedulers (multiprocessing ``spawn``); without
  the flags nothing is carried;
- ``Engine(monokernel=..., monokernel_backend=...)`` (its process spawning stubbed: a real
  engine needs a GPU): the first engine of a process (which loads the plugins itself) and a
  later one without the flag each carry only their own flags;
- the pickled ``ServerArgs`` alone carries the flags to a spawned process.

The launcher processes start concurrently (each imports SGLang: several seconds apiece).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

from mono_ext.engines.sglang import flags, has_native_api  # noqa: E402

if has_native_api():
    pytest.skip(
        "SGLang with the kernel-plugin API: see test_sglang_native_api.py", allow_module_level=True
    )

from mono_ext.engines.sglang import plugin  # noqa: E402

TIMEOUT_S = 240
_SCRIPT = textwrap.dedent("""
    import json, os, sys, multiprocessing as mp

    def child(q, server_args):
        from mono_ext.engines.sglang import flags
        on = flags.of(server_args)
        q.put([os.environ.get(flags.ENV), None if on is None else on.backend])

    def spawned(server_args, env):
        # SGLang starts its schedulers this way: spawn, ServerArgs pickled as an argument
        saved = os.environ.pop("MONO_EXT_SGLANG_MONOKERNEL", None)
        if env is not None:
            os.environ["MONO_EXT_SGLANG_MONOKERNEL"] = env
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q, server_args))
        p.start()
        got = q.get(timeout=120)
        p.join()
        os.environ.pop("MONO_EXT_SGLANG_MONOKERNEL", None)
        if saved is not None:
            os.environ["MONO_EXT_SGLANG_MONOKERNEL"] = saved
        return got

    def cli(ckpt):
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        load_plugins()
        from mono_ext.engines.sglang import plugin
        plugin.register()  # re-entrant: nothing registered twice
        from sglang.srt.server_args import prepare_server_args
        base = ["--model-path", ckpt, "--device", "cpu", "--disable-radix-cache"]
        out = {
            "patched": sorted(t for t, *_ in plugin.HOOKS if t in HookRegistry._patched),
            "hook_counts": [len(HookRegistry._hooks[t]) for t, *_ in plugin.HOOKS],
        }
        off = prepare_server_args(base)
        out["off"] = [os.environ.get("MONO_EXT_SGLANG_MONOKERNEL"), spawned(off, None)]
        on = prepare_server_args(base + ["--monokernel-backend", "reference"])
        out["on_env"] = os.environ.get("MONO_EXT_SGLANG_MONOKERNEL")
        out["on_child_record_only"] = spawned(on, None)  # the pickled record alone suffices
        return out

    def engine(ckpt):
        # sglang.Engine loads the plugins itself: the first Engine of a process must work too
        from sglang.srt.entrypoints.engine import Engine
        from mono_ext.engines.sglang import flags

        class Started(Exception):
            pass

        seen = []

        def launch(server_args, **kw):  # where Engine spawns its processes
            on = flags.of(server_args)
            seen.append([os.environ.get(flags.ENV), None if on is None else on.backend])
            raise Started

        Engine._launch_subprocesses = staticmethod(launch)
        args = dict(model_path=ckpt, device="cpu", disable_radix_cache=True)
        for extra in ({"monokernel_backend": "reference"}, {}, {"monokernel": True}):
            try:
                Engine(**args, **extra)
            except Started:
                pass
            except flags.FlagError as exc:
                seen.append(str(exc))
        return {"engines": seen}

    if __name__ == "__main__":
        print("RESULT " + json.dumps({"cli": cli, "engine": engine}[sys.argv[1]](sys.argv[2])))
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
        "carry": _launch(str(script), "cli", ckpt),
        "engine": _launch(str(script), "engine", ckpt, env={"CUDA_VISIBLE_DEVICES": ""}),
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
    assert eps["nvidia_megakernel"] == "mono_ext.engines.sglang.native_api:register"


def test_help_lists_both_flags(runs):
    rc, out, err = runs["help"]
    assert rc == 0, err[-2000:]
    assert "--monokernel " in out and "--monokernel-backend NAME" in out
    assert "auto, flydsl, reference, triton" in " ".join(out.split())


@pytest.mark.parametrize(
    "run,needle",
    [
        (
            "unknown",
            "mono_ext: unknown kernel backend 'nope'; choose from auto, flydsl, reference, triton",
        ),
        ("empty", "mono_ext: --monokernel-backend needs a backend name"),
        ("unusable", "mono_ext: no kernel backend can run here (flydsl: "),
    ],
)
def test_bad_flags_stop_the_launcher_with_one_line(runs, run, needle):
    rc, _, err = runs[run]
    assert rc == 2, err[-2000:]
    lines = _mono_lines(err)
    assert len(lines) == 1 and lines[0].startswith(needle), err[-2000:]
    assert "Traceback" not in err


def _result(run):
    rc, out, err = run
    assert rc == 0 and "RESULT " in out, err[-3000:]
    return json.loads(out.split("RESULT ", 1)[1])


def test_flags_reach_spawned_workers_through_the_real_plugin_loader(runs):
    res = _result(runs["carry"])
    assert res["patched"] == sorted(t for t, *_ in plugin.HOOKS)
    assert res["hook_counts"] == [1] * len(plugin.HOOKS)
    assert res["off"] == [None, [None, None]]  # no flag: nothing carried
    assert res["on_env"] == "reference"
    assert res["on_child_record_only"] == [None, "reference"]


def test_engine_kwargs_reach_the_first_and_later_engines_of_a_process(runs):
    engines = _result(runs["engine"])["engines"]
    assert engines[0] == ["reference", "reference"]  # first Engine: plugins loaded inside
    assert engines[1] == [None, None]  # a later Engine without the flag: nothing leaks
    assert engines[2].startswith("mono_ext: no kernel backend can run here")  # auto, no GPU


# -- the hooks on their own ---------------------------------------------------------------------
def test_server_args_hook_takes_validates_and_records_the_arguments(monkeypatch):
    monkeypatch.delenv(flags.ENV, raising=False)
    seen = {}

    def original(sa, **kwargs):
        seen.update(kwargs)

    sa = SimpleNamespace()
    plugin._around_server_args_init(original, sa, model_path="m", monokernel_backend="reference")
    assert seen == {"model_path": "m"}  # ServerArgs never sees them
    assert flags.of(sa, {}) == flags.Monokernel("reference")
    assert os.environ[flags.ENV] == "reference"
    plain = SimpleNamespace()
    plugin._around_server_args_init(lambda s, **k: None, plain, model_path="m")
    assert flags.ATTR not in plain.__dict__  # no arguments: no record


def test_engine_hook_scopes_the_variable_to_the_engine_it_starts(monkeypatch):
    monkeypatch.setenv(flags.ENV, "left-over")
    seen = []
    on = SimpleNamespace()
    flags.attach(on, flags.Monokernel("reference"))
    for kwargs in ({}, {"server_args": on}, {"server_args": SimpleNamespace()}):
        plugin._around_engine_init(
            lambda e, **k: seen.append(os.environ.get(flags.ENV)), 0, **kwargs
        )
        assert os.environ[flags.ENV] == "left-over"
    assert seen == [None, "reference", None]


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"monokernel_backend": "nope"}, "unknown kernel backend 'nope'"),
        ({"monokernel": False, "monokernel_backend": "reference"}, "contradicts"),
        ({"monokernel": "yes"}, "is not a boolean"),
    ],
)
def test_engine_argument_errors_are_one_line_before_anything_starts(kwargs, needle):
    def original(sa, **kw):
        raise AssertionError("ServerArgs must not be built")

    with pytest.raises(flags.FlagError) as info:
        plugin._around_server_args_init(original, SimpleNamespace(), model_path="m", **kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_bad_check_setting_stops_the_launch(monkeypatch):
    monkeypatch.setenv("MONO_EXT_CHECK", "maybe")
    with pytest.raises(flags.FlagError, match="MONO_EXT_CHECK='maybe' is not a switch"):
        plugin._around_server_args_init(
            lambda s, **k: None, SimpleNamespace(), monokernel_backend="reference"
        )
