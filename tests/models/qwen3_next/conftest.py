"""Views of a model exactly as the spec expects it, for mutating in refusal tests."""

import pytest

from mono_ext.core.views import (
    CacheTensorView,
    CacheView,
    LayerCacheView,
    LayerView,
    ModelView,
    PlaneView,
)


def ideal_model_view(dims, packing=None):
    packing = packing or {"qwen3_next": "interleaved", "qwen3_5_moe": "contiguous"}[dims.family]
    layers = []
    for i, kind in enumerate(dims.kinds):
        planes = {
            name: PlaneView(shape, "float32" if name == "A_log" else "bfloat16")
            for name, shape in dims.planes(kind).items()
        }
        facts = {"qkvz_packing": packing} if kind == "linear_attention" else {}
        layers.append(LayerView(i, kind, planes, facts))
    return ModelView(tuple(layers), tp_size=dims.tp)


def ideal_cache_view(dims, slots=9, conv_layout="time_chan", ssm_dtype="float32"):
    layers = []
    for i, kind in enumerate(dims.kinds):
        if kind == "linear_attention":
            conv_tail = (
                (dims.conv_k - 1, dims.conv_dim_r)
                if conv_layout == "time_chan"
                else (dims.conv_dim_r, dims.conv_k - 1)
            )
            t = {
                "conv_state": CacheTensorView((slots, *conv_tail), "bfloat16", conv_layout),
                "ssm_state": CacheTensorView((slots, dims.hv_r, dims.dv, dims.dk), ssm_dtype, "vk"),
            }
        else:
            t = {
                "kv_cache": CacheTensorView(
                    (2, 64, 16, dims.hkv_r, dims.head_dim), "bfloat16", "kv_block_tok_head"
                )
            }
        layers.append(LayerCacheView(i, kind, t))
    return CacheView(tuple(layers), num_slots=slots - 1)


@pytest.fixture
def views():
    return ideal_model_view, ideal_cache_view
