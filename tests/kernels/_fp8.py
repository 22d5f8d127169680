"""Test-side fp8 quantization of bf16 planes, in the layouts the engines keep (see
``kernels.triton.planes``): codes e4m3fn [.., N, K], fp32 scales, and the fp32 dequantized
plane the reference computes with (the kernels must match the product with it)."""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite e4m3fn value


def quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scale, dequantized fp32) of plane ``w`` [.., N, K] in ``fmt`` (fp8_block128 with
    N, K multiples of 128, fp8_channel, fp8_tensor)."""
    x = w.float()
    *lead, n, k = x.shape
    if fmt == "fp8_block128":
        blocks = x.reshape(*lead, n // 128, 128, k // 128, 128)
        amax = blocks.abs().amax(dim=(-3, -1))  # [.., N/128, K/128]
        scale = (amax / FP8_MAX).clamp_min(1e-12)
        full = scale.repeat_interleave(128, -2).repeat_interleave(128, -1)
    elif fmt == "fp8_channel":
        scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)  # [.., N, 1]
        full = scale.expand_as(x)
    elif fmt == "fp8_tensor":
        scale = (x.abs().amax(dim=(-2, -1)) / FP8_MAX).clamp_min(1e-12)  # [..] (one per expert)
        full = scale[..., None, None].expand_as(x)
    else:
        raise ValueError(fmt)
    codes = (x / full).to(torch.float8_e4m3fn)
    return codes, scale.contiguous(), codes.float() * full


def quantize_planes(weights: dict, formats: dict) -> tuple[dict, dict]:
    """(the kernel's weights: codes + ``<plane>.scale``, the reference's: dequantized fp32) for
    the planes ``formats`` names; other planes are shared as they are."""
    kern, ref = dict(weights), dict(weights)
    for plane, fmt in formats.items():
        codes, scale, deq = quantize(weights[plane], fmt)
        kern[plane], kern[plane + ".scale"], ref[plane] = codes, scale, deq
    return kern, ref
