"""``kernels.triton.launcher``: a planned launch run with new buffers and row counts, against
a plain JIT launch of the same kernel and torch: on CUDA (the compiled variant, launched
directly) or under ``TRITON_INTERPRET=1`` (through the JIT); skipped elsewhere."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

from mono_ext.kernels.triton.launcher import (  # noqa: E402
    ROWS,
    FrozenLaunch,
    Live,
    live_template,
    live_values,
)

INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not (INTERP or torch.cuda.is_available()):
    pytest.skip("needs a CUDA device or TRITON_INTERPRET=1", allow_module_level=True)
DEV = "cpu" if INTERP else "cuda"
N = 64


@triton.jit(do_not_specialize=["n_rows"])
def _axpy(x_ptr, y_ptr, out_ptr, n_rows, scale, N: tl.constexpr, BB: tl.constexpr):
    r = tl.arange(0, BB)[:, None]
    c = tl.arange(0, N)[None, :]
    m = (r < n_rows) & (c < N)
    x = tl.load(x_ptr + r * N + c, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + r * N + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * N + c, (x * scale + y).to(out_ptr.dtype.element_ty), mask=m)


def _bufs(rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, N, generator=g).to(torch.bfloat16)
    y = torch.randn(rows, N, generator=g).to(torch.bfloat16)
    return x.to(DEV), y.to(DEV), torch.full((rows, N), float("nan")).to(torch.bfloat16).to(DEV)


def test_frozen_launch_matches_the_jit_launch_and_torch():
    x, y, out = _bufs(3)
    t, names, values = live_template((x, y, out), (0, 1, 2))
    fl = FrozenLaunch(_axpy, 1, [*t, Live(ROWS), 0.5], names, values,
                      [dict(N=N, BB=16, num_warps=1)], compiled=not INTERP,
                      max_rows=16)  # fmt: skip
    for rows in (3, 1, 16, 7):  # new buffers and row counts on every run
        x, y, out = _bufs(rows)
        assert fl.fits(live_values((x, y, out), (0, 1, 2)))
        ref = out.clone()
        fl.run(live_values((x, y, out), (0, 1, 2)))
        _axpy[(1,)](x, y, ref, rows, 0.5, N=N, BB=16, num_warps=1)
        if DEV == "cuda":
            torch.cuda.synchronize()
        want = (x.float() * 0.5 + y.float()).to(torch.bfloat16)
        assert torch.equal(out, ref)
        assert torch.equal(out, want)
