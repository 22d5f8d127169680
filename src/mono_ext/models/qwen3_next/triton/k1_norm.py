"""K1's input RMSNorm (both fronts, GDN and attention): each CTA norms the step's rows into
its own dot operand, or, for steps wider than ``NONCE`` rows, each row is normed once by one
CTA and handed to every CTA behind a flag word carrying its rsqrt
(``K1Config.norm_once_above``). Both are the same code on the same values, so the same bits.
The operand is ``bf16(s * (1 + w))``; the rows' rsqrt scales each tile's accumulator at its
end (``k1_kernel``'s module doc).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mono_ext.kernels.triton.primitives import fence_gpu
from mono_ext.models.qwen3_next.triton.k1_words import get_f32, put_f32

__all__ = ["input_norm", "normed_rows", "norm_publish", "own_rows", "shared_rows"]


@triton.jit
def input_norm(
    hid_ptr, res_ptr, nw_ptr, xs_base, rout_ptr, n_rows, has_res, eps, pid,
    H: tl.constexpr, BB: tl.constexpr, CH: tl.constexpr, ONE: tl.constexpr = False,
):  # fmt: skip
    """s = hidden (+ residual) in fp32; xs = bf16(s * (1 + w)); returns the rows' rsqrt(mean(s^2)
    + eps) [Bb], which each tile's accumulator takes at its end: W (s * (1 + w)) * rsqrt is the
    Gemma norm's W x_normed, so the operand is written once, before the first weight chunk.

    Two unrolled passes over the H chunks. The first only loads and squares: with no store and
    no cross-warp sum between one chunk and the next, every chunk's loads are in flight
    together, and the sums take one reduction at the end. The second takes the chunks again
    (the compiler keeps the first pass's values in registers; else they come from L1) and
    stores. Storing chunk by chunk in one pass would put each chunk's loads behind the
    previous chunk's stores (the compiler cannot tell that ``xs_base`` is not ``hid_ptr``) and
    behind its reduction's barriers: a global round trip per chunk in front of the weights.

    The ``n_rows`` rows are normed into ``xs_base``, and CTA ``pid`` 0 writes their s (bf16) to
    ``residual_out``; ``ONE``: only row ``pid`` (here a row index), its residual_out too. A row's
    values and its sum depend on that row only, whichever other rows are masked in.
    """
    rows = tl.arange(0, BB)
    if ONE:  # noqa: SIM108 (a constexpr branch)
        rmask = rows == pid
    else:
        rmask = rows < n_rows
    hh = tl.arange(0, CH)
    NCH: tl.constexpr = (H + CH - 1) // CH
    sq = tl.zeros([BB, CH], dtype=tl.float32)
    for c in tl.static_range(NCH):
        hc = c * CH + hh
        m = rmask[:, None] & (hc[None, :] < H)
        off = rows[:, None] * H + hc[None, :]
        s = tl.load(hid_ptr + off, mask=m, other=0.0).to(tl.float32)
        s += tl.load(res_ptr + off, mask=m & (has_res != 0), other=0.0).to(tl.float32)
        sq += s * s
    for c in tl.static_range(NCH):
        hc = c * CH + hh
        m = rmask[:, None] & (hc[None, :] < H)
        off = rows[:, None] * H + hc[None, :]
        w = tl.load(nw_ptr + hc, mask=hc < H, other=0.0).to(tl.float32)
        s = tl.load(hid_ptr + off, mask=m, other=0.0).to(tl.float32)
        s += tl.load(res_ptr + off, mask=m & (has_res != 0), other=0.0).to(tl.float32)
        tl.store(rout_ptr + off, s.to(tl.bfloat16), mask=m & ((pid == 0) | ONE))
        tl.store(xs_base + off, (s * (1.0 + w[None, :])).to(tl.bfloat16), mask=m)
    tl.debug_barrier()  # xs written by this CTA's threads, read back by all of them
    return tl.rsqrt(tl.sum(sq, axis=1) / H + eps)


@triton.jit
def norm_publish(
    hid_ptr, res_ptr, nw_ptr, xs_ptr, rout_ptr, nflag_ptr, pid, G, n_rows, has_res, eps, tag,
    H: tl.constexpr, BB: tl.constexpr, CH: tl.constexpr, NONCE: tl.constexpr,
    STAGES: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """S0 (both kernels; steps wider than ``NONCE`` rows, builds with ``NONCE`` < ``BB`` only):
    CTA p norms rows p, p + G, ... into the shared ``xs[G]`` and writes their
    ``residual_out``, then flags each row with its rsqrt. Every CTA norming every row reads and
    writes all of them through L2 before its first weight chunk; once per row, the rest of the
    grid waits for one flag round trip."""
    if (STAGES & 8) and NONCE < BB:  # noqa: SIM102 (compiled in, then a branch per step)
        if n_rows > NONCE:
            rows = tl.arange(0, BB)
            for r in range(pid, n_rows, G):
                rstd = input_norm(hid_ptr, res_ptr, nw_ptr, xs_ptr + G * (BB * H), rout_ptr,
                                   n_rows, has_res, eps, r, H, BB, CH, ONE=True)  # fmt: skip
                fence_gpu(INTERP)  # every thread's xs stores (the norm's barrier) before flags
                put_f32(nflag_ptr, rows, rstd, rows == r, tag, INTERP)


@triton.jit
def shared_rows(nflag_ptr, xs_ptr, ctrl_ptr, health_ptr, G, rows, rmask, tag, H: tl.constexpr,
                 BB: tl.constexpr, RID_NFLAG: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """The rows S0 normed once: wait for their flags (this step's tag), whose words are their
    rsqrt; after the fence the shared ``xs[G]`` is this CTA's to read."""
    rstd = get_f32(nflag_ptr, rows, rmask, tag, ctrl_ptr, health_ptr, RID_NFLAG, INTERP)
    fence_gpu(INTERP)
    return xs_ptr + G * (BB * H), rstd


@triton.jit
def own_rows(hid_ptr, res_ptr, nw_ptr, xs_ptr, rout_ptr, pid, n_rows, has_res, eps,
              H: tl.constexpr, BB: tl.constexpr, CH: tl.constexpr):  # fmt: skip
    """This CTA's norm of every row into its own ``xs[pid]``: the operand and the rsqrt."""
    xs_base = xs_ptr + pid * (BB * H)
    rstd = input_norm(hid_ptr, res_ptr, nw_ptr, xs_base, rout_ptr, n_rows, has_res, eps, pid,
                       H, BB, CH)  # fmt: skip
    return xs_base, rstd


@triton.jit
def normed_rows(
    hid_ptr, res_ptr, nw_ptr, xs_ptr, rout_ptr, nflag_ptr, ctrl_ptr, health_ptr, pid, G, rows,
    rmask, n_rows, has_res, eps, tag, H: tl.constexpr, BB: tl.constexpr, CH: tl.constexpr,
    NONCE: tl.constexpr, RID_NFLAG: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """S1's dot operand and the rows' rsqrt [Bb]: this CTA's own norm of every row
    (:func:`own_rows`, steps of at most ``NONCE`` rows), else the shared rows of S0
    (:func:`shared_rows`). Both are the same code on the same values, so the same bits.
    ``NONCE`` 0 compiles the hand-off only (every step has a row), ``BB`` the own norm only."""
    if NONCE == 0:
        xs_base, rstd = shared_rows(nflag_ptr, xs_ptr, ctrl_ptr, health_ptr, G, rows, rmask, tag,
                                     H, BB, RID_NFLAG, INTERP)  # fmt: skip
    elif NONCE < BB:
        if n_rows > NONCE:
            xs_base, rstd = shared_rows(nflag_ptr, xs_ptr, ctrl_ptr, health_ptr, G, rows, rmask,
                                         tag, H, BB, RID_NFLAG, INTERP)  # fmt: skip
        else:
            xs_base, rstd = own_rows(hid_ptr, res_ptr, nw_ptr, xs_ptr, rout_ptr, pid, n_rows,
                                      has_res, eps, H, BB, CH)  # fmt: skip
    else:
        xs_base, rstd = own_rows(hid_ptr, res_ptr, nw_ptr, xs_ptr, rout_ptr, pid, n_rows, has_res,
                                  eps, H, BB, CH)  # fmt: skip
    return xs_base, rstd
