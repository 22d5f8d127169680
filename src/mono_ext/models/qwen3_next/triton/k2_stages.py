"""K2's stages, each an inlined ``@triton.jit`` helper that ``k2_kernel`` runs in order (the
device helpers they share are ``k2_sync.py``).

S1 out_proj partials and their reduce (+ residual, and the norm's parts: each row's u = r *
(1 + w) and per column block its sums), S2 every row's rsqrt from those sums and the router
logits, S3 each row's top-k (one CTA per row, its picks published) and the union with the
gate_up activations, S4 the down partials per (pair, H row), their reduce (each row's pairs in
a fixed order) and, at TP > 1, the rank sums. A stage hands its results to the next through
tagged words (``runtime.layout``), waited for with bounded waits; the one exception, the
shared u planes, sits behind the tagged sums, with a fence on each side. The CPU interpreter
runs one stage per launch, so there every hand-off is written before it is read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mono_ext.kernels.triton.planes import (
    qdot,
    qdot_a8q,
    qdot_either,
    quantize_e4m3_cols,
    scale_index,
)
from mono_ext.kernels.triton.primitives import (
    fence_gpu,
    fp32_bits,
    put_words,
    stamp,
    unpack_value,
    words_to_fp32,
)
from mono_ext.models.qwen3_next.triton.k2_sync import (
    prefetch_l2,
    put_partial,
    sum_partials,
    wait2d,
    wait_live_rows,
)
from mono_ext.models.qwen3_next.triton.k2_topk import topk_row

__all__ = [
    "s1_out_proj",
    "s1_reduce",
    "s2_norm_sums",
    "router_tile",
    "s2_router",
    "s3_gate_up",
    "s3_topk",
    "s3_topk_local",
    "s3_union",
    "s4_down",
    "s4_ranks",
    "s4_reduce",
]


@triton.jit
def _o_in_tile(o_in_ptr, gate_ptr, offs, mask, GATED: tl.constexpr):
    """A bf16 tile of out_proj's input; ``GATED``: bf16(o_in * sigmoid(gate)), fp32 math
    (the attention layers' output gate, folded into S1's load)."""
    x = tl.load(o_in_ptr + offs, mask=mask, other=0.0)
    if GATED:
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * tl.sigmoid(g)).to(tl.bfloat16)
    return x


@triton.jit
def s1_out_proj(
    o_in_ptr, gate_ptr, w_o_ptr, s_o_ptr, router_ptr, sgu_ptr, scratch_ptr, peers_ptr, pid, G,
    rows, rmask, nn, slot1, rank, tag, H: tl.constexpr, KO: tl.constexpr, E: tl.constexpr,
    ISR: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr, BK1: tl.constexpr,
    KSPL1: tl.constexpr, PIPE1: tl.constexpr, OFF_P1: tl.constexpr, RANKS: tl.constexpr,
    SYS: tl.constexpr, W_P: tl.constexpr, EBSG: tl.constexpr, GATED: tl.constexpr,
    Q_O: tl.constexpr, Q_R: tl.constexpr, PF1: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """S1: out_proj^T row blocks x K splits, one fp32 partial per (K split, H row) into
    ``p1`` (TP > 1: pushed to every rank); then ``PF1`` bit 1 the router, bit 2 the shared
    gate_up into L2."""
    I8: tl.constexpr = tl.pointer_type(tl.int8)  # prefetches address bytes (planes differ)
    RB1: tl.constexpr = (H + BN - 1) // BN
    KSP1: tl.constexpr = ((KO + KSPL1 - 1) // KSPL1 + BK1 - 1) // BK1 * BK1  # K per split
    KCH1: tl.constexpr = KSP1 // BK1
    T1: tl.constexpr = RB1 * KSPL1
    n_it = tl.where(pid < T1, (T1 - 1 - pid) // G + 1, 0) * KCH1
    kk = tl.arange(0, BK1)
    acc = tl.zeros([BN, BB], dtype=tl.float32)
    # task t = pid + j * G: row block t % RB1, K split t // RB1; Triton's pipeliner keeps
    # PIPE1 chunks in flight across task boundaries (one flat loop: the stream never drains)
    for it in tl.range(0, n_it, num_stages=PIPE1):
        j = it // KCH1
        kc = it - j * KCH1
        t = pid + j * G
        hr = (t % RB1) * BN + nn
        k = (t // RB1) * KSP1 + kc * BK1 + kk
        km = (k < KO) & (k < (t // RB1 + 1) * KSP1)
        w_t = tl.load(
            w_o_ptr + hr[:, None] * KO + k[None, :],
            mask=(hr[:, None] < H) & km[None, :],
            other=0.0,
        )
        x_t = _o_in_tile(o_in_ptr, gate_ptr, rows[None, :] * KO + k[:, None],
                         rmask[None, :] & km[:, None], GATED)  # fmt: skip
        acc = qdot(w_t, x_t, acc, s_o_ptr, hr, hr < H, (t // RB1) * KSP1 + kc * BK1, Q_O, H,
                   KO)  # fmt: skip
        if kc == KCH1 - 1:
            put_partial(
                scratch_ptr, peers_ptr, OFF_P1, slot1 + rank * KSPL1 + t // RB1, acc, hr,
                rows, rmask[None, :] & (hr[:, None] < H), tag, RANKS, W_P, H, SYS, INTERP,
            )  # fmt: skip
            acc = tl.zeros([BN, BB], dtype=tl.float32)
    # weights the next stages surely read, pulled into L2 during the hand-offs
    lane = tl.arange(0, 128)
    part = pid + G * lane
    if PF1 & 1:
        tot_r: tl.constexpr = E * H * (1 if Q_R else 2)
        ch_r: tl.constexpr = (tot_r // 16 + 127) // 128 * 16
        nb_r = tl.minimum(tl.maximum(tot_r - part * ch_r, 0), ch_r)
        prefetch_l2(router_ptr.to(I8) + part * ch_r, nb_r, nb_r > 0)
    if PF1 & 2:
        tot_s: tl.constexpr = 2 * ISR * H * EBSG
        ch_s: tl.constexpr = (tot_s // 16 + 127) // 128 * 16
        nb_s = tl.minimum(tl.maximum(tot_s - part * ch_s, 0), ch_s)
        prefetch_l2(sgu_ptr.to(I8) + part * ch_s, nb_s, nb_s > 0)


@triton.jit
def s1_reduce(
    res_in_ptr, out_r_ptr, p1_read, norm_w_ptr, seg_ptr, s_seg_ptr, xn_base, nsum_ptr, ctrl_ptr,
    health_ptr, pid, G, rows, rmask, n_rows, slot1, tag, H: tl.constexpr, BB: tl.constexpr,
    CB: tl.constexpr, TR: tl.constexpr, NS1: tl.constexpr, W_P: tl.constexpr,
    RID_P1: tl.constexpr, Q_SEG: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """S1 reduce: out_proj partials of all ranks and K splits summed in order, + residual ->
    ``out_residual``, and the norm's parts of those columns (:func:`_norm_parts`)."""
    for t in range(pid, TR, G):
        cols = t * CB + tl.arange(0, CB)
        cm = rmask[:, None] & (cols[None, :] < H)
        s1 = sum_partials(
            p1_read, slot1, RID_P1, n_rows, cols, tag, ctrl_ptr, health_ptr,
            NS1, W_P, H, BB, CB, INTERP,
        )  # fmt: skip
        off = rows[:, None] * H + cols[None, :]
        r = tl.load(res_in_ptr + off, mask=cm, other=0.0).to(tl.float32) + s1
        tl.store(out_r_ptr + off, r.to(tl.bfloat16), mask=cm)
        _norm_parts(r, t, cols, cm, off, rows, rmask, norm_w_ptr, seg_ptr, s_seg_ptr, xn_base,
                    nsum_ptr, tag, H, BB, Q_SEG, INTERP)  # fmt: skip


@triton.jit
def _norm_parts(
    r, t, cols, cm, off, rows, rmask, norm_w_ptr, seg_ptr, s_seg_ptr, xn_base, nsum_ptr, tag,
    H: tl.constexpr, BB: tl.constexpr, Q_SEG: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """The norm's share of reduce task ``t``: its columns of u = r * (1 + w) as bf16 hi + lo
    planes into the shared ``xn`` planes, then per row this block's sum of r^2 and of u *
    shared_expert_gate as tagged words (t, row, 2) of ``nsum``. Gemma's RMSNorm is u times one
    scalar per row, so the router and gate_up multiply u and scale their sums by the row's
    rsqrt afterwards: no CTA waits for a whole row before its GEMVs, and the residual reaches
    the router in one hand-off (a norm of its own would wait for the whole row, then hand the
    normed row on: two)."""
    nw, sg_w = _norm_weights(norm_w_ptr, seg_ptr, s_seg_ptr, cols, H, Q_SEG)
    u = tl.where(cm, r * (1.0 + nw[None, :]), 0.0)
    u_hi = u.to(tl.bfloat16)
    tl.store(xn_base + off, u_hi, mask=cm)
    tl.store(xn_base + BB * H + off, (u - u_hi.to(tl.float32)).to(tl.bfloat16), mask=cm)
    ssq = tl.sum(tl.where(cm, r * r, 0.0), axis=1)
    sgp = tl.sum(u * sg_w[None, :], axis=1)
    tl.debug_barrier()  # every thread's plane stores, then each thread's fence, then the sums
    fence_gpu(INTERP)
    at = t * (2 * BB) + rows * 2
    put_words(nsum_ptr, at, fp32_bits(ssq), rmask, tag, INTERP)
    put_words(nsum_ptr, at + 1, fp32_bits(sgp), rmask, tag, INTERP)


@triton.jit
def _norm_weights(norm_w_ptr, seg_ptr, s_seg_ptr, hh, H: tl.constexpr, Q_SEG: tl.constexpr):
    """The norm's (1 + w) factor's w and the shared-expert gate row, fp32 at columns ``hh``."""
    hmsk = hh < H
    nw = tl.load(norm_w_ptr + hh, mask=hmsk, other=0.0).to(tl.float32)
    sg_w = tl.load(seg_ptr + hh, mask=hmsk, other=0.0).to(tl.float32)
    if Q_SEG:  # the [1, H] gate's scales along H (its one row)
        s_idx = scale_index(0, hh, Q_SEG, 1, H) + hh * 0  # per-row / tensor: one scale
        sg_w *= tl.load(s_seg_ptr + s_idx, mask=hmsk, other=0.0)
    return nw, sg_w


@triton.jit
def s2_norm_sums(
    nsum_ptr, wsc_base, ctrl_ptr, health_ptr, rows, rmask, n_rows, tag, eps, H: tl.constexpr,
    BB: tl.constexpr, UM: tl.constexpr, TR: tl.constexpr, TRP: tl.constexpr,
    RID_NSUM: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """S2 norm from the reduce tasks' sums (:func:`_norm_parts`): every CTA waits for all of
    them, sums each row's TR blocks in one fixed order, and keeps the
    row's rsqrt (slot UM + 1 of ``wsc``, and returned) and its shared-expert gate (slot UM).
    After the fence the shared ``xn`` planes (u) are this CTA's to read."""
    tt = tl.arange(0, TRP)
    cc = tl.arange(0, 2 * BB)
    idx = tt[:, None] * (2 * BB) + cc[None, :]
    m = (tt < TR)[:, None] & (cc // 2 < n_rows)[None, :]
    words, ok = wait2d(nsum_ptr + idx, m, idx, tag, ctrl_ptr, health_ptr, RID_NSUM, TRP, 2 * BB,
                       INTERP)  # fmt: skip
    fence_gpu(INTERP)
    v = tl.where(m, words_to_fp32(words), 0.0)
    ssq, sgp = tl.split(tl.reshape(tl.sum(v, axis=0), (BB, 2)))
    rs = tl.rsqrt(ssq / H + eps)
    tl.store(wsc_base + UM * BB + rows, tl.sigmoid(rs * sgp), mask=rmask)
    tl.store(wsc_base + (UM + 1) * BB + rows, rs)  # padded rows too: finite, never NaN
    tl.debug_barrier()  # wsc written by this CTA's threads, read by all of them
    return rs


@triton.jit
def router_tile(router_ptr, t, kc, live, nn, H: tl.constexpr, E: tl.constexpr,
                BN: tl.constexpr, KS2: tl.constexpr, BK2: tl.constexpr):  # fmt: skip
    """Router task ``t``'s weight tile of its K chunk ``kc``: experts of row block t % NEB,
    columns of K split t // NEB (zeros past E, past the split, and where ``live`` is false:
    nothing read)."""
    NEB: tl.constexpr = (E + BN - 1) // BN
    KSP2: tl.constexpr = ((H + KS2 - 1) // KS2 + BK2 - 1) // BK2 * BK2
    e = (t % NEB) * BN + nn
    ks = t // NEB
    k2 = ks * KSP2 + kc * BK2 + tl.arange(0, BK2)
    km2 = (k2 < H) & (k2 < (ks + 1) * KSP2)
    return tl.load(
        router_ptr + e[:, None] * H + k2[None, :],
        mask=(e < E)[:, None] & km2[None, :] & live,
        other=0.0,
    )


@triton.jit
def s2_router(
    router_ptr, s_r_ptr, xr_base, logits_ptr, rs, w_pre, pid, G, rows, rmask, nn, tag,
    H: tl.constexpr, E: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr, KS2: tl.constexpr,
    BK2: tl.constexpr, PIPE2: tl.constexpr, Q_R: tl.constexpr, RPRE: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    """S2 router: router^T row blocks x K splits over the rows' u, one fp32 partial logit
    block per split, scaled by its row's rsqrt ``rs``. ``RPRE``: each CTA has at most one
    task of one K chunk, whose tile ``w_pre`` it loaded before the norm's wait
    (:func:`router_tile`), so the router's weights are on their way while the hand-off
    from S1 is."""
    NEB: tl.constexpr = (E + BN - 1) // BN
    KSP2: tl.constexpr = ((H + KS2 - 1) // KS2 + BK2 - 1) // BK2 * BK2
    KCH2: tl.constexpr = KSP2 // BK2
    kk2 = tl.arange(0, BK2)
    for t in range(pid, NEB * KS2, G):
        e = (t % NEB) * BN + nn
        em = e < E
        ks = t // NEB
        acc2 = tl.zeros([BN, BB], dtype=tl.float32)
        for kc in tl.range(KCH2, num_stages=PIPE2):
            k2 = ks * KSP2 + kc * BK2 + kk2
            km2 = (k2 < H) & (k2 < (ks + 1) * KSP2)
            if RPRE:  # noqa: SIM108 (a constexpr branch: the other load is never built)
                wr = w_pre
            else:
                wr = router_tile(router_ptr, t, kc, True, nn, H, E, BN, KS2, BK2)
            xa = tl.load(
                xr_base + rows[None, :] * H + k2[:, None],
                mask=rmask[None, :] & km2[:, None],
                other=0.0,
            )
            # the router sees u as hi + lo bf16 parts: logits within ~1e-5 of fp32, so
            # only true near ties can pick differently from the fp32 reference
            xl = tl.load(
                xr_base + BB * H + rows[None, :] * H + k2[:, None],
                mask=rmask[None, :] & km2[:, None],
                other=0.0,
            )
            k0 = ks * KSP2 + kc * BK2
            acc2 = qdot(wr, xa, acc2, s_r_ptr, e, em, k0, Q_R, E, H)
            acc2 = qdot(wr, xl, acc2, s_r_ptr, e, em, k0, Q_R, E, H)
        acc2 = acc2 * rs[None, :]
        off2 = ks * (BB * E) + rows[None, :] * E + e[:, None]
        put_words(logits_ptr, off2, fp32_bits(acc2), rmask[None, :] & em[:, None], tag, INTERP)


@triton.jit
def _row_picks(
    logits_ptr, r, ctrl_ptr, health_ptr, trace_ptr, tag, E: tl.constexpr, EP: tl.constexpr,
    TOPK: tl.constexpr, NORM_TOPK: tl.constexpr, BB: tl.constexpr, KS2: tl.constexpr,
    RID_LOGITS: tl.constexpr, INTERP: tl.constexpr, TRACE: tl.constexpr,
):  # fmt: skip
    """Row ``r``'s picks (:func:`.k2_topk.topk_row` over [1, EP]) once its KS2 partial logits
    are in, summed in one order. The one body of both top-k stages (:func:`s3_topk`,
    :func:`s3_topk_local`): a row's picks are the same bits whichever takes them, which batch
    invariance needs when a row alone and the same row in a wider step take different ones."""
    offs_e = tl.arange(0, EP)
    valid = (offs_e < E)[None, :]
    ks_i = tl.arange(0, KS2)
    kidx = ks_i[:, None] * (BB * E) + r * E + offs_e[None, :]
    km = (ks_i >= 0)[:, None] & valid
    lwords, lok = wait2d(
        logits_ptr + kidx, km, kidx, tag, ctrl_ptr, health_ptr, RID_LOGITS, KS2, EP, INTERP
    )
    stamp(trace_ptr, 13, TRACE)  # the row's logits are in: the rest is the top-k itself
    lg = tl.reshape(tl.sum(words_to_fp32(lwords), axis=0), (1, EP))
    return topk_row(lg, valid, offs_e, TOPK, NORM_TOPK)


@triton.jit
def _quantize_row(xr_base, xq_base, r, rs_r, H: tl.constexpr, HP: tl.constexpr,
                  BB: tl.constexpr, BK3: tl.constexpr):  # fmt: skip
    """Row ``r`` normed, bf16(u * ``rs_r``) from the hi + lo planes of ``xr_base``, as the a8
    gate_up multiplies it (vLLM quantizes its normed rows): e4m3 codes at ``xq_base + r * H``
    (codes [BB, H]), then one fp32 scale per (BK3-column chunk, row) after all the codes, by
    ``planes.quantize_e4m3_cols`` with the row's chunks as its columns."""
    NG: tl.constexpr = HP // BK3  # chunks over the padded row; those past H are not stored
    kk = tl.arange(0, BK3)
    gi = tl.arange(0, NG)
    col = gi[None, :] * BK3 + kk[:, None]  # [BK3, NG]: chunk g's column k
    m = col < H
    x_hi = tl.load(xr_base + r * H + col, mask=m, other=0.0)
    x_lo = tl.load(xr_base + BB * H + r * H + col, mask=m, other=0.0)
    x = ((x_hi.to(tl.float32) + x_lo.to(tl.float32)) * rs_r).to(tl.bfloat16)
    q, s_g = quantize_e4m3_cols(x)
    tl.store(xq_base.to(tl.pointer_type(tl.float8e4nv)) + r * H + col, q, mask=m)
    xsc = (xq_base + BB * H // 2).to(tl.pointer_type(tl.float32))
    tl.store(xsc + gi * BB + r, s_g, mask=gi * BK3 < H)


@triton.jit
def s3_topk(
    logits_ptr, picks_ptr, xr_base, xq_base, wsc_base, ctrl_ptr, health_ptr, trace_ptr, pid, G,
    n_rows, tag, E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, NORM_TOPK: tl.constexpr,
    BB: tl.constexpr, KS2: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
    BK3: tl.constexpr, UM: tl.constexpr, RID_LOGITS: tl.constexpr, INTERP: tl.constexpr,
    A8: tl.constexpr, TRACE: tl.constexpr,
):  # fmt: skip
    """S3 top-k, one row per CTA: CTA ``G - 1 - r`` (mod G: CTAs past the router's tasks) takes
    row r's softmax top-k and publishes its picks into ``picks``: TOPK expert ids by rank, then
    their routing weights (fp32 bits).

    A row's top-k is a chain of dependent block-wide reductions; done by every CTA for every
    row it is serial in the width, done once per row here it is one row deep at any width,
    for one hand-off.

    ``A8``: before its picks, the same CTA quantizes the row for the a8 gate_up into the shared
    codes at ``xq_base`` (:func:`_quantize_row`), so the picks also say the codes are in and
    no CTA quantizes every row before its gate_up stream (a serial loop of L2 reads per K chunk
    in each CTA). Here, not where the rows are normed: there the kernel's live values and the
    division's slow-path call together spill the build."""
    offs_e = tl.arange(0, EP)
    for r in range(G - 1 - pid, n_rows, G):
        sel, prank, wts = _row_picks(logits_ptr, r, ctrl_ptr, health_ptr, trace_ptr, tag, E, EP,
                                     TOPK, NORM_TOPK, BB, KS2, RID_LOGITS, INTERP, TRACE)  # fmt: skip
        # each pick to the word of its rank (ranks are distinct). The rank decides, not the
        # weight: a NaN weight (a CUDA-graph padding row whose attention saw no keys is NaN
        # in vLLM) is still a pick whose pair must be written.
        at = r * (2 * TOPK) + prank
        if A8:
            rs_r = tl.load(wsc_base + (UM + 1) * BB + r)
            _quantize_row(xr_base, xq_base, r, rs_r, H, HP, BB, BK3)
            tl.debug_barrier()  # every thread's code stores, then each thread's fence, then picks
            fence_gpu(INTERP)
        put_words(picks_ptr, at, offs_e[None, :], sel, tag, INTERP)
        put_words(picks_ptr, at + TOPK, fp32_bits(wts), sel, tag, INTERP)


@triton.jit
def s3_topk_local(
    logits_ptr, lpicks_base, ctrl_ptr, health_ptr, trace_ptr, n_rows, tag, E: tl.constexpr,
    EP: tl.constexpr, TOPK: tl.constexpr, NORM_TOPK: tl.constexpr, BB: tl.constexpr,
    KS2: tl.constexpr, RID_LOGITS: tl.constexpr, INTERP: tl.constexpr, TRACE: tl.constexpr,
):  # fmt: skip
    """S3 top-k of every live row in this CTA (``K2Config.local_topk_rows``): the same
    picks as :func:`s3_topk` (:func:`_row_picks`), stored untagged into this CTA's ``lpicks_base``
    (per row TOPK expert ids by rank, then their weights' fp32 bits), so no CTA waits for
    another's picks. Serial in the rows, hence only for the narrowest steps."""
    offs_e = tl.arange(0, EP)
    for r in range(0, n_rows):
        sel, prank, wts = _row_picks(logits_ptr, r, ctrl_ptr, health_ptr, trace_ptr, tag, E, EP,
                                     TOPK, NORM_TOPK, BB, KS2, RID_LOGITS, INTERP, TRACE)  # fmt: skip
        at = r * (2 * TOPK) + prank
        tl.store(lpicks_base + at, offs_e[None, :], mask=sel)
        tl.store(lpicks_base + at + TOPK, fp32_bits(wts), mask=sel)
    tl.debug_barrier()  # every thread's picks, before the union reads them


@triton.jit
def s3_union(
    picks_ptr, lpicks_base, local, wsc_base, ppos_base, meta_base, eslot_base, ctrl_ptr,
    health_ptr, rows, rmask, tag, EP: tl.constexpr, TOPK: tl.constexpr, TKP: tl.constexpr,
    BB: tl.constexpr, UM: tl.constexpr, PM: tl.constexpr, M_U: tl.constexpr,
    PKWP: tl.constexpr, RID_PICKS: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """S3 union (every CTA, its own copy): every live row's picks -> the union of picked
    experts (ascending id) into ``meta``, and per (slot, row) the routing weight (``wsc``)
    and pair row (``ppos``, pair (row r, rank k) = r * TOPK + k). The picks are the
    published ones, or with ``local`` this CTA's own (:func:`s3_topk_local`, untagged at
    ``lpicks_base``). ``eslot_base``: this CTA's 2 * EP int32 words (each expert's slot, then
    its picked flag). Returns the union's size."""
    PKW: tl.constexpr = 2 * TOPK
    kk = tl.arange(0, TKP)
    pkm = rmask[:, None] & (kk < TOPK)[None, :]
    po = rows[:, None] * PKW + kk[None, :]
    if local:
        ids = tl.load(lpicks_base + po, mask=pkm, other=0)
        w_k = tl.load(lpicks_base + TOPK + po, mask=pkm, other=0).to(tl.float32, bitcast=True)
    else:
        cp = tl.arange(0, PKWP)
        pidx = rows[:, None] * PKW + cp[None, :]
        wait2d(picks_ptr + pidx, rmask[:, None] & (cp < PKW)[None, :], pidx, tag, ctrl_ptr,
                health_ptr, RID_PICKS, BB, PKWP, INTERP)  # fmt: skip
        # the words are in: read ids and weights in the shape they are used in
        ids = unpack_value(tl.load(picks_ptr + po, mask=pkm, other=0, volatile=True))
        w_k = words_to_fp32(tl.load(picks_ptr + TOPK + po, mask=pkm, other=0, volatile=True))
    # the union as flags in memory: a scatter of every pick, instead of an [EP] x picks
    # compare in registers
    offs_e = tl.arange(0, EP)
    flag_base = eslot_base + EP
    tl.store(flag_base + offs_e, tl.zeros([EP], dtype=tl.int32))
    tl.debug_barrier()
    tl.store(flag_base + ids, tl.full([BB, TKP], 1, dtype=tl.int32), mask=pkm)
    tl.debug_barrier()
    picked = tl.load(flag_base + offs_e)
    slot_of = tl.cumsum(picked, axis=0) - picked
    n_u = tl.sum(picked, axis=0)
    pk = picked > 0
    tl.store(meta_base + slot_of, offs_e, mask=pk)
    tl.store(meta_base + M_U, n_u)
    tl.store(ppos_base + UM * BB + rows, tl.where(rmask, PM + rows, -1))
    tl.store(eslot_base + offs_e, slot_of)  # read back by the pick scatter below
    # every (picked slot, row) first gets (0, -1): rows that did not pick the slot keep it
    so_d = slot_of[:, None] * BB + rows[None, :]
    tl.store(wsc_base + so_d, tl.zeros([EP, BB], dtype=tl.float32), mask=pk[:, None])
    tl.store(ppos_base + so_d, tl.full([EP, BB], -1, dtype=tl.int32), mask=pk[:, None])
    tl.debug_barrier()  # slot_of and the (0, -1) fill, before the picks overwrite them
    so = tl.load(eslot_base + ids, mask=pkm, other=0) * BB + rows[:, None]
    tl.store(wsc_base + so, w_k, mask=pkm)
    tl.store(ppos_base + so, rows[:, None] * TOPK + kk[None, :], mask=pkm)
    tl.debug_barrier()  # meta / wsc / ppos are read back by every thread of this CTA
    return n_u


@triton.jit
def s3_gate_up(
    w13_ptr, sgu_ptr, s_13_ptr, s_sgu_ptr, xr_base, xq_plane, wsc_base, ppos_base, meta_base,
    act_ptr, pid, G, rows, rmask, n_u, tag, H: tl.constexpr, IR: tl.constexpr, ISR: tl.constexpr,
    BB: tl.constexpr, BN3: tl.constexpr, BK3: tl.constexpr, PIPE3: tl.constexpr,
    JM3: tl.constexpr, UM: tl.constexpr, IW: tl.constexpr, IWR: tl.constexpr,
    IWS: tl.constexpr, Q_13: tl.constexpr, Q_SGU: tl.constexpr, SPE13: tl.constexpr,
    trace_ptr, TRACE: tl.constexpr, INTERP: tl.constexpr, A8: tl.constexpr,
):  # fmt: skip
    """S3 gate_up: (shared or routed slot, row block) tasks of gate rows + the same up rows,
    SiLU(g) * u * routing weight -> bf16 pairs in ``act`` per (slot, row). ``A8``: fp8 planes
    multiply e4m3 activations (``planes.qdot_a8q``): the rows' codes and scales in
    ``xq_plane``, written by the top-k CTAs before their picks (``s3_topk``), which
    ``s3_union`` waited for. The bf16 rows are u (``_norm_parts``), so each task's gate and up
    sums are scaled by their row's rsqrt (slot UM + 1 of ``wsc``) before the SiLU; a8's codes
    are of the normed rows already."""
    BI3: tl.constexpr = BN3 // 2  # gate rows (and up rows) per expert task
    NB: tl.constexpr = (IR + BI3 - 1) // BI3
    NBS: tl.constexpr = (ISR + BI3 - 1) // BI3
    KCH3: tl.constexpr = (H + BK3 - 1) // BK3
    # tasks: shared blocks first, then (routed slot, block) of BI3 gate rows (+ the same up
    # rows) in a tile of BI3 + BI3
    T3 = NBS + n_u * NB
    n_mine3 = tl.where(pid < T3, (T3 - 1 - pid) // G + 1, 0)
    n_it3 = n_mine3 * KCH3
    kk3 = tl.arange(0, BK3)
    nn3 = tl.arange(0, BN3)
    half = nn3 // BI3  # 0: gate row, 1: up row
    ri = nn3 % BI3
    acc3 = tl.zeros([BN3, BB], dtype=tl.float32)
    # The expert of each of this CTA's tasks, held in registers: a load inside the loop
    # that another load's address depends on makes Triton's pipeliner wait for every
    # copy in flight at each iteration (async_wait 0: no pipelining at all).
    jv = tl.arange(0, JM3)
    tv = pid + jv * G
    ex_v = tl.load(
        meta_base + tl.minimum(tl.maximum(tv - NBS, 0) // NB, UM - 1),
        mask=(tv >= NBS) & (tv < T3),
        other=0,
    )
    if A8:
        # e4m3 codes [BB, H] then one fp32 scale per (K chunk, row): every task multiplies
        # the same rows, so they are quantized once per row, not per task and chunk
        xq_base = xq_plane.to(tl.pointer_type(tl.float8e4nv))
        xsc_base = (xq_plane + BB * H // 2).to(tl.pointer_type(tl.float32))
        fence_gpu(INTERP)  # the picks were in (s3_union): the codes before them are too
    stamp(trace_ptr, 11, TRACE)
    # one flat pipelined loop over (task, K chunk): the stream never drains between tasks
    for it in tl.range(0, n_it3, num_stages=PIPE3):
        j = it // KCH3
        kc = it - j * KCH3
        t = pid + j * G
        sh = t < NBS
        ex = tl.sum(tl.where(jv == j, ex_v, 0), axis=0)
        isl = tl.where(sh, ISR, IR)
        ib = tl.where(sh, t, (t - NBS) % NB)
        gr = ib * BI3 + ri
        live3 = (ri < BI3) & (gr < isl)
        wrow = half * isl + gr
        k3 = kc * BK3 + kk3
        km = k3 < H
        if A8:
            xq_t = tl.load(xq_base + rows[None, :] * H + k3[:, None],
                           mask=rmask[None, :] & km[:, None], other=0.0)  # fmt: skip
            xs_t = tl.load(xsc_base + kc * BB + rows, mask=rmask, other=0.0)
        else:
            x_t = tl.load(
                xr_base + rows[None, :] * H + k3[:, None],
                mask=rmask[None, :] & km[:, None],
                other=0.0,
            )
        w13_e = w13_ptr + ex.to(tl.int64) * (2 * IR * H)
        s13_e = s_13_ptr + ex.to(tl.int64) * SPE13
        woff = wrow[:, None] * H + k3[None, :]
        wm = live3[:, None] & km[None, :]
        if Q_13 == Q_SGU:  # one format: one load through the task's plane
            w_t = tl.load(tl.where(sh, sgu_ptr, w13_e) + woff, mask=wm, other=0.0)
            sp3 = tl.where(sh, s_sgu_ptr, s13_e)
            if A8:
                acc3 = qdot_a8q(w_t, xq_t, xs_t, acc3, sp3, wrow, live3, kc * BK3, Q_13,
                                2 * isl, H)  # fmt: skip
            else:
                acc3 = qdot(w_t, x_t, acc3, sp3, wrow, live3, kc * BK3, Q_13, 2 * isl, H)
        else:
            w_r = tl.load(w13_e + woff, mask=wm & (sh == 0), other=0.0)
            w_s = tl.load(sgu_ptr + woff, mask=wm & sh, other=0.0)
            acc3 = qdot_either(acc3, w_r, w_s, sh, x_t, s13_e, s_sgu_ptr, wrow, live3,
                               kc * BK3, Q_13, Q_SGU, 2 * IR, H, 2 * ISR, H)  # fmt: skip
        if kc == KCH3 - 1:
            slot = tl.where(sh, UM, (t - NBS) // NB)
            wr3 = tl.load(wsc_base + slot * BB + rows)
            pr3 = tl.load(ppos_base + slot * BB + rows)
            if not A8:  # a8's codes are of the normed rows (``_quantize_row``)
                acc3 = acc3 * tl.load(wsc_base + (UM + 1) * BB + rows)[None, :]
            g3, u3 = tl.split(tl.permute(tl.reshape(acc3, (2, BI3, BB)), (1, 2, 0)))
            h3 = g3 / (1.0 + tl.exp(-g3)) * u3 * wr3[None, :]  # [BI3, BB]
            lo, hi = tl.split(tl.permute(tl.reshape(h3, (BI3 // 2, 2, BB)), (0, 2, 1)))
            lo_b = lo.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            hi_b = hi.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) << 16
            cl = tl.arange(0, BI3 // 2)
            c2 = ib * (BI3 // 2) + cl
            # activation rows by (slot, row): the down stage reads a slot's rows at an
            # address it computes, with no lookup
            off3 = (slot * BB + rows)[None, :] * IW + c2[:, None]
            am3 = (pr3[None, :] >= 0) & ((cl < BI3 // 2) & (c2 < tl.where(sh, IWS, IWR)))[:, None]
            put_words(act_ptr, off3, hi_b | lo_b, am3, tag, INTERP)
            acc3 = tl.zeros([BN3, BB], dtype=tl.float32)


@triton.jit
def _act_chunk_f32(act_ptr, s_act, cw, isl, rmask, live, rows, BB: tl.constexpr,
                   IW: tl.constexpr, BI4: tl.constexpr):  # fmt: skip
    """The act words of slot row ``s_act``, columns ``cw`` (bf16 pairs along I), for every
    live row of the batch, as fp32 [BI4, BB]; words past the slot's width, and all of them
    where ``live`` is false, read as zero."""
    a = tl.load(
        act_ptr + (s_act * BB + rows)[None, :] * IW + cw[:, None],
        mask=(rmask & live)[None, :] & (cw[:, None] < (isl + 1) // 2),
        other=0,
        cache_modifier=".cg",
    )
    v = unpack_value(a)  # [BI4 / 2, BB] bf16 pairs along I
    lo = (v << 16).to(tl.float32, bitcast=True)
    hi = ((v >> 16) << 16).to(tl.float32, bitcast=True)
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BI4, BB))


@triton.jit
def s4_down(
    w2_ptr, sdown_ptr, s_2_ptr, s_sd_ptr, act_ptr, p4l_ptr, ppos_base, meta_base, xs_base,
    ctrl_ptr, health_ptr, trace_ptr, run, G, rows, rmask, tag, H: tl.constexpr, IR: tl.constexpr,
    ISR: tl.constexpr, BB: tl.constexpr, BN4: tl.constexpr, BI4: tl.constexpr,
    JS: tl.constexpr, ACH: tl.constexpr, PIPE4: tl.constexpr, UM: tl.constexpr,
    M_U: tl.constexpr, IW: tl.constexpr, IWR: tl.constexpr, IWS: tl.constexpr,
    IWP: tl.constexpr, EB2: tl.constexpr, EBSD: tl.constexpr, RID_ACT: tl.constexpr,
    Q_2: tl.constexpr, Q_SD: tl.constexpr, SPE2: tl.constexpr, PREFETCH: tl.constexpr,
    PF4: tl.constexpr, TRACE: tl.constexpr, INTERP: tl.constexpr, A8: tl.constexpr,
):  # fmt: skip
    # ------------------------------------- S4: down^T over (slot, H block) tasks -> pairs
    # (A8: fp8 planes multiply e4m3 activations, planes.qdot_a8q: each slot of the run has
    # its activations quantized once, I chunk by I chunk, into this CTA's xs planes, which
    # gate_up has finished with)
    # Task t = slot ordinal * RB4 + H block over the routed slots then the shared expert;
    # each CTA takes a contiguous run of tasks, the ``run``-th of G (balanced to one task at
    # any width; a run touches at most JS slots), and writes one fp32 partial per (pair, H
    # row). The sum over a row's pairs happens in S4 reduce in a fixed order (rank
    # 0..TOPK-1, then shared), so a row's output depends on its own picks only (batch
    # invariance).
    I8: tl.constexpr = tl.pointer_type(tl.int8)  # prefetches address bytes (planes differ)
    RB4: tl.constexpr = (H + BN4 - 1) // BN4
    IMAX: tl.constexpr = IR if IR > ISR else ISR
    KCH4: tl.constexpr = (IMAX + BI4 - 1) // BI4
    n_u4 = tl.load(meta_base + M_U)
    T4 = (n_u4 + 1) * RB4
    t0 = run * T4 // G
    t1 = (run + 1) * T4 // G
    s0 = t0 // RB4
    js = tl.arange(0, JS)
    sj = s0 + js  # slot ordinals of this run (n_u4: the shared expert)
    s_live = (t1 > t0) & (sj * RB4 < t1) & (sj <= n_u4)
    s_tab = tl.where(sj == n_u4, UM, tl.minimum(sj, UM - 1))  # row of wsc / ppos / act
    ex_j = tl.load(meta_base + tl.minimum(sj, UM - 1), mask=s_live & (sj < n_u4), other=0)
    pp_j = tl.load(ppos_base + s_tab[:, None] * BB + rows[None, :], mask=s_live[:, None],
                   other=-1)  # fmt: skip
    if PREFETCH:
        # this run's down rows (contiguous within each slot's plane), into L2 while the
        # activations are still being written
        h_lo = tl.maximum(t0 - sj * RB4, 0) * BN4
        h_hi = tl.minimum(tl.minimum(t1 - sj * RB4, RB4) * BN4, H)
        sh_j = sj == n_u4
        isl_j = tl.where(sh_j, ISR, IR)
        base_j = tl.where(sh_j, sdown_ptr.to(I8),
                          (w2_ptr + ex_j.to(tl.int64) * (H * IR)).to(I8))  # fmt: skip
        eb_j = tl.where(sh_j, EBSD, EB2)
        nb_j = (h_hi - h_lo) * isl_j * eb_j
        if PF4 > 0:  # the run's first PF4 bytes only, in task order: all runs fit in L2
            live_nb = tl.where(s_live, nb_j, 0)
            before = tl.cumsum(live_nb, 0) - live_nb
            nb_j = tl.minimum(nb_j, tl.maximum(PF4 - before, 0)) // 16 * 16
        prefetch_l2(base_j + h_lo.to(tl.int64) * isl_j * eb_j, nb_j,
                     s_live & (nb_j > 0) & (nb_j % 16 == 0))  # fmt: skip
    # the activation rows this run reads, (slot, row) pairs whose row picked the slot: ACH
    # of them per bounded wait
    fl = tl.arange(0, JS * BB)
    fsl = s0 + fl // BB
    f_live = (t1 > t0) & (fsl * RB4 < t1) & (fsl <= n_u4)
    f_row = tl.where(fsl == n_u4, UM, tl.minimum(fsl, UM - 1)) * BB + fl % BB
    f_pp = tl.load(ppos_base + f_row, mask=f_live, other=-1)
    wait_live_rows(act_ptr, f_live & (f_pp >= 0), f_row, tl.where(fsl == n_u4, IWS, IWR), tag,
                   ctrl_ptr, health_ptr, RID_ACT, IW, ACH, IWP, INTERP)  # fmt: skip
    stamp(trace_ptr, 7, TRACE)
    cw = tl.arange(0, BI4 // 2)
    ci = tl.arange(0, BI4)
    nn4 = tl.arange(0, BN4)
    if A8:
        IQ: tl.constexpr = KCH4 * BI4  # code bytes per (slot, row)
        aq_base = xs_base.to(tl.pointer_type(tl.float8e4nv))
        asc_base = (xs_base + JS * BB * IQ // 2).to(tl.pointer_type(tl.float32))
        # only the slots this run touches (at most JS; t1 <= (n_u4 + 1) * RB4)
        n_run = tl.where(t1 > t0, (t1 - 1) // RB4 - s0 + 1, 0)
        for q in range(0, n_run * KCH4):
            jq = q // KCH4
            icq = q % KCH4
            sq = s0 + jq
            shq = sq == n_u4
            islq = IR if IR == ISR else tl.where(shq, ISR, IR)
            a_f = _act_chunk_f32(act_ptr, tl.where(shq, UM, sq), icq * (BI4 // 2) + cw, islq,
                                 rmask, True, rows, BB, IW, BI4)  # fmt: skip
            q_c, s_c = quantize_e4m3_cols(a_f)
            tl.store(aq_base + (jq * BB + rows)[None, :] * IQ + (icq * BI4 + ci)[:, None], q_c)
            tl.store(asc_base + (jq * KCH4 + icq) * BB + rows, s_c)
        tl.debug_barrier()  # codes written by this CTA's threads, read by all of them
    stamp(trace_ptr, 12, TRACE)
    acc4 = tl.zeros([BN4, BB], dtype=tl.float32)
    # one flat pipelined loop over (task, I chunk); the expert comes out of registers
    # (JS entries) and every address is arithmetic: nothing loaded feeds an address
    for it in tl.range(0, (t1 - t0) * KCH4, num_stages=PIPE4):
        tt = t0 + it // KCH4
        ic = it % KCH4
        sj4 = tt // RB4
        hr = (tt - sj4 * RB4) * BN4 + nn4
        hm = hr < H
        sh4 = sj4 == n_u4
        ex4 = tl.sum(tl.where(js == sj4 - s0, ex_j, 0), axis=0)
        w2_e = w2_ptr + ex4.to(tl.int64) * (H * IR)
        isl4 = IR if IR == ISR else tl.where(sh4, ISR, IR)
        c4 = ic * BI4 + ci
        cw4 = ic * (BI4 // 2) + cw
        woff4 = hr[:, None] * isl4 + c4[None, :]
        wm4 = hm[:, None] & (c4[None, :] < isl4)
        if Q_2 == Q_SD:
            w4 = tl.load(tl.where(sh4, sdown_ptr, w2_e) + woff4, mask=wm4, other=0.0)
        else:  # two formats: the task's plane through its own pointer type
            w4 = tl.load(w2_e + woff4, mask=wm4 & (sh4 == 0), other=0.0)
            w4s = tl.load(sdown_ptr + woff4, mask=wm4 & sh4, other=0.0)
        # all live rows of the slot: a row that did not pick it reads a stale word, but
        # MMA columns are independent and that column is never stored
        if A8:
            jq4 = sj4 - s0
            aq4 = tl.load(aq_base + (jq4 * BB + rows)[None, :] * IQ + c4[:, None])
            as4 = tl.load(asc_base + (jq4 * KCH4 + ic) * BB + rows)
        else:
            a_m = _act_chunk_f32(act_ptr, tl.where(sh4, UM, sj4), cw4, isl4, rmask, True, rows,
                                 BB, IW, BI4)  # fmt: skip
        s2_e = s_2_ptr + ex4.to(tl.int64) * SPE2
        if Q_2 == Q_SD:
            sp4 = tl.where(sh4, s_sd_ptr, s2_e)
            if A8:
                acc4 = qdot_a8q(w4, aq4, as4, acc4, sp4, hr, hm, ic * BI4, Q_2, H, isl4)
            else:
                acc4 = qdot(w4, a_m.to(tl.bfloat16), acc4, sp4, hr, hm, ic * BI4, Q_2, H, isl4)
        else:
            acc4 = qdot_either(acc4, w4, w4s, sh4, a_m.to(tl.bfloat16), s2_e, s_sd_ptr, hr, hm,
                               ic * BI4, Q_2, Q_SD, H, IR, H, ISR)  # fmt: skip
        if ic == KCH4 - 1:
            ppr = tl.sum(tl.where((js == sj4 - s0)[:, None], pp_j, 0), axis=0)  # [BB]
            put_words(p4l_ptr, ppr[None, :] * H + hr[:, None], fp32_bits(acc4),
                 (ppr >= 0)[None, :] & hm[:, None], tag, INTERP)  # fmt: skip
            acc4 = tl.zeros([BN4, BB], dtype=tl.float32)


@triton.jit
def s4_reduce(
    out_h_ptr, p4l_ptr, scratch_ptr, peers_ptr, ctrl_ptr, health_ptr, pid, G, rows, rmask,
    n_rows, slot4, rank, tag, H: tl.constexpr, TOPK: tl.constexpr, BB: tl.constexpr,
    CB: tl.constexpr, TR: tl.constexpr, PM: tl.constexpr, NPP: tl.constexpr,
    OFF_P4: tl.constexpr, RID_P4L: tl.constexpr, RANKS: tl.constexpr, W_P: tl.constexpr,
    SYS: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """S4 reduce: each row's pairs summed in rank order, then its shared pair (TP1: the
    output; TP > 1: pushed into ``p4`` on every rank)."""
    NPW: tl.constexpr = PM + BB  # pair rows: routed (row, rank) then shared (row)
    pw_i = tl.arange(0, NPP)
    pw_live = (pw_i < n_rows * TOPK) | ((pw_i >= PM) & (pw_i < PM + n_rows))
    for t in range(pid, TR, G):
        cols = t * CB + tl.arange(0, CB)
        colm = cols < H
        widx = pw_i[:, None] * H + cols[None, :]
        wait2d(p4l_ptr + widx, (pw_live & (pw_i < NPW))[:, None] & colm[None, :], widx,
                tag, ctrl_ptr, health_ptr, RID_P4L, NPP, CB, INTERP)  # fmt: skip
        cm = rmask[:, None] & colm[None, :]
        acc5 = tl.zeros([BB, CB], dtype=tl.float32)
        for k in tl.static_range(TOPK):
            w5 = tl.load(p4l_ptr + (rows * TOPK + k)[:, None] * H + cols[None, :], mask=cm,
                         other=0, cache_modifier=".cg")  # fmt: skip
            acc5 += words_to_fp32(w5)
        w5 = tl.load(p4l_ptr + (PM + rows)[:, None] * H + cols[None, :], mask=cm, other=0,
                     cache_modifier=".cg")  # fmt: skip
        acc5 += words_to_fp32(w5)
        off = rows[:, None] * H + cols[None, :]
        if RANKS == 1:
            tl.store(out_h_ptr + off, acc5.to(tl.bfloat16), mask=cm)
        else:
            put_partial(
                scratch_ptr, peers_ptr, OFF_P4, slot4 + rank, tl.trans(acc5), cols, rows,
                rmask[None, :] & colm[:, None], tag, RANKS, W_P, H, SYS, INTERP,
            )  # fmt: skip


@triton.jit
def s4_ranks(
    out_h_ptr, p4_read, ctrl_ptr, health_ptr, pid, G, rows, rmask, n_rows, slot4, tag,
    H: tl.constexpr, BB: tl.constexpr, CB: tl.constexpr, TR: tl.constexpr,
    RANKS: tl.constexpr, W_P: tl.constexpr, RID_P4: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """S4 ranks (TP > 1): every rank's MoE sums, in rank order -> ``out_hidden``."""
    for t in range(pid, TR, G):
        cols = t * CB + tl.arange(0, CB)
        cm = rmask[:, None] & (cols[None, :] < H)
        s4 = sum_partials(
            p4_read, slot4, RID_P4, n_rows, cols, tag, ctrl_ptr, health_ptr,
            RANKS, W_P, H, BB, CB, INTERP,
        )  # fmt: skip
        off = rows[:, None] * H + cols[None, :]
        tl.store(out_h_ptr + off, s4.to(tl.bfloat16), mask=cm)
