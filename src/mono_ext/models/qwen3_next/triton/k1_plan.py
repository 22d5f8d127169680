"""What a K1 build is made from, before any launch: the per-rank shapes of the GDN and attention
fronts, the grid and tile config, the hand-off programs (checked by
``runtime.layout.check_handoffs`` at build), the row order of the GDN projection planes, the
RoPE table and S1's tiling. ``k1.py`` builds and launches from these; the device program is
``k1_kernel.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mono_ext.kernels.triton.limits import BLOCK_B
from mono_ext.models.qwen3_next.shapes import AttnFrontShape, GdnFrontShape
from mono_ext.runtime.layout import Program, Region, Stage, wait, write

__all__ = [
    "K1AttnShape",
    "K1Config",
    "K1GdnShape",
    "gdn_row_map",
    "k1_attn_program",
    "k1_gdn_program",
    "pow2_divisor",
    "rope_table",
    "s1_units",
    "split_words",
]


@dataclass(frozen=True)
class K1GdnShape(GdnFrontShape):
    """The GDN front's sizes (:class:`~mono_ext.models.qwen3_next.shapes.GdnFrontShape`)
    with the Triton K1's own limits."""

    def refusals(self) -> list[str]:
        bad = super().refusals()
        if self.conv_k != 4:
            bad.append(f"conv kernel {self.conv_k}: K1 is built for 4")
        for name, v in (("Dk", self.dk), ("Dv", self.dv)):
            if v < 16 or v & (v - 1):
                bad.append(f"{name}={v}: K1 tiles power-of-two head dims >= 16")
        if self.dk * self.dv > 128 * 128:
            bad.append(
                f"Dk*Dv={self.dk * self.dv}: the [Dv, Dk] state tile lives in registers; "
                "K1 holds at most 128x128 (larger heads need a Dv-chunked recurrence)"
            )
        if self.hidden % 16:
            bad.append(f"hidden={self.hidden} is not a multiple of 16")
        if self.qkvz_rows % 16:
            bad.append(f"in_proj_qkvz rows {self.qkvz_rows} are not a multiple of 16")
        return bad


@dataclass(frozen=True)
class K1AttnShape(AttnFrontShape):
    """The attention front's sizes (:class:`~mono_ext.models.qwen3_next.shapes.AttnFrontShape`)
    with the Triton K1's own limits."""

    def refusals(self) -> list[str]:
        bad = super().refusals()
        d = self.head_dim
        if d < 16 or d & (d - 1):
            bad.append(f"head_dim={d}: K1 tiles power-of-two head dims >= 16")
        if self.hidden % 16:
            bad.append(f"hidden={self.hidden} is not a multiple of 16")
        if self.qkv_rows % 16:
            bad.append(f"qkv_proj rows {self.qkv_rows} are not a multiple of 16")
        return bad


@dataclass(frozen=True)
class K1Config:
    """Grid and tiles (one build per config; none of it changes per step).

    Every projection is ``acc^T [tile_rows, Bb] = W [tile_rows, k_chunk] @ x^T [k_chunk, Bb]``:
    the weight tile is the MMA's M (wgmma, 64 rows per warpgroup of 4 warps; with 8 warps the
    two warpgroups split the batch columns), the batch rows its N, so no warp re-reads
    another's weights. The defaults are the fastest tested on H200 at the 80B-A3B shapes
    (docs/journal.md, K1, where the knobs go by their earlier names ``bn``, ``bk``, ``ns``,
    ``dvs``): 8 warps (4: 1.7x slower, 16: 8-25% slower), 3 pipeline stages (2 and 4-5 slower).
    Device-side constexprs keep the short names (``BN``, ``BK``, ``CH``, ``NS``, ``PRE``, ...).
    """

    grid: int
    num_warps: int = 8
    tile_rows: int = 64  # projection rows per S1 tile (at most; a power of two dividing the rows)
    k_chunk: int = 256  # K chunk of a tile (at most; a power of two dividing H)
    norm_chunk: int = 512  # H columns per step of the input RMSNorm
    pipeline_stages: int = 3  # software-pipeline stages of the projection loop (copies in flight)
    # L2-prefetch the first pipeline_stages - 1 weight chunks before the input norm
    prefetch_first_chunks: bool = False
    # GDN: the [Dv, Dk] state tile in this many row slices (1 or 2; 2 halves the registers)
    state_row_slices: int = 2
    pdl: bool = False  # programmatic dependent launch (primitives.pdl_prologue)
    # GDN: each (row, head) of the recurrence as this many tasks over blocks of Dv rows (1, 2
    # or 4; more than 1 needs state_row_slices = 1), the gated norm a stage of its own
    # (k1_recurrence): at width 1, 32 x dv_split tasks instead of 32
    dv_split: int = 1
    # per-CTA %globaltimer stamps at the launch's points into ``K1Workspace.trace``
    # (benchmarks/bench_k1.py --trace; never in a deployment, not in the interpreter)
    trace: bool = False
    # steps of more rows than this norm each row once, in one CTA, into a buffer every CTA
    # reads, behind a flag word per row carrying its rsqrt; narrower steps have every CTA norm
    # every row into its own buffer (the same bits). Every CTA reading and writing all 16 rows
    # is L2 traffic of the whole grid before the first weight chunk; a hand-off adds a flag
    # round trip. BLOCK_B (16): never. None: the kind's own (``NORM_ONCE_ABOVE``)
    norm_once_above: int | None = None
    # the rows past the grid's whole rounds of tiles: in full-height tiles split along K,
    # their parts summed by the last unit to arrive, or in whole tiles of fewer rows
    # (``s1_units``)
    split_tail_tiles: bool = True

    def norm_once_rows(self, kind: str) -> int:
        """``norm_once_above`` for a front of ``kind`` ("gdn" or "attn")."""
        return NORM_ONCE_ABOVE[kind] if self.norm_once_above is None else self.norm_once_above


#: each front's ``norm_once_above`` by default. On the H200 the attention front was fastest
#: or level with 4 at every width in two runs, and the GDN front was slower with the hand-off
#: at any threshold (docs/results/k1_norm_once_h200.csv)
NORM_ONCE_ABOVE = {"gdn": BLOCK_B, "attn": 4}


def _split_region(regions: tuple, stages: tuple, words: int) -> tuple[tuple, tuple]:
    """With ``words``: the ``s1_split`` region (the tail tiles' K parts and arrival counters,
    ``s1_units``), written by the projection stage. No stage waits on it: the last unit of a
    tail tile to arrive, counted by an atomic, reads its parts; the others never do."""
    if not words:
        return regions, stages
    s1 = stages[0]
    return (*regions, Region("s1_split", words)), (
        Stage(s1.name, [*s1.ops, write("s1_split")]),
        *stages[1:],
    )


def _norm_once(regions: tuple, stages: tuple, norm_once: bool) -> tuple[tuple, tuple]:
    """With ``norm_once``: the ``nflag`` region (a flag word per row) and the stage that
    writes it first, the projections' stage waiting on it."""
    if not norm_once:
        return regions, stages
    first = stages[0]
    s1 = Stage(first.name, [wait("nflag"), *first.ops])
    return (*regions, Region("nflag", BLOCK_B)), (
        Stage("input_norm_once", [write("nflag")]),
        s1,
        *stages[1:],
    )


def k1_gdn_program(shape: K1GdnShape, dv_split: int = 1, norm_once: bool = False,
                   split: int = 0) -> Program:  # fmt: skip
    """S1 writes the proj region; S2 waits on it (checked at build). Split recurrence
    (``dv_split`` > 1): S2 also writes each block's sum of o^2 (``osq``) and its o (``oraw``,
    read back by the same CTA), and the gated norm, a stage after it, waits on ``osq``.
    ``norm_once`` (``K1Config.norm_once_above``): see :func:`_norm_once`; ``split``: the words
    of the tail tiles' K parts (:func:`split_words`), see :func:`_split_region`."""
    proj = Region("proj", BLOCK_B * shape.payload_words)
    s1 = Stage("in_proj_conv", [write("proj")])
    if dv_split == 1:
        regions: tuple = (proj,)
        stages: tuple = (s1, Stage("recurrence", [wait("proj")]))
    else:
        heads = BLOCK_B * shape.hv
        regions = (proj, Region("osq", heads * dv_split), Region("oraw", heads * shape.dv))
        stages = (
            s1,
            Stage("recurrence", [wait("proj"), write("osq"), write("oraw")]),
            Stage("gated_norm", [wait("osq")]),
        )
    return Program("k1_gdn", *_norm_once(*_split_region(regions, stages, split), norm_once))


def k1_attn_program(shape: K1AttnShape, norm_once: bool = False, split: int = 0) -> Program:
    words = BLOCK_B * (shape.hq + shape.hkv) * shape.head_dim
    regions = (Region("qk", words),)
    stages = (Stage("qkv_proj", [write("qk")]), Stage("norm_rope", [wait("qk")]))
    return Program("k1_attn", *_norm_once(*_split_region(regions, stages, split), norm_once))


def gdn_row_map(shape: K1GdnShape, packing: str) -> list[int]:
    """Payload word of every projection row: ``in_proj_qkvz`` rows, then ``in_proj_ba`` rows.

    Payload per row: conv channels q (head-major), k, v (``[0, C)``), z (``C + h*Dv + j``),
    beta (``C + Hv*Dv + h``), g (``C + Hv*Dv + Hv + h``). "contiguous" is the identity.
    """
    s = shape
    kd, vd, c, r = s.key_dim, s.value_dim, s.conv_dim, s.ratio
    if packing == "contiguous":
        return list(range(s.qkvz_rows + 2 * s.hv))
    if packing != "interleaved":
        raise ValueError(f"packing must be 'interleaved' or 'contiguous', got {packing!r}")
    out: list[int] = []
    rdv = r * s.dv
    for g in range(s.hk):
        out += [g * s.dk + i for i in range(s.dk)]  # q
        out += [kd + g * s.dk + i for i in range(s.dk)]  # k
        out += [2 * kd + g * rdv + i for i in range(rdv)]  # v of value heads g*r .. g*r+r-1
        out += [c + g * rdv + i for i in range(rdv)]  # z
    for g in range(s.hk):
        out += [c + vd + g * r + i for i in range(r)]  # b
        out += [c + vd + s.hv + g * r + i for i in range(r)]  # a
    return out


def rope_table(shape: K1AttnShape, max_positions: int, device: Any = "cpu") -> Any:
    """[max_positions, rotary_dim] fp32: cos then sin halves, built like the reference."""
    import torch

    from mono_ext.models.qwen3_next.reference.attention import rope_cos_sin

    pos = torch.arange(max_positions, device=device)
    cos, sin = rope_cos_sin(pos, shape.rotary_dim, shape.rope_theta)
    return torch.cat([cos, sin], dim=-1).contiguous()


def s1_units(rows: int, grid: int, bn: int, chunks: int,
             split_k: bool = True) -> tuple[int, int, int, int]:  # fmt: skip
    """S1's work units for ``rows`` projection rows over ``grid`` CTAs, in tiles of ``bn`` rows
    x ``chunks`` K chunks: (full tiles, split, tail units, rows per tail unit).

    Whole rounds of the grid of full tiles (every K chunk), then the rest of the rows, at most
    one unit per CTA. ``split_k`` (``K1Config.split_tail_tiles``): in tail tiles of ``bn`` rows,
    each split along K into ``split`` units of ``chunks / split`` chunks, the largest power of
    two dividing ``chunks`` that still fits the grid; every unit then streams chunks of ``bn``
    rows. A CTA keeps a fixed number of chunks in flight, so a chunk of fewer rows streams its
    bytes proportionally slower. A tail tile's parts are summed in part order by the last of
    its units to finish (``k1_units.tail_sum``). Without ``split_k``: in tail tiles of the
    fewest rows (a power of two, 16..bn) that still fit one round, each unit a whole tile (80B-A3B
    GDN, 132 CTAs: 122 tiles of 32 rows, where ``split_k`` gives 61 tiles of 64 rows in halves).
    """
    full = rows // (grid * bn) * grid
    rest = rows - full * bn
    if not split_k:
        hb = bn
        while hb > 16 and -(-rest // (hb // 2)) <= grid:
            hb //= 2
        return full, 1, -(-rest // hb), hb
    tail_tiles = -(-rest // bn)
    split = 1
    while tail_tiles and chunks % (2 * split) == 0 and tail_tiles * 2 * split <= grid:
        split *= 2
    return full, split, tail_tiles * split, bn


def split_words(tail_tiles: int, split: int, bn: int) -> int:
    """Scratch words (int64) of the tail tiles' K parts, fp32 [tiles, split, BLOCK_B, bn], then
    their arrival counters, one int32 per tail tile; none without a split."""
    if split == 1:
        return 0
    return tail_tiles * split * BLOCK_B * bn // 2 + -(-tail_tiles // 2)


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b
