"""tests/conftest.py skips the Triton (PTX) kernel tests on a ROCm torch, only them."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent


def _hook():
    spec = importlib.util.spec_from_file_location("tests_conftest", HERE.parent / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.pytest_collection_modifyitems


class Item:
    def __init__(self, path):
        self.fspath, self.marks = path, []

    def add_marker(self, mark):
        self.marks.append(mark)


@pytest.mark.parametrize("hip", [None, "6.4"])
def test_only_kernel_tests_are_skipped_and_only_on_rocm(monkeypatch, hip):
    monkeypatch.setattr(torch, "version", SimpleNamespace(hip=hip, cuda=None))
    k = Item("/r/tests/models/qwen3_next/triton/test_k2.py")
    u = Item("/r/tests/models/qwen3_next/test_spec.py")
    _hook()(None, [k, u])
    assert [m.name for m in k.marks] == (["skip"] if hip else [])
    assert u.marks == []
