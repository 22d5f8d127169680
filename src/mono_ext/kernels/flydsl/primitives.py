"""FlyDSL device primitives for persistent launches on gfx950: tagged words, bounded waits on
``s_memrealtime`` deadlines, health records with a sticky failed word, and the one-shot
peer-buffer all-reduce. The same contracts as ``kernels/triton/primitives.py``:

| name        | shape                 | dtype | layout                              | writer                 |
|-------------|-----------------------|-------|-------------------------------------|------------------------|
| ctrl        | [CTRL_WORDS]          | int64 | epoch, deadline_ns, rank, spare     | host; epoch +1/step    |
| health      | [HEALTH_WORDS]        | int32 | failed, magic, 2 spare, records     | a wait that gives up   |
| local region| [words]               | int64 | ``(tag << 32) | value``             | one producer stage     |
| peer region | [2][world][words]     | int64 | parity, source rank, word; tagged   | every rank's push      |
| peer table  | [world]               | int64 | byte address of each rank's buffer  | host at init (HIP IPC) |

Offsets come from ``mono_ext.runtime.health`` and ``.layout`` (one definition for both
backends). Every pointer arrives as an ``Int64`` byte address (kernel arguments by value):
FlyDSL's tensor arguments specialise on shapes, and a persistent launch must never compile
mid-step.

How the gfx950 pieces map the Triton ones:

- Spin loads are LLVM ``volatile`` loads: on gfx950 they are ``global_load ... sc0 sc1``
  (bypass the per-CU and L2 caches), so every re-load sees the other CU's (or GPU's) store.
- Stores are ``monotonic`` atomics: ``agent`` scope for a reader on this GPU, system scope
  (``sc0 sc1`` write-through) when the reader may sit on a peer GPU across XGMI.
- Deadlines read ``s_memrealtime``: the 100 MHz constant reference clock, the same on every
  CU; the host's ``deadline_ns`` becomes ticks once per wait (``/ 10``).
- FlyDSL code is per lane (SIMT), not per block: each lane waits for its own words; a lane
  that gives up bumps the failed word and, while slots remain, writes one record.

Helpers with data-dependent control flow are ``@flyc.jit`` (FlyDSL rewrites their loops and
branches when a kernel traces them); the rest are plain functions emitting straight-line IR.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import llvm

from ...runtime import health as _h
from .limits import GFX950

__all__ = [
    "NS_PER_TICK",
    "allreduce_word",
    "bf16x2_sum_to_word",
    "gptr",
    "load_word",
    "mailbox_put",
    "pack_tagged",
    "realtime_ticks",
    "record_give_up",
    "seq_tag",
    "step_seq",
    "store_tagged",
    "unpack_tag",
    "unpack_value",
    "wait_tagged",
]

NS_PER_TICK = 1_000_000_000 // GFX950.realtime_hz  # 10 ns per s_memrealtime tick
_MASK32 = 0xFFFFFFFF


def gptr(addr, dtype, align: int):
    """A global-memory pointer to ``dtype`` at byte address ``addr`` (Int64)."""
    ty = fx.PointerType.get(dtype.ir_type, fx.AddressSpace.Global, align)
    return fx.inttoptr(ty, addr)


def word_addr(base, index):
    """Byte address of int64 word ``index`` (Int32/Int64) of a region at ``base``."""
    return base + fx.Int64(index) * fx.Int64(8)


def load_word(addr):
    """Volatile int64 load: never hoisted, never served from a stale cache line."""
    return fx.generic_load(gptr(addr, fx.Int64, 8), volatile=True)


def realtime_ticks():
    """``s_memrealtime``: the constant 100 MHz clock, shared by every CU."""
    i64 = ir.IntegerType.get_signless(64)
    return fx.Int64(llvm.call_intrinsic(i64, "llvm.amdgcn.s.memrealtime", [], [], []))


def step_seq(ctrl, layer, layers_per_step):
    """``epoch * layers_per_step + layer``; epoch read from device memory (graph-safe)."""
    epoch = fx.generic_load(gptr(ctrl + 8 * _h.CTRL_EPOCH, fx.Int64, 8), volatile=True)
    return epoch * fx.Int64(layers_per_step) + fx.Int64(layer)


def seq_tag(seq):
    """Tag of a sequence: its low 32 bits."""
    return fx.Int32(seq)


def pack_tagged(value, tag):
    """Int32 value + Int32 tag -> Int64 word ``(tag << 32) | value`` (value zero-extended)."""
    return (fx.Int64(tag) << fx.Int64(32)) | (fx.Int64(value) & fx.Int64(_MASK32))


def unpack_value(word):
    return fx.Int32(word)  # truncation keeps the low 32 bits


def unpack_tag(word):
    return fx.Int32(word >> fx.Int64(32))


def store_tagged(addr, word, system: bool):
    """One 64-bit monotonic store; system scope when a reader may be on another GPU."""
    fx.generic_store(
        gptr(addr, fx.Int64, 8),
        word,
        memory_order=fx.AtomicOrdering.Monotonic,
        syncscope="" if system else "agent",
    )


def mailbox_put(region, index, value, tag, system: bool = False):
    """Hand the Int32 ``value`` to a later stage: word ``index`` of ``region``, tagged."""
    store_tagged(word_addr(region, index), pack_tagged(value, tag), system)


@flyc.jit
def record_give_up(ctrl, health, region_id, index, tag, seen, waited):
    """Count the give-up in the sticky failed word; describe it while record slots remain."""
    slot = fx.atomic_add(gptr(health + 4 * _h.H_FAILED, fx.Int32, 4), fx.Int32(1))
    if slot < _h.MAX_RECORDS:
        rec = health + fx.Int64(4 * _h.H_RECORDS) + fx.Int64(slot) * fx.Int64(4 * _h.RECORD_WORDS)
        rank = fx.Int32(fx.generic_load(gptr(ctrl + 8 * _h.CTRL_RANK, fx.Int64, 8)))
        epoch = fx.Int32(
            fx.generic_load(gptr(ctrl + 8 * _h.CTRL_EPOCH, fx.Int64, 8), volatile=True)
        )
        fields = (
            fx.Int32(region_id),
            fx.Int32(index),
            tag,
            seen,
            fx.Int32(fx.block_idx.x),
            rank,
            epoch,
            fx.Int32(waited * fx.Int64(NS_PER_TICK) // fx.Int64(1000)),  # waited_us
        )
        for i, value in enumerate(fields):
            fx.generic_store(gptr(rec + 4 * i, fx.Int32, 4), value)


@flyc.jit
def wait_tagged(addr, tag, ctrl, health, region_id, index):
    """Spin until the int64 word at ``addr`` carries ``tag``, at most the deadline.

    Bails at once when the sticky failed word is set (another wait gave up). On a timeout it
    records (region, index, wanted tag, seen tag, CTA, rank, epoch, waited) in the health
    block. Returns the last word seen; its tag equals ``tag`` exactly when the wait succeeded.
    """
    deadline = fx.generic_load(gptr(ctrl + 8 * _h.CTRL_DEADLINE_NS, fx.Int64, 8)) // fx.Int64(
        NS_PER_TICK
    )
    failed_ptr = gptr(health + 4 * _h.H_FAILED, fx.Int32, 4)
    word = load_word(addr)
    failed = fx.generic_load(failed_ptr, volatile=True)
    t0 = realtime_ticks()
    waited = t0 - t0
    while (unpack_tag(word) != tag) & (failed == 0) & (waited <= deadline):
        word = load_word(addr)
        failed = fx.generic_load(failed_ptr, volatile=True)
        waited = realtime_ticks() - t0
    if (unpack_tag(word) != tag) & (failed == 0):
        record_give_up(ctrl, health, region_id, index, tag, unpack_tag(word), waited)
    return word


def bf16x2_sum_to_word(lo, hi):
    """Two fp32 sums -> one Int32 word of two bf16 (round to nearest even, as torch)."""

    def rne(x):
        bits = fx.Uint32(x.bitcast(fx.Int32))
        bits = bits + fx.Uint32(0x7FFF) + ((bits >> fx.Uint32(16)) & fx.Uint32(1))
        return bits >> fx.Uint32(16)

    return fx.Int32((rne(hi) << fx.Uint32(16)) | rne(lo))


def _bf16_lo(word):
    return (word << fx.Int32(16)).bitcast(fx.Float32)


def _bf16_hi(word):
    return (word & fx.Int32(-65536)).bitcast(fx.Float32)


@flyc.jit
def allreduce_word(
    x, out, w, peers, region_off, slot_words, region_id, seq, ctrl, health, ranks: int, system: bool
):
    """One lane's share of the one-shot all-reduce: word ``w`` (two bf16) of ``x``.

    Push: the tagged word goes into this rank's slot of the parity-``seq`` half of the peer
    region on every rank (remote stores are posted, not waited on). Then a bounded wait on
    every source's slot in *this* rank's buffer, and an fp32 sum in rank order 0..R-1, so all
    ranks round the same sum to the same bf16. ``x``/``out`` hold Int32 words; the region
    starts ``region_off`` bytes into every rank's peer buffer, ``slot_words`` words per slot.
    """
    rank = fx.Int32(fx.generic_load(gptr(ctrl + 8 * _h.CTRL_RANK, fx.Int64, 8)))
    tag = seq_tag(seq)
    parity = fx.Int32(seq & fx.Int64(1))
    value = fx.generic_load(gptr(x + fx.Int64(w) * fx.Int64(4), fx.Int32, 4))
    word = pack_tagged(value, tag)
    # word w of slot (parity, source): (parity * R + source) * slot_words + w
    own = (parity * fx.Int32(ranks) + rank) * slot_words + w
    for p in fx.range_constexpr(ranks):
        base = fx.generic_load(gptr(peers + 8 * p, fx.Int64, 8))
        store_tagged(word_addr(base + region_off, own), word, system)
    mine = fx.generic_load(gptr(peers + fx.Int64(rank) * fx.Int64(8), fx.Int64, 8)) + region_off
    lo = fx.Float32(0.0)
    hi = fx.Float32(0.0)
    for s in fx.range_constexpr(ranks):
        idx = (parity * fx.Int32(ranks) + fx.Int32(s)) * slot_words + w
        got = unpack_value(wait_tagged(word_addr(mine, idx), tag, ctrl, health, region_id, idx))
        lo = lo + _bf16_lo(got)
        hi = hi + _bf16_hi(got)
    fx.generic_store(gptr(out + fx.Int64(w) * fx.Int64(4), fx.Int32, 4), bf16x2_sum_to_word(lo, hi))
