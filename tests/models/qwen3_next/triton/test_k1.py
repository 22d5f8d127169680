"""K1 (layer front) Triton launches against the fp32 reference.

GDN: widths 1..16, both qkvz packings, both conv-state layouts, fp32 and bf16 recurrent
states (and the "kv" state layout), padding rows (vLLM's null slot 0, SGLang's -1), the
first layer (no residual); rows not in the step stay bit-untouched; K1 -> reference -> K1
switching matches a K1-only run; CUDA-graph replay is bit-identical to eager; no wait gives
up and nothing compiles after build. Attention: q, k, v, gate after norm + partial RoPE.
FP8 planes (``formats``): the projections read in e4m3fn with fp32 block-128 / per-row /
per-tensor scales, in place, against the reference on the fp32 dequantized planes; a plane or
scale that does not match the build is refused by the launch's check, by name.

Outputs are poisoned (NaN) before every run and test data are never zeros. On a CUDA device
the real 80B-A3B shapes run as well as a tiny config; without one, ``TRITON_INTERPRET=1``
(with Triton installed) runs the tiny configs through Triton's CPU interpreter; otherwise
the module skips.
"""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not torch.cuda.is_available() and not INTERP:
    pytest.skip("needs a CUDA device (or TRITON_INTERPRET=1)", allow_module_level=True)

from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims, text_config  # noqa: E402
from mono_ext.models.qwen3_next.reference import attn_front, gdn_front, rel_l2  # noqa: E402
from mono_ext.models.qwen3_next.reference.convert import (  # noqa: E402
    dequantized_weights,
    quantized_weights,
)
from mono_ext.models.qwen3_next.spec import Qwen3NextSpec  # noqa: E402
from mono_ext.models.qwen3_next.triton.k1 import (  # noqa: E402
    K1AttnLaunch,
    K1AttnShape,
    K1Config,
    K1GdnLaunch,
    K1GdnShape,
    gdn_row_map,
    k1_attn_kernel,
    k1_gdn_kernel,
)
from mono_ext.runtime.build_cache import jit_cache_size  # noqa: E402
from mono_ext.runtime.health import H_FAILED  # noqa: E402
from mono_ext.runtime.peers import RankState  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM = Qwen3NextSpec.NUMERICS
DEADLINE_S = float(os.environ.get("MONO_EXT_DEADLINE_S", "2"))
REAL = "qwen3-next-80b-a3b"
TINY = "qwen3.5-moe-tiny"  # r = 2, Dv (64) != Dk (32)
TINY_B = "qwen3-next-tiny-b"  # r = 1, hidden 96, head_dim 64
PRESETS = [TINY] if INTERP else [REAL, TINY]
WIDTHS_GPU = list(range(1, 17))
WIDTHS = [1, 3, 16] if INTERP else WIDTHS_GPU
SLOTS = 40  # slots per state tensor (> 16 + padding, so untouched slots exist)


# fp8 builds: the tiny config at hidden 256, so the block-128 planes have whole 128x128 scale
# blocks and two scale columns (qkvz rows 640 = 5 x 128, qkv rows 384 = 3 x 128)
FP8_TINY = "qwen3.5-moe-tiny@h256"


def _cfg(name):
    if name == FP8_TINY:
        return {**text_config(get_preset(TINY)), "hidden_size": 256}
    return text_config(get_preset(name))


def _grid():
    if DEV.type == "cuda":
        return torch.cuda.get_device_properties(DEV).multi_processor_count
    # interpreter: a few programs so tiles and tasks wrap around the grid (S1 and S2 then run
    # as two launches); MONO_EXT_K1_GRID=1 runs the one-launch path (S2 after S1 in-program)
    return int(os.environ.get("MONO_EXT_K1_GRID", "5"))


_BUILDS: dict = {}


def gdn_build(name, state_dtype, ssm_layout="vk", packing="interleaved", formats=None,
              config=None):  # fmt: skip
    formats, config = formats or {}, config or {}
    key = ("gdn", name, state_dtype, ssm_layout, packing, tuple(sorted(formats.items())),
           tuple(sorted(config.items())))  # fmt: skip
    if key not in _BUILDS:
        shape = K1GdnShape.from_dims(Dims.from_config(_cfg(name)))
        k1 = K1GdnLaunch(shape, K1Config(grid=_grid(), **config), packing=packing,
                         state_dtype=state_dtype, ssm_layout=ssm_layout,
                         formats=formats)  # fmt: skip
        k1.build(DEV)
        _BUILDS[key] = k1
    return _BUILDS[key]


def attn_build(name, formats=None, config=None):
    formats, config = formats or {}, config or {}
    key = ("attn", name, tuple(sorted(formats.items())), tuple(sorted(config.items())))
    if key not in _BUILDS:
        shape = K1AttnShape.from_dims(Dims.from_config(_cfg(name)))
        k1 = K1AttnLaunch(shape, K1Config(grid=_grid(), **config), max_positions=4096,
                          formats=formats)  # fmt: skip
        k1.build(DEV)
        _BUILDS[key] = k1
    return _BUILDS[key]


def cosine(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-30))


def assert_close(name, got, ref):
    assert torch.isfinite(got).all(), f"{name}: non-finite values (unwritten or NaN)"
    cos, rl2 = cosine(got, ref), rel_l2(got, ref)
    assert cos >= NUM[f"k1.{name}.cosine"], f"{name}: cosine {cos:.6f} (rel_l2 {rl2:.2e})"
    assert rl2 <= NUM[f"k1.{name}.rel_l2"], f"{name}: rel_l2 {rl2:.2e} (cosine {cos:.6f})"


def new_gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(gen, *shape):
    """Fresh normal samples made on the test device (fast at the real shapes)."""
    return torch.randn(*shape, generator=gen, device=DEV)


def rank_state():
    return RankState.create(0, DEV, DEADLINE_S)


def assert_healthy(st):
    assert int(st.health[H_FAILED].item()) == 0, "a K1 wait gave up (see the health block)"


# ------------------------------------------------------------------------------------ GDN


def gdn_weights(md: Dims, packing, gen):
    h = md.hidden

    def rnd(*shape, scale=1.0):
        return (randn(gen, *shape) * scale).to(torch.bfloat16)

    from mono_ext.models.qwen3_next.reference import pack_ba, pack_qkvz

    s = h**-0.5
    qkvz = pack_qkvz(rnd(md.key_dim, h, scale=s), rnd(md.key_dim, h, scale=s),
                     rnd(md.value_dim, h, scale=s), rnd(md.value_dim, h, scale=s),
                     md, packing)  # fmt: skip
    ba = pack_ba(rnd(md.hv, h, scale=s), rnd(md.hv, h, scale=s), md, packing)
    # Decay A in [0.1, 4] and a unit-scale state keep o = S q well-conditioned. With strong
    # decay (A up to 16) and a small state, o ~ delta * (k . q) and a head's sign follows
    # k . q ~ 0, which bf16 rounding flips (seen on H200: rel_l2 4e-2..1e-1 from a few of
    # 512 heads; the fp32 reference itself flips under a 2^-9 weight perturbation).
    a = torch.empty(md.hv, device=DEV).uniform_(0.1, 4.0, generator=gen)
    return {
        "input_layernorm": rnd(h, scale=0.2),
        "in_proj_qkvz": qkvz.contiguous(),
        "in_proj_ba": ba.contiguous(),
        "conv1d": rnd(md.conv_dim, 1, md.conv_k, scale=0.5),
        "A_log": torch.log(a),
        "dt_bias": rnd(md.hv, scale=0.5),
        "norm": (1.0 + randn(gen, md.dv) * 0.1).to(torch.bfloat16),
    }


def gdn_states(md: Dims, conv_layout, state_dtype, gen):
    k1 = md.conv_k - 1
    shp = (SLOTS, k1, md.conv_dim) if conv_layout == "time_chan" else (SLOTS, md.conv_dim, k1)
    conv = randn(gen, *shp).to(torch.bfloat16)
    ssm = randn(gen, SLOTS, md.hv, md.dv, md.dk) * 0.5
    return conv, ssm.to(getattr(torch, state_dtype))


def step_slots(width, null_slot, gen, pad=True):
    """Distinct real slots (never 0: vLLM's null block) and, when ``pad``, a padding row."""
    real = (torch.randperm(SLOTS - 1, generator=gen, device=DEV)[:width] + 1).to(torch.int32)
    if pad and width > 1:
        real[width // 2] = -1 if null_slot is None else 0
    return real


def step_inputs(md, width, gen, residual=True):
    hid = randn(gen, width, md.hidden).to(torch.bfloat16)
    res = randn(gen, width, md.hidden).to(torch.bfloat16)
    return hid, (res if residual else None)


def run_k1_gdn(k1, st, ws, hid, res, w, conv, ssm, slots, null_slot, layer=0, lps=1):
    o_in = torch.full((hid.shape[0], k1.shape.value_dim), float("nan"), dtype=torch.bfloat16,
                      device=DEV)  # fmt: skip
    r_out = torch.full_like(hid, float("nan"))
    st.bump_epoch()
    k1.launch(hid, res, w, conv, ssm, slots, o_in, r_out, ws=ws, ctrl=st.ctrl,
              health=st.health, null_slot=null_slot, layer=layer, layers_per_step=lps)  # fmt: skip
    return o_in, r_out


def run_ref_gdn(md, hid, res, w, conv, ssm, slots, packing, conv_layout, null_slot, ssm_layout):
    return gdn_front(hid, res, w["input_layernorm"], w, md, conv, ssm, slots,
                     conv_layout=conv_layout, packing=packing, null_slot=null_slot,
                     ssm_layout=ssm_layout)  # fmt: skip


def _valid(slots, null_slot):
    ok = slots >= 0
    if null_slot is not None:
        ok &= slots != null_slot
    return ok


# Every packing x conv layout x state dtype at the first preset; on a GPU the tiny config
# runs bf16 states only (fp32 is covered at the real shape; each dtype is one more compile).
CASES = [
    (p, pk, cl, sd, "vk")
    for p in PRESETS
    for pk in ("interleaved", "contiguous")
    for cl in ("time_chan", "chan_time")
    for sd in ("float32", "bfloat16")
    if INTERP or p == REAL or sd == "bfloat16"
] + [(TINY, "interleaved", "time_chan", "float32", "kv")]
if INTERP:
    CASES.append((TINY_B, "contiguous", "time_chan", "float32", "vk"))
ATTN_PRESETS = PRESETS + [TINY_B] if INTERP else PRESETS


@pytest.mark.parametrize("preset,packing,conv_layout,state_dtype,ssm_layout", CASES)
def test_gdn_front_matches_reference(preset, packing, conv_layout, state_dtype, ssm_layout):
    md = Dims.from_config(_cfg(preset))
    k1 = gdn_build(preset, state_dtype, ssm_layout, packing)
    gen = new_gen(sum(map(ord, f"{preset}{packing}{conv_layout}{state_dtype}{ssm_layout}")))
    w = gdn_weights(md, packing, gen)
    check_gdn_steps(k1, md, w, w, packing, conv_layout, state_dtype, ssm_layout, gen, WIDTHS)


def check_gdn_steps(k1, md, w, w_ref, packing, conv_layout, state_dtype, ssm_layout, gen,
                    widths):  # fmt: skip
    """K1 with weights ``w`` against the reference with ``w_ref``, one step per width."""
    null_slot = 0 if conv_layout == "time_chan" else None  # vLLM pads with 0, SGLang with -1
    st, ws = rank_state(), k1.workspace(DEV)
    n_jit = jit_cache_size(k1_gdn_kernel)
    for width in widths:
        conv, ssm = gdn_states(md, conv_layout, state_dtype, gen)
        slots = step_slots(width, null_slot, gen)
        hid, res = step_inputs(md, width, gen, residual=width != 2)  # width 2: first layer
        conv_r, ssm_r = conv.clone(), ssm.clone()
        conv0, ssm0 = conv.clone(), ssm.clone()
        o_in, r_out = run_k1_gdn(k1, st, ws, hid, res, w, conv, ssm, slots, null_slot)
        ref = run_ref_gdn(md, hid, res, w_ref, conv_r, ssm_r, slots, packing, conv_layout,
                          null_slot, ssm_layout)  # fmt: skip
        ok = _valid(slots, null_slot)
        assert_healthy(st)
        assert torch.isfinite(r_out).all()
        assert rel_l2(r_out.float(), ref.residual_out) <= NUM["k2.residual.rel_l2"]
        assert (o_in[~ok] == 0).all(), "padding rows must give o_in = 0"
        assert_close("out", o_in[ok].float(), ref.o_in[ok])
        idx = slots[ok].long()
        assert_close("conv_state", conv[idx].float(), conv_r[idx].float())
        assert_close("ssm_state", ssm[idx].float(), ssm_r[idx].float())
        # every slot not in the step (padding included) is bit-untouched
        untouched = torch.ones(SLOTS, dtype=torch.bool, device=DEV)
        untouched[idx] = False
        assert torch.equal(conv[untouched], conv0[untouched])
        assert torch.equal(ssm[untouched], ssm0[untouched])
    assert jit_cache_size(k1_gdn_kernel) == n_jit, "K1 compiled a new variant after build"


def test_gdn_row_map_matches_reference_packing():
    """The row map sends each packed row where the reference's split puts it."""
    from mono_ext.models.qwen3_next.reference.gdn import split_ba, split_qkvz

    for preset in (TINY, TINY_B):
        md = Dims.from_config(_cfg(preset))
        shape = K1GdnShape.from_dims(md)
        for packing in ("interleaved", "contiguous"):
            rmap = torch.tensor(gdn_row_map(shape, packing))
            rows = torch.arange(md.qkvz_rows, dtype=torch.float64)
            q, k, v, z = split_qkvz(rows, md, packing)
            want = torch.cat([q.flatten(), k.flatten(), v.flatten(), z.flatten()])
            got = torch.empty(md.qkvz_rows, dtype=torch.float64)
            got[rmap[: md.qkvz_rows].long()] = rows
            assert torch.equal(got, want), packing
            brow = torch.arange(2 * md.hv, dtype=torch.float64)
            b, a = split_ba(brow, md, packing)
            got = torch.empty(2 * md.hv, dtype=torch.float64)
            got[rmap[md.qkvz_rows :].long() - md.qkvz_rows] = brow
            assert torch.equal(got, torch.cat([b, a])), packing


@pytest.mark.parametrize("preset", PRESETS)
def test_gdn_switching_k1_reference_k1(preset):
    """K1 for some steps, the reference for some, K1 again == a run that never switched."""
    md = Dims.from_config(_cfg(preset))
    k1 = gdn_build(preset, "float32")
    gen = new_gen(7)
    w = gdn_weights(md, "interleaved", gen)
    conv, ssm = gdn_states(md, "time_chan", "float32", gen)
    width, steps = 5, 6
    slots = step_slots(width, 0, gen)
    inputs = [step_inputs(md, width, gen) for _ in range(steps)]
    st, ws = rank_state(), k1.workspace(DEV)
    runs = {}
    for name, plan in (("switched", "KKRRKK"), ("k1_only", "KKKKKK")):
        c, s = conv.clone(), ssm.clone()
        for mode, (hid, res) in zip(plan, inputs, strict=True):
            if mode == "K":
                o, _ = run_k1_gdn(k1, st, ws, hid, res, w, c, s, slots, 0)
            else:
                o = run_ref_gdn(
                    md, hid, res, w, c, s, slots, "interleaved", "time_chan", 0, "vk"
                ).o_in
        runs[name] = (o.float(), c, s)
    assert_healthy(st)
    ok = _valid(slots, 0)
    idx = slots[ok].long()
    (o1, c1, s1), (o2, c2, s2) = runs["switched"], runs["k1_only"]
    assert_close("out", o1[ok], o2[ok])
    assert_close("conv_state", c1[idx].float(), c2[idx].float())
    assert_close("ssm_state", s1[idx], s2[idx])


def test_launches_use_the_constexprs_fixed_at_build(monkeypatch):
    """Plan once, run many: build() fixes each launch's constexprs and a launch reuses them."""
    preset = PRESETS[0]
    gdn, attn = gdn_build(preset, "float32"), attn_build(preset)
    assert gdn._cx == gdn._constexprs() and attn._cx == attn._constexprs()
    md = Dims.from_config(_cfg(preset))
    gen = new_gen(9)
    w = gdn_weights(md, "interleaved", gen)
    conv, ssm = gdn_states(md, "time_chan", "float32", gen)
    slots = step_slots(3, 0, gen)
    hid, res = step_inputs(md, 3, gen)
    st, ws = rank_state(), gdn.workspace(DEV)
    want, _ = run_k1_gdn(gdn, st, ws, hid, res, w, conv.clone(), ssm.clone(), slots, 0)

    def recomputed():
        raise AssertionError("a launch recomputed its constexprs")

    monkeypatch.setattr(gdn, "_constexprs", recomputed)
    got, _ = run_k1_gdn(gdn, st, ws, hid, res, w, conv.clone(), ssm.clone(), slots, 0)
    assert_healthy(st)
    ok = _valid(slots, 0)
    assert torch.isfinite(want[ok]).all()  # written over the NaN poison
    assert torch.equal(got[ok], want[ok])


@pytest.mark.skipif(DEV.type != "cuda", reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("preset", PRESETS)
def test_gdn_graph_replay_bit_identical(preset):
    md = Dims.from_config(_cfg(preset))
    k1 = gdn_build(preset, "float32")
    gen = new_gen(11)
    w = gdn_weights(md, "interleaved", gen)
    conv0, ssm0 = gdn_states(md, "time_chan", "float32", gen)
    width = 4
    slots = step_slots(width, 0, gen)
    hid, res = step_inputs(md, width, gen)
    st, ws = rank_state(), k1.workspace(DEV)
    # eager: two steps
    ce, se = conv0.clone(), ssm0.clone()
    eager = []
    for _ in range(2):
        o, r = run_k1_gdn(k1, st, ws, hid, res, w, ce, se, slots, 0)
        eager.append((o.clone(), r.clone(), ce.clone(), se.clone()))
    # graph: capture one step (epoch bump + launch), replay twice from the same start
    cg, sg = conv0.clone(), ssm0.clone()
    o_in = torch.empty(width, md.value_dim, dtype=torch.bfloat16, device=DEV)
    r_out = torch.empty_like(hid)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        st.bump_epoch()
        k1.launch(hid, res, w, cg, sg, slots, o_in, r_out, ws=ws, ctrl=st.ctrl,
                  health=st.health, null_slot=0)  # fmt: skip
    cg.copy_(conv0)
    sg.copy_(ssm0)
    for o_e, r_e, c_e, s_e in eager:
        o_in.fill_(float("nan"))
        r_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o_in, o_e) and torch.equal(r_out, r_e)
        assert torch.equal(cg, c_e) and torch.equal(sg, s_e)
    assert_healthy(st)


# ------------------------------------------------------------------------------ attention


def attn_weights(md: Dims, gen):
    h, d = md.hidden, md.head_dim
    rows = (2 * md.hq + 2 * md.hkv) * d

    def rnd(*shape, scale=1.0):
        return (randn(gen, *shape) * scale).to(torch.bfloat16)

    return {
        "input_layernorm": rnd(h, scale=0.2),
        "qkv_proj": rnd(rows, h, scale=h**-0.5),
        "q_norm": rnd(d, scale=0.2),
        "k_norm": rnd(d, scale=0.2),
    }


@pytest.mark.parametrize("preset", ATTN_PRESETS)
def test_attn_front_matches_reference(preset):
    md = Dims.from_config(_cfg(preset))
    k1 = attn_build(preset)
    gen = new_gen(3)
    w = attn_weights(md, gen)
    check_attn_steps(k1, md, w, w, gen, WIDTHS)


def check_attn_steps(k1, md, w, w_ref, gen, widths):
    """K1 with weights ``w`` against the reference with ``w_ref``, one step per width."""
    st, ws = rank_state(), k1.workspace(DEV)
    qd, kvd = md.hq * md.head_dim, md.hkv * md.head_dim
    n_jit = jit_cache_size(k1_attn_kernel)
    for width in widths:
        hid, res = step_inputs(md, width, gen, residual=width != 2)
        pos = torch.randint(0, 4096, (width,), generator=gen, device=DEV)
        outs = [torch.full((width, n), float("nan"), dtype=torch.bfloat16, device=DEV)
                for n in (qd, kvd, kvd, qd)]  # fmt: skip
        r_out = torch.full_like(hid, float("nan"))
        st.bump_epoch()
        k1.launch(hid, res, w, pos, *outs, r_out, ws=ws, ctrl=st.ctrl, health=st.health)
        ref = attn_front(hid, res, w["input_layernorm"], w_ref, md, pos)
        assert_healthy(st)
        q, k, v, gate = (t.float() for t in outs)
        assert_close("q", q, ref.q.reshape(width, -1))
        assert_close("k", k, ref.k.reshape(width, -1))
        assert_close("v", v, ref.v.reshape(width, -1))
        assert_close("q", gate, ref.gate)  # the gate is a plain projection, q's thresholds
        assert rel_l2(r_out.float(), ref.residual_out) <= NUM["k2.residual.rel_l2"]
    assert jit_cache_size(k1_attn_kernel) == n_jit, "K1 compiled a new variant after build"


def split(n):
    """K1Config overrides of the recurrence in ``n`` blocks of Dv rows per (row, head)."""
    return {"dv_split": n, "state_row_slices": 1}


# the blocked recurrence at both state layouts (its blocks are rows of vk, columns of kv)
SPLIT_CASES = [(p, n, "vk") for p in PRESETS for n in (2, 4)] + [(TINY, 4, "kv")]


@pytest.mark.parametrize("preset,n,ssm_layout", SPLIT_CASES)
def test_gdn_front_dv_split_matches_reference(preset, n, ssm_layout):
    """``K1Config.dv_split``: each (row, head) of the recurrence as ``n`` tasks, the gated
    norm a stage after them."""
    md = Dims.from_config(_cfg(preset))
    k1 = gdn_build(preset, "float32", ssm_layout, config=split(n))
    gen = new_gen(37 + n)
    w = gdn_weights(md, "interleaved", gen)
    check_gdn_steps(k1, md, w, w, "interleaved", "time_chan", "float32", ssm_layout, gen, WIDTHS)


# K chunks of 16 columns: the tiny presets' tail tiles split along K (qwen3.5-moe-tiny at grid
# 5: 4 units of one tile, both fronts), which the default chunk of the tiny hidden size never
# does; on a GPU the 80B-A3B default splits already (GDN in 2, attention in 8)
SPLIT_TAIL = {"k_chunk": 16}


@pytest.mark.parametrize("split", [True, False], ids=["split", "smaller_tiles"])
def test_fronts_tail_tiles_match_reference(split):
    """The rows past the full rounds (``k1_plan.s1_units``): tail tiles split along K, each
    tile's parts summed by its last unit to arrive, over several launches on one workspace
    (the arrival counts reset); or whole tail tiles of fewer rows."""
    preset = TINY
    md = Dims.from_config(_cfg(preset))
    config = {**SPLIT_TAIL, "split_tail_tiles": split}
    gdn = gdn_build(preset, "float32", config=config)
    attn = attn_build(preset, config=config)
    for k1 in (gdn, attn):
        _, parts, units, rows = k1._units()
        assert units > 0 and (parts > 1) == split and (rows < k1._tiling()[0]) == (not split)
    gen = new_gen(43)
    w = gdn_weights(md, "interleaved", gen)
    check_gdn_steps(gdn, md, w, w, "interleaved", "time_chan", "float32", "vk", gen, WIDTHS)
    aw = attn_weights(md, gen)
    check_attn_steps(attn, md, aw, aw, gen, WIDTHS)


def _check_trace(trace, first_tasks):
    """Every CTA stamped its start, rows normed, S1 done and end, in that order; exactly the
    CTAs in ``first_tasks`` stamped their first S2 task's words, between S1 and the end."""
    from mono_ext.models.qwen3_next.triton.k1 import TRACE_POINTS

    names = ("start", "rows normed", "S1 done", "first S2 words", "end")
    start, normed, s1, words, end = (TRACE_POINTS.index(p) for p in names)
    t = trace.cpu()
    assert bool((t[:, [start, normed, s1, end]] > 0).all()), "a CTA missed a stamp"
    assert bool((t[:, start] <= t[:, normed]).all() and (t[:, normed] <= t[:, s1]).all())
    assert bool((t[:, s1] <= t[:, end]).all())
    has = t[:, words] > 0
    assert has.nonzero().flatten().tolist() == sorted(first_tasks)
    assert bool((t[has, s1] <= t[has, words]).all() and (t[has, words] <= t[has, end]).all())


@pytest.mark.skipif(INTERP or DEV.type != "cuda", reason="trace stamps read %globaltimer")
def test_trace_builds_give_the_same_bits_and_ordered_stamps():
    """``K1Config.trace`` (bench_k1.py --trace): both fronts' outputs and states bit-equal to
    the default build's on the same inputs, and each CTA's stamps in program order."""
    md = Dims.from_config(_cfg(REAL))
    gen = new_gen(51)
    w, aw = gdn_weights(md, "interleaved", gen), attn_weights(md, gen)
    conv0, ssm0 = gdn_states(md, "time_chan", "float32", gen)
    width = 3
    slots = step_slots(width, 0, gen, pad=False)
    hid, res = step_inputs(md, width, gen)
    pos = torch.randint(0, 4096, (width,), generator=gen, device=DEV)
    qd, kvd = md.hq * md.head_dim, md.hkv * md.head_dim
    st, got = rank_state(), {}
    for traced in (False, True):
        cfg = {"trace": True} if traced else {}
        gdn, attn = gdn_build(REAL, "float32", config=cfg), attn_build(REAL, config=cfg)
        ws, wsa = gdn.workspace(DEV), attn.workspace(DEV)
        assert (ws.trace is not None) == traced and (wsa.trace is not None) == traced
        conv, ssm = conv0.clone(), ssm0.clone()
        o_in, r_out = run_k1_gdn(gdn, st, ws, hid, res, w, conv, ssm, slots, 0)
        outs = [torch.full((width, n), float("nan"), dtype=torch.bfloat16, device=DEV)
                for n in (qd, kvd, kvd, qd)]  # fmt: skip
        ra = torch.full_like(hid, float("nan"))
        st.bump_epoch()
        attn.launch(hid, res, aw, pos, *outs, ra, ws=wsa, ctrl=st.ctrl, health=st.health)
        assert_healthy(st)
        got[traced] = (o_in, r_out, conv, ssm, *outs, ra)
        if traced:
            g = gdn.config.grid
            _check_trace(ws.trace, [g - 1 - t for t in range(min(g, width * md.hv))])
            _check_trace(wsa.trace, [g - 1 - t for t in range(min(g, md.hq + md.hkv))])
    for a, b in zip(got[False], got[True], strict=True):
        assert torch.equal(a, b), "a trace build computes other bits than the default"


def test_dv_split_refused_by_name():
    shape = K1GdnShape.from_dims(Dims.from_config(_cfg(TINY)))
    with pytest.raises(ValueError, match="dv_split=3: 1, 2 or 4 blocks"):
        K1GdnLaunch(shape, K1Config(grid=_grid(), **split(3)))
    with pytest.raises(ValueError, match="dv_split=2 needs state_row_slices=1"):
        K1GdnLaunch(shape, K1Config(grid=_grid(), dv_split=2))


@pytest.mark.parametrize(
    "config",
    [{}, split(4), {"norm_once_above": 4}, SPLIT_TAIL],
    ids=["default", "dv_split4", "norm_once_above4", "split_tail"],
)
def test_fronts_batch_invariant(config):
    """A row's outputs and states are bit-identical whatever the other rows and the width:
    the first rows of a 16-row step, run again at fewer rows (padding included); with
    ``norm_once_above`` 4, across the switch between the two norms (16 and 9 rows hand the
    rows over, 1 row norms in every CTA)."""
    preset = PRESETS[0]
    md = Dims.from_config(_cfg(preset))
    gen = new_gen(31)
    attn_config = {k: v for k, v in config.items() if k in ("norm_once_above", "k_chunk")}
    gdn = gdn_build(preset, "float32", config=config)
    attn = attn_build(preset, config=attn_config)
    w, aw = gdn_weights(md, "interleaved", gen), attn_weights(md, gen)
    conv0, ssm0 = gdn_states(md, "time_chan", "float32", gen)
    slots = step_slots(16, 0, gen)
    hid, res = step_inputs(md, 16, gen)
    pos = torch.randint(0, 4096, (16,), generator=gen, device=DEV)
    st, ws, wsa = rank_state(), gdn.workspace(DEV), attn.workspace(DEV)
    qd, kvd = md.hq * md.head_dim, md.hkv * md.head_dim
    runs = {}
    for width in (16, 9, 1):
        conv, ssm = conv0.clone(), ssm0.clone()
        o_in, r_out = run_k1_gdn(gdn, st, ws, hid[:width], res[:width], w, conv, ssm,
                                 slots[:width], 0)  # fmt: skip
        outs = [torch.full((width, n), float("nan"), dtype=torch.bfloat16, device=DEV)
                for n in (qd, kvd, kvd, qd)]  # fmt: skip
        ra = torch.full_like(hid[:width], float("nan"))
        st.bump_epoch()
        attn.launch(hid[:width], res[:width], aw, pos[:width], *outs, ra, ws=wsa, ctrl=st.ctrl,
                    health=st.health)  # fmt: skip
        assert_healthy(st)
        idx = slots[:width][_valid(slots[:width], 0)].long()
        runs[width] = (o_in, r_out, conv[idx], ssm[idx], *outs, ra)
    names = ("o_in", "residual_out", "conv", "ssm", "q", "k", "v", "gate", "attn residual_out")
    for width in (9, 1):
        for name, got, full in zip(names, runs[width], runs[16], strict=True):
            want = full[: got.shape[0]]
            assert torch.equal(got, want), f"{name} at width {width} differs from width 16's"


@pytest.mark.parametrize("preset", PRESETS)
def test_norm_once_builds_give_the_default_builds_bits(preset):
    """``K1Config.norm_once_above``: each row normed once, by one CTA, and handed to every CTA
    behind a flag is the same code on the same values as every CTA norming every row, so both
    fronts' outputs and states are bit-equal to the default build's, with the hand-off at every
    width (0) and from 3 rows up (2); width 3 without a residual (a first layer)."""
    md = Dims.from_config(_cfg(preset))
    gen = new_gen(71)
    w, aw = gdn_weights(md, "interleaved", gen), attn_weights(md, gen)
    conv0, ssm0 = gdn_states(md, "time_chan", "float32", gen)
    qd, kvd = md.hq * md.head_dim, md.hkv * md.head_dim
    configs = {"default": {}, "once": {"norm_once_above": 0}, "above 2": {"norm_once_above": 2}}
    builds = {n: (gdn_build(preset, "float32", config=c), attn_build(preset, config=c))
              for n, c in configs.items()}  # fmt: skip
    st = rank_state()
    for width in (1, 3, 16):
        slots = step_slots(width, 0, gen)
        hid, res = step_inputs(md, width, gen, residual=width != 3)
        pos = torch.randint(0, 4096, (width,), generator=gen, device=DEV)
        got = {}
        for name, (gdn, attn) in builds.items():
            assert (gdn.workspace(DEV).xs.shape[0] == gdn.config.grid + 1) == (name != "default")
            conv, ssm = conv0.clone(), ssm0.clone()
            o_in, r_out = run_k1_gdn(gdn, st, gdn.workspace(DEV), hid, res, w, conv, ssm, slots,
                                     0)  # fmt: skip
            outs = [torch.full((width, n), float("nan"), dtype=torch.bfloat16, device=DEV)
                    for n in (qd, kvd, kvd, qd)]  # fmt: skip
            ra = torch.full_like(hid, float("nan"))
            st.bump_epoch()
            attn.launch(hid, res, aw, pos, *outs, ra, ws=attn.workspace(DEV), ctrl=st.ctrl,
                        health=st.health)  # fmt: skip
            assert_healthy(st)
            got[name] = (o_in, r_out, conv, ssm, *outs, ra)
        outputs = ("o_in", "residual_out", "conv", "ssm", "q", "k", "v", "gate", "attn res")
        for name in ("once", "above 2"):
            for out, a, b in zip(outputs, got["default"], got[name], strict=True):
                assert not a.isnan().any(), f"{out} at width {width}: not written"
                assert torch.equal(a, b), f"{out} at width {width}: {name} differs"


def test_norm_once_above_refused_by_name():
    shape = K1GdnShape.from_dims(Dims.from_config(_cfg(TINY)))
    with pytest.raises(ValueError, match="norm_once_above=17: 0..16 rows"):
        K1GdnLaunch(shape, K1Config(grid=_grid(), norm_once_above=17))
    with pytest.raises(ValueError, match="norm_once_above=-1: 0..16 rows"):
        K1AttnLaunch(K1AttnShape.from_dims(Dims.from_config(_cfg(TINY))),
                     K1Config(grid=_grid(), norm_once_above=-1))  # fmt: skip


def test_launches_adapter_matches_direct_launch():
    """``K1Launches`` (the k1_* half of ``launches.LayerLaunches``) over BoundLayer views."""
    from mono_ext.models.qwen3_next.launches import BoundLayer
    from mono_ext.models.qwen3_next.triton.k1 import K1Launches

    md = Dims.from_config(_cfg(TINY))
    gdn, attn = gdn_build(TINY, "bfloat16"), attn_build(TINY)
    gen = new_gen(21)
    st = rank_state()
    adapter = K1Launches(gdn, attn, gdn.workspace(DEV), attn.workspace(DEV), st.ctrl, st.health,
                         layers_per_step=2, null_slot=0)  # fmt: skip
    w = {**gdn_weights(md, "interleaved", gen)}
    conv, ssm = gdn_states(md, "time_chan", "bfloat16", gen)
    conv_r, ssm_r = conv.clone(), ssm.clone()
    slots = step_slots(3, 0, gen)
    hid, res = step_inputs(md, 3, gen)
    o_in = torch.full((3, md.value_dim), float("nan"), dtype=torch.bfloat16, device=DEV)
    r_out = torch.full_like(hid, float("nan"))
    st.bump_epoch()
    adapter.k1_gdn(BoundLayer(0, "linear_attention", w, conv, ssm), hid, res, slots,
                   o_in=o_in, residual_out=r_out)  # fmt: skip
    ref = run_ref_gdn(md, hid, res, w, conv_r, ssm_r, slots, "interleaved", "time_chan", 0, "vk")
    ok = _valid(slots, 0)
    assert_close("out", o_in[ok].float(), ref.o_in[ok])
    aw = attn_weights(md, gen)
    pos = torch.randint(0, 4096, (3,), generator=gen, device=DEV)
    qd, kvd = md.hq * md.head_dim, md.hkv * md.head_dim
    q, k, v, gate = (torch.full((3, n), float("nan"), dtype=torch.bfloat16, device=DEV)
                     for n in (qd, kvd, kvd, qd))  # fmt: skip
    adapter.k1_attn(BoundLayer(1, "full_attention", aw), hid, res, pos, q=q, k=k, v=v, gate=gate,
                    residual_out=r_out)  # fmt: skip
    ref_a = attn_front(hid, res, aw["input_layernorm"], aw, md, pos)
    assert_close("q", q.float(), ref_a.q.reshape(3, -1))
    assert_close("k", k.float(), ref_a.k.reshape(3, -1))
    assert_healthy(st)


def test_launches_adapter_plans_each_layer_once(monkeypatch):
    """``K1Launches`` plans a layer's launch (every tensor checked, the table frozen) at its
    first launch, runs later steps' new buffers and widths from that plan, plans again for a
    new bound layer object, and a tensor that no longer fits gets the full check's error."""
    from mono_ext.models.qwen3_next.launches import BoundLayer
    from mono_ext.models.qwen3_next.triton.k1 import K1Launches

    md = Dims.from_config(_cfg(TINY))
    gdn = gdn_build(TINY, "bfloat16")
    plans = []
    plan = gdn.plan
    monkeypatch.setattr(gdn, "plan", lambda *a, **k: plans.append(1) or plan(*a, **k))
    gen = new_gen(23)
    st = rank_state()
    adapter = K1Launches(gdn, None, gdn.workspace(DEV), None, st.ctrl, st.health,
                         layers_per_step=1, null_slot=0)  # fmt: skip
    w = gdn_weights(md, "interleaved", gen)
    conv, ssm = gdn_states(md, "time_chan", "bfloat16", gen)
    layer = BoundLayer(0, "linear_attention", w, conv, ssm)

    def step(bound, width, o_dtype=torch.bfloat16):
        slots = step_slots(width, 0, gen)
        hid, res = step_inputs(md, width, gen)
        o_in = torch.full((width, md.value_dim), float("nan"), dtype=o_dtype, device=DEV)
        r_out = torch.full_like(hid, float("nan"))
        conv_r, ssm_r = conv.clone(), ssm.clone()
        st.bump_epoch()
        adapter.k1_gdn(bound, hid, res, slots, o_in=o_in, residual_out=r_out)
        ref = run_ref_gdn(md, hid, res, w, conv_r, ssm_r, slots, "interleaved", "time_chan", 0,
                          "vk")  # fmt: skip
        ok = _valid(slots, 0)
        assert_close("out", o_in[ok].float(), ref.o_in[ok])

    step(layer, 3)
    step(layer, 2)  # other buffers, another width: the same plan
    assert len(plans) == 1
    again = BoundLayer(0, "linear_attention", w, conv, ssm)
    step(again, 2)  # the layer bound again
    assert len(plans) == 2
    with pytest.raises(ValueError, match="o_in is torch.float32"):
        step(again, 2, o_dtype=torch.float32)
    assert len(plans) == 3  # the misfit was planned (and checked) again, and refused
    assert_healthy(st)


# ---------------------------------------------------------------------------- fp8 planes


def quantize_planes(w, formats, gen):
    """(K1's weights: quantized planes + ``.scale``, the reference's: fp32 dequantized). Scales
    are jittered (x [1, 8)): one read for the wrong block or row is off by up to 8x. Per-row
    scales come as vLLM keeps them ([N, 1]) for GDN, flat [N] for attention: K1 reads both."""
    wq = quantized_weights(w, formats, jitter=gen)
    if formats.get("qkv_proj") == "fp8_channel":
        wq["qkv_proj.scale"] = wq["qkv_proj.scale"].reshape(-1)
    return wq, dequantized_weights(wq, formats)


# qkvz fp8 with ba bf16 is what an FP8-block checkpoint gives (in_proj_ba kept bf16); the
# others read both planes in one fp8 format, or in two different ones
FP8_GDN = [
    {"in_proj_qkvz": "fp8_block128"},
    {"in_proj_qkvz": "fp8_channel", "in_proj_ba": "fp8_channel"},
    {"in_proj_qkvz": "fp8_tensor", "in_proj_ba": "fp8_block128"},
]
FP8_WIDTHS = [1, 16] if INTERP else WIDTHS_GPU


@pytest.mark.parametrize("formats", FP8_GDN, ids=lambda f: "+".join(f.values()))
def test_gdn_front_fp8_planes_match_reference(formats):
    md = Dims.from_config(_cfg(FP8_TINY))
    k1 = gdn_build(FP8_TINY, "float32", formats=formats)
    gen = new_gen(sum(map(ord, str(formats))))
    w, w_ref = quantize_planes(gdn_weights(md, "interleaved", gen), formats, gen)
    check_gdn_steps(k1, md, w, w_ref, "interleaved", "time_chan", "float32", "vk", gen, FP8_WIDTHS)


@pytest.mark.parametrize("fmt", ["fp8_block128", "fp8_channel", "fp8_tensor"])
def test_attn_front_fp8_planes_match_reference(fmt):
    md = Dims.from_config(_cfg(FP8_TINY))
    k1 = attn_build(FP8_TINY, {"qkv_proj": fmt})
    gen = new_gen(sum(map(ord, fmt)))
    w, w_ref = quantize_planes(attn_weights(md, gen), {"qkv_proj": fmt}, gen)
    check_attn_steps(k1, md, w, w_ref, gen, FP8_WIDTHS)


def test_fp8_planes_refused_by_name():
    """A plane or scale that does not match the build is refused before anything runs, with
    the plane's name; an unknown format is refused at construction."""
    md = Dims.from_config(_cfg(FP8_TINY))
    formats = {"in_proj_qkvz": "fp8_block128"}
    k1 = gdn_build(FP8_TINY, "float32", formats=formats)
    gen = new_gen(5)
    w_bf16 = gdn_weights(md, "interleaved", gen)
    w, _ = quantize_planes(w_bf16, formats, gen)
    conv, ssm = gdn_states(md, "time_chan", "float32", gen)
    slots = step_slots(2, 0, gen)
    hid, res = step_inputs(md, 2, gen)
    st, ws = rank_state(), k1.workspace(DEV)
    scale = w["in_proj_qkvz.scale"]
    bad = {
        "missing in_proj_qkvz.scale": {k: v for k, v in w.items() if k != "in_proj_qkvz.scale"},
        # per-row scales where block-128 ones are due
        r"in_proj_qkvz.scale is torch.float32 \(640,\)": {
            **w,
            "in_proj_qkvz.scale": torch.ones(640, device=DEV),
        },
        r"in_proj_qkvz.scale is torch.float64": {**w, "in_proj_qkvz.scale": scale.double()},
        r"in_proj_qkvz is torch.bfloat16, expected torch.float8_e4m3fn": w_bf16,
        # this build reads in_proj_ba in bf16
        r"in_proj_ba is torch.float8_e4m3fn, expected torch.bfloat16": {
            **w,
            "in_proj_ba": w["in_proj_ba"].to(torch.float8_e4m3fn),
        },
    }
    for want, weights in bad.items():
        o_in = torch.full((2, md.value_dim), float("nan"), dtype=torch.bfloat16, device=DEV)
        with pytest.raises(ValueError, match=want):
            k1.launch(hid, res, weights, conv, ssm, slots, o_in, torch.empty_like(hid), ws=ws,
                      ctrl=st.ctrl, health=st.health, null_slot=0)  # fmt: skip
        assert torch.isnan(o_in).all(), "a refused launch ran"
    ka = attn_build(FP8_TINY, {"qkv_proj": "fp8_channel"})
    aw, _ = quantize_planes(attn_weights(md, gen), {"qkv_proj": "fp8_channel"}, gen)
    del aw["qkv_proj.scale"]
    qd, kvd = md.hq * md.head_dim, md.hkv * md.head_dim
    outs = [torch.empty((2, n), dtype=torch.bfloat16, device=DEV) for n in (qd, kvd, kvd, qd)]
    pos = torch.zeros(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="missing qkv_proj.scale"):
        ka.launch(hid, res, aw, pos, *outs, torch.empty_like(hid), ws=ka.workspace(DEV),
                  ctrl=st.ctrl, health=st.health)  # fmt: skip
    shape = K1GdnShape.from_dims(Dims.from_config(_cfg(FP8_TINY)))
    with pytest.raises(ValueError, match="in_proj_ba: the Triton kernels do not read 'mxfp4'"):
        K1GdnLaunch(shape, K1Config(grid=_grid()), formats={"in_proj_ba": "mxfp4"})
