"""K1's attention front on the stream engine (``k1_stream``), and the chunk deal it runs on.

On any machine: the deal (every chunk streamed by exactly one CTA, equal counts to within
one, each tile's parts where the CTAs' ranges say); the kernel compiled for sm_90a with the
instructions the engine is built on (TMA copies, mbarrier waits, async wgmma, the loader's
register reallocation, the parts' acquire-release count), nothing spilled, its SMEM as
computed; the refusals, by name.

On an sm_90 device, at the 80B-A3B shapes: q, k, v, gate and residual_out against the fp32
reference at widths 1..16 (the first layer, without a residual, at width 2), outputs
poisoned first, on 132 CTAs and on 37 (tiles in other parts), with the parts counted in
after the stream and x^T stored by rows, and with heads of 4 and 2 tiles (chunks of 64 rows
x 256 columns, 128 x 128); each row's outputs the same
bits whatever else is in the step; CUDA-graph replay bit-identical to eager.
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")

from mono_ext.kernels.triton.limits import SHARED_PER_BLOCK  # noqa: E402
from mono_ext.kernels.triton.offline import resources  # noqa: E402
from mono_ext.kernels.triton.stream_schedule import ChunkDeal  # noqa: E402
from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims, text_config  # noqa: E402
from mono_ext.models.qwen3_next.reference import attn_front, rel_l2  # noqa: E402
from mono_ext.models.qwen3_next.spec import Qwen3NextSpec  # noqa: E402
from mono_ext.models.qwen3_next.triton.k1_plan import K1AttnShape  # noqa: E402
from mono_ext.models.qwen3_next.triton.k1_stream import (  # noqa: E402
    K1AttnStreamLaunch,
    StreamConfig,
)

NUM = Qwen3NextSpec.NUMERICS
REAL = K1AttnShape.from_dims(Dims.from_config(text_config(get_preset("qwen3-next-80b-a3b"))))
CONFIGS = [StreamConfig(), StreamConfig(stages=4), StreamConfig(norm_groups=8),
           StreamConfig(defer_counts=True), StreamConfig(x_row_stores=True),
           StreamConfig(chunk_rows=64, k_chunk=256), StreamConfig(chunk_rows=128, k_chunk=128)]  # fmt: skip
OUT_NAMES = ("q", "k", "v", "gate", "residual_out")


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
    try:
        return K1AttnStreamLaunch(REAL, 132, config).compile_offline()
    except RuntimeError as exc:  # no ptxas for sm_90a in this wheel
        pytest.skip(f"cannot compile for sm_90a here: {exc}")


@pytest.mark.parametrize(
    "config",
    CONFIGS,
    ids=lambda c: f"cr{c.chunk_rows}bk{c.k_chunk}ns{c.stages}ng{c.norm_groups}"
    f"{'defer' * c.defer_counts}{'xrow' * c.x_row_stores}",
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
    # x_row_stores: the layout change's scratch, one column group of x^T (fp32 words at most)
    scratch = REAL.hidden // config.norm_groups * 16 * 4 if config.x_row_stores else 0
    assert want <= res.shared <= want + scratch + 1024, (res.shared, want)
    assert res.shared <= SHARED_PER_BLOCK


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
    ],
    ids=["head_dim", "hidden", "smem", "positions", "ctas", "chunk_rows"],
)
def test_stream_front_refuses_what_it_cannot_tile(shape, kwargs, match):
    with pytest.raises(ValueError, match=match):
        K1AttnStreamLaunch(shape, **{"ctas": 132, **kwargs})


# ------------------------------------------------------------------------- on the device

_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not _SM90, reason="needs an sm_90 device")(test))


DEV = torch.device("cuda")
MD = Dims.from_config(text_config(get_preset("qwen3-next-80b-a3b")))


def _weights(gen):
    s = REAL

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(torch.bfloat16)

    return {
        "input_layernorm": rnd(s.hidden, scale=0.2),
        "qkv_proj": rnd(s.qkv_rows, s.hidden, scale=s.hidden**-0.5),
        "q_norm": rnd(s.head_dim, scale=0.2),
        "k_norm": rnd(s.head_dim, scale=0.2),
    }


def _inputs(gen, width, residual=True):
    hid = torch.randn(width, REAL.hidden, generator=gen, device=DEV).to(torch.bfloat16)
    res = torch.randn(width, REAL.hidden, generator=gen, device=DEV).to(torch.bfloat16)
    pos = torch.randint(0, 8192, (width,), generator=gen, device=DEV)
    return hid, (res if residual else None), pos


def _outputs(width):
    qd, kvd = REAL.hq * REAL.head_dim, REAL.hkv * REAL.head_dim
    return [torch.full((width, n), float("nan"), dtype=torch.bfloat16, device=DEV)
            for n in (qd, kvd, kvd, qd, REAL.hidden)]  # fmt: skip


def _run(k1, w, hid, res, pos):
    q, k, v, gate, r_out = _outputs(hid.shape[0])
    k1.launch(hid, res, w, pos, q, k, v, gate, r_out)
    return q, k, v, gate, r_out


def _assert_close(name, got, ref, metric):
    got, ref = got.float(), ref.float().reshape(got.shape)
    assert torch.isfinite(got).all(), f"{name}: non-finite values (unwritten or NaN)"
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    rl2 = rel_l2(got, ref)
    assert cos >= NUM[f"k1.{metric}.cosine"], f"{name}: cosine {cos:.6f} (rel_l2 {rl2:.2e})"
    assert rl2 <= NUM[f"k1.{metric}.rel_l2"], f"{name}: rel_l2 {rl2:.2e} (cosine {cos:.6f})"


@pytest.fixture(
    scope="module",
    params=[
        (132, StreamConfig()),
        (37, StreamConfig()),
        (132, StreamConfig(defer_counts=True, x_row_stores=True)),
        (132, StreamConfig(chunk_rows=64, k_chunk=256)),
        (37, StreamConfig(chunk_rows=128, k_chunk=128, defer_counts=True)),
    ],
    ids=lambda p: f"ctas{p[0]}-cr{p[1].chunk_rows}bk{p[1].k_chunk}"
    f"{'-defer' * p[1].defer_counts}{'-xrow' * p[1].x_row_stores}",
)
def built(request):
    k1 = K1AttnStreamLaunch(REAL, *request.param)
    k1.build(DEV)
    return k1


@gpu
def test_stream_front_matches_the_reference(built):
    gen = torch.Generator(device=DEV).manual_seed(11)
    w = _weights(gen)
    for width in range(1, 17):
        hid, res, pos = _inputs(gen, width, residual=width != 2)
        q, k, v, gate, r_out = _run(built, w, hid, res, pos)
        torch.cuda.synchronize()
        ref = attn_front(hid, res, w["input_layernorm"], w, MD, pos)
        _assert_close(f"w{width} q", q, ref.q, "q")
        _assert_close(f"w{width} k", k, ref.k, "k")
        _assert_close(f"w{width} v", v, ref.v, "v")
        _assert_close(f"w{width} gate", gate, ref.gate, "q")  # a plain projection: q's bounds
        assert rel_l2(r_out.float(), ref.residual_out) <= NUM["k1.residual.rel_l2"]


@gpu
def test_stream_front_rows_do_not_depend_on_the_step(built):
    gen = torch.Generator(device=DEV).manual_seed(12)
    w = _weights(gen)
    hid, res, pos = _inputs(gen, 16)
    wide = _run(built, w, hid, res, pos)
    for j in (0, 7, 15):
        one = _run(built, w, hid[j : j + 1], res[j : j + 1], pos[j : j + 1])
        for name, a, b in zip(OUT_NAMES, wide, one, strict=True):
            assert torch.equal(a[j : j + 1], b), f"row {j}'s {name} differs alone and in 16"


@gpu
def test_stream_front_graph_replay_is_bit_identical_to_eager(built):
    gen = torch.Generator(device=DEV).manual_seed(13)
    w = _weights(gen)
    hid, res, pos = _inputs(gen, 5)
    eager = _run(built, w, hid, res, pos)
    outs = _outputs(5)
    built.launch(hid, res, w, pos, *outs)  # the descriptor cached before capture
    torch.cuda.synchronize()
    for t in outs:
        t.fill_(float("nan"))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        built.launch(hid, res, w, pos, *outs, validate=False)
    for _ in range(3):
        for t in outs:
            t.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for name, a, b in zip(OUT_NAMES, eager, outs, strict=True):
            assert torch.equal(a, b), f"{name}: replay differs from eager"
