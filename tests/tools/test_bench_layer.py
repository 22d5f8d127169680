"""benchmarks/bench_layer.py's sizes: the layer pattern it times and the bytes its floor
counts (no device)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")

from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_layer.py"
_spec = importlib.util.spec_from_file_location("bench_layer", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

D = Dims.from_config(get_preset("qwen3-next-80b-a3b"), tp=1)


def test_the_layers_timed_are_the_models_first_eight():
    assert bench.layer_kinds(D) == ("gdn", "gdn", "gdn", "attn") * 2


@pytest.mark.parametrize("kind", ["gdn", "attn"])
def test_floor_counts_only_the_routed_experts(kind):
    per_expert = (2 * D.moe_inter * D.hidden + D.hidden * D.moe_inter) * 2  # w13 + w2, bf16
    none, ten = bench.layer_bytes(D, kind, 1, 0), bench.layer_bytes(D, kind, 1, 10)
    assert ten - none == 10 * per_expert
    planes = D.planes("linear_attention" if kind == "gdn" else "full_attention")
    dense = sum(
        (4 if n == "A_log" else 2) * _numel(s) for n, s in planes.items() if n not in ("w13", "w2")
    )
    state = 2 * D.hv * D.dv * D.dk * 4 if kind == "gdn" else 0  # fp32, read and written
    assert dense + state < none < dense + state + 1024 * 1024  # + conv state, activations


@pytest.mark.parametrize("kind", ["gdn", "attn"])
def test_floor_grows_by_the_same_bytes_per_row(kind):
    b = [bench.layer_bytes(D, kind, w, 10) for w in (1, 2, 3)]
    assert b[2] - b[1] == b[1] - b[0] > 0
    if kind == "gdn":  # fp32 recurrent state read and written dominates a GDN row
        assert b[1] - b[0] > 2 * D.hv * D.dv * D.dk * 4


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def test_arms_are_timed_in_alternating_order_and_checked_after_each_timing():
    calls, checked = [], []

    class Mono:
        def __init__(self, name):
            self.name = name

        def healthy(self):
            checked.append(self.name)

    bodies = [("a", "body-a", Mono("a")), ("b", "body-b", Mono("b")), ("vllm", "body-v", None)]
    times = iter(range(100))

    def time_one(body):
        calls.append(body)
        return float(next(times))

    out = bench.time_arms(bodies, 3, time_one)
    assert calls == ["body-a", "body-b", "body-v", "body-v", "body-b", "body-a"] + [
        "body-a",
        "body-b",
        "body-v",
    ]
    assert out == {"a": [0.0, 5.0, 6.0], "b": [1.0, 4.0, 7.0], "vllm": [2.0, 3.0, 8.0]}
    assert checked == ["a", "b", "b", "a", "a", "b"]
