"""K1's GDN S2: per (row, value head) the gated delta rule on the recurrent state tile, in
place, then the gated RMSNorm into ``o_in`` (the program and the tensor contract are in
``k1_kernel``'s module doc).

Two schedules (``K1Config.dv_split``):

- ``gdn_s2`` (split 1): one task per (row, head) does the whole [Dv, Dk] tile, in
  ``state_row_slices`` slices one after the other, and the norm. At width 1 that is 32 tasks
  of 128 KB of state traffic each on 32 of 132 CTAs.
- ``gdn_s2_blocks`` then ``gdn_s3_norm`` (split 2 or 4): each (row, head) is ``DS`` tasks over
  blocks of Dv / DS state rows (128 tasks at width 1 for DS = 4). A block's task hands its o
  and its sum of o^2 to the norm as tagged words; the norm, a stage of its own (every CTA
  finishes its recurrence tasks before it waits, so no wait can deadlock), adds the head's DS
  sums in a fixed order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mono_ext.kernels.triton.primitives import stamp_when
from mono_ext.models.qwen3_next.triton.k1_words import prefetch_l2, put_f32, read_f32, wait_all

__all__ = ["block_task", "gdn_s2", "gdn_s2_blocks", "gdn_s3_norm"]

L2NORM_EPS = tl.constexpr(1e-6)  # FLA / vLLM: x / sqrt(sum(x^2) + 1e-6)


@triton.jit
def _delta_rule(S, qv, kv, vvec, beta, decay):
    """Rows of the gated delta rule: S <- decay S + beta (v - decay S k) k^T; o = S q."""
    S = S * decay
    ks = tl.sum(S * kv[None, :], axis=1)
    delta = (vvec - ks) * beta
    S = S + delta[:, None] * kv[None, :]
    o = tl.sum(S * qv[None, :], axis=1)
    return S, o


@triton.jit
def _slot(slots_all, rows, b, null_slot):
    """Row ``b``'s state slot and whether it is a real one (not padding)."""
    slot = tl.sum(tl.where(rows == b, slots_all, 0), axis=0)
    return slot, (slot >= 0) & (slot != null_slot)


@triton.jit
def _task_words(wi, gk, h, vofs, DK: tl.constexpr, DV: tl.constexpr, NV: tl.constexpr,
                KD: tl.constexpr, CONV: tl.constexpr, VD: tl.constexpr,
                HV: tl.constexpr):  # fmt: skip
    """Payload-row offsets of every word one task reads, as one block for one wait: q and k
    of key head ``gk`` (Dk each), ``NV`` values of v and of z from channel ``vofs`` of value
    head ``h``, beta and g of ``h``."""
    return tl.where(
        wi < DK,
        gk * DK + wi,
        tl.where(
            wi < 2 * DK,
            KD + gk * DK + (wi - DK),
            tl.where(
                wi < 2 * DK + NV,
                2 * KD + h * DV + vofs + (wi - 2 * DK),
                tl.where(
                    wi < 2 * DK + 2 * NV,
                    CONV + h * DV + vofs + (wi - 2 * DK - NV),
                    CONV + VD + h + (wi - 2 * DK - 2 * NV) * HV,
                ),
            ),
        ),
    )


@triton.jit
def _read_qk_gates(proj_ptr, row, gk, h, kq, two, mk, valid, KD: tl.constexpr,
                   DK: tl.constexpr, CONV: tl.constexpr, VD: tl.constexpr,
                   HV: tl.constexpr):  # fmt: skip
    """A task's raw q and k (key head ``gk``) and its head's [beta, g] words, waited for."""
    qv = read_f32(proj_ptr, row + gk * DK + kq, mk)
    kv = read_f32(proj_ptr, row + KD + gk * DK + kq, mk)
    bg = read_f32(proj_ptr, row + CONV + VD + h + two * HV, valid & (two < 2))
    return qv, kv, bg


@triton.jit
def _qk_gates(qv, kv, bg, two, qscale):
    """L2-normed q (times ``qscale``) and k, beta, and the decay exp(g)."""
    beta = tl.sum(tl.where(two == 0, bg, 0.0), axis=0)
    gdec = tl.sum(tl.where(two == 1, bg, 0.0), axis=0)
    qv = qv / tl.sqrt(tl.sum(qv * qv, axis=0) + L2NORM_EPS) * qscale
    kv = kv / tl.sqrt(tl.sum(kv * kv, axis=0) + L2NORM_EPS)
    return qv, kv, beta, tl.exp(gdec)


@triton.jit
def gdn_s2(
    ssm_ptr, slots_ptr, oin_ptr, proj_ptr, ctrl_ptr, health_ptr, G, first, rows, rmask, n_tasks,
    null_slot, ss16, ln, vh, kq, soff, gw0, gw1, eps, qscale, tag, HV: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, WROW: tl.constexpr, RID_PROJ: tl.constexpr,
    DVS: tl.constexpr, WB: tl.constexpr, KD: tl.constexpr,
    VD: tl.constexpr, CONV: tl.constexpr, RR: tl.constexpr, LINES: tl.constexpr,
    EPL: tl.constexpr, VH: tl.constexpr, SL_OFF: tl.constexpr, INTERP: tl.constexpr, trace_ptr,
    TRACE: tl.constexpr,
):  # fmt: skip
    """GDN S2: one task per (row, value head): gated delta rule on the state tile (in place),
    then the gated RMSNorm -> ``o_in``. ``TRACE``: stamps point 3 (``k1_kernel.TRACE_POINTS``)
    when the CTA's first task has all its words."""
    two = tl.arange(0, 2)
    # every word one task reads, as one block: q (Dk), k (Dk), v (Dv), z (Dv), beta, g
    NW: tl.constexpr = 2 * DK + 2 * DV + 2
    wi = tl.arange(0, WB)
    slots_all = tl.load(slots_ptr + rows, mask=rmask, other=-1)
    for t in range(first, n_tasks, G):
        b = t // HV
        h = t - b * HV
        gk = h // RR
        slot, valid = _slot(slots_all, rows, b, null_slot)
        sbase = ssm_ptr + tl.where(valid, slot, 0).to(tl.int64) * ss16 * 16 + h * (DV * DK)
        if not INTERP:  # the next task's state starts moving into L2
            tn = t + G
            bn_ = tn // HV
            sn = tl.sum(tl.where(rows == bn_, slots_all, 0), axis=0)
            okn = (tn < n_tasks) & (sn >= 0) & (sn != null_slot)
            stn = tl.where(okn, sn, 0).to(tl.int64) * ss16 * 16 + (tn - bn_ * HV) * (DV * DK)
            prefetch_l2(ssm_ptr + stn + ln * EPL, okn & (ln < LINES))
        smask = valid & (vh[:, None] < VH) & (kq[None, :] < DK)
        S = tl.load(sbase + soff, mask=smask, other=0.0).to(tl.float32)
        row = b * WROW
        woff = _task_words(wi, gk, h, 0, DK, DV, DV, KD, CONV, VD, HV)
        wait_all(proj_ptr, row + woff, valid & (wi < NW), tag, ctrl_ptr, health_ptr,
                  RID_PROJ, INTERP)  # fmt: skip
        stamp_when(trace_ptr, 3, t == first, TRACE)
        mk = valid & (kq < DK)
        mv = valid & (vh < VH)
        # every word of the task read at once (one round trip)
        qv, kv, bg = _read_qk_gates(proj_ptr, row, gk, h, kq, two, mk, valid, KD, DK, CONV, VD, HV)
        v0 = read_f32(proj_ptr, row + 2 * KD + h * DV + vh, mv)
        z0 = read_f32(proj_ptr, row + CONV + h * DV + vh, mv)
        if DVS > 1:
            v1 = read_f32(proj_ptr, row + 2 * KD + h * DV + VH + vh, mv)
            z1 = read_f32(proj_ptr, row + CONV + h * DV + VH + vh, mv)
        qv, kv, beta, decay = _qk_gates(qv, kv, bg, two, qscale)
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


@triton.jit
def block_task(t, HV: tl.constexpr, DS: tl.constexpr):
    """Row, value head and Dv block of a blocked S2 task (a head's DS tasks are consecutive)."""
    b = t // (HV * DS)
    r = t - b * (HV * DS)
    h = r // DS
    return b, h, r - h * DS


@triton.jit
def gdn_s2_blocks(
    ssm_ptr, slots_ptr, proj_ptr, osq_ptr, oraw_ptr, ctrl_ptr, health_ptr, G, first, rows,
    rmask, n_tasks, null_slot, ss16, ln, vh, kq, soff, qscale, tag,
    HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, WROW: tl.constexpr,
    RID_PROJ: tl.constexpr, WB: tl.constexpr, KD: tl.constexpr,
    VD: tl.constexpr, CONV: tl.constexpr, RR: tl.constexpr, LINES: tl.constexpr,
    EPL: tl.constexpr, VH: tl.constexpr, QB_OFF: tl.constexpr, DS: tl.constexpr,
    INTERP: tl.constexpr, trace_ptr, TRACE: tl.constexpr,
):  # fmt: skip
    """Blocked GDN S2, the recurrence: per (row, head, block of ``VH`` state rows) the delta
    rule on the block (in place); its o (fp32) and sum of o^2 go to ``oraw`` / ``osq`` for
    :func:`gdn_s3_norm`. ``QB_OFF``: a block's offset in a head's state; ``LINES``: its
    128-byte lines. ``TRACE``: as :func:`gdn_s2`."""
    two = tl.arange(0, 2)
    # every word one task reads, as one block: q (Dk), k (Dk), its v and z (VH), beta, g
    NW: tl.constexpr = 2 * DK + 2 * VH + 2
    wi = tl.arange(0, WB)
    slots_all = tl.load(slots_ptr + rows, mask=rmask, other=-1)
    for t in range(first, n_tasks, G):
        b, h, qb = block_task(t, HV, DS)
        gk = h // RR
        slot, valid = _slot(slots_all, rows, b, null_slot)
        head = tl.where(valid, slot, 0).to(tl.int64) * ss16 * 16 + h * (DV * DK)
        sbase = ssm_ptr + head + qb * QB_OFF
        if not INTERP:  # the next task's block starts moving into L2
            tn = t + G
            bn_, hn, qn = block_task(tn, HV, DS)
            sn, okn = _slot(slots_all, rows, bn_, null_slot)
            okn = okn & (tn < n_tasks)
            stn = tl.where(okn, sn, 0).to(tl.int64) * ss16 * 16 + hn * (DV * DK) + qn * QB_OFF
            prefetch_l2(ssm_ptr + stn + ln * EPL, okn & (ln < LINES))
        smask = valid & (vh[:, None] < VH) & (kq[None, :] < DK)
        S = tl.load(sbase + soff, mask=smask, other=0.0).to(tl.float32)
        row = b * WROW
        col = h * DV + qb * VH  # the block's first value channel
        woff = _task_words(wi, gk, h, qb * VH, DK, DV, VH, KD, CONV, VD, HV)
        wait_all(proj_ptr, row + woff, valid & (wi < NW), tag, ctrl_ptr, health_ptr, RID_PROJ,
                 INTERP)  # fmt: skip
        stamp_when(trace_ptr, 3, t == first, TRACE)
        mk = valid & (kq < DK)
        mv = valid & (vh < VH)
        qv, kv, bg = _read_qk_gates(proj_ptr, row, gk, h, kq, two, mk, valid, KD, DK, CONV, VD, HV)
        v0 = read_f32(proj_ptr, row + 2 * KD + col + vh, mv)
        qv, kv, beta, decay = _qk_gates(qv, kv, bg, two, qscale)
        S, o = _delta_rule(S, qv, kv, v0, beta, decay)
        tl.store(sbase + soff, S.to(ssm_ptr.dtype.element_ty), mask=smask)
        ss = tl.where(two == 0, tl.sum(o * o, axis=0), 0.0)
        put_f32(osq_ptr, (b * HV + h) * DS + qb + two, ss, valid & (two == 0), tag, INTERP)
        put_f32(oraw_ptr, b * VD + col + vh, o, mv, tag, INTERP)


@triton.jit
def gdn_s3_norm(
    slots_ptr, oin_ptr, gnw_ptr, proj_ptr, osq_ptr, oraw_ptr, ctrl_ptr, health_ptr, G, first,
    rows, rmask, n_tasks, null_slot, vh, eps, tag, HV: tl.constexpr, DV: tl.constexpr,
    WROW: tl.constexpr, RID_OSQ: tl.constexpr, VD: tl.constexpr, CONV: tl.constexpr,
    VH: tl.constexpr, DS: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Blocked GDN S2, the gated RMSNorm of this CTA's blocks (the same tasks as
    :func:`gdn_s2_blocks`, after all of them): w * o * rsqrt(mean(o^2) + eps) * silu(z), with
    the head's DS sums of o^2 added in block order. Padding rows get o_in = 0."""
    dsr = tl.arange(0, DS)
    slots_all = tl.load(slots_ptr + rows, mask=rmask, other=-1)
    for t in range(first, n_tasks, G):
        b, h, qb = block_task(t, HV, DS)
        slot, valid = _slot(slots_all, rows, b, null_slot)
        parts = (b * HV + h) * DS + dsr
        wait_all(osq_ptr, parts, valid & (dsr < DS), tag, ctrl_ptr, health_ptr, RID_OSQ, INTERP)
        ss = tl.sum(read_f32(osq_ptr, parts, valid & (dsr < DS)), axis=0)
        rstd = tl.rsqrt(ss / DV + eps)
        col = h * DV + qb * VH + vh
        mv = valid & (vh < VH)
        o = read_f32(oraw_ptr, b * VD + col, mv)  # this CTA's own words: no wait
        z = read_f32(proj_ptr, b * WROW + CONV + col, mv)
        gw = tl.load(gnw_ptr + qb * VH + vh).to(tl.float32)
        y = tl.where(valid, gw * o * rstd * (z * tl.sigmoid(z)), 0.0)
        tl.store(oin_ptr + b * VD + col, y.to(oin_ptr.dtype.element_ty))
