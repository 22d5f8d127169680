"""K1's device code: the persistent layer-front kernels ``k1_gdn_kernel`` and ``k1_attn_kernel``
and their stages (``@triton.jit`` helpers, inlined; the input norm is ``k1_norm``, GDN's S2
``k1_recurrence``, the tagged-word hand-offs ``k1_words``, S1's units and tail-tile sums
``k1_units``). The host side
(shapes, config, programs, launches, the tensor contract) is ``k1.py``.

Program (both kinds; declared by ``k1.k1_gdn_program`` / ``k1.k1_attn_program`` and checked
by ``runtime.layout.check_handoffs`` at build):

- prologue, every CTA: residual add of the B rows and their Gemma weighting ``s * (1 + w)``
  (redundant, so no hand-off), kept in a private bf16 buffer as the dot operand, with the
  rows' rsqrt for the input norm, which each tile's accumulator takes at its end (the rows'
  loads all in flight at once, the operand written once before the first weight chunk);
  CTA 0 writes ``residual_out``. Steps wider than ``NONCE`` (``K1Config.norm_once_above``;
  by default none) instead norm each row once, in S0: CTA p norms row p into the shared
  ``xs[G]`` and its ``residual_out`` and flags it with its rsqrt; S1 waits for the flags and
  reads the shared rows (the same values, so the same bits).
- S1, over the grid: the projection rows in tiles of ``BN`` rows x all of H, whole rounds
  of the grid, then the rest in tail tiles of ``BN`` rows split along K into ``SPLIT``
  units, one per CTA (``k1_plan.s1_units``: every chunk the same bytes, so no CTA streams
  at a fraction of the others' rate); GDN: ``in_proj_ba`` first (every S2 task needs beta
  and g). One flattened loop over (unit, K chunk); each chunk is ``acc^T = W x^T`` with the
  weight tile as wgmma's M operand. A tail unit ends
  by storing its part and counting itself in (an atomic per tail tile); the last of a
  tile's units to arrive sums the parts in part order and runs the tile's epilogue, and no
  unit ever waits (``tail_sum``). Epilogue per tile: GDN: the conv update for the conv
  channels in the tile (read K-1 cached values, write the shifted window back, SiLU), beta =
  sigmoid(b), g = -exp(A_log) softplus(a + dt_bias); attention: gate and v go straight to
  their outputs. Everything a later stage needs goes into one
  tagged mailbox region (fp32 bits). An fp8 plane is read in place through
  ``planes.qdot`` (a chunk's MMA on the codes widened to bf16, times its scales); block-128
  planes cap the K chunk at 128 (one scale column per chunk). When in_proj_qkvz and in_proj_ba
  differ in format (an FP8 checkpoint keeps ba bf16), each chunk loads from both planes, the
  other's fully masked. The loop is software-pipelined (``NS`` = ``pipeline_stages`` of async
  copies); what an epilogue reads (conv window, taps, A_log, dt_bias) is loaded at the
  tile's first chunk, because a dependent load behind a full memory pipeline costs a
  whole queue's latency (several us, measured on H200).
- S2, over the grid: GDN: one task per (row, value head): wait for its q, k (the key
  head's), v, z, beta, g words, L2-norm q/k, decay + delta-rule update of the
  [Dv, Dk] state tile (fp32 math, stored back in the state's dtype), o = S q, gated RMSNorm;
  one bounded wait covers every word of a task; the state tile in ``DVS`` row slices
  (``K1Config.state_row_slices``; registers). Tasks run from the last CTA down (the first
  CTAs carry the extra S1 tiles). The first task's state is L2-prefetched before S1 (not
  loaded: registers held through S1 are taken from its projection loop); later ones are
  L2-prefetched one task ahead.
  Attention: one task per q or k head (all rows): wait, Gemma norm, RoPE from a cos/sin
  table (positions, cos/sin and norm weights are loaded before S1).
- GDN with ``K1Config.dv_split`` > 1 (``k1_recurrence``): S2 runs each (row, head) as
  ``dv_split`` tasks over blocks of Dv rows, each handing its o and sum of o^2 on as tagged
  words (``oraw``, ``osq``), and S3, after every S2 task of the CTA, waits for a head's sums
  and writes its gated norm.

A CTA finishes all of its S1 tiles before its first S2 wait and all of its S2 tasks before
its first S3 wait; S1 never waits and S2 waits only on S1, so with every CTA resident (checked
at build) no wait can deadlock. Waits are bounded
(``primitives.wait_tagged``). Reduction orders depend only on the build, never on the
width, so a row's result does not depend on the other rows and replays are bit-identical.

Tensor contract (one layer; ``B`` = rows 1..16, ``Bb`` = ``BLOCK_B`` = 16, ``G`` = grid;
sizes are this rank's; ``C`` = conv_dim = 2*Hk*Dk + Hv*Dv, ``Wg`` = C + Hv*Dv + 2*Hv):

| name            | shape                  | dtype     | layout                                  | writer            |
|-----------------|------------------------|-----------|-----------------------------------------|-------------------|
| hidden          | [B, H]                 | bf16      | contiguous rows                         | engine / K2       |
| residual        | [B, H] or None         | bf16      | contiguous rows; None on layer 0        | K2                |
| residual_out    | [B, H]                 | bf16      | hidden + residual (fp32 add, rounded)   | this launch (CTA0)|
| input_layernorm | [H]                    | bf16      | Gemma weight (``x * (1 + w)``)          | engine (read)     |
| in_proj_qkvz    | [2*Hk*Dk + 2*Hv*Dv, H] | bf16/fp8  | "interleaved" or "contiguous" packing   | engine (read)     |
|                 |                        |           | (compiled in; ``gdn_row_map`` is the    |                   |
|                 |                        |           | host mirror of where each row goes)     |                   |
| in_proj_ba      | [2*Hv, H]              | bf16/fp8  | same packing                            | engine (read)     |
| P + ".scale"    | per ``planes``         | fp32      | scales of an fp8 plane P (stored rows)  | engine (read)     |
| conv1d          | [C, 1, 4] or [C, 4]    | bf16      | contiguous                              | engine (read)     |
| A_log / dt_bias | [Hv]                   | fp32/bf16 | (dtypes fixed at build)                 | engine (read)     |
| norm            | [Dv]                   | bf16      | plain weight of the gated norm          | engine (read)     |
| conv_state      | any [S, ., .] view     | bf16      | [S, K-1, C] (time_chan) or [S, C, K-1]  | this launch (S1)  |
|                 |                        |           | (chan_time):                            |                   |
|                 |                        |           | read through its strides; in place      |                   |
| ssm_state       | [S, Hv, Dv, Dk]        | fp32/bf16 | in place; each slot contiguous, slot    | this launch (S2)  |
|                 |                        |           | stride % 16 == 0; "kv": slot memory is  |                   |
|                 |                        |           | [Hv, Dk, Dv]                            |                   |
| slots           | [B]                    | int32     | < 0 or == null_slot: padding (no state  | engine            |
|                 |                        |           | read or written, o_in row = 0)          |                   |
| o_in            | [B, Hv*Dv]             | bf16      | out_proj's input                        | this launch (S2)  |
| qkv_proj        | [(2*Hq + 2*Hkv)*D, H]  | bf16/fp8  | per q head [q (D), gate (D)]; k; v      | engine (read)     |
| q_norm / k_norm | [D]                    | bf16      | Gemma weights                           | engine (read)     |
| positions       | [B]                    | int64     | 0-based token positions                 | engine            |
| q / gate        | [B, Hq*D]              | bf16      | normed + RoPE'd q / pre-sigmoid gate    | this launch       |
| k / v           | [B, Hkv*D]             | bf16      | normed + RoPE'd k / v                   | this launch       |
| rope table      | [P, rotary_dim]        | fp32      | cos (rd/2) then sin (rd/2) per position | build (host, once)|
| scratch: proj   | [Bb, Wg] words         | int64     | tagged fp32: conv out (q, k, v channels | S1 -> S2          |
|                 |                        |           | head-major), z, beta, g                 |                   |
| scratch: qk     | [Bb, (Hq + Hkv)*D]     | int64     | tagged fp32 raw q, k                    | S1 -> S2 (attn)   |
| scratch: osq    | [Bb, Hv, dv_split]     | int64     | tagged fp32 sum of o^2 per block        | S2 -> S3 (split)  |
| scratch: oraw   | [Bb, Hv*Dv]            | int64     | tagged fp32 o, read by the same CTA     | S2 -> S3 (split)  |
| priv xs         | [G, Bb, H]             | bf16      | this CTA's rows s * (1 + w) (operand)   | prologue, same CTA|
| xs[G] (shared)  | [Bb, H]                | bf16      | each row s * (1 + w), normed once       | S0 -> S1 (flag)   |
| scratch: nflag  | [Bb]                   | int64     | tagged fp32 rsqrt per row, after xs[G]  | S0 -> S1 (once)   |
| s1_split: parts | [NTT, SPLIT, Bb, BN]   | fp32      | a tail tile's K parts (NTT = NU/SPLIT   | S1 -> S1 (the     |
|                 |                        |           | tiles), then NTT int32 arrival counts   | tile's last unit) |
| ctrl / health   | see runtime.health     |           | epoch read for tags; sticky failed word | host / waits      |
| trace           | [G, 16]                | int64     | %globaltimer ns per CTA at TRACE_POINTS | TRACE builds only |
"""

from __future__ import annotations

import triton
import triton.language as tl

from mono_ext.kernels.triton.planes import qdot, qdot_either
from mono_ext.kernels.triton.primitives import (
    pdl_prologue,
    seq_tag,
    stamp,
    stamp_when,
    step_seq,
    words_to_fp32,
)
from mono_ext.models.qwen3_next.triton.k1_norm import norm_publish, normed_rows
from mono_ext.models.qwen3_next.triton.k1_recurrence import (
    block_task,
    gdn_s2,
    gdn_s2_blocks,
    gdn_s3_norm,
)
from mono_ext.models.qwen3_next.triton.k1_units import (
    gdn_tile_rows,
    prefetch_chunk,
    s1_chunk,
    s1_iterations,
    tail_sum,
)
from mono_ext.models.qwen3_next.triton.k1_words import get_f32, prefetch_l2, put_f32

__all__ = [
    "S0",
    "S1",
    "S2",
    "S3",
    "STAGES_ALL",
    "TRACE_POINTS",
    "k1_attn_kernel",
    "k1_gdn_kernel",
]

S1 = 1  # prologue + projections (+ conv); the interpreter runs each stage as a launch
S2 = 2  # recurrence + gated norm (GDN) / norm + RoPE (attention)
S3 = 4  # the blocked recurrence's gated norm (GDN with dv_split > 1)
S0 = 8  # each row normed once and flagged (K1Config.norm_once_above); runs before S1
STAGES_ALL = 15
#: what a TRACE build stamps, by word (both kinds): the CTA's start, its rows normed (the
#: first weight chunk can be asked for), its last S1 tile handed on, its first S2 task's
#: words all arrived (CTAs with an S2 task), its end
TRACE_POINTS = ("start", "rows normed", "S1 done", "first S2 words", "end")


@triton.jit
def _dot_chunk(acc, wt, xs_base, rows, rmask, k, H: tl.constexpr, sp, wrows, wlive, k0,
               Q: tl.constexpr, N: tl.constexpr):  # fmt: skip
    """One K chunk of a tile, ``acc^T += W x^T``: the weight chunk ``wt`` [BN, BK] is the MMA's
    M operand (wgmma), this CTA's weighted rows its N; ``Q`` is the plane's format, its scales
    at ``sp``, stored rows ``wrows``, chunk at column ``k0``."""
    xt = tl.load(xs_base + rows[None, :] * H + k[:, None], mask=rmask[None, :], other=0.0)
    return qdot(wt, xt, acc, sp, wrows, wlive, k0, Q, N, H)  # Q = 0: tl.dot(wt, xt, acc)


@triton.jit
def _dot_mixed(acc, wq, wa, is_ba, xs_base, rows, rmask, k, k0, sq_ptr, sba_ptr, wrows, live,
               H: tl.constexpr, PQ: tl.constexpr, PBA: tl.constexpr, Q_QKVZ: tl.constexpr,
               Q_BA: tl.constexpr):  # fmt: skip
    """A GDN chunk when in_proj_qkvz and in_proj_ba differ in format (the usual FP8 checkpoint:
    fp8 qkvz, bf16 ba): the tile's plane (``is_ba``) was loaded into ``wa`` or ``wq`` (the
    other fully masked); ``planes.qdot_either``."""
    xt = tl.load(xs_base + rows[None, :] * H + k[:, None], mask=rmask[None, :], other=0.0)
    return qdot_either(acc, wq, wa, is_ba, xt, sq_ptr, sba_ptr, wrows, live, k0, Q_QKVZ, Q_BA,
                       PQ, H, PBA, H)  # fmt: skip


@triton.jit
def _conv_inputs(
    dest, rvalid, slot64, conv_ptr, convw_ptr, alog_ptr, dtb_ptr, cs_slot, cs_t, cs_c,
    CONV: tl.constexpr, VD: tl.constexpr, HV: tl.constexpr, KC: tl.constexpr,
):  # fmt: skip
    """What a tile's epilogue reads from memory: the K-1 cached conv inputs [Bb, BN], the
    conv taps, A_log and dt_bias of its rows (zeros where they do not apply)."""
    is_conv = (dest >= 0) & (dest < CONV)
    is_a = dest >= CONV + VD + HV
    ch = tl.where(is_conv, dest, 0)
    ha = tl.where(is_a, dest - (CONV + VD + HV), 0)
    cm = rvalid[:, None] & is_conv[None, :]
    cbase = conv_ptr + slot64[:, None] * cs_slot + ch[None, :] * cs_c
    s0 = tl.load(cbase, mask=cm, other=0.0).to(tl.float32)
    s1 = tl.load(cbase + cs_t, mask=cm, other=0.0).to(tl.float32)
    s2 = tl.load(cbase + 2 * cs_t, mask=cm, other=0.0).to(tl.float32)
    w0 = tl.load(convw_ptr + ch * KC, mask=is_conv, other=0.0).to(tl.float32)
    w1 = tl.load(convw_ptr + ch * KC + 1, mask=is_conv, other=0.0).to(tl.float32)
    w2 = tl.load(convw_ptr + ch * KC + 2, mask=is_conv, other=0.0).to(tl.float32)
    w3 = tl.load(convw_ptr + ch * KC + 3, mask=is_conv, other=0.0).to(tl.float32)
    alog = tl.load(alog_ptr + ha, mask=is_a, other=0.0).to(tl.float32)
    dtb = tl.load(dtb_ptr + ha, mask=is_a, other=0.0).to(tl.float32)
    return s0, s1, s2, w0, w1, w2, w3, alog, dtb


@triton.jit
def _gdn_epilogue(
    acc, dest, s0, s1, s2, w0, w1, w2, w3, alog, dtb, rows, rmask, rvalid, slot64, proj_ptr,
    conv_ptr, cs_slot, cs_t, cs_c, tag,
    CONV: tl.constexpr, VD: tl.constexpr, HV: tl.constexpr, WROW: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    """One finished tile (acc [Bb, BN]): conv update (K = 4, window [s0, s1, s2, x] oldest
    first), beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), hand-off."""
    is_conv = (dest >= 0) & (dest < CONV)
    is_z = (dest >= CONV) & (dest < CONV + VD)
    is_b = (dest >= CONV + VD) & (dest < CONV + VD + HV)
    ch = tl.where(is_conv, dest, 0)
    cm = rvalid[:, None] & is_conv[None, :]
    cbase = conv_ptr + slot64[:, None] * cs_slot + ch[None, :] * cs_c
    y = s0 * w0[None, :] + s1 * w1[None, :] + s2 * w2[None, :] + acc * w3[None, :]
    tl.store(cbase, s1.to(conv_ptr.dtype.element_ty), mask=cm)
    tl.store(cbase + cs_t, s2.to(conv_ptr.dtype.element_ty), mask=cm)
    tl.store(cbase + 2 * cs_t, acc.to(conv_ptr.dtype.element_ty), mask=cm)
    conv_out = y * tl.sigmoid(y)
    xa = acc + dtb[None, :]
    sp = tl.where(xa > 20.0, xa, tl.log(1.0 + tl.exp(tl.minimum(xa, 20.0))))  # torch's softplus
    g = -tl.exp(alog)[None, :] * sp
    val = tl.where(
        is_conv[None, :],
        conv_out,
        tl.where(is_z[None, :], acc, tl.where(is_b[None, :], tl.sigmoid(acc), g)),
    )
    off = rows[:, None] * WROW + dest[None, :]
    put_f32(proj_ptr, off, val, rmask[:, None] & (dest >= 0)[None, :], tag, INTERP)


@triton.jit
def _gdn_s1(
    hid_ptr, res_ptr, rout_ptr, nw_ptr, wq_ptr, wba_ptr, convw_ptr, alog_ptr, dtb_ptr, conv_ptr,
    slots_ptr, xs_ptr, proj_ptr, sq_ptr, sba_ptr, pid, G, rows, rmask, n_rows, has_res,
    null_slot, cs_slot, cs_t, cs_c, eps, tag, H: tl.constexpr, HV: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, KC: tl.constexpr, WROW: tl.constexpr,
    INTERLEAVED: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    FT: tl.constexpr, SPLIT: tl.constexpr, NU: tl.constexpr, TR: tl.constexpr, split_ptr,
    CH: tl.constexpr, NS: tl.constexpr, PRE: tl.constexpr, CONV: tl.constexpr,
    VD: tl.constexpr, PQ: tl.constexpr, PBA: tl.constexpr, RR: tl.constexpr,
    Q_QKVZ: tl.constexpr, Q_BA: tl.constexpr, INTERP: tl.constexpr, trace_ptr,
    TRACE: tl.constexpr, nflag_ptr, ctrl_ptr, health_ptr, NONCE: tl.constexpr,
    RID_NFLAG: tl.constexpr,
):  # fmt: skip
    """GDN S1: input norm, then the projection units (ba rows first: every S2 task needs
    beta and g, then qkvz rows), flattened over K chunks; each tile's epilogue (in a split
    tail tile, by its last unit to arrive) runs the conv update and hands the payload words
    to S2."""
    # row space: in_proj_ba rows (padded to NA), then in_proj_qkvz rows; units: s1_chunk
    NA: tl.constexpr = (PBA + BN - 1) // BN * BN
    KCH: tl.constexpr = H // BK
    n_it = s1_iterations(pid, G, FT, NU, SPLIT, KCH)
    if PRE:  # the first chunks start moving into L2 while the norm runs
        for pi in tl.static_range(NS - 1):
            prefetch_chunk(wba_ptr, wq_ptr, pi, n_it, pid, G, KCH, NA, PBA, PQ, H, FT, SPLIT, TR,
                           BN, BK)  # fmt: skip

    xs_base, rstd = normed_rows(hid_ptr, res_ptr, nw_ptr, xs_ptr, rout_ptr, nflag_ptr, ctrl_ptr,
                                 health_ptr, pid, G, rows, rmask, n_rows, has_res, eps, tag, H,
                                 BB, CH, NONCE, RID_NFLAG, INTERP)  # fmt: skip
    stamp(trace_ptr, 1, TRACE)

    slot_r = tl.load(slots_ptr + rows, mask=rmask, other=-1)
    rvalid = rmask & (slot_r >= 0) & (slot_r != null_slot)
    slot64 = tl.where(rvalid, slot_r, 0).to(tl.int64)

    kk = tl.arange(0, BK)
    nn = tl.arange(0, BN)
    acc = tl.zeros([BN, BB], dtype=tl.float32)  # acc^T: weight rows x batch rows
    # a tile's epilogue inputs, loaded at its first chunk: their latency hides behind the
    # tile's other chunks instead of stalling the pipeline at the tile's end
    c0 = tl.zeros([BB, BN], dtype=tl.float32)
    c1 = c0
    c2 = c0
    cw0 = tl.zeros([BN], dtype=tl.float32)
    cw1 = cw0
    cw2 = cw0
    cw3 = cw0
    alog = cw0
    dtb = cw0
    # Software-pipelined (NS stages of async copies into shared memory): HBM latency is
    # covered by NS - 1 chunks in flight per CTA, also across tile epilogues.
    for it in tl.range(0, n_it, num_stages=NS):
        r0, nr, kc, first_chunk, ends_tile = s1_chunk(it, pid, G, FT, SPLIT, TR, BN, KCH)
        is_ba, r_in, live, dest = gdn_tile_rows(r0, nr, nn, NA, PQ, PBA, HV, DK, DV, RR,
                                                 INTERLEAVED)  # fmt: skip
        if Q_QKVZ == Q_BA:  # one format: one load from the tile's plane
            wb = tl.where(is_ba, wba_ptr, wq_ptr)
        k = kc * BK + kk
        if Q_QKVZ == Q_BA:
            wt = tl.load(
                wb + r_in[:, None] * H + k[None, :],
                mask=live[:, None],
                other=0.0,
            )
        else:  # element types differ: a load per plane, the other plane's fully masked
            wt = tl.load(wq_ptr + r_in[:, None] * H + k[None, :],
                         mask=(live & (is_ba == 0))[:, None], other=0.0)  # fmt: skip
            wa = tl.load(wba_ptr + r_in[:, None] * H + k[None, :],
                         mask=(live & is_ba)[:, None], other=0.0)  # fmt: skip
        if first_chunk:
            c0, c1, c2, cw0, cw1, cw2, cw3, alog, dtb = _conv_inputs(
                dest, rvalid, slot64, conv_ptr, convw_ptr, alog_ptr, dtb_ptr, cs_slot, cs_t,
                cs_c, CONV, VD, HV, KC,
            )  # fmt: skip
        if Q_QKVZ == Q_BA:
            # scale_index reads only K: PQ stands for either plane's N
            sp = tl.where(is_ba, sba_ptr, sq_ptr)
            acc = _dot_chunk(acc, wt, xs_base, rows, rmask, k, H, sp, r_in, live, kc * BK,
                             Q_QKVZ, PQ)  # fmt: skip
        else:
            acc = _dot_mixed(acc, wt, wa, is_ba, xs_base, rows, rmask, k, kc * BK, sq_ptr,
                             sba_ptr, r_in, live, H, PQ, PBA, Q_QKVZ, Q_BA)  # fmt: skip
        if ends_tile:  # a split tail unit is its CTA's last: summed after the loop
            acc = acc * rstd[None, :]  # the input norm (input_norm)
            _gdn_epilogue(
                tl.trans(acc), dest, c0, c1, c2, cw0, cw1, cw2, cw3, alog, dtb, rows, rmask,
                rvalid, slot64, proj_ptr, conv_ptr, cs_slot, cs_t, cs_c, tag,
                CONV, VD, HV, WROW, INTERP,
            )  # fmt: skip
            acc = tl.zeros_like(acc)
    # outside the pipelined loop: inside it, the sum's atomic and CTA barrier kept Triton from
    # pipelining the loop at all (the sm_90a build lost its multi-stage buffers)
    if SPLIT > 1:  # noqa: SIM102 (compiled in, then a branch per CTA)
        if pid < NU:
            tt = pid // SPLIT
            last, acc = tail_sum(acc, tt, pid, split_ptr, rows, rmask, BN, BB, SPLIT,
                                  NU // SPLIT, INTERP)  # fmt: skip
            if last:
                _, _, _, dest = gdn_tile_rows(FT * BN + tt * BN, BN, nn, NA, PQ, PBA, HV, DK, DV,
                                              RR, INTERLEAVED)  # fmt: skip
                _gdn_epilogue(
                    tl.trans(acc * rstd[None, :]), dest, c0, c1, c2, cw0, cw1, cw2, cw3, alog,
                    dtb, rows, rmask, rvalid, slot64, proj_ptr, conv_ptr, cs_slot, cs_t, cs_c,
                    tag, CONV, VD, HV, WROW, INTERP,
                )  # fmt: skip


@triton.jit
def _attn_s1(
    hid_ptr, res_ptr, rout_ptr, nw_ptr, wqkv_ptr, v_ptr, gate_ptr, xs_ptr, qk_ptr, sqkv_ptr, pid,
    G, rows, rmask, n_rows, has_res, eps, tag, H: tl.constexpr, HQ: tl.constexpr,
    D: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FT: tl.constexpr,
    SPLIT: tl.constexpr, NU: tl.constexpr, TR: tl.constexpr, split_ptr, CH: tl.constexpr,
    NS: tl.constexpr,
    PRE: tl.constexpr, Q_QKV: tl.constexpr, QG: tl.constexpr, KVD: tl.constexpr,
    PA: tl.constexpr, WA: tl.constexpr, INTERP: tl.constexpr, trace_ptr, TRACE: tl.constexpr,
    nflag_ptr, ctrl_ptr, health_ptr, NONCE: tl.constexpr, RID_NFLAG: tl.constexpr,
):  # fmt: skip
    """Attention S1: input norm, then the qkv_proj units (:func:`s1_chunk`); each tile's
    epilogue (in a split tail tile, by its last unit to arrive) sends gate and v straight to
    their outputs, raw q and k to the ``qk`` region."""
    KCH: tl.constexpr = H // BK
    n_it = s1_iterations(pid, G, FT, NU, SPLIT, KCH)
    if PRE:
        for pi in tl.static_range(NS - 1):
            prefetch_chunk(wqkv_ptr, wqkv_ptr, pi, n_it, pid, G, KCH, 0, PA, PA, H, FT, SPLIT, TR,
                           BN, BK)  # fmt: skip
    xs_base, rstd = normed_rows(hid_ptr, res_ptr, nw_ptr, xs_ptr, rout_ptr, nflag_ptr, ctrl_ptr,
                                 health_ptr, pid, G, rows, rmask, n_rows, has_res, eps, tag, H,
                                 BB, CH, NONCE, RID_NFLAG, INTERP)  # fmt: skip
    stamp(trace_ptr, 1, TRACE)
    kk = tl.arange(0, BK)
    nn = tl.arange(0, BN)
    acc = tl.zeros([BN, BB], dtype=tl.float32)  # acc^T: weight rows x batch rows
    for it in tl.range(0, n_it, num_stages=NS):  # pipelined, as in the GDN kernel
        r0, nr, kc, _, ends_tile = s1_chunk(it, pid, G, FT, SPLIT, TR, BN, KCH)
        r = tl.where(nn < nr, tl.minimum(r0 + nn, PA), PA)  # PA: no row (masked, no output)
        k = kc * BK + kk
        wt = tl.load(
            wqkv_ptr + r[:, None] * H + k[None, :],
            mask=r[:, None] < PA,
            other=0.0,
        )
        acc = _dot_chunk(acc, wt, xs_base, rows, rmask, k, H, sqkv_ptr, r, r < PA,
                         kc * BK, Q_QKV, PA)  # fmt: skip
        if ends_tile:  # a split tail unit: after the loop
            _attn_epilogue(acc * rstd[None, :], r, rows, rmask, gate_ptr, v_ptr, qk_ptr, tag, HQ,
                           D, QG, KVD, PA, WA, INTERP)  # fmt: skip
            acc = tl.zeros_like(acc)
    if SPLIT > 1:  # noqa: SIM102 (compiled in, then a branch per CTA)
        if pid < NU:  # as in the GDN front, outside the pipelined loop
            tt = pid // SPLIT
            last, acc = tail_sum(acc, tt, pid, split_ptr, rows, rmask, BN, BB, SPLIT,
                                  NU // SPLIT, INTERP)  # fmt: skip
            if last:
                _attn_epilogue(acc * rstd[None, :], tl.minimum(FT * BN + tt * BN + nn, PA), rows,
                               rmask, gate_ptr, v_ptr, qk_ptr, tag, HQ, D, QG, KVD, PA, WA,
                               INTERP)  # fmt: skip


@triton.jit
def _attn_epilogue(acc, r, rows, rmask, gate_ptr, v_ptr, qk_ptr, tag, HQ: tl.constexpr,
                   D: tl.constexpr, QG: tl.constexpr, KVD: tl.constexpr, PA: tl.constexpr,
                   WA: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """One finished tile (acc^T [BN, Bb], normed; projection rows ``r``, ``PA`` = none): gate
    and v to their outputs, raw q and k to the ``qk`` region."""
    acc_r = tl.trans(acc)
    head = r // (2 * D)
    o = r - head * (2 * D)
    is_q = (r < QG) & (o < D)
    is_gate = (r < QG) & (o >= D)
    is_k = (r >= QG) & (r < QG + KVD)
    is_v = (r >= QG + KVD) & (r < PA)
    m2 = rmask[:, None]
    tl.store(
        gate_ptr + rows[:, None] * (HQ * D) + (head * D + o - D)[None, :],
        acc_r.to(gate_ptr.dtype.element_ty),
        mask=m2 & is_gate[None, :],
    )
    tl.store(
        v_ptr + rows[:, None] * KVD + (r - QG - KVD)[None, :],
        acc_r.to(v_ptr.dtype.element_ty),
        mask=m2 & is_v[None, :],
    )
    dest = tl.where(is_q, head * D + o, HQ * D + (r - QG))
    put_f32(qk_ptr, rows[:, None] * WA + dest[None, :], acc_r, m2 & (is_q | is_k)[None, :], tag,
            INTERP)  # fmt: skip


@triton.jit
def _attn_s2(
    q_ptr, k_ptr, qk_ptr, ctrl_ptr, health_ptr, pid, G, rows, eps, tag, dd, part, rm, cos, sin,
    sgn, wq_n, wq_p, wk_n, wk_p, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    RD: tl.constexpr, BB: tl.constexpr, KVD: tl.constexpr, WA: tl.constexpr,
    RID_QK: tl.constexpr, INTERP: tl.constexpr, trace_ptr, TRACE: tl.constexpr,
):  # fmt: skip
    """Attention S2: one task per q or k head (all rows): Gemma norm, then RoPE -> q / k."""
    for t in range(G - 1 - pid, HQ + HKV, G):  # last CTAs first: they have fewer S1 rows
        is_k = t >= HQ
        idx = rows[:, None] * WA + t * D + dd[None, :]
        flat = tl.reshape(idx, (BB * D,))
        x = get_f32(qk_ptr, flat, tl.reshape(rm, (BB * D,)), tag, ctrl_ptr, health_ptr, RID_QK,
                 INTERP)  # fmt: skip
        x = tl.reshape(x, (BB, D))
        stamp_when(trace_ptr, 3, t == G - 1 - pid, TRACE)  # its first task
        pidx = rows[:, None] * WA + t * D + part[None, :]
        xp = words_to_fp32(tl.load(qk_ptr + pidx, mask=rm, other=0, volatile=True))
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        w = tl.where(is_k, wk_n, wq_n)
        wp = tl.where(is_k, wk_p, wq_p)
        xn = x * rstd[:, None] * (1.0 + w[None, :])
        xpn = xp * rstd[:, None] * (1.0 + wp[None, :])
        out = tl.where(dd[None, :] < RD, xn * cos + sgn[None, :] * xpn * sin, xn)
        optr = tl.where(is_k, k_ptr + (t - HQ) * D, q_ptr + t * D)
        ostride = tl.where(is_k, KVD, HQ * D)
        tl.store(optr + rows[:, None] * ostride + dd[None, :],
                 out.to(q_ptr.dtype.element_ty), mask=rm)  # fmt: skip


@triton.jit(do_not_specialize=["n_rows", "layer", "layers_per_step", "has_res", "null_slot",
                               "cs_slot", "cs_t", "cs_c", "ss16"])  # fmt: skip
def k1_gdn_kernel(
    hid_ptr, res_ptr, rout_ptr, oin_ptr, nw_ptr, wq_ptr, wba_ptr, convw_ptr, alog_ptr, dtb_ptr,
    gnw_ptr, conv_ptr, ssm_ptr, slots_ptr, scratch_ptr, xs_ptr, ctrl_ptr, health_ptr, trace_ptr,
    n_rows, layer, layers_per_step, has_res, null_slot, cs_slot, cs_t, cs_c, ss16, eps, qscale,
    sq_ptr,  # fp32 scales of in_proj_qkvz / in_proj_ba (bf16 planes: any pointer, not read)
    sba_ptr,
    # shapes
    H: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    KC: tl.constexpr, WROW: tl.constexpr, OFF_PROJ: tl.constexpr, RID_PROJ: tl.constexpr,
    SSM_KV: tl.constexpr, INTERLEAVED: tl.constexpr, STATE_BYTES: tl.constexpr,
    # tiles
    BB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FT: tl.constexpr,
    SPLIT: tl.constexpr, NU: tl.constexpr, TR: tl.constexpr, OFF_SPLIT: tl.constexpr,
    CH: tl.constexpr,
    NS: tl.constexpr, PRE: tl.constexpr, DVS: tl.constexpr, WB: tl.constexpr, Q_QKVZ: tl.constexpr,
    Q_BA: tl.constexpr, STAGES: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr = False,
    # the blocked recurrence (k1_recurrence): DS tasks per (row, head), its two regions
    DS: tl.constexpr = 1, OFF_OSQ: tl.constexpr = 0, RID_OSQ: tl.constexpr = 0,
    OFF_ORAW: tl.constexpr = 0, TRACE: tl.constexpr = False,
    # each row normed once (K1Config.norm_once_above; BB: never), its flags' region
    NONCE: tl.constexpr = 16, OFF_NFLAG: tl.constexpr = 0, RID_NFLAG: tl.constexpr = 0,
):  # fmt: skip
    if PDL:
        pdl_prologue()
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    tag = seq_tag(step_seq(ctrl_ptr, layer, layers_per_step))
    stamp(trace_ptr, 0, TRACE)
    proj_ptr = scratch_ptr + OFF_PROJ
    KD: tl.constexpr = HK * DK
    VD: tl.constexpr = HV * DV
    CONV: tl.constexpr = 2 * KD + VD
    PQ: tl.constexpr = 2 * KD + 2 * VD
    PBA: tl.constexpr = 2 * HV
    RR: tl.constexpr = HV // HK
    # 128-byte lines per S2 task's state: a (slot, head), or one of its DS blocks
    LINES: tl.constexpr = DV * DK * STATE_BYTES // 128 // DS
    EPL: tl.constexpr = 128 // STATE_BYTES

    rows = tl.arange(0, BB)
    rmask = rows < n_rows
    n_tasks = n_rows * HV * DS
    # S2 tasks run from the last CTA down: the first S1 tiles go to the first CTAs, so the
    # CTAs with one S1 tile fewer start the recurrence (width 1: 32 tasks) soonest
    first = G - 1 - pid
    ln = tl.arange(0, LINES)
    # state rows per slice (DVS = 2: half the registers) or per block (DS > 1, DVS = 1)
    VH: tl.constexpr = DV // (DVS * DS)
    vh = tl.arange(0, VH)
    kq = tl.arange(0, DK)
    if SSM_KV:  # noqa: SIM108 (a constexpr branch)
        soff = kq[None, :] * DV + vh[:, None]
    else:
        soff = vh[:, None] * DK + kq[None, :]
    SL_OFF: tl.constexpr = VH if SSM_KV else VH * DK  # offset of the second slice / block

    # S2's first task: its whole state tile starts moving into L2 now, behind S1.
    b0 = first // (HV * DS)
    s0 = tl.load(slots_ptr + b0, mask=first < n_tasks, other=-1)
    ok0 = (first < n_tasks) & (s0 >= 0) & (s0 != null_slot)
    if DS == 1:
        st0 = tl.where(ok0, s0, 0).to(tl.int64) * ss16 * 16 + (first - b0 * HV) * (DV * DK)
    else:  # head, then block: blocks start SL_OFF apart (vk: VH rows of DK; kv: VH columns)
        _, h0, q0 = block_task(first, HV, DS)
        st0 = tl.where(ok0, s0, 0).to(tl.int64) * ss16 * 16 + h0 * (DV * DK) + q0 * SL_OFF
    if (STAGES & 2) and not INTERP:
        prefetch_l2(ssm_ptr + st0 + ln * EPL, ok0 & (ln < LINES))
    if DS == 1:  # the blocked norm loads its block's weights per task
        gw0 = tl.load(gnw_ptr + vh).to(tl.float32)
        gw1 = tl.load(gnw_ptr + (DVS - 1) * VH + vh).to(tl.float32)

    nflag_ptr = scratch_ptr + OFF_NFLAG
    norm_publish(hid_ptr, res_ptr, nw_ptr, xs_ptr, rout_ptr, nflag_ptr, pid, G, n_rows, has_res,
                  eps, tag, H, BB, CH, NONCE, STAGES, INTERP)  # fmt: skip
    if STAGES & 1:
        _gdn_s1(
            hid_ptr, res_ptr, rout_ptr, nw_ptr, wq_ptr, wba_ptr, convw_ptr, alog_ptr, dtb_ptr,
            conv_ptr, slots_ptr, xs_ptr, proj_ptr, sq_ptr, sba_ptr, pid, G, rows, rmask, n_rows,
            has_res, null_slot, cs_slot, cs_t, cs_c, eps, tag, H, HV, DK, DV, KC, WROW,
            INTERLEAVED, BB, BN, BK, FT, SPLIT, NU, TR, scratch_ptr + OFF_SPLIT, CH, NS, PRE, CONV,
            VD, PQ, PBA, RR,
            Q_QKVZ, Q_BA, INTERP, trace_ptr, TRACE, nflag_ptr, ctrl_ptr, health_ptr, NONCE,
            RID_NFLAG,
        )  # fmt: skip
    stamp(trace_ptr, 2, TRACE)
    if DS == 1:
        if STAGES & 2:
            gdn_s2(
                ssm_ptr, slots_ptr, oin_ptr, proj_ptr, ctrl_ptr, health_ptr, G, first, rows,
                rmask, n_tasks, null_slot, ss16, ln, vh, kq, soff, gw0, gw1, eps, qscale,
                tag, HV, DK, DV, WROW, RID_PROJ, DVS, WB, KD, VD, CONV, RR, LINES, EPL,
                VH, SL_OFF, INTERP, trace_ptr, TRACE,
            )  # fmt: skip
    else:
        osq_ptr = scratch_ptr + OFF_OSQ
        oraw_ptr = scratch_ptr + OFF_ORAW
        if STAGES & 2:
            gdn_s2_blocks(
                ssm_ptr, slots_ptr, proj_ptr, osq_ptr, oraw_ptr, ctrl_ptr, health_ptr, G, first,
                rows, rmask, n_tasks, null_slot, ss16, ln, vh, kq, soff, qscale, tag,
                HV, DK, DV, WROW, RID_PROJ, WB, KD, VD, CONV, RR, LINES, EPL, VH,
                SL_OFF, DS, INTERP, trace_ptr, TRACE,
            )  # fmt: skip
        if STAGES & 4:
            tl.debug_barrier()  # this CTA's o words, read back by its threads
            gdn_s3_norm(
                slots_ptr, oin_ptr, gnw_ptr, proj_ptr, osq_ptr, oraw_ptr, ctrl_ptr, health_ptr,
                G, first, rows, rmask, n_tasks, null_slot, vh, eps, tag, HV, DV, WROW, RID_OSQ,
                VD, CONV, VH, DS, INTERP,
            )  # fmt: skip
    stamp(trace_ptr, 4, TRACE)


@triton.jit(do_not_specialize=["n_rows", "layer", "layers_per_step", "has_res", "max_pos"])
def k1_attn_kernel(
    hid_ptr, res_ptr, rout_ptr, nw_ptr, wqkv_ptr, qn_ptr, kn_ptr, rope_ptr, pos_ptr, q_ptr, k_ptr,
    v_ptr, gate_ptr, scratch_ptr, xs_ptr, ctrl_ptr, health_ptr, trace_ptr, n_rows, layer,
    layers_per_step, has_res, max_pos, eps,
    sqkv_ptr,  # fp32 scales of qkv_proj (a bf16 plane: any pointer, not read)
    H: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, RD: tl.constexpr,
    OFF_QK: tl.constexpr, RID_QK: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, FT: tl.constexpr, SPLIT: tl.constexpr, NU: tl.constexpr, TR: tl.constexpr,
    OFF_SPLIT: tl.constexpr, CH: tl.constexpr, NS: tl.constexpr, PRE: tl.constexpr,
    Q_QKV: tl.constexpr,
    STAGES: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr = False,
    TRACE: tl.constexpr = False,
    # each row normed once (K1Config.norm_once_above; BB: never), its flags' region
    NONCE: tl.constexpr = 16, OFF_NFLAG: tl.constexpr = 0, RID_NFLAG: tl.constexpr = 0,
):  # fmt: skip
    if PDL:
        pdl_prologue()
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    tag = seq_tag(step_seq(ctrl_ptr, layer, layers_per_step))
    stamp(trace_ptr, 0, TRACE)
    qk_ptr = scratch_ptr + OFF_QK
    QG: tl.constexpr = 2 * HQ * D  # q + gate rows
    KVD: tl.constexpr = HKV * D
    PA: tl.constexpr = QG + 2 * KVD
    WA: tl.constexpr = (HQ + HKV) * D  # words per row of the qk region
    rows = tl.arange(0, BB)
    rmask = rows < n_rows
    # S2's inputs that do not depend on S1 (positions, cos/sin, norm weights) load first, so
    # their round trips hide behind S1
    HALF: tl.constexpr = RD // 2
    dd = tl.arange(0, D)
    part = tl.where(dd < HALF, dd + HALF, tl.where(dd < RD, dd - HALF, dd))
    fi = tl.where(dd < HALF, dd, tl.where(dd < RD, dd - HALF, 0))
    pos = tl.load(pos_ptr + rows, mask=rmask, other=0)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1).to(tl.int64)
    rm = rmask[:, None] & (dd[None, :] < D)
    cs = rope_ptr + pos[:, None] * RD + fi[None, :]
    rot = rm & (dd[None, :] < RD)
    cos = tl.load(cs, mask=rot, other=1.0)
    sin = tl.load(cs + HALF, mask=rot, other=0.0)
    sgn = tl.where(dd < HALF, -1.0, 1.0)
    wq_n = tl.load(qn_ptr + dd).to(tl.float32)
    wq_p = tl.load(qn_ptr + part).to(tl.float32)
    wk_n = tl.load(kn_ptr + dd).to(tl.float32)
    wk_p = tl.load(kn_ptr + part).to(tl.float32)

    nflag_ptr = scratch_ptr + OFF_NFLAG
    norm_publish(hid_ptr, res_ptr, nw_ptr, xs_ptr, rout_ptr, nflag_ptr, pid, G, n_rows, has_res,
                  eps, tag, H, BB, CH, NONCE, STAGES, INTERP)  # fmt: skip
    if STAGES & 1:
        _attn_s1(
            hid_ptr, res_ptr, rout_ptr, nw_ptr, wqkv_ptr, v_ptr, gate_ptr, xs_ptr, qk_ptr,
            sqkv_ptr, pid, G, rows, rmask, n_rows, has_res, eps, tag, H, HQ, D, BB, BN, BK, FT,
            SPLIT, NU, TR, scratch_ptr + OFF_SPLIT, CH, NS, PRE, Q_QKV, QG, KVD, PA, WA, INTERP,
            trace_ptr, TRACE, nflag_ptr,
            ctrl_ptr, health_ptr, NONCE, RID_NFLAG,
        )  # fmt: skip
    stamp(trace_ptr, 2, TRACE)
    if STAGES & 2:
        _attn_s2(
            q_ptr, k_ptr, qk_ptr, ctrl_ptr, health_ptr, pid, G, rows, eps, tag, dd, part, rm, cos,
            sin, sgn, wq_n, wq_p, wk_n, wk_p, HQ, HKV, D, RD, BB, KVD, WA, RID_QK, INTERP,
            trace_ptr, TRACE,
        )  # fmt: skip
    stamp(trace_ptr, 4, TRACE)
