"""K2's device code: the persistent layer-tail kernel (``k2_kernel``) and its stage bits.

The host side (shapes, config, hand-off program, workspace, launch, the tensor contract) is
``k2.py``; the stages the kernel runs in order are ``k2_stages.py`` and ``k2_experts.py``.
``STAGES`` selects stages (the CPU interpreter runs one per launch, so every hand-off is
written before it is read).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mono_ext.kernels.triton.primitives import pdl_prologue, seq_tag, stamp, step_seq
from mono_ext.models.qwen3_next.triton.k2_experts import s3_gate_up, s4_down
from mono_ext.models.qwen3_next.triton.k2_stages import (
    router_tile,
    s1_out_proj,
    s1_reduce,
    s2_norm_sums,
    s2_router,
    s3_topk,
    s3_topk_local,
    s3_union,
    s4_ranks,
    s4_reduce,
)

__all__ = ["STAGE_ORDER", "STAGES_ALL", "k2_kernel"]


# Stage bits (a debugging aid and the CPU interpreter path: run one stage per launch).
S1_MATMUL = 1  # out_proj partials (TP: push to peers; TP1: residual + outputs)
S1_REDUCE = 2  # every rank's partials summed, residual add, outputs, the norm's parts
S2_ROUTER = 4  # each row's rsqrt from the norm's parts, shared-expert gate, router logits
S3_TOPK = 8  # top-k: one row per CTA, its picks published (wider than LTR rows)
S3_EXPERT = 16  # (LTR rows: own top-k) picks -> union, routing tables; gate_up -> act
S4_MATMUL = 32  # down over (slot, H block) tasks -> one partial per (pair, H row)
S4_REDUCE = 64  # each row's pairs summed in order (TP1: outputs; TP: push to every rank)
S4_RANKS = 128  # TP: every rank's sums, in rank order -> outputs
STAGES_ALL = 255
STAGE_ORDER = (
    S1_MATMUL, S1_REDUCE, S2_ROUTER, S3_TOPK, S3_EXPERT, S4_MATMUL, S4_REDUCE, S4_RANKS,
)  # fmt: skip


@triton.jit(do_not_specialize=["n_rows", "layer", "layers_per_step"])
def k2_kernel(
    o_in_ptr, gate_ptr, res_in_ptr, out_h_ptr, out_r_ptr, w_o_ptr, norm_w_ptr, router_ptr, seg_ptr,
    w13_ptr, w2_ptr, sgu_ptr, sdown_ptr, s_o_ptr, s_13_ptr, s_2_ptr, s_sgu_ptr, s_sd_ptr, s_r_ptr,
    s_seg_ptr, scratch_ptr, xs_ptr, eslot_ptr, wsc_ptr, ppos_ptr, meta_ptr, peers_ptr,
    ctrl_ptr, health_ptr, trace_ptr, n_rows, layer, layers_per_step, eps,
    # shapes (per rank)
    H: tl.constexpr, KO: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr,
    NORM_TOPK: tl.constexpr, IR: tl.constexpr, ISR: tl.constexpr,
    # layout (runtime.layout offsets and region ids)
    OFF_P1: tl.constexpr, OFF_LOGITS: tl.constexpr, OFF_ACT: tl.constexpr,
    OFF_P4L: tl.constexpr, OFF_P4: tl.constexpr, OFF_PICKS: tl.constexpr,
    OFF_NSUM: tl.constexpr, RID_P1: tl.constexpr,
    RID_LOGITS: tl.constexpr, RID_PICKS: tl.constexpr, RID_ACT: tl.constexpr,
    RID_P4L: tl.constexpr, RID_P4: tl.constexpr, RID_NSUM: tl.constexpr,
    RANKS: tl.constexpr, SYS: tl.constexpr,
    # tiles
    BB: tl.constexpr, BN: tl.constexpr, BN3: tl.constexpr, BN4: tl.constexpr, BK1: tl.constexpr,
    KSPL1: tl.constexpr, KS2: tl.constexpr, BK2: tl.constexpr, BK3: tl.constexpr, BI4: tl.constexpr,
    JS: tl.constexpr, ACH: tl.constexpr, CB: tl.constexpr,
    TKP: tl.constexpr, TRP: tl.constexpr,
    PKWP: tl.constexpr,
    HP: tl.constexpr, PREFETCH: tl.constexpr, PF1: tl.constexpr, PF4: tl.constexpr,
    GATED: tl.constexpr,
    NPP: tl.constexpr,
    IWPOW: tl.constexpr, STAGES: tl.constexpr, PIPE1: tl.constexpr, PIPE2: tl.constexpr,
    PIPE3: tl.constexpr,
    PIPE4: tl.constexpr, JM3: tl.constexpr, TRACE: tl.constexpr, Q_O: tl.constexpr,
    Q_13: tl.constexpr,
    Q_2: tl.constexpr, Q_SGU: tl.constexpr, Q_SD: tl.constexpr, Q_R: tl.constexpr,
    Q_SEG: tl.constexpr, SPE13: tl.constexpr, SPE2: tl.constexpr, INTERP: tl.constexpr,
    PDL: tl.constexpr = False, A8: tl.constexpr = False, RPRE: tl.constexpr = False,
    DRR: tl.constexpr = 0, LTR: tl.constexpr = 0,
):  # fmt: skip
    if PDL:
        pdl_prologue()
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    seq = step_seq(ctrl_ptr, layer, layers_per_step)
    tag = seq_tag(seq)
    parity = (seq & 1).to(tl.int32)
    rank = tl.load(ctrl_ptr + 2).to(tl.int32)  # CTRL_RANK (runtime.health)
    stamp(trace_ptr, 0, TRACE)

    UM: tl.constexpr = E if E < BB * TOPK else BB * TOPK  # routed slots; slot UM = shared
    PM: tl.constexpr = BB * TOPK  # routed (row, pick) pairs; shared pairs follow
    IWR: tl.constexpr = (IR + 1) // 2  # words of a routed activation row
    IWS: tl.constexpr = (ISR + 1) // 2  # words of a shared activation row
    IW: tl.constexpr = IWR if IWR > IWS else IWS
    IWP: tl.constexpr = IWPOW  # power of two >= IW
    M_U: tl.constexpr = UM  # meta: U (after the union list)
    META: tl.constexpr = UM + 1
    W_P: tl.constexpr = BB * H  # words per partials slot (p1 / p4)
    NS1: tl.constexpr = RANKS * KSPL1  # out_proj partial slots per parity
    EB2: tl.constexpr = 1 if Q_2 else 2  # bytes per routed down weight (fp8 / bf16)
    EBSG: tl.constexpr = 1 if Q_SGU else 2  # the shared expert's
    EBSD: tl.constexpr = 1 if Q_SD else 2

    rows = tl.arange(0, BB)
    rmask = rows < n_rows
    nn = tl.arange(0, BN)
    xs_base = xs_ptr + pid * (2 * BB * H)  # A8: this CTA's down run's e4m3 activations
    xn_base = xs_ptr + G * (2 * BB * H)  # shared: plane 0 bf16(u), plane 1 bf16(u - plane 0)
    xq_base = xs_ptr + (G + 1) * (2 * BB * H)  # A8: the rows' e4m3 codes and scales, shared
    eslot_base = eslot_ptr + pid * (2 * EP + BB * 2 * TOPK)
    lpicks_base = eslot_base + 2 * EP  # this CTA's own picks (LTR: narrow steps)
    wsc_base = wsc_ptr + pid * ((UM + 2) * BB)  # slots: routed, shared, the rows' rsqrt
    ppos_base = ppos_ptr + pid * ((UM + 1) * BB)
    meta_base = meta_ptr + pid * META
    logits_ptr = scratch_ptr + OFF_LOGITS
    act_ptr = scratch_ptr + OFF_ACT
    p4l_ptr = scratch_ptr + OFF_P4L
    picks_ptr = scratch_ptr + OFF_PICKS
    nsum_ptr = scratch_ptr + OFF_NSUM
    if RANKS == 1:
        p1_read = scratch_ptr + OFF_P1
        p4_read = scratch_ptr + OFF_P4
        slot1 = 0
        slot4 = 0
    else:
        mine = tl.load(peers_ptr + rank).to(tl.pointer_type(tl.int64))
        p1_read = mine + OFF_P1
        p4_read = mine + OFF_P4
        slot1 = parity * NS1
        slot4 = parity * RANKS

    TR: tl.constexpr = (H + CB - 1) // CB
    if STAGES & 1:
        s1_out_proj(
            o_in_ptr, gate_ptr, w_o_ptr, s_o_ptr, router_ptr, sgu_ptr, scratch_ptr, peers_ptr,
            pid, G, rows, rmask, nn, slot1, rank, tag, H, KO, E, ISR, BB, BN, BK1, KSPL1, PIPE1,
            OFF_P1, RANKS, SYS, W_P, EBSG, GATED, Q_O, Q_R, PF1, INTERP,
        )  # fmt: skip
    stamp(trace_ptr, 1, TRACE)
    w_pre = 0
    if RPRE and (STAGES & 4):  # this CTA's router tile, loaded before the hand-offs to S2
        w_pre = router_tile(router_ptr, pid, 0, pid < (E + BN - 1) // BN * KS2, nn, H, E, BN,
                            KS2, BK2)  # fmt: skip
    if STAGES & 2:
        s1_reduce(
            res_in_ptr, out_r_ptr, p1_read, norm_w_ptr, seg_ptr, s_seg_ptr, xn_base, nsum_ptr,
            ctrl_ptr, health_ptr, pid, G, rows, rmask, n_rows, slot1, tag, H, BB, CB, TR, NS1,
            W_P, RID_P1, Q_SEG, INTERP,
        )  # fmt: skip
    stamp(trace_ptr, 2, TRACE)
    if STAGES & 4:
        rs = s2_norm_sums(
            nsum_ptr, wsc_base, ctrl_ptr, health_ptr, rows, rmask, n_rows, tag, eps, H, BB, UM,
            TR, TRP, RID_NSUM, INTERP,
        )  # fmt: skip
        stamp(trace_ptr, 3, TRACE)
        s2_router(
            router_ptr, s_r_ptr, xn_base, logits_ptr, rs, w_pre, pid, G, rows, rmask, nn, tag, H,
            E, BB, BN, KS2, BK2, PIPE2, Q_R, RPRE, INTERP,
        )  # fmt: skip
    stamp(trace_ptr, 4, TRACE)
    if STAGES & 8:
        # a step of at most LTR rows publishes no picks: every CTA takes them itself in S3
        n_pub = tl.where(n_rows > LTR, n_rows, 0)
        s3_topk(
            logits_ptr, picks_ptr, xn_base, xq_base, wsc_base, ctrl_ptr, health_ptr, trace_ptr,
            pid, G, n_pub, tag, E, EP, TOPK, NORM_TOPK, BB, KS2, H, HP, BK3, UM, RID_LOGITS,
            INTERP, A8, TRACE,
        )  # fmt: skip
    stamp(trace_ptr, 10, TRACE)
    if STAGES & 16:
        local_tk = False
        if LTR > 0:
            local_tk = n_rows <= LTR
            if local_tk:
                s3_topk_local(
                    logits_ptr, lpicks_base, ctrl_ptr, health_ptr, trace_ptr, n_rows, tag, E, EP,
                    TOPK, NORM_TOPK, BB, KS2, RID_LOGITS, INTERP, TRACE,
                )  # fmt: skip
        n_u = s3_union(
            picks_ptr, lpicks_base, local_tk, wsc_base, ppos_base, meta_base, eslot_base,
            ctrl_ptr, health_ptr, rows, rmask, tag, EP, TOPK, TKP, BB, UM, PM, M_U, PKWP,
            RID_PICKS, INTERP,
        )  # fmt: skip
        stamp(trace_ptr, 5, TRACE)
        s3_gate_up(
            w13_ptr, sgu_ptr, s_13_ptr, s_sgu_ptr, xn_base, xq_base, wsc_base, ppos_base, meta_base,
            act_ptr, pid, G, rows, rmask, n_u, tag, H, IR, ISR, BB, BN3, BK3, PIPE3, JM3, UM, IW,
            IWR, IWS, Q_13, Q_SGU, SPE13, trace_ptr, TRACE, INTERP, A8,
        )  # fmt: skip
    stamp(trace_ptr, 6, TRACE)
    if STAGES & 32:
        # up to DRR rows, the CTAs of gate_up's last round take the last slots' runs
        run4 = tl.where(n_rows <= DRR, G - 1 - pid, pid)
        s4_down(
            w2_ptr, sdown_ptr, s_2_ptr, s_sd_ptr, act_ptr, p4l_ptr, ppos_base, meta_base,
            xs_base, ctrl_ptr, health_ptr, trace_ptr, run4, G, rows, rmask, tag, H, IR, ISR, BB,
            BN4, BI4, JS, ACH, PIPE4, UM, M_U, IW, IWR, IWS, IWP, EB2, EBSD, RID_ACT, Q_2, Q_SD,
            SPE2, PREFETCH, PF4, TRACE, INTERP, A8,
        )  # fmt: skip
    stamp(trace_ptr, 8, TRACE)
    if STAGES & 64:
        s4_reduce(
            out_h_ptr, p4l_ptr, scratch_ptr, peers_ptr, ctrl_ptr, health_ptr, pid, G, rows, rmask,
            n_rows, slot4, rank, tag, H, TOPK, BB, CB, TR, PM, NPP, OFF_P4, RID_P4L, RANKS, W_P,
            SYS, INTERP,
        )  # fmt: skip
    stamp(trace_ptr, 9, TRACE)
    if (RANKS > 1) and (STAGES & 128):
        s4_ranks(
            out_h_ptr, p4_read, ctrl_ptr, health_ptr, pid, G, rows, rmask, n_rows, slot4, tag, H,
            BB, CB, TR, RANKS, W_P, RID_P4, INTERP,
        )  # fmt: skip
