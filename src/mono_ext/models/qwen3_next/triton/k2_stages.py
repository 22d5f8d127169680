"""K2's stages, each an inlined ``@triton.jit`` helper that ``k2_kernel`` runs in order (the
device helpers they share are ``k2_sync.py``).

S1 out_proj partials and their reduce (+ residual, and the norm's parts: each row's u = r *
(1 + w) and per column block its sums), S2 every row's rsqrt from those sums and the router
logits, S3 each row's top-k (one CTA per row, its picks published) and the union, then the
expert stages (``k2_experts.py``: gate_up activations, the down partials per (pair, H row)),
then S4's reduce (each row's pairs in a fixed order) and, at TP > 1, the rank sums. A stage hands its results to the next through
tagged words (``runtime.layout``), waited for with bounded waits; the one exception, the
shared u planes, sits behind the tagged sums, with a fence on each side. The CPU interpreter
runs one stage per launch, so there every hand-off is written before it is read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mono_ext.kernels.triton.planes import (
    qdot,
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
)
from mono_ext.models.qwen3_next.triton.k2_topk import topk_row

__all__ = [
    "s1_out_proj",
    "s1_reduce",
    "s2_norm_sums",
    "router_tile",
    "s2_router",
    "s3_topk",
    "s3_topk_local",
    "s3_union",
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
