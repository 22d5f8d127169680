"""How a stream-engine launch deals a plane's weight chunks to its CTAs (host side, plain
Python; the device computes the same numbers by the same formulas, ``stream.py``).

A plane is ``tiles`` tiles of ``chunks_per_tile`` K chunks each, all chunks the same size.
Its chunks are numbered tile by tile, ``c = tile * chunks_per_tile + k_chunk``, and CTA ``p``
of ``ctas`` streams the contiguous range ``[p * C // ctas, (p + 1) * C // ctas)`` of the ``C``
chunks: every CTA streams the same number of bytes to within one chunk, whatever the tile
count, where dealing whole tiles round-robin leaves some CTAs a tile more than others (1.33
rounds of 64-row tiles on 132 CTAs at the 80B attention front).

A tile whose chunks span several CTAs is finished from *parts*: each CTA that streamed some
of its chunks stores its partial product as part ``p - first_cta(tile)``; the last part to
arrive sums them in part order (a fixed order, so the same bits every launch and for every
batch composition) and runs the tile's epilogue. ``max_parts`` sizes the parts' scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChunkDeal"]


@dataclass(frozen=True)
class ChunkDeal:
    """Equal contiguous chunk ranges of a ``tiles x chunks_per_tile`` plane over ``ctas``."""

    tiles: int
    chunks_per_tile: int
    ctas: int

    def __post_init__(self) -> None:
        if self.tiles < 1 or self.chunks_per_tile < 1 or self.ctas < 1:
            raise ValueError(f"ChunkDeal needs positive sizes, got {self}")
        if self.ctas > self.chunks:
            # a CTA with no chunk would hold a part number of a tile and never count it in
            raise ValueError(
                f"ChunkDeal: {self.ctas} CTAs for {self.chunks} chunks; at most one "
                "CTA per chunk"
            )

    @property
    def chunks(self) -> int:
        return self.tiles * self.chunks_per_tile

    def cta_range(self, cta: int) -> tuple[int, int]:
        """The chunks ``[start, end)`` CTA ``cta`` streams (at least one)."""
        c, g = self.chunks, self.ctas
        return cta * c // g, (cta + 1) * c // g

    def owner(self, chunk: int) -> int:
        """The CTA whose range holds ``chunk``: the largest ``p`` with ``p * C // G <= chunk``."""
        c, g = self.chunks, self.ctas
        return ((chunk + 1) * g + c - 1) // c - 1

    def tile_parts(self, tile: int) -> tuple[int, int]:
        """(first CTA, number of parts) of ``tile``: the CTAs owning its first and last chunk
        and every one between them."""
        first = self.owner(tile * self.chunks_per_tile)
        last = self.owner((tile + 1) * self.chunks_per_tile - 1)
        return first, last - first + 1

    @property
    def max_parts(self) -> int:
        return max(self.tile_parts(t)[1] for t in range(self.tiles))

    def bytes_per_cta(self, chunk_bytes: int) -> tuple[int, int]:
        """The fewest and most bytes any CTA streams."""
        sizes = [e - s for s, e in (self.cta_range(p) for p in range(self.ctas))]
        return min(sizes) * chunk_bytes, max(sizes) * chunk_bytes
