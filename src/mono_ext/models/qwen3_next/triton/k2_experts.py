"""K2's expert stages (``@triton.jit`` helpers ``k2_kernel`` runs after the union of the
step's picks, ``k2_stages.s3_union``): S3 gate_up over (shared or routed slot, row block)
tasks into the activation words, and S4 down over (slot, H block) tasks into the pairs'
partials, which ``k2_stages.s4_reduce`` sums. Both stream their planes through one flat
pipelined loop per CTA, the expert of each task held in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mono_ext.kernels.triton.planes import qdot, qdot_a8q, qdot_either, quantize_e4m3_cols
from mono_ext.kernels.triton.primitives import (
    fence_gpu,
    fp32_bits,
    put_words,
    stamp,
    unpack_value,
)
from mono_ext.models.qwen3_next.triton.k2_sync import prefetch_l2, wait_live_rows

__all__ = ["s3_gate_up", "s4_down"]


@triton.jit
def _gate_up_out(acc3, t, wsc_base, ppos_base, act_ptr, rows, tag, NBS, NB: tl.constexpr,
                 BI3: tl.constexpr, BB: tl.constexpr, UM: tl.constexpr, IW: tl.constexpr,
                 IWR: tl.constexpr, IWS: tl.constexpr, INTERP: tl.constexpr,
                 A8: tl.constexpr):  # fmt: skip
    """Task ``t``'s finished gate and up sums ``acc3`` [2 BI3, BB]: SiLU(g) * u * routing
    weight, as bf16 pairs into its slot's ``act`` words."""
    sh = t < NBS
    ib = tl.where(sh, t, (t - NBS) % NB)
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
    # activation rows by (slot, row): the down stage reads a slot's rows at an address it
    # computes, with no lookup
    off3 = (slot * BB + rows)[None, :] * IW + c2[:, None]
    am3 = (pr3[None, :] >= 0) & ((cl < BI3 // 2) & (c2 < tl.where(sh, IWS, IWR)))[:, None]
    put_words(act_ptr, off3, hi_b | lo_b, am3, tag, INTERP)


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
    are of the normed rows already. Tasks are dealt round-robin: CTA p takes p, p + G, ..."""
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
            x_t = tl.load(xr_base + rows[None, :] * H + k3[:, None],
                          mask=rmask[None, :] & km[:, None], other=0.0)  # fmt: skip
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
            _gate_up_out(acc3, t, wsc_base, ppos_base, act_ptr, rows, tag, NBS, NB, BI3, BB, UM,
                         IW, IWR, IWS, INTERP, A8)  # fmt: skip
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
