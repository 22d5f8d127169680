"""K2's router top-k of one row (``k2_topk.topk_row``): exactly TOPK picks, never a padding
expert, ranks 0..TOPK-1, the TOPK largest probabilities in order, and the routing weights
those probabilities (renormalised over the picks where the model says so).

Runs the helper in a one-row kernel: on a CUDA device, or under ``TRITON_INTERPRET=1``
without one. Fresh random logits per case at several scales, exact ties, a NaN row and
padded experts (E < EP); outputs poisoned before each run.
"""

import os
import zlib

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not torch.cuda.is_available() and not INTERP:
    pytest.skip("needs a CUDA device (or TRITON_INTERPRET=1)", allow_module_level=True)

import triton.language as tl  # noqa: E402

from mono_ext.models.qwen3_next.triton.k2_topk import topk_row  # noqa: E402

DEV = "cpu" if INTERP else "cuda"
ROWS = 6


@triton.jit
def _rows_topk(lg_ptr, sel_ptr, prank_ptr, wts_ptr, E: tl.constexpr, EP: tl.constexpr,
               TOPK: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    offs_e = tl.arange(0, EP)
    valid = (offs_e < E)[None, :]
    at = tl.program_id(0) * EP + offs_e[None, :]
    lg = tl.load(lg_ptr + at, mask=valid, other=0.0)
    sel, prank, wts = topk_row(lg, valid, offs_e, TOPK, NORM)
    tl.store(sel_ptr + at, sel.to(tl.int32))
    tl.store(prank_ptr + at, tl.where(sel, prank, -1))
    tl.store(wts_ptr + at, wts)


def _run(lg, e, topk, norm):
    ep = lg.shape[1]
    sel = torch.full(lg.shape, -7, dtype=torch.int32, device=DEV)
    prank = torch.full_like(sel, -7)
    wts = torch.full(lg.shape, float("nan"), device=DEV)
    _rows_topk[(lg.shape[0],)](lg, sel, prank, wts, e, ep, topk, norm)
    return sel, prank, wts


def _logits(case, e, ep, gen):
    scale = {"unit": 1.0, "wide": 12.0, "narrow": 1e-3, "ties": 1.0, "nan": 1.0}[case]
    lg = torch.randn(ROWS, ep, generator=gen, device=DEV) * scale
    if case == "ties":
        lg[:, : e // 4] = lg[:, :1]  # a quarter of the experts tied with expert 0
    if case == "nan":
        lg[1] = float("nan")
    lg[:, e:] = float("nan")  # padding past E: never read as logits
    return lg


@pytest.mark.parametrize(
    "e, ep, topk", [(512, 512, 10), (500, 512, 10), (256, 256, 8), (60, 64, 3)]
)
@pytest.mark.parametrize("case", ["unit", "wide", "narrow", "ties", "nan"])
@pytest.mark.parametrize("norm", [True, False])
def test_topk_picks_the_largest_probabilities_in_order(e, ep, topk, case, norm):
    gen = torch.Generator(device=DEV).manual_seed(zlib.crc32(f"{e} {topk} {case} {norm}".encode()))
    lg = _logits(case, e, ep, gen)
    sel, prank, wts = _run(lg, e, topk, norm)

    for r in range(ROWS):
        picked = sel[r, :e].nonzero().flatten()
        assert picked.numel() == topk, f"row {r}: {picked.numel()} picks"
        assert not sel[r, e:].any(), f"row {r}: a padding expert picked"
        ranks = prank[r, picked]
        assert sorted(ranks.tolist()) == list(range(topk)), f"row {r}: ranks {ranks.tolist()}"
        if case == "nan" and r == 1:
            continue
        p = torch.softmax(lg[r, :e].double(), dim=0)
        order = picked[torch.argsort(ranks)]
        # the picks by rank are the largest probabilities, largest first; the keys keep 14
        # bits of p's mantissa, so within 2^-14 relative a lower id may rank first (2^-19
        # more: the kernel's fp32 softmax against this float64 one)
        tol = 1 - 2**-14 - 2**-19
        assert torch.all(p[order][:-1] >= p[order][1:] * tol), f"row {r}: ranks out of order"
        rest = torch.ones(e, dtype=torch.bool, device=DEV)
        rest[picked] = False
        if rest.any():
            assert p[order[-1]] >= p[rest].max() * tol, f"row {r}: a larger p left out"
        want = torch.zeros_like(p)
        want[picked] = p[picked]
        if norm:
            want = want / want.sum()
        assert torch.allclose(wts[r, :e].double(), want, rtol=1e-5, atol=1e-7), f"row {r}: weights"
        assert not wts[r, e:].any(), f"row {r}: a padding expert weighted"
