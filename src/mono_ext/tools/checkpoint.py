"""Random tiny (or cut-down real-shaped) checkpoints for Qwen3-Next and Qwen3.5-MoE.

``make_checkpoint`` writes ``config.json`` and safetensors weights under exactly the names
and shapes transformers 5.17 expects, building the name -> shape table from the config (no
HF model is instantiated), generating and writing one tensor at a time and one shard at a
time, so large shapes need memory for about one shard only.

Architectures written:

- Qwen3-Next: ``Qwen3NextForCausalLM`` (served by vLLM 0.26 and SGLang 0.5.17).
- Qwen3.5-MoE: by default ``Qwen3_5MoeForConditionalGeneration``, the only Qwen3.5-MoE
  architecture vLLM 0.26's registry serves (``vllm/model_executor/models/registry.py``);
  text weights live under ``model.language_model.`` and a small vision tower (depth 1,
  ``DEFAULT_VISION``) is written too, so HF's ConditionalGeneration class and vLLM load with
  no missing keys. ``arch="Qwen3_5MoeForCausalLM"`` writes a flat text-only checkpoint
  (``model.layers.``), which transformers loads but vLLM 0.26 does not serve.

Routed experts (``expert_layout``):

- ``"fused"``: the names of HF's own ``state_dict()`` (``mlp.experts.gate_up_proj``
  [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]); the published Qwen3.5 layout. vLLM 0.26's
  FusedMoE.load_weights reads 3-D fused tensors; SGLang 0.5.17's Qwen3.5 loader does too,
  but its Qwen3-Next loader only maps per-expert names (a fused tensor raises KeyError).
- ``"per_expert"``: ``mlp.experts.{e}.gate_proj.weight`` etc., the published Qwen3-Next
  layout; transformers fuses them on load (its qwen2_moe conversion mapping).
- ``"auto"`` (default): the published layout of the family, which transformers, vLLM 0.26
  and SGLang 0.5.17 all load: per_expert for Qwen3-Next, fused for Qwen3.5.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import zlib
from pathlib import Path
from typing import Any

from mono_ext.models.qwen3_next.configs import family, get_preset, is_moe_layer, layer_types

__all__ = ["DEFAULT_VISION", "checkpoint_config", "param_shapes", "make_checkpoint", "main"]

QWEN35_COND_GEN = "Qwen3_5MoeForConditionalGeneration"
QWEN35_CAUSAL = "Qwen3_5MoeForCausalLM"
QWEN3_NEXT_CAUSAL = "Qwen3NextForCausalLM"

# Smallest vision tower HF and vLLM build without complaint: num_position_embeddings must be
# a square (the position grid is interpolated), head_dim 16.
DEFAULT_VISION: dict[str, Any] = {
    "model_type": "qwen3_5_moe_vision",
    "depth": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 4,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,
    "hidden_act": "gelu_pytorch_tanh",
}

_DEFAULT_SHARD_BYTES = 2 * 1024**3
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _text_config(config: dict[str, Any] | str, num_layers: int | None) -> dict[str, Any]:
    cfg = get_preset(config) if isinstance(config, str) else copy.deepcopy(config)
    if "text_config" in cfg:
        cfg = cfg["text_config"]
    # Always explicit: vLLM 0.26's Qwen3NextConfig ignores full_attention_interval.
    cfg["layer_types"] = layer_types(cfg)[:num_layers]
    if num_layers is not None:
        cfg["num_hidden_layers"] = num_layers
        if cfg.get("mlp_only_layers"):
            cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < num_layers]
    return cfg


def _default_arch(text: dict[str, Any]) -> str:
    return QWEN3_NEXT_CAUSAL if family(text) == "qwen3_next" else QWEN35_COND_GEN


def checkpoint_config(
    config: dict[str, Any] | str,
    *,
    num_layers: int | None = None,
    arch: str | None = None,
    dtype: str = "bfloat16",
    vision_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``config.json`` dict ``make_checkpoint`` writes."""
    text = _text_config(config, num_layers)
    arch = arch or _default_arch(text)
    text.pop("torch_dtype", None)
    if arch == QWEN3_NEXT_CAUSAL:
        if family(text) != "qwen3_next":
            raise ValueError(f"{arch} needs a qwen3_next config")
        return {**text, "architectures": [arch], "model_type": "qwen3_next", "dtype": dtype}
    if family(text) != "qwen3_5_moe":
        raise ValueError(f"{arch} needs a Qwen3.5-MoE config")
    text["model_type"] = "qwen3_5_moe_text"
    if arch == QWEN35_CAUSAL:
        return {**text, "architectures": [arch], "dtype": dtype}
    if arch != QWEN35_COND_GEN:
        raise ValueError(f"unsupported architecture {arch!r}")
    text.pop("architectures", None)
    vision = {**DEFAULT_VISION, **(vision_config or {}), "out_hidden_size": text["hidden_size"]}
    v = text["vocab_size"]
    # The published special-token ids (248053..248057) fall outside a tiny vocabulary.
    specials = (248056, 248057, 248053, 248054) if v > 248057 else (v - 4, v - 3, v - 2, v - 1)
    return {
        "architectures": [arch],
        "model_type": "qwen3_5_moe",
        "text_config": {**text, "dtype": dtype},
        "vision_config": vision,
        "image_token_id": specials[0],
        "video_token_id": specials[1],
        "vision_start_token_id": specials[2],
        "vision_end_token_id": specials[3],
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
        "dtype": dtype,
    }


#: the planes an FP8 block-128 checkpoint of Qwen3-Next stores as e4m3 codes with one fp32
#: ``weight_scale_inv`` per 128x128 block (docs/quantized_planes.md): the rest stay bf16
FP8_BLOCK128_PLANES = frozenset(
    {"in_proj_qkvz", "out_proj", "qkv_proj", "o_proj", "w13", "w2", "shared_gate_up",
     "shared_down"}
)  # fmt: skip


def fp8_block128_quantization(config: dict[str, Any]) -> dict[str, Any]:
    """The ``quantization_config`` of an FP8 block-128 checkpoint of the Qwen3-Next
    ``config`` (a ``checkpoint_config`` dict), as Qwen's FP8 release declares it: e4m3,
    dynamic activation scales, 128x128 weight blocks, and bf16 (``modules_to_not_convert``)
    for the embeddings, lm_head, every layer's router and shared-expert gate and every GDN
    layer's ``in_proj_ba`` (vLLM refuses blocks of its 64 rows)."""
    if family(config) != "qwen3_next":
        raise ValueError("fp8_block128_quantization: a Qwen3-Next config only")
    keep = ["lm_head", "model.embed_tokens"]
    for i, kind in enumerate(layer_types(config)[: int(config["num_hidden_layers"])]):
        keep += [f"model.layers.{i}.{m}" for m in ("mlp.gate", "mlp.shared_expert_gate")]
        if kind == "linear_attention":
            keep.append(f"model.layers.{i}.linear_attn.in_proj_ba")
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": keep,
    }


def _vision_shapes(v: dict[str, Any], prefix: str) -> dict[str, tuple[int, ...]]:
    h, inter, m = v["hidden_size"], v["intermediate_size"], v["spatial_merge_size"]
    p, tp, cin = v["patch_size"], v["temporal_patch_size"], v["in_channels"]
    merged = h * m * m
    s: dict[str, tuple[int, ...]] = {
        f"{prefix}patch_embed.proj.weight": (h, cin, tp, p, p),
        f"{prefix}patch_embed.proj.bias": (h,),
        f"{prefix}pos_embed.weight": (v["num_position_embeddings"], h),
    }
    for i in range(v["depth"]):
        b = f"{prefix}blocks.{i}."
        for n in ("norm1", "norm2"):
            s[f"{b}{n}.weight"], s[f"{b}{n}.bias"] = (h,), (h,)
        s[f"{b}attn.qkv.weight"], s[f"{b}attn.qkv.bias"] = (3 * h, h), (3 * h,)
        s[f"{b}attn.proj.weight"], s[f"{b}attn.proj.bias"] = (h, h), (h,)
        s[f"{b}mlp.linear_fc1.weight"], s[f"{b}mlp.linear_fc1.bias"] = (inter, h), (inter,)
        s[f"{b}mlp.linear_fc2.weight"], s[f"{b}mlp.linear_fc2.bias"] = (h, inter), (h,)
    s[f"{prefix}merger.norm.weight"], s[f"{prefix}merger.norm.bias"] = (h,), (h,)
    s[f"{prefix}merger.linear_fc1.weight"] = (merged, merged)
    s[f"{prefix}merger.linear_fc1.bias"] = (merged,)
    s[f"{prefix}merger.linear_fc2.weight"] = (v["out_hidden_size"], merged)
    s[f"{prefix}merger.linear_fc2.bias"] = (v["out_hidden_size"],)
    return s


def _layer_shapes(
    t: dict[str, Any], i: int, kind: str, expert_layout: str
) -> dict[str, tuple[int, ...]]:
    h = t["hidden_size"]
    if expert_layout == "auto":
        expert_layout = "per_expert" if family(t) == "qwen3_next" else "fused"
    s: dict[str, tuple[int, ...]] = {}
    if kind == "linear_attention":
        hk, hv = t["linear_num_key_heads"], t["linear_num_value_heads"]
        kd, vd = hk * t["linear_key_head_dim"], hv * t["linear_value_head_dim"]
        la = "linear_attn."
        s[la + "conv1d.weight"] = (2 * kd + vd, 1, t["linear_conv_kernel_dim"])
        if family(t) == "qwen3_next":
            s[la + "in_proj_qkvz.weight"] = (2 * kd + 2 * vd, h)
            s[la + "in_proj_ba.weight"] = (2 * hv, h)
        else:
            s[la + "in_proj_qkv.weight"] = (2 * kd + vd, h)
            s[la + "in_proj_z.weight"] = (vd, h)
            s[la + "in_proj_b.weight"] = (hv, h)
            s[la + "in_proj_a.weight"] = (hv, h)
        s[la + "dt_bias"], s[la + "A_log"] = (hv,), (hv,)
        s[la + "norm.weight"] = (t["linear_value_head_dim"],)
        s[la + "out_proj.weight"] = (h, vd)
    elif kind == "full_attention":
        d = t.get("head_dim") or h // t["num_attention_heads"]
        hq, hkv = t["num_attention_heads"], t["num_key_value_heads"]
        sa = "self_attn."
        s[sa + "q_proj.weight"] = (2 * hq * d, h)  # per head [q, gate]
        s[sa + "k_proj.weight"] = (hkv * d, h)
        s[sa + "v_proj.weight"] = (hkv * d, h)
        s[sa + "o_proj.weight"] = (h, hq * d)
        s[sa + "q_norm.weight"], s[sa + "k_norm.weight"] = (d,), (d,)
    else:
        raise ValueError(f"unknown layer type {kind!r}")
    if t.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported by the checkpoint maker")
    if is_moe_layer(t, i):
        e, inter, si = (
            t["num_experts"],
            t["moe_intermediate_size"],
            t["shared_expert_intermediate_size"],
        )
        s["mlp.gate.weight"] = (e, h)
        if expert_layout == "fused":
            s["mlp.experts.gate_up_proj"] = (e, 2 * inter, h)
            s["mlp.experts.down_proj"] = (e, h, inter)
        elif expert_layout == "per_expert":
            for j in range(e):
                s[f"mlp.experts.{j}.gate_proj.weight"] = (inter, h)
                s[f"mlp.experts.{j}.up_proj.weight"] = (inter, h)
                s[f"mlp.experts.{j}.down_proj.weight"] = (h, inter)
        else:
            raise ValueError(f"expert_layout must be auto, fused or per_expert: {expert_layout!r}")
        if si > 0:
            s["mlp.shared_expert.gate_proj.weight"] = (si, h)
            s["mlp.shared_expert.up_proj.weight"] = (si, h)
            s["mlp.shared_expert.down_proj.weight"] = (h, si)
            s["mlp.shared_expert_gate.weight"] = (1, h)
    else:
        inter = t["intermediate_size"]
        s["mlp.gate_proj.weight"], s["mlp.up_proj.weight"] = (inter, h), (inter, h)
        s["mlp.down_proj.weight"] = (h, inter)
    s["input_layernorm.weight"] = (h,)
    s["post_attention_layernorm.weight"] = (h,)
    return s


def param_shapes(
    config: dict[str, Any] | str,
    *,
    num_layers: int | None = None,
    arch: str | None = None,
    expert_layout: str = "auto",
    vision_config: dict[str, Any] | None = None,
) -> dict[str, tuple[int, ...]]:
    """Ordered name -> shape table of the checkpoint (HF parameter names)."""
    full = checkpoint_config(config, num_layers=num_layers, arch=arch, vision_config=vision_config)
    arch = full["architectures"][0]
    t = full.get("text_config", full)
    base = "model.language_model." if arch == QWEN35_COND_GEN else "model."
    h, v = t["hidden_size"], t["vocab_size"]
    s: dict[str, tuple[int, ...]] = {f"{base}embed_tokens.weight": (v, h)}
    for i, kind in enumerate(layer_types(t)):
        for name, shape in _layer_shapes(t, i, kind, expert_layout).items():
            s[f"{base}layers.{i}.{name}"] = shape
    s[f"{base}norm.weight"] = (h,)
    if arch == QWEN35_COND_GEN:
        s.update(_vision_shapes(full["vision_config"], "model.visual."))
    if not t.get("tie_word_embeddings", False):
        s["lm_head.weight"] = (v, h)
    return s


def _tensor_dtype(name: str, dtype: str) -> str:
    # A_log stays fp32 (the engines keep it fp32; published Qwen3.5 checkpoints store it so).
    return "float32" if name.endswith("A_log") else dtype


def _make_tensor(name: str, shape: tuple[int, ...], dtype: str, seed: int):
    import torch

    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    out = torch.empty(shape, dtype=getattr(torch, _tensor_dtype(name, dtype)))
    leaf = name.rsplit(".", 2)

    def fill(dst, gen_shape):
        if name.endswith("A_log"):
            return torch.log(torch.rand(gen_shape, generator=g) * 15 + 1)
        if name.endswith("dt_bias"):
            return 1 + 0.1 * torch.randn(gen_shape, generator=g)
        if name.endswith("linear_attn.norm.weight"):
            return 1 + 0.05 * torch.randn(gen_shape, generator=g)
        if "visual" in name and ("norm" in leaf[-2] and name.endswith("weight")):
            return 1 + 0.05 * torch.randn(gen_shape, generator=g)  # vision LayerNorm: plain w
        if name.endswith("bias"):
            return 0.02 * torch.randn(gen_shape, generator=g)
        if "norm" in name:
            return 0.05 * torch.randn(gen_shape, generator=g)  # Gemma style: applied as 1 + w
        if "conv1d" in name:
            return 0.3 * torch.randn(gen_shape, generator=g)
        return 0.02 * torch.randn(gen_shape, generator=g)

    # Fill along dim 0 in pieces so a huge expert tensor never exists in fp32 at once.
    step = max(1, (1 << 24) // max(1, math.prod(shape[1:])))
    for a in range(0, shape[0] if shape else 1, step):
        piece = out[a : a + step] if shape else out
        piece.copy_(fill(piece, piece.shape))
    return out


def _plan_shards(
    shapes: dict[str, tuple[int, ...]], dtype: str, max_shard_bytes: int
) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * _DTYPE_BYTES[_tensor_dtype(name, dtype)]
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def make_checkpoint(
    out_dir: str | Path,
    config: dict[str, Any] | str,
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    num_layers: int | None = None,
    arch: str | None = None,
    expert_layout: str = "auto",
    vision_config: dict[str, Any] | None = None,
    max_shard_bytes: int = _DEFAULT_SHARD_BYTES,
) -> Path:
    """Write a random checkpoint of ``config`` (a dict or a preset name) into ``out_dir``.

    Values are deterministic in (seed, tensor name) and well conditioned: projections
    N(0, 0.02), Gemma-style norm weights N(0, 0.05) (applied as 1 + w), the GDN gated-norm
    weight 1 + N(0, 0.05), conv1d N(0, 0.3), A_log = log(U(1, 16)) in fp32, dt_bias
    1 + N(0, 0.1). One ``model.safetensors`` up to ``max_shard_bytes`` (2 GiB), else
    ``model-0000k-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``.

    Returns the output directory.
    """
    from safetensors.torch import save_file

    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = checkpoint_config(
        config, num_layers=num_layers, arch=arch, dtype=dtype, vision_config=vision_config
    )
    shapes = param_shapes(
        config,
        num_layers=num_layers,
        arch=arch,
        expert_layout=expert_layout,
        vision_config=vision_config,
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shards = _plan_shards(shapes, dtype, max_shard_bytes)
    meta = {"format": "pt"}
    if len(shards) == 1:
        tensors = {n: _make_tensor(n, shapes[n], dtype, seed) for n in shards[0]}
        save_file(tensors, str(out / "model.safetensors"), metadata=meta)
        return out
    weight_map, total = {}, 0
    for k, names in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _make_tensor(n, shapes[n], dtype, seed) for n in names}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / fname), metadata=meta)
        del tensors
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write a random Qwen3-Next / Qwen3.5-MoE checkpoint")
    p.add_argument("out_dir")
    p.add_argument("preset", help="preset name from mono_ext.models.qwen3_next.configs")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--arch", default=None)
    p.add_argument("--expert-layout", default="auto", choices=["auto", "fused", "per_expert"])
    a = p.parse_args(argv)
    path = make_checkpoint(
        a.out_dir,
        a.preset,
        seed=a.seed,
        dtype=a.dtype,
        num_layers=a.layers,
        arch=a.arch,
        expert_layout=a.expert_layout,
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
