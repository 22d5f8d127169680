"""The ``triton`` backend's probe now that engines release every step through FailStop: it
says usable on an sm_90 device with triton, and otherwise names the missing piece (never the
old "FailStop is not polled" gate)."""

from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")

from mono_ext.plugins import triton as plugin  # noqa: E402


def test_probe_here_names_a_missing_piece_not_the_failstop_gate():
    ok, why = plugin._probe()
    if not torch.cuda.is_available():
        assert not ok
        assert why in ("triton is not installed", "no CUDA device is visible"), why
    assert "FailStop" not in why


@pytest.mark.parametrize(
    "cap, usable", [((9, 0), True), ((8, 0), False), ((10, 0), False)], ids=str
)
def test_probe_on_a_device(monkeypatch, cap, usable):
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    ok, why = plugin._probe()
    assert ok == usable, why
    assert ("sm_90" in why) and ("FailStop" not in why)
