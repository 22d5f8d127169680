"""The stream engine's device pieces (Gluon, sm_90) that any model's launch uses.

- :func:`chunk_range` / :func:`chunk_owner`: the deal of ``stream_schedule.ChunkDeal``, the
  same formulas on the device (no table to load before the first copy).
- :func:`range_loader`: the producer partition. One warp issues a TMA copy for every chunk of
  the CTA's range into an SMEM ring, waiting only for a free slot, never for data: HBM sees
  the CTA's next bytes requested while the consumer normalises, multiplies or finishes
  earlier tiles. Optionally it holds the copies after the first ``HOLD`` chunks until the
  consumer's ``gate``: a full ring requested at the start puts the consumer's own loads
  (the rows it norms) behind the ring's bytes.
- :func:`count_in`: a finished part's arrival on its tile's counter. The last part to arrive
  gets ``True`` (and resets the counter for the next launch); nobody waits, so a launch with
  parts cannot deadlock whatever the grid's residency.
- :func:`fence_gpu`: ``fence.acq_rel.gpu`` for the part stores before the count and the count
  before the part loads.

Ring protocol (``ready`` / ``empty``: one mbarrier per slot, count 1): chunk ``i`` of the
range goes to slot ``i % NS``; the loader waits ``empty[s]`` at phase ``((i // NS) & 1) ^ 1``
(a fresh barrier has completed the phase before its first, so the first lap never waits),
the consumer waits ``ready[s]`` at phase ``(i // NS) & 1`` and arrives on ``empty[s]`` once
the wgmma that read the slot has retired.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

__all__ = ["chunk_owner", "chunk_range", "count_in", "fence_gpu", "range_loader", "stamp"]


@gluon.jit
def chunk_range(pid, C, G):
    """CTA ``pid``'s chunks ``[start, end)`` of ``C`` over a grid of ``G``."""
    return pid * C // G, (pid + 1) * C // G


@gluon.jit
def chunk_owner(c, C, G):
    """The CTA whose range holds chunk ``c``."""
    return ((c + 1) * G + C - 1) // C - 1


@gluon.jit
def fence_gpu():
    gl.inline_asm_elementwise(
        "fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def stamp(trace_ptr, point: gl.constexpr, TRACE: gl.constexpr):
    """A trace build's ``%globaltimer`` (ns) into word ``point`` of the CTA's row."""
    if TRACE:
        t = gl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1
        )
        gl.store(trace_ptr + point, t)


@gluon.jit
def range_loader(w_desc, ring, ready, empty, gate, c0, c1, KT: gl.constexpr, NS: gl.constexpr,
                 HOLD: gl.constexpr = -1):  # fmt: skip
    """Producer partition: chunks ``c0 .. c1 - 1`` of the plane behind ``w_desc`` (chunk
    ``c`` = tile ``c // KT``, K chunk ``c % KT``; the descriptor's block is one chunk).
    ``HOLD`` >= 0: after the range's first ``HOLD`` chunks, wait for ``gate``'s first phase
    (one consumer arrival) before the next copy; -1: never wait on ``gate``."""
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BK: gl.constexpr = w_desc.block_type.shape[1]
    for c in range(c0, c1):
        i = c - c0
        s = i % NS
        if HOLD >= 0:  # predicated, not branched: one copy of the loop body
            mbarrier.wait(gate, 0, pred=i == HOLD)
        mbarrier.wait(empty.index(s), ((i // NS) & 1) ^ 1)
        mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            w_desc, [(c // KT) * BN, (c % KT) * BK], ready.index(s), ring.index(s)
        )


@gluon.jit
def count_in(counter_ptr, n_parts):
    """After this partition's part stores: count the part in on ``counter_ptr``. Returns
    whether it was the last of ``n_parts``; the last resets the counter, then fences so its
    threads' part loads see every other part."""
    fence_gpu()  # each thread's part stores, before the barrier and the count
    gl.thread_barrier()
    last = gl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == n_parts - 1
    if last:
        gl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        fence_gpu()
    return last
