"""K1's attention front with the stream engine's deal, in plain Triton: device code.

The same program as the Gluon front (``k1_stream_kernel``) without the warp-specialised ring:
every CTA streams an equal contiguous range of ``qkv_proj``'s chunks
(``kernels.triton.stream_schedule.ChunkDeal``) through Triton's own software pipeline, the
loop Triton already streams a full grid with at cuBLAS's rate (docs/perf.md, "One weight
plane streamed"). A chunk is ``BN`` rows (a tile) by ``BK`` columns, a head ``D / BN``
tiles. Before the loop each CTA norms the step's rows into its own bf16 operand buffer
(``k1_norm.own_rows``: ``s * (1 + w)``, the rows' rsqrt applied to the head's sum). In
the loop, a tile's part ends at the tile's last chunk or the CTA's: it is stored at once;
after the loop the CTA counts each of its parts in on its head's counter (an atomic in the
pipelined loop would turn the pipeliner off), and the last of a head's parts sums every
tile's parts in part order and writes the head: gate and v as they are, q and k through the
Gemma head norm and the partial neox RoPE. Nothing waits on another CTA.

Tensor contract: as ``k1_stream_kernel``'s, with ``parts`` [T, MAXP, BB, BN] and one more
scratch, ``xs`` [G, BB, H] bf16 (CTA p's normed rows, written and read by CTA p only).
``TRACE`` builds stamp ``k1_stream_kernel.TRACE_POINTS`` but the first chunk into words 0-4
of CTA p's row of ``trace`` [G, 16] int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mono_ext.kernels.triton.primitives import count_in, stamp
from mono_ext.models.qwen3_next.triton.k1_norm import own_rows

__all__ = ["k1_attn_dealt_kernel"]


@triton.jit
def _owner(c, C: tl.constexpr, G):
    """The CTA whose chunk range holds chunk ``c`` (``ChunkDeal.owner``)."""
    return ((c + 1) * G + C - 1) // C - 1


@triton.jit
def _head_part_count(h, G, C: tl.constexpr, KT: tl.constexpr, TPH: tl.constexpr):
    n = 0
    for r in tl.static_range(TPH):
        t = h * TPH + r
        n += _owner(t * KT + KT - 1, C, G) - _owner(t * KT, C, G) + 1
    return n


@triton.jit
def _head_sum(h, parts_ptr, G, b, d, m2, C: tl.constexpr, KT: tl.constexpr,
              TPH: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr, D: tl.constexpr,
              MAXP: tl.constexpr):  # fmt: skip
    """Head ``h`` at dims ``d`` [BB, D]: tile ``r`` (dims ``r * BN ...``) summed over its
    parts in part order."""
    x = tl.zeros([BB, D], dtype=tl.float32)
    for r in tl.static_range(TPH):
        t = h * TPH + r
        first = _owner(t * KT, C, G)
        n = _owner(t * KT + KT - 1, C, G) - first + 1
        mine = m2 & ((d // BN) == r)[None, :]
        off = b[:, None] * BN + (d - r * BN)[None, :]
        for p in range(n):
            x += tl.load(parts_ptr + (t * MAXP + p) * (BB * BN) + off, mask=mine, other=0.0,
                         cache_modifier=".cg")  # fmt: skip
    return x


@triton.jit
def _head_outputs(h, parts_ptr, G, rstd, qn_ptr, kn_ptr, rope_ptr, pos_ptr, q_ptr, k_ptr,
                  v_ptr, gate_ptr, n_rows, max_pos, eps, HQ: tl.constexpr, HKV: tl.constexpr,
                  D: tl.constexpr, RD: tl.constexpr, BB: tl.constexpr, C: tl.constexpr,
                  KT: tl.constexpr, TPH: tl.constexpr, BN: tl.constexpr,
                  MAXP: tl.constexpr):  # fmt: skip
    """Head ``h`` (q and gate alternating per q head, then k heads, then v heads): its sum
    scaled by the input norm's ``rstd``, then its outputs."""
    HALF: tl.constexpr = RD // 2
    QT: tl.constexpr = 2 * HQ
    b = tl.arange(0, BB)
    d = tl.arange(0, D)
    bm = b < n_rows
    m2 = bm[:, None] & (d[None, :] < D)
    partner = tl.where(d < HALF, d + HALF, tl.where(d < RD, d - HALF, d))
    x = _head_sum(h, parts_ptr, G, b, d, m2, C, KT, TPH, BN, BB, D, MAXP) * rstd[:, None]
    if h >= QT + HKV:  # v head
        j = h - QT - HKV
        tl.store(v_ptr + b[:, None] * (HKV * D) + j * D + d[None, :], x.to(tl.bfloat16), mask=m2)
    elif (h < QT) & (h % 2 == 1):  # gate of q head h // 2
        tl.store(gate_ptr + b[:, None] * (HQ * D) + (h // 2) * D + d[None, :],
                 x.to(tl.bfloat16), mask=m2)  # fmt: skip
    else:  # q head h // 2, or k head h - QT
        xp = _head_sum(h, parts_ptr, G, b, partner, m2, C, KT, TPH, BN, BB, D, MAXP)
        xp = xp * rstd[:, None]
        is_k = h >= QT
        pos = tl.load(pos_ptr + b, mask=bm, other=0)
        pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1).to(tl.int64)
        fi = tl.where(d < HALF, d, tl.where(d < RD, d - HALF, 0))
        rot = bm[:, None] & (d[None, :] < RD)
        cs = rope_ptr + pos[:, None] * RD + fi[None, :]
        cos = tl.load(cs, mask=rot, other=1.0)
        sin = tl.load(cs + HALF, mask=rot, other=0.0)
        nw = tl.where(is_k, kn_ptr, qn_ptr)
        w = tl.load(nw + d).to(tl.float32)
        wp = tl.load(nw + partner).to(tl.float32)
        hr = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        xn = x * hr[:, None] * (1.0 + w[None, :])
        xpn = xp * hr[:, None] * (1.0 + wp[None, :])
        sgn = tl.where(d < HALF, -1.0, 1.0)
        out = tl.where(d[None, :] < RD, xn * cos + sgn[None, :] * xpn * sin, xn)
        base = tl.where(is_k, k_ptr + (h - QT) * D, q_ptr + (h // 2) * D)
        stride = tl.where(is_k, HKV * D, HQ * D)
        tl.store(base + b[:, None] * stride + d[None, :], out.to(tl.bfloat16), mask=m2)


@triton.jit(do_not_specialize=["n_rows", "has_res", "max_pos"])
def k1_attn_dealt_kernel(
    hid_ptr, res_ptr, rout_ptr, nw_ptr, w_ptr, qn_ptr, kn_ptr, rope_ptr, pos_ptr, q_ptr, k_ptr,
    v_ptr, gate_ptr, xs_ptr, parts_ptr, count_ptr, trace_ptr, n_rows, has_res, max_pos, eps,
    H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, RD: tl.constexpr,
    BB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CH: tl.constexpr, NS: tl.constexpr,
    MAXP: tl.constexpr, INTERP: tl.constexpr, TRACE: tl.constexpr = False,
):  # fmt: skip
    pid = tl.program_id(0)
    stamp(trace_ptr, 0, TRACE)
    G = tl.num_programs(0)
    KT: tl.constexpr = H // BK
    TPH: tl.constexpr = D // BN
    C: tl.constexpr = (2 * HQ + 2 * HKV) * TPH * KT
    c0 = pid * C // G
    c1 = (pid + 1) * C // G
    xs_base, rstd = own_rows(hid_ptr, res_ptr, nw_ptr, xs_ptr, rout_ptr, pid, n_rows, has_res,
                              eps, H, BB, CH)  # fmt: skip
    stamp(trace_ptr, 1, TRACE)
    rows = tl.arange(0, BB)
    rmask = rows < n_rows
    nn = tl.arange(0, BN)
    kk = tl.arange(0, BK)
    acc = tl.zeros([BN, BB], dtype=tl.float32)  # acc^T: weight rows x batch rows
    for c in tl.range(c0, c1, num_stages=NS):
        t = c // KT
        kc = c - t * KT
        k = kc * BK + kk
        wt = tl.load(w_ptr + (t * BN + nn).to(tl.int64)[:, None] * H + k[None, :])
        xt = tl.load(xs_base + rows[None, :] * H + k[:, None], mask=rmask[None, :], other=0.0)
        acc = tl.dot(wt, xt, acc)
        if (kc == KT - 1) | (c == c1 - 1):  # the part ends: its tile's last chunk or ours
            part = parts_ptr + (t * MAXP + pid - _owner(t * KT, C, G)) * (BB * BN)
            tl.store(part + rows[None, :] * BN + nn[:, None], acc, mask=rmask[None, :])
            acc = tl.zeros_like(acc)
    # no stamp inside the loop: the barrier it takes would stop Triton's pipeliner, so this
    # program has no "first chunk" point
    stamp(trace_ptr, 3, TRACE)
    for t in range(c0 // KT, (c1 - 1) // KT + 1):
        h = t // TPH
        if count_in(count_ptr + h, _head_part_count(h, G, C, KT, TPH), INTERP):
            _head_outputs(h, parts_ptr, G, rstd, qn_ptr, kn_ptr, rope_ptr, pos_ptr, q_ptr,
                          k_ptr, v_ptr, gate_ptr, n_rows, max_pos, eps, HQ, HKV, D, RD, BB, C,
                          KT, TPH, BN, MAXP)  # fmt: skip
            stamp(trace_ptr, 4, TRACE)
