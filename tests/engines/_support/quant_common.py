"""Shared by tests/engines/vllm/test_vllm_quant.py and
tests/engines/sglang/test_sglang_quant.py: the tiny Qwen3-Next
FP8 block-128 checkpoint (fp8 dense planes and experts; 3 GDN layers, 1 attention layer), what
both engines' per-plane refusal says for a backend that reads no fp8, and the check that the
planes and scales an adapter bound dequantize to the checkpoint's own values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: the weights the official FP8 checkpoint stores as fp8 blocks (per layer, by name suffix)
QUANTIZED = (
    "in_proj_qkvz.weight",
    "out_proj.weight",
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


def make_fp8_block_checkpoint(out: Path, config: dict[str, Any]) -> Path:
    """A random checkpoint of ``config`` (``mono_ext.tools.checkpoint``) in the official FP8
    format: QUANTIZED planes as e4m3fn 128x128 blocks with fp32 ``weight_scale_inv``; the
    router, shared-expert gate, in_proj_ba, embeddings and lm_head left bf16
    (``modules_to_not_convert``)."""
    from safetensors.torch import load_file, save_file

    from mono_ext.models.qwen3_next.reference.convert import quantize
    from mono_ext.tools.checkpoint import fp8_block128_quantization, make_checkpoint

    make_checkpoint(out, config, seed=0)
    tensors = {}
    for name, t in load_file(str(out / "model.safetensors")).items():
        if not (name.startswith("model.layers.") and name.endswith(QUANTIZED)):
            tensors[name] = t
            continue
        tensors[name], scale = quantize(t, "fp8_block128")
        tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = fp8_block128_quantization(cfg)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


#: the fp8 matrix planes of FP8 checkpoints' layers (in_proj_ba, router, shared_expert_gate bf16)
FP8_PLANES = {
    "linear_attention": ("in_proj_qkvz", "out_proj", "w13", "w2", "shared_gate_up", "shared_down"),
    "full_attention": ("qkv_proj", "o_proj", "w13", "w2", "shared_gate_up", "shared_down"),
}


def dequantized_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's tensors with every fp8 ``*.weight`` replaced by its fp32 values: codes
    times the ``weight_scale_inv`` of their 128x128 block (``make_fp8_block_checkpoint``) or the
    per-row ``weight_scale`` [N, 1]; scales dropped. Written from the checkpoint's own names,
    independent of mono_ext's dequantization (``reference.convert.dequantize``)."""
    import torch
    from safetensors.torch import load_file

    sd = load_file(str(path / "model.safetensors"))
    out = {}
    for name, t in sd.items():
        if name.endswith(("weight_scale_inv", "weight_scale")):
            continue
        if t.dtype != torch.float8_e4m3fn:
            out[name] = t
            continue
        stem = name.removesuffix("weight")
        if stem + "weight_scale_inv" in sd:
            s = sd[stem + "weight_scale_inv"]
            s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: t.shape[0], : t.shape[1]]
        else:
            s = sd[stem + "weight_scale"]
        out[name] = t.float() * s
    return out


def assert_bound_planes_dequantize_to_the_checkpoint(
    weights: list[dict[str, Any]],
    formats: dict[str, str],
    ckpt: dict[str, Any],
    config: dict[str, Any],
    fp8_planes: dict[str, tuple[str, ...]],
    prefix: str = "model.layers.",
) -> None:
    """Every matrix plane an adapter bound (``weights``: per layer, plane -> the engine's tensor,
    plus ``<plane>.scale``) dequantizes, through the reference's ``dequantized_weights`` with
    the deployment's ``formats``, to exactly the values of the checkpoint
    (:func:`dequantized_checkpoint` in the engine layout of ``reference.convert``); the planes
    of ``fp8_planes`` (per layer kind) are fp8 with a scale, the others carry none."""
    import torch

    from mono_ext.core.views import MATRIX_PLANES
    from mono_ext.models.qwen3_next.dims import Dims
    from mono_ext.models.qwen3_next.reference import (
        dequantized_weights,
        layer_weights_from_state_dict,
    )

    dims = Dims.from_config(config)
    kinds = config["layer_types"]
    for i, bound in enumerate(weights):
        p = f"{prefix}{i}."
        ref = layer_weights_from_state_dict(
            {k[len(p) :]: v for k, v in ckpt.items() if k.startswith(p)}, dims
        )
        got = dequantized_weights(bound, formats)
        for name in MATRIX_PLANES:
            if name not in ref:
                continue
            fp8 = name in fp8_planes[kinds[i]]
            assert (bound[name].dtype == torch.float8_e4m3fn) == fp8, (i, name)
            assert (name + ".scale" in bound) == fp8, (i, name)
            assert torch.equal(got[name].float(), ref[name].float()), f"layer {i}: {name}"


def assert_fp8_block_views(gdn: Any, attn: Any, qkvz_rows: int) -> None:
    """The plane views either engine gives the tiny FP8 block checkpoint's GDN layer (``gdn``)
    and attention layer (``attn``): in_proj_qkvz fp8 block-128, row-major, with its
    ``weight_scale_inv`` of one column; the attention planes; the experts' block scales; the
    ``modules_to_not_convert`` planes bf16. Engine kernels are the caller's to check."""
    qkvz = gdn["in_proj_qkvz"]
    assert (qkvz.format, qkvz.dtype, qkvz.shape, qkvz.layout) == (
        "fp8_block128",
        "float8_e4m3fn",
        (qkvz_rows, 128),
        "row_major",
    )
    assert (qkvz.scale.name, qkvz.scale.shape, qkvz.scale.dtype) == (
        "weight_scale_inv",
        (qkvz_rows // 128, 1),
        "float32",
    )
    assert qkvz.block == (128, 128)
    assert attn["qkv_proj"].scale.shape == (6, 1) and attn["o_proj"].shape == (128, 256)
    w13, w2 = gdn["w13"], gdn["w2"]
    assert (w13.format, w13.shape, w13.scale.name, w13.scale.shape) == (
        "fp8_block128",
        (4, 256, 128),
        "w13_weight_scale_inv",
        (4, 2, 1),
    )
    assert w2.shape == (4, 128, 128) and w2.scale.shape == (4, 1, 1)
    for bf16 in ("in_proj_ba", "router", "shared_expert_gate"):  # modules_to_not_convert
        assert gdn[bf16].format == "bf16" and gdn[bf16].dtype == "bfloat16", bf16


def assert_fp8_block_reasons(message: str, kernel: str, moe_kernel: str, qkvz_rows: int) -> None:
    """``kernel``: the engine's dense fp8 kernel as the reason names it; ``moe_kernel``: its MoE
    runner; ``qkvz_rows``: in_proj_qkvz's rows in that engine's packing. The backend is the
    reference restricted to bf16 planes (a backend that reads no fp8)."""
    assert message.startswith("mono_ext off: [model] "), message
    for plane, launch, layers, storage, scales in (
        ("in_proj_qkvz", "K1", "layers 0-2", f"[{qkvz_rows}, 128]", f"[{qkvz_rows // 128}, 1]"),
        ("out_proj", "K2", "layers 0-2", "[128, 128]", "[1, 1]"),
        ("qkv_proj", "K1", "layer 3", "[768, 128]", "[6, 1]"),
        ("o_proj", "K2", "layer 3", "[128, 256]", "[1, 2]"),
        ("shared_gate_up", "K2", "layers 0-3", "[256, 128]", "[2, 1]"),
        ("shared_down", "K2", "layers 0-3", "[128, 128]", "[1, 1]"),
    ):
        reason = (
            f"{layers}: {plane}: fp8 block-128 (float8_e4m3fn {storage}, float32 scales "
            f"{scales}, engine kernel {kernel}) recognised; the reference backend's {launch} does "
            "not read fp8 planes yet"
        )
        assert reason in message, (reason, message)
    assert (
        "layers 0-3: w13: fp8 block-128 (float8_e4m3fn [4, 256, 128], float32 scales "
        f"[4, 2, 1], engine kernel {moe_kernel}"
    ) in message
    for bf16 in ("in_proj_ba", "router", "shared_expert_gate"):
        assert f" {bf16}:" not in message, bf16
    assert message.count("recognised") == 8  # one reason per fp8 plane, not per layer
