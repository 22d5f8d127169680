"""A tiny model built in this process the way vLLM's worker builds it (``get_model`` under the
VllmConfig, gloo world of 1, dummy weights, vLLM's post-load processing), and GDN/KV caches for
it, for the adapter and FailStop tests of tests/engines/vllm. Import it after
``pytest.importorskip("vllm")`` and ``("torch")``."""

from __future__ import annotations

import torch

from mono_ext.engines.vllm.local import ensure_vllm_distributed


def engine_args(model, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), skip_tokenizer_init=True, max_model_len=256, **kw)


def config(path, **extra):
    return engine_args(
        path,
        load_format="dummy",
        enforce_eager=True,
        additional_config={"monokernel_backend": "reference"},
        **extra,
    ).create_engine_config()


def build(path, **extra):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    cfg = config(path, **extra)
    with set_current_vllm_config(cfg):
        ensure_vllm_distributed()
        model = get_model(vllm_config=cfg)
    return cfg, model


def caches(
    model,
    dims,
    slots=6,
    conv_dtype=torch.bfloat16,
    kv_dtype=torch.bfloat16,
    ssm_dtype=None,  # default: what vLLM allocates for this config (as the launches expect)
):
    if ssm_dtype is None:
        ssm_dtype = getattr(torch, model.mono.build_extra.get("ssm_dtype", "float32"))
    for layer in model.model.layers:
        if layer.layer_type == "linear_attention":
            conv = torch.zeros(slots, dims.conv_k - 1, dims.conv_dim_r, dtype=conv_dtype)
            ssm = torch.zeros(slots, dims.hv_r, dims.dv, dims.dk, dtype=ssm_dtype)
            layer.linear_attn.kv_cache = [conv, ssm]
        else:
            kv = torch.zeros(4, dims.hkv_r, 16, 2 * dims.head_dim, dtype=kv_dtype)
            layer.self_attn.attn.kv_cache = kv
