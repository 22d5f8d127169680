"""K1's attention front on the stream engine (Gluon, sm_90): device code.

One persistent launch per layer per decode step of at most ``BB`` (16) rows, one CTA per SM:

- the **loader** warp (``stream.range_loader``) streams the CTA's contiguous range of
  ``qkv_proj`` chunks (``stream_schedule.ChunkDeal``: equal bytes on every CTA) into an SMEM
  ring from the first instruction on, so no weight byte waits for the input norm; with
  ``HOLD`` >= 0 (``StreamConfig.chunks_before_norm``) it requests only the first ``HOLD``
  chunks before the consumer's ``gate`` (the norm's loads back): those loads then queue
  behind at most ``HOLD`` chunks, not behind the whole ring (on the H100 the norm ended
  1.2 us later per ring slot of 32 KB per CTA);
- the **consumer** warpgroup norms the step's rows into ``x^T`` in SMEM meanwhile (residual
  add, Gemma RMSNorm's ``s * (1 + w)``; the rows' ``rsqrt`` scales each tile at its end, since
  ``W (s (1 + w)) rsqrt`` is ``W x_normed``), then runs one async wgmma per chunk;
- a chunk is ``CR`` rows (a tile) by ``BK`` columns; a head (``D`` rows of q, gate, k or v)
  is ``D / CR`` tiles. Each CTA that streamed some of a tile's chunks stores its part as the
  part ends, and counts its parts in (``stream.count_in`` on the head's counter) only after
  its last chunk, so no count or head output holds up the ring; the last of a head's parts
  to arrive sums every tile's parts in part order and writes the head's outputs, the q/k
  Gemma norm and the partial RoPE included, since no other head is needed. Nothing in the
  launch waits on another CTA.

Tensor contract (``B`` = rows of the step, at most ``BB``; ``NH = 2 HQ + 2 HKV`` heads of
``TPH = D / CR`` tiles each, ``T = NH * TPH``):

| name | shape | dtype | layout | written by |
|---|---|---|---|---|
| ``hid`` / ``res`` | [B, H] | bf16 | row-major | the engine (``res`` not read when ``has_res`` is 0) |
| ``rout`` | [B, H] | bf16 | row-major | CTA 0: ``hid + res`` |
| ``nw`` | [H] | bf16 | | the engine (input_layernorm) |
| ``qkv_proj`` | [NH * D, H] | bf16 | per q head: D q rows, D gate rows; then k, then v heads | the engine |
| ``qn`` / ``kn`` | [D] | bf16 | | the engine (q_norm / k_norm) |
| ``rope`` | [max_pos, RD] | fp32 | cos (RD/2) then sin (RD/2) per position | the launch, once |
| ``pos`` | [B] | int32 / int64 | | the engine |
| ``q`` / ``gate`` | [B, HQ * D] | bf16 | row-major | the head's last part |
| ``k`` / ``v`` | [B, HKV * D] | bf16 | row-major | the head's last part |
| ``parts`` | [T, MAXP, BB, CR] | fp32 | part p of tile t, batch-row major | each part's CTA |
| ``count`` | [NH] | int32 | zero between launches | ``stream.count_in`` |
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mono_ext.kernels.triton.stream import (
    chunk_owner,
    chunk_range,
    count_in,
    range_loader,
    stamp,
)

__all__ = ["TRACE_POINTS", "k1_attn_stream_kernel"]

#: what a trace build stamps, by word of the CTA's 16: the consumer's start, x^T written, its
#: first chunk arrived, its last chunk multiplied, its last head written (CTAs that finish a
#: head).
TRACE_POINTS = ("start", "rows normed", "first chunk", "stream done", "last head out")


@gluon.jit
def _input_group(hid_ptr, res_ptr, has_res, k, bb, bm, H: gl.constexpr):
    """One column group ``k`` of the step's rows: ``s = hid + res`` in fp32 [GK, BB] (x^T's
    orientation), with its columns, offsets and mask for the stores that follow."""
    off = bb[None, :] * H + k[:, None]
    m = bm[None, :] & (k[:, None] < H)
    s = gl.load(hid_ptr + off, mask=m, other=0.0).to(gl.float32)
    s += gl.load(res_ptr + off, mask=m & (has_res != 0), other=0.0).to(gl.float32)
    return s, k, off, m


@gluon.jit
def _input_norm(hid_ptr, res_ptr, nw_ptr, rout_ptr, xs, gate, pid, n_rows, has_res, eps,
                H: gl.constexpr, BB: gl.constexpr, NG: gl.constexpr,
                HOLD: gl.constexpr):  # fmt: skip
    """``x^T`` [H, BB] = bf16((hid + res) * (1 + nw)) into ``xs`` (rows past ``n_rows``:
    zeros); CTA 0 writes ``hid + res`` to ``rout``. Returns each row's ``rsqrt(mean(s^2) +
    eps)`` [BB]. ``NG`` groups of ``H / NG`` columns: each group's loads are all in flight
    before its math, and a group's registers bound the consumer's. Each group's values move
    to a layout of 8 rows per thread before the SMEM store: one vector store per 8 values
    along x^T's rows, where the load layout's 8 columns per thread are 8 scalar stores.

    ``HOLD`` >= 0 (the loader waits on ``gate``): two passes. The first loads every group
    and sums the squares, then releases the loader: the rows' loads go out ahead of the
    ring's copies and the stores need no HBM. The second loads the groups again (this
    CTA's own lines, from L1 where they still are) and stores. The sums are the same, in
    the same order, so the bits are the one-pass build's."""
    GK: gl.constexpr = H // NG
    nl: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[8, 1], threads_per_warp=[8, 4], warps_per_cta=[1, 4], order=[0, 1]
    )
    xl: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[16, 2], warps_per_cta=[4, 1], order=[1, 0]
    )
    kk = gl.arange(0, GK, layout=gl.SliceLayout(1, nl))
    bb = gl.arange(0, BB, layout=gl.SliceLayout(0, nl))
    bm = bb < n_rows
    sq = gl.zeros([BB], gl.float32, layout=gl.SliceLayout(0, nl))
    if HOLD >= 0:
        for g in gl.static_range(NG):
            s, _, _, _ = _input_group(hid_ptr, res_ptr, has_res, g * GK + kk, bb, bm, H)
            sq += gl.sum(s * s, axis=0)
        gl.thread_barrier()  # every warp's sums done, so its loads are back
        mbarrier.arrive(gate)
    for g in gl.static_range(NG):
        s, k, off, m = _input_group(hid_ptr, res_ptr, has_res, g * GK + kk, bb, bm, H)
        w = gl.load(nw_ptr + k).to(gl.float32)
        if HOLD < 0:
            sq += gl.sum(s * s, axis=0)
        gl.store(rout_ptr + off, s.to(gl.bfloat16), mask=m & (pid == 0))
        x = (s * (1.0 + w[:, None])).to(gl.bfloat16)
        # a row of x^T (16 rows' values at one column) per 16-byte store
        x = gl.convert_layout(x, xl)
        xs.slice(g * GK, GK).store(x)
    return gl.rsqrt(sq / H + eps)


@gluon.jit
def _head_parts(h, p_ptr, G, b, d, m2, C: gl.constexpr, KT: gl.constexpr, TPH: gl.constexpr,
                CR: gl.constexpr, BB: gl.constexpr, D: gl.constexpr, MAXP: gl.constexpr,
                el: gl.constexpr, UNROLL: gl.constexpr):  # fmt: skip
    """Head ``h``'s projection at dims ``d`` [BB, D]: each of its ``TPH`` tiles' parts summed
    in part order, tile ``r`` giving dims ``r * CR ...``; ``p_ptr`` points at the parts'
    scratch. ``UNROLL``: a static loop over the ``MAXP`` slots, those past the tile's parts
    masked and not added, so every part's loads can be in flight together; else a loop over
    the tile's parts, whose adds wait for each part's loads before the next part's issue
    (one L2 round trip per part). The same adds in the same order either way."""
    x = gl.zeros([BB, D], gl.float32, layout=el)
    for r in gl.static_range(TPH):
        t = h * TPH + r
        first = chunk_owner(t * KT, C, G)
        n = chunk_owner(t * KT + KT - 1, C, G) - first + 1
        mine = m2 & ((d // CR) == r)[None, :]
        off = b[:, None] * CR + (d - r * CR)[None, :]
        if UNROLL:
            for p in gl.static_range(MAXP):
                part = p_ptr + (t * MAXP + p) * (BB * CR)
                v = gl.load(part + off, mask=mine & (p < n), other=0.0, cache_modifier=".cg")
                x = gl.where(p < n, x + v, x)
        else:
            for p in range(n):
                part = p_ptr + (t * MAXP + p) * (BB * CR)
                x += gl.load(part + off, mask=mine, other=0.0, cache_modifier=".cg")
    return x


@gluon.jit
def _lanes_16_apart(x):
    """Every value of ``x`` from the lane 16 apart in the warp (``shfl.sync.bfly`` 16), at
    the same register: under ``_head_outputs``' layout a q or k head's dim ``d < 64`` sits in
    warp 0, two dims per lane, so this is the value at ``d +- 32``, its rotation partner when
    the rotary dims are 64."""
    y = gl.inline_asm_elementwise(
        "shfl.sync.bfly.b32 $0, $1, 16, 31, -1;",
        "=r,r",
        [x.to(gl.int32, bitcast=True)],
        dtype=gl.int32,
        is_pure=True,
        pack=1,
    )
    return y.to(gl.float32, bitcast=True)


@gluon.jit
def _head_part_count(h, G, C: gl.constexpr, KT: gl.constexpr, TPH: gl.constexpr):
    """How many parts head ``h``'s tiles have in all (one per tile and CTA streaming it)."""
    n = 0
    for r in gl.static_range(TPH):
        t = h * TPH + r
        n += chunk_owner(t * KT + KT - 1, C, G) - chunk_owner(t * KT, C, G) + 1
    return n


@gluon.jit
def _head_outputs(h, parts_ptr, G, rstd, qn_ptr, kn_ptr, rope_ptr, pos_ptr, q_ptr, k_ptr,
                  v_ptr, gate_ptr, n_rows, max_pos, eps, HQ: gl.constexpr, HKV: gl.constexpr,
                  D: gl.constexpr, RD: gl.constexpr, BB: gl.constexpr, C: gl.constexpr,
                  KT: gl.constexpr, TPH: gl.constexpr, CR: gl.constexpr,
                  MAXP: gl.constexpr, UNROLL: gl.constexpr):  # fmt: skip
    """Head ``h``'s last part: its parts summed (:func:`_head_parts`), scaled by the input
    norm's ``rstd``, and the head's outputs written: gate / v as they are; q / k through the
    Gemma head norm and the partial neox RoPE (rotation partner of dim ``d < RD`` at
    ``d +- RD/2``, summed from the same parts in the same order; with ``UNROLL`` and 64
    rotary dims taken from the lane holding it, :func:`_lanes_16_apart`, instead of summed
    again). ``h`` counts q, gate alternating per q head, then the k heads, then the v
    heads."""
    el: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 2], threads_per_warp=[1, 32], warps_per_cta=[1, 4], order=[1, 0]
    )
    HALF: gl.constexpr = RD // 2
    b = gl.arange(0, BB, layout=gl.SliceLayout(1, el))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, el))
    bm = b < n_rows
    m2 = bm[:, None] & (d[None, :] < D)
    partner = gl.where(d < HALF, d + HALF, gl.where(d < RD, d - HALF, d))
    rs = gl.convert_layout(rstd, gl.SliceLayout(1, el))
    x = _head_parts(h, parts_ptr, G, b, d, m2, C, KT, TPH, CR, BB, D, MAXP, el, UNROLL)
    x = x * rs[:, None]
    QT: gl.constexpr = 2 * HQ  # q and gate heads, alternating
    if h >= QT + HKV:  # v head
        j = h - QT - HKV
        gl.store(v_ptr + b[:, None] * (HKV * D) + j * D + d[None, :], x.to(gl.bfloat16), mask=m2)
    elif (h < QT) & (h % 2 == 1):  # gate of q head h // 2
        gl.store(gate_ptr + b[:, None] * (HQ * D) + (h // 2) * D + d[None, :],
                 x.to(gl.bfloat16), mask=m2)  # fmt: skip
    else:  # q head h // 2, or k head h - QT
        if UNROLL and RD == 64:
            xp = _lanes_16_apart(x)
        else:
            xp = _head_parts(h, parts_ptr, G, b, partner, m2, C, KT, TPH, CR, BB, D, MAXP, el,
                             UNROLL)  # fmt: skip
            xp = xp * rs[:, None]
        is_k = h >= QT
        pos = gl.load(pos_ptr + b, mask=bm, other=0)
        pos = gl.minimum(gl.maximum(pos, 0), max_pos - 1).to(gl.int64)
        fi = gl.where(d < HALF, d, gl.where(d < RD, d - HALF, 0))
        rot = bm[:, None] & (d[None, :] < RD)
        cs = rope_ptr + pos[:, None] * RD + fi[None, :]
        cos = gl.load(cs, mask=rot, other=1.0)
        sin = gl.load(cs + HALF, mask=rot, other=0.0)
        nw = gl.where(is_k, kn_ptr, qn_ptr)
        w = gl.load(nw + d).to(gl.float32)
        wp = gl.load(nw + partner).to(gl.float32)
        hr = gl.rsqrt(gl.sum(x * x, axis=1) / D + eps)
        xn = x * hr[:, None] * (1.0 + w[None, :])
        xpn = xp * hr[:, None] * (1.0 + wp[None, :])
        sgn = gl.where(d < HALF, -1.0, 1.0)
        out = gl.where(d[None, :] < RD, xn * cos + sgn[None, :] * xpn * sin, xn)
        base = gl.where(is_k, k_ptr + (h - QT) * D, q_ptr + (h // 2) * D)
        stride = gl.where(is_k, HKV * D, HQ * D)
        gl.store(base + b[:, None] * stride + d[None, :], out.to(gl.bfloat16), mask=m2)


@gluon.jit
def _attn_consumer(ring, ready, empty, gate, xs, c0, c1, pid, G, hid_ptr, res_ptr, rout_ptr, nw_ptr,
                   qn_ptr, kn_ptr, rope_ptr, pos_ptr, q_ptr, k_ptr, v_ptr, gate_ptr, parts_ptr,
                   count_ptr, n_rows, has_res, max_pos, eps, H: gl.constexpr, HQ: gl.constexpr,
                   HKV: gl.constexpr, D: gl.constexpr, RD: gl.constexpr, BB: gl.constexpr,
                   BK: gl.constexpr, CR: gl.constexpr, NS: gl.constexpr, MAXP: gl.constexpr,
                   NG: gl.constexpr, HOLD: gl.constexpr, UNROLL: gl.constexpr, trace_ptr,
                   TRACE: gl.constexpr):  # fmt: skip
    KT: gl.constexpr = H // BK
    TPH: gl.constexpr = D // CR  # tiles per head
    C: gl.constexpr = (2 * HQ + 2 * HKV) * TPH * KT
    trace_ptr += pid * 16
    stamp(trace_ptr, 0, TRACE)
    # the norm writes x^T as one [H, BB] matrix: the same bytes as the [KT, BK, BB] chunks,
    # the swizzle repeating within every chunk
    x2 = xs._reinterpret(gl.bfloat16, [H, BB], xs.layout)
    rstd = _input_norm(hid_ptr, res_ptr, nw_ptr, rout_ptr, x2, gate, pid, n_rows, has_res, eps,
                       H, BB, NG, HOLD)  # fmt: skip
    fence_async_shared()  # x^T's generic-proxy stores, before the wgmma reads them
    gl.thread_barrier()
    stamp(trace_ptr, 1, TRACE)
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BB, 16]
    )
    acc = gl.zeros([CR, BB], gl.float32, layout=mma)
    ro = gl.arange(0, CR, layout=gl.SliceLayout(1, mma))
    co = gl.arange(0, BB, layout=gl.SliceLayout(0, mma))
    for c in range(c0, c1):
        i = c - c0
        s = i % NS
        kc = c % KT
        cont = (kc > 0) & (c > c0)  # this part's chunks so far are in acc
        mbarrier.wait(ready.index(s), (i // NS) & 1)
        if TRACE:  # noqa: SIM102 (a constexpr branch, then a runtime one)
            if i == 0:
                stamp(trace_ptr, 2, TRACE)
        acc = warpgroup_mma(ring.index(s), xs.index(kc), acc, use_acc=cont, is_async=True)
        # one wgmma stays in flight: the one before it has read its slot and can free it
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index((i + NS - 1) % NS), pred=cont)
        if (kc == KT - 1) | (c == c1 - 1):  # the part ends: its tile's last chunk or ours
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(s))
            t = c // KT
            part = parts_ptr + (t * MAXP + pid - chunk_owner(t * KT, C, G)) * (BB * CR)
            gl.store(part + co[None, :] * CR + ro[:, None], acc, mask=co[None, :] < n_rows)
            if TRACE:  # noqa: SIM102 (a constexpr branch, then a runtime one)
                if c == c1 - 1:
                    stamp(trace_ptr, 3, TRACE)
    # the parts' counts after the stream: a tile ending mid-range stops no load
    for t in range(c0 // KT, (c1 - 1) // KT + 1):
        if count_in(count_ptr + t // TPH, _head_part_count(t // TPH, G, C, KT, TPH)):
            _head_outputs(t // TPH, parts_ptr, G, rstd, qn_ptr, kn_ptr, rope_ptr, pos_ptr, q_ptr,
                          k_ptr, v_ptr, gate_ptr, n_rows, max_pos, eps, HQ, HKV, D, RD, BB, C,
                          KT, TPH, CR, MAXP, UNROLL)  # fmt: skip
            stamp(trace_ptr, 4, TRACE)


@gluon.jit(do_not_specialize=["n_rows", "has_res", "max_pos"])
def k1_attn_stream_kernel(
    hid_ptr, res_ptr, rout_ptr, nw_ptr, w_desc, qn_ptr, kn_ptr, rope_ptr, pos_ptr, q_ptr, k_ptr,
    v_ptr, gate_ptr, parts_ptr, count_ptr, trace_ptr, n_rows, has_res, max_pos, eps,
    H: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, RD: gl.constexpr,
    BB: gl.constexpr, BK: gl.constexpr, NS: gl.constexpr, MAXP: gl.constexpr, NG: gl.constexpr,
    X_LAYOUT: gl.constexpr, LOADER_REGS: gl.constexpr, HOLD: gl.constexpr = -1,
    UNROLL: gl.constexpr = False, TRACE: gl.constexpr = False,
):  # fmt: skip
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    KT: gl.constexpr = H // BK
    CR: gl.constexpr = w_desc.block_type.shape[0]  # rows per chunk (and per tile)
    c0, c1 = chunk_range(pid, (2 * HQ + 2 * HKV) * (D // CR) * KT, G)
    ring = gl.allocate_shared_memory(gl.bfloat16, [NS, CR, BK], w_desc.layout)
    xs = gl.allocate_shared_memory(gl.bfloat16, [KT, BK, BB], X_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    if HOLD >= 0:  # the rows normed: the loader's go-ahead after its first HOLD chunks
        gate = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(gate, count=1)
    else:  # never waited on nor arrived at (the build has no gate)
        gate = ready.index(0)
    fence_async_shared()
    gl.warp_specialize(
        [
            (
                _attn_consumer,
                (ring, ready, empty, gate, xs, c0, c1, pid, G, hid_ptr, res_ptr, rout_ptr, nw_ptr,
                 qn_ptr, kn_ptr, rope_ptr, pos_ptr, q_ptr, k_ptr, v_ptr, gate_ptr, parts_ptr,
                 count_ptr, n_rows, has_res, max_pos, eps, H, HQ, HKV, D, RD, BB, BK, CR, NS,
                 MAXP, NG, HOLD, UNROLL, trace_ptr, TRACE),
            ),  # fmt: skip
            (range_loader, (w_desc, ring, ready, empty, gate, c0, c1, KT, NS, HOLD)),
        ],
        [1],
        [LOADER_REGS],
    )
