"""Shared fp32 building blocks of the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "f32",
    "gemma_rms_norm",
    "add_gemma_rms_norm",
    "gated_rms_norm",
    "l2_normalize",
    "bf16_ulp",
    "rel_l2",
]

# FLA's l2norm and vLLM's packed decode kernel use x / sqrt(sum(x^2) + 1e-6)
# (vllm/third_party/flash_linear_attention/ops/fused_recurrent.py, 0.26.0).
L2NORM_EPS = 1e-6


def f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def gemma_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * (1 + w)`` over the last dim, fp32."""
    x = f32(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + f32(w))


def add_gemma_rms_norm(
    hidden: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fused add + norm: returns (norm(s), s) with s = hidden (+ residual)."""
    s = f32(hidden) if residual is None else f32(hidden) + f32(residual)
    return gemma_rms_norm(s, w, eps), s


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm (norm before gate, plain weight): ``w * rmsnorm(x) * silu(z)``."""
    x = f32(x)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return f32(w) * y * F.silu(f32(z))


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    x = f32(x)
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (8 significant bits): 2^(floor(log2|x|) - 7).

    Zero maps to the smallest normal bf16 spacing so a 0-vs-0 comparison counts as a tie.
    """
    x = f32(x).abs()
    _, e = torch.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(x), e - 8)
    return torch.where(x > 0, ulp, torch.full_like(x, 2.0**-133))


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||b||, tiny) in fp64 (b is the reference)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
