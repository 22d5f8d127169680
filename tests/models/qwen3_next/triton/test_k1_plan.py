"""K1's S1 schedule (``k1_plan.s1_units``, ``split_words``): pure Python, no device.

Every projection row is in exactly one tile, every (tail tile, K chunk) in exactly one unit,
at most one unit per CTA beyond the full rounds, and every unit's chunks are whole tiles of
``bn`` rows (the point of the split: no CTA streams chunks of fewer bytes).
"""

import pytest

from mono_ext.kernels.triton.limits import BLOCK_B
from mono_ext.models.qwen3_next.triton.k1_plan import s1_units, split_words


def _units(rows, grid, bn, chunks, split_k):
    """Each CTA's (first row, rows, first chunk, chunks) units, as the kernel walks them."""
    full, split, n_tail, tail_rows = s1_units(rows, grid, bn, chunks, split_k)
    per_cta = {p: [] for p in range(grid)}
    for t in range(full):
        per_cta[t % grid].append((t * bn, bn, 0, chunks))
    for u in range(n_tail):
        per_cta[u].append((full * bn + (u // split) * tail_rows, tail_rows,
                           (u % split) * (chunks // split), chunks // split))  # fmt: skip
    return per_cta


@pytest.mark.parametrize("split_k", [True, False])
@pytest.mark.parametrize(
    "rows,grid,bn,chunks",
    [
        (12352, 132, 64, 8),  # 80B-A3B GDN (in_proj_ba padded to a tile, then in_proj_qkvz)
        (9216, 132, 64, 8),  # 80B-A3B attention
        (6208, 132, 64, 8),  # GDN at TP 2: no full round
        (704, 5, 64, 4),  # the tiny preset in the interpreter, k_chunk 16
        (960, 7, 64, 1),  # one chunk per row: nothing to split
        (8448, 132, 64, 8),  # whole rounds only: no tail
    ],
)
def test_every_row_and_chunk_in_exactly_one_unit(rows, grid, bn, chunks, split_k):
    full, split, n_tail, tail_rows = s1_units(rows, grid, bn, chunks, split_k)
    assert full % grid == 0 and n_tail <= grid and n_tail % split == 0
    assert chunks % split == 0 and split & (split - 1) == 0
    # split along K: full-height tiles; else: one whole tile per unit, of fewer rows
    assert tail_rows == bn if split_k else (split == 1 and 16 <= tail_rows <= bn)
    seen = {}
    for cta, units in _units(rows, grid, bn, chunks, split_k).items():
        assert len(units) == full // grid + (cta < n_tail)
        for r0, nr, c0, n in units:
            for r in range(r0, min(r0 + nr, rows)):
                for c in range(c0, c0 + n):
                    seen[(r, c)] = seen.get((r, c), 0) + 1
    assert len(seen) == rows * chunks and set(seen.values()) == {1}


def test_the_split_is_the_largest_that_keeps_one_unit_per_cta():
    # 61 tail tiles on 132 CTAs: two halves each (122 units), four would need 244
    assert s1_units(12352, 132, 64, 8) == (132, 2, 122, 64)
    # 12 tail tiles: every chunk its own unit (96), bounded by the 8 chunks
    assert s1_units(9216, 132, 64, 8) == (132, 8, 96, 64)
    assert s1_units(8448, 132, 64, 8) == (132, 1, 0, 64)
    assert s1_units(960, 7, 64, 1)[1] == 1


def test_without_the_split_the_tail_tiles_shrink_to_fit_one_round():
    # 3904 rows: 122 tiles of 32 (61 of 64 would leave 71 CTAs without a tail tile)
    assert s1_units(12352, 132, 64, 8, split_k=False) == (132, 1, 122, 32)
    # 768 rows: 48 tiles of 16 rows, the smallest tile
    assert s1_units(9216, 132, 64, 8, split_k=False) == (132, 1, 48, 16)


def test_split_words_cover_the_parts_and_the_counters():
    assert split_words(61, 1, 64) == 0
    parts = 61 * 2 * BLOCK_B * 64  # fp32
    assert split_words(61, 2, 64) * 2 == parts + 62  # + 61 int32 counters, rounded to words
    assert split_words(12, 8, 32) == 12 * 8 * BLOCK_B * 32 // 2 + 6
