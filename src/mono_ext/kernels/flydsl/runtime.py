"""The FlyDSL runtime launches built from ``primitives``: a tagged-mailbox hand-off between CTAs
and the standalone one-shot all-reduce over peer buffers, each a persistent launch of one CTA
per CU (grid = 256 on MI355X, a constant: FlyDSL's grid query would need ROCm device code).

| launch     | arguments (all by value)                                   | checks at build           |
|------------|------------------------------------------------------------|---------------------------|
| mailbox    | src, dst (int32 words), scratch, n_words, region_off,       | hand-offs (layout),       |
|            | region_id, ctrl, health, layer, layers_per_step            | ISA: spills/LDS/residency |
| allreduce  | x, out (int32 = bf16x2 words), n_words, peers (table of    | world a power of two <= 8,|
|            | byte addresses), region_off (bytes), region_id, ctrl,      | ISA as above              |
|            | health, layer, layers_per_step                             |                           |

``layer`` / ``layers_per_step`` / ``n_words`` are run-time arguments: one compile serves every
step, layer and size. The mailbox launch's consumers read the *next* CTA's words, so the
hand-off really crosses CTAs: it completes only because the whole grid is resident.

Each ``*_launch`` returns a fresh ``@flyc.jit`` function (FlyDSL caches per function object);
``build_*`` compiles it offline for gfx950 and returns the checked
:class:`~mono_ext.kernels.flydsl.toolchain.Compiled`.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr.typing import Int32, Int64, Stream

from ...runtime.layout import Program, Region, Stage, allreduce, plan_layout, wait, write
from .limits import BLOCK, GFX950
from .primitives import allreduce_word, gptr, mailbox_put, seq_tag, step_seq, wait_tagged, word_addr
from .toolchain import Compiled, compile_offline

__all__ = [
    "allreduce_launch",
    "allreduce_program",
    "build_allreduce",
    "build_mailbox",
    "mailbox_launch",
    "mailbox_program",
]

GRID = GFX950.cus
_NULL_STREAM = Stream(None)  # launch on the current stream


def mailbox_program(words: int) -> Program:
    return Program(
        "mailbox",
        regions=(Region("x", words),),
        stages=(Stage("produce", (write("x"),)), Stage("consume", (wait("x"),))),
    )


def allreduce_program(hidden: int) -> Program:
    if hidden % 2:
        raise ValueError(f"hidden must be even (two bf16 per tagged word), got {hidden}")
    return Program(
        "allreduce",
        regions=(Region("ar", hidden // 2, peer=True),),
        stages=(Stage("reduce", allreduce("ar")),),
    )


def mailbox_launch(grid: int = GRID):
    """Stage 1: every CTA tags its share of ``src`` into the region; stage 2: every CTA waits
    for the share of CTA ``(b + 1) % grid`` and copies it to ``dst``."""

    @flyc.kernel(known_block_size=[BLOCK, 1, 1])
    def mailbox(
        src: Int64,
        dst: Int64,
        scratch: Int64,
        n_words: Int32,
        region_off: Int32,
        region_id: Int32,
        ctrl: Int64,
        health: Int64,
        layer: Int32,
        layers_per_step: Int32,
    ):
        tid = fx.thread_idx.x
        bid = fx.block_idx.x
        tag = seq_tag(step_seq(ctrl, layer, layers_per_step))
        region = word_addr(scratch, region_off)
        for i in range(bid * BLOCK + tid, n_words, grid * BLOCK):
            v = fx.generic_load(gptr(src + fx.Int64(i) * fx.Int64(4), fx.Int32, 4))
            mailbox_put(region, i, v, tag)
        nxt = (bid + 1) % grid
        for i in range(nxt * BLOCK + tid, n_words, grid * BLOCK):
            word = wait_tagged(word_addr(region, i), tag, ctrl, health, region_id, i)
            fx.generic_store(gptr(dst + fx.Int64(i) * fx.Int64(4), fx.Int32, 4), fx.Int32(word))

    @flyc.jit
    def launch(
        src: Int64,
        dst: Int64,
        scratch: Int64,
        n_words: Int32,
        region_off: Int32,
        region_id: Int32,
        ctrl: Int64,
        health: Int64,
        layer: Int32,
        layers_per_step: Int32,
        stream: Stream = _NULL_STREAM,
    ):
        mailbox(
            src, dst, scratch, n_words, region_off, region_id, ctrl, health, layer, layers_per_step
        ).launch(grid=(grid, 1, 1), block=(BLOCK, 1, 1), stream=stream)

    return launch


def allreduce_launch(world: int, system: bool, grid: int = GRID):
    """One-shot bf16 all-reduce of ``2 * n_words`` values through a peer region."""
    if world < 1 or world > 8 or world & (world - 1):
        raise ValueError(f"world must be 1, 2, 4 or 8, got {world}")

    @flyc.kernel(known_block_size=[BLOCK, 1, 1])
    def allreduce_k(
        x: Int64,
        out: Int64,
        n_words: Int32,
        peers: Int64,
        region_off: Int64,
        region_id: Int32,
        ctrl: Int64,
        health: Int64,
        layer: Int32,
        layers_per_step: Int32,
    ):
        tid = fx.thread_idx.x
        bid = fx.block_idx.x
        seq = step_seq(ctrl, layer, layers_per_step)
        for w in range(bid * BLOCK + tid, n_words, grid * BLOCK):
            allreduce_word(x, out, w, peers, region_off, n_words, region_id, seq, ctrl, health,
                           world, system)  # fmt: skip

    @flyc.jit
    def launch(
        x: Int64,
        out: Int64,
        n_words: Int32,
        peers: Int64,
        region_off: Int64,
        region_id: Int32,
        ctrl: Int64,
        health: Int64,
        layer: Int32,
        layers_per_step: Int32,
        stream: Stream = _NULL_STREAM,
    ):
        allreduce_k(
            x, out, n_words, peers, region_off, region_id, ctrl, health, layer, layers_per_step
        ).launch(grid=(grid, 1, 1), block=(BLOCK, 1, 1), stream=stream)

    return launch


def _placeholders(kinds: str) -> tuple:
    """Compile-time stand-ins: ``q`` an Int64 address, ``i`` an Int32 scalar."""
    return tuple(fx.Int64(0) if k == "q" else 0 for k in kinds)


def build_mailbox(words: int = 4096, grid: int = GRID) -> Compiled:
    plan_layout(mailbox_program(words))  # refuses a program whose hand-offs could deadlock
    return compile_offline(
        mailbox_launch(grid), _placeholders("qqqiiiqqii"), label=f"mailbox grid{grid}", grid=grid
    )


def build_allreduce(
    world: int, hidden: int = 2048, system: bool = True, grid: int = GRID
) -> Compiled:
    plan_layout(allreduce_program(hidden), world)
    scope = "system" if system else "agent"
    return compile_offline(
        allreduce_launch(world, system, grid),
        _placeholders("qqiqqiqqii"),
        label=f"allreduce tp{world} {scope} grid{grid}",
        grid=grid,
    )
