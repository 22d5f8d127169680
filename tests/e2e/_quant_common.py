"""What both engines' FP8 block-128 refusal must say, plane by plane (tests/e2e/test_vllm_quant.py,
tests/e2e/test_sglang_quant.py): the tiny Qwen3-Next checkpoint with fp8 dense planes and experts
(3 GDN layers, 1 attention layer), refused at the model stage by the reference backend."""

from __future__ import annotations


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
