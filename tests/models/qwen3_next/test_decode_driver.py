"""The engine-neutral decode driver with the reference backend, against the reference layer loop.

A fake engine (engine-layout weights, GDN caches whose layers use different slot tables, as
vLLM's KV-cache groups do, and a contiguous per-slot KV history standing in for paged
attention) runs decode steps through ``DecodeDriver``; the same steps through
``reference.decoder_layer_step`` on copies of the caches are the oracle. Check mode runs a
stand-in for the engine's layer code built from the reference: clean when it is exact,
breaches (logged with layer and metric) when it is perturbed.
"""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from mono_ext.core.backends import load_target  # noqa: E402
from mono_ext.core.spec import BuildContext, Deployment  # noqa: E402
from mono_ext.core.views import ConfigView, StepView  # noqa: E402
from mono_ext.models.qwen3_next.configs import get_preset  # noqa: E402
from mono_ext.models.qwen3_next.dims import Dims  # noqa: E402
from mono_ext.models.qwen3_next.driver import DecodeDriver, StepInputs  # noqa: E402
from mono_ext.models.qwen3_next.launches import (  # noqa: E402
    BoundLayer,
    LaunchBuilder,
    LayerLaunches,
)
from mono_ext.models.qwen3_next.reference import (  # noqa: E402
    decode_attention,
    decoder_layer_step,
    rel_l2,
)
from mono_ext.models.qwen3_next.reference.attention import attn_front  # noqa: E402
from mono_ext.models.qwen3_next.reference.common import (  # noqa: E402
    add_gemma_rms_norm,
    gemma_rms_norm,
)
from mono_ext.models.qwen3_next.reference.gdn import gdn_front  # noqa: E402
from mono_ext.models.qwen3_next.reference.tail import moe_forward  # noqa: E402
from mono_ext.models.qwen3_next.spec import Qwen3NextSpec  # noqa: E402

BF16 = torch.bfloat16
SLOTS, T_MAX, NULL = 9, 32, 0
TOL = 3e-2  # the driver rounds every launch output to bf16; the oracle stays fp32


def _weights(dims: Dims, kind: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in dims.planes(kind).items():
        if name == "A_log":
            t = torch.log(torch.rand(shape, generator=g) * 15 + 1)
        elif name == "dt_bias":
            t = 1 + 0.1 * torch.randn(shape, generator=g)
        elif name == "norm":
            t = 1 + 0.05 * torch.randn(shape, generator=g)
        elif "norm" in name:
            t = 0.05 * torch.randn(shape, generator=g)
        elif name == "conv1d":
            t = 0.3 * torch.randn(shape, generator=g)
        else:
            t = 0.05 * torch.randn(shape, generator=g)
        out[name] = t if name == "A_log" else t.to(BF16)
    return out


class FakeEngine:
    """Engine-layout tensors of a tiny model. Requests own a slot per GDN layer from that
    layer's table (a permutation keeping the null slot), and a KV history row."""

    def __init__(self, preset: str, seed: int = 0):
        self.cfg = get_preset(preset)
        self.dims = Dims.from_config(self.cfg)
        self.packing = "interleaved" if self.dims.family == "qwen3_next" else "contiguous"
        g = torch.Generator().manual_seed(seed)
        d = self.dims
        self.layers, self.kv, self.table = [], {}, {}
        for i, kind in enumerate(d.kinds):
            w = _weights(d, kind, g)
            if kind == "linear_attention":
                conv = 0.5 * torch.randn(SLOTS, d.conv_k - 1, d.conv_dim_r, generator=g)
                ssm = 0.1 * torch.randn(SLOTS, d.hv_r, d.dv, d.dk, generator=g)
                self.layers.append(BoundLayer(i, kind, w, conv.to(BF16), ssm))
                perm = torch.randperm(SLOTS - 1, generator=g) + 1
                self.table[i] = torch.cat([torch.tensor([NULL]), perm]).to(torch.int32)
            else:
                self.layers.append(BoundLayer(i, kind, w))
                shape = (SLOTS, T_MAX, d.hkv_r, d.head_dim)
                self.kv[i] = (torch.zeros(shape, dtype=BF16), torch.zeros(shape, dtype=BF16))

    def slots(self, requests: torch.Tensor) -> dict[int, torch.Tensor]:
        """GDN layer -> its slots for these request slots (NULL stays NULL)."""
        return {i: t[requests.long()] for i, t in self.table.items()}

    def clone_caches(self):
        return (
            {x.index: (x.conv_state.clone(), x.ssm_state.clone()) for x in self.layers if x.is_gdn},
            {i: (k.clone(), v.clone()) for i, (k, v) in self.kv.items()},
        )

    def attend(self, requests, positions):
        d = self.dims

        def run(index, q, k, v):
            kc, vc = self.kv[index]
            ok = (requests >= 0) & (requests != NULL)
            out = torch.zeros(q.shape, dtype=q.dtype)
            if ok.any():
                idx, pos = requests[ok].long(), positions[ok].long()
                kc[idx, pos] = k[ok].reshape(-1, d.hkv_r, d.head_dim)
                vc[idx, pos] = v[ok].reshape(-1, d.hkv_r, d.head_dim)
                qh = q[ok].reshape(-1, d.hq_r, d.head_dim)
                out[ok] = decode_attention(qh, kc[idx], vc[idx], pos + 1).to(q.dtype)
            return out

        return run

    def step(self, driver, spec, emb, positions, requests):
        plan = spec.plan(StepView("decode", emb.shape[0]))
        inp = StepInputs(emb, positions, self.slots(requests))
        return driver.run(plan, inp, self.attend(requests, positions))


def _driver(eng: FakeEngine, widths=(1, 2, 3, 4), stock=None):
    spec = Qwen3NextSpec()
    assert not spec.accept_config(ConfigView(hf_config=eng.cfg))
    spec.deploy(
        Deployment(
            backend="reference",
            dtype="bfloat16",
            tp_size=1,
            widths=tuple(widths),
            layouts={"conv_layout": "time_chan", "ssm_layout": "vk", "qkvz_packing": eng.packing},
        )
    )
    builder = load_target("mono_ext.models.qwen3_next.reference.backend:build")
    assert isinstance(builder, LaunchBuilder)
    ctx = BuildContext(text_config=eng.cfg, null_slot=NULL)
    launches = {k.width: builder(k, ctx) for k in spec.build_keys()}
    assert all(isinstance(x, LayerLaunches) for x in launches.values())
    driver = DecodeDriver(
        eng.layers,
        launches,
        eng.dims,
        dtype=BF16,
        device="cpu",
        null_slot=NULL,
        numerics=spec.NUMERICS,
        stock=stock,
    )
    return driver, spec


def _oracle_step(eng, caches, hidden, positions, requests):
    gdn, kv = caches
    slots = eng.slots(requests)
    residual = None
    for layer in eng.layers:
        if layer.is_gdn:
            extra = dict(
                kind="gdn",
                slots=slots[layer.index],
                conv_state=gdn[layer.index][0],
                ssm_state=gdn[layer.index][1],
            )
        else:
            extra = dict(
                kind="attn", slots=requests, k_cache=kv[layer.index][0], v_cache=kv[layer.index][1]
            )
        out = decoder_layer_step(
            hidden,
            residual,
            dict(layer.weights),
            eng.dims,
            positions=positions,
            packing=eng.packing,
            null_slot=NULL,
            **extra,
        )
        hidden, residual = out.hidden_out, out.residual_out
    return hidden, residual


@pytest.mark.parametrize("preset", ["qwen3-next-tiny", "qwen3.5-moe-tiny"])
def test_driver_matches_reference_layer_loop(preset):
    eng = FakeEngine(preset)
    driver, spec = _driver(eng)
    oracle = eng.clone_caches()
    g = torch.Generator().manual_seed(1)
    requests = torch.tensor([3, 5, 7], dtype=torch.int32)
    for t in range(3):
        positions = torch.tensor([4 + t, 9 + t, 2 + t])
        emb = torch.randn(3, eng.dims.hidden, generator=g).to(BF16)
        h, r = eng.step(driver, spec, emb, positions, requests)
        h_ref, r_ref = _oracle_step(eng, oracle, emb, positions, requests)
        assert rel_l2(h.float(), h_ref) < TOL, t
        assert rel_l2(r.float(), r_ref) < TOL, t
    for layer in eng.layers:
        if layer.is_gdn:
            s = eng.slots(requests)[layer.index].long()
            conv_ref, ssm_ref = oracle[0][layer.index]
            assert rel_l2(layer.conv_state[s].float(), conv_ref[s]) < TOL
            assert rel_l2(layer.ssm_state[s], ssm_ref[s]) < TOL
    assert driver.steps == 3


def test_padding_rows_touch_no_state_and_leave_real_rows_alone():
    eng = FakeEngine("qwen3-next-tiny", seed=2)
    driver, spec = _driver(eng)
    before = eng.clone_caches()[0]
    emb = torch.randn(4, eng.dims.hidden, generator=torch.Generator().manual_seed(3)).to(BF16)
    requests = torch.tensor([4, NULL, 6, NULL], dtype=torch.int32)
    h, _ = eng.step(driver, spec, emb, torch.tensor([3, 0, 5, 0]), requests)
    h_real = h[[0, 2]].clone()
    for layer in eng.layers:
        if layer.is_gdn:
            owned = set(eng.slots(requests[[0, 2]])[layer.index].tolist())
            conv0, ssm0 = before[layer.index]
            for s in range(SLOTS):
                same = torch.equal(layer.conv_state[s], conv0[s]) and torch.equal(
                    layer.ssm_state[s], ssm0[s]
                )
                assert same == (s not in owned), (layer.index, s)

    # the same two requests alone (width 2) give the same rows: padding does not leak
    eng2 = FakeEngine("qwen3-next-tiny", seed=2)
    driver2, spec2 = _driver(eng2)
    h2, _ = eng2.step(driver2, spec2, emb[[0, 2]], torch.tensor([3, 5]), requests[[0, 2]])
    assert torch.equal(h_real, h2)


def test_a_width_without_launches_is_an_error():
    eng = FakeEngine("qwen3-next-tiny")
    driver, spec = _driver(eng, widths=(1, 2))
    spec.deployment = Deployment("reference", "bfloat16", 1, (1, 2, 3))  # plan says 3
    emb = torch.zeros(3, eng.dims.hidden, dtype=BF16)
    with pytest.raises(KeyError, match="no launches built for width 3"):
        eng.step(driver, spec, emb, torch.tensor([1, 1, 1]), torch.tensor([1, 2, 3]))


class ReferenceStock:
    """A stand-in for an engine's own layer code, built from the reference (bf16 outputs)."""

    def __init__(self, eng: FakeEngine, requests, scale_out_proj_of: int | None = None):
        self.eng = eng
        self.slots = eng.slots(requests)
        self.scale_of = scale_out_proj_of
        self._raw = None

    def _w(self, i):
        return dict(self.eng.layers[i].weights)

    def front_norm(self, i, hidden, residual):
        self._raw = (hidden, residual)
        x, r = add_gemma_rms_norm(
            hidden, residual, self._w(i)["input_layernorm"], self.eng.dims.eps
        )
        return x.to(BF16), r.to(BF16)

    def gdn_mixer(self, i, x):
        layer, w = self.eng.layers[i], self._w(i)
        f = gdn_front(*self._raw, w["input_layernorm"], w, self.eng.dims, layer.conv_state,
                      layer.ssm_state, self.slots[i], packing=self.eng.packing,
                      null_slot=NULL)  # fmt: skip
        return f.o_in.to(BF16)

    def attn_qkv(self, i, x, positions):
        w = self._w(i)
        f = attn_front(*self._raw, w["input_layernorm"], w, self.eng.dims, positions)
        b = x.shape[0]
        return tuple(t.reshape(b, -1).to(BF16) for t in (f.q, f.k, f.v, f.gate))

    def out_proj(self, i, o_in):
        w = self._w(i)["out_proj" if self.eng.layers[i].is_gdn else "o_proj"]
        y = o_in.float() @ w.float().t()
        return (y * (1.05 if i == self.scale_of else 1.0)).to(BF16)

    def tail(self, i, y, residual):
        w = self._w(i)
        r = residual.float() + y.float()
        x = gemma_rms_norm(r, w["post_attention_layernorm"], self.eng.dims.eps)
        out, *_ = moe_forward(x, w, self.eng.dims)
        return out.to(BF16), r.to(BF16)


def _run_checked(stock_scale_of, caplog):
    eng = FakeEngine("qwen3-next-tiny", seed=4)
    requests = torch.tensor([3, 5, 7], dtype=torch.int32)
    driver, spec = _driver(eng, stock=ReferenceStock(eng, requests, stock_scale_of))
    g = torch.Generator().manual_seed(5)
    with caplog.at_level(logging.WARNING, logger="mono_ext.decode"):
        for t in range(2):
            emb = torch.randn(3, eng.dims.hidden, generator=g).to(BF16)
            eng.step(driver, spec, emb, torch.tensor([1 + t, 2 + t, 3 + t]), requests)
    return driver.tracker


def test_check_mode_is_clean_against_an_exact_stand_in(caplog):
    tracker = _run_checked(None, caplog)
    # per step: 3 GDN layers x (k1 4 + k2 2) + 1 attention layer x (k1 5 + k2 2)
    assert tracker.checks == 2 * (3 * 6 + 7)
    assert tracker.problems() == [], tracker.problems()
    assert not [r for r in caplog.records if "mono_ext check" in r.getMessage()]


def test_check_mode_reports_breaches_with_layer_and_metric(caplog):
    tracker = _run_checked(1, caplog)
    problems = tracker.problems()
    assert problems and all(p.startswith("layer 1: k2.") for p in problems), problems
    logged = [r.getMessage() for r in caplog.records if "mono_ext check" in r.getMessage()]
    assert any("layer 1: k2.residual.rel_l2" in m for m in logged), logged
