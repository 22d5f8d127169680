"""K1's hand-offs between its stages as tagged fp32 words (``primitives`` tags and bounded
waits, ``runtime.layout`` regions), and the L2 prefetch its stages issue ahead of a read.

In Triton's interpreter the stages run as separate launches in program order, so a wait there
has nothing to wait for: it reads what the earlier launch wrote.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mono_ext.kernels.triton.primitives import fp32_bits, put_words, wait_tagged, words_to_fp32

__all__ = ["get_f32", "prefetch_l2", "put_f32", "read_f32", "wait_all"]


@triton.jit
def put_f32(region_ptr, offs, values, mask, tag, INTERP: tl.constexpr):
    """Hand fp32 ``values`` to a later stage as tagged words."""
    put_words(region_ptr, offs, fp32_bits(values), mask, tag, INTERP)


@triton.jit
def get_f32(region_ptr, offs, mask, tag, ctrl_ptr, health_ptr, region_id, INTERP: tl.constexpr):
    """Bounded wait for 1-D tagged words; returns their fp32 values (0 where masked)."""
    if INTERP:
        words = tl.load(region_ptr + offs, mask=mask, other=0)
    else:
        words, ok = wait_tagged(region_ptr + offs, mask, offs, tag, ctrl_ptr, health_ptr, region_id)
    return tl.where(mask, words_to_fp32(words), 0.0)


@triton.jit
def wait_all(region_ptr, offs, mask, tag, ctrl_ptr, health_ptr, region_id, INTERP: tl.constexpr):
    """One bounded wait until every masked word carries ``tag`` (read them with read_f32)."""
    if not INTERP:  # the interpreter runs the stages as separate launches: nothing to wait for
        wait_tagged(region_ptr + offs, mask, offs, tag, ctrl_ptr, health_ptr, region_id)


@triton.jit
def read_f32(region_ptr, offs, mask):
    """fp32 values of tagged words already waited for (volatile: never a stale L1 line)."""
    words = tl.load(region_ptr + offs, mask=mask, other=0, volatile=True)
    return tl.where(mask, words_to_fp32(words), 0.0)


@triton.jit
def prefetch_l2(ptrs, mask):
    """``prefetch.global.L2`` per pointer (one per 128-byte line is enough)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred %p; setp.ne.b32 %p, $2, 0; @%p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
