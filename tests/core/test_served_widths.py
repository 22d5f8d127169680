"""Which widths a deployment routes: only those a backend was measured faster than stock at."""

from types import SimpleNamespace

from mono_ext.core.backends import served_widths
from mono_ext.core.settings import load_settings
from mono_ext.models.qwen3_next.triton import measured
from mono_ext.models.qwen3_next.triton.backend import TritonBuilder

SPEC = (1, 2, 3, 4, 8, 16)


def test_builder_without_a_speed_table_serves_every_width():
    widths, why = served_widths(SPEC, SimpleNamespace(), "reference", False)
    assert widths == SPEC and why is None


def test_only_measured_faster_widths_are_served():
    builder = SimpleNamespace(faster_widths=frozenset({1, 2, 5}))
    assert served_widths(SPEC, builder, "x", False) == ((1, 2), None)


def test_no_faster_width_refuses_with_the_reason_and_the_override():
    widths, why = served_widths(SPEC, SimpleNamespace(faster_widths=frozenset()), "x", False)
    assert widths == ()
    assert "'x' serves no width" in why and "MONO_EXT_SERVE_UNMEASURED=1" in why
    assert served_widths(SPEC, SimpleNamespace(faster_widths=frozenset()), "x", True) == (
        SPEC,
        None,
    )


def test_triton_serves_only_measured_widths_and_everything_when_asked(monkeypatch):
    # the mechanism, whatever models/qwen3_next/triton/measured.py lists today
    key = ("vllm", "NVIDIA H200", "bf16")
    monkeypatch.setitem(measured.FASTER, key, (frozenset({1}), "a run"))
    off = load_settings({})
    on = load_settings({"MONO_EXT_SERVE_UNMEASURED": "1"})
    b = TritonBuilder()
    assert served_widths(SPEC, b, "triton", off.serve_unmeasured)[0] == ()  # no engine, device
    h200 = dict(engine="vllm", device="NVIDIA H200")
    assert served_widths(SPEC, b, "triton", off.serve_unmeasured, **h200) == ((1,), None)
    assert served_widths(SPEC, b, "triton", on.serve_unmeasured)[0] == SPEC
