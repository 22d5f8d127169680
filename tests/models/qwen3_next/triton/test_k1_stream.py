"""K1's attention front on the stream engine (``k1_stream``), and the chunk deal it runs on,
on any machine (the fronts against the reference: ``test_k1_stream_fronts.py``).

The deal (every chunk streamed by exactly one CTA, equal counts to within one, each tile's
parts where the CTAs' ranges say); the Gluon kernel compiled for sm_90a with the instructions
the engine is built on (TMA copies, mbarrier waits, async wgmma, the loader's register
reallocation, the parts' acquire-release count), nothing spilled, its SMEM as computed; the
refusals, by name."""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")

from mono_ext.kernels.triton.limits import BLOCK_B, SHARED_PER_BLOCK  # noqa: E402
from mono_ext.kernels.triton.offline import resources  # noqa: E402
from mono_ext.kernels.triton.stream_schedule import ChunkDeal  # noqa: E402
from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims, text_config  # noqa: E402
from mono_ext.models.qwen3_next.triton.k1_plan import K1AttnShape  # noqa: E402
from mono_ext.models.qwen3_next.triton.k1_stream import (  # noqa: E402
    K1AttnStreamLaunch,
    StreamConfig,
)

REAL = K1AttnShape.from_dims(Dims.from_config(text_config(get_preset("qwen3-next-80b-a3b"))))
CONFIGS = [StreamConfig(), StreamConfig(stages=4), StreamConfig(norm_groups=2),
           StreamConfig(chunk_rows=64, k_chunk=256), StreamConfig(chunk_rows=128, k_chunk=128),
           StreamConfig(chunks_before_norm=1), StreamConfig(parts_at_once=True),
           StreamConfig(parts_at_once=True, chunk_rows=64, k_chunk=256)]  # fmt: skip


# ------------------------------------------------------------------------- the chunk deal


@pytest.mark.parametrize("tiles,per_tile,ctas", [(36, 32, 132), (36, 32, 37), (5, 3, 7),
                                                 (2, 2, 4), (1, 1, 1), (9, 16, 132)])  # fmt: skip
def test_deal_streams_every_chunk_once_in_equal_ranges(tiles, per_tile, ctas):
    deal = ChunkDeal(tiles, per_tile, ctas)
    ranges = [deal.cta_range(p) for p in range(ctas)]
    owners = [p for p, (s, e) in enumerate(ranges) for _ in range(s, e)]
    assert owners == sorted(owners) and len(owners) == deal.chunks  # contiguous, in CTA order
    sizes = [e - s for s, e in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    for c in range(deal.chunks):
        assert deal.owner(c) == owners[c], c
    for t in range(tiles):
        holders = sorted({owners[c] for c in range(t * per_tile, (t + 1) * per_tile)})
        first, n = deal.tile_parts(t)
        assert holders == list(range(first, first + n)), t
    assert deal.max_parts == max(deal.tile_parts(t)[1] for t in range(tiles))


def test_deal_at_the_80b_attention_front():
    deal = ChunkDeal(36, 32, 132)  # 16 q + 16 gate + 2 k + 2 v heads, K = 2048 in 64 columns
    assert deal.bytes_per_cta(256 * 64 * 2) == (8 * 32768, 9 * 32768)
    assert deal.max_parts == 5


def test_deal_refuses_empty_sizes_and_ctas_without_a_chunk():
    with pytest.raises(ValueError, match="positive"):
        ChunkDeal(0, 4, 8)
    with pytest.raises(ValueError, match="9 CTAs for 4 chunks"):
        ChunkDeal(2, 2, 9)


# ------------------------------------------------------------------------- offline build


def _compiled(config):
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.skip("offline sm_90a compiles need the compiler, not the interpreter")
    try:
        return K1AttnStreamLaunch(REAL, 132, config).compile_offline()
    except RuntimeError as exc:  # no ptxas for sm_90a in this wheel
        pytest.skip(f"cannot compile for sm_90a here: {exc}")


@pytest.mark.parametrize(
    "config",
    CONFIGS,
    ids=lambda c: f"cr{c.chunk_rows}bk{c.k_chunk}ns{c.stages}ng{c.norm_groups}"
    f"hold{c.chunks_before_norm}{'parts1' if c.parts_at_once else ''}",
)
def test_stream_front_compiles_for_sm90a_with_the_engine_instructions(config):
    kernel = _compiled(config)
    ptx = kernel.asm["ptx"]
    # the loader's TMA copies: one per 64 columns of a chunk (a 128-byte swizzled row)
    assert ptx.count("cp.async.bulk.tensor") == config.k_chunk // 64
    assert "mbarrier.try_wait" in ptx and "mbarrier.arrive" in ptx
    assert "wgmma.mma_async" in ptx and "wgmma.wait_group" in ptx
    assert "setmaxnreg.dec" in ptx  # the loader warp hands its registers to the consumer
    assert "atom.global.gpu.acq_rel.add" in ptx and "fence.acq_rel.gpu" in ptx  # count_in
    res = resources(kernel)
    assert res.stack == 0 and res.spill_stores == res.spill_loads == 0
    want = K1AttnStreamLaunch(REAL, 132, config).smem_bytes()
    # the norm's layout change takes scratch: one column group of x^T (fp32 words at most)
    scratch = REAL.hidden // config.norm_groups * 16 * 4
    assert want <= res.shared <= want + scratch + 1024, (res.shared, want)
    assert res.shared <= SHARED_PER_BLOCK


def test_a_held_loader_waits_once_on_the_rows_and_the_consumer_releases_it():
    """``chunks_before_norm``: the loader's one wait on the gate and the consumer's one
    arrival on it are the build's only additions to the default's barrier traffic."""
    base, held = (_compiled(StreamConfig(chunks_before_norm=h)).asm["ptx"] for h in (None, 1))
    for op in ("mbarrier.try_wait", "mbarrier.arrive"):
        assert held.count(op) > base.count(op), op
    assert held.count("mbarrier.init") == base.count("mbarrier.init") + 1


@pytest.mark.parametrize("rows", [None, 64], ids=["cr256", "cr64"])
def test_parts_at_once_loads_every_part_slot_and_shuffles_the_partners(rows):
    """``parts_at_once``: the head's sum is one static loop over the deal's ``max_parts``
    slots for each of its tiles (masked past its parts), one load of a part's words per row
    of the block per thread, and no second sum for a q/k head's rotation partners, which
    come from a lane shuffle instead."""
    k_chunk = 256 if rows else 64
    cfgs = {u: StreamConfig(parts_at_once=u, chunk_rows=rows, k_chunk=k_chunk) for u in (0, 1)}
    ptx = {u: _compiled(c).asm["ptx"] for u, c in cfgs.items()}
    launch = K1AttnStreamLaunch(REAL, 132, cfgs[1])
    tph = REAL.head_dim // launch.chunk_rows
    assert ptx[1].count("ld.global.cg") == BLOCK_B * tph * launch.deal.max_parts
    assert ptx[1].count("shfl.sync.bfly.b32") > ptx[0].count("shfl.sync.bfly.b32")


def _shape(**over):
    base = dict(hidden=2048, hq=4, hkv=2, head_dim=128, rotary_dim=32, rope_theta=1e4, eps=1e-6)
    return K1AttnShape(**{**base, **over})


@pytest.mark.parametrize(
    "shape,kwargs,match",
    [
        (_shape(head_dim=96), {}, "head_dim=96"),
        (_shape(hidden=2000), {}, "hidden=2000"),
        (REAL, {"config": StreamConfig(stages=6)}, "SMEM"),
        (REAL, {"positions_dtype": "int16"}, "positions_dtype"),
        (_shape(hq=1, hkv=1, hidden=256), {"ctas": 132}, "132 CTAs for 16 chunks"),
        (REAL, {"config": StreamConfig(chunk_rows=32)}, "chunk_rows=32"),
        (REAL, {"config": StreamConfig(chunks_before_norm=4)}, "chunks_before_norm=4"),
        (REAL, {"config": StreamConfig(chunks_before_norm=-1)}, "chunks_before_norm=-1"),
    ],
    ids=["head_dim", "hidden", "smem", "positions", "ctas", "chunk_rows", "hold", "hold_neg"],
)
def test_stream_front_refuses_what_it_cannot_tile(shape, kwargs, match):
    with pytest.raises(ValueError, match=match):
        K1AttnStreamLaunch(shape, **{"ctas": 132, **kwargs})
