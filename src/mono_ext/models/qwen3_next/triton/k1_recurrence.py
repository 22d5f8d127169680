"""K1's GDN S2: per (row, value head) the gated delta rule on the recurrent state tile, in
place, then the gated RMSNorm into ``o_in`` (the program and the tensor contract are in
``k1_kernel``'s module doc).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mono_ext.models.qwen3_next.triton.k1_words import prefetch_l2, read_f32, wait_all

__all__ = ["gdn_s2"]

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
def gdn_s2(
    ssm_ptr, slots_ptr, oin_ptr, proj_ptr, ctrl_ptr, health_ptr, G, first, rows, rmask, n_tasks,
    null_slot, ss16, ln, vh, kq, soff, S_first, gw0, gw1, eps, qscale, tag, HV: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, WROW: tl.constexpr, RID_PROJ: tl.constexpr,
    PRELOAD: tl.constexpr, DVS: tl.constexpr, WB: tl.constexpr, KD: tl.constexpr,
    VD: tl.constexpr, CONV: tl.constexpr, RR: tl.constexpr, LINES: tl.constexpr,
    EPL: tl.constexpr, VH: tl.constexpr, SL_OFF: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """GDN S2: one task per (row, value head): gated delta rule on the state tile (in place),
    then the gated RMSNorm -> ``o_in``."""
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
            prefetch_l2(ssm_ptr + stn + ln * EPL, okn & (ln < LINES))
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
        wait_all(proj_ptr, row + woff, valid & (wi < NW), tag, ctrl_ptr, health_ptr,
                  RID_PROJ, INTERP)  # fmt: skip
        mk = valid & (kq < DK)
        mv = valid & (vh < VH)
        # every word of the task read at once (one round trip)
        qv = read_f32(proj_ptr, row + gk * DK + kq, mk)
        kv = read_f32(proj_ptr, row + KD + gk * DK + kq, mk)
        bg = read_f32(proj_ptr, row + CONV + VD + h + two * HV, valid & (two < 2))
        v0 = read_f32(proj_ptr, row + 2 * KD + h * DV + vh, mv)
        z0 = read_f32(proj_ptr, row + CONV + h * DV + vh, mv)
        if DVS > 1:
            v1 = read_f32(proj_ptr, row + 2 * KD + h * DV + VH + vh, mv)
            z1 = read_f32(proj_ptr, row + CONV + h * DV + VH + vh, mv)
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
