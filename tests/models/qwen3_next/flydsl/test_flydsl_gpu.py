"""The flydsl backend's numerics on an MI355X (gfx950), against the fp32 reference: what
tests/kernels/test_k1.py and test_k2.py check for the Triton kernels (those skip on ROCm).

Model: the dry run's tiny FlyDSL-sized Qwen3-Next (``dry_model.config``: 3 GDN
layers, then attention; hidden 64, head_dim 64, 8 experts top-2, expert widths 64, fp32
recurrent states) with random bf16 planes scaled so activations and router logits are O(1),
vLLM's layouts and null slot 0, TP 1. ``FlyDSLBuilder`` builds every width 1..16 for GPU 0
(compiled, loaded, residency-checked) before the first step seals its build cache; no
served-width gate is involved. Every launch goes through the LayerLaunches interface with its
outputs poisoned (NaN) and is compared, on its own inputs, with ``mono_ext.models.qwen3_next.reference``
(``gdn_front``, ``attn_front``, ``layer_tail``) through a ``CheckTracker`` holding the spec's
NUMERICS (router near-tie rows skipped in ``k2.hidden``): K1 GDN (o_in, residual, the step's
conv/ssm states; padding rows give o_in 0 and every slot not in the step stays bit-untouched)
and K1 attention (q, k, v, gate, residual) and K2 GDN / gated attention (hidden, residual), at
every width with fresh inputs and states; K2 batch invariance (a row alone, in a batch and at
another position: bit-identical); two decode steps of every layer per width through
``DecodeDriver``, each launch checked as it runs. FailStop must release every step (a wait
that gave up raises) and the health block must be clean.

**Never run on gfx950 where it was written** (no AMD GPU there): the device tests skip unless
torch is a ROCm build and GPU 0 is a gfx950 (the Buildkite MI355X step,
``.buildkite/gpu_step.sh gfx950``). What ran is collection, the skip, and
``test_harness_self_check_on_cpu``, with the reference standing in for the kernels.
"""

import pytest
import torch

from mono_ext.core.numerics import CheckTracker
from mono_ext.core.spec import BuildContext, BuildKey, Step
from mono_ext.kernels.flydsl.limits import GFX950, MAX_WIDTH
from mono_ext.models.qwen3_next.dims import Dims
from mono_ext.models.qwen3_next.driver import DecodeDriver, StepInputs
from mono_ext.models.qwen3_next.flydsl.backend import FlyDSLBuilder  # imports no flydsl
from mono_ext.models.qwen3_next.launches import BoundLayer
from mono_ext.models.qwen3_next.reference import (
    attn_front,
    attn_out_input,
    decode_attention,
    gdn_front,
    layer_tail,
    valid_rows,
)
from mono_ext.models.qwen3_next.reference.backend import ReferenceBuilder
from mono_ext.models.qwen3_next.spec import Qwen3NextSpec
from mono_ext.runtime.health import decode_health
from tests.models.qwen3_next.flydsl.dry_model import config as _config

BF = torch.bfloat16
NUM = Qwen3NextSpec.NUMERICS
WIDTHS = tuple(range(1, MAX_WIDTH + 1))
SLOTS, NULL = 40, 0  # state slots per GDN layer (> 16 rows, so untouched ones exist); vLLM's null
GDN, ATTN = 0, 3  # layer indices of the tiny model's kinds
# planes not scaled by 1/sqrt(fan-in): norm weights (Gemma: 1 + w), the conv, dt_bias
SCALES = {"input_layernorm": 0.2, "post_attention_layernorm": 0.1, "q_norm": 0.2, "k_norm": 0.2,
          "conv1d": 0.5, "dt_bias": 0.5}  # fmt: skip


def _not_gfx950() -> str | None:
    """Why the device tests cannot run here (None: GPU 0 is a gfx950), as gpu_step.sh asks."""
    if not getattr(torch.version, "hip", None):
        return "needs an MI355X (gfx950): torch is not a ROCm build (torch.version.hip is None)"
    if not torch.cuda.is_available():
        return "needs an MI355X (gfx950): ROCm torch sees no GPU"
    arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    return None if arch == GFX950.arch else f"needs an MI355X (gfx950): GPU 0 is {arch}"


SKIP = _not_gfx950()


def on_gfx950(test):
    return pytest.mark.gpu(pytest.mark.skipif(SKIP is not None, reason=str(SKIP))(test))


# ----------------------------------------------------------------------------- the model


class Model:
    """The tiny model's layers on ``dev`` and fresh random inputs for it."""

    def __init__(self, dev, seed: int = 0):
        self.cfg = _config()
        self.d = Dims.from_config(self.cfg)
        self.dev = torch.device(dev)
        g = self.gen(seed)
        self.layers = [BoundLayer(i, kind, self.planes(kind, g), *self.states(kind, g))
                       for i, kind in enumerate(self.d.kinds)]  # fmt: skip

    def gen(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.dev).manual_seed(seed)

    def randn(self, g, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=self.dev)

    def planes(self, kind: str, g) -> dict:
        """Projections 1/sqrt(fan-in), router logits std ~3 (decisive: few near ties), decay A
        in [0.1, 4] (well-conditioned GDN heads: see tests/kernels/test_k1.py), fp32 A_log."""
        w = {}
        for name, shape in self.d.planes(kind).items():
            x = self.randn(g, *shape)
            scale = 3 * self.d.hidden**-0.5 if name == "router" else shape[-1] ** -0.5
            w[name] = (1 + 0.1 * x if name == "norm" else x * SCALES.get(name, scale)).to(BF)
        if "A_log" in w:
            a = torch.rand(self.d.hv_r, generator=g, device=self.dev) * 3.9 + 0.1
            w["A_log"] = torch.log(a)
        return w

    def states(self, kind: str, g) -> tuple:
        """A GDN layer's conv [S, K-1, C] bf16 and ssm [S, Hv, Dv, Dk] fp32 (vLLM's)."""
        if kind != "linear_attention":
            return ()
        d = self.d
        conv = self.randn(g, SLOTS, d.conv_k - 1, d.conv_dim_r).to(BF)
        return conv, 0.5 * self.randn(g, SLOTS, d.hv_r, d.dv, d.dk)

    def fresh_states(self, layer: BoundLayer, g) -> None:
        """New random states in place (the tensors the runtime's tables point at stay)."""
        for t, new in zip((layer.conv_state, layer.ssm_state), self.states(layer.kind, g),
                          strict=True):  # fmt: skip
            t.copy_(new)

    def rows(self, w: int, g, cols: int | None = None) -> torch.Tensor:
        return self.randn(g, w, cols or self.d.hidden).to(BF)

    def nan(self, w: int, cols: int | None = None) -> torch.Tensor:
        return torch.full((w, cols or self.d.hidden), float("nan"), dtype=BF, device=self.dev)

    def slots(self, w: int, g) -> torch.Tensor:
        """Distinct real slots (never the null slot); from width 2 one padding row."""
        s = (torch.randperm(SLOTS - 1, generator=g, device=self.dev)[:w] + 1).to(torch.int32)
        if w > 1:
            s[w // 2] = NULL
        return s

    def positions(self, w: int, g) -> torch.Tensor:
        top = self.cfg["max_position_embeddings"]  # the RoPE table's rows
        return torch.randint(0, top, (w,), generator=g, device=self.dev)

    def in_dim(self, layer: BoundLayer) -> int:
        d = self.d
        return d.hv_r * d.dv if layer.is_gdn else d.hq_r * d.head_dim


# ------------------------------------------------------------------ checks per launch


def check_k1_gdn(tracker, m, layer, hidden, residual, slots, *, before, where, o_in,
                 residual_out):  # fmt: skip
    """K1 GDN's outputs and the step's states against gdn_front from the states ``before``
    the launch; padding rows give o_in 0 and every slot not in the step is bit-untouched."""
    conv, ssm = (t.clone() for t in before)
    w = layer.weights
    ref = gdn_front(hidden, residual, w["input_layernorm"], w, m.d, conv, ssm, slots,
                    null_slot=NULL)  # fmt: skip
    ok = valid_rows(slots, NULL)
    idx = slots[ok].long()
    assert (o_in[~ok] == 0).all(), f"{where}: padding rows must give o_in = 0"
    for name, got, want in (("out", o_in[ok], ref.o_in[ok]),
                            ("residual", residual_out, ref.residual_out),
                            ("conv_state", layer.conv_state[idx], conv[idx]),
                            ("ssm_state", layer.ssm_state[idx], ssm[idx])):  # fmt: skip
        tracker.check("k1", name, got, want, where=where)
    keep = torch.ones(SLOTS, dtype=torch.bool, device=slots.device)
    keep[idx] = False
    for now, then in zip((layer.conv_state, layer.ssm_state), before, strict=True):
        assert torch.equal(now[keep], then[keep]), f"{where}: a state slot not in the step changed"


def check_k1_attn(tracker, m, layer, hidden, residual, positions, *, where, q, k, v, gate,
                  residual_out):  # fmt: skip
    w, rows = layer.weights, hidden.shape[0]
    ref = attn_front(hidden, residual, w["input_layernorm"], w, m.d, positions)
    outs = (q, k, v, gate, residual_out)  # AttnFrontOut's order
    for name, got, want in zip(("q", "k", "v", "gate", "residual"), outs, ref, strict=True):
        tracker.check("k1", name, got, want.reshape(rows, -1), where=where)


def check_k2(tracker, m, layer, o_in, residual, gate, *, where, hidden_out, residual_out):
    x = o_in if gate is None else attn_out_input(o_in, gate)  # the gated build's input
    ref = layer_tail(x, residual, layer.weights, m.d, kind="gdn" if layer.is_gdn else "attn")
    tracker.check("k2", "hidden", hidden_out, ref.hidden_out, skip_rows=ref.near_tie, where=where)
    tracker.check("k2", "residual", residual_out, ref.residual_out, where=where)


class Lockstep:
    """LayerLaunches that check every launch of ``inner`` as it runs: outputs poisoned first
    (the driver's buffers hold the last step's values), then the reference on the launch's
    own inputs through ``tracker``; ``where`` names the step in every breach."""

    def __init__(self, inner, m: Model, tracker: CheckTracker, where: str = ""):
        self.inner, self.m, self.tracker, self.where = inner, m, tracker, where

    def __getattr__(self, name):  # key, begin_step, end_step, release: the inner launches'
        return getattr(self.inner, name)

    def _run(self, launch, check, layer, *args, extra=None, **outs):
        for t in outs.values():
            t.fill_(float("nan"))
        getattr(self.inner, launch)(layer, *args, **outs)
        where = f"{self.where} layer {layer.index}"
        check(self.tracker, self.m, layer, *args, where=where, **(extra or {}), **outs)

    def k1_gdn(self, layer, *args, **outs):
        before = (layer.conv_state.clone(), layer.ssm_state.clone())
        self._run("k1_gdn", check_k1_gdn, layer, *args, extra={"before": before}, **outs)

    def k1_attn(self, layer, *args, **outs):
        self._run("k1_attn", check_k1_attn, layer, *args, **outs)

    def k2(self, layer, *args, **outs):
        self._run("k2", check_k2, layer, *args, **outs)


def run_step(launches, launch: str, *args, **outs) -> None:
    """One step of a single launch; FailStop must release it (a wait that gave up raises)."""
    launches.begin_step()
    getattr(launches, launch)(*args, **outs)
    launches.end_step()
    assert launches.release(), f"{launches.key.label()}: FailStop withheld the step"


def attend_own_token(d: Dims):
    """The engine's attention for a request's first token: q over the step's own k/v."""

    def attend(index, q, k, v):
        b, kv = q.shape[0], (q.shape[0], 1, d.hkv_r, d.head_dim)
        out = decode_attention(q.view(b, d.hq_r, d.head_dim), k.view(kv), v.view(kv))
        return out.to(q.dtype)

    return attend


def drive(m: Model, launches: dict, steps: int, seed: int) -> None:
    """``steps`` decode steps of every layer per width of ``launches`` (Lockstep ones)
    through DecodeDriver; every step's tokens must be released."""
    drv = DecodeDriver(m.layers, launches, m.d, dtype=BF, device=m.dev, null_slot=NULL,
                       numerics=NUM)  # fmt: skip
    g = m.gen(seed)
    for w, lock in sorted(launches.items()):
        for t in range(steps):
            lock.where = f"w{w} step {t}"
            slots = m.slots(w, g)  # every GDN layer: the same table
            inp = StepInputs(m.rows(w, g), m.positions(w, g),
                             {x.index: slots for x in m.layers if x.is_gdn})  # fmt: skip
            step = Step(w, lock.key)
            drv.run(step, inp, attend_own_token(m.d))
            assert drv.after_step(step, replayed=False)


def assert_clean(tracker: CheckTracker, launches: dict) -> None:
    rt = next(iter(launches.values())).runtime
    health = decode_health(rt.state.health.cpu().tolist(), rank=0)
    assert health.ok, health.describe(rt.failstop.name_of)
    print(f"\n{tracker.summary()}")
    assert tracker.checks and not tracker.problems(), tracker.problems()


# ------------------------------------------------------------------------ gfx950 tests


@pytest.fixture(scope="module")
def built():
    """The model on GPU 0 and its flydsl launches per width (all built before any step)."""
    m = Model("cuda:0")
    builder, ctx = FlyDSLBuilder(), BuildContext(m.cfg, device="cuda:0", null_slot=NULL)
    launches = {w: builder(BuildKey("qwen3_next", "flydsl", w, "bfloat16", 1), ctx)
                for w in WIDTHS}  # fmt: skip
    yield m, launches
    torch.cuda.synchronize()


@on_gfx950
def test_k1_gdn_front_every_width(built):
    m, launches = built
    layer, g, tracker = m.layers[GDN], m.gen(1), CheckTracker(NUM)
    for w in WIDTHS:
        m.fresh_states(layer, g)
        residual = None if w == 2 else m.rows(w, g)  # width 2: a first layer's front
        run_step(Lockstep(launches[w], m, tracker, f"w{w}"), "k1_gdn", layer, m.rows(w, g),
                 residual, m.slots(w, g), o_in=m.nan(w, m.in_dim(layer)),
                 residual_out=m.nan(w))  # fmt: skip
    assert_clean(tracker, launches)


@on_gfx950
def test_k1_attn_front_every_width(built):
    m, launches = built
    layer, g, tracker, d = m.layers[ATTN], m.gen(2), CheckTracker(NUM), m.d
    q_cols, kv_cols = d.hq_r * d.head_dim, d.hkv_r * d.head_dim
    for w in WIDTHS:
        residual = None if w == 2 else m.rows(w, g)
        run_step(Lockstep(launches[w], m, tracker, f"w{w}"), "k1_attn", layer, m.rows(w, g),
                 residual, m.positions(w, g), q=m.nan(w, q_cols), k=m.nan(w, kv_cols),
                 v=m.nan(w, kv_cols), gate=m.nan(w, q_cols), residual_out=m.nan(w))  # fmt: skip
    assert_clean(tracker, launches)


@on_gfx950
@pytest.mark.parametrize("index", [GDN, ATTN], ids=["gdn", "attn"])
def test_k2_tail_every_width(built, index):
    m, launches = built
    layer, g, tracker = m.layers[index], m.gen(3 + index), CheckTracker(NUM)
    cols = m.in_dim(layer)
    for w in WIDTHS:
        gate = None if layer.is_gdn else m.rows(w, g, cols)
        run_step(Lockstep(launches[w], m, tracker, f"w{w}"), "k2", layer, m.rows(w, g, cols),
                 m.rows(w, g), gate, hidden_out=m.nan(w), residual_out=m.nan(w))  # fmt: skip
    assert_clean(tracker, launches)


@on_gfx950
@pytest.mark.parametrize("index", [GDN, ATTN], ids=["gdn", "attn"])
def test_k2_batch_invariance(built, index):
    """A row's K2 outputs are bit-identical alone (the width-1 build), in the full batch and at
    another position of a width-5 batch (each width is its own build)."""
    m, launches = built
    layer, g = m.layers[index], m.gen(7)
    cols = m.in_dim(layer)
    o_all, r_all = m.rows(MAX_WIDTH, g, cols), m.rows(MAX_WIDTH, g)
    g_all = None if layer.is_gdn else m.rows(MAX_WIDTH, g, cols)

    def run(idx):
        h, r = m.nan(len(idx)), m.nan(len(idx))
        gate = None if g_all is None else g_all[idx]
        run_step(launches[len(idx)], "k2", layer, o_all[idx], r_all[idx], gate, hidden_out=h,
                 residual_out=r)  # fmt: skip
        return h, r

    full = run(list(range(MAX_WIDTH)))
    for idx in ([0], [5], [MAX_WIDTH - 1], [11, 3, 0, 7, 15]):
        got = run(idx)
        for j, i in enumerate(idx):
            same = all(torch.equal(a[j], b[i]) for a, b in zip(got, full, strict=True))
            assert same, f"row {i} at {j} of width {len(idx)} differs from width {MAX_WIDTH}"


@on_gfx950
def test_decode_steps_through_the_driver(built):
    """Two steps of every layer per width through DecodeDriver: the buffers chained from
    launch to launch, every layer's tables, the epoch; each launch checked as it runs."""
    m, launches = built
    tracker = CheckTracker(NUM)
    drive(m, {w: Lockstep(x, m, tracker) for w, x in launches.items()}, steps=2, seed=11)
    assert_clean(tracker, launches)


# ------------------------------------------------------------------- CPU (runs anywhere)


def test_harness_self_check_on_cpu():
    """No FlyDSL launch (none can run here): the reference backend stands in for the kernels.
    The harness finds it clean through DecodeDriver, and the checks catch an output element
    left unwritten and a write to a state slot that is not in the step."""
    m = Model("cpu", seed=5)
    ctx = BuildContext(m.cfg, null_slot=NULL)
    ref = {w: ReferenceBuilder()(BuildKey("qwen3_next", "reference", w, "bfloat16", 1), ctx)
           for w in (1, 3)}  # fmt: skip
    tracker = CheckTracker(NUM)
    drive(m, {w: Lockstep(x, m, tracker) for w, x in ref.items()}, steps=1, seed=3)
    # per step: 3 GDN layers x (k1 4 + k2 2), 1 attention layer x (k1 5 + k2 2)
    assert tracker.checks == 2 * (3 * 6 + 7) and not tracker.problems(), tracker.problems()

    w, layer, g = 3, m.layers[GDN], m.gen(4)
    o_in, res, h_out, r_out = m.rows(w, g, m.in_dim(layer)), m.rows(w, g), m.nan(w), m.nan(w)
    ref[w].k2(layer, o_in, res, None, hidden_out=h_out, residual_out=r_out)
    h_out[1, 5] = float("nan")  # poison the launch did not overwrite
    check_k2(tracker, m, layer, o_in, res, None, where="bad", hidden_out=h_out,
             residual_out=r_out)  # fmt: skip
    assert [p for p in tracker.problems() if p.startswith("bad: k2.hidden")], tracker.problems()

    hidden, slots, o_in = m.rows(w, g), m.slots(w, g), m.nan(w, m.in_dim(layer))
    before = (layer.conv_state.clone(), layer.ssm_state.clone())
    ref[w].k1_gdn(layer, hidden, None, slots, o_in=o_in, residual_out=r_out)
    tracker = CheckTracker(NUM)
    check_k1_gdn(tracker, m, layer, hidden, None, slots, before=before, where="ok", o_in=o_in,
                 residual_out=r_out)  # fmt: skip
    assert not tracker.problems(), tracker.problems()
    layer.ssm_state[NULL] += 1  # the null slot written
    with pytest.raises(AssertionError, match="not in the step changed"):
        check_k1_gdn(tracker, m, layer, hidden, None, slots, before=before, where="bad",
                     o_in=o_in, residual_out=r_out)  # fmt: skip
