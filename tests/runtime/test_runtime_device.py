"""runtime.device: the per-step questions never count the devices again."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mono_ext.runtime import device  # noqa: E402


def test_has_cuda_asks_torch_once(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.append(1) or True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    device.has_cuda.cache_clear()
    try:
        assert [device.is_capturing() for _ in range(5)] == [False] * 5
        assert device.has_cuda() is True
        assert len(calls) == 1
    finally:
        device.has_cuda.cache_clear()


def test_no_device_is_never_capturing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def capturing() -> bool:
        raise AssertionError("asked a CUDA stream without a device")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", capturing)
    device.has_cuda.cache_clear()
    try:
        assert device.is_capturing() is False
    finally:
        device.has_cuda.cache_clear()
