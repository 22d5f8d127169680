"""benchmarks/bench_k2.py's variant names: every named variant and every ``k2 field=value``
name is a K2Config the 80B-A3B shapes accept, and a bad name stops with one line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")  # K2Config lives beside the Triton kernel

from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402
from mono_ext.models.qwen3_next.triton.k2 import K2Config, K2Shape  # noqa: E402

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_k2.py"
_spec = importlib.util.spec_from_file_location("bench_k2", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

SHAPE = K2Shape.from_dims(Dims.from_config(get_preset("qwen3-next-80b-a3b"), tp=1))


@pytest.mark.parametrize("name", sorted(bench.VARIANTS))
def test_named_variants_are_configs(name):
    overrides = bench.variant_overrides(name)
    assert overrides or name == "k2"  # only the default names no override
    cfg = K2Config(grid=132, **overrides)
    assert all(getattr(cfg, k) == v for k, v in overrides.items())
    cfg.splits(SHAPE)  # raises for a tile that is not a power of two


def test_field_words_become_overrides():
    got = bench.variant_overrides("k2 num_warps=8 tile_rows=128 pdl=true prefetch=False")
    assert got == {"num_warps": 8, "tile_rows": 128, "pdl": True, "prefetch": False}
    cfg = K2Config(grid=132, **got)
    assert (cfg.num_warps, cfg.tile_rows, cfg.pdl, cfg.prefetch) == (8, 128, True, False)


@pytest.mark.parametrize(
    "name", ["k2 no_such_knob=1", "k2 topk_rows_per_pass", "k2 grid=7", "k3 tile_rows=64", "zz"]
)
def test_bad_names_stop(name):
    with pytest.raises(SystemExit, match="unknown variant"):
        bench.variant_overrides(name)


def test_the_fp8_activations_variant_runs_by_default_on_block128_planes_only():
    assert "k2 a8" in bench.default_variants("fp8_block128")
    for fmt in ("bf16", "fp8_channel"):
        got = bench.default_variants(fmt)
        assert "k2 a8" not in got and "k2" in got and len(got) == len(bench.VARIANTS) - 1


def test_down_prefetch_budget_variant_and_its_refusals():
    from mono_ext.models.qwen3_next.triton.k2 import K2Launch

    got = bench.variant_overrides("k2 down_prefetch_bytes=262144")
    assert K2Launch(SHAPE, K2Config(grid=132, **got)).config.down_prefetch_bytes == 262144
    for bad in (-16, 100):
        with pytest.raises(ValueError, match="down_prefetch_bytes"):
            K2Launch(SHAPE, K2Config(grid=132, down_prefetch_bytes=bad))
