"""K1's attention front on the stream engine's deal (``k1_stream``, the Gluon program
``k1_stream_kernel``) against the fp32 reference, on an sm_90 device (elsewhere: skipped; the
offline sm_90a build is ``test_k1_stream.py``'s).

Every case: the 80B-A3B shapes, q, k, v, gate and residual_out at several widths (the first
layer, without a residual, at width 2), outputs poisoned first, on grids that put tiles and
heads in several parts; each row's outputs the same bits whatever else is in the step;
CUDA-graph replay bit-identical to eager; a trace build's outputs bit-equal to the untraced
build's, its stamps in program order.
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")

from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims, text_config  # noqa: E402
from mono_ext.models.qwen3_next.reference import attn_front, rel_l2  # noqa: E402
from mono_ext.models.qwen3_next.spec import Qwen3NextSpec  # noqa: E402
from mono_ext.models.qwen3_next.triton.k1_plan import K1AttnShape  # noqa: E402
from mono_ext.models.qwen3_next.triton.k1_stream import (  # noqa: E402
    K1AttnStreamLaunch,
    StreamConfig,
)

CUDA = torch.cuda.is_available()
SM90 = CUDA and torch.cuda.get_device_capability() == (9, 0)
DEV = torch.device("cuda" if CUDA else "cpu")
NUM = Qwen3NextSpec.NUMERICS
OUT_NAMES = ("q", "k", "v", "gate", "residual_out")
REAL = "qwen3-next-80b-a3b"

pytestmark = pytest.mark.skipif(not SM90, reason="the Gluon program needs an sm_90 device")

# (build, grids): heads of one tile (the default), four and two; chunks of 64 to 256 columns;
# the loader held after one chunk and after none until the rows are normed; a head's parts
# loaded at once, its rotation partners from the next lanes
CASES = [
    (StreamConfig(), (132, 37)),
    (StreamConfig(chunk_rows=64, k_chunk=256), (132, 37)),
    (StreamConfig(chunk_rows=128, k_chunk=128), (37,)),
    (StreamConfig(chunks_before_norm=1), (132, 37)),
    (StreamConfig(chunks_before_norm=0), (37,)),
    (StreamConfig(parts_at_once=True), (132, 37)),
    (StreamConfig(parts_at_once=True, chunk_rows=64, k_chunk=256), (37,)),
]
WIDTHS = list(range(1, 17))


def _cases():
    return [
        pytest.param(
            c,
            id=f"cr{c[0].chunk_rows}bk{c[0].k_chunk}hold{c[0].chunks_before_norm}"
            f"{'parts1' if c[0].parts_at_once else ''}",
        )
        for c in CASES
    ]


def _dims():
    return Dims.from_config(text_config(get_preset(REAL)))


def _launch(config, ctas, trace=False):
    k1 = K1AttnStreamLaunch(K1AttnShape.from_dims(_dims()), ctas, config, max_positions=4096,
                            trace=trace)  # fmt: skip
    k1.build(DEV)
    return k1


def _weights(md, gen):
    h, d = md.hidden, md.head_dim
    rows = (2 * md.hq + 2 * md.hkv) * d

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(torch.bfloat16)

    return {
        "input_layernorm": rnd(h, scale=0.2),
        "qkv_proj": rnd(rows, h, scale=h**-0.5),
        "q_norm": rnd(d, scale=0.2),
        "k_norm": rnd(d, scale=0.2),
    }


def _inputs(md, gen, width, residual=True):
    hid = torch.randn(width, md.hidden, generator=gen, device=DEV).to(torch.bfloat16)
    res = torch.randn(width, md.hidden, generator=gen, device=DEV).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (width,), generator=gen, device=DEV)
    return hid, (res if residual else None), pos


def _outputs(md, width):
    qd, kvd = md.hq * md.head_dim, md.hkv * md.head_dim
    return [torch.full((width, n), float("nan"), dtype=torch.bfloat16, device=DEV)
            for n in (qd, kvd, kvd, qd, md.hidden)]  # fmt: skip


def _run(k1, md, w, hid, res, pos):
    outs = _outputs(md, hid.shape[0])
    k1.launch(hid, res, w, pos, *outs)
    return outs


def _assert_close(name, got, ref, metric):
    got, ref = got.float(), ref.float().reshape(got.shape)
    assert torch.isfinite(got).all(), f"{name}: non-finite values (unwritten or NaN)"
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    rl2 = rel_l2(got, ref)
    assert cos >= NUM[f"k1.{metric}.cosine"], f"{name}: cosine {cos:.6f} (rel_l2 {rl2:.2e})"
    assert rl2 <= NUM[f"k1.{metric}.rel_l2"], f"{name}: rel_l2 {rl2:.2e} (cosine {cos:.6f})"


@pytest.mark.gpu
@pytest.mark.parametrize("case", _cases())
def test_stream_front_matches_the_reference(case):
    config, grids = case
    md = _dims()
    gen = torch.Generator(device=DEV).manual_seed(21)
    w = _weights(md, gen)
    for ctas in grids:
        k1 = _launch(config, ctas)
        for width in WIDTHS:
            hid, res, pos = _inputs(md, gen, width, residual=width != 2)
            q, k, v, gate, r_out = _run(k1, md, w, hid, res, pos)
            ref = attn_front(hid, res, w["input_layernorm"], w, md, pos)
            tag = f"ctas {ctas} w{width}"
            _assert_close(f"{tag} q", q, ref.q, "q")
            _assert_close(f"{tag} k", k, ref.k, "k")
            _assert_close(f"{tag} v", v, ref.v, "v")
            _assert_close(f"{tag} gate", gate, ref.gate, "q")  # a plain projection
            assert rel_l2(r_out.float(), ref.residual_out) <= NUM["k1.residual.rel_l2"]


def _built(case, seed):
    """The case's build on its first grid, its dims, fresh weights and the generator."""
    config, grids = case
    md = _dims()
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return _launch(config, grids[0]), md, _weights(md, gen), gen


@pytest.mark.gpu
@pytest.mark.parametrize("case", _cases())
def test_stream_front_rows_do_not_depend_on_the_step(case):
    k1, md, w, gen = _built(case, 22)
    hid, res, pos = _inputs(md, gen, 16)
    wide = _run(k1, md, w, hid, res, pos)
    for j in (0, 9, 15):
        one = _run(k1, md, w, hid[j : j + 1], res[j : j + 1], pos[j : j + 1])
        for name, a, b in zip(OUT_NAMES, wide, one, strict=True):
            assert torch.equal(a[j : j + 1], b), f"row {j}'s {name} differs alone and in 16"


@pytest.mark.gpu
@pytest.mark.parametrize("case", _cases())
def test_stream_front_graph_replay_is_bit_identical_to_eager(case):
    k1, md, w, gen = _built(case, 23)
    hid, res, pos = _inputs(md, gen, 5)
    eager = _run(k1, md, w, hid, res, pos)
    outs = _run(k1, md, w, hid, res, pos)  # the plane's descriptor made before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        k1.launch(hid, res, w, pos, *outs, validate=False)
    for _ in range(3):
        for t in outs:
            t.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for name, a, b in zip(OUT_NAMES, eager, outs, strict=True):
            assert torch.equal(a, b), f"{name}: replay differs from eager"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [StreamConfig(chunks_before_norm=1), StreamConfig(chunks_before_norm=0),
     StreamConfig(parts_at_once=True), StreamConfig(parts_at_once=True, chunks_before_norm=1)],
    ids=["hold1", "hold0", "parts1", "both"],
)  # fmt: skip
def test_schedule_options_give_the_default_builds_bits(config):
    """``chunks_before_norm`` (the norm in two passes) and ``parts_at_once`` (the parts'
    loads unrolled, rotation partners by lane shuffle) change when things happen, not what
    is added in which order: every output bit-equal to the default build's, widths 1-16."""
    md = _dims()
    gen = torch.Generator(device=DEV).manual_seed(25)
    w = _weights(md, gen)
    base, other = _launch(StreamConfig(), 132), _launch(config, 132)
    for width in WIDTHS:
        hid, res, pos = _inputs(md, gen, width, residual=width != 2)
        want = _run(base, md, w, hid, res, pos)
        got = _run(other, md, w, hid, res, pos)
        for name, a, b in zip(OUT_NAMES, want, got, strict=True):
            assert torch.equal(a, b), f"w{width} {name} differs from the default build's"


@pytest.mark.gpu
def test_trace_build_gives_the_same_bits_and_ordered_stamps():
    """``trace`` (bench_k1.py --stream --trace): the outputs bit-equal to the untraced
    build's, and each CTA's stamps in program order (start, rows normed, first chunk, stream
    done; a head written after its CTA's stream)."""
    md = _dims()
    gen = torch.Generator(device=DEV).manual_seed(24)
    w = _weights(md, gen)
    hid, res, pos = _inputs(md, gen, 3)
    got = {}
    for traced in (False, True):
        k1 = _launch(StreamConfig(), 132, trace=traced)
        k1.stamps.zero_()
        got[traced] = _run(k1, md, w, hid, res, pos)
        torch.cuda.synchronize()
    for name, a, b in zip(OUT_NAMES, got[False], got[True], strict=True):
        assert torch.equal(a, b), f"{name}: the trace build differs"
    stamps = k1.stamps.tolist()
    for cta, row in enumerate(stamps):
        start, normed, first, done, head = row[:5]
        assert 0 < start <= normed <= first <= done, (cta, row[:5])
        assert head == 0 or head >= done, (cta, row[:5])
    # every head is written by one CTA, which may write several
    assert 1 <= sum(1 for row in stamps if row[4]) <= k1.heads
