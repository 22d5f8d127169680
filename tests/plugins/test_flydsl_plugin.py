"""The flydsl backend's registration, its probe on each kind of device, and auto's choice."""

import sys
import types

import pytest

from mono_ext.core.backends import BackendError, select_backend
from mono_ext.core.registry import build_registry
from mono_ext.core.spec import BuildKey
from mono_ext.models.qwen3_next.flydsl import backend as fb
from mono_ext.plugins import flydsl as fp

GFX950 = fp.DeviceFacts(True, True, hip="7.1", arch="gfx950", name="AMD Instinct MI355X",
                        flydsl=True)  # fmt: skip
H200 = fp.DeviceFacts(True, True, hip=None, arch="sm_90", name="NVIDIA H200", flydsl=True)


def test_registered_through_the_entry_point():
    reg = build_registry()
    b = reg.backends["flydsl"]
    assert reg.origins["backend:flydsl"].startswith("entry point 'flydsl' of mono-ext")
    assert b.target == "mono_ext.models.qwen3_next.flydsl.backend:build"
    assert b.auto_priority > reg.backends["triton"].auto_priority > 0
    assert not b.testing_only


@pytest.mark.parametrize(
    "facts,needle",
    [
        (fp.DeviceFacts(False, False), "torch is not installed"),
        (fp.DeviceFacts(True, False), "no GPU is visible"),
        (H200, "sm_90 (CUDA)"),
        (fp.DeviceFacts(True, True, "7.1", "gfx942", "MI300X", True), "gfx942; built for gfx950"),
        (fp.DeviceFacts(True, True, "7.1", "gfx950", "MI355X", False), "flydsl is not installed"),
    ],
)
def test_probe_refuses_off_gfx950_with_the_reason(facts, needle):
    ok, why = fp.probe_facts(facts, None)
    assert not ok and needle in why


def test_probe_on_gfx950_accepts_once_nothing_is_missing():
    # the binding and HIP IPC are written (never run on gfx950; fb.WRITTEN), so
    # nothing is missing; the backend serves no width until one is measured
    assert fb.NOT_BUILT == () and fb.missing_reason() is None
    assert fb.build.faster_widths == frozenset()
    assert fp.probe_facts(GFX950, None) == (True, "AMD Instinct MI355X (gfx950, HIP 7.1)")
    ok, why = fp.probe_facts(GFX950, "the FlyDSL backend is incomplete: X")
    assert not ok and "incomplete: X" in why


def test_this_machine_cannot_run_it_and_says_why():
    ok, why = fp._probe()
    assert not ok and why


def _fake_device(monkeypatch, facts, *, complete):
    """Both probes see ``facts``: flydsl's through device_facts, triton's through torch.cuda."""
    import torch

    monkeypatch.setattr(fp, "device_facts", lambda: facts)
    monkeypatch.setattr(fb, "NOT_BUILT", () if complete else ("K1 is not written",))
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    cap = (9, 0) if facts.arch == "sm_90" else (9, 5)  # ROCm torch reports gfx950 as 9.5
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: facts.name)


def test_auto_picks_flydsl_on_gfx950_and_triton_on_sm90(monkeypatch):
    pytest.importorskip("torch")
    backends = build_registry().backends
    _fake_device(monkeypatch, GFX950, complete=True)
    assert select_backend("auto", backends).name == "flydsl"
    _fake_device(monkeypatch, H200, complete=True)
    assert select_backend("auto", backends).name == "triton"


def test_auto_on_gfx950_today_names_what_is_missing(monkeypatch):
    pytest.importorskip("torch")
    backends = build_registry().backends
    _fake_device(monkeypatch, GFX950, complete=False)
    with pytest.raises(BackendError) as err:
        select_backend("auto", backends)
    assert "flydsl: the FlyDSL backend is incomplete: K1 is not written" in str(err.value)
    assert "triton: device is sm_95" in str(err.value)
    with pytest.raises(BackendError, match="kernel backend 'flydsl' cannot run here: .*K1"):
        select_backend("flydsl", backends)


def test_builder_refuses_and_never_builds_a_stub(monkeypatch):
    from mono_ext.core.views import ConfigView

    cfg = ConfigView({"architectures": ["Qwen3NextForCausalLM"]}, tp_size=8)
    reasons = fb.build.refusals(cfg, {})
    assert any("TP 8" in r and "HipIpcPeers" in r for r in reasons)
    with pytest.raises(ValueError, match="TP 1 only"):
        fb.build(BuildKey("qwen3_next", "flydsl", 4, "bfloat16", 8), None)
    monkeypatch.setattr(fb, "NOT_BUILT", ("K1 is not written",))
    assert fb.build.refusals(cfg, {})[0] == "K1 is not written"
    with pytest.raises(NotImplementedError, match="incomplete: K1"):
        fb.build(BuildKey("qwen3_next", "flydsl", 4, "bfloat16", 1), None)
