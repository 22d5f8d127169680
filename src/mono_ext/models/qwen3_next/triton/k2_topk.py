"""K2's router top-k of one row: softmax, then the TOPK largest probabilities and their ranks,
found in threshold rounds over unique int keys (:func:`topk_keys`): one block-wide max per
pick, each a warp reduction, a shared-memory exchange and its barriers.

Why not Triton's bitonic ``tl.topk`` over the same keys: the same bits, but slower on an H100
(the picks about 4 us later at width 1; docs/results/k2_ab_counter_bitonic_h100.csv).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["topk_keys", "topk_row"]


@triton.jit
def topk_keys(lg, valid, offs_e):
    """A row's softmax ``p`` over [1, EP] logits and one unique int key per expert: p's fp32
    bits (p >= 0: int order = float order) with the low 9 bits replaced by (511 - e). Ties
    within 2^-14 relative (far below one bf16 step: near ties) go to the lower expert id.
    Padding experts get INT32_MIN, below every real key (a NaN row's too), so a live row
    always has exactly TOPK picks."""
    lg = tl.where(valid, lg, float("-inf"))
    mx = tl.max(lg, axis=1)
    p = tl.where(valid, tl.exp(lg - mx[:, None]), 0.0)
    den = tl.sum(p, axis=1)
    p = p / tl.where(den > 0.0, den, 1.0)[:, None]
    key = (p.to(tl.int32, bitcast=True) & ~511) | (511 - offs_e[None, :])
    return p, tl.where(valid, key, -2147483648)


@triton.jit
def topk_row(lg, valid, offs_e, TOPK: tl.constexpr, NORM_TOPK: tl.constexpr):
    """Softmax top-k of one row's [1, EP] logits (``valid``: the real experts). Returns (sel,
    prank, wts): the picks, each pick's rank in the row (0 = largest probability; meaningful
    where ``sel``) and the routing weights (0 elsewhere)."""
    p, key = topk_keys(lg, valid, offs_e)
    prank = tl.zeros_like(key)
    thr = tl.max(key, axis=1)
    for _j in tl.static_range(TOPK - 1):
        below = key < thr[:, None]
        prank += below.to(tl.int32)  # a pick's rank: how many picks beat it
        thr = tl.max(tl.where(below, key, -2147483648), axis=1)
    sel = valid & (key >= thr[:, None])
    wts = tl.where(sel, p, 0.0)
    if NORM_TOPK:
        wsum = tl.sum(wts, axis=1)
        wts = wts / tl.where(wsum > 0.0, wsum, 1.0)[:, None]
    return sel, prank, wts
