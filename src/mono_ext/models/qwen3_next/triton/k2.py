"""K2, the layer tail, as one persistent Triton launch per layer per decode step (bf16).

``out_proj``/``o_proj`` -> TP all-reduce -> residual add + post-attention Gemma RMSNorm ->
router GEMV + softmax top-k (renormalised) -> shared expert and the union of picked routed
experts (gate_up, SiLU * up, down, weighted) -> MoE TP all-reduce. Semantics:
:func:`mono_ext.models.qwen3_next.reference.tail.layer_tail` (the fp32 oracle). Weights are read in place.

Tensor contract (one set per rank; ``Bb = BLOCK_B`` = 16 rows, ``B <= Bb`` live rows,
``G`` = grid, ``Um = min(E, Bb * top_k)`` routed slots, ``Pm = Bb * top_k`` routed pairs,
``IW = ceil(max(I_r, Is_r) / 2)`` words per activation row):

| name            | shape                 | dtype | layout                                 | writer               |
|-----------------|-----------------------|-------|----------------------------------------|----------------------|
| o_in            | [B, in_r]             | bf16  | contiguous rows (GDN: Hv*Dv/tp; attn:  | K1 / engine attention|
|                 |                       |       | Hq*D/tp, already * sigmoid(gate) unless|                      |
|                 |                       |       | the build is ``gated``)                |                      |
| gate            | [B, in_r]             | bf16  | ``gated`` builds only: the pre-sigmoid | K1 (attention)       |
|                 |                       |       | output gate; S1 reads bf16(o_in *      |                      |
|                 |                       |       | sigmoid(gate)) (fp32 math, one round)  |                      |
| residual        | [B, H]                | bf16  | contiguous rows                        | K1 (residual_out)    |
| out_hidden      | [B, H]                | bf16  | contiguous; MoE out incl. shared expert| this launch (S4)     |
| out_residual    | [B, H]                | bf16  | contiguous; residual + o_proj(o_in)    | this launch (S1)     |
| out_proj/o_proj | [H, in_r]             | bf16  | row-parallel shard (engine's plane)    | engine (read only)   |
| post_attention_ | [H]                   | bf16  | Gemma weight (``x * (1 + w)``)         | engine (read only)   |
| layernorm       |                       |       |                                        |                      |
| router          | [E, H]                | bf16  | replicated                             | engine (read only)   |
| w13             | [E, 2*I_r, H]         | bf16  | FusedMoE: gate rows then up rows,      | engine (read only)   |
|                 |                       |       | column-parallel over I                 |                      |
| w2              | [E, H, I_r]           | bf16  | FusedMoE, row-parallel over I          | engine (read only)   |
| shared_gate_up  | [2*Is_r, H]           | bf16  | gate rows then up rows                 | engine (read only)   |
| shared_down     | [H, Is_r]             | bf16  | row-parallel                           | engine (read only)   |
| shared_expert_  | [1, H]                | bf16  | replicated                             | engine (read only)   |
| gate            |                       |       |                                        |                      |
| scratch: resid  | [Bb * H] words        | int64 | tagged fp32 bits of residual_out       | S1 (reduce) -> S2    |
| scratch: logits | [KS][Bb][E] words     | int64 | tagged fp32 partial router logits,     | S2 -> S3             |
|                 |                       |       | one K-split each, summed in ks order   |                      |
| scratch: act    | [Pm + Bb][IW] words   | int64 | tagged bf16x2 weighted SiLU(g)*u per   | S3 -> S4             |
|                 |                       |       | (row, pick) pair; shared at Pm + row   |                      |
| peer: ar1       | [2][tp][Bb * H] words | int64 | tagged fp32 out_proj partials          | S1 push (tp > 1)     |
| peer: ar2       | [2][tp][Bb * H] words | int64 | tagged fp32 MoE partials               | S4 push (tp > 1)     |
| priv xs         | [G, 2, Bb, H]         | bf16  | this CTA's normed rows: bf16(x), and   | S2, same CTA         |
|                 |                       |       | bf16(x - bf16(x)) for the router       |                      |
| priv wsc        | [G, Um + 1, Bb]       | fp32  | routing weight per (slot, row); slot   | S2/S3, same CTA      |
|                 |                       |       | Um holds sigmoid(shared_expert_gate.x) |                      |
| priv ppos       | [G, Um + 1, Bb]       | int32 | pair row of (slot, row) in act, or -1  | S3, same CTA         |
| priv meta       | [G, META]             | int32 | union list (Um), then U and n_pairs    | S3, same CTA         |
| ctrl / health   | see runtime.health    |       | epoch read for tags; sticky failed word| host / bounded waits |
| peers           | [tp]                  | int64 | byte address of each rank's buffer     | host (runtime.peers) |

Every CTA computes the norm and the top-k redundantly (bit-identical across CTAs: same
code, same words); the union of picked experts (ascending expert id) plus the shared
expert are the "slots" whose gate_up row blocks (S3) and down H-slices (S4) are spread
over the grid. Stages hand off only through tagged words (``runtime.layout``); the program
is declared by :func:`k2_program` and checked at build. No grid barrier; waits are bounded.

Per-element reduction orders depend only on the build (tiles), never on the width or the
other rows, so a row's output is independent of the batch (batch invariance), and replays
are bit-identical.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import triton
import triton.language as tl

from mono_ext.kernels.triton.limits import BLOCK_B, PER_STEP_ARGS
from mono_ext.kernels.triton.planes import (
    chunk_limit,
    format_code,
    plane_reasons,
    qdot,
    qdot_either,
    scale_index,
    scale_numel,
)
from mono_ext.kernels.triton.primitives import (
    global_timer_ns,
    pack_tagged,
    put_words,
    seq_tag,
    step_seq,
    store_tagged,
    unpack_value,
    wait_tagged,
)
from mono_ext.models.qwen3_next.shapes import TailShape
from mono_ext.runtime.layout import Program, Region, Stage, plan_layout, push, wait, write

__all__ = [
    "BLOCK_B",
    "K2Config",
    "K2Launch",
    "K2Shape",
    "k2_kernel",
    "k2_program",
    "STAGES_ALL",
]

# Stage bits (a debugging aid and the CPU interpreter path: run one stage per launch).
S1_MATMUL = 1  # out_proj partials (TP: push to peers; TP1: residual + outputs)
S1_REDUCE = 2  # TP: wait for every rank's partials, residual add, outputs
S2_ROUTER = 4  # norm (redundant), shared-expert gate, router logits slice
S3_EXPERT = 8  # top-k + union (redundant), gate_up blocks -> activations
S4_MATMUL = 16  # down over (slot, H block) tasks -> one partial per (pair, H row)
S4_REDUCE = 32  # each row's pairs summed in order (TP1: outputs; TP: push to every rank)
S4_RANKS = 64  # TP: every rank's sums, in rank order -> outputs
STAGES_ALL = 127
STAGE_ORDER = (S1_MATMUL, S1_REDUCE, S2_ROUTER, S3_EXPERT, S4_MATMUL, S4_REDUCE, S4_RANKS)


@triton.jit
def _fp32_bits(x):
    return x.to(tl.int32, bitcast=True)


@triton.jit
def _words_to_fp32(words):
    return unpack_value(words).to(tl.float32, bitcast=True)


@triton.jit
def _wait2d(
    ptrs, mask, index, tag, ctrl_ptr, health_ptr, region_id, R: tl.constexpr, C: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    """``wait_tagged`` over a [R, C] block (the primitive takes flat blocks). The CPU
    interpreter runs one stage per launch, so there the words are already written."""
    if INTERP:
        words2 = tl.load(ptrs, mask=mask, other=0)
        ok = True
    else:
        words, ok = wait_tagged(
            tl.reshape(ptrs, (R * C,)),
            tl.reshape(mask, (R * C,)),
            tl.reshape(index, (R * C,)),
            tag,
            ctrl_ptr,
            health_ptr,
            region_id,
        )
        words2 = tl.reshape(words, (R, C))
    return words2, ok


@triton.jit
def _prefetch_l2(ptrs, nbytes, mask):
    """``cp.async.bulk.prefetch.L2`` of ``nbytes`` (multiple of 16) at each masked pointer."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred %p; setp.ne.b32 %p, $3, 0; "
        "@%p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r",
        [ptrs, nbytes, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _stamp(trace_ptr, i: tl.constexpr, TRACE: tl.constexpr):
    """``TRACE`` builds only: this CTA's %globaltimer when all its threads reach point i
    (benchmarks/bench_k2.py --trace reads them to place time inside the launch)."""
    if TRACE:
        tl.debug_barrier()
        tl.store(trace_ptr + tl.program_id(0) * 16 + i, global_timer_ns())


@triton.jit
def _put_partial(
    scratch_ptr,
    peers_ptr,
    off,
    slot,
    acc_t,
    n_idx,
    rows,
    mask,
    tag,
    RANKS: tl.constexpr,
    WORDS: tl.constexpr,
    H: tl.constexpr,
    SYS: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Store a transposed fp32 partial ``acc_t`` [N, Bb] (columns ``n_idx`` of H) as tagged
    words into slot ``slot`` of a partials region: local at TP1, on every peer at TP > 1."""
    words = pack_tagged(_fp32_bits(acc_t), tag)
    offs = slot * WORDS + rows[None, :] * H + n_idx[:, None]
    if RANKS == 1:
        if INTERP:
            tl.store(scratch_ptr + off + offs, words, mask=mask)
        else:
            store_tagged(scratch_ptr + off + offs, words, mask, False)
    else:
        for p in tl.static_range(RANKS):
            dst = tl.load(peers_ptr + p).to(tl.pointer_type(tl.int64)) + off
            store_tagged(dst + offs, words, mask, SYS)


@triton.jit
def _sum_partials(
    base_ptr,
    slot0,
    region_id,
    n_rows,
    cols,
    tag,
    ctrl_ptr,
    health_ptr,
    NSLOT: tl.constexpr,
    WORDS: tl.constexpr,
    H: tl.constexpr,
    BB: tl.constexpr,
    CB: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Wait for slots ``slot0 .. slot0 + NSLOT - 1`` of rows x ``cols``, sum them in slot
    order (fp32). One bounded wait covers every slot (one round trip per spin)."""
    flat = tl.arange(0, NSLOT * BB)
    r = flat % BB
    idx = (slot0 + flat // BB)[:, None] * WORDS + r[:, None] * H + cols[None, :]
    m_all = (r < n_rows)[:, None] & (cols[None, :] < H)
    _wait2d(base_ptr + idx, m_all, idx, tag, ctrl_ptr, health_ptr, region_id, NSLOT * BB, CB,
            INTERP)  # fmt: skip
    rows = tl.arange(0, BB)
    mask = (rows < n_rows)[:, None] & (cols[None, :] < H)
    acc = tl.zeros([BB, CB], dtype=tl.float32)
    for s in tl.static_range(NSLOT):
        offs = (slot0 + s) * WORDS + rows[:, None] * H + cols[None, :]
        acc += _words_to_fp32(tl.load(base_ptr + offs, mask=mask, other=0, volatile=True))
    return acc


@triton.jit
def _o_in_tile(o_in_ptr, gate_ptr, offs, mask, GATED: tl.constexpr):
    """A bf16 tile of out_proj's input; ``GATED``: bf16(o_in * sigmoid(gate)), fp32 math
    (the attention layers' output gate, folded into S1's load)."""
    x = tl.load(o_in_ptr + offs, mask=mask, other=0.0)
    if GATED:
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * tl.sigmoid(g)).to(tl.bfloat16)
    return x


@triton.jit(do_not_specialize=["n_rows", "layer", "layers_per_step"])
def k2_kernel(
    o_in_ptr,
    gate_ptr,
    res_in_ptr,
    out_h_ptr,
    out_r_ptr,
    w_o_ptr,
    norm_w_ptr,
    router_ptr,
    seg_ptr,
    w13_ptr,
    w2_ptr,
    sgu_ptr,
    sdown_ptr,
    s_o_ptr,
    s_13_ptr,
    s_2_ptr,
    s_sgu_ptr,
    s_sd_ptr,
    s_r_ptr,
    s_seg_ptr,
    scratch_ptr,
    xs_ptr,
    pw_ptr,
    prk_ptr,
    wsc_ptr,
    ppos_ptr,
    meta_ptr,
    peers_ptr,
    ctrl_ptr,
    health_ptr,
    trace_ptr,
    n_rows,
    layer,
    layers_per_step,
    eps,
    # shapes (per rank)
    H: tl.constexpr,
    KO: tl.constexpr,
    E: tl.constexpr,
    EP: tl.constexpr,
    TOPK: tl.constexpr,
    NORM_TOPK: tl.constexpr,
    IR: tl.constexpr,
    ISR: tl.constexpr,
    # layout (runtime.layout offsets and region ids)
    OFF_P1: tl.constexpr,
    OFF_RESID: tl.constexpr,
    OFF_LOGITS: tl.constexpr,
    OFF_ACT: tl.constexpr,
    OFF_P4L: tl.constexpr,
    OFF_P4: tl.constexpr,
    RID_P1: tl.constexpr,
    RID_RESID: tl.constexpr,
    RID_LOGITS: tl.constexpr,
    RID_ACT: tl.constexpr,
    RID_P4L: tl.constexpr,
    RID_P4: tl.constexpr,
    RANKS: tl.constexpr,
    SYS: tl.constexpr,
    # tiles
    BB: tl.constexpr,
    BN: tl.constexpr,
    BN3: tl.constexpr,
    BN4: tl.constexpr,
    BK1: tl.constexpr,
    KSPL1: tl.constexpr,
    KS2: tl.constexpr,
    BK2: tl.constexpr,
    BK3: tl.constexpr,
    BI4: tl.constexpr,
    JS: tl.constexpr,
    ACH: tl.constexpr,
    CB: tl.constexpr,
    RB: tl.constexpr,
    RN: tl.constexpr,
    HP: tl.constexpr,
    PREFETCH: tl.constexpr,
    GATED: tl.constexpr,
    NPP: tl.constexpr,
    IWPOW: tl.constexpr,
    STAGES: tl.constexpr,
    PIPE1: tl.constexpr,
    PIPE3: tl.constexpr,
    PIPE4: tl.constexpr,
    JM3: tl.constexpr,
    TRACE: tl.constexpr,
    BAL3: tl.constexpr,
    TASK_ROWS: tl.constexpr,
    PF3: tl.constexpr,
    Q_O: tl.constexpr,
    Q_13: tl.constexpr,
    Q_2: tl.constexpr,
    Q_SGU: tl.constexpr,
    Q_SD: tl.constexpr,
    Q_R: tl.constexpr,
    Q_SEG: tl.constexpr,
    SPE13: tl.constexpr,
    SPE2: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    seq = step_seq(ctrl_ptr, layer, layers_per_step)
    tag = seq_tag(seq)
    parity = (seq & 1).to(tl.int32)
    rank = tl.load(ctrl_ptr + 2).to(tl.int32)  # CTRL_RANK (runtime.health)
    _stamp(trace_ptr, 0, TRACE)

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
    BI3: tl.constexpr = BN3 // 2  # gate rows (and up rows) per expert task
    EB13: tl.constexpr = 1 if Q_13 else 2  # bytes per routed gate_up weight (fp8 / bf16)
    EB2: tl.constexpr = 1 if Q_2 else 2  # bytes per routed down weight
    EBSG: tl.constexpr = 1 if Q_SGU else 2  # the shared expert's
    EBSD: tl.constexpr = 1 if Q_SD else 2
    I8: tl.constexpr = tl.pointer_type(tl.int8)  # prefetches address bytes (planes differ)

    rows = tl.arange(0, BB)
    rmask = rows < n_rows
    nn = tl.arange(0, BN)
    xs_base = xs_ptr + pid * (2 * BB * H)  # plane 0: bf16(x); plane 1: bf16(x - plane 0)
    pw_base = pw_ptr + pid * (BB * EP)
    prk_base = prk_ptr + pid * (BB * EP)
    wsc_base = wsc_ptr + pid * ((UM + 1) * BB)
    ppos_base = ppos_ptr + pid * ((UM + 1) * BB)
    meta_base = meta_ptr + pid * META
    resid_ptr = scratch_ptr + OFF_RESID
    logits_ptr = scratch_ptr + OFF_LOGITS
    act_ptr = scratch_ptr + OFF_ACT
    p4l_ptr = scratch_ptr + OFF_P4L
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

    # ------------------------------------------- S1: out_proj^T row blocks x K splits
    RB1: tl.constexpr = (H + BN - 1) // BN
    KSP1: tl.constexpr = ((KO + KSPL1 - 1) // KSPL1 + BK1 - 1) // BK1 * BK1  # K per split
    KCH1: tl.constexpr = KSP1 // BK1
    T1: tl.constexpr = RB1 * KSPL1
    if STAGES & 1:
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
                _put_partial(
                    scratch_ptr, peers_ptr, OFF_P1, slot1 + rank * KSPL1 + t // RB1, acc, hr,
                    rows, rmask[None, :] & (hr[:, None] < H), tag, RANKS, W_P, H, SYS, INTERP,
                )  # fmt: skip
                acc = tl.zeros([BN, BB], dtype=tl.float32)
        if PREFETCH:
            # weights the next stages surely read, pulled into L2 during the hand-offs
            lane = tl.arange(0, 128)
            part = pid + G * lane
            tot_r: tl.constexpr = E * H * (1 if Q_R else 2)
            ch_r: tl.constexpr = (tot_r // 16 + 127) // 128 * 16
            nb_r = tl.minimum(tl.maximum(tot_r - part * ch_r, 0), ch_r)
            _prefetch_l2(router_ptr.to(I8) + part * ch_r, nb_r, nb_r > 0)
            tot_s: tl.constexpr = 2 * ISR * H * EBSG
            ch_s: tl.constexpr = (tot_s // 16 + 127) // 128 * 16
            nb_s = tl.minimum(tl.maximum(tot_s - part * ch_s, 0), ch_s)
            _prefetch_l2(sgu_ptr.to(I8) + part * ch_s, nb_s, nb_s > 0)

    _stamp(trace_ptr, 1, TRACE)

    # ------------------ S1 reduce: out_proj partials (all ranks, K splits) + residual
    TR: tl.constexpr = (H + CB - 1) // CB
    if STAGES & 2:
        for t in range(pid, TR, G):
            cols = t * CB + tl.arange(0, CB)
            cm = rmask[:, None] & (cols[None, :] < H)
            s1 = _sum_partials(
                p1_read, slot1, RID_P1, n_rows, cols, tag, ctrl_ptr, health_ptr,
                NS1, W_P, H, BB, CB, INTERP,
            )  # fmt: skip
            off = rows[:, None] * H + cols[None, :]
            r = tl.load(res_in_ptr + off, mask=cm, other=0.0).to(tl.float32) + s1
            tl.store(out_r_ptr + off, r.to(tl.bfloat16), mask=cm)
            put_words(resid_ptr, off, _fp32_bits(r), cm, tag, INTERP)

    _stamp(trace_ptr, 2, TRACE)

    # -------------------------------------- S2: norm (every CTA) + router^T slices
    NEB: tl.constexpr = (E + BN - 1) // BN
    KSP2: tl.constexpr = ((H + KS2 - 1) // KS2 + BK2 - 1) // BK2 * BK2
    KCH2: tl.constexpr = KSP2 // BK2
    if STAGES & 4:
        # live rows only, RN rows x all of H per bounded wait (one round trip per RN rows)
        hh = tl.arange(0, HP)
        hmsk = hh < H
        rn = tl.arange(0, RN)
        nw = tl.load(norm_w_ptr + hh, mask=hmsk, other=0.0).to(tl.float32)
        sg_w = tl.load(seg_ptr + hh, mask=hmsk, other=0.0).to(tl.float32)
        if Q_SEG:  # the [1, H] gate's scales along H (its one row)
            s_idx = scale_index(0, hh, Q_SEG, 1, H) + hh * 0  # per-row / tensor: one scale
            sg_w *= tl.load(s_seg_ptr + s_idx, mask=hmsk, other=0.0)
        for r0 in range(0, n_rows, RN):
            rws = r0 + rn
            m = (rws < n_rows)[:, None] & hmsk[None, :]
            idx = rws[:, None] * H + hh[None, :]
            words, ok = _wait2d(
                resid_ptr + idx, m, idx, tag, ctrl_ptr, health_ptr, RID_RESID, RN, HP, INTERP
            )
            v = tl.where(m, _words_to_fp32(words), 0.0)
            rstd = tl.rsqrt(tl.sum(v * v, axis=1) / H + eps)
            xn = v * rstd[:, None] * (1.0 + nw[None, :])
            x_hi = xn.to(tl.bfloat16)
            tl.store(xs_base + idx, x_hi, mask=m)
            tl.store(xs_base + BB * H + idx, (xn - x_hi.to(tl.float32)).to(tl.bfloat16), mask=m)
            sg = tl.sigmoid(tl.sum(xn * sg_w[None, :], axis=1))
            tl.store(wsc_base + UM * BB + rws, sg, mask=rws < n_rows)
        tl.debug_barrier()  # xs written by this CTA's threads, read by all of them
        _stamp(trace_ptr, 3, TRACE)

        kk2 = tl.arange(0, BK2)
        for t in range(pid, NEB * KS2, G):
            e = (t % NEB) * BN + nn
            em = e < E
            ks = t // NEB
            acc2 = tl.zeros([BN, BB], dtype=tl.float32)
            for kc in range(KCH2):
                k2 = ks * KSP2 + kc * BK2 + kk2
                km2 = (k2 < H) & (k2 < (ks + 1) * KSP2)
                wr = tl.load(
                    router_ptr + e[:, None] * H + k2[None, :],
                    mask=em[:, None] & km2[None, :],
                    other=0.0,
                )
                xa = tl.load(
                    xs_base + rows[None, :] * H + k2[:, None],
                    mask=rmask[None, :] & km2[:, None],
                    other=0.0,
                )
                # the router sees x as hi + lo bf16 parts: logits within ~1e-5 of fp32, so
                # only true near ties can pick differently from the fp32 reference
                xl = tl.load(
                    xs_base + BB * H + rows[None, :] * H + k2[:, None],
                    mask=rmask[None, :] & km2[:, None],
                    other=0.0,
                )
                k0 = ks * KSP2 + kc * BK2
                acc2 = qdot(wr, xa, acc2, s_r_ptr, e, em, k0, Q_R, E, H)
                acc2 = qdot(wr, xl, acc2, s_r_ptr, e, em, k0, Q_R, E, H)
            off2 = ks * (BB * E) + rows[None, :] * E + e[:, None]
            put_words(logits_ptr, off2, _fp32_bits(acc2), rmask[None, :] & em[:, None], tag, INTERP)

    _stamp(trace_ptr, 4, TRACE)

    # ------------------------------------- S3: top-k + union, gate_up -> activations
    NB: tl.constexpr = (IR + BI3 - 1) // BI3
    NBS: tl.constexpr = (ISR + BI3 - 1) // BI3
    KCH3: tl.constexpr = (H + BK3 - 1) // BK3
    if STAGES & 8:
        offs_e = tl.arange(0, EP)
        rr = tl.arange(0, RB)
        cnt = tl.zeros([EP], dtype=tl.int32)
        # pass 1, RB rows at a time: softmax top-k. pw = renormalised weight, prk = the pick's
        # rank in its row (0 = largest probability) or -1: pair (row r, rank k) is r*TOPK + k,
        # so pair rows need no scan over the experts, and every live row has TOPK pairs.
        for r0 in range(0, n_rows, RB):
            rws = r0 + rr
            valid = (rws < n_rows)[:, None] & (offs_e[None, :] < E)
            lidx = rws[:, None] * E + offs_e[None, :]
            if RB == 1:
                # every K split's partial logits of the row in one bounded wait
                ks_i = tl.arange(0, KS2)
                kidx = ks_i[:, None] * (BB * E) + offs_e[None, :] + r0 * E
                km1 = (ks_i >= 0)[:, None] & (offs_e[None, :] < E)
                lwords, lok = _wait2d(
                    logits_ptr + kidx, km1, kidx, tag, ctrl_ptr, health_ptr, RID_LOGITS, KS2, EP,
                    INTERP,
                )  # fmt: skip
                lg = tl.reshape(tl.sum(_words_to_fp32(lwords), axis=0), (RB, EP))
            else:
                # several rows: one bounded wait per K split, summed in split order (all
                # splits land at about the same time), so an [RB, EP] block is in registers,
                # not [KS2 * RB, EP]
                lg = tl.zeros([RB, EP], dtype=tl.float32)
                for ks in tl.static_range(KS2):
                    lwords, lok = _wait2d(
                        logits_ptr + ks * (BB * E) + lidx, valid, ks * (BB * E) + lidx, tag,
                        ctrl_ptr, health_ptr, RID_LOGITS, RB, EP, INTERP,
                    )  # fmt: skip
                    lg += _words_to_fp32(lwords)
            lg = tl.where(valid, lg, float("-inf"))
            mx = tl.max(lg, axis=1)
            mx = tl.where(rws < n_rows, mx, 0.0)
            p = tl.where(valid, tl.exp(lg - mx[:, None]), 0.0)
            den = tl.sum(p, axis=1)
            p = p / tl.where(den > 0.0, den, 1.0)[:, None]
            # Unique int keys: p's fp32 bits (p >= 0: int order = float order) with the low
            # 9 bits replaced by (511 - e). Ties within 2^-14 relative (far below one bf16
            # step: near ties) go to the lower expert id. Padding experts get INT32_MIN, below
            # every real key (a NaN row's too), so a live row always has exactly TOPK picks.
            key = (p.to(tl.int32, bitcast=True) & ~511) | (511 - offs_e[None, :])
            key = tl.where(valid, key, -2147483648)
            thr = tl.max(key, axis=1)
            prank = tl.zeros([RB, EP], dtype=tl.int32)
            for _j in tl.static_range(TOPK - 1):
                below = key < thr[:, None]
                prank += below.to(tl.int32)  # a pick's rank: how many picks beat it
                thr = tl.max(tl.where(below, key, -2147483648), axis=1)
            sel = valid & (key >= thr[:, None])
            wts = tl.where(sel, p, 0.0)
            if NORM_TOPK:
                wsum = tl.sum(wts, axis=1)
                wts = wts / tl.where(wsum > 0.0, wsum, 1.0)[:, None]
            pro = rws[:, None] * EP + offs_e[None, :]
            tl.store(pw_base + pro, wts, mask=(rws < n_rows)[:, None])
            tl.store(prk_base + pro, tl.where(sel, prank, -1), mask=(rws < n_rows)[:, None])
            cnt += tl.sum(sel.to(tl.int32), axis=0)
        picked = (cnt > 0).to(tl.int32)
        slot_of = tl.cumsum(picked, axis=0) - picked
        n_u = tl.sum(picked, axis=0)
        pk = picked > 0
        tl.store(meta_base + slot_of, offs_e, mask=pk)
        tl.store(meta_base + M_U, n_u)
        tl.store(ppos_base + UM * BB + rows, tl.where(rmask, PM + rows, -1))
        tl.debug_barrier()  # pw / prk read back by other threads
        # pass 2: per (slot, row) routing weight and pair row (rows that did not pick: 0, -1).
        # Rows past the width get (0, -1) by plain stores; only live rows take the loop.
        dead = pk[:, None] & (rows >= n_rows)[None, :]
        so_d = slot_of[:, None] * BB + rows[None, :]
        tl.store(wsc_base + so_d, tl.zeros([EP, BB], dtype=tl.float32), mask=dead)
        tl.store(ppos_base + so_d, tl.full([EP, BB], -1, dtype=tl.int32), mask=dead)
        for r0 in range(0, n_rows, RB):
            rws = r0 + rr
            live = (rws < n_rows)[:, None]
            pro = rws[:, None] * EP + offs_e[None, :]
            pwc = tl.load(pw_base + pro, mask=live, other=0.0)
            # the rank decides, not the weight: a NaN weight (a CUDA-graph padding row whose
            # attention saw no keys is NaN in vLLM) is still a pick whose pair must be written
            rkc = tl.load(prk_base + pro, mask=live, other=-1)
            so = slot_of[None, :] * BB + rws[:, None]
            mk = pk[None, :] & live
            tl.store(wsc_base + so, tl.where(rkc >= 0, pwc, 0.0), mask=mk)
            tl.store(ppos_base + so, tl.where(rkc >= 0, rws[:, None] * TOPK + rkc, -1), mask=mk)
        tl.debug_barrier()  # meta / wsc / ppos are read back by every thread of this CTA
        _stamp(trace_ptr, 5, TRACE)

        # tasks: shared blocks first, then (routed slot, block) of L3 gate rows (+ the same up
        # rows) in a tile of BI3 + BI3. L3 (even, <= BI3) is picked per step so that the
        # busiest CTA streams the fewest rows: at width 1, 11 planes of 512 rows as 176 tiles
        # of 32 leave 44 CTAs with two tiles; 264 tiles of 22 give every CTA two smaller ones.
        L3 = BI3
        nbs3 = NBS
        nb3 = NB
        if BAL3:
            best = 2147483647
            for c in tl.static_range(BI3 // 4 + 1):  # heights BI3 .. BI3 / 2 (JM bounds it)
                lc = BI3 - 2 * c
                nbs_c = (ISR + lc - 1) // lc
                nb_c = (IR + lc - 1) // lc
                cost = ((nbs_c + n_u * nb_c + G - 1) // G) * (lc + TASK_ROWS)
                take = cost < best
                L3 = tl.where(take, lc, L3)
                nbs3 = tl.where(take, nbs_c, nbs3)
                nb3 = tl.where(take, nb_c, nb3)
                best = tl.where(take, cost, best)
        T3 = nbs3 + n_u * nb3
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
            meta_base + tl.minimum(tl.maximum(tv - nbs3, 0) // nb3, UM - 1),
            mask=(tv >= nbs3) & (tv < T3),
            other=0,
        )
        if PF3:  # noqa: SIM102 (constexpr, then a per-CTA condition)
            # The CTAs with one task more than the rest end the stage: their last tile goes
            # into L2 now, so HBM streams it while they work on the first (idle SMs' share
            # of the bandwidth serves the busy ones).
            if n_mine3 > T3 // G:
                tl_ = pid + (n_mine3 - 1) * G
                sh_ = tl_ < nbs3
                ex_ = tl.sum(tl.where(jv == n_mine3 - 1, ex_v, 0), axis=0)
                wb_ = tl.where(sh_, sgu_ptr.to(I8),
                               (w13_ptr + ex_.to(tl.int64) * (2 * IR * H)).to(I8))  # fmt: skip
                eb_ = tl.where(sh_, EBSG, EB13)
                isl_ = tl.where(sh_, ISR, IR)
                ib_ = tl.where(sh_, tl_, (tl_ - nbs3) % nb3)
                nrow_ = tl.minimum(L3, isl_ - ib_ * L3)
                q = tl.arange(0, 8)  # gate block, then up block, each in 4 pieces
                pc = (nrow_ + 3) // 4
                r_lo = tl.minimum((q % 4) * pc, nrow_)
                r_hi = tl.minimum(r_lo + pc, nrow_)
                row0 = (q // 4) * isl_ + ib_ * L3 + r_lo
                nbp = (r_hi - r_lo) * H * eb_
                _prefetch_l2(wb_ + row0.to(tl.int64) * H * eb_, nbp, (nbp > 0) & (nbp % 16 == 0))
        # one flat pipelined loop over (task, K chunk): the stream never drains between tasks
        for it in tl.range(0, n_it3, num_stages=PIPE3):
            j = it // KCH3
            kc = it - j * KCH3
            t = pid + j * G
            sh = t < nbs3
            ex = tl.sum(tl.where(jv == j, ex_v, 0), axis=0)
            isl = tl.where(sh, ISR, IR)
            ib = tl.where(sh, t, (t - nbs3) % nb3)
            gr = ib * L3 + ri
            live3 = (ri < L3) & (gr < isl)
            wrow = half * isl + gr
            k3 = kc * BK3 + kk3
            km = k3 < H
            x_t = tl.load(
                xs_base + rows[None, :] * H + k3[:, None],
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
                acc3 = qdot(w_t, x_t, acc3, sp3, wrow, live3, kc * BK3, Q_13, 2 * isl, H)
            else:
                w_r = tl.load(w13_e + woff, mask=wm & (sh == 0), other=0.0)
                w_s = tl.load(sgu_ptr + woff, mask=wm & sh, other=0.0)
                acc3 = qdot_either(acc3, w_r, w_s, sh, x_t, s13_e, s_sgu_ptr, wrow, live3,
                                   kc * BK3, Q_13, Q_SGU, 2 * IR, H, 2 * ISR, H)  # fmt: skip
            if kc == KCH3 - 1:
                slot = tl.where(sh, UM, (t - nbs3) // nb3)
                wr3 = tl.load(wsc_base + slot * BB + rows)
                pr3 = tl.load(ppos_base + slot * BB + rows)
                g3, u3 = tl.split(tl.permute(tl.reshape(acc3, (2, BI3, BB)), (1, 2, 0)))
                h3 = g3 / (1.0 + tl.exp(-g3)) * u3 * wr3[None, :]  # [BI3, BB]
                lo, hi = tl.split(tl.permute(tl.reshape(h3, (BI3 // 2, 2, BB)), (0, 2, 1)))
                lo_b = lo.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
                hi_b = hi.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) << 16
                cl = tl.arange(0, BI3 // 2)
                c2 = ib * (L3 // 2) + cl
                # activation rows by (slot, row): the down stage reads a slot's rows at an
                # address it computes, with no lookup
                off3 = (slot * BB + rows)[None, :] * IW + c2[:, None]
                am3 = (pr3[None, :] >= 0) & ((cl < L3 // 2) & (c2 < tl.where(sh, IWS, IWR)))[
                    :, None
                ]
                put_words(act_ptr, off3, hi_b | lo_b, am3, tag, INTERP)
                acc3 = tl.zeros([BN3, BB], dtype=tl.float32)

    _stamp(trace_ptr, 6, TRACE)

    # ------------------------------------- S4: down^T over (slot, H block) tasks -> pairs
    # Task t = slot ordinal * RB4 + H block over the routed slots then the shared expert;
    # each CTA takes a contiguous run of tasks (balanced to one task at any width; a run
    # touches at most JS slots) and writes one fp32 partial per (pair, H row). The sum over
    # a row's pairs happens in S4 reduce in a fixed order (rank 0..TOPK-1, then shared), so
    # a row's output depends on its own picks only (batch invariance).
    RB4: tl.constexpr = (H + BN4 - 1) // BN4
    IMAX: tl.constexpr = IR if IR > ISR else ISR
    KCH4: tl.constexpr = (IMAX + BI4 - 1) // BI4
    if STAGES & 16:
        n_u4 = tl.load(meta_base + M_U)
        T4 = (n_u4 + 1) * RB4
        t0 = pid * T4 // G
        t1 = (pid + 1) * T4 // G
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
            _prefetch_l2(base_j + h_lo.to(tl.int64) * isl_j * eb_j, nb_j,
                         s_live & (nb_j > 0) & (nb_j % 16 == 0))  # fmt: skip
        # the activation rows this run reads: one bounded wait per ACH of (slot, row)
        fc = tl.arange(0, ACH)
        cwa = tl.arange(0, IWP)
        for f0 in range(0, JS * BB, ACH):
            fl = f0 + fc
            fsl = s0 + fl // BB
            f_live = (t1 > t0) & (fsl * RB4 < t1) & (fsl <= n_u4)
            f_tab = tl.where(fsl == n_u4, UM, tl.minimum(fsl, UM - 1))
            f_pp = tl.load(ppos_base + f_tab * BB + fl % BB, mask=f_live, other=-1)
            aidx = (f_tab * BB + fl % BB)[:, None] * IW + cwa[None, :]
            f_w = tl.where(fsl == n_u4, IWS, IWR)
            am4 = (f_live & (f_pp >= 0))[:, None] & (cwa[None, :] < f_w[:, None])
            _wait2d(act_ptr + aidx, am4, aidx, tag, ctrl_ptr, health_ptr, RID_ACT, ACH, IWP,
                    INTERP)  # fmt: skip
        _stamp(trace_ptr, 7, TRACE)
        cw = tl.arange(0, BI4 // 2)
        ci = tl.arange(0, BI4)
        nn4 = tl.arange(0, BN4)
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
            s_act = tl.where(sh4, UM, sj4)
            a4 = tl.load(
                act_ptr + (s_act * BB + rows)[None, :] * IW + cw4[:, None],
                mask=rmask[None, :] & (cw4[:, None] < (isl4 + 1) // 2),
                other=0,
                cache_modifier=".cg",
            )
            v4 = unpack_value(a4)  # [BI4 / 2, BB] bf16 pairs along I
            lo4 = (v4 << 16).to(tl.float32, bitcast=True)
            hi4 = ((v4 >> 16) << 16).to(tl.float32, bitcast=True)
            a_m = tl.reshape(tl.permute(tl.join(lo4, hi4), (0, 2, 1)), (BI4, BB))
            s2_e = s_2_ptr + ex4.to(tl.int64) * SPE2
            if Q_2 == Q_SD:
                sp4 = tl.where(sh4, s_sd_ptr, s2_e)
                acc4 = qdot(w4, a_m.to(tl.bfloat16), acc4, sp4, hr, hm, ic * BI4, Q_2, H, isl4)
            else:
                acc4 = qdot_either(acc4, w4, w4s, sh4, a_m.to(tl.bfloat16), s2_e, s_sd_ptr, hr, hm,
                                   ic * BI4, Q_2, Q_SD, H, IR, H, ISR)  # fmt: skip
            if ic == KCH4 - 1:
                ppr = tl.sum(tl.where((js == sj4 - s0)[:, None], pp_j, 0), axis=0)  # [BB]
                put_words(p4l_ptr, ppr[None, :] * H + hr[:, None], _fp32_bits(acc4),
                     (ppr >= 0)[None, :] & hm[:, None], tag, INTERP)  # fmt: skip
                acc4 = tl.zeros([BN4, BB], dtype=tl.float32)

    _stamp(trace_ptr, 8, TRACE)

    # ------------------- S4 reduce: each row's pairs in rank order, then its shared pair
    NPW: tl.constexpr = PM + BB  # pair rows: routed (row, rank) then shared (row)
    if STAGES & 32:
        pw_i = tl.arange(0, NPP)
        pw_live = (pw_i < n_rows * TOPK) | ((pw_i >= PM) & (pw_i < PM + n_rows))
        for t in range(pid, TR, G):
            cols = t * CB + tl.arange(0, CB)
            colm = cols < H
            widx = pw_i[:, None] * H + cols[None, :]
            _wait2d(p4l_ptr + widx, (pw_live & (pw_i < NPW))[:, None] & colm[None, :], widx,
                    tag, ctrl_ptr, health_ptr, RID_P4L, NPP, CB, INTERP)  # fmt: skip
            cm = rmask[:, None] & colm[None, :]
            acc5 = tl.zeros([BB, CB], dtype=tl.float32)
            for k in tl.static_range(TOPK):
                w5 = tl.load(p4l_ptr + (rows * TOPK + k)[:, None] * H + cols[None, :], mask=cm,
                             other=0, cache_modifier=".cg")  # fmt: skip
                acc5 += _words_to_fp32(w5)
            w5 = tl.load(p4l_ptr + (PM + rows)[:, None] * H + cols[None, :], mask=cm, other=0,
                         cache_modifier=".cg")  # fmt: skip
            acc5 += _words_to_fp32(w5)
            off = rows[:, None] * H + cols[None, :]
            if RANKS == 1:
                tl.store(out_h_ptr + off, acc5.to(tl.bfloat16), mask=cm)
            else:
                _put_partial(
                    scratch_ptr, peers_ptr, OFF_P4, slot4 + rank, tl.trans(acc5), cols, rows,
                    rmask[None, :] & colm[:, None], tag, RANKS, W_P, H, SYS, INTERP,
                )  # fmt: skip

    _stamp(trace_ptr, 9, TRACE)

    # --------------------------- S4 ranks (TP > 1): every rank's MoE sums, in rank order
    if (RANKS > 1) and (STAGES & 64):
        for t in range(pid, TR, G):
            cols = t * CB + tl.arange(0, CB)
            cm = rmask[:, None] & (cols[None, :] < H)
            s4 = _sum_partials(
                p4_read, slot4, RID_P4, n_rows, cols, tag, ctrl_ptr, health_ptr,
                RANKS, W_P, H, BB, CB, INTERP,
            )  # fmt: skip
            off = rows[:, None] * H + cols[None, :]
            tl.store(out_h_ptr + off, s4.to(tl.bfloat16), mask=cm)


# ------------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class K2Shape(TailShape):
    """Per-rank sizes this backend's K2 is built for (fields, ``from_dims`` and the shared
    limits: :class:`~mono_ext.models.qwen3_next.shapes.TailShape`)."""

    @property
    def slots(self) -> int:
        """Routed slots a launch can touch: min(E, BLOCK_B * top_k)."""
        return min(self.experts, BLOCK_B * self.top_k)

    @property
    def pairs(self) -> int:
        return BLOCK_B * self.top_k

    @property
    def act_words(self) -> int:
        return (max(self.moe_inter, self.shared_inter) + 1) // 2


@dataclass(frozen=True)
class K2Config:
    """Grid and tiles (one build per config; none of it changes per step).

    Every GEMV is ``W [bn, K] @ x^T [K, Bb]``: weight rows are the MMA's M (64 rows over 4
    warps: wgmma-sized, no warp re-reads another's weights), the rows of the batch its N.
    ``kspl1`` (None: from the grid) splits out_proj's K so that S1 has about ``grid`` tasks;
    its partials are summed in a fixed order by the next stage.
    """

    grid: int
    num_warps: int = 4
    bn: int = 64  # weight rows per MMA tile (out_proj, router)
    bn3: int = 64  # gate_up rows per task (half gate, half up): smaller = finer balance
    bn4: int = 64  # down: H rows per (slot, H block) task
    bk1: int = 256  # out_proj K chunk
    kspl1: int | None = None  # out_proj K splits (power of two)
    ks2: int = 8  # router K splits (partial logits summed in order by every CTA)
    bk2: int = 256
    bk3: int = 256  # gate_up K chunk
    bi4: int = 256  # down I chunk
    cb: int = 16  # columns per reduce task
    rb: int = 1  # rows per top-k wait (each covers every K split of the logits)
    ach: int = 8  # (slot, row) activation rows per down-stage wait (power of two)
    rn: int = 1  # rows per norm wait (each wait covers all of H)
    prefetch: bool = True  # L2 prefetch of router/shared (after S1) and down planes (S4)
    ns1: int = 4  # weight chunks in flight (Triton pipeline stages): out_proj
    ns3: int = 4  # gate_up
    ns4: int = 4  # down
    trace: bool = False  # per-CTA %globaltimer stamps (benchmarks only; ws.trace)
    bal3: bool = False  # gate_up tile height picked per step (measured slower: off)
    task_rows: int = 4  # what one more gate_up task costs, in rows, when picking its height
    pf3: bool = False  # CTAs with an extra gate_up task pull it into L2 first (slower: off)

    def splits(self, shape: K2Shape) -> int:
        """out_proj's K splits for this shape: about one S1 task per CTA."""
        blocks = -(-shape.hidden // self.bn)
        per_block = 1 << max(0, (max(1, self.grid // blocks)).bit_length() - 1)
        kspl1 = self.kspl1 or min(per_block, max(1, _next_pow2(-(-shape.in_dim // self.bk1))))
        for name, v in (("kspl1", kspl1), ("bn3", self.bn3), ("bn4", self.bn4)):
            if v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two")
        return kspl1


def k2_program(shape: K2Shape, config: K2Config) -> Program:
    """K2's regions and stages (checked by ``runtime.layout.check_handoffs`` at build).

    ``act`` holds one activation row per (slot, row), ``p4l`` one down partial per (pair, H
    row): pairs are (row, pick rank) then the shared expert's (row). At TP1 the out_proj
    partials are local and the pair sum is the output; at TP > 1 ``p1`` and ``p4`` are peer
    regions (every rank pushes into its slot on every rank: the all-reduce is the sum the
    next stage takes over ranks, in rank order).
    """
    h, bb = shape.hidden, BLOCK_B
    kspl1 = config.splits(shape)
    peer = shape.tp > 1
    regions = [
        Region("p1", kspl1 * bb * h, peer=peer),
        Region("resid", bb * h),
        Region("logits", config.ks2 * bb * shape.experts),
        Region("act", (shape.slots + 1) * bb * shape.act_words),
        Region("p4l", (shape.pairs + bb) * h),
    ]
    stages = [
        Stage("out_proj", [push("p1") if peer else write("p1")]),
        Stage("residual", [wait("p1"), write("resid")]),
        Stage("norm_router", [wait("resid"), write("logits")]),
        Stage("topk_gate_up", [wait("logits"), write("act")]),
        Stage("down", [wait("act"), write("p4l")]),
    ]
    if peer:
        regions.append(Region("p4", bb * h, peer=True))
        stages += [Stage("moe_sum", [wait("p4l"), push("p4")]), Stage("moe_out", [wait("p4")])]
    else:
        stages.append(Stage("moe_out", [wait("p4l")]))
    return Program("k2", tuple(regions), tuple(stages))


@dataclass
class K2Workspace:
    """One rank's scratch: mailbox regions and per-CTA private rows (zeroed once)."""

    scratch: Any  # int64 [scratch_words]
    xs: Any  # bf16 [G, 2, Bb, H]
    pw: Any  # fp32 [G, Bb, EP]
    prk: Any  # int32 [G, Bb, EP]
    wsc: Any  # fp32 [G, Um + 1, Bb]
    ppos: Any  # int32 [G, Um + 1, Bb]
    meta: Any  # int32 [G, Um + 1]
    trace: Any = None  # int64 [G, 16] (``trace`` builds only)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _interp() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


#: planes K2 reads in any format of ``planes.READ_FORMATS``, besides out_proj / o_proj (the
#: engines leave the router and shared_expert_gate bf16; a checkpoint could still quantize them)
QUANTIZABLE = ("w13", "w2", "shared_gate_up", "shared_down", "router", "shared_expert_gate")

_WEIGHT_KEYS = (
    "post_attention_layernorm",
    "router",
    "w13",
    "w2",
    "shared_gate_up",
    "shared_down",
    "shared_expert_gate",
)


@dataclass
class K2Launch:
    """Build once (compile + load + residency check), then launch once per layer per step.

    ``co_resident``: how many launches of this kernel spin together on one device (``tp``
    for virtual TP, 1 for real TP). ``kind``: "gdn" reads ``weights["out_proj"]``, "attn"
    ``weights["o_proj"]``. ``gated`` (attention only): :meth:`launch` takes the pre-sigmoid
    output ``gate`` next to the raw attention output and S1 forms bf16(o_in * sigmoid(gate))
    as it loads (compiled in; no extra launch). ``formats``: plane -> format of the planes
    not in bf16 (``kernels.triton.planes``; a quantized plane's scales come as
    ``weights[plane + ".scale"]``); planes K2 does not read are ignored.
    """

    shape: K2Shape
    config: K2Config
    kind: str = "gdn"
    gated: bool = False
    co_resident: int = 1
    sys_scope: bool = False
    stages: int = STAGES_ALL
    formats: Mapping[str, str] = field(default_factory=dict)
    layout: Any = field(init=False)
    _compiled: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.shape.validate()
        if self.kind not in ("gdn", "attn"):
            raise ValueError(f"kind must be 'gdn' or 'attn', got {self.kind!r}")
        if self.gated and self.kind != "attn":
            raise ValueError("only attention layers have an output gate (gated needs kind 'attn')")
        c = self.config
        if c.bn != 16 * c.num_warps:
            raise ValueError(f"bn={c.bn} must be 16 * num_warps (one M16 slab per warp)")
        for name in ("bn3", "bn4"):
            if not 16 <= getattr(c, name) <= 64:
                raise ValueError(f"{name}={getattr(c, name)} must be 16, 32 or 64 (MMA rows)")
        self.kspl1 = c.splits(self.shape)
        self.layout = plan_layout(k2_program(self.shape, c), self.shape.tp)
        self._check_formats()

    # -- plane formats -------------------------------------------------------------------
    @property
    def w_o_name(self) -> str:
        return "out_proj" if self.kind == "gdn" else "o_proj"

    def fmt(self, plane: str) -> str:
        return self.formats.get(plane, "bf16")

    def _check_formats(self) -> None:
        for plane in (self.w_o_name, *QUANTIZABLE):
            format_code(self.formats, plane)  # raises for a format the kernels do not read

    # -- sizes ---------------------------------------------------------------------------
    @property
    def peer_words(self) -> int:
        return self.layout.peer_words

    def label(self) -> str:
        s = self.shape
        return (
            f"k2 {self.kind} h{s.hidden} in{s.in_dim} e{s.experts}k{s.top_k} i{s.moe_inter}"
            f" is{s.shared_inter} tp{s.tp} grid{self.config.grid} w{self.config.num_warps}"
            + (" gated" if self.gated else "")
        )

    @property
    def meta_words(self) -> int:
        return self.shape.slots + 1

    def workspace(self, device: Any) -> K2Workspace:
        import torch

        g, s = self.config.grid, self.shape
        return K2Workspace(
            scratch=torch.zeros(
                max(self.layout.scratch_words, 16), dtype=torch.int64, device=device
            ),
            xs=torch.zeros(g, 2, BLOCK_B, s.hidden, dtype=torch.bfloat16, device=device),
            pw=torch.zeros(g, BLOCK_B, _next_pow2(s.experts), dtype=torch.float32, device=device),
            prk=torch.zeros(g, BLOCK_B, _next_pow2(s.experts), dtype=torch.int32, device=device),
            wsc=torch.zeros(g, s.slots + 1, BLOCK_B, dtype=torch.float32, device=device),
            ppos=torch.full((g, s.slots + 1, BLOCK_B), -1, dtype=torch.int32, device=device),
            meta=torch.zeros(g, self.meta_words, dtype=torch.int32, device=device),
            trace=(
                torch.zeros(g, 16, dtype=torch.int64, device=device) if self.config.trace else None
            ),
        )

    def _max_tasks3(self) -> int:
        """gate_up tasks of the widest step: the shared expert and every routed slot, at the
        smallest tile height ``bal3`` may pick (half the tile)."""
        s, c = self.shape, self.config
        bi3 = c.bn3 // 2
        low = max(2, bi3 // 2) if c.bal3 else bi3
        return -(-s.shared_inter // low) + s.slots * -(-s.moe_inter // low)

    def _run_slots(self) -> int:
        """Slots one CTA's run of down tasks can touch (power of two): a run of at most
        ceil(tasks / grid) tasks, ``H / bn4`` tasks per slot, may start inside a slot."""
        s, c = self.shape, self.config
        rb4 = -(-s.hidden // c.bn4)
        run = -(-((s.slots + 1) * rb4) // c.grid)
        return _next_pow2(-(-run // rb4) + 1)

    def _constexprs(self) -> dict:
        s, c, lay = self.shape, self.config, self.layout
        rid = {r.name: i for i, r in enumerate(lay.program.regions)}
        # a block-128 plane's K chunks stay inside one scale column
        lim1 = chunk_limit(self.formats, self.w_o_name) or c.bk1
        lim2 = chunk_limit(self.formats, "router") or c.bk2
        lim3 = chunk_limit(self.formats, "w13", "shared_gate_up") or c.bk3
        lim4 = chunk_limit(self.formats, "w2", "shared_down") or c.bi4
        return dict(
            H=s.hidden,
            KO=s.in_dim,
            E=s.experts,
            EP=_next_pow2(s.experts),
            TOPK=s.top_k,
            NORM_TOPK=bool(s.norm_topk),
            IR=s.moe_inter,
            ISR=s.shared_inter,
            OFF_P1=lay.offsets["p1"],
            OFF_RESID=lay.offsets["resid"],
            OFF_LOGITS=lay.offsets["logits"],
            OFF_ACT=lay.offsets["act"],
            OFF_P4L=lay.offsets["p4l"],
            OFF_P4=lay.offsets.get("p4", 0),
            RID_P1=rid["p1"],
            RID_RESID=rid["resid"],
            RID_LOGITS=rid["logits"],
            RID_ACT=rid["act"],
            RID_P4L=rid["p4l"],
            RID_P4=rid.get("p4", 0),
            RANKS=s.tp,
            SYS=self.sys_scope,
            BB=BLOCK_B,
            BN=c.bn,
            BN3=c.bn3,
            BN4=c.bn4,
            BK1=min(c.bk1, max(16, _next_pow2(-(-s.in_dim // self.kspl1))), lim1),
            KSPL1=self.kspl1,
            KS2=c.ks2,
            BK2=min(c.bk2, max(16, _next_pow2(-(-s.hidden // c.ks2))), lim2),
            BK3=min(c.bk3, max(16, _next_pow2(s.hidden)), lim3),
            BI4=min(c.bi4, max(32, _next_pow2(max(s.moe_inter, s.shared_inter))), lim4),
            JS=self._run_slots(),
            ACH=min(c.ach, self._run_slots() * BLOCK_B),
            CB=c.cb,
            RB=c.rb,
            RN=c.rn,
            HP=_next_pow2(s.hidden),
            PREFETCH=c.prefetch and not _interp(),
            GATED=self.gated,
            NPP=_next_pow2(s.pairs + BLOCK_B),
            IWPOW=_next_pow2(s.act_words),
            STAGES=self.stages,
            PIPE1=c.ns1,
            PIPE3=c.ns3,
            PIPE4=c.ns4,
            JM3=_next_pow2(-(-(self._max_tasks3()) // c.grid)),
            TRACE=c.trace,
            BAL3=c.bal3,
            TASK_ROWS=c.task_rows,
            PF3=c.pf3 and not _interp(),
            Q_O=format_code(self.formats, self.w_o_name),
            Q_13=format_code(self.formats, "w13"),
            Q_2=format_code(self.formats, "w2"),
            Q_SGU=format_code(self.formats, "shared_gate_up"),
            Q_SD=format_code(self.formats, "shared_down"),
            Q_R=format_code(self.formats, "router"),
            Q_SEG=format_code(self.formats, "shared_expert_gate"),
            SPE13=scale_numel(self.fmt("w13"), 2 * s.moe_inter, s.hidden),
            SPE2=scale_numel(self.fmt("w2"), s.hidden, s.moe_inter),
            INTERP=_interp(),
            num_warps=c.num_warps,
            num_stages=1,
        )

    # -- build / launch ------------------------------------------------------------------
    def _args(self, o_in, residual, weights, out_hidden, out_residual, ws, ctrl, health, peers,
              n_rows, layer, layers_per_step, gate=None):  # fmt: skip
        w_o = weights[self.w_o_name]

        def scale(plane):  # bf16 planes have none: any fp32 pointer (never read)
            return weights.get(plane + ".scale", ws.pw)

        return (
            o_in,
            o_in if gate is None else gate,  # read only by gated builds
            residual,
            out_hidden,
            out_residual,
            w_o,
            weights["post_attention_layernorm"],
            weights["router"],
            weights["shared_expert_gate"],
            weights["w13"],
            weights["w2"],
            weights["shared_gate_up"],
            weights["shared_down"],
            scale(self.w_o_name),
            scale("w13"),
            scale("w2"),
            scale("shared_gate_up"),
            scale("shared_down"),
            scale("router"),
            scale("shared_expert_gate"),
            ws.scratch,
            ws.xs,
            ws.pw,
            ws.prk,
            ws.wsc,
            ws.ppos,
            ws.meta,
            ctrl if peers is None else peers,
            ctrl,
            health,
            ws.meta if ws.trace is None else ws.trace,
            n_rows,
            layer,
            layers_per_step,
            float(self.shape.eps),
        )

    def check(self, o_in, residual, weights, out_hidden, out_residual, gate=None) -> int:
        """Validate shapes, dtypes, contiguity and 16-byte alignment; returns the width."""
        import torch

        b = o_in.shape[0] if o_in.dim() == 2 else -1
        acts, bad = self.shape.launch_tensors(self.kind, self.gated, b, o_in, residual, weights,
                                              out_hidden, out_residual, gate)  # fmt: skip
        for plane in (self.w_o_name, *QUANTIZABLE):  # weights and scales in their formats
            if plane in acts:
                bad += plane_reasons(plane, weights, self.fmt(plane), acts.pop(plane)[1])
        for name, (t, shp) in acts.items():
            if tuple(t.shape) != shp:
                bad.append(f"{name} is {tuple(t.shape)}, expected {shp}")
            if t.dtype != torch.bfloat16:
                bad.append(f"{name} is {t.dtype}, expected bfloat16")
            if not t.is_contiguous():
                bad.append(f"{name} is not contiguous")
            if t.data_ptr() % 16:
                # Triton keys variants on 16-byte pointer alignment: another alignment would
                # compile (and load a module) mid-step, which stalls against spinning peers.
                bad.append(f"{name} is not 16-byte aligned (no JIT mid-step)")
        if not 1 <= b <= BLOCK_B:
            bad.append(f"width {b} outside 1..{BLOCK_B}")
        if bad:
            raise ValueError(f"{self.label()}: " + "; ".join(bad))
        return b

    def build(self, device: Any = "cuda") -> None:
        """Compile and load at startup (never mid-step), and check the grid is resident."""
        import torch

        from mono_ext.runtime.build_cache import (
            check_residency,
            check_unspecialized,
            device_limits,
            kernel_resources,
        )
        from mono_ext.runtime.peers import RankState

        s = self.shape
        dev = torch.device(device)
        if _interp():
            # the CPU interpreter (tests without a GPU): nothing to compile, one stage per
            # launch, so nothing spins and residency does not apply; TP1 only (virtual ranks
            # would have to interleave their stages)
            if s.tp > 1:
                raise ValueError(f"{self.label()}: the interpreter path runs TP1 only")
            self.resources = None
            self._compiled = "interpreter"
            return
        check_unspecialized(k2_kernel, PER_STEP_ARGS)
        bf = dict(dtype=torch.bfloat16, device=dev)
        # Tiny stand-ins: warmup compiles for dtypes and alignment, it launches nothing.
        one = torch.zeros(16, **bf)
        f32, i32 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int32, device=dev)
        weights = {k: one for k in _WEIGHT_KEYS}
        weights["out_proj"] = weights["o_proj"] = one
        for plane in (self.w_o_name, *QUANTIZABLE):
            if self.fmt(plane) != "bf16":
                weights[plane] = torch.zeros(16, dtype=torch.float8_e4m3fn, device=dev)
                weights[plane + ".scale"] = torch.zeros(16, **f32)
        ws = K2Workspace(
            scratch=torch.zeros(16, dtype=torch.int64, device=dev),
            xs=one,
            pw=torch.zeros(16, **f32),
            prk=torch.zeros(16, **i32),
            wsc=torch.zeros(16, **f32),
            ppos=torch.zeros(16, **i32),
            meta=torch.zeros(16, **i32),
            trace=torch.zeros(16, dtype=torch.int64, device=dev) if self.config.trace else None,
        )
        st = RankState.create(0, dev, 1.0)
        peers = torch.zeros(max(s.tp, 2), dtype=torch.int64, device=dev) if s.tp > 1 else None
        args = self._args(one, one, weights, one, one, ws, st.ctrl, st.health, peers, 2, 0, 1,
                          one if self.gated else None)  # fmt: skip
        compiled = k2_kernel.warmup(*args, grid=(self.config.grid,), **self._constexprs())
        res = kernel_resources(compiled)
        check_residency(self.label(), self.config.grid * self.co_resident, res, device_limits(dev))
        self.resources = res
        self._compiled = compiled

    def launch(
        self,
        o_in,
        residual,
        weights: dict,
        out_hidden,
        out_residual,
        *,
        ws: K2Workspace,
        ctrl,
        health,
        peers=None,
        layer: int = 0,
        layers_per_step: int = 1,
        validate: bool = True,
        gate=None,
    ) -> None:
        """One K2 for ``o_in.shape[0]`` rows. The caller bumps the epoch once per step.
        ``gate``: the pre-sigmoid output gate, for (and only for) a ``gated`` build."""
        if self._compiled is None:
            raise RuntimeError(f"{self.label()}: build() at startup before launching")
        if validate:
            n_rows = self.check(o_in, residual, weights, out_hidden, out_residual, gate)
        else:
            if self.gated != (gate is not None):
                raise ValueError(f"{self.label()}: gate must be given exactly for gated builds")
            n_rows = o_in.shape[0]
        if self.shape.tp > 1 and peers is None:
            raise ValueError(f"{self.label()}: TP {self.shape.tp} needs the peer table")
        args = self._args(o_in, residual, weights, out_hidden, out_residual, ws, ctrl, health,
                          peers, n_rows, layer, layers_per_step, gate)  # fmt: skip
        cx = self._constexprs()
        if cx["INTERP"]:  # one stage per launch: every hand-off is written before it is read
            for st in STAGE_ORDER:
                if st & self.stages:
                    k2_kernel[(self.config.grid,)](*args, **{**cx, "STAGES": st})
        else:
            k2_kernel[(self.config.grid,)](*args, **cx)


def shard_tail_weights(
    weights: dict, tp: int, rank: int, formats: Mapping[str, str] | None = None
) -> dict:
    """One rank's K2 planes cut from full (TP1) planes, the way the engines shard them:
    out_proj/o_proj and w2/shared_down split their input columns (row-parallel), w13 and
    shared_gate_up split I within the gate rows and within the up rows (column-parallel),
    router, shared_expert_gate and the norm weight are replicated. A quantized plane's
    ``.scale`` (``formats`` names its format) is cut to match: block-128 scales by blocks,
    per-row scales with their rows, a per-tensor scale replicated. Tests and benchmarks use
    it; engines hand their own shards."""
    import torch

    if tp == 1:
        return dict(weights)
    formats = formats or {}

    def cols(w, k):  # the rank's share of the last dim, k per rank
        return w[..., rank * k : (rank + 1) * k].contiguous()

    def gate_up_rows(w, c):  # the rank's c rows of the gate half and of the up half
        i = w.shape[-2] // 2
        gate = w[..., rank * c : (rank + 1) * c, :]
        up = w[..., i + rank * c : i + (rank + 1) * c, :]
        return torch.cat([gate, up], dim=-2).contiguous()

    out = {}
    for name, w in weights.items():
        plane, is_scale = name.removesuffix(".scale"), name.endswith(".scale")
        fmt = formats.get(plane, "bf16")
        if is_scale and fmt == "fp8_tensor":
            out[name] = w
        elif plane in ("out_proj", "o_proj", "shared_down", "w2"):
            if not is_scale:
                out[name] = cols(w, w.shape[-1] // tp)
            elif fmt == "fp8_block128":
                out[name] = cols(w, weights[plane].shape[-1] // tp // 128)
            else:  # per-row scales: the rows are not split
                out[name] = w
        elif plane in ("w13", "shared_gate_up"):
            rows = weights[plane].shape[-2] // 2 // tp  # gate (and up) rows per rank
            out[name] = gate_up_rows(w, rows // 128 if fmt == "fp8_block128" and is_scale else rows)
        else:
            out[name] = w
    return out
