"""K2 at the tiny test presets' shapes against the fp32 reference: on a CUDA device the real
persistent launch; without one, ``TRITON_INTERPRET=1`` (with Triton installed) runs the same
kernel through Triton's CPU interpreter one stage per launch, so K2's routing, pair and
reduce logic is checked on machines without a GPU. Otherwise the module skips.

Presets cover the shape cases the 80B test (tests/kernels/test_k2.py) cannot: hidden and
intermediate sizes that are not powers of two, fewer experts than a 16-row step picks
(every slot in the union), top-k 2 and 3, with and without renormalised weights, the
shared expert wider and narrower than a routed one. Fresh random inputs each check,
outputs poisoned (NaN) before each run, never zeros as data.
"""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not torch.cuda.is_available() and not INTERP:
    pytest.skip("needs a CUDA device (or TRITON_INTERPRET=1)", allow_module_level=True)


from mono_ext.core.numerics import CheckTracker  # noqa: E402
from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims, text_config  # noqa: E402
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
    shard_tail_weights,
)
from mono_ext.runtime.health import decode_health  # noqa: E402
from mono_ext.runtime.peers import RankState  # noqa: E402
from tests.models.qwen3_next.triton.a8_check import check_a8_hidden  # noqa: E402
from tests.models.qwen3_next.triton.tail_weights import random_tail_weights  # noqa: E402

DEV = "cpu" if INTERP else "cuda"
PRESETS = ["qwen3-next-tiny", "qwen3-next-tiny-b", "qwen3.5-moe-tiny"]
WIDTHS = [1, 3, 16] if INTERP else list(range(1, BLOCK_B + 1))
GRID = 8  # more CTAs than some stages have tasks: idle CTAs must not break a hand-off


#: A tiny config whose K2 planes are whole 128 x 128 blocks (fp8 block-128 checkpoints are)
FP8_CONFIG = {
    **get_preset("qwen3-next-tiny"),
    "hidden_size": 256,
    "linear_value_head_dim": 64,  # out_proj K = 4 heads x 64
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
}
K2_PLANES = ("out_proj", "w13", "w2", "shared_gate_up", "shared_down")
FP8_CASES = {
    "block128": dict.fromkeys(K2_PLANES, "fp8_block128"),
    "channel": dict.fromkeys(K2_PLANES, "fp8_channel"),
    # formats differ per plane, the shared expert's from the routed ones' too (one loop
    # streams both: two loads, the other's masked off)
    "mixed": {
        "out_proj": "fp8_tensor",
        "w13": "fp8_block128",
        "shared_gate_up": "fp8_channel",
        "w2": "fp8_channel",
        "shared_down": "fp8_block128",
    },
    # fp8 routed experts beside a bf16 shared expert and out_proj
    "routed_only": {"w13": "fp8_block128", "w2": "fp8_block128"},
    # the engines keep the router and shared_expert_gate bf16; a checkpoint may not
    "gates": {"router": "fp8_channel", "shared_expert_gate": "fp8_block128"},
}


class TinyTail:
    """One TP1 K2 build for a preset (or config), its weights (random, O(1) activations) and
    buffers. ``formats``: planes given to K2 in fp8 (codes + scales); the reference then
    computes with the dequantized planes (``self.w_ref``)."""

    def __init__(
        self, preset: str | dict, seed: int, formats: dict | None = None, **config: int
    ):  # fmt: skip
        full = get_preset(preset) if isinstance(preset, str) else preset
        cfg = text_config(full)
        self.dims = Dims.from_config(cfg, tp=1)
        self.k2 = K2Launch(K2Shape.from_dims(self.dims), K2Config(grid=GRID, **config),
                           formats=formats or {})  # fmt: skip
        self.k2.build(DEV)
        self.ws = self.k2.workspace(DEV)
        self.state = RankState.create(0, torch.device(DEV), 2.0)
        self.w = random_tail_weights(self.dims, torch.Generator(device=DEV).manual_seed(seed))
        self.w = quantized_weights(self.w, formats or {})
        self.w_ref = dequantized_weights(self.w, formats or {})
        self.k_in = self.dims.hv * self.dims.dv

    def inputs(self, b: int, gen: torch.Generator):
        o = torch.randn(b, self.k_in, generator=gen, device=DEV).to(torch.bfloat16)
        res = torch.randn(b, self.dims.hidden, generator=gen, device=DEV).to(torch.bfloat16)
        return o, res

    def run(self, o_in, res):
        b, h = o_in.shape[0], self.dims.hidden
        out_h = torch.full((b, h), float("nan"), dtype=torch.bfloat16, device=DEV)
        out_r = torch.full((b, h), float("nan"), dtype=torch.bfloat16, device=DEV)
        self.state.bump_epoch()
        self.k2.launch(o_in, res, self.w, out_h, out_r, ws=self.ws, ctrl=self.state.ctrl,
                       health=self.state.health)  # fmt: skip
        if DEV == "cuda":
            torch.cuda.synchronize()
        health = decode_health(self.state.health.cpu().tolist(), rank=0)
        assert health.ok, health.describe(self.k2.layout.describe)
        return out_h, out_r


@pytest.fixture(scope="module", params=PRESETS)
def tiny(request):
    return TinyTail(request.param, seed=5)


def test_k2_tiny_matches_reference(tiny):
    """At every width, against the reference (with the planes whose activations the build
    quantizes to e4m3 quantized there too): NUMERICS, or for such a build the hidden output
    as ``a8_check`` judges it."""
    tracker = CheckTracker(Qwen3NextSpec.NUMERICS)
    gen = torch.Generator(device=DEV).manual_seed(21)
    a8_planes = tiny.k2.a8_planes
    for b in WIDTHS:
        o_in, res = tiny.inputs(b, gen)
        out_h, out_r = tiny.run(o_in, res)
        assert not torch.isnan(out_h).any() and not torch.isnan(out_r).any(), "unwritten output"
        ref = layer_tail(o_in, res, tiny.w_ref, tiny.dims, a8_planes=a8_planes)
        tracker.check("k2", "residual", out_r, ref.residual_out, where=f"w{b}")
        if not a8_planes:
            tracker.check(
                "k2", "hidden", out_h, ref.hidden_out, skip_rows=ref.near_tie, where=f"w{b}"
            )
            continue
        d = check_a8_hidden(out_h, ref, layer_tail(o_in, res, tiny.w_ref, tiny.dims), f"w{b}")
        if d is not None:
            print(f"  w{b}: hidden rel_l2 {d[0]:.4f} to the quantizing reference, {d[1]:.4f} "
                  f"to the exact one, whose own is {d[2]:.4f}")  # fmt: skip
    print(f"\n{tracker.summary()}")
    assert not tracker.problems(), tracker.problems()


def test_k2_tiny_batch_invariance_and_non_finite_row(tiny):
    """A row's output is bit-identical alone and in any batch, and a NaN row (vLLM's padding
    rows can be) keeps its NaN to itself while every hand-off of the launch completes."""
    gen = torch.Generator(device=DEV).manual_seed(22)
    o_all, r_all = tiny.inputs(BLOCK_B, gen)
    h16, r16 = tiny.run(o_all, r_all)
    for rows in ([0], [5, 2], [15, 3, 9, 0]):
        h, r = tiny.run(o_all[rows], r_all[rows])
        for j, i in enumerate(rows):
            assert torch.equal(h[j], h16[i]) and torch.equal(r[j], r16[i]), f"row {i} at {j}"
    o_bad = o_all[:4].clone()
    o_bad[1] = float("nan")
    h, r = tiny.run(o_bad, r_all[:4])
    for j in (0, 2, 3):
        assert torch.equal(h[j], h16[j]) and torch.equal(r[j], r16[j]), f"row {j} beside NaN"
    assert torch.isnan(h[1]).any()


# router K splits other than the default 2 (the partial logits every top-k CTA sums), and a
# pipelined router loop (on a GPU: chunks in flight; the interpreter runs it as a plain loop)
ROUTER_SPLITS = [
    {"router_k_splits": 8},
    {"router_k_splits": 1},
    {"router_k_splits": 4, "router_pipeline_stages": 2},
]


@pytest.fixture(scope="module", params=ROUTER_SPLITS, ids=lambda c: "-".join(map(str, c.values())))
def tiny_topk(request):
    return TinyTail(PRESETS[0], seed=7, **request.param)


def test_k2_tiny_topk_over_router_k_splits(tiny_topk):
    """Top-k over 8, 1 and 4 (pipelined) router K splits: the reference's routing, and each
    row's output bit-identical alone and in a batch, whichever CTA took its top-k."""
    test_k2_tiny_matches_reference(tiny_topk)
    gen = torch.Generator(device=DEV).manual_seed(24)
    o_all, r_all = tiny_topk.inputs(BLOCK_B, gen)
    h16, r16 = tiny_topk.run(o_all, r_all)
    for rows in ([7], [11, 2, 5]):
        h, r = tiny_topk.run(o_all[rows], r_all[rows])
        for j, i in enumerate(rows):
            assert torch.equal(h[j], h16[i]) and torch.equal(r[j], r16[i]), f"row {i} at {j}"


@pytest.mark.parametrize("splits", [8, 2])
def test_k2_tiny_router_preload_is_the_same_launch(splits):
    """``router_preload`` (each CTA's router tile loaded before S1's hand-offs) changes when
    the tile is read, not what is computed: bit-identical to the build that loads it after
    the norm, at every width, and the reference's routing."""
    pre = TinyTail(PRESETS[0], seed=8, router_k_splits=splits, router_preload=True)
    late = TinyTail(PRESETS[0], seed=8, router_k_splits=splits)
    test_k2_tiny_matches_reference(pre)
    gen = torch.Generator(device=DEV).manual_seed(25)
    for b in WIDTHS:
        o_in, res = pre.inputs(b, gen)
        h_pre, r_pre = pre.run(o_in, res)
        h_late, r_late = late.run(o_in, res)
        assert torch.equal(h_pre, h_late) and torch.equal(r_pre, r_late), f"width {b}"


@pytest.mark.parametrize(
    "option, rows, preset, seed",
    [
        # which CTA streams each run of down tasks changes, not the tasks or their sums
        ("down_runs_from_last_rows", BLOCK_B, PRESETS[1], 10),
        # every CTA takes the rows' top-k itself (widths 1 and 3), or the picks are
        # published (16): the same sums and picks either way
        ("local_topk_rows", 3, PRESETS[2], 11),
    ],
)
def test_k2_tiny_narrow_step_options_are_the_same_launch(option, rows, preset, seed):
    """A narrow-step option on for steps of at most ``rows`` rows is bit-identical to the
    build with it off, at every width."""
    on = TinyTail(preset, seed=seed, **{option: rows})
    off = TinyTail(preset, seed=seed, **{option: 0})
    gen = torch.Generator(device=DEV).manual_seed(26)
    for b in WIDTHS:
        o_in, res = on.inputs(b, gen)
        h_on, r_on = on.run(o_in, res)
        h_off, r_off = off.run(o_in, res)
        assert not torch.isnan(h_on).any(), f"width {b}: unwritten output"
        assert torch.equal(h_on, h_off) and torch.equal(r_on, r_off), f"width {b}"


def test_narrow_step_options_refuse_rows_past_the_block():
    shape = K2Shape.from_dims(Dims.from_config(text_config(get_preset("qwen3-next-80b-a3b")), tp=1))
    for name in ("local_topk_rows", "down_runs_from_last_rows"):
        for rows in (BLOCK_B + 1, -1):
            with pytest.raises(ValueError, match=f"{name}={rows} must be 0..{BLOCK_B}"):
                K2Launch(shape, K2Config(grid=132, **{name: rows}))
        K2Launch(shape, K2Config(grid=132, **{name: BLOCK_B}))


def test_router_preload_refuses_configs_without_one_router_task_per_cta():
    """The preload holds one tile per CTA: a config with more than one K chunk per router
    task, or more tasks than CTAs, is refused when the launch is made."""
    shape = K2Shape.from_dims(Dims.from_config(text_config(get_preset("qwen3-next-80b-a3b")), tp=1))
    with pytest.raises(ValueError, match="router_preload needs one router task"):
        K2Launch(shape, K2Config(grid=132, router_k_splits=4, router_preload=True))
    with pytest.raises(ValueError, match="router_preload needs one router task"):
        K2Launch(shape, K2Config(grid=32, router_k_splits=8, router_preload=True))
    K2Launch(shape, K2Config(grid=132, router_k_splits=8, router_preload=True))


#: build -> (FP8_CASES key, K2Config overrides): every case widened (the default), and
#: block-128 expert planes with e4m3 activations
FP8_BUILDS = {
    **{case: (case, {}) for case in FP8_CASES},
    "block128 a8": ("block128", {"fp8_activations": True}),
}


@pytest.fixture(scope="module", params=sorted(FP8_BUILDS))
def tiny_fp8(request):
    case, config = FP8_BUILDS[request.param]
    return TinyTail(FP8_CONFIG, seed=6, formats=FP8_CASES[case], **config)


def test_k2_tiny_fp8_planes_match_the_reference_on_dequantized_planes(tiny_fp8):
    """K2 reads fp8 e4m3fn planes with their fp32 scales in place (block-128, per row, per
    tensor) against the fp32 reference computing with the dequantized planes: widened, the
    same NUMERICS as bf16; with e4m3 activations (``fp8_activations``, as vLLM's fp8 MoE),
    against the reference that quantizes the same activations (``a8_check``). A row's output
    stays independent of the batch."""
    test_k2_tiny_matches_reference(tiny_fp8)
    gen = torch.Generator(device=DEV).manual_seed(23)
    o_all, r_all = tiny_fp8.inputs(BLOCK_B, gen)
    h16, r16 = tiny_fp8.run(o_all, r_all)
    h, r = tiny_fp8.run(o_all[[9, 4]], r_all[[9, 4]])
    assert torch.equal(h[0], h16[9]) and torch.equal(h[1], h16[4])
    assert torch.equal(r[0], r16[9]) and torch.equal(r[1], r16[4])


def test_k2_refuses_planes_it_cannot_read():
    d = Dims.from_config(text_config(FP8_CONFIG), tp=1)
    shape = K2Shape.from_dims(d)
    with pytest.raises(ValueError, match="do not read 'mxfp4'"):
        K2Launch(shape, K2Config(grid=GRID), formats={"w2": "mxfp4", "shared_down": "mxfp4"})
    tail = TinyTail(FP8_CONFIG, seed=7, formats=FP8_CASES["block128"])
    o_in, res = tail.inputs(2, torch.Generator(device=DEV).manual_seed(1))
    out = torch.empty(2, d.hidden, dtype=torch.bfloat16, device=DEV)
    w = dict(tail.w)
    del w["w2.scale"]
    w["out_proj.scale"] = w["out_proj.scale"][:1]
    with pytest.raises(ValueError) as err:
        tail.k2.check(o_in, res, w, out, out.clone())
    assert "missing w2.scale" in str(err.value)
    assert "out_proj.scale is torch.float32 (1, 2)" in str(err.value)


@pytest.mark.parametrize("fmt", ["fp8_block128", "fp8_channel", "fp8_tensor"])
def test_shard_tail_weights_cuts_scales_with_their_planes(fmt):
    """A rank's quantized shard, dequantized with the scales cut for it, is the shard of the
    dequantized plane (what the virtual-TP fp8 tests on the GPU rely on)."""
    gen = torch.Generator().manual_seed(3)
    h, k, e, i = 256, 512, 3, 256
    planes = {
        "out_proj": torch.randn(h, k, generator=gen),
        "w13": torch.randn(e, 2 * i, h, generator=gen),
        "w2": torch.randn(e, h, i, generator=gen),
        "shared_gate_up": torch.randn(2 * i, h, generator=gen),
        "shared_down": torch.randn(h, i, generator=gen),
    }
    formats = dict.fromkeys(planes, fmt)
    kern = quantized_weights(planes, formats)
    deq = dequantized_weights(kern, formats)
    for rank in range(2):
        got, want = shard_tail_weights(kern, 2, rank, formats), shard_tail_weights(deq, 2, rank)
        for p in planes:
            c, s = got[p].float(), got[p + ".scale"]
            if fmt == "fp8_block128":
                full = s.repeat_interleave(128, -2).repeat_interleave(128, -1)
            elif fmt == "fp8_channel":
                full = s.expand_as(c)
            else:
                full = s.reshape(*s.shape, 1, 1).expand_as(c)
            assert torch.equal(c * full, want[p]), f"{fmt} {p} rank {rank}"


def test_k2_tiny_launch_uses_the_constexprs_fixed_at_build(tiny, monkeypatch):
    """Plan once, run many: build() fixes the constexprs, a launch does not recompute them."""
    assert tiny.k2._cx == tiny.k2._constexprs()
    gen = torch.Generator(device=DEV).manual_seed(25)
    o_all, r_all = tiny.inputs(2, gen)
    h0, r0 = tiny.run(o_all, r_all)

    def recomputed():
        raise AssertionError("a launch recomputed its constexprs")

    monkeypatch.setattr(tiny.k2, "_constexprs", recomputed)
    h, r = tiny.run(o_all, r_all)
    assert torch.equal(h, h0) and torch.equal(r, r0)


def test_fp8_activations_none_quantizes_exactly_where_the_build_can():
    """``fp8_activations`` None: e4m3 activations where every expert plane is fp8 block-128
    and the chunks are whole quantization groups, else widened; False (the default) widens
    always."""
    shape = K2Shape.from_dims(Dims.from_config(text_config(FP8_CONFIG), tp=1))
    for case, formats in FP8_CASES.items():
        k2 = K2Launch(shape, K2Config(grid=GRID, fp8_activations=None), formats=formats)
        assert k2.a8 == (case == "block128"), case
        assert k2.a8_planes == ({"w13", "w2", "shared_gate_up", "shared_down"} if k2.a8 else set())
        assert not K2Launch(shape, K2Config(grid=GRID), formats=formats).a8, case
    cfg = K2Config(grid=GRID, fp8_activations=None, gate_up_k_chunk=64)
    assert not K2Launch(shape, cfg, formats=FP8_CASES["block128"]).a8


@pytest.mark.parametrize(
    "formats, config, message",
    [
        (FP8_CASES["channel"], {}, "fp8_activations needs fp8_block128 expert planes"),
        (FP8_CASES["routed_only"], {}, "shared_down, shared_gate_up are bf16"),
        (FP8_CASES["block128"], {"gate_up_k_chunk": 64}, "gate_up_k_chunk >= 128, got 64"),
    ],
)
def test_fp8_activations_refuse_what_they_cannot_quantize(formats, config, message):
    dims = Dims.from_config(text_config(FP8_CONFIG), tp=1)
    cfg = K2Config(grid=GRID, fp8_activations=True, **config)
    with pytest.raises(ValueError, match=message):
        K2Launch(K2Shape.from_dims(dims), cfg, formats=formats)
