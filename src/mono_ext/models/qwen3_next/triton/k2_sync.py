"""The device helpers K2's stages share (``k2_stages.py``): bounded waits over 2-D blocks and
over the live rows of a sparse set, tagged partial sums across slots and ranks and the L2
prefetch of weight blocks. All are inlined into ``k2_kernel``."""

from __future__ import annotations

import triton
import triton.language as tl

from mono_ext.kernels.triton.primitives import (
    fp32_bits,
    pack_tagged,
    store_tagged,
    wait_tagged,
    words_to_fp32,
)

__all__ = [
    "live_places",
    "packed_rows",
    "prefetch_l2",
    "put_partial",
    "sum_partials",
    "wait2d",
    "wait_live_rows",
]


@triton.jit
def wait2d(
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
def live_places(live):
    """Each entry's place among the live entries of a flat block (a prefix sum; meaningful
    where ``live``)."""
    live_i = live.to(tl.int32)
    return tl.cumsum(live_i, axis=0) - live_i


@triton.jit
def packed_rows(live, place, row, words, first, CH: tl.constexpr):
    """Entries ``first .. first + CH - 1`` of the live entries of ``row`` / ``words`` (flat
    blocks) in their order: ``(row, words)`` blocks of CH, words 0 past the last live entry.
    ``place`` is :func:`live_places` of ``live``; each of the CH lanes picks the entry of its
    place with a masked sum, so no scatter through memory is needed."""
    lane = first + tl.arange(0, CH)
    pick = (place[None, :] == lane[:, None]) & live[None, :]
    return (
        tl.sum(tl.where(pick, row[None, :], 0), axis=1),
        tl.sum(tl.where(pick, words[None, :], 0), axis=1),
    )


@triton.jit
def wait_live_rows(
    base_ptr, live, row, words, tag, ctrl_ptr, health_ptr, region_id, W: tl.constexpr,
    CH: tl.constexpr, WP: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Bounded waits for the first ``words`` words of each row ``row`` (rows of ``W`` words at
    ``base_ptr``) where ``live``, CH live rows per wait (``WP``: a power of two >= every
    ``words``). The live rows are packed first (:func:`packed_rows`): each wait costs an L2
    round trip whatever its mask, so a sparse set (one batch row of a 16-row block) takes the
    fewest waits, not one per CH of all the rows."""
    n_live = tl.sum(live.to(tl.int32), axis=0)
    place = live_places(live)
    cw = tl.arange(0, WP)
    for first in range(0, n_live, CH):
        r, nw = packed_rows(live, place, row, words, first, CH)
        idx = r[:, None] * W + cw[None, :]
        wait2d(base_ptr + idx, cw[None, :] < nw[:, None], idx, tag, ctrl_ptr, health_ptr,
               region_id, CH, WP, INTERP)  # fmt: skip


@triton.jit
def prefetch_l2(ptrs, nbytes, mask):
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
def put_partial(
    scratch_ptr, peers_ptr, off, slot, acc_t, n_idx, rows, mask, tag, RANKS: tl.constexpr,
    WORDS: tl.constexpr, H: tl.constexpr, SYS: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Store a transposed fp32 partial ``acc_t`` [N, Bb] (columns ``n_idx`` of H) as tagged
    words into slot ``slot`` of a partials region: local at TP1, on every peer at TP > 1."""
    words = pack_tagged(fp32_bits(acc_t), tag)
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
def sum_partials(
    base_ptr, slot0, region_id, n_rows, cols, tag, ctrl_ptr, health_ptr, NSLOT: tl.constexpr,
    WORDS: tl.constexpr, H: tl.constexpr, BB: tl.constexpr, CB: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    """Wait for slots ``slot0 .. slot0 + NSLOT - 1`` of rows x ``cols``, sum them in slot
    order (fp32). One bounded wait covers every slot (one round trip per spin)."""
    flat = tl.arange(0, NSLOT * BB)
    r = flat % BB
    idx = (slot0 + flat // BB)[:, None] * WORDS + r[:, None] * H + cols[None, :]
    m_all = (r < n_rows)[:, None] & (cols[None, :] < H)
    wait2d(base_ptr + idx, m_all, idx, tag, ctrl_ptr, health_ptr, region_id, NSLOT * BB, CB,
            INTERP)  # fmt: skip
    rows = tl.arange(0, BB)
    mask = (rows < n_rows)[:, None] & (cols[None, :] < H)
    acc = tl.zeros([BB, CB], dtype=tl.float32)
    for s in tl.static_range(NSLOT):
        offs = (slot0 + s) * WORDS + rows[:, None] * H + cols[None, :]
        acc += words_to_fp32(tl.load(base_ptr + offs, mask=mask, other=0, volatile=True))
    return acc
