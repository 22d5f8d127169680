"""Entry-point discovery with a third-party plugin really installed (pip, into a temp dir)."""

import importlib.metadata as md
import subprocess
import sys
import textwrap

import pytest

from mono_ext.core.registry import PluginError, build_registry

_PLUGIN = """
from mono_ext.core import KernelBackend, ModelSpec, Refusal
from mono_ext.core.hookspecs import hookimpl


class ToySpec(ModelSpec):
    name = "toy"
    architectures = ("ToyForCausalLM",)
    NUMERICS = {"k2.hidden.cosine": 0.99}

    def refuse_config(self, cfg):
        return Refusal.of("config", [])

    def refuse_model(self, model):
        return Refusal.of("model", [])

    def refuse_caches(self, caches):
        return Refusal.of("caches", [])


@hookimpl
def mono_ext_model_specs():
    return [ToySpec]


@hookimpl
def mono_ext_kernel_backends():
    return [KernelBackend("toy_backend", "test", "toy_plugin:ToySpec", lambda: (True, "ok"))]
"""


def _install(tmp_path, name, entry_points, module_src):
    src = tmp_path / f"src_{name}"
    (src / name).mkdir(parents=True)
    (src / name / "__init__.py").write_text(module_src)
    eps = "\n".join(f'{k} = "{v}"' for k, v in entry_points.items())
    (src / "pyproject.toml").write_text(textwrap.dedent(f"""
            [build-system]
            requires = ["setuptools"]
            build-backend = "setuptools.build_meta"
            [project]
            name = "{name.replace('_', '-')}"
            version = "1.2.3"
            [project.entry-points.mono_ext]
            """) + eps + "\n")
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(src),
        ],
        check=True,
    )
    return target


@pytest.fixture
def installed(tmp_path, monkeypatch):
    def install(name, eps, src):
        target = _install(tmp_path, name, eps, src)
        monkeypatch.syspath_prepend(str(target))
        return [
            ep for ep in md.entry_points(group="mono_ext") if ep.dist.name == name.replace("_", "-")
        ]

    return install


def test_third_party_plugin_adds_spec_and_backend(installed):
    eps = installed("toy_plugin", {"toy": "toy_plugin"}, _PLUGIN)
    assert [ep.name for ep in eps] == ["toy"]
    reg = build_registry()  # everything installed: ours and the toy
    assert {"qwen3_next", "toy"} <= set(reg.specs)
    assert {"reference", "triton", "toy_backend"} <= set(reg.backends)
    assert reg.origins["spec:toy"] == "entry point 'toy' of toy-plugin 1.2.3"
    assert reg.specs["toy"].__module__ == "toy_plugin"


def test_duplicate_spec_name_names_both_distributions(installed):
    dup = _PLUGIN.replace('name = "toy"', 'name = "qwen3_next"').replace("toy_backend", "tb2")
    installed("dup_plugin", {"dup": "dup_plugin"}, dup)
    with pytest.raises(PluginError) as err:
        build_registry()
    msg = str(err.value)
    assert "qwen3_next" in msg and "mono-ext" in msg and "dup-plugin 1.2.3" in msg


def test_plugin_failing_to_import_names_its_distribution(installed):
    eps = installed("broken_plugin", {"broken": "broken_plugin"}, "raise ImportError('no cuda')\n")
    with pytest.raises(PluginError) as err:
        build_registry(eps)
    assert "broken-plugin 1.2.3" in str(err.value) and "no cuda" in str(err.value)


def test_hookimpl_without_spec_is_refused(installed):
    src = "from mono_ext.core.hookspecs import hookimpl\n\n@hookimpl\ndef mono_ext_typo():\n    return []\n"
    eps = installed("typo_plugin", {"typo": "typo_plugin"}, src)
    with pytest.raises(PluginError) as err:
        build_registry(eps)
    assert "mono_ext_typo" in str(err.value) and "typo-plugin 1.2.3" in str(err.value)
