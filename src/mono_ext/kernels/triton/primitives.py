"""Triton device primitives for persistent launches: tagged words, bounded waits, health
records, and the one-shot in-kernel all-reduce.

Tensor contract (one set per rank; layouts in ``mono_ext.runtime.health`` / ``.layout``):

| name        | shape                 | dtype | layout                              | writer                 |
|-------------|-----------------------|-------|-------------------------------------|------------------------|
| ctrl        | [CTRL_WORDS]          | int64 | epoch, deadline_ns, rank, spare     | host; epoch +1/step    |
| health      | [HEALTH_WORDS]        | int32 | failed, magic, 2 spare, records     | a wait that gives up   |
| local region| [words]               | int64 | ``(tag << 32) | value``             | one producer stage     |
| peer region | [2][world][words]     | int64 | parity, source rank, word; tagged   | every rank's push      |
| peer table  | [world]               | int64 | byte address of each rank's buffer  | host at init           |

Why the pieces look the way they do:

- A payload word and its tag travel in one 64-bit store, so a reader that sees the right tag
  has the right value: no flag/data ordering, no fence per word.
- Spin loads are ``volatile`` (PTX ``ld.volatile`` = relaxed, system scope): never hoisted out
  of the loop, never served from a stale L1 line. Stores are ``st.relaxed.{gpu,sys}``:
  morally strong, so the race with the spinning reader is defined; ``sys`` scope when the
  reader sits on another GPU.
- Deadlines read ``%globaltimer`` (nanoseconds; ticks coarsely, fine for seconds-long limits).
- A wait that gives up bumps the sticky failed word; every wait checks it on entry and while
  spinning, so one stuck hand-off ends the whole launch (and later launches) at once.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mono_ext.runtime import health as _h

__all__ = [
    "allreduce_bf16_oneshot",
    "count_in",
    "fence_gpu",
    "fp32_bits",
    "global_timer_ns",
    "mailbox_get",
    "mailbox_put",
    "pack_bf16x2",
    "pack_tagged",
    "pdl_prologue",
    "put_words",
    "seq_tag",
    "stamp",
    "stamp_when",
    "step_seq",
    "store_tagged",
    "unpack_tag",
    "unpack_value",
    "wait_tagged",
    "words_to_fp32",
]

# Offsets into the control / health blocks (the layout lives in runtime/health.py).
CTRL_EPOCH = tl.constexpr(_h.CTRL_EPOCH)
CTRL_DEADLINE_NS = tl.constexpr(_h.CTRL_DEADLINE_NS)
CTRL_RANK = tl.constexpr(_h.CTRL_RANK)
H_FAILED = tl.constexpr(_h.H_FAILED)
H_RECORDS = tl.constexpr(_h.H_RECORDS)
MAX_RECORDS = tl.constexpr(_h.MAX_RECORDS)
RECORD_WORDS = tl.constexpr(_h.RECORD_WORDS)
_INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def global_timer_ns():
    """The GPU global timer in nanoseconds (same clock on every SM)."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def stamp(trace_ptr, i: tl.constexpr, TRACE: tl.constexpr):
    """``TRACE`` builds only: this CTA's %globaltimer when all its threads reach point ``i``,
    into word ``i`` of its 16 (benchmarks place time inside a launch with them:
    ``bench_k2.py --trace``, ``bench_k1.py --trace``). Other builds compile to nothing here."""
    if TRACE:
        tl.debug_barrier()
        tl.store(trace_ptr + tl.program_id(0) * 16 + i, global_timer_ns())


@triton.jit
def stamp_when(trace_ptr, i: tl.constexpr, when, TRACE: tl.constexpr):
    """:func:`stamp` where ``when`` (a scalar, the same in every thread of the CTA) holds."""
    if TRACE:
        tl.debug_barrier()
        tl.store(trace_ptr + tl.program_id(0) * 16 + i, global_timer_ns(), mask=when)


@triton.jit
def pdl_prologue():
    """Programmatic dependent launch, first thing in a persistent kernel: wait for the launch
    before this one (its outputs are this one's inputs, and its hand-off words must not be
    overwritten while it runs), then let the launch after this one begin launching. Nothing is
    read or written before the wait, so what overlaps is the next kernel's launch latency."""
    gdc_wait()
    gdc_launch_dependents()


@triton.jit
def step_seq(ctrl_ptr, layer, layers_per_step):
    """Sequence number of this (step, layer): ``epoch * layers_per_step + layer`` (int64).

    ``epoch`` is read from device memory (bumped once per step on the stream), never passed
    as an argument: a per-step int argument would specialise and compile mid-step.
    """
    epoch = tl.load(ctrl_ptr + CTRL_EPOCH, volatile=True)
    return epoch * layers_per_step + layer


@triton.jit
def seq_tag(seq):
    """Tag of a sequence: its low 32 bits (int32 bit pattern)."""
    return seq.to(tl.int32)


@triton.jit
def pack_tagged(values, tag):
    """int32 values + int32 tag -> int64 words ``(tag << 32) | value``."""
    lo = values.to(tl.uint32, bitcast=True).to(tl.int64)  # zero-extend: keep the tag bits clean
    return (tag.to(tl.int64) << 32) | lo


@triton.jit
def unpack_value(words):
    return words.to(tl.int32)  # truncation keeps the low 32 bits


@triton.jit
def fp32_bits(x):
    """fp32 values as the int32 payload of tagged words."""
    return x.to(tl.int32, bitcast=True)


@triton.jit
def words_to_fp32(words):
    """The fp32 payload of tagged words (``fp32_bits`` undone)."""
    return unpack_value(words).to(tl.float32, bitcast=True)


@triton.jit
def fence_gpu(INTERP: tl.constexpr):
    """``fence.acq_rel.gpu``: orders this thread's plain stores (after a CTA barrier: the
    CTA's) before a later flag store, or a flag seen before later plain loads."""
    if not INTERP:
        tl.inline_asm_elementwise(
            "fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
            pack=1,
        )  # fmt: skip


@triton.jit
def count_in(counter_ptr, n_parts, INTERP: tl.constexpr):
    """After this CTA's stores of its part of something ``n_parts`` CTAs write: count it in
    on ``counter_ptr``. Returns whether it was the last; the last resets the counter for the
    next launch and fences, so its threads' loads then see every part. Nobody waits."""
    tl.debug_barrier()  # every thread's part stores, then each thread's fence, then the count
    fence_gpu(INTERP)
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == n_parts - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        fence_gpu(INTERP)
    return last


@triton.jit
def unpack_tag(words):
    return (words >> 32).to(tl.int32)


@triton.jit
def store_tagged(ptrs, words, mask, SYS: tl.constexpr):
    """Store tagged words with ``st.relaxed``; ``SYS`` when a reader may be on another GPU."""
    if SYS:
        tl.inline_asm_elementwise(
            "{ .reg .pred %p; setp.ne.b32 %p, $3, 0; "
            "@%p st.relaxed.sys.global.b64 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,l,r",
            [ptrs, words, mask.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred %p; setp.ne.b32 %p, $3, 0; "
            "@%p st.relaxed.gpu.global.b64 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,l,r",
            [ptrs, words, mask.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _record_give_up(health_ptr, ctrl_ptr, region_id, index, bad, words, tag, waited_ns):
    first = tl.min(tl.where(bad, index, _INT32_MAX), axis=0)
    seen = tl.sum(tl.where(bad & (index == first), unpack_tag(words), 0), axis=0)
    slot = tl.atomic_add(health_ptr + H_FAILED, 1)  # one thread; also sets the sticky word
    if slot < MAX_RECORDS:
        rec = health_ptr + H_RECORDS + slot * RECORD_WORDS
        tl.store(rec + 0, region_id)
        tl.store(rec + 1, first)
        tl.store(rec + 2, tag)
        tl.store(rec + 3, seen)
        tl.store(rec + 4, tl.program_id(0))
        tl.store(rec + 5, tl.load(ctrl_ptr + CTRL_RANK))
        tl.store(rec + 6, tl.load(ctrl_ptr + CTRL_EPOCH, volatile=True))
        tl.store(rec + 7, waited_ns // 1000)


@triton.jit
def wait_tagged(ptrs, mask, index, tag, ctrl_ptr, health_ptr, region_id):
    """Spin until every masked word at ``ptrs`` carries ``tag``, at most the deadline.

    ``index`` (same shape) is each word's index inside region ``region_id``; it only goes
    into the health record. Returns ``(words, ok)``; ``ok`` is False when the wait gave up
    (a record is written) or bailed because the launch had already failed.
    """
    deadline = tl.load(ctrl_ptr + CTRL_DEADLINE_NS)
    failed = tl.load(health_ptr + H_FAILED, volatile=True)
    words = tl.load(ptrs, mask=mask, other=0, volatile=True)
    bad = (unpack_tag(words) != tag) & mask
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    t0 = global_timer_ns()
    waited = t0 - t0
    spin = (n_bad > 0) & (failed == 0)
    while spin:
        # both loads issued before either is used: one L2 round trip per spin, not two
        words = tl.load(ptrs, mask=mask, other=0, volatile=True)
        failed = tl.load(health_ptr + H_FAILED, volatile=True)
        bad = (unpack_tag(words) != tag) & mask
        n_bad = tl.sum(bad.to(tl.int32), axis=0)
        waited = global_timer_ns() - t0
        spin = (n_bad > 0) & (failed == 0) & (waited <= deadline)
    if (n_bad > 0) & (waited > deadline):
        _record_give_up(health_ptr, ctrl_ptr, region_id, index, bad, words, tag, waited)
    return words, n_bad == 0


@triton.jit
def mailbox_put(region_ptr, offs, values, mask, tag, SYS: tl.constexpr):
    """Hand int32 ``values`` to a later stage: words ``offs`` of a region, tagged."""
    store_tagged(region_ptr + offs, pack_tagged(values, tag), mask, SYS)


@triton.jit
def put_words(region_ptr, offs, values, mask, tag, INTERP: tl.constexpr):
    """``mailbox_put``, or under Triton's CPU interpreter (no inline PTX; a kernel's stages run
    as separate launches there, so nothing reads a word before its writer's launch ends) a
    plain store of the same tagged words."""
    if INTERP:
        tl.store(region_ptr + offs, pack_tagged(values, tag), mask=mask)
    else:
        mailbox_put(region_ptr, offs, values, mask, tag, False)


@triton.jit
def mailbox_get(region_ptr, offs, mask, tag, ctrl_ptr, health_ptr, region_id):
    """Bounded wait for words ``offs`` of a region; returns ``(int32 values, ok)``."""
    words, ok = wait_tagged(region_ptr + offs, mask, offs, tag, ctrl_ptr, health_ptr, region_id)
    return unpack_value(words), ok


@triton.jit
def pack_bf16x2(lo, hi):
    """Two fp32 blocks -> int32 words holding (round-to-nearest-even) bf16 pairs."""
    lo_b = lo.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi_b = hi.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) << 16
    return hi_b | lo_b


@triton.jit
def allreduce_bf16_oneshot(
    x_ptr,
    out_ptr,
    n_words,
    peers_ptr,
    region_off,
    region_id,
    seq,
    ctrl_ptr,
    health_ptr,
    RANKS: tl.constexpr,
    BLOCK: tl.constexpr,
    SYS: tl.constexpr,
):
    """One-shot all-reduce of ``2 * n_words`` bf16 values (``x_ptr``/``out_ptr``: int32 words,
    two bf16 each) through a peer region at ``region_off`` words into every rank's buffer.

    Push model: each CTA stores its chunk, tagged, into its rank's slot on every peer (remote
    stores are posted, not waited on), then spins on its *local* copy of all slots at once
    (one L2 round trip per spin, not one per source). Sums run in fp32 in rank order
    0..RANKS-1, so every rank gets bit-identical bf16 results. Chunks are spread over the
    grid; no CTA waits on another CTA of its own rank. ``RANKS`` must be a power of two.

    Why a re-load after the wait is safe: a peer overwrites this parity's slot only for the
    use after next, which needs this CTA's push of the next use, which comes later.
    """
    tl.static_assert((RANKS & (RANKS - 1)) == 0, "RANKS must be a power of two")
    rank = tl.load(ctrl_ptr + CTRL_RANK).to(tl.int32)
    tag = seq_tag(seq)
    parity = (seq & 1).to(tl.int32)
    mine = tl.load(peers_ptr + rank).to(tl.pointer_type(tl.int64)) + region_off
    own_slot = (parity * RANKS + rank) * n_words
    flat = tl.arange(0, RANKS * BLOCK)
    for chunk in range(tl.program_id(0), tl.cdiv(n_words, BLOCK), tl.num_programs(0)):
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_words
        words = pack_tagged(tl.load(x_ptr + offs, mask=mask, other=0), tag)
        for p in tl.static_range(RANKS):
            dst = tl.load(peers_ptr + p).to(tl.pointer_type(tl.int64)) + region_off + own_slot
            store_tagged(dst + offs, words, mask, SYS)
        # every source's words of this chunk in one bounded wait
        w = chunk * BLOCK + flat % BLOCK
        idx_all = (parity * RANKS + flat // BLOCK) * n_words + w
        wait_tagged(mine + idx_all, w < n_words, idx_all, tag, ctrl_ptr, health_ptr, region_id)
        lo = tl.zeros([BLOCK], dtype=tl.float32)
        hi = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(RANKS):
            idx = (parity * RANKS + s) * n_words + offs
            v = unpack_value(tl.load(mine + idx, mask=mask, other=0, volatile=True))
            lo += (v << 16).to(tl.float32, bitcast=True)  # bf16 bits -> fp32: shift into place
            hi += ((v >> 16) << 16).to(tl.float32, bitcast=True)
        tl.store(out_ptr + offs, pack_bf16x2(lo, hi), mask=mask)
