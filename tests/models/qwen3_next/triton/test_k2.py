"""K2 (layer tail, one persistent launch) against the fp32 reference on the H200.

Real Qwen3-Next-80B-A3B tail shapes (H 2048, GDN out_proj input 4096, 512 experts top-10,
I 512, shared 512), sharded for TP 1, 2 and 8 (virtual TP: R launches on R streams of one
GPU). Every check draws fresh random inputs, poisons the outputs with NaN, and compares
with ``mono_ext.models.qwen3_next.reference.layer_tail`` through ``CheckTracker`` (rows whose router top-k is
a near tie are skipped and counted). Also: batch invariance (a row's output is bit-identical
alone, in any batch and any position), graph replay bit-identical to eager over 200
replays, no wait gave up, and no compile after warm-up.
"""

import os

import pytest

# virtual TP needs a hardware queue per rank stream; read when CUDA starts
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


from mono_ext.core.numerics import CheckTracker, metrics  # noqa: E402
from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402
from mono_ext.models.qwen3_next.reference.convert import (  # noqa: E402
    dequantized_weights,
    quantized_weights,
)
from mono_ext.models.qwen3_next.reference.tail import layer_tail  # noqa: E402
from mono_ext.models.qwen3_next.spec import Qwen3NextSpec  # noqa: E402
from mono_ext.models.qwen3_next.triton.k2 import (  # noqa: E402
    BLOCK_B,
    K2Config,
    K2Launch,
    K2Shape,
    k2_kernel,
    shard_tail_weights,
)
from mono_ext.runtime.build_cache import jit_cache_size  # noqa: E402
from mono_ext.runtime.health import decode_health  # noqa: E402
from mono_ext.runtime.peers import VirtualPeers  # noqa: E402
from tests.models.qwen3_next.triton.a8_check import check_a8_hidden  # noqa: E402
from tests.models.qwen3_next.triton.tail_weights import random_tail_weights  # noqa: E402

pytestmark = pytest.mark.gpu
DEADLINE_S = float(os.environ.get("MONO_EXT_DEADLINE_S", "2"))
POISON = float("nan")
PRESET = "qwen3-next-80b-a3b"
GRIDS = {1: 132, 2: 64, 8: 16}  # all ranks' CTAs resident together on 132 SMs


def make_weights(dims: Dims, seed: int) -> dict:
    """Full (TP1) tail planes, bf16, scaled so activations and logits are O(1)."""
    return random_tail_weights(dims, torch.Generator(device="cuda").manual_seed(seed))


class Tail:
    """K2 for ``tp`` virtual ranks (tp == 1: one launch on the current stream)."""

    def __init__(self, full: dict, tp: int, formats: dict | None = None, **config):
        self.dims = Dims.from_config(get_preset(PRESET), tp=tp)
        self.tp = tp
        self.k2 = K2Launch(K2Shape.from_dims(self.dims), K2Config(grid=GRIDS[tp], **config),
                           co_resident=tp, formats=formats or {})  # fmt: skip
        self.k2.build("cuda")
        self.peers = VirtualPeers(tp, max(self.k2.peer_words, 16), "cuda", DEADLINE_S)
        self.ws = [self.k2.workspace("cuda") for _ in range(tp)]
        self.w = [shard_tail_weights(full, tp, r, formats) for r in range(tp)]
        h, k_in = self.dims.hidden, self.dims.hv_r * self.dims.dv
        # static per-rank buffers (graph-safe): o_in shards, residual, outputs
        self.o = torch.empty(tp, BLOCK_B, k_in, dtype=torch.bfloat16, device="cuda")
        self.res = torch.empty(BLOCK_B, h, dtype=torch.bfloat16, device="cuda")
        self.out_h = torch.empty(tp, BLOCK_B, h, dtype=torch.bfloat16, device="cuda")
        self.out_r = torch.empty(tp, BLOCK_B, h, dtype=torch.bfloat16, device="cuda")

    def set_inputs(self, o_in: torch.Tensor, res: torch.Tensor) -> None:
        b, k_in = o_in.shape[0], self.o.shape[-1]
        for r in range(self.tp):
            self.o[r, :b].copy_(o_in[:, r * k_in : (r + 1) * k_in])
        self.res[:b].copy_(res)
        self.out_h.fill_(POISON)
        self.out_r.fill_(POISON)

    def step(self, b: int) -> None:
        """Bump every rank's epoch, launch every rank (forked streams, joined back)."""

        def one(r: int) -> None:
            st = self.peers.ranks[r]
            st.bump_epoch()
            self.k2.launch(
                self.o[r, :b],
                self.res[:b],
                self.w[r],
                self.out_h[r, :b],
                self.out_r[r, :b],
                ws=self.ws[r],
                ctrl=st.ctrl,
                health=st.health,
                peers=self.peers.table if self.tp > 1 else None,
            )

        self.peers.run(one)

    def healthy(self) -> None:
        for st in self.peers.ranks:
            h = decode_health(st.health.cpu().tolist(), rank=st.rank)
            assert h.ok, h.describe(self.k2.layout.describe)


@pytest.fixture(scope="module")
def full_weights():
    dims = Dims.from_config(get_preset(PRESET), tp=1)
    return make_weights(dims, seed=1234)


@pytest.fixture(scope="module")
def tails(full_weights):
    made: dict[int, Tail] = {}

    def get(tp: int) -> Tail:
        if tp not in made:
            made[tp] = Tail(full_weights, tp)
        return made[tp]

    yield get
    for t in made.values():
        torch.cuda.synchronize()
        t.peers.close()


def fresh_inputs(dims: Dims, b: int, gen: torch.Generator):
    k_in = dims.hv * dims.dv
    o_in = torch.randn(b, k_in, generator=gen, device="cuda").to(torch.bfloat16)
    res = torch.randn(b, dims.hidden, generator=gen, device="cuda").to(torch.bfloat16)
    return o_in, res


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_k2_matches_reference_every_width(tails, full_weights, tp):
    check_every_width(tails(tp), full_weights, tp, seed=100 + tp)


FP8 = {
    fmt: dict.fromkeys(("out_proj", "w13", "w2", "shared_gate_up", "shared_down"), fmt)
    for fmt in ("fp8_block128", "fp8_channel")
}


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("tp", [1, 2])  # TP 8 cuts I = 512 below one 128-row block
def test_k2_fp8_planes_match_reference_every_width(full_weights, fmt, tp):
    """fp8 e4m3fn planes with their fp32 scales, read in place, against the
    reference on the dequantized planes, at the real shapes."""
    kern = quantized_weights(full_weights, FP8[fmt])
    deq = dequantized_weights(kern, FP8[fmt])
    t = Tail(kern, tp, formats=FP8[fmt])
    try:
        check_every_width(t, deq, tp, seed=200 + tp)
    finally:
        torch.cuda.synchronize()
        t.peers.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_k2_fp8_activations_match_the_quantizing_reference_every_width(full_weights, tp):
    """``fp8_activations`` on fp8 block-128 planes at the real shapes: e4m3 activations per row
    and 128 columns, as vLLM's own fp8 MoE quantizes them. At every width the residual meets
    NUMERICS and the hidden output follows the reference that quantizes the same activations
    (``a8_check``); every rank writes the same bits."""
    fmts = FP8["fp8_block128"]
    kern = quantized_weights(full_weights, fmts)
    t = Tail(kern, tp, formats=fmts, fp8_activations=True)
    assert t.k2.a8_planes == {"w13", "w2", "shared_gate_up", "shared_down"}
    try:
        check_every_width(t, dequantized_weights(kern, fmts), tp, seed=300 + tp)
    finally:
        torch.cuda.synchronize()
        t.peers.close()


def check_every_width(t: Tail, ref_weights: dict, tp: int, seed: int) -> None:
    """``t`` at widths 1-16 against the reference (with the planes whose activations the
    build quantizes, ``a8_planes``, quantized there too)."""
    full_dims = Dims.from_config(get_preset(PRESET), tp=1)
    a8_planes = t.k2.a8_planes
    tracker = CheckTracker(Qwen3NextSpec.NUMERICS)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    worst = {}
    for b in range(1, BLOCK_B + 1):
        o_in, res = fresh_inputs(full_dims, b, gen)
        t.set_inputs(o_in, res)
        t.step(b)
        torch.cuda.synchronize()
        t.healthy()
        ref = layer_tail(o_in, res, ref_weights, full_dims, a8_planes=a8_planes)
        for r in range(tp):
            oh, orr = t.out_h[r, :b], t.out_r[r, :b]
            assert not torch.isnan(oh).any() and not torch.isnan(orr).any(), "unwritten output"
            if r:
                assert torch.equal(oh, t.out_h[0, :b]) and torch.equal(orr, t.out_r[0, :b])
        tracker.check("k2", "residual", t.out_r[0, :b], ref.residual_out, where=f"w{b}")
        if a8_planes:
            exact = layer_tail(o_in, res, ref_weights, full_dims)
            d = check_a8_hidden(t.out_h[0, :b], ref, exact, where=f"TP{tp} w{b}")
            if d is not None:
                worst[b] = d
            continue
        tracker.check(
            "k2", "hidden", t.out_h[0, :b], ref.hidden_out, skip_rows=ref.near_tie, where=f"w{b}"
        )
        keep = ~ref.near_tie
        if keep.any():
            m = metrics(t.out_h[0, :b][keep], ref.hidden_out[keep])
            mr = metrics(t.out_r[0, :b], ref.residual_out)
            worst[b] = (m["cosine"], m["rel_l2"], mr["rel_l2"])
    print(
        f"\nTP{tp} width: "
        + (
            "hidden rel_l2 to the quantizing reference, to the exact one, the quantizing one's own"
            if a8_planes
            else "(hidden cosine, hidden rel_l2, residual rel_l2)"
        )
    )
    for b, v in worst.items():
        print(f"  {b:2d}: {v[0]:.6f} {v[1]:.2e} {v[2]:.2e}")
    print(f"TP{tp}: {tracker.summary()}")
    assert not tracker.problems(), tracker.problems()


def test_k2_batch_invariance(tails, full_weights):
    check_batch_invariance(tails(1))


def check_batch_invariance(t: Tail) -> None:
    dims = Dims.from_config(get_preset(PRESET), tp=1)
    gen = torch.Generator(device="cuda").manual_seed(7)
    o_all, r_all = fresh_inputs(dims, BLOCK_B, gen)

    def run(idx):
        t.set_inputs(o_all[idx], r_all[idx])
        t.step(len(idx))
        torch.cuda.synchronize()
        return t.out_h[0, : len(idx)].clone(), t.out_r[0, : len(idx)].clone()

    h16, r16 = run(list(range(BLOCK_B)))
    for i in (0, 5, 15):
        h1, r1 = run([i])
        assert torch.equal(h1[0], h16[i]) and torch.equal(r1[0], r16[i]), f"row {i} alone"
    perm = [11, 3, 0, 7, 15]
    hp, rp = run(perm)
    for j, i in enumerate(perm):
        assert torch.equal(hp[j], h16[i]) and torch.equal(rp[j], r16[i]), f"row {i} at {j}"
    t.healthy()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_k2_non_finite_row_neither_hangs_nor_leaks(tails, bad):
    """A row that is not finite (vLLM's attention gives NaN for a CUDA-graph padding row that
    has no keys) routes like any other row, keeps its NaN/inf to itself, and every wait of
    the launch completes: the other rows are bit-equal to a run without it."""
    t = tails(1)
    dims = Dims.from_config(get_preset(PRESET), tp=1)
    gen = torch.Generator(device="cuda").manual_seed(11)
    o_all, r_all = fresh_inputs(dims, 4, gen)

    def run(o, r):
        t.set_inputs(o, r)
        t.step(o.shape[0])
        torch.cuda.synchronize()
        t.healthy()
        return t.out_h[0, : o.shape[0]].clone(), t.out_r[0, : o.shape[0]].clone()

    h_ok, r_ok = run(o_all[:3], r_all[:3])
    o_bad = o_all.clone()
    o_bad[3] = bad
    h, r = run(o_bad, r_all)
    assert torch.equal(h[:3], h_ok) and torch.equal(r[:3], r_ok)
    assert not torch.isfinite(h[3]).all()


@pytest.mark.parametrize("tp", [1, 2])
def test_k2_graph_replay_matches_eager(tails, tp):
    t = tails(tp)
    dims = Dims.from_config(get_preset(PRESET), tp=1)
    b = 4
    gen = torch.Generator(device="cuda").manual_seed(11)
    o_in, res = fresh_inputs(dims, b, gen)
    t.set_inputs(o_in, res)
    t.step(b)  # warm: compiled and loaded before capture
    torch.cuda.synchronize()
    compiled = jit_cache_size(k2_kernel)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        t.step(b)
    t.peers.register_graph(graph)
    for i in range(200):
        o_in, res = fresh_inputs(dims, b, gen)
        t.set_inputs(o_in, res)
        graph.replay()
        if i % 10 == 0:
            torch.cuda.synchronize()
            g_h, g_r = t.out_h.clone(), t.out_r.clone()
            assert not torch.isnan(g_h[:, :b]).any() and not torch.isnan(g_r[:, :b]).any()
            t.out_h.fill_(POISON)
            t.out_r.fill_(POISON)
            t.step(b)
            torch.cuda.synchronize()
            assert torch.equal(g_h[:, :b], t.out_h[:, :b]) and torch.equal(
                g_r[:, :b], t.out_r[:, :b]
            )
    torch.cuda.synchronize()
    t.healthy()
    assert jit_cache_size(k2_kernel) == compiled, "a launch compiled after warm-up"
    del graph


def test_k2_program_declares_every_handoff():
    from mono_ext.runtime.layout import check_handoffs

    for tp in (1, 2, 8):
        k2 = K2Launch(K2Shape.from_dims(Dims.from_config(get_preset(PRESET), tp=tp)),
                      K2Config(grid=GRIDS[tp]))  # fmt: skip
        check_handoffs(k2.layout.program)
        assert k2.layout.scratch_words > 0
        assert (k2.layout.peer_words > 0) == (tp > 1)


def test_k2_refuses_misaligned_and_wrong_shapes(tails):
    t = tails(1)
    k_in = t.o.shape[-1]
    misaligned = t.o[0, :2].flatten()[1 : 1 + k_in].view(1, k_in)  # 2-byte offset
    with pytest.raises(ValueError, match="16-byte aligned"):
        t.k2.check(misaligned, t.res[:1], t.w[0], t.out_h[0, :1], t.out_r[0, :1])
    with pytest.raises(ValueError, match="expected"):
        t.k2.check(t.o[0, :2, :-8], t.res[:2], t.w[0], t.out_h[0, :2], t.out_r[0, :2])
