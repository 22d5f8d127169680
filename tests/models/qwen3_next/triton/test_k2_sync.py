"""K2's waits over the live rows of a sparse set (``k2_sync.live_places``,
``k2_sync.packed_rows``, ``k2_sync.wait_live_rows``), as the down stage waits for the
activation rows of its run.

``packed_rows`` (with ``live_places``) runs on a CUDA device or under ``TRITON_INTERPRET=1``:
every chunk of the packed live rows against numpy, at densities from none to all. The waits
themselves need a device (the interpreter's waits are plain loads): rows whose words carry the
step's tag are waited for and nothing else, a dead row with a stale tag holds nothing up, and
a live row left stale gives up with a record naming its word.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not torch.cuda.is_available() and not INTERP:
    pytest.skip("needs a CUDA device (or TRITON_INTERPRET=1)", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mono_ext.kernels.triton.primitives import seq_tag, step_seq  # noqa: E402
from mono_ext.models.qwen3_next.triton.k2_sync import (  # noqa: E402
    live_places,
    packed_rows,
    wait_live_rows,
)

DEV = "cpu" if INTERP else "cuda"
N, CH = 64, 8


@triton.jit
def _packed_kernel(live_ptr, row_ptr, words_ptr, out_row_ptr, out_words_ptr,
                   N: tl.constexpr, CH: tl.constexpr):  # fmt: skip
    i = tl.arange(0, N)
    live = tl.load(live_ptr + i) != 0
    row = tl.load(row_ptr + i)
    words = tl.load(words_ptr + i)
    place = live_places(live)
    for first in tl.static_range(0, N, CH):
        r, w = packed_rows(live, place, row, words, first, CH)
        tl.store(out_row_ptr + first + tl.arange(0, CH), r)
        tl.store(out_words_ptr + first + tl.arange(0, CH), w)


@pytest.mark.parametrize("density", [0.0, 0.05, 0.3, 1.0])
def test_packed_rows_lists_the_live_rows_in_order(density):
    gen = np.random.default_rng(int(density * 100) + 7)
    for _ in range(3):
        live = gen.random(N) < density
        row = gen.integers(1, 1 << 20, N).astype(np.int32)
        words = gen.integers(1, 300, N).astype(np.int32)
        out_row = torch.full((N,), -7, dtype=torch.int32, device=DEV)
        out_words = torch.full((N,), -7, dtype=torch.int32, device=DEV)
        _packed_kernel[(1,)](
            torch.tensor(live.astype(np.int32), device=DEV),
            torch.tensor(row, device=DEV),
            torch.tensor(words, device=DEV),
            out_row,
            out_words,
            N=N,
            CH=CH,
        )
        n = int(live.sum())
        got_row, got_words = out_row.cpu().numpy(), out_words.cpu().numpy()
        np.testing.assert_array_equal(got_row[:n], row[live])
        np.testing.assert_array_equal(got_words[:n], words[live])
        # past the live rows: no words to wait for
        assert (got_words[n:] == 0).all()


@triton.jit(do_not_specialize=["layer"])
def _wait_kernel(base_ptr, live_ptr, row_ptr, words_ptr, done_ptr, ctrl_ptr, health_ptr, layer,
                 N: tl.constexpr, W: tl.constexpr, CH: tl.constexpr, WP: tl.constexpr):  # fmt: skip
    tag = seq_tag(step_seq(ctrl_ptr, layer, 1))
    i = tl.arange(0, N)
    live = tl.load(live_ptr + i) != 0
    wait_live_rows(base_ptr, live, tl.load(row_ptr + i), tl.load(words_ptr + i), tag, ctrl_ptr,
                   health_ptr, 3, W, CH, WP, False)  # fmt: skip
    tl.store(done_ptr, 1)


@pytest.mark.gpu
@pytest.mark.skipif(INTERP, reason="the interpreter's waits are plain loads")
def test_wait_live_rows_waits_for_live_rows_only():
    from mono_ext.runtime.health import decode_health
    from mono_ext.runtime.peers import RankState

    rows_total, w, wp = 96, 40, 64
    gen = np.random.default_rng(11)
    state = RankState.create(0, "cuda", deadline_s=0.05)
    state.bump_epoch()
    tag = int(state.ctrl[0].item()) & 0xFFFFFFFF
    live = gen.random(N) < 0.2
    live[:2] = True
    row = gen.permutation(rows_total)[:N].astype(np.int32)
    words = gen.integers(1, w + 1, N).astype(np.int32)
    # live rows' words carry this step's tag; every other word an old one
    base = torch.full((rows_total * w,), (tag - 1) << 32, dtype=torch.int64)
    for r, nw in zip(row[live], words[live], strict=True):
        base[r * w : r * w + nw] = tag << 32
    args = [
        torch.tensor(live.astype(np.int32), device="cuda"),
        torch.tensor(row, device="cuda"),
        torch.tensor(words, device="cuda"),
    ]
    done = torch.zeros(1, dtype=torch.int32, device="cuda")
    base_d = base.cuda()
    _wait_kernel[(1,)](base_d, *args, done, state.ctrl, state.health, 0, N=N, W=w, CH=CH, WP=wp)
    torch.cuda.synchronize()
    health = decode_health(state.health.cpu().tolist(), rank=0)
    assert health.ok and done.item() == 1
    # one live row's last word left stale: the wait gives up and names that word
    stale = int(row[1]) * w + int(words[1]) - 1
    base_d[stale] = (tag - 1) << 32
    _wait_kernel[(1,)](base_d, *args, done, state.ctrl, state.health, 0, N=N, W=w, CH=CH, WP=wp)
    torch.cuda.synchronize()
    health = decode_health(state.health.cpu().tolist(), rank=0)
    assert not health.ok
    rec = health.records[0]
    assert (rec.region, rec.index, rec.wanted_tag, rec.seen_tag) == (3, stale, tag, tag - 1)
