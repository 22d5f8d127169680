"""The fp8 plane reader of K1/K2 (``kernels.triton.planes.qdot``) against the product with the
dequantized plane, over every finite e4m3fn code, for each scale format.

Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1`` (the same kernel through Triton's
interpreter). Each check draws fresh codes, scales and activations and poisons the output.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

planes = pytest.importorskip("mono_ext.kernels.triton.planes")
FORMAT_CODES, plane_reasons, qdot, scale_numel = (
    planes.FORMAT_CODES,
    planes.plane_reasons,
    planes.qdot,
    planes.scale_numel,
)

INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not (INTERP or torch.cuda.is_available()):
    pytest.skip("needs a CUDA device or TRITON_INTERPRET=1", allow_module_level=True)


DEV = "cpu" if INTERP else "cuda"
BB = 16


@triton.jit
def _gemv(w_ptr, s_ptr, x_ptr, out_ptr, n_rows, N: tl.constexpr, K: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, Q: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    nn = pid * BN + tl.arange(0, BN)
    b = tl.arange(0, 16)
    kk = tl.arange(0, BK)
    acc = tl.zeros([BN, 16], dtype=tl.float32)
    for k0 in range(0, K, BK):
        w = tl.load(w_ptr + nn[:, None] * K + (k0 + kk)[None, :])
        x = tl.load(x_ptr + b[None, :] * K + (k0 + kk)[:, None], mask=(b < n_rows)[None, :],
                    other=0.0)  # fmt: skip
        acc = qdot(w, x, acc, s_ptr, nn, nn < N, k0, Q, N, K)
    tl.store(out_ptr + b[None, :] * N + nn[:, None], acc, mask=(b < n_rows)[None, :])


def _finite_codes() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32)
    return codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # 0x7F / 0xFF are e4m3fn's NaNs


def _scales(fmt: str, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(the engine-shaped scale tensor, the per-element scale [N, K]) with powers of two and
    arbitrary values mixed (vLLM's DeepGEMM path requantizes to powers of two; others do not)."""
    num = scale_numel(fmt, n, k)
    s = torch.rand(num, generator=gen) * 2 + 0.01
    s[::3] = 2.0 ** torch.randint(-12, 4, (len(s[::3]),), generator=gen).float()
    if fmt == "fp8_block128":
        s = s.view(-(-n // 128), -(-k // 128))
        full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    elif fmt == "fp8_channel":
        s = s.view(n, 1)
        full = s.expand(n, k)
    else:
        full = s.view(1, 1).expand(n, k)
    return s, full


@pytest.mark.parametrize("fmt", ["fp8_block128", "fp8_channel", "fp8_tensor"])
@pytest.mark.parametrize("width", [1, 5, 16])
def test_qdot_equals_the_dequantized_product_over_every_code(fmt, width):
    n, k, bn, bk = 256, 384, 64, 128
    gen = torch.Generator().manual_seed(hash((fmt, width)) % 2**31)
    for _check in range(2):
        codes = _finite_codes()
        # every finite code, many times, at fresh random places
        flat = codes[torch.randint(0, len(codes), (n * k,), generator=gen)]
        flat[torch.randperm(n * k, generator=gen)[: len(codes)]] = codes
        w = flat.view(n, k).view(torch.float8_e4m3fn)
        scale, full = _scales(fmt, n, k, gen)
        x = torch.randn(BB, k, generator=gen).to(torch.bfloat16)
        out = torch.full((BB, n), float("nan"), dtype=torch.float32)
        ref = x[:width].double() @ (w.double() * full.double()).t()
        wd, sd, xd, od = (t.to(DEV) for t in (w, scale, x, out))
        _gemv[(n // bn,)](wd, sd, xd, od, width, N=n, K=k, BN=bn, BK=bk, Q=FORMAT_CODES[fmt])
        got = od.cpu()[:width].double()
        assert torch.isfinite(got).all()
        # fp32 sums of exact products: within fp32 rounding of the dequantized product
        err = (got - ref).abs().max() / ref.abs().max()
        assert err < 1e-5, f"{fmt} width {width}: max error {err:.2e} of the largest output"
        assert torch.isnan(od.cpu()[width:]).all(), "rows past the width were written"


def test_a_nan_code_reaches_only_its_own_output_row():
    n, k = 64, 128
    w = torch.randint(0, 0x70, (n, k), dtype=torch.uint8)
    w[7, 5] = 0x7F  # NaN
    w = w.view(torch.float8_e4m3fn)
    s = torch.rand(1, 1) + 0.5
    x = torch.randn(BB, k).to(torch.bfloat16)
    out = torch.zeros(BB, n)
    wd, sd, xd, od = (t.to(DEV) for t in (w, s, x, out))
    _gemv[(1,)](wd, sd, xd, od, BB, N=n, K=k, BN=64, BK=128, Q=FORMAT_CODES["fp8_block128"])
    got = od.cpu()
    assert torch.isnan(got[:, 7]).all()
    assert torch.isfinite(torch.cat([got[:, :7], got[:, 8:]], 1)).all()


def test_plane_reasons_name_dtype_scale_and_shape_problems():
    w = torch.zeros(256, 384, dtype=torch.float8_e4m3fn)
    ok = {"p": w, "p.scale": torch.ones(2, 3)}
    assert plane_reasons("p", ok, "fp8_block128", (256, 384)) == []
    assert plane_reasons("p", {"p": w}, "fp8_block128", (256, 384)) == [
        "missing p.scale (fp8_block128 planes need their fp32 scales)"
    ]
    bad = plane_reasons("p", {"p": w, "p.scale": torch.ones(256)}, "fp8_block128", (256, 384))
    assert bad and "expected 6 dense float32 scales" in bad[0]
    assert (
        plane_reasons("p", {"p": w, "p.scale": torch.ones(256, 1)}, "fp8_channel", (256, 384)) == []
    )
    assert "expected torch.bfloat16" in plane_reasons("p", {"p": w}, "bf16", (256, 384))[0]
    wrong = plane_reasons("p", ok, "fp8_block128", (256, 256))
    assert wrong[0] == "p is (256, 384), expected (256, 256)"
