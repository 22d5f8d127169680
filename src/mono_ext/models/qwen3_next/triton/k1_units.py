"""K1's S1 units: which projection rows and K chunk each iteration of a CTA's flattened S1
loop streams (``k1_plan.s1_units`` is the host side), where a GDN tile's rows go, the L2
prefetch of a future chunk, and the tail tiles' split sum, shared by both fronts
(``k1_kernel``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mono_ext.kernels.triton.primitives import count_in
from mono_ext.models.qwen3_next.triton.k1_words import prefetch_l2

__all__ = ["gdn_tile_rows", "prefetch_chunk", "s1_chunk", "s1_iterations", "tail_sum"]


@triton.jit
def s1_chunk(it, pid, G, FT: tl.constexpr, SPLIT: tl.constexpr, TR: tl.constexpr,
             BN: tl.constexpr, KCH: tl.constexpr):  # fmt: skip
    """Flattened S1 iteration ``it`` of CTA ``pid`` (``k1_plan.s1_units``): its first row in
    row space, its rows, its K chunk, whether it is its unit's first chunk, and whether it
    finishes a whole tile here (its epilogue runs now). A CTA's units are the full tiles pid,
    pid + G, ... (``FT`` over whole rounds of the grid, ``BN`` rows, every K chunk), then tail
    unit pid: part pid % SPLIT of tail tile pid // SPLIT (``TR`` rows), ``KCH / SPLIT``
    consecutive chunks. A split tail tile is finished after the loop (:func:`tail_sum`)."""
    KCU: tl.constexpr = KCH // SPLIT
    n_full = (FT // G) * KCH
    tail = it >= n_full
    j = it // KCH
    kc_f = it - j * KCH
    kc_t = it - n_full
    r0 = tl.where(tail, FT * BN + (pid // SPLIT) * TR, (pid + j * G) * BN)
    kc = tl.where(tail, (pid % SPLIT) * KCU + kc_t, kc_f)
    first = tl.where(tail, kc_t == 0, kc_f == 0)
    ends_tile = tl.where(tail, (kc_t == KCU - 1) & (SPLIT == 1), kc_f == KCH - 1)
    return r0, tl.where(tail, TR, BN), kc, first, ends_tile


@triton.jit
def s1_iterations(pid, G, FT: tl.constexpr, NU: tl.constexpr, SPLIT: tl.constexpr,
                   KCH: tl.constexpr):  # fmt: skip
    """How many flattened S1 iterations CTA ``pid`` runs (:func:`s1_chunk`)."""
    return (FT // G) * KCH + tl.where(pid < NU, KCH // SPLIT, 0)


@triton.jit
def tail_sum(acc, tt, pid, split_ptr, rows, rmask, BN: tl.constexpr, BB: tl.constexpr,
              SPLIT: tl.constexpr, NTT: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """A tail unit's last chunk: store this CTA's K part ``acc`` [BN, Bb] of tail tile ``tt``,
    then count itself in on the tile's counter. Returns (last, sum): the last of the tile's
    ``SPLIT`` units to arrive sums every part in part order (fixed, whatever the arrival
    order: the same bits every launch) and resets the counter for the next launch; the
    others return (False, zeros) and never wait. Parts live in ``split_ptr`` (the
    ``s1_split`` region: fp32 [NTT, SPLIT, Bb, BN], then NTT int32 counters)."""
    parts = split_ptr.to(tl.pointer_type(tl.float32))
    count = (parts + NTT * SPLIT * BB * BN).to(tl.pointer_type(tl.int32)) + tt
    nn = tl.arange(0, BN)
    offs = rows[None, :] * BN + nn[:, None]  # batch-row major: a narrow step's rows are dense
    m = rmask[None, :] & (nn < BN)[:, None]
    tile = parts + tt * (SPLIT * BB * BN)
    tl.store(tile + (pid % SPLIT) * (BB * BN) + offs, acc, mask=m)
    last = count_in(count, SPLIT, INTERP)
    total = tl.zeros_like(acc)
    if last:
        for p in tl.static_range(SPLIT):
            total += tl.load(tile + p * (BB * BN) + offs, mask=m, other=0.0, cache_modifier=".cg")
    return last, total


@triton.jit
def prefetch_chunk(w_ptr, w2_ptr, it, n_it, pid, G, KCH, NA, LIM1, LIM2, H: tl.constexpr,
                   FT: tl.constexpr, SPLIT: tl.constexpr, TR: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):  # fmt: skip
    """L2-prefetch the bf16 weight chunk of flattened iteration ``it`` (one 128-byte line per
    thread): row-space rows ``< NA`` are rows of ``w_ptr`` (``LIM1`` rows), later ones of
    ``w2_ptr``."""
    LPR: tl.constexpr = BK // 64  # 128-byte lines per row of a [BN, BK] bf16 chunk
    r0, nr, kc, _, _ = s1_chunk(it, pid, G, FT, SPLIT, TR, BN, KCH)
    first = r0 < NA
    wb = tl.where(first, w_ptr, w2_ptr)
    lim = tl.where(first, LIM1, LIM2)
    li = tl.arange(0, BN * LPR)
    rr = li // LPR
    r = tl.where(first, r0, r0 - NA) + rr
    prefetch_l2(wb + r * H + kc * BK + (li % LPR) * 64, (it < n_it) & (rr < nr) & (r < lim))


@triton.jit
def _payload_word(p, PQ: tl.constexpr, PBA: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                  DV: tl.constexpr, RR: tl.constexpr, INTERLEAVED: tl.constexpr):  # fmt: skip
    """Payload word of projection row ``p`` (``in_proj_qkvz`` rows, then ``in_proj_ba``);
    -1 past the end. Arithmetic mirror of :func:`gdn_row_map` (no table load: one memory
    round trip less in front of every tile's epilogue)."""
    KD: tl.constexpr = (HV // RR) * DK
    VD: tl.constexpr = HV * DV
    CONV: tl.constexpr = 2 * KD + VD
    if INTERLEAVED:
        RDV: tl.constexpr = RR * DV
        GS: tl.constexpr = 2 * DK + 2 * RDV
        g = p // GS
        o = p - g * GS
        dq = tl.where(
            o < DK,
            g * DK + o,
            tl.where(
                o < 2 * DK,
                KD + g * DK + (o - DK),
                tl.where(o < 2 * DK + RDV, 2 * KD + g * RDV + (o - 2 * DK),
                         CONV + g * RDV + (o - 2 * DK - RDV)),
            ),
        )  # fmt: skip
        pb = p - PQ
        gb = pb // (2 * RR)
        ob = pb - gb * (2 * RR)
        dba = tl.where(ob < RR, CONV + VD + gb * RR + ob, CONV + VD + HV + gb * RR + (ob - RR))
        d = tl.where(p < PQ, dq, dba)
    else:
        d = p
    return tl.where(p < PQ + PBA, d, -1)


@triton.jit
def gdn_tile_rows(r0, nr, nn, NA: tl.constexpr, PQ: tl.constexpr, PBA: tl.constexpr,
                   HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, RR: tl.constexpr,
                   INTERLEAVED: tl.constexpr):  # fmt: skip
    """The ``nr`` rows of the GDN tile at row-space row ``r0`` (in_proj_ba rows padded to
    ``NA``, then in_proj_qkvz rows): whether it is the ba tile, each row's stored row in its
    plane (also its scale row), whether that row exists, and its payload word (-1: none)."""
    is_ba = r0 < NA
    rs = r0 + nn
    r_in = tl.where(is_ba, rs, rs - NA)
    live = (nn < nr) & (r_in < tl.where(is_ba, PBA, PQ))
    p = tl.where(is_ba, PQ + rs, rs - NA)
    dest = tl.where(live, _payload_word(p, PQ, PBA, HV, DK, DV, RR, INTERLEAVED), -1)
    return is_ba, r_in, live, dest
