"""The flydsl backend's launch binding, driven on a CPU by its dry run: a tiny Qwen3-Next whose
sizes the FlyDSL kernels take (head_dim 64, expert widths 64) is built at width 2 (K1 GDN and
attention, K2 GDN and attention compiled for gfx950 and checked) and two decode steps go
through the LayerLaunches interface. Every launch's arguments are checked against the
kernel's parameters, packed as FlyDSL packs them for the device, and bound and traced by
FlyDSL under COMPILE_ONLY against the build's artifact; the tables the kernels read are
checked entry by entry. Nothing is launched: loading and running on an MI355X never ran."""

import pytest
import torch

from mono_ext.core.backends import served_widths
from mono_ext.core.spec import BuildContext, BuildKey
from mono_ext.core.views import ConfigView
from mono_ext.kernels.flydsl.toolchain import dry_launch, launch_params
from mono_ext.models.qwen3_next.configs import get_preset
from mono_ext.models.qwen3_next.dims import Dims
from mono_ext.models.qwen3_next.flydsl import backend as fb
from mono_ext.models.qwen3_next.flydsl import k1, k2
from mono_ext.models.qwen3_next.launches import BoundLayer
from mono_ext.models.qwen3_next.reference.attention import rope_cos_sin
from mono_ext.runtime.build_cache import NotBuiltError
from mono_ext.runtime.failstop import FailStopError
from mono_ext.runtime.health import CTRL_EPOCH
from tests.models.qwen3_next.flydsl.dry_model import config as _config

W = 2
BF = torch.bfloat16
SLOTS = 5


def _layer(d, i, kind, gen):
    def rand(shp, dtype=BF):
        return torch.randn(shp, generator=gen).to(dtype)

    w = {n: rand(s, torch.float32 if n == "A_log" else BF) for n, s in d.planes(kind).items()}
    if kind != "linear_attention":
        return BoundLayer(i, kind, w)
    conv = rand((SLOTS, d.conv_k - 1, d.conv_dim_r))
    return BoundLayer(i, kind, w, conv, rand((SLOTS, d.hv_r, d.dv, d.dk), torch.float32))


def _step(launches, d, layers, gen, slots, positions):
    """One decode step through the interface; the tensors of every launch, in order."""
    h = d.hidden
    hidden, residual, seen = torch.randn(W, h, generator=gen).to(BF), None, []
    launches.begin_step()
    for layer in layers:
        r1 = torch.empty(W, h, dtype=BF)
        if layer.is_gdn:
            o_in, gate = torch.empty(W, d.hv_r * d.dv, dtype=BF), None
            launches.k1_gdn(layer, hidden, residual, slots, o_in=o_in, residual_out=r1)
            seen.append(dict(hidden=hidden, residual=residual, residual_out=r1, slots=slots,
                             o_in=o_in))  # fmt: skip
        else:
            q, gate = (torch.empty(W, d.hq_r * d.head_dim, dtype=BF) for _ in range(2))
            k, v = (torch.empty(W, d.hkv_r * d.head_dim, dtype=BF) for _ in range(2))
            launches.k1_attn(layer, hidden, residual, positions, q=q, k=k, v=v, gate=gate,
                             residual_out=r1)  # fmt: skip
            seen.append(dict(hidden=hidden, residual=residual, residual_out=r1,
                             positions=positions, q=q, gate=gate, k=k, v=v))  # fmt: skip
            o_in = torch.empty_like(q)
        hidden, residual = torch.empty(W, h, dtype=BF), torch.empty(W, h, dtype=BF)
        launches.k2(layer, o_in, r1, gate, hidden_out=hidden, residual_out=residual)
        seen.append(dict(o_in=o_in, gate=o_in if gate is None else gate, residual=r1,
                         out_hidden=hidden, out_residual=residual))  # fmt: skip
    launches.end_step()
    return seen


@pytest.fixture(scope="module")
def dry():
    cfg = _config()
    d = Dims.from_config(cfg)
    builder = fb.FlyDSLBuilder()
    key = BuildKey("qwen3_next", "flydsl", W, "bfloat16", 1)
    ctx = BuildContext(cfg, device="cpu", null_slot=0, extra={"dry_run": True})
    launches = builder(key, ctx)
    gen = torch.Generator().manual_seed(0)
    layers = [_layer(d, i, kind, gen) for i, kind in enumerate(d.kinds)]
    slots = torch.tensor([3, 0], dtype=torch.int32)  # row 1: the engine's null slot
    positions = torch.tensor([5, 4095])
    seen = _step(launches, d, layers, gen, slots, positions)
    return dict(cfg=cfg, d=d, builder=builder, key=key, ctx=ctx, launches=launches,
                layers=layers, seen=seen, slots=slots, positions=positions, gen=gen)  # fmt: skip


def _u64(t):
    return [int(x) for x in t.tolist()]


def test_a_step_launches_every_layer_with_the_kernels_arguments(dry):
    rt, d, layers = dry["launches"].runtime, dry["d"], dry["layers"]
    labels = [label for label, _, _ in rt.launched]
    assert [lab.split(" w")[0] for lab in labels] == ["k1 gdn", "k2 gdn"] * 3 + [
        "k1 attn",
        "k2 attn",
    ]
    kinds = ["k1_gdn", "k2_gdn"] * 3 + ["k1_attn", "k2_attn"]
    for (label, args, packed), kind, tensors, i in zip(
        rt.launched, kinds, dry["seen"], [0, 0, 1, 1, 2, 2, 3, 3], strict=True
    ):
        c = dry["launches"].builds[kind]
        assert c.label == label and c.build.width == W
        params = [n for n, _ in launch_params(c.launch)]
        got = dict(zip(params, args, strict=False))  # the stream went in as the last argument
        assert packed == [*args, None]  # the device packing: every value as passed, null stream
        for name, t in tensors.items():  # activations: their own addresses
            want = tensors["hidden"] if t is None else t  # first layer: no residual
            assert got[name] == want.data_ptr(), (label, name)
        assert (got["layer"], got["layers_per_step"]) == (i, d.num_layers)
        assert got["rtab"] == rt.rtabs[kind].data_ptr()
        col = fb.K2_COL if kind.startswith("k2") else fb.K1_COL
        assert got["wtab"] == rt.tables[i, col:].data_ptr()
        want_w = [layers[i].weights[n].data_ptr() for n in c.build.weight_shapes()]
        entries = {"k1_gdn": k1.GDN_WEIGHT_ENTRIES, "k1_attn": k1.WEIGHT_ENTRIES}
        names = entries.get(kind, k2.WEIGHT_ENTRIES)  # the kernel's table order
        pairs = zip(names, c.build.weight_shapes(), strict=True)
        assert all(plane in entry.split("|") for entry, plane in pairs)
        assert _u64(rt.tables[i, col : col + len(names)]) == want_w
        if kind.startswith("k1"):
            assert got["has_residual"] == int(i > 0)
        if kind == "k1_gdn":
            lay = layers[i]
            assert got["null_slot"] == 0 and got["stab"] == rt.tables[i, fb.STATE_COL :].data_ptr()
            assert _u64(rt.tables[i, fb.STATE_COL : fb.STATE_COL + 4]) == [
                lay.conv_state.data_ptr(), lay.conv_state.stride(0),
                lay.ssm_state.data_ptr(), lay.ssm_state.stride(0)]  # fmt: skip


def test_runtime_tables_workspaces_and_rope(dry):
    rt, d = dry["launches"].runtime, dry["d"]
    st = rt.state
    for kind, rtab in rt.rtabs.items():
        third = rt.rope if kind == "k1_attn" else st.ctrl  # K1 GDN / K2 at TP 1: never read
        want = [rt.scratch[kind], rt.xs, third, st.ctrl, st.health]
        assert _u64(rtab) == [t.data_ptr() for t in want], kind
        kw = dict(scratch=rt.scratch[kind], xs=rt.xs, ctrl=st.ctrl, health=st.health)
        kw.update({"rope": rt.rope} if kind == "k1_attn" else {})
        for width in (1, 7, 16):  # every width fits the shared workspaces (plans, no compile)
            assert rt.factories[kind](width).runtime_table(**kw) == _u64(rtab)
    assert len({t.data_ptr() for t in rt.scratch.values()}) == 4  # one scratch per launch kind
    rows = d.rotary_dim // 2
    cos, sin = rope_cos_sin(torch.tensor([0, 5, 4095]), d.rotary_dim, d.rope_theta)
    assert rt.rope.shape == (4096, d.rotary_dim) and rt.rope.dtype == torch.float32
    assert torch.equal(rt.rope[[0, 5, 4095], :rows], cos)
    assert torch.equal(rt.rope[[0, 5, 4095], rows:], sin)
    assert int(st.ctrl[CTRL_EPOCH]) == 1 and rt.steps == 1 and rt.release(1)


def test_second_step_reuses_tables_and_the_cache_is_sealed(dry):
    launches, rt = dry["launches"], dry["launches"].runtime
    bound = dict(rt.bound)
    n = len(rt.launched)
    _step(launches, dry["d"], dry["layers"], dry["gen"], dry["slots"], dry["positions"])
    assert len(rt.launched) == n + 8 and rt.bound == bound and rt.steps == 2
    assert int(rt.state.ctrl[CTRL_EPOCH]) == 2
    with pytest.raises(NotBuiltError, match="after startup"):
        dry["builder"](BuildKey("qwen3_next", "flydsl", 3, "bfloat16", 1), dry["ctx"])


def test_bad_launches_are_refused_before_flydsl_sees_them(dry):
    launches, d, layer = dry["launches"], dry["d"], dry["layers"][0]
    rows = torch.zeros(W + 1, d.hidden, dtype=BF)
    with pytest.raises(ValueError, match="got 3 rows, built for 2"):
        launches.k2(layer, rows, rows, None, hidden_out=rows, residual_out=rows)
    o_in = torch.zeros(W, d.hv_r * d.dv, dtype=torch.float32)
    h = torch.zeros(W, d.hidden, dtype=BF)
    with pytest.raises(ValueError, match="o_in is torch.float32"):
        launches.k2(layer, o_in, h, None, hidden_out=h, residual_out=h)
    with pytest.raises(ValueError, match="gate"):
        launches.k2(dry["layers"][3], o_in.to(BF), h, None, hidden_out=h, residual_out=h)
    c = launches.builds["k2_gdn"]
    _, args, _ = launches.runtime.launched[1]
    with pytest.raises(ValueError, match="layer=1.5 is not an int"):
        dry_launch(c, (*args[:-2], 1.5, args[-1], None))
    with pytest.raises(ValueError, match="is not a device address"):
        dry_launch(c, (0, *args[1:], None))
    with pytest.raises(ValueError, match="9 arguments for the 10 parameters"):
        dry_launch(c, args)


def test_failstop_stops_the_deployment(dry):
    # last in the module: the runtime stays failed
    launches, rt = dry["launches"], dry["launches"].runtime
    launches.begin_step()
    rt.failstop.source.fail()  # what a wait that gave up leaves in the health block
    with pytest.raises(FailStopError, match="gave up"):
        launches.end_step()
    with pytest.raises(FailStopError):
        launches.begin_step()


def test_refusals_and_no_width_served_by_default():
    b = fb.FlyDSLBuilder()
    assert b.refusals(ConfigView(_config(), tp_size=1), {}) == []
    tiny = b.refusals(ConfigView(get_preset("qwen3-next-tiny"), tp_size=1), {})
    assert any("head_dim=32" in r for r in tiny) and any("moe_inter=32" in r for r in tiny)
    tp2 = b.refusals(ConfigView(_config(), tp_size=2), {})
    assert any("TP 2" in r and "HipIpcPeers" in r for r in tp2)
    assert served_widths((1, 2, 4), b, "flydsl", False)[0] == ()
    assert served_widths((1, 2, 4), b, "flydsl", True)[0] == (1, 2, 4)
    key = BuildKey("qwen3_next", "flydsl", W, "bfloat16", 1)
    with pytest.raises(ValueError, match="runs on ROCm gfx950 GPUs, got cpu"):
        b(key, BuildContext(_config(), device="cpu"))
    with pytest.raises(ValueError, match="TP 1 only"):
        b(BuildKey("qwen3_next", "flydsl", W, "bfloat16", 2), BuildContext(_config()))
