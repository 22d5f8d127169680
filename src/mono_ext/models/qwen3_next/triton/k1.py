"""K1, the layer front, as one persistent Triton launch per layer per decode step (bf16
activations; the matrix planes in bf16 or fp8 e4m3fn with fp32 scales, ``formats``).

GDN layers (:func:`mono_ext.models.qwen3_next.reference.gdn.gdn_front` is the fp32 oracle): residual add +
input Gemma RMSNorm -> ``in_proj_qkvz`` / ``in_proj_ba`` -> causal conv1d update on the
engine's conv state -> gated delta rule on the engine's recurrent state (in place) -> gated
RMSNorm with SiLU(z) = out_proj's input. Attention layers (:func:`mono_ext.models.qwen3_next.reference.
attention.attn_front`): residual add + norm -> ``qkv_proj`` -> q/k Gemma norms -> partial
neox RoPE -> q, k, v, gate. Writing k/v into the paged KV cache stays with the engine's
attention call (its ``reshape_and_cache`` / backend ``forward``), which runs after K1.

Program (both kinds; declared by :func:`k1_gdn_program` / :func:`k1_attn_program` and checked
by ``runtime.layout.check_handoffs`` at build):

- prologue, every CTA: residual add + input norm of the B rows (redundant, so no hand-off),
  kept in a private bf16 buffer as the dot operand; CTA 0 writes ``residual_out``.
- S1, over the grid: the projection rows in tiles of ``BN`` rows x all of H, whole rounds
  of the grid, then the rest in smaller tiles so that no CTA streams much more than its
  share (:func:`s1_tiles`); GDN: ``in_proj_ba`` first (every S2 task needs beta and g). One
  flattened loop over (tile, K chunk); each chunk is ``acc^T = W x^T`` with the weight tile
  as wgmma's M operand (``K1Config.wt``); weights streamed with ``evict_first``. Epilogue
  per tile: GDN: the conv update for the conv channels in the tile (read K-1 cached
  values, write the shifted window back, SiLU), beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias); attention:
  gate and v go straight to their outputs. Everything a later stage needs goes into one
  tagged mailbox region (fp32 bits). An fp8 plane is read in place through
  ``planes.qdot`` (a chunk's MMA on the codes widened to bf16, times its scales); block-128
  planes cap the K chunk at 128 (one scale column per chunk). When in_proj_qkvz and in_proj_ba
  differ in format (an FP8 checkpoint keeps ba bf16), each chunk loads from both planes, the
  other's fully masked. The loop is software-pipelined (``ns`` stages of async
  copies); what an epilogue reads (conv window, taps, A_log, dt_bias) is loaded at the
  tile's first chunk, because a dependent load behind a full memory pipeline costs a
  whole queue's latency (several us, measured on H200).
- S2, over the grid: GDN: one task per (row, value head): wait for its q, k (the key
  head's), v, z, beta, g words, L2-norm q/k, decay + delta-rule update of the
  [Dv, Dk] state tile (fp32 math, stored back in the state's dtype), o = S q, gated RMSNorm;
  one bounded wait covers every word of a task; the state tile in ``dvs`` row slices
  (registers). Tasks run from the last CTA down (the first CTAs carry the extra S1 tiles).
  The first task's state is L2-prefetched before S1 and its first slice loaded into
  registers (``preload``); later ones are L2-prefetched one task ahead.
  Attention: one task per q or k head (all rows): wait, Gemma norm, RoPE from a cos/sin
  table (positions, cos/sin and norm weights are loaded before S1).

A CTA finishes all of its S1 tiles before its first S2 wait and S1 never waits, so with
every CTA resident (checked at build) no wait can deadlock. Waits are bounded
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
| conv_state      | any [S, ., .] view     | bf16      | vLLM [S, K-1, C] or SGLang [S, C, K-1]: | this launch (S1)  |
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
| priv xs         | [G, Bb, H]             | bf16      | this CTA's normed rows (dot operand)    | prologue, same CTA|
| ctrl / health   | see runtime.health     |           | epoch read for tags; sticky failed word | host / waits      |
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
)
from mono_ext.kernels.triton.primitives import (
    put_words,
    seq_tag,
    step_seq,
    unpack_value,
    wait_tagged,
)
from mono_ext.runtime.layout import Program, Region, Stage, plan_layout, wait, write

__all__ = [
    "BLOCK_B",
    "K1AttnLaunch",
    "K1AttnShape",
    "K1Config",
    "K1GdnLaunch",
    "K1GdnShape",
    "K1Launches",
    "K1Workspace",
    "gdn_row_map",
    "k1_attn_kernel",
    "k1_attn_program",
    "k1_gdn_kernel",
    "k1_gdn_program",
    "rope_table",
    "s1_tiles",
]

S1 = 1  # prologue + projections (+ conv); the interpreter runs S1 and S2 as two launches
S2 = 2  # recurrence + gated norm (GDN) / norm + RoPE (attention)
STAGES_ALL = 3
L2NORM_EPS = tl.constexpr(1e-6)  # FLA / vLLM: x / sqrt(sum(x^2) + 1e-6)


# ------------------------------------------------------------------------------ device helpers


@triton.jit
def _put(region_ptr, offs, values, mask, tag, INTERP: tl.constexpr):
    """Hand fp32 ``values`` to a later stage as tagged words."""
    put_words(region_ptr, offs, values.to(tl.int32, bitcast=True), mask, tag, INTERP)


@triton.jit
def _get(region_ptr, offs, mask, tag, ctrl_ptr, health_ptr, region_id, INTERP: tl.constexpr):
    """Bounded wait for 1-D tagged words; returns their fp32 values (0 where masked)."""
    if INTERP:
        words = tl.load(region_ptr + offs, mask=mask, other=0)
    else:
        words, ok = wait_tagged(region_ptr + offs, mask, offs, tag, ctrl_ptr, health_ptr, region_id)
    return tl.where(mask, unpack_value(words).to(tl.float32, bitcast=True), 0.0)


@triton.jit
def _wait_all(region_ptr, offs, mask, tag, ctrl_ptr, health_ptr, region_id, INTERP: tl.constexpr):
    """One bounded wait until every masked word carries ``tag`` (read them with _read_f32)."""
    if not INTERP:  # the interpreter runs the stages as separate launches: nothing to wait for
        wait_tagged(region_ptr + offs, mask, offs, tag, ctrl_ptr, health_ptr, region_id)


@triton.jit
def _read_f32(region_ptr, offs, mask):
    """fp32 values of tagged words already waited for (volatile: never a stale L1 line)."""
    words = tl.load(region_ptr + offs, mask=mask, other=0, volatile=True)
    return tl.where(mask, unpack_value(words).to(tl.float32, bitcast=True), 0.0)


@triton.jit
def _prefetch_l2(ptrs, mask):
    """``prefetch.global.L2`` per pointer (one per 128-byte line is enough)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred %p; setp.ne.b32 %p, $2, 0; @%p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _tile(t, FT: tl.constexpr, BN: tl.constexpr, HB: tl.constexpr):
    """Row-space start and row count of S1 tile ``t``: ``FT`` tiles of ``BN`` rows (whole
    rounds of the grid), then tiles of ``HB`` rows (the rest, spread over the grid)."""
    full = t < FT
    r0 = tl.where(full, t * BN, FT * BN + (t - FT) * HB)
    nr = tl.where(full, BN, HB)
    return r0, nr


@triton.jit
def _acc_zeros(BB: tl.constexpr, BN: tl.constexpr, WT: tl.constexpr):
    """A projection tile's fp32 accumulator: [BN, BB] with ``WT`` (acc^T = W x^T: weight rows
    as the MMA's M), else [BB, BN] (acc = x W^T: x is a 16-row M operand every warp re-reads)."""
    if WT:  # noqa: SIM108 (a constexpr branch)
        acc = tl.zeros([BN, BB], dtype=tl.float32)
    else:
        acc = tl.zeros([BB, BN], dtype=tl.float32)
    return acc


@triton.jit
def _dot_chunk(acc, wt, xs_base, rows, rmask, k, H: tl.constexpr, WT: tl.constexpr, sp, wrows,
               wlive, k0, Q: tl.constexpr, N: tl.constexpr):  # fmt: skip
    """One K chunk of a tile: the weight chunk ``wt`` [BN, BK] (plane format ``Q``, its scales
    at ``sp``, stored rows ``wrows``, chunk at column ``k0``) times this CTA's normed rows."""
    if WT:
        xt = tl.load(xs_base + rows[None, :] * H + k[:, None], mask=rmask[None, :],
                     other=0.0)  # fmt: skip
        acc = qdot(wt, xt, acc, sp, wrows, wlive, k0, Q, N, H)  # Q = 0: tl.dot(wt, xt, acc)
    else:
        tl.static_assert(Q == 0, "fp8 planes are read with wt (refused at build)")
        xa = tl.load(xs_base + rows[:, None] * H + k[None, :], mask=rmask[:, None],
                     other=0.0)  # fmt: skip
        acc = tl.dot(xa, tl.trans(wt), acc)
    return acc


@triton.jit
def _acc_rows(acc, WT: tl.constexpr):
    """A finished tile's accumulator as [BB, BN] (batch rows x projection rows)."""
    if WT:  # noqa: SIM108 (a constexpr branch)
        acc_r = tl.trans(acc)
    else:
        acc_r = acc
    return acc_r


@triton.jit
def _dot_mixed(acc, wq, wa, is_ba, xs_base, rows, rmask, k, k0, sq_ptr, sba_ptr, wrows, live,
               H: tl.constexpr, PQ: tl.constexpr, PBA: tl.constexpr, Q_QKVZ: tl.constexpr,
               Q_BA: tl.constexpr):  # fmt: skip
    """A GDN chunk when in_proj_qkvz and in_proj_ba differ in format (the usual FP8 checkpoint:
    fp8 qkvz, bf16 ba): the tile's plane (``is_ba``) was loaded into ``wa`` or ``wq`` (the
    other fully masked); ``planes.qdot_either`` (wt only, checked at build)."""
    xt = tl.load(xs_base + rows[None, :] * H + k[:, None], mask=rmask[None, :], other=0.0)
    return qdot_either(acc, wq, wa, is_ba, xt, sq_ptr, sba_ptr, wrows, live, k0, Q_QKVZ, Q_BA,
                       PQ, H, PBA, H)  # fmt: skip


@triton.jit
def _prefetch_w(w_ptr, w2_ptr, it, n_it, pid, G, KCH, NA, LIM1, LIM2, H: tl.constexpr,
                FT: tl.constexpr, BN: tl.constexpr, HB: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """L2-prefetch the bf16 weight chunk of flattened iteration ``it`` (one 128-byte line per
    thread): row-space rows ``< NA`` are rows of ``w_ptr`` (``LIM1`` rows), later ones of
    ``w2_ptr``."""
    LPR: tl.constexpr = BK // 64  # 128-byte lines per row of a [BN, BK] bf16 chunk
    j = it // KCH
    kc = it - j * KCH
    r0, nr = _tile(pid + j * G, FT, BN, HB)
    first = r0 < NA
    wb = tl.where(first, w_ptr, w2_ptr)
    lim = tl.where(first, LIM1, LIM2)
    li = tl.arange(0, BN * LPR)
    rr = li // LPR
    r = tl.where(first, r0, r0 - NA) + rr
    _prefetch_l2(wb + r * H + kc * BK + (li % LPR) * 64, (it < n_it) & (rr < nr) & (r < lim))


@triton.jit
def _input_norm(
    hid_ptr, res_ptr, nw_ptr, xs_base, rout_ptr, n_rows, has_res, eps, pid,
    H: tl.constexpr, BB: tl.constexpr, CH: tl.constexpr,
):  # fmt: skip
    """s = hidden (+ residual) in fp32; xs = bf16(s * rsqrt(mean(s^2) + eps) * (1 + w)).

    Every CTA computes it into its own ``xs_base`` (the dot operand); CTA 0 writes s (bf16)
    to ``residual_out``.
    """
    rows = tl.arange(0, BB)
    rmask = rows < n_rows
    hh = tl.arange(0, CH)
    NCH: tl.constexpr = (H + CH - 1) // CH
    ss = tl.zeros([BB], dtype=tl.float32)
    for c in tl.static_range(NCH):  # unrolled: every chunk's loads in flight together
        hc = c * CH + hh
        m = rmask[:, None] & (hc[None, :] < H)
        off = rows[:, None] * H + hc[None, :]
        s = tl.load(hid_ptr + off, mask=m, other=0.0).to(tl.float32)
        s += tl.load(res_ptr + off, mask=m & (has_res != 0), other=0.0).to(tl.float32)
        tl.store(rout_ptr + off, s.to(tl.bfloat16), mask=m & (pid == 0))
        ss += tl.sum(s * s, axis=1)
    rstd = tl.rsqrt(ss / H + eps)
    for c in tl.static_range(NCH):
        hc = c * CH + hh
        hm = hc < H
        m = rmask[:, None] & hm[None, :]
        off = rows[:, None] * H + hc[None, :]
        s = tl.load(hid_ptr + off, mask=m, other=0.0).to(tl.float32)
        s += tl.load(res_ptr + off, mask=m & (has_res != 0), other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + hc, mask=hm, other=0.0).to(tl.float32)
        xn = s * rstd[:, None] * (1.0 + w[None, :])
        tl.store(xs_base + off, xn.to(tl.bfloat16), mask=m)
    tl.debug_barrier()  # xs written by this CTA's threads, read back by all of them


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
def _prefetch_conv_inputs(
    dest, rvalid, slot64, conv_ptr, convw_ptr, alog_ptr, dtb_ptr, cs_slot, cs_t,
    cs_c, CONV: tl.constexpr, VD: tl.constexpr, HV: tl.constexpr, KC: tl.constexpr,
):  # fmt: skip
    """L2-prefetch what :func:`_conv_inputs` will read (no registers, nothing waits)."""
    is_conv = (dest >= 0) & (dest < CONV)
    is_a = dest >= CONV + VD + HV
    ch = tl.where(is_conv, dest, 0)
    ha = tl.where(is_a, dest - (CONV + VD + HV), 0)
    cm = rvalid[:, None] & is_conv[None, :]
    cbase = conv_ptr + slot64[:, None] * cs_slot + ch[None, :] * cs_c
    _prefetch_l2(cbase, cm)
    _prefetch_l2(cbase + cs_t, cm)
    _prefetch_l2(cbase + 2 * cs_t, cm)
    _prefetch_l2(convw_ptr + ch * KC, is_conv)
    _prefetch_l2(alog_ptr + ha, is_a)
    _prefetch_l2(dtb_ptr + ha, is_a)


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
    _put(proj_ptr, off, val, rmask[:, None] & (dest >= 0)[None, :], tag, INTERP)


@triton.jit
def _delta_rule(S, qv, kv, vvec, beta, decay):
    """Rows of the gated delta rule: S <- decay S + beta (v - decay S k) k^T; o = S q."""
    S = S * decay
    ks = tl.sum(S * kv[None, :], axis=1)
    delta = (vvec - ks) * beta
    S = S + delta[:, None] * kv[None, :]
    o = tl.sum(S * qv[None, :], axis=1)
    return S, o


@triton.jit(do_not_specialize=["n_rows", "layer", "layers_per_step", "has_res", "null_slot",
                               "cs_slot", "cs_t", "cs_c", "ss16"])  # fmt: skip
def k1_gdn_kernel(
    hid_ptr,
    res_ptr,
    rout_ptr,
    oin_ptr,
    nw_ptr,
    wq_ptr,
    wba_ptr,
    convw_ptr,
    alog_ptr,
    dtb_ptr,
    gnw_ptr,
    conv_ptr,
    ssm_ptr,
    slots_ptr,
    scratch_ptr,
    xs_ptr,
    ctrl_ptr,
    health_ptr,
    n_rows,
    layer,
    layers_per_step,
    has_res,
    null_slot,
    cs_slot,
    cs_t,
    cs_c,
    ss16,
    eps,
    qscale,
    sq_ptr,  # fp32 scales of in_proj_qkvz / in_proj_ba (bf16 planes: any pointer, not read)
    sba_ptr,
    # shapes
    H: tl.constexpr,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    KC: tl.constexpr,
    WROW: tl.constexpr,
    OFF_PROJ: tl.constexpr,
    RID_PROJ: tl.constexpr,
    SSM_KV: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    STATE_BYTES: tl.constexpr,
    # tiles
    BB: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    FT: tl.constexpr,
    HB: tl.constexpr,
    NT: tl.constexpr,
    CH: tl.constexpr,
    NS: tl.constexpr,
    PRE: tl.constexpr,
    PRELOAD: tl.constexpr,
    DVS: tl.constexpr,
    WT: tl.constexpr,
    CVL: tl.constexpr,
    WB: tl.constexpr,
    Q_QKVZ: tl.constexpr,
    Q_BA: tl.constexpr,
    STAGES: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    tag = seq_tag(step_seq(ctrl_ptr, layer, layers_per_step))
    proj_ptr = scratch_ptr + OFF_PROJ
    KD: tl.constexpr = HK * DK
    VD: tl.constexpr = HV * DV
    CONV: tl.constexpr = 2 * KD + VD
    PQ: tl.constexpr = 2 * KD + 2 * VD
    PBA: tl.constexpr = 2 * HV
    RR: tl.constexpr = HV // HK
    LINES: tl.constexpr = DV * DK * STATE_BYTES // 128  # 128-byte lines per (slot, head)
    EPL: tl.constexpr = 128 // STATE_BYTES

    rows = tl.arange(0, BB)
    rmask = rows < n_rows
    n_tasks = n_rows * HV
    # S2 tasks run from the last CTA down: the first S1 tiles go to the first CTAs, so the
    # CTAs with one S1 tile fewer start the recurrence (width 1: 32 tasks) soonest
    first = G - 1 - pid
    ln = tl.arange(0, LINES)
    VH: tl.constexpr = DV // DVS  # state rows per slice (DVS = 2: half the registers)
    vh = tl.arange(0, VH)
    kq = tl.arange(0, DK)
    if SSM_KV:  # noqa: SIM108 (a constexpr branch)
        soff = kq[None, :] * DV + vh[:, None]
    else:
        soff = vh[:, None] * DK + kq[None, :]
    SL_OFF: tl.constexpr = VH if SSM_KV else VH * DK  # offset of the second slice

    # S2's first task: its whole state tile starts moving into L2 now and (PRELOAD) its
    # first slice is loaded into registers, so both hide behind S1 instead of following it.
    b0 = first // HV
    s0 = tl.load(slots_ptr + b0, mask=first < n_tasks, other=-1)
    ok0 = (first < n_tasks) & (s0 >= 0) & (s0 != null_slot)
    st0 = tl.where(ok0, s0, 0).to(tl.int64) * ss16 * 16 + (first - b0 * HV) * (DV * DK)
    if (STAGES & 2) and not INTERP:
        _prefetch_l2(ssm_ptr + st0 + ln * EPL, ok0 & (ln < LINES))
    if PRELOAD:
        m0 = ok0 & (vh[:, None] < VH) & (kq[None, :] < DK)
        S_first = tl.load(ssm_ptr + st0 + soff, mask=m0, other=0.0).to(tl.float32)
    gw0 = tl.load(gnw_ptr + vh).to(tl.float32)
    gw1 = tl.load(gnw_ptr + (DVS - 1) * VH + vh).to(tl.float32)

    if STAGES & 1:
        # ---- S1: projection tiles (ba tiles first: every S2 task needs beta and g, then
        # qkvz tiles), flattened over K chunks
        # row space: in_proj_ba rows (padded to NA), then in_proj_qkvz rows; tiles from _tile
        NA: tl.constexpr = (PBA + BN - 1) // BN * BN
        KCH: tl.constexpr = H // BK
        n_my = tl.where(pid < NT, (NT - 1 - pid) // G + 1, 0)
        n_it = n_my * KCH
        if PRE:  # the first chunks start moving into L2 while the norm runs
            for pi in tl.static_range(NS - 1):
                _prefetch_w(wba_ptr, wq_ptr, pi, n_it, pid, G, KCH, NA, PBA, PQ, H, FT, BN, HB,
                            BK)  # fmt: skip

        xs_base = xs_ptr + pid * (BB * H)
        _input_norm(hid_ptr, res_ptr, nw_ptr, xs_base, rout_ptr, n_rows, has_res, eps, pid,
                    H, BB, CH)  # fmt: skip

        slot_r = tl.load(slots_ptr + rows, mask=rmask, other=-1)
        rvalid = rmask & (slot_r >= 0) & (slot_r != null_slot)
        slot64 = tl.where(rvalid, slot_r, 0).to(tl.int64)

        kk = tl.arange(0, BK)
        nn = tl.arange(0, BN)
        acc = _acc_zeros(BB, BN, WT)
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
            j = it // KCH
            kc = it - j * KCH
            r0, nr = _tile(pid + j * G, FT, BN, HB)
            is_ba = r0 < NA
            rs = r0 + nn
            r_in = tl.where(is_ba, rs, rs - NA)  # the plane's stored row (also its scale row)
            if Q_QKVZ == Q_BA:  # one format: one load from the tile's plane
                wb = tl.where(is_ba, wba_ptr, wq_ptr)
            lim = tl.where(is_ba, PBA, PQ)
            live = (nn < nr) & (r_in < lim)
            k = kc * BK + kk
            if Q_QKVZ == Q_BA:
                wt = tl.load(
                    wb + r_in[:, None] * H + k[None, :],
                    mask=live[:, None],
                    other=0.0,
                    eviction_policy="evict_first",
                )
            else:  # element types differ: a load per plane, the other plane's fully masked
                wt = tl.load(wq_ptr + r_in[:, None] * H + k[None, :],
                             mask=(live & (is_ba == 0))[:, None], other=0.0,
                             eviction_policy="evict_first")  # fmt: skip
                wa = tl.load(wba_ptr + r_in[:, None] * H + k[None, :],
                             mask=(live & is_ba)[:, None], other=0.0,
                             eviction_policy="evict_first")  # fmt: skip
            p = tl.where(is_ba, PQ + rs, rs - NA)
            dest = tl.where(live, _payload_word(p, PQ, PBA, HV, DK, DV, RR, INTERLEAVED), -1)
            if kc == 0:
                if CVL:  # start moving them into L2; loaded at the tile's last chunk
                    if not INTERP:
                        _prefetch_conv_inputs(
                            dest, rvalid, slot64, conv_ptr, convw_ptr, alog_ptr, dtb_ptr,
                            cs_slot, cs_t, cs_c, CONV, VD, HV, KC,
                        )  # fmt: skip
                else:
                    c0, c1, c2, cw0, cw1, cw2, cw3, alog, dtb = _conv_inputs(
                        dest, rvalid, slot64, conv_ptr, convw_ptr, alog_ptr, dtb_ptr, cs_slot,
                        cs_t, cs_c, CONV, VD, HV, KC,
                    )  # fmt: skip
            if Q_QKVZ == Q_BA:
                # scale_index reads only K: PQ stands for either plane's N
                sp = tl.where(is_ba, sba_ptr, sq_ptr)
                acc = _dot_chunk(acc, wt, xs_base, rows, rmask, k, H, WT, sp, r_in, live,
                                 kc * BK, Q_QKVZ, PQ)  # fmt: skip
            else:
                acc = _dot_mixed(acc, wt, wa, is_ba, xs_base, rows, rmask, k, kc * BK, sq_ptr,
                                 sba_ptr, r_in, live, H, PQ, PBA, Q_QKVZ, Q_BA)  # fmt: skip
            if kc == KCH - 1:
                acc_r = _acc_rows(acc, WT)
                if CVL:
                    e0, e1, e2, ew0, ew1, ew2, ew3, ealog, edtb = _conv_inputs(
                        dest, rvalid, slot64, conv_ptr, convw_ptr, alog_ptr, dtb_ptr, cs_slot,
                        cs_t, cs_c, CONV, VD, HV, KC,
                    )  # fmt: skip
                else:
                    e0, e1, e2, ew0, ew1, ew2, ew3, ealog, edtb = (
                        c0, c1, c2, cw0, cw1, cw2, cw3, alog, dtb,
                    )  # fmt: skip
                _gdn_epilogue(
                    acc_r, dest, e0, e1, e2, ew0, ew1, ew2, ew3, ealog, edtb, rows, rmask, rvalid,
                    slot64, proj_ptr, conv_ptr, cs_slot, cs_t, cs_c, tag,
                    CONV, VD, HV, WROW, INTERP,
                )  # fmt: skip
                acc = tl.zeros_like(acc)

    # ---- S2: one task per (row, value head): gated delta rule + gated norm
    if STAGES & 2:
        two = tl.arange(0, 2)
        # every word one task reads, as one block: q (Dk), k (Dk), v (Dv), z (Dv), beta, g
        NW: tl.constexpr = 2 * DK + 2 * DV + 2
        wi = tl.arange(0, WB)
        slots_all = tl.load(slots_ptr + rows, mask=rmask, other=-1)
        for t in range(first, n_tasks, G):
            b = t // HV
            h = t - b * HV
            gk = h // RR
            slot = tl.sum(tl.where(rows == b, slots_all, 0), axis=0)
            valid = (slot >= 0) & (slot != null_slot)
            sbase = ssm_ptr + tl.where(valid, slot, 0).to(tl.int64) * ss16 * 16 + h * (DV * DK)
            if not INTERP:  # the next task's state starts moving into L2
                tn = t + G
                bn_ = tn // HV
                sn = tl.sum(tl.where(rows == bn_, slots_all, 0), axis=0)
                okn = (tn < n_tasks) & (sn >= 0) & (sn != null_slot)
                stn = tl.where(okn, sn, 0).to(tl.int64) * ss16 * 16 + (tn - bn_ * HV) * (DV * DK)
                _prefetch_l2(ssm_ptr + stn + ln * EPL, okn & (ln < LINES))
            smask = valid & (vh[:, None] < VH) & (kq[None, :] < DK)
            if PRELOAD:
                S = tl.load(sbase + soff, mask=smask & (t != first), other=0.0).to(tl.float32)
                S = tl.where(t == first, S_first, S)
            else:
                S = tl.load(sbase + soff, mask=smask, other=0.0).to(tl.float32)
            row = b * WROW
            woff = tl.where(
                wi < DK,
                gk * DK + wi,
                tl.where(
                    wi < 2 * DK,
                    KD + gk * DK + (wi - DK),
                    tl.where(
                        wi < 2 * DK + DV,
                        2 * KD + h * DV + (wi - 2 * DK),
                        tl.where(
                            wi < 2 * DK + 2 * DV,
                            CONV + h * DV + (wi - 2 * DK - DV),
                            CONV + VD + h + (wi - 2 * DK - 2 * DV) * HV,
                        ),
                    ),
                ),
            )
            _wait_all(proj_ptr, row + woff, valid & (wi < NW), tag, ctrl_ptr, health_ptr,
                      RID_PROJ, INTERP)  # fmt: skip
            mk = valid & (kq < DK)
            mv = valid & (vh < VH)
            # every word of the task read at once (one round trip)
            qv = _read_f32(proj_ptr, row + gk * DK + kq, mk)
            kv = _read_f32(proj_ptr, row + KD + gk * DK + kq, mk)
            bg = _read_f32(proj_ptr, row + CONV + VD + h + two * HV, valid & (two < 2))
            v0 = _read_f32(proj_ptr, row + 2 * KD + h * DV + vh, mv)
            z0 = _read_f32(proj_ptr, row + CONV + h * DV + vh, mv)
            if DVS > 1:
                v1 = _read_f32(proj_ptr, row + 2 * KD + h * DV + VH + vh, mv)
                z1 = _read_f32(proj_ptr, row + CONV + h * DV + VH + vh, mv)
            beta = tl.sum(tl.where(two == 0, bg, 0.0), axis=0)
            gdec = tl.sum(tl.where(two == 1, bg, 0.0), axis=0)
            qv = qv / tl.sqrt(tl.sum(qv * qv, axis=0) + L2NORM_EPS) * qscale
            kv = kv / tl.sqrt(tl.sum(kv * kv, axis=0) + L2NORM_EPS)
            decay = tl.exp(gdec)
            S, o0 = _delta_rule(S, qv, kv, v0, beta, decay)
            tl.store(sbase + soff, S.to(ssm_ptr.dtype.element_ty), mask=smask)
            ss = tl.sum(o0 * o0, axis=0)
            if DVS > 1:  # the second half of the rows, after the first is stored
                S = tl.load(sbase + SL_OFF + soff, mask=smask, other=0.0).to(tl.float32)
                S, o1 = _delta_rule(S, qv, kv, v1, beta, decay)
                tl.store(sbase + SL_OFF + soff, S.to(ssm_ptr.dtype.element_ty), mask=smask)
                ss += tl.sum(o1 * o1, axis=0)
            # gated RMSNorm: w * o * rsqrt(mean(o^2) + eps) * silu(z)
            rstd = tl.rsqrt(ss / DV + eps)
            y = gw0 * o0 * rstd * (z0 * tl.sigmoid(z0))
            y = tl.where(valid, y, 0.0)
            tl.store(oin_ptr + b * VD + h * DV + vh, y.to(oin_ptr.dtype.element_ty))
            if DVS > 1:
                y = gw1 * o1 * rstd * (z1 * tl.sigmoid(z1))
                y = tl.where(valid, y, 0.0)
                tl.store(oin_ptr + b * VD + h * DV + VH + vh, y.to(oin_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["n_rows", "layer", "layers_per_step", "has_res", "max_pos"])
def k1_attn_kernel(
    hid_ptr,
    res_ptr,
    rout_ptr,
    nw_ptr,
    wqkv_ptr,
    qn_ptr,
    kn_ptr,
    rope_ptr,
    pos_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    gate_ptr,
    scratch_ptr,
    xs_ptr,
    ctrl_ptr,
    health_ptr,
    n_rows,
    layer,
    layers_per_step,
    has_res,
    max_pos,
    eps,
    sqkv_ptr,  # fp32 scales of qkv_proj (a bf16 plane: any pointer, not read)
    H: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    RD: tl.constexpr,
    OFF_QK: tl.constexpr,
    RID_QK: tl.constexpr,
    BB: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    FT: tl.constexpr,
    HB: tl.constexpr,
    NT: tl.constexpr,
    CH: tl.constexpr,
    NS: tl.constexpr,
    PRE: tl.constexpr,
    WT: tl.constexpr,
    Q_QKV: tl.constexpr,
    STAGES: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    tag = seq_tag(step_seq(ctrl_ptr, layer, layers_per_step))
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

    if STAGES & 1:
        KCH: tl.constexpr = H // BK
        n_my = tl.where(pid < NT, (NT - 1 - pid) // G + 1, 0)
        n_it = n_my * KCH
        if PRE:
            for pi in tl.static_range(NS - 1):
                _prefetch_w(wqkv_ptr, wqkv_ptr, pi, n_it, pid, G, KCH, 0, PA, PA, H, FT, BN, HB,
                            BK)  # fmt: skip
        xs_base = xs_ptr + pid * (BB * H)
        _input_norm(hid_ptr, res_ptr, nw_ptr, xs_base, rout_ptr, n_rows, has_res, eps, pid,
                    H, BB, CH)  # fmt: skip
        kk = tl.arange(0, BK)
        nn = tl.arange(0, BN)
        acc = _acc_zeros(BB, BN, WT)
        for it in tl.range(0, n_it, num_stages=NS):  # pipelined, as in the GDN kernel
            j = it // KCH
            kc = it - j * KCH
            r0, nr = _tile(pid + j * G, FT, BN, HB)
            r = tl.where(nn < nr, r0 + nn, PA)  # PA: no row (masked, no output)
            k = kc * BK + kk
            wt = tl.load(
                wqkv_ptr + r[:, None] * H + k[None, :],
                mask=r[:, None] < PA,
                other=0.0,
                eviction_policy="evict_first",
            )
            acc = _dot_chunk(acc, wt, xs_base, rows, rmask, k, H, WT, sqkv_ptr, r, r < PA,
                             kc * BK, Q_QKV, PA)  # fmt: skip
            if kc == KCH - 1:
                acc_r = _acc_rows(acc, WT)
                p = r
                head = p // (2 * D)
                o = p - head * (2 * D)
                is_q = (p < QG) & (o < D)
                is_gate = (p < QG) & (o >= D)
                is_k = (p >= QG) & (p < QG + KVD)
                is_v = (p >= QG + KVD) & (p < PA)
                m2 = rmask[:, None]
                tl.store(
                    gate_ptr + rows[:, None] * (HQ * D) + (head * D + o - D)[None, :],
                    acc_r.to(gate_ptr.dtype.element_ty),
                    mask=m2 & is_gate[None, :],
                )
                tl.store(
                    v_ptr + rows[:, None] * KVD + (p - QG - KVD)[None, :],
                    acc_r.to(v_ptr.dtype.element_ty),
                    mask=m2 & is_v[None, :],
                )
                dest = tl.where(is_q, head * D + o, HQ * D + (p - QG))
                _put(qk_ptr, rows[:, None] * WA + dest[None, :], acc_r,
                     m2 & (is_q | is_k)[None, :], tag, INTERP)  # fmt: skip
                acc = tl.zeros_like(acc)

    if STAGES & 2:
        for t in range(G - 1 - pid, HQ + HKV, G):  # last CTAs first: they have fewer S1 rows
            is_k = t >= HQ
            idx = rows[:, None] * WA + t * D + dd[None, :]
            flat = tl.reshape(idx, (BB * D,))
            x = _get(qk_ptr, flat, tl.reshape(rm, (BB * D,)), tag, ctrl_ptr, health_ptr, RID_QK,
                     INTERP)  # fmt: skip
            x = tl.reshape(x, (BB, D))
            pidx = rows[:, None] * WA + t * D + part[None, :]
            xp = unpack_value(tl.load(qk_ptr + pidx, mask=rm, other=0, volatile=True))
            xp = xp.to(tl.float32, bitcast=True)
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


# ------------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class K1GdnShape:
    """Per-rank GDN sizes K1 is built for (TP > 1: pass this rank's head counts)."""

    hidden: int
    hk: int
    hv: int
    dk: int
    dv: int
    eps: float
    conv_k: int = 4

    @classmethod
    def from_dims(cls, dims: Any) -> K1GdnShape:
        """From :class:`mono_ext.models.qwen3_next.dims.Dims` (per rank via ``tp``)."""
        return cls(dims.hidden, dims.hk_r, dims.hv_r, dims.dk, dims.dv, dims.eps, dims.conv_k)

    @property
    def key_dim(self) -> int:
        return self.hk * self.dk

    @property
    def value_dim(self) -> int:
        return self.hv * self.dv

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def qkvz_rows(self) -> int:
        return 2 * self.key_dim + 2 * self.value_dim

    @property
    def ratio(self) -> int:
        return self.hv // self.hk

    @property
    def payload_words(self) -> int:
        """Words per row of the proj region: conv out, z, beta, g (rounded to 16)."""
        n = self.conv_dim + self.value_dim + 2 * self.hv
        return -(-n // 16) * 16

    def refusals(self) -> list[str]:
        bad = []
        if self.conv_k != 4:
            bad.append(f"conv kernel {self.conv_k}: K1 is built for 4")
        if self.hk < 1 or self.hv % self.hk:
            bad.append(f"Hv={self.hv} is not a multiple of Hk={self.hk}")
        for name, v in (("Dk", self.dk), ("Dv", self.dv)):
            if v < 16 or v & (v - 1):
                bad.append(f"{name}={v}: K1 tiles power-of-two head dims >= 16")
        if self.dk * self.dv > 128 * 128:
            bad.append(
                f"Dk*Dv={self.dk * self.dv}: the [Dv, Dk] state tile lives in registers; "
                "K1 holds at most 128x128 (larger heads need a Dv-chunked recurrence)"
            )
        if self.hidden % 16:
            bad.append(f"hidden={self.hidden} is not a multiple of 16")
        if self.qkvz_rows % 16:
            bad.append(f"in_proj_qkvz rows {self.qkvz_rows} are not a multiple of 16")
        return bad


@dataclass(frozen=True)
class K1AttnShape:
    hidden: int
    hq: int
    hkv: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    eps: float

    @classmethod
    def from_dims(cls, dims: Any) -> K1AttnShape:
        return cls(dims.hidden, dims.hq_r, dims.hkv_r, dims.head_dim, dims.rotary_dim,
                   float(dims.rope_theta), dims.eps)  # fmt: skip

    @property
    def qkv_rows(self) -> int:
        return (2 * self.hq + 2 * self.hkv) * self.head_dim

    def refusals(self) -> list[str]:
        bad = []
        d = self.head_dim
        if d < 16 or d & (d - 1):
            bad.append(f"head_dim={d}: K1 tiles power-of-two head dims >= 16")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= d:
            bad.append(f"rotary_dim={self.rotary_dim} is not even and within head_dim {d}")
        if self.hidden % 16:
            bad.append(f"hidden={self.hidden} is not a multiple of 16")
        if self.qkv_rows % 16:
            bad.append(f"qkv_proj rows {self.qkv_rows} are not a multiple of 16")
        return bad


@dataclass(frozen=True)
class K1Config:
    """Grid and tiles (one build per config; none of it changes per step).

    With ``wt`` every projection is ``acc^T [bn, Bb] = W [bn, bk] @ x^T [bk, Bb]``: the
    weight tile is the MMA's M (wgmma, 64 rows per warpgroup of 4 warps; with 8 warps the
    two warpgroups split the batch columns), the batch rows its N. Without it, x is a 16-row
    M operand (mma.sync) that every warp re-reads (the first version; kept for comparison).
    The defaults are the fastest tested on H200 at the 80B-A3B shapes (docs/journal.md, K1):
    8 warps (4: 1.7x slower, 16: 8-25% slower), 3 stages (2 and 4-5 slower).
    """

    grid: int
    num_warps: int = 8
    bn: int = 64  # projection rows per S1 tile (at most; a power of two dividing the rows)
    bk: int = 256  # K chunk of a tile (at most; a power of two dividing H)
    ch: int = 512  # norm chunk
    ns: int = 3  # software-pipeline stages of the projection loop (async copies in flight)
    pre: bool = False  # L2-prefetch the first ns - 1 weight chunks before the input norm
    preload: bool = True  # GDN: load the first S2 task's state (first slice) before S1
    wt: bool = True  # weight tile as the MMA's M operand (see above)
    dvs: int = 2  # GDN: the [Dv, Dk] state tile in dvs row slices (1 or 2; registers / 2)
    cvl: bool = False  # GDN: conv inputs L2-prefetched at a tile's first chunk, loaded at its
    # last (else loaded at the first, where the load waits); helps 16 warps, not 8


def k1_gdn_program(shape: K1GdnShape) -> Program:
    """S1 writes the proj region; S2 waits on it (checked at build)."""
    return Program(
        "k1_gdn",
        (Region("proj", BLOCK_B * shape.payload_words),),
        (Stage("in_proj_conv", [write("proj")]), Stage("recurrence", [wait("proj")])),
    )


def k1_attn_program(shape: K1AttnShape) -> Program:
    words = BLOCK_B * (shape.hq + shape.hkv) * shape.head_dim
    return Program(
        "k1_attn",
        (Region("qk", words),),
        (Stage("qkv_proj", [write("qk")]), Stage("norm_rope", [wait("qk")])),
    )


def gdn_row_map(shape: K1GdnShape, packing: str) -> list[int]:
    """Payload word of every projection row: ``in_proj_qkvz`` rows, then ``in_proj_ba`` rows.

    Payload per row: conv channels q (head-major), k, v (``[0, C)``), z (``C + h*Dv + j``),
    beta (``C + Hv*Dv + h``), g (``C + Hv*Dv + Hv + h``). "contiguous" is the identity.
    """
    s = shape
    kd, vd, c, r = s.key_dim, s.value_dim, s.conv_dim, s.ratio
    if packing == "contiguous":
        return list(range(s.qkvz_rows + 2 * s.hv))
    if packing != "interleaved":
        raise ValueError(f"packing must be 'interleaved' or 'contiguous', got {packing!r}")
    out: list[int] = []
    rdv = r * s.dv
    for g in range(s.hk):
        out += [g * s.dk + i for i in range(s.dk)]  # q
        out += [kd + g * s.dk + i for i in range(s.dk)]  # k
        out += [2 * kd + g * rdv + i for i in range(rdv)]  # v of value heads g*r .. g*r+r-1
        out += [c + g * rdv + i for i in range(rdv)]  # z
    for g in range(s.hk):
        out += [c + vd + g * r + i for i in range(r)]  # b
        out += [c + vd + s.hv + g * r + i for i in range(r)]  # a
    return out


def rope_table(shape: K1AttnShape, max_positions: int, device: Any = "cpu") -> Any:
    """[max_positions, rotary_dim] fp32: cos then sin halves, built like the reference."""
    import torch

    from mono_ext.models.qwen3_next.reference.attention import rope_cos_sin

    pos = torch.arange(max_positions, device=device)
    cos, sin = rope_cos_sin(pos, shape.rotary_dim, shape.rope_theta)
    return torch.cat([cos, sin], dim=-1).contiguous()


def s1_tiles(rows: int, grid: int, bn: int) -> tuple[int, int, int]:
    """S1 tiling of ``rows`` projection rows over ``grid`` CTAs: (full tiles, rows of a tail
    tile, tiles). Whole rounds of ``grid`` tiles of ``bn`` rows, then the rest in tiles of the
    fewest rows (a power of two, 16..bn) that still fit one round, so that no CTA streams
    more than about its share (80B-A3B GDN, 132 CTAs: 132 x 64 rows + 122 x 32 rows instead
    of 193 x 64, of which 61 CTAs took two)."""
    full = rows // (grid * bn) * grid
    rest = rows - full * bn
    hb = bn
    while hb > 16 and -(-rest // (hb // 2)) <= grid:
        hb //= 2
    return full, hb, full + -(-rest // hb)


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _interp() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pre(config: K1Config, hidden: int) -> bool:
    """Weight prefetch: off in the interpreter (no inline asm) and for chunks < 64 values."""
    return config.pre and not _interp() and _pow2_divisor(hidden, config.bk) >= 64


@dataclass
class K1Workspace:
    """One rank's K1 scratch: the tagged mailbox region and per-CTA normed rows."""

    scratch: Any  # int64 [scratch_words]
    xs: Any  # bf16 [G, Bb, H]


def _check_tensors(label: str, tensors: dict, bad: list[str]) -> None:
    for name, (t, shp, dtype) in tensors.items():
        if t is None:
            bad.append(f"missing {name}")
            continue
        if shp is not None and tuple(t.shape) != tuple(shp):
            bad.append(f"{name} is {tuple(t.shape)}, expected {tuple(shp)}")
        if dtype is not None and t.dtype != dtype:
            bad.append(f"{name} is {t.dtype}, expected {dtype} (the dtype built)")
        if not t.is_contiguous():
            bad.append(f"{name} is not contiguous")
        if t.data_ptr() % 16:
            # Triton keys variants on 16-byte pointer alignment: another alignment would
            # compile (and load a module) mid-step, which stalls against spinning CTAs.
            bad.append(f"{name} is not 16-byte aligned (no JIT mid-step)")


def _fp8_stand_ins(planes: list[str], dev: Any) -> dict:
    """Warmup stand-ins of quantized planes and their scales: warmup compiles for dtypes and
    alignment, it launches nothing."""
    import torch

    out = {}
    for plane in planes:
        out[plane] = torch.zeros(16, dtype=torch.float8_e4m3fn, device=dev)
        out[plane + ".scale"] = torch.zeros(16, dtype=torch.float32, device=dev)
    return out


def _dt(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _workspace(words: int, grid: int, hidden: int, device: Any) -> K1Workspace:
    import torch

    return K1Workspace(
        scratch=torch.zeros(max(words, 16), dtype=torch.int64, device=device),
        xs=torch.zeros(grid, BLOCK_B, hidden, dtype=torch.bfloat16, device=device),
    )


def _step_args(residual, ws, ctrl, health, n_rows, layer, layers_per_step) -> tuple:
    """The arguments both kernels take after their tensors (scratch .. has_res), in order."""
    return (ws.scratch, ws.xs, ctrl, health, n_rows, layer, layers_per_step,
            0 if residual is None else 1)  # fmt: skip


class _K1LaunchBase:
    """What :class:`K1GdnLaunch` and :class:`K1AttnLaunch` share: refusals, S1 tiling and the
    common constexprs, tensor checks, the build (compile + load + residency check) and the
    launch (S1 and S2 as two launches in the interpreter with more than one program).

    Subclasses are dataclasses with the fields ``shape``, ``config``, ``co_resident``,
    ``stages``, ``formats``, ``layout``, ``resources`` and ``_built``; they set ``_KIND``
    (refusals), ``_KERNEL``, ``_PROGRAM`` and ``_PLANES`` and implement ``label``, ``check``,
    ``_args``, ``_refusals``, ``_proj_rows``, ``_kind_constexprs`` and ``_warmup_args``.

    ``formats``: plane -> format (``kernels.triton.planes.FORMAT_CODES``) of the matrix planes
    in ``_PLANES``; absent ones are bf16, other planes are ignored. A quantized plane ``P`` is
    read in place with its fp32 scales ``weights[P + ".scale"]``; each plane's format is a
    constexpr, so an all-bf16 build compiles to the same kernel as a build with no format constexprs.
    """

    _KIND = ""
    _KERNEL: Any = None
    _PROGRAM: Any = None
    _PLANES: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bad = self.shape.refusals() + self._refusals() + self._format_refusals()
        if bad:
            raise ValueError(f"K1 {self._KIND} refused: " + "; ".join(bad))
        self.layout = plan_layout(self._PROGRAM(self.shape))

    def _fmt(self, plane: str) -> str:
        return self.formats.get(plane, "bf16")

    def _quantized(self) -> list[str]:
        """Planes of ``_PLANES`` this build reads in a format other than bf16."""
        return [p for p in self._PLANES if self._fmt(p) != "bf16"]

    def _format_refusals(self) -> list[str]:
        bad = []
        for plane in self._PLANES:
            try:
                format_code(self.formats, plane)
            except ValueError as e:
                bad.append(str(e))
        if self._quantized() and not self.config.wt:
            bad.append("fp8 planes are read with wt=True only (the scales are per weight row)")
        return bad

    def _q(self, plane: str) -> int:
        return format_code(self.formats, plane)

    def _scale_arg(self, weights: Any, plane: str) -> Any:
        """A quantized plane's scales; bf16 planes have none: the weight itself (never read,
        and as aligned as the weight, so no other variant is compiled)."""
        return weights[plane + ".scale"] if self._fmt(plane) != "bf16" else weights[plane]

    def _formats_label(self) -> str:
        q = self._quantized()
        return (" " + ",".join(f"{p}={self._fmt(p)}" for p in q)) if q else ""

    def _config_label(self) -> str:
        c = self.config
        return f"grid{c.grid} w{c.num_warps} bn{c.bn} bk{c.bk} ns{c.ns} {'wt' if c.wt else 'xm'}"

    def workspace(self, device: Any) -> K1Workspace:
        return _workspace(self.layout.scratch_words, self.config.grid, self.shape.hidden, device)

    def _s1_rows(self, bn: int) -> int:
        """Rows S1 streams in tiles (:func:`s1_tiles`)."""
        return self._proj_rows()

    def _constexprs(self) -> dict:
        s, c = self.shape, self.config
        bn = _pow2_divisor(self._proj_rows(), c.bn)
        # a block-128 plane's chunks stay inside one scale column: BK divides 128 (and H, so
        # every chunk starts at a multiple of BK)
        bk = min(c.bk, chunk_limit(self.formats, *self._PLANES) or c.bk)
        ft, hb, nt = s1_tiles(self._s1_rows(bn), c.grid, bn)
        return dict(
            H=s.hidden,
            **self._kind_constexprs(),
            BB=BLOCK_B,
            BN=bn,
            BK=_pow2_divisor(s.hidden, bk),
            FT=ft,
            HB=hb,
            NT=nt,
            CH=min(c.ch, _next_pow2(s.hidden)),
            NS=c.ns,
            PRE=_pre(c, s.hidden) and not self._quantized(),  # the prefetch assumes bf16
            WT=c.wt,
            STAGES=self.stages,
            INTERP=_interp(),
            num_warps=c.num_warps,
            num_stages=1,  # only the projection loop is pipelined (its own num_stages)
        )

    def _check(self, hidden, residual, residual_out, weights, rows: dict, params: dict,
               more: list[str] | tuple = ()) -> int:  # fmt: skip
        """Shapes, dtypes, contiguity and alignment of hidden, residual(_out), the input norm,
        ``rows`` (name: (tensor, shape after the width, dtype)) and ``params`` (weight name:
        (shape or None, dtype)); ``more`` refusals after those. Returns the width."""
        import torch

        s, bf = self.shape, torch.bfloat16
        b = hidden.shape[0] if hidden.dim() == 2 else -1
        planes = {name: params.pop(name)[0] for name in self._PLANES}
        want = {
            "hidden": (hidden, (b, s.hidden), bf),
            "residual_out": (residual_out, (b, s.hidden), bf),
            **{name: (t, (b, *tail), dt) for name, (t, tail, dt) in rows.items()},
            "input_layernorm": (weights.get("input_layernorm"), (s.hidden,), bf),
            **{name: (weights.get(name), shp, dt) for name, (shp, dt) in params.items()},
        }
        if residual is not None:
            want["residual"] = (residual, (b, s.hidden), bf)
        bad: list[str] = []
        _check_tensors(self.label(), want, bad)
        for name, shp in planes.items():  # matrix planes (and scales) in their built formats
            if weights.get(name) is None:
                bad.append(f"missing {name}")
            bad += plane_reasons(name, weights, self._fmt(name), shp)
        bad += more
        if not 1 <= b <= BLOCK_B:
            bad.append(f"width {b} outside 1..{BLOCK_B}")
        if bad:
            raise ValueError(f"{self.label()}: " + "; ".join(bad))
        return b

    def build(self, device: Any = "cuda") -> None:
        """Compile, load and residency-check (GPU) at startup."""
        import torch

        dev = torch.device(device)
        if _interp() or dev.type != "cuda":
            self._built = True
            return
        from mono_ext.runtime.build_cache import (
            check_residency,
            check_unspecialized,
            device_limits,
            kernel_resources,
        )
        from mono_ext.runtime.peers import RankState

        check_unspecialized(self._KERNEL, PER_STEP_ARGS)
        one = torch.zeros(16, dtype=torch.bfloat16, device=dev)
        ws = K1Workspace(torch.zeros(16, dtype=torch.int64, device=dev), one)
        st = RankState.create(0, dev, 1.0)
        args = self._warmup_args(dev, one, ws, st.ctrl, st.health)
        compiled = self._KERNEL.warmup(*args, grid=(self.config.grid,), **self._constexprs())
        res = kernel_resources(compiled)
        check_residency(self.label(), self.config.grid * self.co_resident, res, device_limits(dev))
        self.resources = res
        self._built = True

    def _launch(self, tensors: tuple, validate: bool, ws: K1Workspace, ctrl, health,
                **step) -> None:  # fmt: skip
        """``tensors``: ``check``'s arguments; ``step``: ``_args``' keywords after n_rows."""
        if not self._built:
            raise RuntimeError(f"{self.label()}: build() at startup before launching")
        n = self.check(*tensors) if validate else tensors[0].shape[0]
        args = self._args(*tensors, ws, ctrl, health, n, **step)
        grid = (self.config.grid,)
        cx = self._constexprs()
        if self._split():  # interpreter: programs run in turn; S2 would wait on later ones
            for st in (S1, S2):
                self._KERNEL[grid](*args, **{**cx, "STAGES": st & self.stages})
        else:
            self._KERNEL[grid](*args, **cx)

    def _split(self) -> bool:
        """Run S1 and S2 as two launches: the interpreter with more than one program."""
        return _interp() and self.config.grid > 1


@dataclass
class K1GdnLaunch(_K1LaunchBase):
    """GDN K1 of one build: compile + load + residency check once, then launch per layer.

    ``packing`` picks the row map (data, not a compile); conv-state strides are read from
    the tensor, so both conv layouts share one compile. ``state_dtype`` ("float32" or
    "bfloat16") and ``ssm_layout`` are compiled in. ``param_dtypes`` fixes A_log / dt_bias
    dtypes (a different dtype would compile mid-step: refused at launch instead).
    ``formats``: ``in_proj_qkvz`` / ``in_proj_ba`` formats (see :class:`_K1LaunchBase`).
    """

    shape: K1GdnShape
    config: K1Config
    packing: str = "interleaved"
    state_dtype: str = "float32"
    ssm_layout: str = "vk"
    conv_dtype: str = "bfloat16"
    a_log_dtype: str = "float32"
    dt_bias_dtype: str = "bfloat16"
    co_resident: int = 1
    stages: int = STAGES_ALL
    formats: Mapping[str, str] = field(default_factory=dict)
    layout: Any = field(init=False)
    resources: Any = field(init=False, default=None)
    _built: bool = field(init=False, default=False)

    _KIND = "GDN"
    _KERNEL = k1_gdn_kernel
    _PROGRAM = staticmethod(k1_gdn_program)
    _PLANES = ("in_proj_qkvz", "in_proj_ba")

    def _refusals(self) -> list[str]:
        bad = []
        if self.state_dtype not in ("float32", "bfloat16"):
            bad.append(f"state dtype {self.state_dtype}: K1 reads fp32 or bf16 states")
        if self.ssm_layout not in ("vk", "kv"):
            bad.append(f"ssm_layout {self.ssm_layout!r} is not 'vk' or 'kv'")
        if self.shape.qkvz_rows % 16:
            bad.append(f"qkvz rows {self.shape.qkvz_rows} are not a multiple of 16")
        if self.config.dvs not in (1, 2) or self.shape.dv // self.config.dvs < 16:
            bad.append(f"dvs={self.config.dvs}: 1 or 2 state slices of at least 16 rows")
        return bad

    def label(self) -> str:
        s = self.shape
        return (
            f"k1 gdn h{s.hidden} hk{s.hk} hv{s.hv} dk{s.dk} dv{s.dv} {self.state_dtype} "
            f"{self.ssm_layout} {self._config_label()} dvs{self.config.dvs}"
            f"{self._formats_label()}"
        )

    def _proj_rows(self) -> int:
        return self.shape.qkvz_rows

    def _s1_rows(self, bn: int) -> int:
        na = -(-2 * self.shape.hv // bn) * bn  # in_proj_ba rows first, padded to whole tiles
        return na + self.shape.qkvz_rows

    def _kind_constexprs(self) -> dict:
        s, c, lay = self.shape, self.config, self.layout
        return dict(
            HK=s.hk,
            HV=s.hv,
            DK=s.dk,
            DV=s.dv,
            KC=s.conv_k,
            WROW=s.payload_words,
            OFF_PROJ=lay.offsets["proj"],
            RID_PROJ=lay.region_id("proj"),
            SSM_KV=self.ssm_layout == "kv",
            INTERLEAVED=self.packing == "interleaved",
            STATE_BYTES=4 if self.state_dtype == "float32" else 2,
            PRELOAD=c.preload and self.stages == STAGES_ALL and not self._split(),
            DVS=c.dvs,
            CVL=c.cvl,
            WB=_next_pow2(2 * s.dk + 2 * s.dv + 2),
            Q_QKVZ=self._q("in_proj_qkvz"),
            Q_BA=self._q("in_proj_ba"),
        )

    def check(self, hidden, residual, weights, conv_state, ssm_state, slots, o_in,
              residual_out) -> int:  # fmt: skip
        """Validate shapes, dtypes, contiguity, alignment and strides; returns the width."""
        import torch

        s, bf = self.shape, torch.bfloat16
        rows = {"o_in": (o_in, (s.value_dim,), bf), "slots": (slots, (), torch.int32)}
        params = {
            "in_proj_qkvz": ((s.qkvz_rows, s.hidden), bf),
            "in_proj_ba": ((2 * s.hv, s.hidden), bf),
            "conv1d": (None, bf),
            "A_log": ((s.hv,), _dt(self.a_log_dtype)),
            "dt_bias": ((s.hv,), _dt(self.dt_bias_dtype)),
            "norm": ((s.dv,), bf),
        }
        more = self._state_refusals(weights.get("conv1d"), conv_state, ssm_state)
        return self._check(hidden, residual, residual_out, weights, rows, params, more)

    def _state_refusals(self, conv_w, conv_state, ssm_state) -> list[str]:
        s = self.shape
        bad = []
        if conv_w is not None and conv_w.numel() != s.conv_dim * s.conv_k:
            bad.append(f"conv1d has {conv_w.numel()} values, expected {s.conv_dim}x{s.conv_k}")
        k1 = s.conv_k - 1
        if conv_state.dim() != 3 or conv_state.dtype != _dt(self.conv_dtype):
            bad.append(f"conv_state must be 3-d {self.conv_dtype}, got {conv_state.dtype}")
        elif tuple(conv_state.shape[1:]) not in ((k1, s.conv_dim), (s.conv_dim, k1)):
            bad.append(f"conv_state is {tuple(conv_state.shape)}: neither [S, K-1, C] nor "
                       "[S, C, K-1]")  # fmt: skip
        if ssm_state.dtype != _dt(self.state_dtype):
            bad.append(f"ssm_state is {ssm_state.dtype}, built for {self.state_dtype}")
        if ssm_state.dim() != 4 or tuple(ssm_state.shape[1:]) != (s.hv, s.dv, s.dk):
            bad.append(f"ssm_state is {tuple(ssm_state.shape)}, expected [S, {s.hv}, {s.dv}, "
                       f"{s.dk}]")  # fmt: skip
        elif ssm_state.stride()[1:] != (s.dv * s.dk, s.dk, 1) or ssm_state.stride(0) % 16:
            bad.append("ssm_state slots must be contiguous inside, slot stride a multiple of 16")
        for name, t in (("conv_state", conv_state), ("ssm_state", ssm_state)):
            if t.data_ptr() % 16:
                bad.append(f"{name} is not 16-byte aligned (no JIT mid-step)")
        return bad

    def _args(self, hidden, residual, weights, conv_state, ssm_state, slots, o_in,
              residual_out, ws, ctrl, health, n_rows, null_slot, layer, layers_per_step):  # fmt: skip
        cs = conv_state.stride()
        k1 = self.shape.conv_k - 1
        if tuple(conv_state.shape[1:]) == (k1, self.shape.conv_dim):
            cs_t, cs_c = cs[1], cs[2]  # vLLM: [S, K-1, C]
        else:
            cs_t, cs_c = cs[2], cs[1]  # SGLang: [S, C, K-1]
        return (
            hidden,
            hidden if residual is None else residual,
            residual_out,
            o_in,
            weights["input_layernorm"],
            weights["in_proj_qkvz"],
            weights["in_proj_ba"],
            weights["conv1d"],
            weights["A_log"],
            weights["dt_bias"],
            weights["norm"],
            conv_state,
            ssm_state,
            slots,
            *_step_args(residual, ws, ctrl, health, n_rows, layer, layers_per_step),
            -1 if null_slot is None else int(null_slot),
            cs[0],
            cs_t,
            cs_c,
            ssm_state.stride(0) // 16,
            float(self.shape.eps),
            float(self.shape.dk) ** -0.5,
            self._scale_arg(weights, "in_proj_qkvz"),
            self._scale_arg(weights, "in_proj_ba"),
        )

    def _warmup_args(self, dev, one, ws, ctrl, health) -> tuple:
        import torch

        w = {k: one for k in ("input_layernorm", "in_proj_qkvz", "in_proj_ba", "conv1d", "norm")}
        w.update(_fp8_stand_ins(self._quantized(), dev))
        w["A_log"] = torch.zeros(16, dtype=_dt(self.a_log_dtype), device=dev)
        w["dt_bias"] = torch.zeros(16, dtype=_dt(self.dt_bias_dtype), device=dev)
        conv = torch.zeros(1, 3, 16, dtype=_dt(self.conv_dtype), device=dev)
        ssm = torch.zeros(1, 1, 1, 16, dtype=_dt(self.state_dtype), device=dev)
        slots = torch.zeros(16, dtype=torch.int32, device=dev)
        return self._args(one, None, w, conv, ssm, slots, one, one, ws, ctrl, health, 2, 0, 0, 1)

    def launch(self, hidden, residual, weights, conv_state, ssm_state, slots, o_in,
               residual_out, *, ws: K1Workspace, ctrl, health, null_slot: int | None = None,
               layer: int = 0, layers_per_step: int = 1, validate: bool = True) -> None:  # fmt: skip
        """One K1 for ``hidden.shape[0]`` rows. The caller bumps the epoch once per step."""
        self._launch((hidden, residual, weights, conv_state, ssm_state, slots, o_in,
                      residual_out), validate, ws, ctrl, health, null_slot=null_slot,
                     layer=layer, layers_per_step=layers_per_step)  # fmt: skip


@dataclass
class K1AttnLaunch(_K1LaunchBase):
    """Attention K1 of one build. RoPE reads a [max_positions, rotary_dim] fp32 cos/sin
    table built once here (positions are clamped into it). ``formats``: the ``qkv_proj``
    format (see :class:`_K1LaunchBase`)."""

    shape: K1AttnShape
    config: K1Config
    max_positions: int = 8192
    positions_dtype: str = "int64"
    co_resident: int = 1
    stages: int = STAGES_ALL
    formats: Mapping[str, str] = field(default_factory=dict)
    layout: Any = field(init=False)
    rope: Any = field(init=False, default=None)
    resources: Any = field(init=False, default=None)
    _built: bool = field(init=False, default=False)

    _KIND = "attention"
    _KERNEL = k1_attn_kernel
    _PROGRAM = staticmethod(k1_attn_program)
    _PLANES = ("qkv_proj",)

    def _refusals(self) -> list[str]:
        rows = self.shape.qkv_rows
        return [f"qkv rows {rows} are not a multiple of 16"] if rows % 16 else []

    def label(self) -> str:
        s = self.shape
        return (
            f"k1 attn h{s.hidden} hq{s.hq} hkv{s.hkv} d{s.head_dim} rd{s.rotary_dim} "
            f"{self._config_label()}{self._formats_label()}"
        )

    def _proj_rows(self) -> int:
        return self.shape.qkv_rows

    def _kind_constexprs(self) -> dict:
        s, lay = self.shape, self.layout
        return dict(
            HQ=s.hq,
            HKV=s.hkv,
            D=s.head_dim,
            RD=s.rotary_dim,
            OFF_QK=lay.offsets["qk"],
            RID_QK=lay.region_id("qk"),
            Q_QKV=self._q("qkv_proj"),
        )

    def check(self, hidden, residual, weights, positions, q, k, v, gate, residual_out) -> int:
        import torch

        s, bf = self.shape, torch.bfloat16
        qd, kvd = s.hq * s.head_dim, s.hkv * s.head_dim
        rows = {
            "positions": (positions, (), _dt(self.positions_dtype)),
            "q": (q, (qd,), bf),
            "gate": (gate, (qd,), bf),
            "k": (k, (kvd,), bf),
            "v": (v, (kvd,), bf),
        }
        params = {
            "qkv_proj": ((s.qkv_rows, s.hidden), bf),
            "q_norm": ((s.head_dim,), bf),
            "k_norm": ((s.head_dim,), bf),
        }
        return self._check(hidden, residual, residual_out, weights, rows, params)

    def _args(self, hidden, residual, weights, positions, q, k, v, gate, residual_out, ws,
              ctrl, health, n_rows, layer, layers_per_step):  # fmt: skip
        return (
            hidden,
            hidden if residual is None else residual,
            residual_out,
            weights["input_layernorm"],
            weights["qkv_proj"],
            weights["q_norm"],
            weights["k_norm"],
            self.rope,
            positions,
            q,
            k,
            v,
            gate,
            *_step_args(residual, ws, ctrl, health, n_rows, layer, layers_per_step),
            self.max_positions,
            float(self.shape.eps),
            self._scale_arg(weights, "qkv_proj"),
        )

    def build(self, device: Any = "cuda") -> None:
        """The cos/sin table to ``device``, then compile, load and residency-check (GPU)."""
        import torch

        self.rope = rope_table(self.shape, self.max_positions, torch.device(device))
        super().build(device)

    def _warmup_args(self, dev, one, ws, ctrl, health) -> tuple:
        import torch

        w = {k: one for k in ("input_layernorm", "qkv_proj", "q_norm", "k_norm")}
        w.update(_fp8_stand_ins(self._quantized(), dev))
        pos = torch.zeros(16, dtype=_dt(self.positions_dtype), device=dev)
        return self._args(one, None, w, pos, one, one, one, one, one, ws, ctrl, health, 2, 0, 1)

    def launch(self, hidden, residual, weights, positions, q, k, v, gate, residual_out, *,
               ws: K1Workspace, ctrl, health, layer: int = 0, layers_per_step: int = 1,
               validate: bool = True) -> None:  # fmt: skip
        self._launch((hidden, residual, weights, positions, q, k, v, gate, residual_out),
                     validate, ws, ctrl, health, layer=layer,
                     layers_per_step=layers_per_step)  # fmt: skip


@dataclass
class K1Launches:
    """The K1 half of ``models.qwen3_next.launches.LayerLaunches`` (``k1_gdn``, ``k1_attn``
    with the Protocol's signatures) over built :class:`K1GdnLaunch` / :class:`K1AttnLaunch`.

    A Triton ``LayerLaunches`` delegates its ``k1_*`` methods here; ``layer.index`` is the
    tag's layer id, ``layers_per_step`` the number of decoder layers.
    """

    gdn: K1GdnLaunch | None
    attn: K1AttnLaunch | None
    gdn_ws: K1Workspace | None
    attn_ws: K1Workspace | None
    ctrl: Any
    health: Any
    layers_per_step: int
    null_slot: int | None = None
    validate: bool = True

    def k1_gdn(self, layer, hidden, residual, slots, *, o_in, residual_out) -> None:
        if self.gdn is None or self.gdn_ws is None:
            raise RuntimeError("K1Launches: no GDN build")
        self.gdn.launch(hidden, residual, layer.weights, layer.conv_state, layer.ssm_state,
                        slots, o_in, residual_out, ws=self.gdn_ws, ctrl=self.ctrl,
                        health=self.health, null_slot=self.null_slot, layer=layer.index,
                        layers_per_step=self.layers_per_step, validate=self.validate)  # fmt: skip

    def k1_attn(self, layer, hidden, residual, positions, *, q, k, v, gate,
                residual_out) -> None:  # fmt: skip
        if self.attn is None or self.attn_ws is None:
            raise RuntimeError("K1Launches: no attention build")
        self.attn.launch(hidden, residual, layer.weights, positions, q, k, v, gate,
                         residual_out, ws=self.attn_ws, ctrl=self.ctrl, health=self.health,
                         layer=layer.index, layers_per_step=self.layers_per_step,
                         validate=self.validate)  # fmt: skip
