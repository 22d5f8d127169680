"""What both engines' FP8 block-128 refusal must say, plane by plane (tests/e2e/test_vllm_quant.py,
tests/e2e/test_sglang_quant.py): the tiny Qwen3-Next checkpoint with fp8 dense planes and experts
(3 GDN layers, 1 attention layer), refused at the model stage by the reference backend."""

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
    import torch
    from safetensors.torch import load_file, save_file

    from mono_ext.tools.checkpoint import make_checkpoint

    make_checkpoint(out, config, seed=0)
    tensors = {}
    for name, t in load_file(str(out / "model.safetensors")).items():
        if not (name.startswith("model.layers.") and name.endswith(QUANTIZED)):
            tensors[name] = t
            continue
        n, k = t.shape
        blocks = t.float().view(n // 128, 128, k // 128, 128)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / 448.0
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k)
        tensors[name] = q
        tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    keep = ["lm_head", "model.embed_tokens"]
    for i in range(cfg["num_hidden_layers"]):
        keep += [f"model.layers.{i}.{m}" for m in ("mlp.gate", "mlp.shared_expert_gate")]
        if cfg["layer_types"][i] == "linear_attention":
            keep.append(f"model.layers.{i}.linear_attn.in_proj_ba")
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": keep,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def assert_fp8_block_reasons(message: str, kernel: str, moe_kernel: str, qkvz_rows: int) -> None:
    """``kernel``: the engine's dense fp8 kernel as the reason names it; ``moe_kernel``: its MoE
    runner; ``qkvz_rows``: in_proj_qkvz's rows in that engine's packing."""
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
            "not read fp8 planes yet (issue 9)"
        )
        assert reason in message, (reason, message)
    assert (
        "layers 0-3: w13: fp8 block-128 (float8_e4m3fn [4, 256, 128], float32 scales "
        f"[4, 2, 1], engine kernel {moe_kernel}"
    ) in message
    for bf16 in ("in_proj_ba", "router", "shared_expert_gate"):
        assert f" {bf16}:" not in message, bf16
    assert message.count("recognised") == 8  # one reason per fp8 plane, not per layer
